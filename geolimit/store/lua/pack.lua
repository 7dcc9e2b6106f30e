-- pack: take up to max_keys keys from this shard's outbox for a peer into
-- in-flight slot w, and return their cells as one msgpack blob. The keys come
-- from HGETALL when the whole outbox fits, else from a bounded HSCAN (outbox.lua
-- take); the slot gets one field per call (see outbox.lua).
-- KEYS: registry
-- ARGV: now_us|'', peer, w, max_keys, max_cells, nrules, then per rule: name, res_us, N, M
-- Reply: {blob|'', keys, cells, outbox_left, unknown, bad, queued_at}
--   blob: msgpack [slots, keys, counts, cells]; keys[i] is a data key after
--   '<tag>:' (rule:subject), counts[i] its number of cells, and cells is flat
--   bucket, slot_ref (0-based into slots), value, floor, in key order (four
--   flat lists: cmsgpack builds and reads them much faster than a list per key).
--   Keys of unknown rules and keys that expired are dropped from the outbox;
--   stored values that are not exact integers are skipped and counted in bad.
--   queued_at: when the oldest entry of the outbox this call took from was queued
--   (µs, the in-flight hash's '@t'), -1 if it moved nothing (the peer's lag counts it).
--   Then, only if slot w held another type (junk, deleted: see below), {slot key}.
local reg = KEYS[1]
local raw = clock(ARGV[1])  -- this Redis's clock: in-flight times
local now = raw + correction(reg)  -- the region clock: which buckets are current
local tag = tag_of(reg)
local peer = ARGV[2]
local box, since = tag .. '#o:' .. peer, tag .. '#t:' .. peer
local flight = tag .. '#f:' .. peer .. ':' .. ARGV[3]
local max_keys, max_cells = tonumber(ARGV[4]), tonumber(ARGV[5])
local rules = {}
local a = 7
for _ = 1, tonumber(ARGV[6]) do
  local res = tonumber(ARGV[a + 1])
  -- res, N, M, the current bucket, and the HMGET field lists by first bucket
  rules[ARGV[a]] = {res, tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), bucket(now, res), {}}
  a = a + 4
end
local n = call('HLEN', box)
if n == 0 then
  call('DEL', since)
  return {'', 0, 0, 0, 0, 0, -1}
end
local taken, whole = take(box, n, max_keys, raw)

-- slot index -> slot id. A wide entry sends the peer's own slots too: a reset
-- here raised their floors, and the peer accepts an echo of its own counts.
local names = nil
local function load_names()
  names = {}
  local flat = call('HGETALL', reg)
  for i = 1, #flat, 2 do
    local id = flat[i]
    if string.find(id, '/', 1, true) then
      local idx = tonumber(flat[i + 1])
      if idx then names[idx] = id end
    end
  end
end

