-- repair_request: anti-entropy requests that agent workers leave for their region's
-- initiator (worker 0, the only worker that starts exchanges; geolimit/server/workers.py).
-- KEYS: the request list (one per region, on shard 0's tag).
-- ARGV: 'push', ttl_ms, max_entries, entries... -> the list's length. The oldest entries
--         beyond max_entries go, and the list expires ttl_ms after the last push.
--       'take', max_entries                     -> up to max_entries entries, oldest first,
--         removed in the same call: a request is taken once, by one initiator.
-- Entries are '<flag>:<posted, µs>:<peer>' (geolimit/replication/ae_requests.py).
-- A key of another type is junk: it goes (kept, no request would ever pass again).
local key, op = KEYS[1], ARGV[1]
local kind = call('TYPE', key)['ok']
if kind ~= 'list' and kind ~= 'none' then call('DEL', key) end
if op == 'push' then
  call('RPUSH', key, unpack(ARGV, 4))
  call('LTRIM', key, -tonumber(ARGV[3]), -1)
  call('PEXPIRE', key, ARGV[2])
  return call('LLEN', key)
end
local got = call('LRANGE', key, 0, tonumber(ARGV[2]) - 1)
if #got > 0 then call('LTRIM', key, #got, -1) end
return got
