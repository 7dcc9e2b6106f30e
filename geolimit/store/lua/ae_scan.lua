-- ae_scan: one bounded page of an anti-entropy pass over this node's data keys.
-- KEYS: any key of this node (routing only)
-- ARGV: mode ('d' digests | 'l' list), now_us, match pattern, prefix length,
--   leaves per shard L, shards, max keys, max fields, big key fields, leaf
--   bitmap ('l' only: bit g of byte g // 8, lowest bit first), rules (n, then
--   per rule: name, res_us, N, M, F), registries (n, then per shard: shard,
--   nslots, then per slot: index, code1, code2), cursor (last, so the caller
--   can encode the rest once)
-- Visits keys with SCAN (whole batches, COUNT 32) until it has read max keys,
-- or max fields, or visited 4 x max keys. Keys of unknown rules or shards are skipped; keys with
-- more than big-key fields are not read but returned in `big`, for ae_key.lua.
-- Reply: {cursor, keys visited, out, big}
--   'd': out = {leaf, digest, ...} (global leaf = shard * L + leaf)
--   'l': out = {shard, rule:subject, digest, ...} for keys in the bitmap's leaves
--   big = {key, leaf, ...}. Keys without a live non-zero cell are left out.
local mode, now = ARGV[1], tonumber(ARGV[2])
local pattern, plen = ARGV[3], tonumber(ARGV[4])
local L, want, budget, big_fields = tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local bitmap = ARGV[10]
local cursor = ARGV[#ARGV]
local listing = mode == 'l'
local rules, a = read_rules(11, now)
local regs, nslots = {}, {}
local nregs = tonumber(ARGV[a])
a = a + 1
for _ = 1, nregs do
  local shard = tonumber(ARGV[a])
  regs[shard], a, nslots[shard] = read_codes(a + 1)
end
local band, lshift, byte, pcall = bit.band, bit.lshift, string.byte, redis.pcall
local out, big, shardnums = {}, {}, {}
local seen, visited, fields = 0, 0, 0
local start = plen + 3
repeat
  local r = call('SCAN', cursor, 'MATCH', pattern, 'COUNT', 32)
  cursor = r[1]
  local batch = r[2]
  visited = visited + #batch
  for i = 1, #batch do
    local key = batch[i]
    local close = find(key, '}', start, true)
    if close and byte(key, close + 1) == 58 then
      local tag = sub(key, start, close - 1)
      local shard = shardnums[tag]
      if shard == nil then
        shard = tonumber(tag) or false
        shardnums[tag] = shard
      end
      local codes = shard and regs[shard]
      local stop = find(key, ':', close + 2, true)
      local rule = stop and rules[sub(key, close + 2, stop - 1)]
      if codes and rule then
        local suffix = sub(key, close + 2)
        local leaf, k1, k2 = seed(suffix, L)
        local g = shard * L + leaf
        if not listing or band(byte(bitmap, (g - g % 8) / 8 + 1), lshift(1, g % 8)) ~= 0 then
          seen = seen + 1
          -- Only a key that could be big costs an HLEN: one whose rule and
          -- registry allow more fields than big-key fields.
          local len = 0
          if 2 * rule[3] * nslots[shard] >= big_fields then
            len = pcall('HLEN', key)
            if type(len) ~= 'number' then len = 0 end
          end
          if len > big_fields then
            big[#big + 1] = key
            big[#big + 1] = g
          else
            local flat = pcall('HGETALL', key)  -- not a hash: an error reply, skipped
            fields = fields + #flat / 2
            local s1, s2, n = 0, 0, 0
            if not flat.err then s1, s2, n = key_sums(flat, rule, codes) end
            if n > 0 then
              local w = key_digest(k1, k2, s1, s2)
              if listing then
                out[#out + 1] = shard
                out[#out + 1] = suffix
              else
                out[#out + 1] = g
              end
              out[#out + 1] = w
            end
          end
        end
      end
    end
  end
until cursor == '0' or seen >= want or fields >= budget or visited >= 4 * want
return {cursor, visited, out, big}
