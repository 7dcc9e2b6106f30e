-- unpark: take the parked cells of a shard that are due (merge.lua parks cells
-- further ahead than the clock-skew tolerance until their bucket comes within
-- it), for the agent to merge like a peer's (bounded: max entries a call).
-- KEYS: registry
-- ARGV: now_us|'', max entries
-- Reply: {the next due time left (µs, region clock) or -1, then field, value
--   pairs: field '<bucket>:<length of slot id>:<slot id><rule:subject>', value
--   'value:floor'; then, only if parking keys of another type were deleted (see
--   below), the list of their names (the reply's length is even then, odd otherwise)}
-- A parking key of another type (junk an operator or a bug left) would fail this
-- call for good, and with it the release of the shard's parked cells: on WRONGTYPE
-- it is deleted (outbox.lua repair_park: a junk '#pz' makes '#pk''s cells due now)
-- and the call runs again.
local reg = KEYS[1]
local now = clock(ARGV[1]) + correction(reg)
local tag = tag_of(reg)
local pk, pz = tag .. '#pk', tag .. '#pz'
local function run()
  local due = call('ZRANGEBYSCORE', pz, '-inf', fmt(now), 'LIMIT', 0, tonumber(ARGV[2]))
  local out = {-1}
  if #due > 0 then
    local vals = call('HMGET', pk, unpack(due))
    for i = 1, #due do
      if vals[i] then
        out[#out + 1] = due[i]
        out[#out + 1] = vals[i]
      end
    end
    call('ZREM', pz, unpack(due))
    call('HDEL', pk, unpack(due))
  end
  local nxt = call('ZRANGE', pz, 0, 0, 'WITHSCORES')
  if #nxt > 0 then out[1] = tonumber(nxt[2]) end
  return out
end

local ok, out = pcall(run)
if ok then return out end
if not wrongtype(out) then return redis.error_reply(error_text(out)) end
local gone = repair_park(pk, pz, now)  -- (run() failed before its first write)
if #gone == 0 then return redis.error_reply(error_text(out)) end
out = run()
out[#out + 1] = gone
return out
