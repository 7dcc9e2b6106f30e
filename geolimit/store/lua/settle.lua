-- settle: conclude in-flight message slot w for a peer.
-- KEYS: registry
-- ARGV: now_us|'', peer, w, mode: 'ack' (the peer stored the message: forget
--   what was sent) or 'nack' (it did not: put the entries back in the outbox,
--   merged with whatever was queued since)
-- Reply: fields of the in-flight hash settled (one per pack call), 0 if it was empty
local now = clock(ARGV[1])
local tag = tag_of(KEYS[1])
local peer = ARGV[2]
local flight = tag .. '#f:' .. peer .. ':' .. ARGV[3]
if call('EXISTS', flight) == 0 then return 0 end
if ARGV[4] == 'nack' then
  -- Back in the outbox, the entries keep the time they were first queued.
  local since = tag .. '#t:' .. peer
  local entries = in_flight(flight)
  enqueue(tag .. '#o:' .. peer, since, entries, now)
  local queued_at = tonumber(call('HGET', flight, '@t'))
  if queued_at and #entries > 0 then
    local cur = tonumber(call('GET', since))
    if not cur or queued_at < cur then call('SET', since, string.format('%d', queued_at)) end
  end
end
local n = call('HLEN', flight)
call('UNLINK', flight)  -- a large hash is freed off the main thread
return n