local slots, refs = {}, {}
local function ref(idx)
  local r = refs[idx]
  if not r then
    slots[#slots + 1] = names[idx]
    r = #slots - 1
    refs[idx] = r
  end
  return r
end

local function num(s)
  local v = tonumber(s)
  if not v or v < 0 or v > MAX_VALUE or v ~= math.floor(v) then return nil end
  return v
end

local bkeys, bcounts, cells = {}, {}, {}  -- the blob's keys, cells per key, flat cells
local moved, done, rest, empty = {}, {}, {}, {}
local nm, nd = 0, 0
local nkeys, ncells, unknown, bad = 0, 0, 0, 0
local head = #tag + 2
-- Numbers go through the prelude's per-call cache (strnum): outbox entries and heads
-- repeat a few buckets, and tonumber() costs more than a table lookup.
-- The previous key's 'rule:' (its only ':' is its last byte) and rule: a key that starts
-- with it has that rule (keys mostly share one; a C call a key less).
local last_head, last_len, last_spec = nil, 0, nil
local find, sub = string.find, string.sub
for i = 1, #taken, 2 do
  if ncells >= max_cells then break end
  local key, entry = taken[i], taken[i + 1]
  nd = nd + 1
  done[nd] = key
  local from, wide = strnum[entry], false
  if from and from < 0 then from, wide = -from - 1, true end
  local suffix = sub(key, head)
  local spec
  if last_head and sub(suffix, 1, last_len) == last_head then
    spec = last_spec
  else
    local stop = find(suffix, ':', 1, true)
    spec = stop and rules[sub(suffix, 1, stop - 1)]
    if stop then last_head, last_len, last_spec = sub(suffix, 1, stop), stop, spec end
  end
  if not spec or not from then
    unknown = unknown + 1
    empty[#empty + 1] = key
  else
    local N, M, c = spec[2], spec[3], spec[4]
    local lo = from
    if lo < c - N then lo = c - N end
    local base = 4 * ncells  -- this key's cells go to cells[base + 1 ..]
    local n4 = base
    if wide then
      local flat = call('HGETALL', key)
      local h, vals, floors = nil, {}, {}
      for j = 1, #flat, 2 do
        local f = tonumber(flat[j])
        if not f then
          if flat[j] == 'h' then h = tonumber(flat[j + 1]) end
        elseif f < 0 then
          floors[-f - 1] = flat[j + 1]
        else
          vals[f] = flat[j + 1]
          floors[f] = floors[f] or '0'
        end
      end
      if h then
        if not names then load_names() end
        for f, fl in pairs(floors) do
          local b = h - (h - f % M) % M
          local idx = (f - f % M) / M
          if b >= lo and names[idx] then
            local v, w = num(vals[f] or '0'), num(fl)
            if v and w then
              if v > 0 or w > 0 then
                cells[n4 + 1], cells[n4 + 2], cells[n4 + 3], cells[n4 + 4] = b, ref(idx), v, w
                n4 = n4 + 4
              end
            else
              bad = bad + 1
            end
          end
        end
      end
    elseif lo <= c then
      if not names then load_names() end
      local fields = spec[5][lo]
      if not fields then
        fields = {'h'}
        for b = lo, c do fields[#fields + 1] = fmt(b % M) end
        if c - lo < 8 then spec[5][lo] = fields end  -- cache only short lists
      end
      -- Own values only: this region's floors change only by a reset, which queues
      -- a wide entry (entries combine to the wider scope), so a narrow entry sends
      -- floor 0 and the peer keeps the floor it has (a max).
      local got
      if lo == c then  -- the usual case: one bucket, no unpack()
        got = call('HMGET', key, 'h', fields[2])
      else
        got = call('HMGET', key, unpack(fields))
      end
      local h = got[1] and strnum[got[1]]
      if h and names[0] then
        local r0 = refs[0] or ref(0)
        for b = lo, c do
          local x = got[b - lo + 2]
          if x and b <= h and b > h - M then
            local v = strnum[x]
            -- an exact integer in [0, MAX_VALUE] (NaN fails v >= 0; v % 1 is 0 for integers only)
            if v and v >= 0 and v <= MAX_VALUE and v % 1 == 0 then
              cells[n4 + 1], cells[n4 + 2], cells[n4 + 3], cells[n4 + 4] = b, r0, v, 0
              n4 = n4 + 4
            else
              bad = bad + 1
            end
          end
        end
      end
    end
    local room = max_cells - ncells
    if (n4 - base) / 4 > room then
      -- A key larger than the room left (3600 buckets x 3 regions is 10800 cells):
      -- send its oldest buckets now and queue the rest from the first bucket left out.
      local order = {}
      for j = base + 1, n4, 4 do order[#order + 1] = {cells[j], cells[j + 1], cells[j + 2], cells[j + 3]} end
      table.sort(order, function(x, y) return x[1] < y[1] end)
      local cut = order[room + 1][1]
      if cut == order[1][1] then  -- one bucket (at most max_slots cells) always fits in a blob
        for j = 2, #order do if order[j][1] > cut then cut = order[j][1] break end end
        if cut == order[1][1] then cut = order[#order][1] + 1 end
      end
      for j = n4, base + 1, -1 do cells[j] = nil end
      n4 = base
      for j = 1, #order do
        local x = order[j]
        if x[1] < cut then
          cells[n4 + 1], cells[n4 + 2], cells[n4 + 3], cells[n4 + 4] = x[1], x[2], x[3], x[4]
          n4 = n4 + 4
        end
      end
      rest[#rest + 1] = key
      rest[#rest + 1] = wide and fmt(-cut - 1) or fmt(cut)
    end
    if n4 > base then
      nkeys = nkeys + 1
      bkeys[nkeys], bcounts[nkeys] = suffix, (n4 - base) / 4
      ncells = n4 / 4
      moved[nm + 1], moved[nm + 2], nm = key, entry, nm + 2
    else
      empty[#empty + 1] = key  -- nothing to send: leaves the outbox, not put in flight
    end
  end
end
-- Move what was sent from the outbox into in-flight slot w: the whole outbox by
-- RENAME when all of it was taken into an empty slot (O(1)), else one field per
-- call, '#<n>' -> msgpack {key, entry, ...} (cheaper than one hash field per key).
local emptied = whole and nd * 2 == #taken
local queued_at = nm > 0 and call('GET', since)
-- The slot's fields, read before anything is written: a slot of another type (junk)
-- is deleted here (its entries are unknown: anti-entropy repairs their cells), where
-- a failure after the outbox lost the batch would lose it for good.
local junk = nil
local held = 0
if nm > 0 then
  held = redis.pcall('HLEN', flight)
  if type(held) ~= 'number' then  -- an error reply: nothing was written yet
    if not wrongtype(held) then return held end
    junk = delete_junk({flight, 'hash'})
    if #junk == 0 then return held end
    held = 0
  end
end
if emptied and nm > 0 and held == 0 then
  call('RENAME', box, flight)  -- O(1): the flight holds key -> entry fields (in_flight reads both layouts)
  if #empty > 0 then chunked('HDEL', flight, empty, 1000) end
else
  if emptied then call('UNLINK', box) else chunked('HDEL', box, done, 1000) end
  if nm > 0 then
    local n = held - call('HEXISTS', flight, '@t')
    call('HSET', flight, '#' .. fmt(n + 1), cmsgpack.pack(moved))
  end
end
if queued_at then call('HSETNX', flight, '@t', queued_at) end  -- the oldest entry's age goes with it
if #rest > 0 then enqueue(box, since, rest, raw) end
local left = 0
if not emptied or #rest > 0 then left = call('HLEN', box) end
if left == 0 then call('DEL', since) end
if nkeys == 0 then return {'', 0, 0, left, unknown, bad, -1, junk} end
return {cmsgpack.pack({slots, bkeys, bcounts, cells}), nkeys, ncells, left, unknown, bad, tonumber(queued_at) or -1,
        junk}
