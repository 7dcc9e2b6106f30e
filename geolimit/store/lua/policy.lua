-- geolimit policy prelude: prepended after common.lua to every script by
-- geolimit/store/scripts.py. Mirrors geolimit/core/policy.py: what a region
-- reserves for its peers (prediction, the split of freed room, partition
-- policies) and retry_after under prediction; keep the two in step (tests
-- compare them).

-- How many quanta of its own admissions a key keeps (geolimit.core.policy.QUANTA).
local QUANTA = 8

-- This region's own admissions of a key per quantum (field 'u' = 'q c1 c2 ... cK':
-- the newest quantum's number, its count, then those of the quanta before it;
-- geolimit.core.policy.Quanta). A quantum is partition_after / 16.
local function quantum(after)
  local q = (after - after % 16) / 16
  if q < 1 then q = 1 end
  return q
end

local function quanta(u)
  local cs, q = {}, nil
  if u then
    for x in string.gmatch(u, '%d+') do
      if q == nil then q = tonumber(x) else cs[#cs + 1] = tonumber(x) end
    end
  end
  return q, cs
end

-- Own admissions after t0 (those of the quantum t0 cuts assumed uniform over its
-- elapsed part; geolimit.core.policy.own_since).
local function own_since(q, cs, now, Q, t0)
  if q == nil then return 0 end
  local total = 0
  for j = 1, #cs do
    local lo = (q - j + 1) * Q
    local hi = lo + Q
    if hi > now then hi = now end
    if lo >= t0 then
      total = total + cs[j]
    elseif hi > t0 and hi > lo then
      total = total + cs[j] * (hi - t0) / (hi - lo)
    end
  end
  return total
end

-- Field 'u' after this region admits cost more at now (geolimit.core.policy.quanta_add).
local function quanta_add(q, cs, now, Q, cost)
  local qn = (now - fmod(now, Q)) / Q
  local out = {}
  if q ~= nil and q == qn then
    for j = 1, #cs do out[j] = cs[j] end
    out[1] = out[1] + cost
  else
    out[1] = cost
    if q ~= nil and q < qn then
      for j = 2, QUANTA do out[j] = cs[j - (qn - q)] or 0 end
    end
  end
  -- counts are at most a limit (2^46): concat writes them as integers
  return string.format('%d', qn) .. ' ' .. table.concat(out, ' ')
end

-- Approximate mode: how fast the oldest bucket's n units free room (units per µs, as
-- oldest_part() falls while it is below n; geolimit.core.policy.freeing).
local function freeing(n, first, res)
  if n <= 0 then return 0 end
  if first >= SUB then first = -1 end
  local span = res - (first + 1) * res / SUB
  if span <= 0 then return 0 end
  return (n + MARGIN * math.sqrt(n)) / span
end

-- Does a key hold counts (or rises, see load_window) of any slot but this region's current one?
local function has_remote(slots)
  return next(slots) ~= nil
end

-- What this region knows of its peers, for prediction and partition policies:
-- slot index -> region (from the registry), region -> time its counts were last
-- current, and the number of regions (written by the agent in the peers hash).
local function load_peers(reg, peers)
  local flat = call('HGETALL', reg)
  local owner = {}
  for i = 1, #flat, 2 do
    local id = flat[i]
    local cut = string.find(id, '/', 1, true)
    if cut then owner[tonumber(flat[i + 1])] = string.sub(id, 1, cut - 1) end
  end
  local p = call('HGETALL', peers)
  local known, regions = {}, 0
  for i = 1, #p, 2 do
    if p[i] == '#R' then regions = tonumber(p[i + 1]) else known[p[i]] = tonumber(p[i + 1]) end
  end
  return {owner, known, regions}
end

