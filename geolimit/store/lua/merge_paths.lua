-- merge, part 2 of 3 (after merge.lua, before merge_apply.lua; one chunk, see
-- geolimit/store/scripts.py): the helpers of the writes and the one-cell path.
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
-- A parking key of another type (junk) failed every merge that parked, for good (the
-- sender's message refused, sent again and again): on WRONGTYPE it is deleted
-- (outbox.lua repair_park), once a call, and the cell parked again (park_junk: the
-- keys deleted, for the reply).
local pk, pz = tag .. '#pk', tag .. '#pz'
local park_room, parked, park_first, park_last, park_junk = nil, 0, nil, nil, nil
local function park_cell(field, v, w, due_us)
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
  call('ZADD', pz, fmt(due_us), field)  -- (a rerun after a junk pz writes the same again)
  return true
end
local function park(suffix, b, id, v, w, due_us)
  local field = fmt(b) .. ':' .. fmt(#id) .. ':' .. id .. suffix
  local ok, done = pcall(park_cell, field, v, w, due_us)
  if not ok then
    if park_junk or not wrongtype(done) then error(done, 0) end
    local due
    park_junk, due = repair_park(pk, pz, now)
    if #park_junk == 0 then error(done, 0) end
    if due > 0 and (not park_first or now < park_first) then park_first = now end
    park_room = nil
    done = park_cell(field, v, w, due_us)
  end
  if not done then return false end
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
-- gnum[name]: a field name's cell number (value or floor field alike), false for other names.
local gnum = setmetatable({}, {__index = function(cache, s)
  local g = tonumber(s)
  if g and g < 0 then g = -g - 1 end
  cache[s] = g or false
  return g or false
end})
-- The low mark to write for a key read whole (flat) with head h, at most `low`: the
-- oldest bucket of a field kept. A moving head that cleared stale fields (a key whose
-- ring is full, or nearly) keeps nothing before newh - M + 1, so that bound is
-- used instead of walking the fields again (a busy key gains nothing from an exact mark).
local function oldest_kept(flat, h, M, low, stale, newh)
  if stale then
    local bound = newh - M + 1
    if bound < low then low = bound end
    return low
  end
  for x = 1, #flat, 2 do
    local g = gnum[flat[x]]
    if g then
      local kb = h - (h - g % M) % M
      if kb < low then low = kb end
    end
  end
  return low
end
-- HSET key with the first nw items of write (field, value, ...): the usual sizes
-- without unpack(), a large key's in chunks (unpack() is limited by Lua's C stack).
local function write_fields(key, nw)
  if nw == 2 then call('HSET', key, write[1], write[2])
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
end

local prefix = tag .. ':'
local function merge_one(i, o, spec)
  local b, r = cells[o + 1], cells[o + 2]
  local c = spec[6]
  if r < 0 or b > c + spec[4] or b < c - spec[2] or dense or not spec[8] then return false end
  local M = spec[3]
  local f = idx[r + 1] * M + b % M
  local key = prefix .. keys[i]
  local fv, fw = fnames[f], fnames[-f - 1]
  -- The low mark 'l' says no cell field lies below bucket l: a head that moves to b
  -- with b - M < l passes over no stored field, and the cell's own position then
  -- holds nothing, so the key need not be read whole (design section 2).
  local got = call('HMGET', key, 'h', 'l', 'e')
  local hs, ls, es = got[1], got[2], got[3]
  local h, l, fast = nil, nil, false
  if not hs then  -- (a missing field is false in Lua)
    fast = not ls and not es  -- no head: a new key
  elseif ls then
    if hs == fnames[b] then h = b elseif hs == fnames[b - 1] then h = b - 1 else h = strnum[hs] or nil end
    l = strnum[ls]  -- (the prelude's cache of numbers: the keys of a blob share a few marks and heads)
    fast = h and l and (b <= h or (b - M < l and b - h < M)) or false
  end
  local e, v0, w0, low, ls0, stale = es, 0, 0, nil, ls, nil
  if fast then
    if h and b <= h and b > h - M then
      local had = call('HMGET', key, fv, fw)
      v0, w0 = nums[had[1] or '0'], nums[had[2] or '0']
    end
    low = l or (c - spec[4])  -- a new key's mark: c - F, lowered below if its cell is older
  else
    local flat = call('HGETALL', key)
    local nf = #flat
    if nf > 64 then dense = true end
    h, e, v0, w0, stale = nil, nil, 0, 0, nil
    low = c - spec[4]  -- the low mark to write: at most the oldest bucket of a field kept
    ls0 = nil  -- the stored low mark
    if nf > 0 then
      local hs = nil
      if flat[1] == 'h' then hs = flat[2] else
        for x = 3, nf, 2 do if flat[x] == 'h' then hs = flat[x + 1] break end end
      end
      if hs == nil then h = nil
      elseif hs == fnames[b] then h = b
      elseif hs == fnames[b - 1] then h = b - 1
      else h = strnum[hs] or nil end
    end
    if h then
      local span = b - h
      local moves = span > 0 and span < M
      local gone = nil
      if moves then gone = passed(spec, h, span) end
      local n1, n2 = nil, nil
      if b <= h and b > h - M then n1, n2 = fv, fw end
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
        elseif name == 'l' then ls0 = flat[x + 1]
        else
          if name == n1 then v0 = nums[flat[x + 1]]
          elseif name == n2 then w0 = nums[flat[x + 1]] end
        end
      end
      low = oldest_kept(flat, h, M, low, stale, b)
    elseif nf > 0 then
      low = nil  -- fields but no head: leave the key without a low mark
    end
  end
  local newh = h
  if not h or b > h then newh = b end
  if h and newh > h then
    if newh - h >= M then
      call('DEL', key)
      h, e, v0, w0, low = nil, nil, 0, 0, c - spec[4]
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
      if low and b < low then low = b end
      if stamp and spec[9] and v > v0 and f >= M then  -- a peer slot's count may have risen (floors applied)
        -- counted(v, w) - counted(v0, w0), inline (four calls a key less)
        local cv, cw = (v - v % SUB) / SUB, (w - w % SUB) / SUB
        local add = cv > cw and cv - cw or 0
        cv, cw = (v0 - v0 % SUB) / SUB, (w0 - w0 % SUB) / SUB
        if cv > cw then add = add - (cv - cw) end
        if add > 0 then write[nw + 1], write[nw + 2], nw = pnames[(f - f % M) / M], risen[add], nw + 2 end
      end
      if v > 0 then write[nw + 1], write[nw + 2], nw = fv, fnames[v], nw + 2 end
      if w > 0 then write[nw + 1], write[nw + 2], nw = fw, fnames[w], nw + 2 end
    end
  end
  if low and (h or lowest) and fnames[low] ~= ls0 then write[nw + 1], write[nw + 2], nw = 'l', fnames[low], nw + 2 end
  if h or lowest then  -- a key that does not exist and gains nothing is not created
    if nw == 6 then  -- (P8's usual: head, cell, rise; a call less)
      call('HSET', key, write[1], write[2], write[3], write[4], write[5], write[6])
    elseif nw > 0 then
      write_fields(key, nw)
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

