-- escrow_merge: merge a peer's escrow fields into this region's keys of one shard:
-- transfers t:<giver>:<receiver>:<limit> by max, adverts a:<region> by the newer
-- (version, used, demand, bucket). geolimit/replication/escrow_fields.py has vetted
-- every name and value; they are checked again here, before anything is written,
-- and a bad one fails the whole call.
-- KEYS: registry, then the data keys.
-- ARGV: now_us|'', me, nonce, then per data key: limit, ttl_ms, nfields, then
--   nfields name, value pairs.
-- Returns per data key the number of fields that changed.
local function fmt(x) return string.format('%d', x) end
local match = string.match
local now = clock(ARGV[1])
local reg, me, nonce = KEYS[1], ARGV[2], ARGV[3]
local function digits(v, max_len)
  return #v <= max_len and match(v, '^%d+$') ~= nil and tonumber(v) < 9007199254740992
end
-- check everything first
local a = 4
for j = 2, #KEYS do
  local nf = tonumber(ARGV[a + 2])
  for i = a + 3, a + 2 + 2 * nf, 2 do
    local f, v = ARGV[i], ARGV[i + 1]
    if match(f, '^t:[^:]+:[^:]+:%d+$') then
      if not digits(v, 16) then return redis.error_reply('escrow: bad transfer value') end
    elseif match(f, '^a:[^:]+$') then
      local x, y, z, w = match(v, '^(%d+):(%d+):(%d+):(%d+)$')
      if not (x and digits(x, 16) and digits(y, 16) and digits(z, 16) and digits(w, 16)) then
        return redis.error_reply('escrow: bad advert value')
      end
    else
      return redis.error_reply('escrow: bad field name')
    end
  end
  a = a + 3 + 2 * nf
end
local track = nil
local out = {}
a = 4
for j = 2, #KEYS do
  local key = KEYS[j]
  local limit, ttl, nf = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local changed = 0
  for i = a + 3, a + 2 + 2 * nf, 2 do
    local f, v = ARGV[i], ARGV[i + 1]
    local old = call('HGET', key, f)
    local newer
    if string.sub(f, 1, 1) == 't' then
      newer = not old or tonumber(v) > tonumber(old)
    else
      newer = not old
      if old then
        local n1 = {match(v, '^(%d+):(%d+):(%d+):(%d+)$')}
        local o1 = {match(old, '^(%d+):(%d+):(%d+):(%d+)$')}
        if #o1 < 4 then newer = true else
          for x = 1, 4 do
            local p, q = tonumber(n1[x]), tonumber(o1[x])
            if p ~= q then newer = p > q break end
          end
        end
      end
    end
    if newer then
      call('HSET', key, f, v)
      changed = changed + 1
    end
  end
  if changed > 0 then
    escrow_expiry(key, escrow_load(key, me), limit, ttl)
    if track == nil then track = tracking(reg, me, nonce, now) end
    if track then call('HSET', string.sub(reg, 1, -2) .. 'e', key, '1') end
  end
  out[#out + 1] = changed
  a = a + 3 + 2 * nf
end
return out
