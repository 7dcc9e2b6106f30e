-- merge: validate a peer's blob for one shard, then max-merge its cells.
-- KEYS: registry
-- ARGV: now_us|'', region, nonce, apply, mode ('delta'|'repair'), max_cells,
--       max_new_slots, max_slots, park_cap, park_us, nregions, regions..., nrules,
--       per rule: name, res_us, N, M, F, ttl_ms, predict (1|0), nrelay, relay peers...,
--       blob, gap_us (optional)
-- The blob is msgpack [slots, keys, counts, cells] (see pack.lua): keys[i] is
-- 'rule:subject', counts[i] its number of cells, and cells is flat bucket,
-- slot_ref, value, floor in key order.
-- apply: '0' check only (nothing is written at all), '1' check, then write,
-- '2' write a blob that a '0' call (same blob and limits) accepted: the
-- per-cell type and range checks are skipped, the registry and own-slot checks
-- run again. Every check runs before any write.
-- Refused: {0, reason}. Accepted: {1, cells, increased, dropped_old, dropped_future,
--   unknown_rule, relayed (keys queued for relay peers), own_ahead, parked,
--   first parked due (µs on the region clock, -1: none)}; fields may be appended
--   to this reply, so readers ignore what they do not know.
-- A cell that claims more in the receiver's own current slot than it counted
-- refuses the blob in 'delta' mode; in 'repair' mode (anti-entropy after a
-- failover or a restore lost this region's latest writes) it is skipped, never
-- written, and counted in own_ahead.
-- Every slot the blob writes gets registry field 't<index>' = now (see reclaim.lua).
-- Cells older than c - N are dropped (too old to matter). Cells after c + F
-- (further ahead than the clock-skew tolerance) and at most park_us ahead of it
-- are parked, up to park_cap per shard (fields of hash '<tag>#pk', due times in
-- zset '<tag>#pz'), and merged by unpark.lua once their bucket is within the
-- tolerance; the rest are dropped. Keys whose state rose are queued, every slot
-- from the lowest raised bucket, in the outboxes of the relay peers.
-- gap_us > 0 (a delta: the time since the sender's previous update) records, for
-- prediction (rules that predict only), each peer slot's rise in the key: field 'p<slot index>' =
-- 'now:units:gap_us', units what the slot's count rose by (see
-- geolimit.core.policy.Rise; readers of cells skip non-numeric field names).
local reg = KEYS[1]
local raw = clock(ARGV[1])  -- this Redis's clock: relay queue times
local now = raw + correction(reg)  -- the region clock: which buckets are current
local region, nonce = ARGV[2], ARGV[3]
local apply, checked, repair = ARGV[4] ~= '0', ARGV[4] == '2', ARGV[5] == 'repair'
local max_cells, max_new, max_slots = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local park_cap, park_us = tonumber(ARGV[9]), tonumber(ARGV[10])
local allowed = {}
local a = 12
for _ = 1, tonumber(ARGV[11]) do allowed[ARGV[a]] = true a = a + 1 end
local rules = {}
local nrules = tonumber(ARGV[a])
a = a + 1
for _ = 1, nrules do
  -- res, N, M, F, ttl_ms, the current bucket, passed() cache, [8] read whole (set below), [9] predict,
  -- [10] park span (buckets)
  local res = tonumber(ARGV[a + 1])
  rules[ARGV[a]] = {res, tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]),
                    bucket(now, res), {}, false, ARGV[a + 6] == '1', math.ceil(park_us / res)}
  a = a + 7
