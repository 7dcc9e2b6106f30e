-- heard: when each peer's deltas last reached any agent worker of this region
-- (geolimit/replication/heard.py). A peer's deltas reach whichever worker accepted
-- their connection, while every worker publishes the peers' freshness for its own
-- shards (drain.lua), so the workers share the latest time.
-- KEYS: the hash (one per region, on shard 0's tag): field peer = time (µs, engine clock).
-- ARGV: ttl_ms, then pairs of peer, time: each field becomes the larger of the two.
-- Returns the hash, flat (peer, time, ...), after the update.
local key = KEYS[1]
for i = 2, #ARGV - 1, 2 do
  local had = tonumber(call('HGET', key, ARGV[i]))
  if not had or had < tonumber(ARGV[i + 1]) then call('HSET', key, ARGV[i], ARGV[i + 1]) end
end
if #ARGV > 1 then call('PEXPIRE', key, ARGV[1]) end
return call('HGETALL', key)
