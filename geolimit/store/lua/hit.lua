-- hit: decide a batch of requests atomically; each request is all-or-nothing
-- over its rules and consumes nothing unless every rule allows it.
-- KEYS per request: registry, changed, peers, then one data key per rule.
-- ARGV: now_us|'', region, nonce, nreq, then per request:
--   consume (1|0), cost, nrules, then per rule: limit, res_us, N, M, ttl_ms,
--   approx (1|0), predict (1|0), partition (0 local|1 share|2 closed), partition_after_us
-- Returns per request: allowed, then per rule: allowed, used, retry_us, reset_us.
-- Every number written to Redis goes through fmt: a Lua number passed to
-- redis.call is formatted with %.17g (and as '6.4e+09' by Redis 7.2.0-7.2.4).
local function fmt(x) return string.format('%d', x) end
local now = clock(ARGV[1])
local region, nonce = ARGV[2], ARGV[3]
local out = {}
local ai, ki = 5, 1
for _ = 1, tonumber(ARGV[4]) do
  local consume, cost, nr = ARGV[ai] == '1', tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  ai = ai + 3
  local reg, chg, peers = KEYS[ki], KEYS[ki + 1], KEYS[ki + 2]
  ki = ki + 3
  local res_all, rs, info = true, {}, nil
  for j = 1, nr do
    local limit, res, N, M = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2]), tonumber(ARGV[ai + 3])
    local approx, predict = ARGV[ai + 5] == '1', ARGV[ai + 6] == '1'
    local partition = tonumber(ARGV[ai + 7])
    local c = bucket(now, res)
    local watch = predict or partition > 0
    local sums, futs, h, own, stale, slots, firsts, e = load_window(KEYS[ki + j - 1], c, N, M, watch, approx)
    local reserve, closed, predicted, ends = 0, false, 0, 0
    if watch and (partition > 0 or has_remote(slots)) then
      info = info or load_peers(reg, peers)
      reserve, closed, predicted, ends = reservation(info, slots or {}, region, limit, res, now, predict, partition,
                                                     tonumber(ARGV[ai + 8]))
    end
    -- One rule: evaluate() below answers the same, so skip this pass.
    if closed or (nr > 1 and not admits(sums, futs, firsts, N, now, cost, limit, res, approx, reserve)) then
      res_all = false
    end
    rs[j] = {sums, futs, N, limit, res, approx, c, M, tonumber(ARGV[ai + 4]), h, own, stale, reserve, closed, firsts, e,
             predicted, ends}
    ai = ai + 9
  end
  local single
  if nr == 1 and res_all then
    local r = rs[1]
    single = {evaluate(r[1], r[15], r[2], r[3], now, cost, r[4], r[5], r[6], consume, r[13])}
    single[3] = predicted_retry(single[3], r[1], r[15], r[2], r[3], now, cost, r[4], r[5], r[6], r[13], r[17], r[18])
    res_all = single[1]
  end
  local consumed = res_all and consume
  if consumed and cost > 0 then
    local track = tracking(reg, region, nonce, now)
    for j = 1, nr do
      local key, r = KEYS[ki + j - 1], rs[j]
      local c, M, h, res = r[7], r[8], r[10], r[5]
      local value = r[11]
      if value == 0 then value = math.floor((now - c * res) * SUB / res) end
      value = value + cost * SUB
      if h == nil or c > h then
        if #r[12] > 0 then chunked('HDEL', key, r[12], 1000) end
        local mark = expiry_mark(r[16], r[9])
        if mark then
          call('HSET', key, 'h', fmt(c), fmt(c % M), fmt(value), 'e', fmt(mark))
          arm_expiry(key, mark)
        else
          call('HSET', key, 'h', fmt(c), fmt(c % M), fmt(value))
        end
      else
        call('HSET', key, fmt(c % M), fmt(value))
      end
      if track then call('HSETNX', chg, key, fmt(c)) end
    end
  end
  out[#out + 1] = res_all and 1 or 0
  for j = 1, nr do
    local r = rs[j]
    local ok, used, retry, reset
    if single then
      ok, used, retry, reset = single[1], single[2], single[3], single[4]
    else
      ok, used, retry, reset = evaluate(r[1], r[15], r[2], r[3], now, cost, r[4], r[5], r[6], consumed, r[13])
      retry = predicted_retry(retry, r[1], r[15], r[2], r[3], now, cost, r[4], r[5], r[6], r[13], r[17], r[18])
    end
    if r[14] then
      ok, retry = false, r[5]
    end
    out[#out + 1] = ok and 1 or 0
    out[#out + 1] = used
    out[#out + 1] = retry
    out[#out + 1] = reset
  end
  ki = ki + nr
end
return out
