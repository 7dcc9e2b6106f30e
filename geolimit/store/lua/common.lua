-- geolimit common prelude: prepended to every script by geolimit/store/scripts.py.
-- Mirrors geolimit/core/window.py; keep the two in step (tests compare them).
local tonumber, ceil, fmod = tonumber, math.ceil, math.fmod
local call = redis.call

-- A cell's value is count * 64 + the offset (in 64ths of the bucket) of its
-- first admission: still monotonic, so max-merge keeps working, and it tells
-- approximate mode where a bucket's traffic began. (geolimit.core.window.SUBSTEPS)
local SUB = 64
local function count_of(v) return (v - v % SUB) / SUB end
-- What a cell of value v and reset floor w counts: max(0, count(v) - count(w))
-- (geolimit.core.gcounter.Cell.effective).
local function counted(v, w)
  local cv, cw = count_of(v), count_of(w)
  return cv > cw and cv - cw or 0
end
-- Approximate mode's margin on the oldest bucket, in standard deviations of its
-- count (geolimit.core.window.MARGIN).
local MARGIN = 2.5

-- The epoch-aligned bucket of time t (exact: fmod never rounds).
local function bucket(t, res)
  return (t - fmod(t, res)) / res
end

-- Run cmd key args... in chunks: unpack() is limited by Lua's C stack.
local function chunked(cmd, key, list, step)
  local n = #list
  for i = 1, n, step do
    local j = i + step - 1
    if j > n then j = n end
    call(cmd, key, unpack(list, i, j))
  end
end

-- Microseconds: ARGV value if the caller injected a clock, else Redis TIME.
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = call('TIME')
  return t[1] * 1000000 + t[2]
end

-- The region clock's correction (µs) in a shard's registry (field 'k'): the
-- agent sets it so that every region's decisions run on one agreed clock, the
-- mean of the regions' clocks (design section 14, Clock skew). Buckets and peer
-- freshness use clock() + correction; leases, outbox times and escrow rules
-- use clock() alone.
local function correction(reg)
  return tonumber(call('HGET', reg, 'k')) or 0
end

-- Slot registry of a shard. Slot index 0 is always this region's current
-- incarnation; a fresh (or wiped) registry starts a new incarnation, so counts
-- that a lost Redis held come back from peers under the old slot, never merged
-- into the new one.
-- candidate: an unused incarnation id chosen by the caller (the agent picks a
-- fresh one per round, so the shards it creates together share it), or nil.
local function ensure_registry(reg, region, nonce, candidate)
  local own = call('HGET', reg, '@')
  if not own then
    if candidate and candidate ~= '' then
      own = candidate
    else
      local t = call('TIME')
      own = string.format('%x%05x', tonumber(t[1]), tonumber(t[2])) .. nonce
    end
    call('HSET', reg, '@', own, '#', 1, region .. '/' .. own, 0)
  end
  return own
end

-- The registry check of a write: creates the registry if missing and says
-- whether a replication agent holds the lease (field 'a': expiry, in the same
-- clock as decisions), i.e. whether changes must be recorded for it.
-- got: the registry's HMGET of '@', 'a' (first), if the caller read it already.
local function tracking(reg, region, nonce, now, got)
  got = got or call('HMGET', reg, '@', 'a')
  if not got[1] then ensure_registry(reg, region, nonce) end
  return got[2] and tonumber(got[2]) > now
end

-- Key expiry. Field 'e' of a data key holds when (Redis TIME, in ms) its TTL
-- ends, as last set by these scripts. A write that needs the key to live ttl
-- ms more re-arms the TTL only when 'e' says it ends sooner, and then arms
-- ttl + ttl/4: a busy key re-arms about every ttl/4 instead of on every move
-- of its head (PEXPIRE is one of the dearest calls of a write), and an idle
-- key lives at most a quarter of its TTL longer than it must.
local now_ms_cache = nil
local function now_ms()
  if not now_ms_cache then
    local t = call('TIME')
    now_ms_cache = tonumber(t[1]) * 1000 + (tonumber(t[2]) - tonumber(t[2]) % 1000) / 1000
  end
  return now_ms_cache
end

