-- ae_read: the live cells of some keys of one shard, as merge blobs.
-- KEYS: the shard's registry, then the data keys
-- ARGV: now_us, position to resume the first key at (0: from the start), max
--   fields, big key fields, max cells per blob, then per data key: res_us, N, M, F
-- Reads keys in order until max fields are reached (always at least one key or
-- chunk). A key with more than big-key fields (or resumed) is read in chunks of
-- ring positions, one HMGET each, so no call reads much more than max fields.
-- Reply: {done, position, blobs}: the first `done` keys were read entirely, the
--   next one up to ring position `position` (0: not at all). A blob is
--   cmsgpack {slot ids, keys, counts, cells} (see pack.lua) with at most
--   max-cells cells; a key may continue in the next blob.
local now = tonumber(ARGV[1])
local pos, budget, big_fields, max_cells = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local reg = call('HGETALL', KEYS[1])
local ids, nslots = {}, 0
for i = 1, #reg, 2 do
  if find(reg[i], '/', 1, true) then
    local index = fieldnum(reg[i + 1])
    if index and not ids[index] then
      ids[index] = reg[i]
      nslots = nslots + 1
    end
  end
end

-- A blob also ends once its subjects pass 256 KiB (2048 keys of 4 KiB subjects
-- would make one of 8 MiB).
local blobs = {}
local slots, refs, keys, counts, flat, current, ncells, nbytes
local function flush()
  if slots then blobs[#blobs + 1] = cmsgpack.pack({slots, keys, counts, flat}) end
  slots = nil
end
local function add(suffix, slot, b, v, fl)
  if slots and (ncells >= max_cells or nbytes >= 262144) then flush() end
  if not slots then
    slots, refs, keys, counts, flat, ncells, current, nbytes = {}, {}, {}, {}, {}, 0, nil, 0
  end
  if current ~= suffix then
    nbytes = nbytes + #suffix
    keys[#keys + 1] = suffix
    counts[#keys] = 0
    current = suffix
  end
  local id = ids[slot]
  local ref = refs[id]
  if not ref then
    ref = #slots
    slots[ref + 1] = id
    refs[id] = ref
  end
  counts[#keys] = counts[#keys] + 1
  local n = 4 * ncells
  flat[n + 1] = b
  flat[n + 2] = ref
  flat[n + 3] = v
  flat[n + 4] = fl
  ncells = ncells + 1
end

local used, done, stopped, cells = 0, 0, false, {}
local chunk = 1
if nslots > 0 and big_fields >= 2 * nslots then chunk = (big_fields - big_fields % (2 * nslots)) / (2 * nslots) end
for j = 2, #KEYS do
  local key = KEYS[j]
  local o = 6 + (j - 2) * 4
  local res = tonumber(ARGV[o])
  local rule = {(now - now % res) / res, tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3])}
  local M = rule[3]
  local suffix = sub(key, find(key, '}', 1, true) + 2)
  local whole = false
  if pos == 0 then
    local len = redis.pcall('HLEN', key)
    if type(len) ~= 'number' then len = 0 end  -- not a hash: no cells
    if len <= big_fields then
      if used > 0 and used + len > budget then
        stopped = true
      else
        used = used + len
        if len > 0 and nslots > 0 then
          local n = cells_of(call('HGETALL', key), rule, ids, cells)
          for i = 1, 4 * n, 4 do add(suffix, cells[i], cells[i + 1], cells[i + 2], cells[i + 3]) end
        end
        whole = true
      end
    end
  end
  if stopped then break end
  if not whole and nslots > 0 then
    while pos < M do
      local p1 = pos + chunk
      if p1 > M then p1 = M end
      local need = 2 * nslots * (p1 - pos)
      if used > 0 and used + need > budget then
        stopped = true
        break
      end
      local n = cells_in_range(key, rule, ids, pos, p1, cells)
      for i = 1, 4 * n, 4 do add(suffix, cells[i], cells[i + 1], cells[i + 2], cells[i + 3]) end
      used = used + need
      pos = p1
    end
  end
  if stopped then break end
  pos = 0
  done = done + 1
end
flush()
return {done, pos, blobs}
