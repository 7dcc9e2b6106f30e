-- Replication prelude (after common.lua): durable per-peer outboxes.
--
-- Per shard and peer P (tag = '<prefix>:{<shard>}'):
--   tag#o:P     hash   data key -> entry: keys whose cells P still has to receive
--   tag#f:P:w   hash   the same, for the entries taken into in-flight message slot w
--   tag#t:P     string when the oldest entry of tag#o:P was queued (µs), for lag
-- An entry is a bucket b (send this region's own cells from b on) or -(b + 1)
-- (send every slot's cells from b on: after a reset, or a relay). Entries merge
-- by taking the lower bucket and the wider scope.
local MAX_VALUE = 9007199254740991  -- 2**53 - 1: the largest exact integer

local function fmt(x) return string.format('%d', x) end

local function tag_of(reg) return string.sub(reg, 1, -3) end

local function decode_entry(v)
  v = tonumber(v)
  if not v then return nil, false end
  if v < 0 then return -v - 1, true end
  return v, false
end

local function combine(a, b)
  -- a, b: raw entries (strings or numbers); nil-safe.
  if not a then return b end
  if not b then return a end
  local ba, wa = decode_entry(a)
  local bb, wb = decode_entry(b)
  if not ba then return b end
  if not bb then return a end
  local lo = ba < bb and ba or bb
  if wa or wb then return fmt(-lo - 1) end
  return fmt(lo)
end

-- HMGET of any number of fields (unpack() is limited by Lua's C stack).
local function hmget_all(key, names)
  local out = {}
  for i = 1, #names, 500 do
    local j = i + 499
    if j > #names then j = #names end
    local got = call('HMGET', key, unpack(names, i, j))
    for k = 1, #got do out[i + k - 1] = got[k] end
  end
  return out
end

-- Merge entries {key, entry, key, entry, ...} into outbox hash `box` (and note
-- the time of the first pending entry in key `since`, if given and unset).
local function enqueue(box, since, flat, now)
  local n = #flat
  if n == 0 then return end
  local names = {}
  for i = 1, n, 2 do names[#names + 1] = flat[i] end
  local have = hmget_all(box, names)
  local write = {}
  for i = 1, n, 2 do
    local merged = combine(have[(i + 1) / 2] or nil, flat[i + 1])
    if merged ~= have[(i + 1) / 2] then
      write[#write + 1] = flat[i]
      write[#write + 1] = merged
    end
  end
  if #write > 0 then chunked('HSET', box, write, 1000) end
  if since then call('SET', since, fmt(now), 'NX') end
end