-- The expiry mark to write with a key's fields, or nil if its TTL lasts
-- long enough already (e: the key's current mark, nil if none).
local function expiry_mark(e, ttl)
  local need = now_ms() + ttl
  if e and e >= need then return nil end
  return need + (ttl - ttl % 4) / 4
end

-- Arm the TTL that expiry_mark() chose (after the key's fields are written:
-- PEXPIRE of a missing key does nothing).
local function arm_expiry(key, mark)
  call('PEXPIRE', key, string.format('%d', mark - now_ms()))
end

-- Reads a key's buckets relative to bucket c.
-- Returns sums[0..N] (effective count of bucket c - d), futs (bucket -> count
-- for buckets newer than c), head (nil for a new key), own (raw value of this
-- region's field for bucket c), stale (fields of buckets that have left the
-- window, deleted by the next write), firsts[0..N] (earliest first-admission
-- offset of each bucket, in 64ths; only with approx) and the expiry mark (see
-- expiry_mark). With per_slot, also slot index -> count in the window (floors
-- applied) and slot index -> {at, units, gap}: the slot's last rise, from field
-- 'p<slot index>' = 'at:units:gap' (written by merge.lua, see
-- geolimit.core.policy.Rise). Last, field 'u' as stored (this region's own recent
-- admissions, see quanta()). Fields whose name or value is not a number are
-- ignored (geolimit.core.window.read_key does the same). flat: the key's HGETALL
-- reply if the caller has it (read only), else the key is read here.
-- strnum[s]: tonumber(s), or false if s is not a number, from a cache. tonumber() (glibc's
-- strtod) costs far more than a table lookup, and the same strings come again and again: a
-- batch that decides one busy subject reads the same fields and values again, every request
-- repeats its rules' arguments, merge.lua and pack.lua meet the same heads, marks and values
-- across a blob's keys. The cache is a pure function of its keys, so it may outlive a call:
-- in the function library (Redis 7, preludes set up once) it does, and every call reuses the
-- rule arguments and field names converted before; under EVALSHA the prelude runs again for
-- each call, so it lasts one call. Bounded: after STRNUM_CAP conversions it starts afresh
-- (geolimit/store/scripts.py: _PRELUDE_CACHES).
local STRNUM_CAP = 4096
local strnum_count = 0
local strnum_mt = {}
local strnum = setmetatable({}, strnum_mt)
strnum_mt.__index = function(cache, s)
  local v = tonumber(s) or false
  if strnum_count >= STRNUM_CAP then
    strnum_count = 0
    cache = setmetatable({}, strnum_mt)
    strnum = cache
  end
  strnum_count = strnum_count + 1
  cache[s] = v
  return v
end

-- firsts is filled only with approx; else it is NONE (read by nobody, written by nobody), as is
-- stale when no field has left the window.
local NONE = {}
-- filled(same, v, N): a table of v at 0..N. Up to #same + 1 buckets (the default is 11: N = 10)
-- one table constructor from same (#same copies of v), cheaper than N + 1 stores.
local ZEROS = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
               0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
local SUBS = {SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB,
              SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB, SUB}
local function filled(same, v, N)
  if N <= #same then return {[0] = v, unpack(same, 1, N)} end
  local t = {}
  for d = 0, N do t[d] = v end
  return t
end
local function load_window(key, c, N, M, per_slot, approx, flat)
  flat = flat or call('HGETALL', key)
  local n = #flat
  local sums = filled(ZEROS, 0, N)
  local firsts = approx and filled(SUBS, SUB, N) or NONE
  local slots = per_slot and {} or nil
  local rises = per_slot and {} or nil
  if n == 0 then return sums, nil, nil, 0, NONE, slots, firsts, nil, rises end
  local h, e, u, l
  for i = 1, n, 2 do
    local fs = flat[i]
    if fs == 'h' then h = strnum[flat[i + 1]] or nil elseif fs == 'e' then e = strnum[flat[i + 1]] or nil
    elseif fs == 'u' then u = flat[i + 1] elseif fs == 'l' then l = strnum[flat[i + 1]] or nil end
  end
  if not h then h = c end
  local stale, futs, floors = nil, nil, nil
  local own, ownf, old = 0, c % M, c - N - 1
  for i = 1, n, 2 do
    local fs = flat[i]
    local f = strnum[fs]
    local raw_v = f and strnum[flat[i + 1]]
    local raw = f and (f < 0 and -f - 1 or f)
    if not f then
      if rises and string.byte(fs, 1) == 112 then  -- 'p': a slot's last rise
        local v, find, sub = flat[i + 1], string.find, string.sub
        local c1 = find(v, ':', 1, true)
        local c2 = c1 and find(v, ':', c1 + 1, true)
        if c2 then
          local s, at, units, gap = tonumber(sub(fs, 2)), tonumber(sub(v, 1, c1 - 1)), tonumber(sub(v, c1 + 1, c2 - 1)),
                                    tonumber(sub(v, c2 + 1))
          if s and at and units and gap and gap > 0 then rises[s] = {at, units, gap} end
        end
      end
    elseif raw and h - (h - raw % M) % M <= old then
      if stale then stale[#stale + 1] = fs else stale = {fs} end
    elseif raw_v then
      local b = h - (h - raw % M) % M
      if f < 0 then
        floors = floors or {}
        floors[raw] = count_of(raw_v)
      else
        local v = (raw_v - raw_v % SUB) / SUB
        local d = c - b
        if d < 0 then
          futs = futs or {}
          futs[b] = (futs[b] or 0) + v
        elseif d <= N then
          sums[d] = sums[d] + v
          if approx then
            local first = raw_v % SUB
            if first < firsts[d] then firsts[d] = first end
          end
          if slots and f >= M then  -- remote slots only (index 0 is this region's own)
            local s = (f - f % M) / M
            slots[s] = (slots[s] or 0) + v
          end
        end
        if f == ownf then own = raw_v end
      end
    end
  end
  if floors then
    for i = 1, n, 2 do
      local f = strnum[flat[i]]
      local fl = f and f >= 0 and floors[f]
      local raw_v = fl and strnum[flat[i + 1]]
      if raw_v then
        local b = h - (h - f % M) % M
        if b > old then
          local v = count_of(raw_v)
          local sub = fl < v and fl or v
          local d = c - b
          if d < 0 then
            futs[b] = futs[b] - sub
          elseif d <= N then
            sums[d] = sums[d] - sub
            if slots and f >= M then
              local s = (f - f % M) / M
              slots[s] = slots[s] - sub
            end
          end
        end
      end
    end
  end
  return sums, futs, h, own, stale or NONE, slots, firsts, e, rises, u, l
end

-- Approximate mode: the share of the oldest bucket still inside the window ending
-- at t, its traffic assumed uniform from the end of the 64th in which its first
-- admission fell to the bucket's end (geolimit.core.window.share).
local function share(first, c, res, t)
  if first >= SUB then first = -1 end
  local span = res - (first + 1) * res / SUB
  local stop = (c + 1) * res
  if span <= 0 then return t < stop and 1 or 0 end
  local w = (stop - t) / span
  if w > 1 then w = 1 elseif w < 0 then w = 0 end
  return w
end

-- Approximate mode: what the oldest bucket's n units count for at weight w: n * w
-- inflated by MARGIN * sqrt(n) for lumpy traffic, at most n (geolimit.core.window.oldest_part).
local function oldest_part(n, w)
  local part = w * (n + MARGIN * math.sqrt(n))
  if part > n then return n end
  return part
end

-- Cells in buckets ahead of this region's clock were written by a region whose
-- clock runs ahead: those admissions already happened, so they count now.
local function ahead(futs)
  local n = 0
  if futs then for _, t in pairs(futs) do n = n + t end end
  return n
end

-- Does the window admit cost more? (count the partial oldest bucket fully in
-- strict mode, weighted by its overlap in approximate mode)
local function admits(sums, futs, firsts, N, now, cost, limit, res, approx, reserve)
  local count = reserve + ahead(futs)
  for d = 0, N - 1 do count = count + sums[d] end
  if approx then
    count = count + oldest_part(sums[N], share(firsts[N], bucket(now, res), res, now))
  else
    count = count + sums[N]
  end
  return count + cost <= limit
end

-- The decision rule for one key. ``consume``: the request as a whole consumed
-- cost (every rule allowed it). Times in microseconds; returns
-- allowed, used, retry_after (-1: never), reset_after, stable (see below).
local function evaluate(sums, firsts, futs, N, now, cost, limit, res, approx, consume, reserve)
  local c = bucket(now, res)
  local weight = approx and share(firsts[N], c, res, now) or 1  -- (firsts: approx only)
  local newer = reserve + ahead(futs)
  for d = 0, N - 1 do newer = newer + sums[d] end
  local count
  if approx then count = newer + oldest_part(sums[N], weight) else count = newer + sums[N] end
  local allowed = count + cost <= limit
  local used = count
  if allowed and consume then used = count + cost end
  used = ceil(used)  -- a reserve is fractional in both modes: limit - used is what a request may still cost
  local retry = 0
  if not allowed then
    if cost > limit then
      retry = -1
    elseif approx then
      retry = (c + N + 1) * res - now
      for k = 0, N do
        if k > 0 then newer = newer - sums[N - k] end
        local oldest = sums[N - k]
        local w0 = 1.0
        if k == 0 then w0 = weight end
        if newer + cost <= limit then
          if oldest == 0 or newer + oldest_part(oldest, w0) + cost <= limit then
            if k == 0 then retry = 0 else retry = (c + k) * res - now end
          else
            local first = firsts[N - k]
            if first >= SUB then first = -1 end
            local span = res - (first + 1) * res / SUB
            -- relative to now first: an absolute time in µs as a double is exact only to ~0.25 µs
            local stop = (c + k + 1) * res - now
            if span <= 0 then
              retry = stop
            else
              local need = (limit - cost - newer) / (oldest + MARGIN * math.sqrt(oldest))
              retry = ceil(stop - need * span)
              -- the exact microsecond, as evaluate() will judge it then (the root is rounded)
              local thn = reserve + ahead(futs)
              for d = 0, N - k - 1 do thn = thn + sums[d] end
              local low = 1
              if k > 0 then low = (c + k) * res - now + 1 end
              for _ = 1, 4 do
                if retry < stop and thn + oldest_part(oldest, share(firsts[N - k], c + k, res, now + retry)) + cost > limit then
                  retry = retry + 1
                elseif retry > low and thn + oldest_part(oldest, share(firsts[N - k], c + k, res, now + retry - 1)) + cost
                    <= limit then
                  retry = retry - 1
                else
                  break
                end
              end
            end
          end
          break
        end
      end
    else
      local rem = count
      retry = (c + N + 1) * res - now
      for k = 1, N + 1 do
        rem = rem - sums[N - k + 1]
        if rem + cost <= limit then retry = (c + k) * res - now break end
      end
    end
  end
  local latest = -1
  if allowed and consume and cost > 0 then
    latest = c
  else
    for d = 0, N do if sums[d] > 0 then latest = c - d break end end
  end
  if futs then
    for b, t in pairs(futs) do if t > 0 and b > latest then latest = b end end
  end
  local reset = 0
  if latest >= 0 then
    reset = (latest + N + 1) * res - now
    if reset < 0 then reset = 0 end
  end
  -- stable: a time during which limit - used cannot grow (no new traffic, the
  -- same reserve). Approximate: the window if nothing counts, until its bucket
  -- leaves if one unit does, else 0. Strict: until the oldest bucket holding a
  -- count leaves the window (the window if none does).
  local stable
  if approx then
    if latest < 0 then stable = N * res elseif used == 1 then stable = reset else stable = 0 end
  else
    local oldest = -1
    for d = N, 0, -1 do if sums[d] > 0 then oldest = c - d break end end
    if oldest < 0 then
      if allowed and consume and cost > 0 then
        oldest = c
      elseif futs then
        for b, t in pairs(futs) do if t > 0 and (oldest < 0 or b < oldest) then oldest = b end end
      end
    end
    if oldest < 0 then stable = N * res else stable = (oldest + N + 1) * res - now end
  end
  return allowed, used, retry, reset, stable
end
