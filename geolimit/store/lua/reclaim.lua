-- reclaim: take back the slot indices of a shard's registry whose incarnation
-- wrote nothing here for a long time, so that wipes (each one a new incarnation
-- of the wiped region) never fill the registry (merge.lua refuses new slot ids
-- once max_slots are live).
-- KEYS: registry
-- ARGV: now_us|'', idle_us, region
-- A slot that has written no cell here (merge.lua stamps 't<index>' = now on
-- every write) for idle_us has no cell left in any live window: idle_us is
-- longer than every rule's window plus its keys' TTL and the parking span. Its
-- id and stamp are deleted and its index joins the free list 'F', for merge.lua
-- to hand out again; stale cells under that index are older than any window
-- (dropped as such wherever read). This region's current slot ('@') is never
-- taken back; a slot with no stamp (registered before stamps existed) is stamped
-- now, and reclaimable idle_us later.
-- Reply: {slot ids reclaimed, free indices after}
local reg = KEYS[1]
local now = clock(ARGV[1]) + correction(reg)
local idle, region = tonumber(ARGV[2]), ARGV[3]
local flat = call('HGETALL', reg)
local ids, stamps, own, free = {}, {}, nil, nil
for i = 1, #flat, 2 do
  local name, value = flat[i], flat[i + 1]
  if name == '@' then own = value
  elseif name == 'F' then free = value
  elseif string.byte(name, 1) == 116 then stamps[string.sub(name, 2)] = tonumber(value)  -- 't'
  elseif string.find(name, '/', 1, true) then ids[#ids + 1] = {name, value}
  end
end
local gone, unstamped, back = {}, {}, {}
for _, e in ipairs(ids) do
  local id, index = e[1], e[2]
  if id ~= region .. '/' .. (own or '') then
    local at = stamps[index]
    if not at then
      unstamped[#unstamped + 1] = 't' .. index
      unstamped[#unstamped + 1] = fmt(now)
    elseif now - at > idle then
      gone[#gone + 1] = id
      gone[#gone + 1] = 't' .. index
      back[#back + 1] = index
    end
  end
end
if #unstamped > 0 then call('HSET', reg, unpack(unstamped)) end
local nfree = 0
if free then for _ in string.gmatch(free, '%d+') do nfree = nfree + 1 end end
if #back > 0 then
  call('HDEL', reg, unpack(gone))
  local list = table.concat(back, ' ')
  if free and free ~= '' then list = free .. ' ' .. list end
  call('HSET', reg, 'F', list)
end
return {#back, nfree + #back}
