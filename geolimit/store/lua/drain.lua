-- drain: hand the replication agent this shard's changes since the last drain.
-- KEYS: registry, changed, peers
-- ARGV: now_us|'', region, nonce, candidate incarnation, lease_us, nrules, then per rule:
--   name, res_us, N, M; then regions, npeers, then per peer: name, age_us
-- Also renews the agent's lease (registry field 'a': apps record changes while it
-- lasts) and publishes peer freshness in the peers hash: peer -> time until which
-- its counts are current (now - age), '#R' -> number of regions.
-- Reply: {own_slot_id, registry, unknown, key, cells, key, cells, ...}
--   cells: flat bucket, slot_index, value, floor. A key changed by a reset comes
--   with every live cell of every slot and registry is then the registry's flat
--   HGETALL (else empty). unknown: keys of rules the agent does not know.
local now = clock(ARGV[1])
local reg, chg = KEYS[1], KEYS[2]
local own = ensure_registry(reg, ARGV[2], ARGV[3], ARGV[4])
call('HSET', reg, 'a', now + tonumber(ARGV[5]))
local rules = {}
local a = 7
for _ = 1, tonumber(ARGV[6]) do
  rules[ARGV[a]] = {tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])}
  a = a + 4
end
local fresh = {'#R', ARGV[a]}
for _ = 1, tonumber(ARGV[a + 1]) do
  fresh[#fresh + 1] = ARGV[a + 2]
  fresh[#fresh + 1] = now - tonumber(ARGV[a + 3])
  a = a + 2
end
call('HSET', KEYS[3], unpack(fresh))
local changed = call('HGETALL', chg)
local out = {ARGV[2] .. '/' .. own, {}, 0}
if #changed == 0 then return out end
call('DEL', chg)
local unknown = 0
for i = 1, #changed, 2 do
  local key, from = changed[i], tonumber(changed[i + 1])
  local close = string.find(key, '}', 1, true)
  local stop = string.find(key, ':', close + 2, true)
  local spec = stop and rules[string.sub(key, close + 2, stop - 1)]
  if not spec then
    unknown = unknown + 1
  else
    local res, N, M = spec[1], spec[2], spec[3]
    local c = bucket(now, res)
    local cells = {}
    if from < 0 then
      local flat = call('HGETALL', key)
      local h, vals, floors = nil, {}, {}
      for j = 1, #flat, 2 do
        local f = tonumber(flat[j])
        if not f then
          h = tonumber(flat[j + 1])
        elseif f < 0 then
          floors[-f - 1] = tonumber(flat[j + 1])
        else
          vals[f] = tonumber(flat[j + 1])
          floors[f] = floors[f] or 0
        end
      end
      if h then
        for f, fl in pairs(floors) do
          local b = h - (h - f % M) % M
          if b >= c - N and b > h - M then
            cells[#cells + 1] = b
            cells[#cells + 1] = (f - f % M) / M
            cells[#cells + 1] = vals[f] or 0
            cells[#cells + 1] = fl
          end
        end
        out[2] = call('HGETALL', reg)
      end
    else
      local lo = from
      if lo < c - N then lo = c - N end
      if lo <= c then
        local fields = {'h'}
        for b = lo, c do
          fields[#fields + 1] = b % M
          fields[#fields + 1] = -(b % M) - 1
        end
        local got = call('HMGET', key, unpack(fields))
        local h = tonumber(got[1])
        if h then
          for b = lo, c do
            local k = 2 * (b - lo) + 2
            if b <= h and b > h - M and (got[k] or got[k + 1]) then
              cells[#cells + 1] = b
              cells[#cells + 1] = 0
              cells[#cells + 1] = tonumber(got[k]) or 0
              cells[#cells + 1] = tonumber(got[k + 1]) or 0
            end
          end
        end
      end
    end
    if #cells > 0 then
      out[#out + 1] = key
      out[#out + 1] = cells
    end
  end
end
out[3] = unknown
return out
