-- freshen: publish peers' freshness for a shard whose own worker is down
-- (geolimit/replication/takeover.py), as drain.lua publishes it for its own shards:
-- field peer = the region-clock time (µs) its counts here are as fresh as. A field only
-- moves forward (the larger time wins), and no peer or outbox is added or removed:
-- that stays drain.lua's, run by the shard's worker when it is back.
-- KEYS: the shard's peers hash
-- ARGV: now_us|'', clock correction (µs), then pairs of peer, age_us
local now = clock(ARGV[1]) + tonumber(ARGV[2])
local key = KEYS[1]
local moved = 0
for i = 3, #ARGV - 1, 2 do
  local fresh = now - tonumber(ARGV[i + 1])
  local had = tonumber(call('HGET', key, ARGV[i]) or '')
  if had and had < fresh then
    call('HSET', key, ARGV[i], fmt(fresh))
    moved = moved + 1
  end
end
return moved
