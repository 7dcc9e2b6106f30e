-- merge: validate a peer's blob for one shard, then max-merge its cells.
-- KEYS: registry
-- ARGV: now_us|'', region, nonce, apply (1|0), max_cells, max_new_slots,
--       max_slots, nregions, regions..., nrules, per rule: name, res_us, N, M, F, ttl_ms,
--       nrelay, relay peers..., blob
-- The blob is msgpack [slots, suffix, cells, suffix, cells, ...] (see pack.lua).
-- Every check runs before any write; with apply = 0 nothing is written at all.
-- Refused: {0, reason}. Accepted: {1, cells, increased, dropped_old, dropped_future,
--   unknown_rule, relayed (keys queued for relay peers)}
-- Cells outside [c - N, c + F] are dropped (too old to matter / too far in the
-- future). Keys whose state rose are queued, every slot from the lowest raised
-- bucket, in the outboxes of the relay peers.
local now = clock(ARGV[1])
local reg = KEYS[1]
local region, nonce = ARGV[2], ARGV[3]
local apply = ARGV[4] == '1'
local max_cells, max_new, max_slots = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local allowed = {}
local a = 9
for _ = 1, tonumber(ARGV[8]) do allowed[ARGV[a]] = true a = a + 1 end
local rules = {}
local nrules = tonumber(ARGV[a])
a = a + 1
for _ = 1, nrules do
  rules[ARGV[a]] = {tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
                    tonumber(ARGV[a + 4]), ARGV[a + 5]}
  a = a + 6
