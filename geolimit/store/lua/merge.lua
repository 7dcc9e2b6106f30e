-- merge (part 1 of 3; merge_paths.lua and merge_apply.lua follow in the same chunk,
-- see geolimit/store/scripts.py): validate a peer's blob for one shard, then max-merge its cells.
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
--   first parked due (µs on the region clock, -1: none), then, only if any, the
--   parking keys of another type deleted (merge_paths.lua park)}; fields may be
--   appended to this reply, so readers ignore what they do not know.
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
  local longest = 0
  for i = 1, n do
    local suffix = keys[i]
    if type(suffix) ~= 'string' or #suffix < 3 or #suffix > 4200 then return refuse('bad key') end
    if #suffix > longest then longest = #suffix end
  end
  -- A subject (after the first ':') over 4096 bytes (MAX_SUBJECT_BYTES): no limiter writes
  -- one, and anti-entropy cannot exchange it. Only a key over 4097 bytes can hold one, and
  -- only with a ':' in its first #suffix - 4097 bytes (at most 103 are searched a key).
  if longest > 4097 then
    for i = 1, n do
      local suffix = keys[i]
      if #suffix > 4097 and string.find(string.sub(suffix, 1, #suffix - 4097), ':', 1, true) then
        return refuse("a key's subject is over 4096 bytes")
      end
    end
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
-- The previous key's 'rule:' (its only ':' is its last byte) and rule: a key that starts
-- with it has that rule (keys of a blob mostly share one; a C call a key less).
local last_head, last_len, last_spec = nil, 0, false
local find, sub = string.find, string.sub
for i = 1, n do
  local suffix, m = keys[i], counts[i]
  local known
  if last_head and sub(suffix, 1, last_len) == last_head then
    known = last_spec
  else
    local stop = find(suffix, ':', 1, true)
    known = stop and rules[sub(suffix, 1, stop - 1)] or false
    if stop then last_head, last_len, last_spec = sub(suffix, 1, stop), stop, known end
  end
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

