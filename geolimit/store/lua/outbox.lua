-- Replication prelude (after common.lua): durable per-peer outboxes.
--
-- Per shard and peer P (tag = '<prefix>:{<shard>}'):
--   tag#o:P     hash   data key -> entry: keys whose cells P still has to receive
--   tag#f:P:w   hash   the entries taken into in-flight message slot w: one field
--                      per pack call, '#<n>' -> msgpack {key, entry, ...}
--   tag#t:P     string when the oldest entry of tag#o:P was queued (µs), for lag;
--               an in-flight hash keeps it in field '@t' (a returned batch keeps its age)
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
-- Duplicate keys in `flat` are combined; an outbox that does not exist yet is
-- written without being read first.
local function enqueue(box, since, flat, now)
  local n = #flat
  if n == 0 then return end
  local have = nil
  if call('EXISTS', box) == 1 then
    local names = {}
    for i = 1, n, 2 do names[#names + 1] = flat[i] end
    have = hmget_all(box, names)
  end
  local val, was, keys = {}, {}, {}
  for i = 1, n, 2 do
    local k = flat[i]
    local cur = val[k]
    if cur == nil then
      cur = have and have[(i + 1) / 2] or false
      was[k] = cur
      keys[#keys + 1] = k
    end
    val[k] = combine(cur or nil, flat[i + 1])
  end
  local write = {}
  for j = 1, #keys do
    local k = keys[j]
    local v = val[k]
    if v ~= was[k] then
      write[#write + 1] = k
      write[#write + 1] = v
    end
  end
  if #write > 0 then chunked('HSET', box, write, 1000) end
  if since then call('SET', since, fmt(now), 'NX') end
end

-- The entries of in-flight hash `flight`, as {key, entry, ...}. pack.lua writes
-- one field per call, '#<n>' -> msgpack {key, entry, ...}; any other field is a
-- single entry (key -> entry: a whole outbox that pack.lua moved in by RENAME).
local function in_flight(flight)
  local flat = call('HGETALL', flight)
  local out = {}
  for i = 1, #flat, 2 do
    local f = flat[i]
    local first = string.byte(f, 1)
    if first == 35 then  -- '#'
      local ok, list = pcall(cmsgpack.unpack, flat[i + 1])
      if ok and type(list) == 'table' then
        for j = 1, #list do out[#out + 1] = list[j] end
      end
    elseif first ~= 64 then  -- not '@t' (the batch's queue time)
      out[#out + 1] = f
      out[#out + 1] = flat[i + 1]
    end
  end
  return out
end

-- Up to `want` entries {field, value, ...} of hash `hash` (which holds n > 0):
-- all of it when it fits (and then whole = true), else an HSCAN from a cursor
-- chosen by `seed` (so no part of a large hash waits for ever), wrapping round
-- once. Bounded: at most 16 HSCAN calls of want - got each.
local function take(hash, n, want, seed)
  if n <= want then return call('HGETALL', hash), true end
  local out, seen, got = {}, {}, 0
  local cursor = fmt(seed % 1048576)
  local wrapped = cursor == '0'
  for _ = 1, 16 do
    local r = call('HSCAN', hash, cursor, 'COUNT', want - got)
    local flat = r[2]
    for i = 1, #flat, 2 do
      local k = flat[i]
      if not seen[k] then
        seen[k] = true
        got = got + 1
        out[#out + 1] = k
        out[#out + 1] = flat[i + 1]
        if got >= want then return out, false end
      end
    end
    cursor = r[1]
    if cursor == '0' then
      if wrapped then break end
      wrapped = true
    end
  end
  return out, false
end

-- Junk: a shard's bookkeeping key of another type (an operator or a bug left it)
-- fails every call that uses it with WRONGTYPE. The scripts check types only once a
-- call has met WRONGTYPE (nothing on the usual path), delete the keys of theirs that
-- hold another type and go on; the caller logs and counts the keys (design section 3).

-- The text of err (what pcall caught from redis.call, or redis.pcall's error reply).
local function error_text(err)
  if type(err) == 'table' then return tostring(err.err) end
  return tostring(err)
end

-- True if err (as error_text() takes it) is WRONGTYPE.
local function wrongtype(err)
  return string.find(error_text(err), 'WRONGTYPE', 1, true) ~= nil
end

-- Delete those of the keys {key, type, ...} that hold another type than theirs
-- (a key of its type, or missing, is never touched). Returns them: {key, ...}.
local function delete_junk(want)
  local gone = {}
  for i = 1, #want, 2 do
    local kind = call('TYPE', want[i])['ok']
    if kind ~= want[i + 1] and kind ~= 'none' then
      call('DEL', want[i])
      gone[#gone + 1] = want[i]
    end
  end
  return gone
end

-- The parking keys (merge.lua's park(), unpark.lua) after a call met WRONGTYPE: hash
-- pk (field -> 'value:floor') and zset pz (field -> due time) of another type are
-- deleted. A junk pk holds no cells (what it held before was overwritten: anti-entropy
-- brings such cells once their bucket is live); a junk pz left pk's cells without due
-- times: each is made due at now (the region clock: the agent's next unpark takes them,
-- and merge.lua parks again those still ahead). Returns the keys deleted and the cells
-- made due.
local function repair_park(pk, pz, now)
  local gone = delete_junk({pk, 'hash', pz, 'zset'})
  local due = 0
  if #gone > 0 and gone[#gone] == pz then
    local fields, scored, at = call('HKEYS', pk), {}, fmt(now)
    for i = 1, #fields do
      scored[2 * i - 1], scored[2 * i] = at, fields[i]
    end
    if #fields > 0 then
      chunked('ZADD', pz, scored, 1000)
      local ttl = call('PTTL', pk)
      if ttl > 0 then call('PEXPIRE', pz, ttl) end
      due = #fields
    end
  end
  return gone, due
end
