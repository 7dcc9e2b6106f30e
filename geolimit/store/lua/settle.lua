-- settle: conclude in-flight message slot w for a peer.
-- KEYS: registry
-- ARGV: now_us|'', peer, w, mode: 'ack' (the peer stored the message: forget
--   what was sent) or 'nack' (it did not: put the entries back in the outbox,
--   merged with whatever was queued since)
-- Reply: fields of the in-flight hash settled (one per pack call), 0 if it was empty;
--   {that, {key, ...}} if keys of another type were deleted (see below).
-- A key this script uses that holds another type (junk an operator or a bug left:
-- the slot, the peer's outbox or its time) would fail this call, the agent's start
-- (it returns every slot) and the slot's every later use for good: on WRONGTYPE the
-- call deletes those of its keys that hold another type and runs again. A junk
-- slot's entries are unknown: anti-entropy repairs the cells they named.
local now = clock(ARGV[1])
local tag = tag_of(KEYS[1])
local peer = ARGV[2]
local flight = tag .. '#f:' .. peer .. ':' .. ARGV[3]
local box, since = tag .. '#o:' .. peer, tag .. '#t:' .. peer
local function run()
  if call('EXISTS', flight) == 0 then return 0 end
  if ARGV[4] == 'nack' then
    -- Back in the outbox, the entries keep the time they were first queued.
    local entries = in_flight(flight)
    enqueue(box, since, entries, now)
    local queued_at = tonumber(call('HGET', flight, '@t'))
    if queued_at and #entries > 0 then
      local cur = tonumber(call('GET', since))
      if not cur or queued_at < cur then call('SET', since, string.format('%d', queued_at)) end
    end
  end
  local n = call('HLEN', flight)
  call('UNLINK', flight)  -- a large hash is freed off the main thread
  return n
end

local ok, n = pcall(run)
if ok then return n end
if not wrongtype(n) then return redis.error_reply(error_text(n)) end
-- (a rerun redoes what the first run wrote: enqueue() merges entries, a max)
local gone = delete_junk({flight, 'hash', box, 'hash', since, 'string'})
if #gone == 0 then return redis.error_reply(error_text(n)) end
return {run(), gone}
