-- pack: take up to max_keys keys from this shard's outbox for a peer into
-- in-flight slot w, and return their cells as one msgpack blob.
-- KEYS: registry
-- ARGV: now_us|'', peer, w, max_keys, max_cells, nrules, then per rule: name, res_us, N, M
-- Reply: {blob|'', keys, cells, outbox_left, unknown, bad}
--   blob: msgpack [slots, suffix, cells, suffix, cells, ...]; suffix is the data
--   key after '<tag>:' (rule:subject); cells is flat bucket, slot_ref (0-based
--   into slots), value, floor. Keys of unknown rules and keys that expired are
--   dropped from the outbox; stored values that are not exact integers are
--   skipped and counted in bad.
local now = clock(ARGV[1])
local reg = KEYS[1]
local tag = tag_of(reg)
local peer = ARGV[2]
local box, since = tag .. '#o:' .. peer, tag .. '#t:' .. peer
local flight = tag .. '#f:' .. peer .. ':' .. ARGV[3]
local max_keys, max_cells = tonumber(ARGV[4]), tonumber(ARGV[5])
local rules = {}
local a = 7
for _ = 1, tonumber(ARGV[6]) do
  rules[ARGV[a]] = {tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])}
  a = a + 4
end
local taken = {}
if call('EXISTS', box) == 1 then taken = call('HRANDFIELD', box, max_keys, 'WITHVALUES') end
if #taken == 0 then
  call('DEL', since)
  return {'', 0, 0, 0, 0, 0}
end

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

local blob = {slots}
local moved, done, rest = {}, {}, {}
local nkeys, ncells, unknown, bad = 0, 0, 0, 0
local head = #tag + 2
for i = 1, #taken, 2 do
  if ncells >= max_cells then break end
  local key, entry = taken[i], taken[i + 1]
  done[#done + 1] = key
  local from, wide = decode_entry(entry)
  local suffix = string.sub(key, head)
  local stop = string.find(suffix, ':', 1, true)
  local spec = stop and rules[string.sub(suffix, 1, stop - 1)]
  if not spec or not from then
    unknown = unknown + 1
  else
    local res, N, M = spec[1], spec[2], spec[3]
    local c = bucket(now, res)
    local lo = from
    if lo < c - N then lo = c - N end
    local cells = {}
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
                cells[#cells + 1] = b
                cells[#cells + 1] = ref(idx)
                cells[#cells + 1] = v
                cells[#cells + 1] = w
              end
            else
              bad = bad + 1
            end
          end
        end
      end
    elseif lo <= c then
      if not names then load_names() end
      local fields = {'h'}
      for b = lo, c do
        fields[#fields + 1] = fmt(b % M)
        fields[#fields + 1] = fmt(-(b % M) - 1)
      end
      local got = call('HMGET', key, unpack(fields))
      local h = tonumber(got[1])
      if h and names[0] then
        for b = lo, c do
          local k = 2 * (b - lo) + 2
          if b <= h and b > h - M and (got[k] or got[k + 1]) then
            local v, w = num(got[k] or '0'), num(got[k + 1] or '0')
            if v and w then
              cells[#cells + 1] = b
              cells[#cells + 1] = ref(0)
              cells[#cells + 1] = v
              cells[#cells + 1] = w
            else
              bad = bad + 1
            end
          end
        end
      end
    end
    local room = max_cells - ncells
    if #cells / 4 > room then
      -- A key larger than the room left (3600 buckets x 3 regions is 10800 cells):
      -- send its oldest buckets now and queue the rest from the first bucket left out.
      local order = {}
      for j = 1, #cells, 4 do order[#order + 1] = {cells[j], cells[j + 1], cells[j + 2], cells[j + 3]} end
      table.sort(order, function(x, y) return x[1] < y[1] end)
      local cut = order[room + 1][1]
      if cut == order[1][1] then  -- one bucket (at most max_slots cells) always fits in a blob
        for j = 2, #order do if order[j][1] > cut then cut = order[j][1] break end end
        if cut == order[1][1] then cut = order[#order][1] + 1 end
      end
      cells = {}
      for j = 1, #order do
        local x = order[j]
        if x[1] < cut then
          cells[#cells + 1] = x[1]
          cells[#cells + 1] = x[2]
          cells[#cells + 1] = x[3]
          cells[#cells + 1] = x[4]
        end
      end
      rest[#rest + 1] = key
      rest[#rest + 1] = wide and fmt(-cut - 1) or fmt(cut)
    end
    if #cells > 0 then
      blob[#blob + 1] = suffix
      blob[#blob + 1] = cells
      nkeys = nkeys + 1
      ncells = ncells + #cells / 4
      moved[#moved + 1] = key
      moved[#moved + 1] = entry
    end
  end
end
chunked('HDEL', box, done, 1000)
if #rest > 0 then enqueue(box, since, rest, now) end
if #moved > 0 then enqueue(flight, nil, moved, now) end
local left = call('HLEN', box)
if left == 0 then call('DEL', since) end
if nkeys == 0 then return {'', 0, 0, left, unknown, bad} end
return {cmsgpack.pack(blob), nkeys, ncells, left, unknown, bad}
