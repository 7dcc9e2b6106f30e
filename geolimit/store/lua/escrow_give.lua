-- escrow_give: this region's part of one rebalancing round for one escrow key:
-- write its advert (own use and demand, if they changed) and raise its own
-- transfers t:<me>:<receiver>:<limit> by the planned amounts, each capped by the
-- spare (rights less own use) as Redis holds it now: apps may have admitted since
-- the plan was made. No replicated value goes past 2^53 - 1, which peers refuse
-- (escrow_fields.MAX_VALUE) with every key pushed beside it: a transfer at the top
-- gives no more, an advert whose version is at the top is left as it is, and the
-- advertised demand is capped. Nor does a key get more transfers and adverts than a
-- message may carry: a gift or advert that would add one past MAX_FIELDS is not made.
-- KEYS: registry, data key.
-- ARGV: now_us|'', me, limit, share, steps per bucket, N, res_us, ttl_ms, then
--   receiver, amount pairs.
-- Returns {0} while the shard's escrow state is held (nothing written), else
-- {1 if anything changed else 0 + 1, given, rights, then the key's replicated
-- fields t:... and a:... as name, value pairs}: status 1 unchanged, 2 changed.
local function fmt(x) return string.format('%d', x) end
local TOP = 9007199254740991  -- 2^53 - 1
local MAX_FIELDS = 1024  -- transfers and adverts a key may hold (escrow_fields.MAX_FIELDS_PER_KEY)
local now = clock(ARGV[1])
local reg, key, me = KEYS[1], KEYS[2], ARGV[2]
if not call('HGET', reg, 'xo') then return {0} end
local limit, share, k = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local N, res, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local window, step_us, n = N * res, res / k, N * k
local st = escrow_load(key, me)
local cur = bucket(now, step_us)
local used = escrow_used(st.steps, cur, n, now, window)
local spare = share + escrow_net(st.net, limit) - used
local changed, given = false, 0
for i = 9, #ARGV - 1, 2 do
  local amount = tonumber(ARGV[i + 1])
  if amount > spare then amount = spare end
  local field = 't:' .. me .. ':' .. ARGV[i] .. ':' .. fmt(limit)
  local held = call('HGET', key, field)
  local room = TOP - (tonumber(held) or 0)
  if amount > room then amount = room end
  if not held and st.shared >= MAX_FIELDS then amount = 0 end
  if amount > 0 then
    if not held then st.shared = st.shared + 1 end
    call('HINCRBY', key, field, fmt(amount))
    st.net[limit] = (st.net[limit] or 0) - amount
    spare = spare - amount
    given = given + amount
    changed = true
  end
end
local demand = escrow_demand(st.q, now, res, window)
if demand > TOP then demand = TOP end  -- denied requests count too: any cost, any number of them
local b = bucket(now, res)
local ad = st.ads[me]
if (ad and ad[1] < TOP or not ad and st.shared < MAX_FIELDS) and (not ad or ad[2] ~= used or ad[3] ~= demand or (ad[4] ~= b and (used > 0 or demand > 0 or ad[2] > 0 or ad[3] > 0))) then
  -- one above the last, and at least this clock's milliseconds: a version a peer forged
  -- ahead (escrow_merge.lua bounds it by the clock) is passed within the auth window
  local version = math.max(ad and ad[1] + 1 or 1, math.floor(now / 1000))
  call('HSET', key, 'a:' .. me, fmt(version) .. ':' .. fmt(used) .. ':' .. fmt(demand) .. ':' .. fmt(b))
  changed = true
end
if changed or st.e == nil then escrow_expiry(key, st, limit, ttl) end
local rights = share + escrow_net(st.net, limit)
local out = {changed and 2 or 1, given, rights}
if changed then
  local flat = call('HGETALL', key)
  for i = 1, #flat, 2 do
    local c = string.sub(flat[i], 1, 2)
    if c == 't:' or c == 'a:' then
      out[#out + 1] = flat[i]
      out[#out + 1] = flat[i + 1]
    end
  end
end
return out
