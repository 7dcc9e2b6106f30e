-- freshen: publish peers' freshness for a shard whose own worker is down
-- (geolimit/replication/takeover.py), as drain.lua publishes it for its own shards:
-- field peer = the region-clock time (µs) its counts here are as fresh as. A field only
-- moves forward (the larger time wins), and no peer or outbox is added or removed:
-- that stays drain.lua's, run by the shard's worker when it is back. A key of another
-- type (junk) would fail every decision on the shard until that worker is back: it is
-- deleted and rewritten, every peer given and '#R' (the regions: those peers and this
-- one, as drain.lua writes it), and noted in Redis's log.
-- KEYS: the shard's peers hash
-- ARGV: now_us|'', clock correction (µs), then pairs of peer, age_us
local now = clock(ARGV[1]) + tonumber(ARGV[2])
local key = KEYS[1]
local moved = 0
local junk = false
for i = 3, #ARGV - 1, 2 do
  local fresh = now - tonumber(ARGV[i + 1])
  local raw = redis.pcall('HGET', key, ARGV[i])
  if type(raw) == 'table' then  -- an error: a key of another type (only the first call meets one)
    redis.log(redis.LOG_WARNING, 'geolimit freshen: ' .. key .. ' held another type (junk): deleted and rewritten')
    call('DEL', key)
    call('HSET', key, '#R', fmt((#ARGV - 2) / 2 + 1))
    junk, raw = true, false
  end
  local had = tonumber(raw or '')
  if junk or (had and had < fresh) then
    call('HSET', key, ARGV[i], fmt(fresh))
    moved = moved + 1
  end
end
return moved