end
local relay = {}
for _ = 1, tonumber(ARGV[a]) do relay[#relay + 1] = ARGV[a + 1] a = a + 1 end
local blob = ARGV[a + 1]
local gap = tonumber(ARGV[a + 2] or '') or 0
local stamp = gap > 0 and (fmt(now) .. ':') or nil  -- prefix of a rise field's value
local gaps = gap > 0 and (':' .. fmt(gap)) or nil  -- its suffix
local floor = math.floor
local tag = tag_of(reg)

local function refuse(why) return {0, why} end

-- fnames[x]: the decimal string of the integer x (field names and heads),
-- formatted once per call: the cells of a blob share a few of each.
local fnames = setmetatable({}, {__index = function(cache, x)
  local s = fmt(x)
  cache[x] = s
  return s
end})

local ok, t = pcall(cmsgpack.unpack, blob)
if not ok or type(t) ~= 'table' then return refuse('blob is not msgpack') end
local slots = t[1]
if type(slots) ~= 'table' then return refuse('blob has no slot list') end
local nslots = #slots
if nslots > max_slots then return refuse('too many slot ids in one blob') end
local own_inc = call('HGET', reg, '@')
local own_id = own_inc and (region .. '/' .. own_inc) or nil
local seen, own_ref = {}, nil
for i = 1, nslots do
  local id = slots[i]
  if type(id) ~= 'string' or #id > 200 then return refuse('slot id is not a short string') end
  if seen[id] then return refuse('duplicate slot id') end
  seen[id] = true
  local cut = string.find(id, '/[^/]*$')
  if not cut or cut == 1 or cut == #id then return refuse('slot id is not region/incarnation') end
  if not allowed[string.sub(id, 1, cut - 1)] then return refuse('slot of a region that is not configured') end
  if id == own_id then own_ref = i - 1 end
end
local idx = {}
local fresh = 0
if nslots > 0 then
  local got = call('HMGET', reg, unpack(slots))
  for i = 1, nslots do
    if got[i] then idx[i] = tonumber(got[i]) else fresh = fresh + 1 end
  end
end
-- Repairs (anti-entropy answers to our own requests) may bring many: a region wiped
-- more than max_new times within a window has that many incarnations with live cells,
-- and its repair needs them all; the registry cap below still bounds them.
if fresh > max_new and not repair then return refuse('too many new slot ids in one blob') end
-- used: the slot indices handed out so far ('#'); indices reclaim.lua took back
-- from expired incarnations wait in field 'F' (space-separated) to be reused.
local used = tonumber(call('HGET', reg, '#')) or 1
local free = {}
if fresh > 0 then
  local list = call('HGET', reg, 'F')
  if list then for x in string.gmatch(list, '%d+') do free[#free + 1] = x end end
  if used - #free + fresh > max_slots then return refuse("the shard's slot registry is full") end
end

-- Check every key and cell first.
local keys, counts, cells = t[2], t[3], t[4]
if #t ~= 4 or type(keys) ~= 'table' or type(counts) ~= 'table' or type(cells) ~= 'table' then
  return refuse('blob is not [slots, keys, counts, cells]')
end
local n = #keys
if #counts ~= n then return refuse('key and count lists differ in length') end
local total, unknown, own_ahead = 0, 0, 0
local needed = {}  -- slots that cells of known rules use: only those are registered
local specs = {}  -- key position -> its rule (false: a rule this region skips)
if checked then  -- the types passed the check call (blob_check.py): only count
  for i = 1, n do total = total + counts[i] end
else  -- in the order of blob_check.py, so that both name the same fault first
  for i = 1, n do
    local suffix = keys[i]
    if type(suffix) ~= 'string' or #suffix < 3 or #suffix > 4200 then return refuse('bad key') end
  end
  for i = 1, n do
    local m = counts[i]
    if type(m) ~= 'number' or not (m >= 1) or m ~= floor(m) then return refuse('a cell count is not a positive integer') end
    total = total + m
  end
end
if total > max_cells then return refuse('too many cells in one blob') end
if #cells ~= 4 * total then return refuse('the cells do not match the counts') end
if not checked then
  for j = 1, 4 * total, 4 do
    local b, r, v, w = cells[j], cells[j + 1], cells[j + 2], cells[j + 3]
    -- integers >= 0 (NaN fails x >= 0)
    if type(b) ~= 'number' or type(r) ~= 'number' or type(v) ~= 'number' or type(w) ~= 'number'
        or not (b >= 0 and r >= 0 and v >= 0 and w >= 0)
        or b ~= floor(b) or r ~= floor(r) or v ~= floor(v) or w ~= floor(w) then
      return refuse('a cell field is not a non-negative integer')
    end
    if r >= nslots then return refuse('slot reference out of range') end
    if b > MAX_VALUE or v > MAX_VALUE or w > MAX_VALUE then return refuse('a cell value is out of range') end
  end
end
local o = 0  -- offset of key i's cells in cells
for i = 1, n do
  local suffix, m = keys[i], counts[i]
  local stop = string.find(suffix, ':', 1, true)
  local known = stop and rules[string.sub(suffix, 1, stop - 1)] or false
  specs[i] = known
  local last = o + 4 * m
  if not known then
    unknown = unknown + m
  else
    local mine = 0
    for j = o + 2, last, 4 do
      local r = cells[j]
      needed[r + 1] = true
      if r == own_ref then mine = mine + 1 end
    end
    -- This region is the only writer of its current slot: an echo of it is fine,
    -- a claim of more than it counted is refused (or, repairing, skipped).
    if mine > 0 then
      local M = known[3]
      local fields, at = {'h'}, {}
      for j = o + 1, last, 4 do
        if cells[j + 1] == own_ref then
          fields[#fields + 1] = fnames[cells[j] % M]
          at[#at + 1] = j
        end
      end
      local got = hmget_all(tag .. ':' .. suffix, fields)
      local h = tonumber(got[1])
      local oldest = known[6] - known[2]  -- older cells are dropped, never written
      if h and h - M + 1 > oldest then oldest = h - M + 1 end
      for q = 1, #at do
        local j = at[q]
        local b, have = cells[j], 0
        if h and b <= h and b > h - M then have = tonumber(got[q + 1]) or 0 end
        -- An echo of a bucket this region has passed (its key's ring, or the window,
        -- moved on since the peer packed it) is dropped as old below, like a peer's.
        if b >= oldest and (cells[j + 2] > have or cells[j + 3] > have) then
          if not repair then return refuse("claims more in the receiver's own slot than it counted") end
          own_ahead = own_ahead + 1
          cells[j + 1] = -1  -- skipped below
        end
      end
    end
  end
  o = last
end
if not apply then return {1, total, 0, 0, 0, unknown, 0, own_ahead, 0, -1} end

-- Apply.
if not own_inc then ensure_registry(reg, region, nonce) end
local nfree, marks = #free, {}
for i = 1, nslots do
  if needed[i] then
    if not idx[i] then
      local v
      if nfree > 0 then
        v, nfree = tonumber(free[nfree]), nfree - 1
      else
        v = call('HINCRBY', reg, '#', 1) - 1
        used = used + 1
      end
      call('HSET', reg, slots[i], fmt(v))
      idx[i] = v
    end
    -- when this slot last wrote here: reclaim.lua frees the index once that is long past
    marks[#marks + 1] = 't' .. fmt(idx[i])
    marks[#marks + 1] = fmt(now)
  end
end
if nfree < #free then
  if nfree > 0 then call('HSET', reg, 'F', table.concat(free, ' ', 1, nfree)) else call('HDEL', reg, 'F') end
end
if #marks > 0 then call('HSET', reg, unpack(marks)) end

-- Clear the ring positions of buckets h+1..newh (passed over by a moving head)
-- of a key read with HMGET: name every candidate field, or list the hash's
-- fields when that is shorter.
local function clear(key, h, newh, M)
  local del, span = {}, newh - h
  if span * used * 2 <= 64 or span * used * 2 <= call('HLEN', key) then
    for b = h + 1, newh do
      local p = b % M
      for s = 0, used - 1 do
        del[#del + 1] = fnames[s * M + p]
        del[#del + 1] = fnames[-(s * M + p) - 1]
      end
    end
  else
    local names = call('HKEYS', key)
    for k = 1, #names do
      local f = tonumber(names[k])
      if f then
        if f < 0 then f = -f - 1 end
        if (f % M - h - 1) % M < span then del[#del + 1] = names[k] end
      end
    end
  end
  if #del > 0 then chunked('HDEL', key, del, 1000) end
end

-- Park a cell ahead of the skew tolerance until due_us (region clock): a field
-- '<bucket>:<length of slot id>:<slot id><rule:subject>' holding 'value:floor'
-- (max-merged with what is parked), scored by due_us. False when the park is full.
local pk, pz = tag .. '#pk', tag .. '#pz'
local park_room, parked, park_first, park_last = nil, 0, nil, nil
local function park(suffix, b, id, v, w, due_us)
  local field = fmt(b) .. ':' .. fmt(#id) .. ':' .. id .. suffix
  local old = call('HGET', pk, field)
  if old then
    local ov, ow = string.match(old, '^(%d+):(%d+)$')
    ov, ow = tonumber(ov) or 0, tonumber(ow) or 0
    if ov > v then v = ov end
    if ow > w then w = ow end
  else
    if park_room == nil then park_room = park_cap - call('HLEN', pk) end
    if park_room <= 0 then return false end
    park_room = park_room - 1
  end
  call('HSET', pk, field, fmt(v) .. ':' .. fmt(w))
  call('ZADD', pz, fmt(due_us), field)
  parked = parked + 1
  if not park_first or due_us < park_first then park_first = due_us end
  if not park_last or due_us > park_last then park_last = due_us end
  return true
end

-- The set of field names at the ring positions of buckets h+1..h+span (passed
-- over when a key's head moves from h to h+span), cached per rule: the keys of
-- a blob share a few heads. nil (test each field then) for a long span, or
-- once 32 sets are cached.
local sets = 0
local function passed(spec, h, span)
  if span * used * 2 > 64 then return nil end
  local M = spec[3]
  local id = h * M + span
  local set = spec[7][id]
  if not set then
    if sets >= 32 then return nil end
    sets = sets + 1
    set = {}
    for b = h + 1, h + span do
      local p = b % M
      for s = 0, used - 1 do
        set[fnames[s * M + p]] = true
        set[fnames[-(s * M + p) - 1]] = true
      end
    end
    spec[7][id] = set
  end
  return set
end

-- expiry_mark() for a stored mark given as its decimal string: one at least the
-- mark needed now (compared as strings of digits: same length, then bytes) needs
-- no new TTL. Cheaper than tonumber() on every key.
local needs = {}  -- ttl -> decimal string of now_ms() + ttl
local function mark_for(es, ttl)
  if es then
    local ns = needs[ttl]
    if not ns then
      ns = fmt(now_ms() + ttl)
      needs[ttl] = ns
    end
    if #es > #ns or (#es == #ns and es >= ns) then return nil end
  end
  return expiry_mark(nil, ttl)
end

-- A key is read whole (HGETALL: then a moving head costs no extra call) while
-- keys are small: once one has more than 32 fields, the rest of this call reads
-- only the fields it needs (HMGET). Rules whose keys may grow large always do.
local dense = false
for _, spec in pairs(rules) do spec[8] = spec[3] * used * 2 <= 512 end
local inc, old, fut = 0, 0, 0
local queued, nq, relaying = {}, 0, #relay > 0
-- This key's cells (bucket, field, value, floor, stored value, stored floor),
-- reused from key to key; pos/want: field -> cell (cleared after each key).
local cb, cf, cv, cw, sv, sw, pos, want = {}, {}, {}, {}, {}, {}, {}, {}
local write, nw = {}, 0
-- The peer slots whose count rose in this key (nr of them): the first is x1 (by
-- u1 units), any other x is rslots[2..nr] (by rose[x] units).
local nr, x1, u1, rose, rslots = 0, 0, 0, {}, {}
local pnames = setmetatable({}, {__index = function(cache, x)
  local name = 'p' .. fmt(x)
  cache[x] = name
  return name
end})
-- risen[u]: a rise field's value for a rise of u units (stamp and gap are this call's).
local risen = setmetatable({}, {__index = function(cache, u)
  local s = stamp .. fnames[u] .. gaps
  cache[u] = s
  return s
end})
-- nums[s]: a stored value's number (0 if it is not one): stored values repeat, and
-- tonumber() (strtod) costs more than a table lookup.
local nums = setmetatable({}, {__index = function(cache, s)
  local v = tonumber(s) or 0
  cache[s] = v
  return v
end})
-- The usual key: one cell, within the window, read whole. The same writes as the
-- general loop below (tests/replication/test_merge_matches_model.py), with fewer
-- table operations: false if the key is not such a key.
local prefix = tag .. ':'
local function merge_one(i, o, spec)
  local b, r = cells[o + 1], cells[o + 2]
  local c = spec[6]
  if r < 0 or b > c + spec[4] or b < c - spec[2] or dense or not spec[8] then return false end
  local M = spec[3]
  local f = idx[r + 1] * M + b % M
  local key = prefix .. keys[i]
  local flat = call('HGETALL', key)
  local nf = #flat
  if nf > 64 then dense = true end
  local h, e, v0, w0, stale = nil, nil, 0, 0, nil
  if nf > 0 then
    local hs = nil
    if flat[1] == 'h' then hs = flat[2] else
      for x = 3, nf, 2 do if flat[x] == 'h' then hs = flat[x + 1] break end end
    end
    if hs == nil then h = nil
    elseif hs == fnames[b] then h = b
    elseif hs == fnames[b - 1] then h = b - 1
    else h = tonumber(hs) end
  end
  if h then
    local span = b - h
    local moves = span > 0 and span < M
    local gone = nil
    if moves then gone = passed(spec, h, span) end
    local n1, n2 = nil, nil
    if b <= h and b > h - M then n1, n2 = fnames[f], fnames[-f - 1] end
    for x = 1, nf, 2 do
      local name = flat[x]
      local drop = false
      if gone then
        drop = gone[name]
      elseif moves then
        local g = tonumber(name)
        if g then
          if g < 0 then g = -g - 1 end
          drop = (g % M - h - 1) % M < span
        end
      end
      if drop then
        stale = stale or {}
        stale[#stale + 1] = name
      elseif name == 'e' then e = flat[x + 1]
      elseif name == n1 then v0 = nums[flat[x + 1]]
      elseif name == n2 then w0 = nums[flat[x + 1]] end
    end
  end
  local newh = h
  if not h or b > h then newh = b end
  if h and newh > h then
    if newh - h >= M then
      call('DEL', key)
      h, e, v0, w0 = nil, nil, 0, 0
    elseif stale then
      chunked('HDEL', key, stale, 1000)
    end
  end
  local nw, mark = 0, nil
  if newh ~= h then
    write[1], write[2], nw = 'h', fnames[newh], 2
    mark = mark_for(e, spec[5])
    if mark then write[3], write[4], nw = 'e', fmt(mark), 4 end
  end
  local lowest = nil
  if b <= newh - M then
    old = old + 1
  else
    local v, w = cells[o + 3], cells[o + 4]
    if v > v0 or w > w0 then
      if v < v0 then v = v0 end
      if w < w0 then w = w0 end
      inc = inc + 1
      lowest = b
      if stamp and spec[9] and v > v0 and f >= M then  -- a peer slot's count may have risen
        local add = (v - v % SUB) / SUB - (v0 - v0 % SUB) / SUB
        if add > 0 then write[nw + 1], write[nw + 2], nw = pnames[(f - f % M) / M], risen[add], nw + 2 end
      end
      if v > 0 then write[nw + 1], write[nw + 2], nw = fnames[f], fnames[v], nw + 2 end
      if w > 0 then write[nw + 1], write[nw + 2], nw = fnames[-f - 1], fnames[w], nw + 2 end
    end
  end
  if h or lowest then
    if nw == 2 then call('HSET', key, write[1], write[2])
    elseif nw == 4 then call('HSET', key, write[1], write[2], write[3], write[4])
    elseif nw == 6 then call('HSET', key, write[1], write[2], write[3], write[4], write[5], write[6])
    elseif nw == 8 then
      call('HSET', key, write[1], write[2], write[3], write[4], write[5], write[6], write[7], write[8])
    elseif nw > 0 then
      call('HSET', key, unpack(write, 1, nw))
    end
    if mark then arm_expiry(key, mark) end
  end
  if lowest and relaying then
    queued[#queued + 1] = key
    queued[#queued + 1] = fmt(-lowest - 1)
    nq = nq + 1
  end
  return true
end

local o = 0  -- offset of key i's cells in cells
for i = 1, n do
  local m = counts[i]
  local spec, last = specs[i], o + 4 * m
  if spec and m == 1 and merge_one(i, o, spec) then
    -- done
  elseif spec then
    local key = tag .. ':' .. keys[i]
    local N, M, F, ttl, c, rises = spec[2], spec[3], spec[4], spec[5], spec[6], stamp and spec[9]
    local k, maxb = 0, nil
    for j = o + 1, last, 4 do
      local b, r = cells[j], cells[j + 1]
      if r < 0 then
        -- an own-slot claim skipped in repair mode
      elseif b > c + F then
        if b > c + F + spec[10] or not park(keys[i], b, slots[r + 1], cells[j + 2], cells[j + 3], (b - F) * spec[1]) then
          fut = fut + 1
        end
      elseif b < c - N then
        old = old + 1
      else
        local f = idx[r + 1] * M + b % M
        local p = nil
        if m > 1 then p = pos[f] end
        if p then  -- the same cell twice: keep the larger value and floor
          if cells[j + 2] > cv[p] then cv[p] = cells[j + 2] end
          if cells[j + 3] > cw[p] then cw[p] = cells[j + 3] end
        else
          k = k + 1
          cb[k], cf[k], cv[k], cw[k], sv[k], sw[k] = b, f, cells[j + 2], cells[j + 3], 0, 0
          if m > 1 then pos[f] = k end
          if not maxb or b > maxb then maxb = b end
        end
      end
    end
    if m > 1 then for q = 1, k do pos[cf[q]] = nil end end
    if k > 0 then
      local h, e = nil, nil  -- the key's head and expiry mark (its decimal string)
      local whole = not dense and spec[8]
      local stale = nil  -- fields of the ring positions a moving head passes over
      if whole then
        local flat = call('HGETALL', key)
        local nf = #flat
        if nf > 64 then dense = true end
        if nf > 0 then
          local hs = nil
          if flat[1] == 'h' then hs = flat[2] else
            for x = 3, nf, 2 do if flat[x] == 'h' then hs = flat[x + 1] break end end
          end
          -- Most heads are the cell's bucket or the one before: compare strings (tonumber is dear).
          if hs == nil then h = nil
          elseif hs == fnames[maxb] then h = maxb
          elseif hs == fnames[maxb - 1] then h = maxb - 1
          else h = tonumber(hs) end
        end
        if h then
          local moves, gone = maxb > h and maxb - h < M, nil
          if moves then gone = passed(spec, h, maxb - h) end
          local n1, n2 = nil, nil
          if k == 1 then
            if cb[1] <= h and cb[1] > h - M then n1, n2 = fnames[cf[1]], fnames[-cf[1] - 1] end
          else
            for q = 1, k do
              local b = cb[q]
              if b <= h and b > h - M then
                want[fnames[cf[q]]] = q
                want[fnames[-cf[q] - 1]] = -q
              end
            end
          end
          for x = 1, nf, 2 do
            local name = flat[x]
            local drop = false
            if gone then
              drop = gone[name]
            elseif moves then
              local f = tonumber(name)
              if f then
                if f < 0 then f = -f - 1 end
                drop = (f % M - h - 1) % M < maxb - h
              end
            end
            if drop then
              stale = stale or {}
              stale[#stale + 1] = name
            elseif name == 'e' then
              e = flat[x + 1]
            elseif k == 1 then
              if name == n1 then sv[1] = nums[flat[x + 1]]
              elseif name == n2 then sw[1] = nums[flat[x + 1]] end
            else
              local q = want[name]
              if q then
                if q > 0 then sv[q] = nums[flat[x + 1]] else sw[-q] = nums[flat[x + 1]] end
              end
            end
          end
          if k > 1 then
            for q = 1, k do
              want[fnames[cf[q]]] = nil
              want[fnames[-cf[q] - 1]] = nil
            end
          end
        end
      else
        local fields = {'h'}
        for q = 1, k do
          fields[2 * q] = fnames[cf[q]]
          fields[2 * q + 1] = fnames[-cf[q] - 1]
        end
        fields[2 * k + 2] = 'e'
        local got = hmget_all(key, fields)
        h, e = tonumber(got[1]), got[2 * k + 2]
        if h then
          for q = 1, k do
            local b = cb[q]
            if b <= h and b > h - M then
              sv[q], sw[q] = tonumber(got[2 * q]) or 0, tonumber(got[2 * q + 1]) or 0
            end
          end
        end
      end
      local newh = h
      if not h or maxb > h then newh = maxb end
      if h and newh > h then
        if newh - h >= M then
          call('DEL', key)
          h, e = nil, nil
          for q = 1, k do sv[q], sw[q] = 0, 0 end
        elseif whole then
          if stale then chunked('HDEL', key, stale, 1000) end
        else
          clear(key, h, newh, M)
        end
      end
      nw = 0
      local mark = nil
      if newh ~= h then
        write[1], write[2], nw = 'h', fnames[newh], 2
        mark = mark_for(e, ttl)
        if mark then write[3], write[4], nw = 'e', fmt(mark), 4 end
      end
      local lowest = nil
      for q = 1, k do
        local b = cb[q]
        if b <= newh - M then
          old = old + 1
        else
          local v, w, v0, w0 = cv[q], cw[q], sv[q], sw[q]
          if v > v0 or w > w0 then
            if v < v0 then v = v0 end
            if w < w0 then w = w0 end
            inc = inc + 1
            if not lowest or b < lowest then lowest = b end
            local f = cf[q]
            if rises and v > v0 and f >= M then  -- a peer slot's count may have risen
              local add = (v - v % SUB) / SUB - (v0 - v0 % SUB) / SUB
              if add > 0 then
                local x = (f - f % M) / M
                if nr == 0 then nr, x1, u1 = 1, x, add  -- the usual case: one peer slot
                elseif x == x1 then u1 = u1 + add
                else
                  local had = rose[x]
                  if had then rose[x] = had + add else nr = nr + 1 rslots[nr] = x rose[x] = add end
                end
              end
            end
            if v > 0 then write[nw + 1], write[nw + 2], nw = fnames[f], fnames[v], nw + 2 end
            if w > 0 then write[nw + 1], write[nw + 2], nw = fnames[-f - 1], fnames[w], nw + 2 end
          end
        end
      end
      if nr > 0 then
        write[nw + 1], write[nw + 2], nw = pnames[x1], risen[u1], nw + 2
        for y = 2, nr do
          local x = rslots[y]
          write[nw + 1], write[nw + 2], nw = pnames[x], risen[rose[x]], nw + 2
          rose[x] = nil
        end
        nr = 0
      end
      -- A key that does not exist and gains nothing is not created.
      if h or lowest then
        if nw == 2 then call('HSET', key, write[1], write[2])  -- the usual sizes, without unpack()
        elseif nw == 4 then call('HSET', key, write[1], write[2], write[3], write[4])
        elseif nw == 6 then call('HSET', key, write[1], write[2], write[3], write[4], write[5], write[6])
        elseif nw == 8 then
          call('HSET', key, write[1], write[2], write[3], write[4], write[5], write[6], write[7], write[8])
        else
          for x = 1, nw, 1000 do
            local y = x + 999
            if y > nw then y = nw end
            call('HSET', key, unpack(write, x, y))
          end
        end
        if mark then arm_expiry(key, mark) end
      end
      if lowest and relaying then
        queued[#queued + 1] = key
        queued[#queued + 1] = fmt(-lowest - 1)
        nq = nq + 1
      end
    end
  end
  o = last
end
if #queued > 0 then
  for r = 1, #relay do enqueue(tag .. '#o:' .. relay[r], tag .. '#t:' .. relay[r], queued, raw) end
end
if parked > 0 then
  local keep = math.floor((park_last - now) / 1000) + 60000  -- ms: the last due time, and a minute to release it
  for _, name in ipairs({pk, pz}) do
    if call('PTTL', name) < keep then call('PEXPIRE', name, keep) end
  end
end
return {1, total, inc, old, fut, unknown, nq * #relay, own_ahead, parked, park_first or -1}
