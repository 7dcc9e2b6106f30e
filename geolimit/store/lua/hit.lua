-- hit: decide a batch of requests atomically; each request is all-or-nothing
-- over its rules and consumes nothing unless every rule allows it.
-- KEYS per request: registry, changed, peers, then one data key per rule.
-- ARGV: now_us|'', region, nonce, nreq, then per request:
--   consume (1|0), cost, nrules, then per rule: limit, res_us, N, M, ttl_ms,
--   approx (1|0), predict (1|0), partition (0 local|1 share|2 closed), partition_after_us,
--   escrow ('' for a gossip-mode rule, else 'share steps wait_us': this region's share of
--   the limit, -1 while the regions are unknown; own steps per bucket; how soon rights
--   from peers can arrive)
-- Returns per request: allowed, then per rule: allowed, used, retry_us, reset_us, stable_us
-- (a time during which limit - used cannot grow with no new traffic and no news from peers).
-- allowed is 1 or 0, or for an escrow rule denied before its count was looked at:
-- -1 (the regions are not known yet), -2 (this shard's escrow state is being restored).
-- Every number written to Redis goes through fmt: a Lua number passed to
-- redis.call is formatted with %.17g (and as '6.4e+09' by Redis 7.2.0-7.2.4).
local function fmt(x) return string.format('%d', x) end
local now = clock(ARGV[1])
local region, nonce = ARGV[2], ARGV[3]
local out = {}
local ai, ki = 5, 1

-- A batch often decides the same key again (one busy subject): what this call read of a
-- registry (its HMGET of '@', 'a', 'k') and of a data key (its HGETALL) is kept, with the
-- call's own HSETs applied to it as Redis applies them (a new field goes last), so the
-- next request of the batch reads the same as Redis would give it without asking again.
-- Any other write to such a key forgets it. (Not for a batch of one request: flats is nil.)
local regs_read, flats = {}, nil
if tonumber(ARGV[4]) > 1 then flats = {} end
local function read_flat(key)
  if not flats then return nil end
  local flat = flats[key]
  if not flat then
    flat = call('HGETALL', key)
    flats[key] = flat
  end
  return flat
end
local function hset(key, ...)
  call('HSET', key, ...)
  local flat = flats and flats[key]
  if not flat then return end
  local kv = {...}
  for i = 1, #kv, 2 do
    local f, v, at = kv[i], kv[i + 1], nil
    for j = 1, #flat, 2 do
      if flat[j] == f then
        at = j
        break
      end
    end
    if at then
      flat[at + 1] = v
    else
      flat[#flat + 1] = f
      flat[#flat + 1] = v
    end
  end
end

-- Escrow hold of a shard: field xo of its registry says its escrow state is
-- intact; without it (a new or wiped Redis) escrow rules are denied from xs on,
-- until the agent has pulled every peer's state and a window has passed.
local function escrow_hold(reg)
  local got = call('HMGET', reg, 'xo', 'xs')
  if got[1] then return nil end
  if not got[2] then
    call('HSET', reg, 'xs', fmt(now))
    return now
  end
  return tonumber(got[2])
end

-- One escrow rule of a request, read and judged (nothing written).
local function escrow_rule(key, reg, limit, res, N, spec, cost, held)
  local share, k, wait = string.match(spec, '^(%-?%d+) (%d+) (%d+)$')
  share, k, wait = tonumber(share), tonumber(k), tonumber(wait)
  local window = N * res
  local r = {escrow = true, limit = limit, res = res, window = window, k = k}
  if share < 0 then
    r.code, r.retry = -1, res
    return r
  end
  if held then
    local left = held + window - now
    r.code, r.retry = -2, left > 0 and left or res
    return r
  end
  local step_us = res / k
  local n = N * k
  local st = escrow_load(key, region)
  local cur = bucket(now, step_us)
  local rights = share + escrow_net(st.net, limit)
  local used = escrow_used(st.steps, cur, n, now, window)
  r.st, r.cur, r.n, r.step_us, r.share, r.wait = st, cur, n, step_us, share, wait
  r.rights, r.used = rights, used
  r.ok = cost <= limit and used + cost <= rights
  return r
end

-- The reply of an escrow rule: allowed, used (so that limit - used is what this
-- region may still admit), retry_us, reset_us, stable_us (until the oldest own step
-- that counts stops counting: geolimit.core.escrow.Ledger.stable_us).
local function escrow_reply(r, cost, consumed)
  if r.code then return r.code, r.limit, r.retry, 0, 0 end
  local used = r.used
  if consumed then used = used + cost end
  local retry = 0
  if not r.ok then
    local wait = nil
    if r.wait > 0 and escrow_spare_elsewhere(r.st.ads, region, r.limit, r.rights, bucket(now, r.res), r.window / r.res)
        >= cost then
      wait = r.wait
    end
    retry = escrow_retry(r.st.steps, r.cur, r.n, r.step_us, now, r.window, r.rights, cost, r.limit, wait)
  end
  local latest, exit = -1, nil
  local took = consumed and cost > 0
  for _, s in pairs(r.st.steps) do
    if s[2] > 0 and escrow_counts(s, r.cur, r.n, now, r.window) then
      if s[3] > latest then latest = s[3] end
      if not (took and s[1] == r.cur) then  -- (this request's step: its last admission is now)
        local at = s[3] + r.window + 1
        local edge = (s[1] + r.n) * r.step_us
        if edge > at then at = edge end
        if exit == nil or at < exit then exit = at end
      end
    end
  end
  if took then
    latest = now
    if exit == nil or now + r.window + 1 < exit then exit = now + r.window + 1 end
  end
  local reset = 0
  if latest >= 0 then reset = latest + r.window + 1 - now end
  local spare = r.rights - used
  if spare < 0 then spare = 0 end
  return (r.ok and 1 or 0), r.limit - spare, retry, reset, exit and exit - now or r.window
end

-- Record an escrow request: its own step (if admitted) and the units asked for.
local function escrow_write(key, r, cost, consumed, ttl, track, chg)
  if flats then flats[key] = nil end
  local st = r.st
  if consumed and cost > 0 then
    local pos = r.cur % (r.n + 1)
    local s = st.steps[pos]
    local count = cost
    if s and s[1] == r.cur then count = s[2] + cost end
    call('HSET', key, 's' .. fmt(pos), fmt(r.cur) .. ':' .. fmt(count) .. ':' .. fmt(now))
  end
  local b = bucket(now, r.res)
  local q = st.q
  local asked, before = cost, 0
  if q and q[1] == b then asked, before = q[2] + cost, q[3] elseif q and q[1] == b - 1 then before = q[2] end
  call('HSET', key, 'q', fmt(b) .. ':' .. fmt(asked) .. ':' .. fmt(before))
  escrow_expiry(key, st, r.limit, ttl)
  if track then call('HSET', string.sub(chg, 1, -2) .. 'e', key, '1') end
end

for _ = 1, tonumber(ARGV[4]) do
  -- (numbers of ARGV through strnum: the requests of a batch repeat the same rule arguments)
  local consume, cost, nr = ARGV[ai] == '1', strnum[ARGV[ai + 1]], strnum[ARGV[ai + 2]]
  ai = ai + 3
  local reg, chg, peers = KEYS[ki], KEYS[ki + 1], KEYS[ki + 2]
  ki = ki + 3
  -- The registry: own slot, the agent's lease (both for tracking) and the clock
  -- correction: gossip-mode rules run on the agreed region clock gnow, escrow
  -- rules and the lease on this Redis's own clock (now).
  local regs = regs_read[reg]
  if not regs then
    regs = call('HMGET', reg, '@', 'a', 'k')
    regs_read[reg] = regs
  end
  local gnow = now + (tonumber(regs[3]) or 0)
  local res_all, rs, info, held = true, {}, nil, false
  for j = 1, nr do
    local limit, res, N, M = strnum[ARGV[ai]], strnum[ARGV[ai + 1]], strnum[ARGV[ai + 2]], strnum[ARGV[ai + 3]]
    local ttl, spec = strnum[ARGV[ai + 4]], ARGV[ai + 9]
    if spec ~= '' then
      if held == false then held = escrow_hold(reg) end
      local r = escrow_rule(KEYS[ki + j - 1], reg, limit, res, N, spec, cost, held)
      r.ttl = ttl
      if not r.ok then res_all = false end
      rs[j] = r
    else
      local approx, predict = ARGV[ai + 5] == '1', ARGV[ai + 6] == '1'
      local partition = strnum[ARGV[ai + 7]]
      local c = bucket(gnow, res)
      local watch = predict or partition > 0
      local sums, futs, h, own, stale, slots, firsts, e, rises, u, low = load_window(KEYS[ki + j - 1], c, N, M, watch, approx,
                                                                                  read_flat(KEYS[ki + j - 1]))
      local reserve, closed, predicted, ends, falls = 0, false, 0, 0, nil
      local after = strnum[ARGV[ai + 8]]
      local uq, ucs = nil, nil  -- field 'u', read (predicting approximate rules with peers: rewritten on admission)
      if watch and (partition > 0 or has_remote(slots) or has_remote(rises)) then
        info = info or load_peers(reg, peers)
        local win = nil
        if approx then
          local count, total = 0, 0
          for d = 0, N - 1 do count = count + sums[d] end
          for d = 0, N do total = total + sums[d] end
          uq, ucs = quanta(u)
          -- (N >= 1: sums[1] exists; the intake is geolimit.core.policy.intake)
          win = {count + oldest_part(sums[N], share(firsts[N], c, res, gnow)), total, uq, ucs,
                 freeing(sums[N], firsts[N], res), (sums[0] + sums[1]) / (gnow - (c - 1) * res)}
          if not predict then ucs = nil end
        end
        reserve, closed, predicted, ends, falls = reservation(info, slots or {}, rises or {}, region, limit, gnow,
                                                              predict, partition, after, win)
      end
      -- One rule: evaluate() below answers the same, so skip this pass.
      if closed or (nr > 1 and not admits(sums, futs, firsts, N, gnow, cost, limit, res, approx, reserve)) then
        res_all = false
      end
      rs[j] = {sums = sums, futs = futs, N = N, limit = limit, res = res, approx = approx, c = c, M = M, ttl = ttl,
               h = h, own = own, stale = stale, reserve = reserve, closed = closed, firsts = firsts, e = e,
               predicted = predicted, ends = ends, falls = falls, uq = uq, ucs = ucs, after = after, low = low}
    end
    ai = ai + 10
  end
  -- One gossip-mode rule allowed so far: its answer, decided once (in locals, not a table;
  -- s_used is nil otherwise).
  local s_ok, s_used, s_retry, s_reset, s_stable
  if nr == 1 and res_all and not rs[1].escrow then
    local r = rs[1]
    s_ok, s_used, s_retry, s_reset, s_stable = evaluate(r.sums, r.firsts, r.futs, r.N, gnow, cost, r.limit, r.res,
                                                        r.approx, consume, r.reserve)
    s_retry = predicted_retry(s_retry, r.sums, r.firsts, r.futs, r.N, gnow, cost, r.limit, r.res, r.approx,
                              r.reserve, r.predicted, r.ends)
    res_all = s_ok
  end
  local consumed = res_all and consume
  local track
  if consumed and cost > 0 then
    track = tracking(reg, region, nonce, now, regs)
    if not regs[1] then regs_read[reg] = nil end  -- tracking() made the registry
    for j = 1, nr do
      local key, r = KEYS[ki + j - 1], rs[j]
      if not r.escrow then
        local c, M, h, res = r.c, r.M, r.h, r.res
        local value = r.own
        if value == 0 then value = math.floor((gnow - c * res) * SUB / res) end
        value = value + cost * SUB
        -- field 'u' (see quanta()) when this rule records its own admissions
        local um = r.ucs and quanta_add(r.uq, r.ucs, gnow, quantum(r.after), cost)
        if h == nil or c > h then
          if #r.stale > 0 then
            chunked('HDEL', key, r.stale, 1000)
            if flats then flats[key] = nil end
          end
          local mark = expiry_mark(r.e, r.ttl)
          if h == nil and track and mark then
            -- A new key the agent will replicate: its low mark (merge.lua), so that a
            -- peer's first cell need not read it whole. F = M - N - 1 (section 2).
            local low = fmt(c - (M - r.N - 1))
            if um then
              hset(key, 'h', fmt(c), fmt(c % M), fmt(value), 'e', fmt(mark), 'l', low, 'u', um)
            else
              hset(key, 'h', fmt(c), fmt(c % M), fmt(value), 'e', fmt(mark), 'l', low)
            end
          elseif mark and um then
            hset(key, 'h', fmt(c), fmt(c % M), fmt(value), 'e', fmt(mark), 'u', um)
          elseif mark then
            hset(key, 'h', fmt(c), fmt(c % M), fmt(value), 'e', fmt(mark))
          elseif um then
            hset(key, 'h', fmt(c), fmt(c % M), fmt(value), 'u', um)
          else
            hset(key, 'h', fmt(c), fmt(c % M), fmt(value))
          end
          if mark then arm_expiry(key, mark) end
        elseif um then
          hset(key, fmt(c % M), fmt(value), 'u', um)
        else
          hset(key, fmt(c % M), fmt(value))
        end
        -- the low mark (merge.lua): no cell below it; a clock behind the one that set it lowers it
        if r.low and c < r.low then hset(key, 'l', fmt(c)) end
        if track then call('HSETNX', chg, key, fmt(c)) end
      end
    end
  end
  out[#out + 1] = res_all and 1 or 0
  for j = 1, nr do
    local r = rs[j]
    local ok, used, retry, reset, stable
    if r.escrow then
      if consume and r.st then
        if track == nil then
          track = tracking(reg, region, nonce, now, regs)
          if not regs[1] then regs_read[reg] = nil end
        end
        escrow_write(KEYS[ki + j - 1], r, cost, consumed, r.ttl, track, chg)
      end
      ok, used, retry, reset, stable = escrow_reply(r, cost, consumed)
    elseif s_used ~= nil then
      ok, used, retry, reset, stable = s_ok, s_used, s_retry, s_reset, s_stable
    else
      ok, used, retry, reset, stable = evaluate(r.sums, r.firsts, r.futs, r.N, gnow, cost, r.limit, r.res, r.approx,
                                                consumed, r.reserve)
      retry = predicted_retry(retry, r.sums, r.firsts, r.futs, r.N, gnow, cost, r.limit, r.res, r.approx, r.reserve,
                              r.predicted, r.ends)
    end
    if r.closed then
      ok, retry = false, r.res
    end
    if r.falls and r.falls - gnow < stable then stable = r.falls - gnow end
    if ok == true then ok = 1 elseif ok == false then ok = 0 end
    out[#out + 1] = ok
    out[#out + 1] = used
    out[#out + 1] = retry
    out[#out + 1] = reset
    out[#out + 1] = stable
  end
  ki = ki + nr
end
return out