end
local relay = {}
for _ = 1, tonumber(ARGV[a]) do relay[#relay + 1] = ARGV[a + 1] a = a + 1 end
local blob = ARGV[a + 1]

local function refuse(why) return {0, why} end

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
if fresh > max_new then return refuse('too many new slot ids in one blob') end
local used = tonumber(call('HGET', reg, '#')) or 1
if used + fresh > max_slots then return refuse("the shard's slot registry is full") end

-- Check every key and cell first.
local total, unknown = 0, 0
local needed = {}  -- slots that cells of known rules use: only those are registered
local n = #t
if n % 2 ~= 1 then return refuse('blob has a key without cells') end
for i = 2, n, 2 do
  local suffix, cells = t[i], t[i + 1]
  if type(suffix) ~= 'string' or #suffix < 3 or #suffix > 4200 then return refuse('bad key') end
  if type(cells) ~= 'table' then return refuse('bad cell list') end
  local m = #cells
  if m % 4 ~= 0 then return refuse('cells are not bucket, slot, value, floor quadruples') end
  total = total + m / 4
  if total > max_cells then return refuse('too many cells in one blob') end
  local stop = string.find(suffix, ':', 1, true)
  local known = stop and rules[string.sub(suffix, 1, stop - 1)]
  if not known then unknown = unknown + m / 4 end
  for j = 1, m do
    local x = cells[j]
    if type(x) ~= 'number' or x ~= x or x < 0 or x ~= math.floor(x) then
      return refuse('a cell field is not a non-negative integer')
    end
    local kind = j % 4
    if kind == 2 then
      if x >= nslots then return refuse('slot reference out of range') end
      if known then needed[x + 1] = true end
    elseif x > MAX_VALUE then
      return refuse('a cell value is out of range')
    end
  end
  -- This region is the only writer of its current slot: an echo of it is fine,
  -- a claim of more than it counted is refused.
  if known and own_ref then
    local M = known[3]
    for j = 1, m, 4 do
      if cells[j + 1] == own_ref then
        local b = cells[j]
        local got = call('HMGET', tag_of(reg) .. ':' .. suffix, 'h', fmt(b % M))
        local h, have = tonumber(got[1]), 0
        if h and b <= h and b > h - M then have = tonumber(got[2]) or 0 end
        if cells[j + 2] > have or cells[j + 3] > have then
          return refuse("claims more in the receiver's own slot than it counted")
        end
      end
    end
  end
end
if not apply then return {1, total, 0, 0, 0, unknown, 0} end

-- Apply.
if not own_inc then ensure_registry(reg, region, nonce) end
for i = 1, nslots do
  if not idx[i] and needed[i] then
    local v = call('HINCRBY', reg, '#', 1) - 1
    call('HSET', reg, slots[i], fmt(v))
    idx[i] = v
  end
end
used = used + fresh
local tag = tag_of(reg)
local inc, old, fut = 0, 0, 0
local queued = {}
for i = 2, n, 2 do
  local suffix, list = t[i], t[i + 1]
  local stop = string.find(suffix, ':', 1, true)
  local spec = stop and rules[string.sub(suffix, 1, stop - 1)]
  if spec then
    local key = tag .. ':' .. suffix
    local res, N, M, F, ttl = spec[1], spec[2], spec[3], spec[4], spec[5]
    local c = bucket(now, res)
    local cells, fields, maxb = {}, {'h'}, nil
    for j = 1, #list, 4 do
      local b = list[j]
      if b > c + F then
        fut = fut + 1
      elseif b < c - N then
        old = old + 1
      else
        local f = idx[list[j + 1] + 1] * M + b % M
        cells[#cells + 1] = {b, f, list[j + 2], list[j + 3]}
        fields[#fields + 1] = fmt(f)
        fields[#fields + 1] = fmt(-f - 1)
        if not maxb or b > maxb then maxb = b end
      end
    end
    if #cells > 0 then
      local got = hmget_all(key, fields)
      local h = tonumber(got[1])
      local newh = h
      if not h or maxb > h then newh = maxb end
      if h and newh > h then
        if newh - h >= M then
          call('DEL', key)
          h = nil
        else
          -- Clear the ring positions of buckets h+1..newh: name every candidate
          -- field, or list the hash when that is cheaper.
          local del, span = {}, newh - h
          if span * used * 2 <= call('HLEN', key) then
            for b = h + 1, newh do
              local p = b % M
              for s = 0, used - 1 do
                del[#del + 1] = fmt(s * M + p)
                del[#del + 1] = fmt(-(s * M + p) - 1)
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
      end
      local target, set = {}, {}
      local lowest = nil
      for k = 1, #cells do
        local cell = cells[k]
        local b, f = cell[1], cell[2]
        if b <= newh - M then
          old = old + 1
        else
          local cur = target[f]
          if not cur then
            cur = {0, 0}
            if h and b <= h and b > h - M then
              cur = {tonumber(got[2 * k]) or 0, tonumber(got[2 * k + 1]) or 0}
            end
            target[f] = cur
            set[#set + 1] = f
          end
          local up = false
          if cell[3] > cur[1] then cur[1] = cell[3] up = true end
          if cell[4] > cur[2] then cur[2] = cell[4] up = true end
          if up then
            cur[3] = true
            inc = inc + 1
            if not lowest or b < lowest then lowest = b end
          end
        end
      end
      local write = {}
      if newh ~= h then
        write[1] = 'h'
        write[2] = fmt(newh)
      end
      for k = 1, #set do
        local f = set[k]
        local cur = target[f]
        if cur[3] then
          if cur[1] > 0 then write[#write + 1] = fmt(f) write[#write + 1] = fmt(cur[1]) end
          if cur[2] > 0 then write[#write + 1] = fmt(-f - 1) write[#write + 1] = fmt(cur[2]) end
        end
      end
      if #write > 0 then chunked('HSET', key, write, 1000) end
      if newh ~= h then call('PEXPIRE', key, ttl) end
      if lowest then
        queued[#queued + 1] = key
        queued[#queued + 1] = fmt(-lowest - 1)
      end
    end
  end
end
if #queued > 0 then
  for r = 1, #relay do enqueue(tag .. '#o:' .. relay[r], tag .. '#t:' .. relay[r], queued, now) end
end
return {1, total, inc, old, fut, unknown, #queued / 2 * #relay}
