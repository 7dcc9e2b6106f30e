-- Escrow prelude (after common.lua; for hit.lua and the escrow_* scripts): escrow
-- mode, mirroring geolimit.core.escrow (geolimit/replication/escrow_fields.py
-- reads and writes the same fields). Fields of an escrow rule's key:
--   t:<giver>:<receiver>:<limit>  units giver gave receiver under limit (replicated, max-merged)
--   a:<region>                    advert version:used:demand:bucket (replicated, newest wins)
--   s<pos>                        own step at ring position step % (n + 1): step:count:last_us
--   q                             units asked for: bucket:requested:requested in the bucket before
--   e                             expiry mark (see expiry_mark)
-- No numeric field names: the gossip scripts and anti-entropy never see them.

-- floor(a / b) and the remainder, exact for integers |a| < 2^53, 0 < b < 2^53.
local function floor_div(a, b)
  local r = fmod(a, b)
  if r < 0 then r = r + b end
  return (a - r) / b, r
end

-- The sum of integers below 2^53 in magnitude whose sum is too, exactly: adding
-- positives while the partial sum is not positive and negatives while it is keeps
-- every partial sum below 2^53, whatever the order (transfers are cumulative and
-- may each be near 2^53 while a region's net is small).
local function exact_sum(terms)
  local pos, neg = {}, {}
  for _, x in pairs(terms) do
    if x > 0 then pos[#pos + 1] = x elseif x < 0 then neg[#neg + 1] = x end
  end
  local s, i, j = 0, 1, 1
  while i <= #pos or j <= #neg do
    if j > #neg or (s <= 0 and i <= #pos) then s, i = s + pos[i], i + 1 else s, j = s + neg[j], j + 1 end
  end
  return s
end

-- The key's escrow fields, seen from region me: net[limit] = units received
-- minus units given under that limit (summed per peer first: received from q
-- less given to q, then exact_sum), adverts by region, own steps by ring
-- position, the requested-units field and the expiry mark.
local function escrow_load(key, me)
  local flat = call('HGETALL', key)
  local st = {net = {}, ads = {}, steps = {}, q = nil, e = nil, shared = 0}  -- shared: t: and a: fields
  local flows = {}  -- flows[limit][peer] = received from peer - given to peer (each exact)
  local match, sub = string.match, string.sub
  for i = 1, #flat, 2 do
    local f, v = flat[i], flat[i + 1]
    local c = sub(f, 1, 1)
    if c == 't' or c == 'a' then st.shared = st.shared + 1 end
    if c == 't' then
      local giver, to, lim = match(f, '^t:([^:]+):([^:]+):(%d+)$')
      local n = tonumber(v)
      lim = tonumber(lim)
      if giver and n and lim and lim > 0 and giver ~= to and (to == me or giver == me) then
        local by = flows[lim] or {}
        flows[lim] = by
        if to == me then by[giver] = (by[giver] or 0) + n else by[to] = (by[to] or 0) - n end
      end
    elseif c == 'a' then
      local region = match(f, '^a:(.+)$')
      local ver, used, demand, b = match(v, '^(%d+):(%d+):(%d+):(%d+)$')
      if region and ver then
        st.ads[region] = {tonumber(ver), tonumber(used), tonumber(demand), tonumber(b)}
      end
    elseif c == 's' then
      local pos = tonumber(sub(f, 2))
      local step, count, last = match(v, '^(%d+):(%d+):(%d+)$')
      if pos and step then st.steps[pos] = {tonumber(step), tonumber(count), tonumber(last)} end
    elseif f == 'q' then
      local b, q, qp = match(v, '^(%d+):(%d+):(%d+)$')
      if b then st.q = {tonumber(b), tonumber(q), tonumber(qp)} end
    elseif f == 'e' then
      st.e = tonumber(v)
    end
  end
  for lim, by in pairs(flows) do st.net[lim] = exact_sum(by) end
  return st
end

-- floor(sum over limits L' of net[L'] * limit / L'): what the transfers add to
-- (or take from) a region's share. Exact while the products fit in 2^53 (always,
-- for limits below 2^26); otherwise a unit lower than the truth, never higher.
local function escrow_net(net, limit)
  local whole, rests = 0, {}
  for lim, n in pairs(net) do
    if n ~= 0 then
      if lim == limit then
        whole = whole + n
      else
        local p = n * limit
        if p > -9007199254740992 and p < 9007199254740992 then
          local q, r = floor_div(p, lim)
          whole = whole + q
          if r > 0 then rests[#rests + 1] = {r, lim} end
        else
          whole = whole + math.floor(n * limit / lim) - 1
        end
      end
    end
  end
  if #rests > 1 then  -- the remainders r / L' may add up to whole units
    local d = 1
    for _, x in ipairs(rests) do d = d * x[2] end
    if d < 2^50 / #rests then
      local num = 0
      for _, x in ipairs(rests) do num = num + x[1] * (d / x[2]) end
      whole = whole + floor_div(num, d)
    else
      local sum = 0
      for _, x in ipairs(rests) do sum = sum + x[1] / x[2] end
      local extra = math.floor(sum - 1e-9)
      if extra > 0 then whole = whole + extra end
    end
  end
  return whole
end

-- Whether an own step still counts in the window [now - W, now] (Ledger.counts):
-- every step from cur - n + 1 on, and step cur - n while its last admission is in it.
local function escrow_counts(s, cur, n, now, window)
  return s[1] > cur - n or (s[1] == cur - n and s[3] >= now - window)
end

-- Own admissions that may still lie in the window ending at now.
local function escrow_used(steps, cur, n, now, window)
  local used = 0
  for _, s in pairs(steps) do
    if escrow_counts(s, cur, n, now, window) then used = used + s[2] end
  end
  return used
end

-- Units per window asked for over the current and the previous bucket (Ledger.demand).
local function escrow_demand(q, now, res, window)
  local b = bucket(now, res)
  local asked = 0
  if q then
    if q[1] == b then asked = q[2] + q[3] elseif q[1] == b - 1 then asked = q[2] end
  end
  local span = now - (b - 1) * res
  if span < 1 then span = 1 end
  return ceil(asked * window / span)
end

-- Rights the other regions hold spare, as this region sees them: the limit less
-- its own rights less the others' advertised use (adverts of the last N buckets).
local function escrow_spare_elsewhere(ads, me, limit, rights, cur_bucket, N)
  local spare = limit - rights
  for region, ad in pairs(ads) do
    if region ~= me and ad[1] > 0 and cur_bucket - ad[4] <= N then spare = spare - ad[2] end
  end
  return spare
end

-- retry_after of a denied escrow request (core.escrow._retry_us): when enough of
-- the own steps leave the window, or wait (rights from peers) if sooner; -1: never.
local function escrow_retry(steps, cur, n, step_us, now, window, rights, cost, limit, wait)
  if cost > limit then return -1 end
  local best = wait
  local live, remaining = {}, 0
  for _, s in pairs(steps) do
    if escrow_counts(s, cur, n, now, window) then
      live[#live + 1] = s
      remaining = remaining + s[2]
    end
  end
  table.sort(live, function(x, y) return x[1] < y[1] end)
  for _, s in ipairs(live) do
    remaining = remaining - s[2]
    if s[2] > 0 and remaining + cost <= rights then
      local at = s[3] + window + 1
      local edge = (s[1] + n) * step_us
      if edge > at then at = edge end
      at = at - now
      if best == nil or at < best then best = at end
      break
    end
  end
  if best == nil then return window end
  if best < 1 then return 1 end
  return best
end

-- Arm or hold the key's expiry after an escrow write. A region may forget its
-- escrow state only if it then holds no more than it truly does: its transfers in
-- must be at least its transfers out (then forgetting leaves it its share). A
-- region that gave more than it received keeps the key (no TTL) until rights
-- come back; its own steps are gone from the window long before the TTL ends.
local function escrow_expiry(key, st, limit, ttl)
  if escrow_net(st.net, limit) >= 0 then
    local mark = expiry_mark(st.e, ttl)
    if mark then
      call('HSET', key, 'e', string.format('%d', mark))
      arm_expiry(key, mark)
    end
  elseif st.e ~= 0 then
    call('PERSIST', key)
    call('HSET', key, 'e', '0')
  end
end
