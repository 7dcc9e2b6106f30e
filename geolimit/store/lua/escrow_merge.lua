-- escrow_merge: merge a peer's escrow fields into this region's keys of one shard:
-- transfers t:<giver>:<receiver>:<limit> by max, adverts a:<region> by the newer
-- (version, used, demand, bucket). geolimit/replication/escrow_fields.py has vetted
-- every name and value; they are checked again here, before anything is written,
-- and a bad one fails the whole call. So is a key that would hold more replicated
-- fields than one message may carry (MAX_FIELDS: escrow_fields.MAX_FIELDS_PER_KEY):
-- its pushes would be refused by every peer, and every decision reads them all.
-- KEYS: registry, then the data keys.
-- ARGV: now_us|'', me, nonce, apply ('0': check only, nothing is written; '1':
--   check, then write), ahead_ms, how ('push': a peer's push; 'pull': a page this
--   region pulled, the repair path), then per data key: limit, ttl_ms, this
--   region's share of the limit, nfields, then nfields name, value pairs.
-- An advert's version is at least its region's clock in ms when it was made
-- (escrow_give.lua): one more than ahead_ms past this clock is refused (a forged
-- version at the top of the range froze that region's adverts of the key for good).
-- This region's own transfers t:<me>:...: only this region writes them (they are
-- what it gave away). A push claiming more than this Redis holds is refused; a
-- pulled page's are merged and counted: after a wipe, lost writes or the key's
-- expiry here, peers hold them legitimately, and a region that forgot a gift would
-- spend it again (they can only lower its rights). A key whose transfers to and from
-- this region would, merged, give it rights above the limit is refused when the
-- message raises one of its gifts in: no honest history does that.
-- Returns per data key the number of fields that changed, then the number of own
-- transfers raised (all 0 when checking only).
local function fmt(x) return string.format('%d', x) end
local MAX_FIELDS = 1024
local match, sub = string.match, string.sub
local now = clock(ARGV[1])
local reg, me, nonce, apply = KEYS[1], ARGV[2], ARGV[3], ARGV[4] ~= '0'
local newest = math.floor(now / 1000) + tonumber(ARGV[5])  -- the largest advert version accepted
local repair = ARGV[6] == 'pull'
local own = 't:' .. me .. ':'
local function digits(v, max_len)
  return #v <= max_len and match(v, '^%d+$') ~= nil and tonumber(v) < 9007199254740992
end
-- escrow_load's net of transfers name -> value: per limit, received less given (exact).
local function net_of(transfers)
  local flows = {}
  for f, n in pairs(transfers) do
    local giver, to, lim = match(f, '^t:([^:]+):([^:]+):(%d+)$')
    lim = tonumber(lim)
    if giver and lim and lim > 0 and giver ~= to and (to == me or giver == me) then
      local by = flows[lim] or {}
      flows[lim] = by
      if to == me then by[giver] = (by[giver] or 0) + n else by[to] = (by[to] or 0) - n end
    end
  end
  local net = {}
  for lim, by in pairs(flows) do net[lim] = exact_sum(by) end
  return net
end
-- check everything first
local a = 7
for j = 2, #KEYS do
  local limit, share, nf = tonumber(ARGV[a]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local flat = call('HGETALL', KEYS[j])
  local have, merged, held, gained = {}, {}, 0, false
  for i = 1, #flat, 2 do
    local f = flat[i]
    local c = sub(f, 1, 2)
    if c == 't:' or c == 'a:' then
      held = held + 1
      have[f] = flat[i + 1]
      if c == 't:' then merged[f] = tonumber(flat[i + 1]) end
    end
  end
  for i = a + 4, a + 3 + 2 * nf, 2 do
    local f, v = ARGV[i], ARGV[i + 1]
    local old = have[f]
    if not old then held = held + 1 end
    if match(f, '^t:[^:]+:[^:]+:%d+$') then
      if not digits(v, 16) then return redis.error_reply('escrow: bad transfer value') end
      local n, o = tonumber(v), tonumber(old or '0') or 0
      if n > o then
        if sub(f, 1, #own) == own then
          if not repair then
            return redis.error_reply('escrow: ' .. f .. ' = ' .. v .. ' claims that ' .. me .. ' gave more than it '
              .. 'recorded (' .. fmt(o) .. '): only ' .. me .. ' writes its own transfers')
          end
        elseif match(f, '^t:[^:]+:([^:]+):') == me then
          gained = true
        end
        merged[f] = n
      end
    elseif match(f, '^a:[^:]+$') then
      local x, y, z, w = match(v, '^(%d+):(%d+):(%d+):(%d+)$')
      if not (x and digits(x, 16) and digits(y, 16) and digits(z, 16) and digits(w, 16)) then
        return redis.error_reply('escrow: bad advert value')
      end
      if tonumber(x) > newest then
        return redis.error_reply('escrow: advert ' .. f .. ' has version ' .. x .. ', ahead of this region\'s clock (ms) by more than the auth window')
      end
    else
      return redis.error_reply('escrow: bad field name')
    end
  end
  if held > MAX_FIELDS then
    return redis.error_reply('escrow: a key would hold more than ' .. MAX_FIELDS .. ' transfers and adverts')
  end
  if gained then
    local rights = share + escrow_net(net_of(merged), limit)
    if rights > limit then
      return redis.error_reply('escrow: the transfers would give ' .. me .. ' rights of ' .. fmt(rights)
        .. ', over the limit ' .. fmt(limit) .. ': some of them were never made')
    end
  end
  a = a + 4 + 2 * nf
end
local out = {}
if not apply then
  for j = 1, #KEYS do out[#out + 1] = 0 end  -- (the last one: own transfers raised)
  return out
end
local track, raised = nil, 0
a = 7
for j = 2, #KEYS do
  local key = KEYS[j]
  local limit, ttl, nf = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
  local changed = 0
  for i = a + 4, a + 3 + 2 * nf, 2 do
    local f, v = ARGV[i], ARGV[i + 1]
    local old = call('HGET', key, f)
    local newer
    if sub(f, 1, 1) == 't' then
      newer = not old or tonumber(v) > tonumber(old)
      if newer and sub(f, 1, #own) == own then raised = raised + 1 end
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
    if track then call('HSET', sub(reg, 1, -2) .. 'e', key, '1') end
  end
  out[#out + 1] = changed
  a = a + 4 + 2 * nf
end
out[#out + 1] = raised
return out
