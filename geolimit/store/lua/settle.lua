-- settle: conclude in-flight message slot w for a peer.
-- KEYS: registry
-- ARGV: now_us|'', peer, w, mode: 'ack' (the peer stored the message: forget
--   what was sent) or 'nack' (it did not: put the entries back in the outbox,
--   merged with whatever was queued since)
-- Reply: entries settled
local now = clock(ARGV[1])
local tag = tag_of(KEYS[1])
local peer = ARGV[2]
local flight = tag .. '#f:' .. peer .. ':' .. ARGV[3]
local n = call('HLEN', flight)
if n == 0 then return 0 end
if ARGV[4] == 'nack' then
  enqueue(tag .. '#o:' .. peer, tag .. '#t:' .. peer, call('HGETALL', flight), now)
end
call('DEL', flight)
return n