-- Mirrors geolimit.core.policy.reserve: units to reserve for peers, and whether
-- a partitioned peer closes the rule. slots: slot index -> count in the window;
-- rises: slot index -> {at, units, gap} (see load_window). Approximate mode:
-- win = {weighted count without reserve, plain total of the window, field 'u' as
-- quanta() reads it: q, cs, how fast the oldest bucket frees room (freeing()), how
-- fast the window took units lately (units per µs, geolimit.core.policy.intake)}
-- (the room is split by the regions' shares of the count; contested room, at most
-- what the window frees and takes in `after`, without a cap; see reserve()).
local function reservation(info, slots, rises, own_region, limit, now, predict, partition, after, win)
  local owner, known, regions = info[1], info[2], info[3]
  local counts, rates, lasts, newest = {}, {}, {}, {}
  for s, v in pairs(slots) do
    local r = owner[s]
    if r and r ~= own_region then counts[r] = (counts[r] or 0) + v end
  end
  local base, pool = 0, 0
  if win then
    -- the room and the count are split between the regions in contact: a partitioned
    -- peer's count is left out, and so is what policy share reserves for it
    local stalest, gone, away = nil, 0, 0
    for r, untl in pairs(known) do
      if r ~= own_region then
        if now - untl <= after then
          if stalest == nil or untl < stalest then stalest = untl end
        else
          gone = gone + (counts[r] or 0)
          if partition == 1 and regions > 0 and limit / regions > (counts[r] or 0) then
            away = away + (limit / regions - (counts[r] or 0))
          end
        end
      end
    end
    if stalest then
      local mine = own_since(win[3], win[4], now, quantum(after), stalest)
      base = limit - win[1] - away + mine
      -- shares of the count as it was then: taking its share does not grow this region's
      pool = win[2] - gone - mine
      if pool <= 0 then pool = win[2] end
    end
  end
  local split = base > 0 and win and win[2] > 0
  -- fresh: the oldest bucket freed all of the room within `after` (the window was full);
  -- contested: the room is gone within `after` at the rates it frees and is taken
  local fresh = split and base <= win[5] * after
  local contested = fresh or (split and base <= (win[5] + win[6]) * after)
  if predict then
    -- geolimit.core.policy.predicted_rate: a rise that arrived before the peer's
    -- counts were last current is over (the peer stopped on this key).
    for s, t in pairs(rises) do
      local r = owner[s]
      local untl = r and known[r]
      local rating = untl and r ~= own_region and t[1] >= untl
      local recent = split and untl and r ~= own_region and t[1] >= now - after
      if rating then rates[r] = (rates[r] or 0) + t[2] / t[3] end
      if recent then
        local l = lasts[r] or {0, nil}
        l[1] = l[1] + t[2] / t[3]
        if l[2] == nil or t[1] < l[2] then l[2] = t[1] end  -- the oldest: it leaves first
        lasts[r] = l
      end
      -- the newest rise still in play (rated or recent): the prediction may last until it leaves
      if (rating or recent) and (not newest[r] or t[1] > newest[r]) then newest[r] = t[1] end
    end
  end
  local units, closed, predicted, ends, falls = 0, false, 0, 0, nil
  local shared = 0
  for r, untl in pairs(known) do
    if r ~= own_region then
      local stale = now - untl
      if stale < 0 then stale = 0 end
      if stale > after then
        if partition == 2 then
          closed = true
        elseif partition == 1 and regions > 0 then
          local fair = limit / regions
          local have = counts[r] or 0
          if fair > have then units = units + (fair - have) end
        end
      elseif predict and stale > 0 then
        local rate = rates[r] or 0
        local held = rate * stale
        if contested and (fresh or lasts[r]) then
          -- its share, uncapped: a peer that rose lately, or any peer if the room is fresh
          held = (counts[r] or 0) / pool * base
          if held > 0 then falls = now end  -- it moves with the room, continuously
          shared = shared + held
        elseif split then
          local l = lasts[r]
          local part = (counts[r] or 0) / pool * base
          local cap = (l and l[1] or 0) * stale
          if part > cap then part = cap end
          if part > held then held = part end
          -- it shrinks when a rise leaves the last `after`
          if part > 0 and (not falls or l[2] + after + 1 < falls) then falls = l[2] + after + 1 end
        end
        units = units + held
        predicted = predicted + held
        -- Once its counts are older than `after`, a peer is no longer predicted for.
        if untl + after + 1 > ends then ends = untl + after + 1 end
        -- News may come before that: it ends the rate of rises merged before it only, and
        -- approximate mode counts a rise for `after` after its merge (see reserve() in policy.py).
        local t = newest[r]
        if t and t + after + 1 > ends then ends = t + after + 1 end
        -- ... so a reserve above 0 may first shrink then (it only grows before).
        if rate > 0 and (not falls or untl + after + 1 < falls) then falls = untl + after + 1 end
      end
    end
  end
  -- Together the shares leave at least one unit of the room (when there is one): else
  -- with every share below a unit nobody would take the last ones (at most R - 1 over).
  if shared > 0 and shared > base - 1 then
    local cut = shared - (base > 1 and base - 1 or 0)
    units, predicted = units - cut, predicted - cut
  end
  if partition ~= 0 then predicted, ends = 0, 0 end  -- the share/closed policy takes over afterwards: no cap
  return units, closed, predicted, ends, falls
end

-- retry_after when part of the reserve is predicted for peers (policy local):
-- with no new traffic that part is gone once the peers' counts are `after` old
-- (at `ends`), so a request is admitted by then or by when its window alone
-- admits it (`plain`), whichever is later; never later than `retry` itself.
local function predicted_retry(retry, sums, firsts, futs, N, now, cost, limit, res, approx, reserve, predicted, ends)
  if predicted <= 0 or retry <= 0 then return retry end
  local _, _, plain = evaluate(sums, firsts, futs, N, now, cost, limit, res, approx, false, reserve - predicted)
  local bound = ends - now
  if plain > bound then bound = plain end
  if bound < retry then return bound end
  return retry
end
