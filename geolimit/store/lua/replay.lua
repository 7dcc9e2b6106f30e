-- replay: remember an accepted gossip message, or say it was seen before.
-- KEYS: the sender's seen set (sorted set: member = seq, score = message time, seconds).
-- ARGV: seq, stamp, horizon (members scored below it are dropped), ttl_ms, max_entries.
-- Returns 1 if (sender, seq) is new (now recorded), 0 for a replay.
local key = KEYS[1]
local seq = ARGV[1]
if redis.call('ZSCORE', key, seq) then return 0 end
redis.call('ZADD', key, ARGV[2], seq)
redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. ARGV[3])
local max = tonumber(ARGV[5])
if redis.call('ZCARD', key) > max then
  -- Keep the newest max entries: a peer cannot grow the set without bound.
  redis.call('ZREMRANGEBYRANK', key, 0, -max - 1)
end
redis.call('PEXPIRE', key, ARGV[4])
return 1
