-- ae_scan: one bounded page of an anti-entropy pass over this node's data keys.
-- KEYS: any key of this node (routing only)
-- ARGV: mode ('s' shard digests | 'd' digests | 'l' list), now_us, match
--   pattern, prefix length, leaves per shard L, shards, max keys, max fields,
--   big key fields, bitmap (bit g of byte g // 8, lowest bit first; 'l': of
--   the leaves to list; 'd': of the shards to digest, empty for all), max
--   microseconds, rules (n, then
--   per rule: name, res_us, N, M, F), registries: the usual one (nslots, then
--   per slot: index, code1, code2), then the shards whose registry differs (n,
--   then per shard: shard, nslots, then per slot: index, code1, code2), then
--   part, parts, cursor (last, so the caller can encode the rest once)
-- Parts: SCAN visits buckets in increasing bit-reversed cursor order whatever
-- the table's size, so the lowest log2(parts) bits of a cursor, reversed, say
-- which part of the iteration it is in. Part p starts at cursor reverse(p) and
-- ends where part p + 1 starts (the last part: when the cursor wraps to 0);
-- the script returns cursor 0 at the end of its part. Parts > 1 only for
-- tables of at least `parts` buckets.
-- Visits keys with SCAN (whole batches, COUNT 32) until it has read max keys,
-- or max fields, or visited 4 x max keys, or run for max microseconds. Keys of
-- unknown rules or shards are skipped; keys with more than big-key fields are
-- not read but returned in `big`, for ae_key.lua.
-- Reply: {cursor (0: this part is done), keys visited, out, big, microseconds,
--   shards}
--   'd': out = {leaf, digest, ...} (global leaf = shard * L + leaf), shards =
--        {shard, sum of its keys' digests mod 2^52, keys, ...} (big keys not in)
--   's': out = {}, shards as for 'd' (a pass that only compares shards: the
--        per-key leaves cost the caller more than the rest of the page)
--   'l': out = {shard, rule:subject, digest, ...} for keys in the bitmap's leaves,
--        shards = {}
--   big = {key, leaf, ...}. Keys without a live non-zero cell are left out.
local t0 = call('TIME')
local mode, now = ARGV[1], tonumber(ARGV[2])
local pattern, plen = ARGV[3], tonumber(ARGV[4])
local L, want, budget, big_fields = tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local bitmap, max_us = ARGV[10], tonumber(ARGV[11])
local cursor = ARGV[#ARGV]
local listing, leafless = mode == 'l', mode == 's'
local scope = mode == 'd' and #bitmap > 0 and bitmap or nil
local rules, a = read_rules(12, now)
local function elapsed()
  local t = call('TIME')
  return (t[1] - t0[1]) * 1000000 + (t[2] - t0[2])
end
local default, ndefault
default, a, ndefault = read_codes(a)
local regs, nslots = {}, {}
local nregs = tonumber(ARGV[a])
a = a + 1
for _ = 1, nregs do
  local shard = tonumber(ARGV[a])
  regs[shard], a, nslots[shard] = read_codes(a + 1)
end
local shards = tonumber(ARGV[6])
local band, lshift, byte, pcall = bit.band, bit.lshift, string.byte, redis.pcall
local out, big, shardnums, shard_sum, shard_keys = {}, {}, {}, {}, {}
local seen, visited, fields = 0, 0, 0
local start = plen + 3
local function process(batch)
  visited = visited + #batch
  for i = 1, #batch do
    local key = batch[i]
    local close = find(key, '}', start, true)
    if close and byte(key, close + 1) == 58 then
      local tag = sub(key, start, close - 1)
      local shard = shardnums[tag]
      if shard == nil then  -- a shard is written in plain decimal: '{017}' is no shard
        shard = tonumber(tag)
        if not shard or shard % 1 ~= 0 or string.format('%d', shard) ~= tag then shard = false end
        shardnums[tag] = shard
      end
      local codes = shard and shard >= 0 and shard < shards and (regs[shard] or default)
      if codes and scope and band(byte(scope, (shard - shard % 8) / 8 + 1) or 0, lshift(1, shard % 8)) == 0 then
        codes = nil
      end
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
          if 2 * rule[3] * (nslots[shard] or ndefault) >= big_fields then
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
                if not leafless then out[#out + 1] = g end
                local sum = (shard_sum[shard] or 0) + w
                if sum >= W52 then sum = sum - W52 end
                shard_sum[shard] = sum
                shard_keys[shard] = (shard_keys[shard] or 0) + 1
              end
              if not leafless then out[#out + 1] = w end
            end
          end
        end
      end
    end
  end
end

-- This stream's part of the SCAN (see the header).
local part, parts = tonumber(ARGV[#ARGV - 2]), tonumber(ARGV[#ARGV - 1])
local bits = 0
while 2 ^ bits < parts do bits = bits + 1 end
local function part_of(cur)
  local low, r = cur % parts, 0
  for _ = 1, bits do
    r = r * 2 + low % 2
    low = (low - low % 2) / 2
  end
  return r
end
local last = part == parts - 1
local boundary = -1
if not last then
  local low, r = part + 1, 0
  for _ = 1, bits do
    r = r * 2 + low % 2
    low = (low - low % 2) / 2
  end
  boundary = r
end
-- May a batch that ended at cursor nxt be kept whole (all its buckets ours)?
local function inside(nxt)
  return last or (nxt ~= 0 and part_of(nxt) == part)
end

repeat
  local r = call('SCAN', cursor, 'MATCH', pattern, 'COUNT', 32)
  if inside(tonumber(r[1])) then
    process(r[2])
    cursor = r[1]
  else
    -- That batch may hold keys of the next part: redo the end of ours with
    -- COUNT 1, which returns the keys of one bucket (after empty ones).
    while true do
      r = call('SCAN', cursor, 'MATCH', pattern, 'COUNT', 1)
      local nxt = tonumber(r[1])
      if inside(nxt) then
        process(r[2])
        cursor = r[1]
      else
        if nxt == boundary then process(r[2]) end
        cursor = '0'
        break
      end
    end
  end
  local spent = elapsed()
until cursor == '0' or seen >= want or fields >= budget or visited >= 4 * want or spent >= max_us
local shard_out = {}
for shard, sum in pairs(shard_sum) do
  shard_out[#shard_out + 1] = shard
  shard_out[#shard_out + 1] = sum
  shard_out[#shard_out + 1] = shard_keys[shard]
end
return {cursor, visited, out, big, elapsed(), shard_out}
