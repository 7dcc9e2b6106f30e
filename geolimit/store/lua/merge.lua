-- merge: max-merge replicated cells into one shard (idempotent, commutative).
-- KEYS: registry, then one data key per key entry
-- ARGV: now_us|'', region, nonce, nslots, slot ids..., then per key:
--   res_us, N, M, F, ttl_ms, ncells, then per cell: bucket, slot_ref, value, floor
-- Cells outside [c - N, c + F] are dropped (too old to matter / too far in the
-- future: anti-entropy delivers those once the local clock has caught up).
-- Reply: {increased, dropped_old, dropped_future}; increased is a flat list of
--   (key_number, cell_number) pairs, 1-based, of cells that raised this region's state.
local now = clock(ARGV[1])
local reg = KEYS[1]
ensure_registry(reg, ARGV[2], ARGV[3])
local nslots = tonumber(ARGV[4])
local idx = {}
if nslots > 0 then
  local ids = {}
  for i = 1, nslots do ids[i] = ARGV[4 + i] end
  local got = call('HMGET', reg, unpack(ids))
  for i = 1, nslots do
    local v = got[i]
    if not v then
      v = call('HINCRBY', reg, '#', 1) - 1
      call('HSET', reg, ids[i], v)
    end
    idx[i] = tonumber(v)
  end
end
local used = tonumber(call('HGET', reg, '#'))
local a = 5 + nslots
local inc, old, fut = {}, 0, 0
for k = 2, #KEYS do
  local key = KEYS[k]
  local res, N, M, F = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local ttl, n = ARGV[a + 4], tonumber(ARGV[a + 5])
  a = a + 6
  local c = bucket(now, res)
  local cells, fields, maxb = {}, {'h'}, nil
  for j = 1, n do
    local b, s = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    local v, fl = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    a = a + 4
    if b > c + F then
      fut = fut + 1
    elseif b < c - N then
      old = old + 1
    else
      local f = idx[s + 1] * M + b % M
      cells[#cells + 1] = {b, f, v, fl, j}
      fields[#fields + 1] = f
      fields[#fields + 1] = -f - 1
      if not maxb or b > maxb then maxb = b end
    end
  end
  if #cells > 0 then
    local got = call('HMGET', key, unpack(fields))
    local h = tonumber(got[1])
    local newh = h
    if not h or maxb > h then newh = maxb end
    if h and newh > h then
      if newh - h >= M then
        call('DEL', key)
        h = nil
      else
        -- Clear the ring positions of buckets h+1..newh. Naming every candidate
        -- field costs (newh - h) * slots * 2 lookups: past the hash's own size it
        -- is cheaper to list the fields that exist and pick those.
        local del, span = {}, newh - h
        if span * used * 2 <= call('HLEN', key) then
          for b = h + 1, newh do
            local p = b % M
            for s = 0, used - 1 do
              del[#del + 1] = s * M + p
              del[#del + 1] = -(s * M + p) - 1
            end
          end
        else
          local names = call('HKEYS', key)
          for i = 1, #names do
            local f = tonumber(names[i])
            if f then
              if f < 0 then f = -f - 1 end
              if (f % M - h - 1) % M < span then del[#del + 1] = names[i] end
            end
          end
        end
        if #del > 0 then chunked('HDEL', key, del, 1000) end
      end
    end
    local target, set = {}, {}
    for i = 1, #cells do
      local cell = cells[i]
      local b, f = cell[1], cell[2]
      if b <= newh - M then
        old = old + 1
      else
        local cur = target[f]
        if not cur then
          cur = {0, 0}
          if h and b <= h and b > h - M then
            cur = {tonumber(got[2 * i]) or 0, tonumber(got[2 * i + 1]) or 0}
          end
          target[f] = cur
          set[#set + 1] = f
        end
        local up = false
        if cell[3] > cur[1] then cur[1] = cell[3] up = true end
        if cell[4] > cur[2] then cur[2] = cell[4] up = true end
        if up then
          cur[3] = true
          inc[#inc + 1] = k - 1
          inc[#inc + 1] = cell[5]
        end
      end
    end
    local write = {}
    if newh ~= h then
      write[1] = 'h'
      write[2] = newh
    end
    for i = 1, #set do
      local f = set[i]
      local cur = target[f]
      if cur[3] then
        if cur[1] > 0 then write[#write + 1] = f write[#write + 1] = cur[1] end
        if cur[2] > 0 then write[#write + 1] = -f - 1 write[#write + 1] = cur[2] end
      end
    end
    if #write > 0 then chunked('HSET', key, write, 1000) end
    if newh ~= h then call('PEXPIRE', key, ttl) end
  end
end
return {inc, old, fut}
