-- heard: when each peer's deltas last reached any agent worker of this region
-- (geolimit/replication/heard.py). A peer's deltas reach whichever worker accepted their
-- connection, while every worker publishes the peers' freshness for its own shards
-- (drain.lua), so the workers share the latest time.
-- KEYS: the hash (one per region, on shard 0's tag): field peer = time (µs, engine clock).
-- ARGV: ttl_ms, limit (µs: the caller's clock and a margin), then pairs of peer, time
--       (µs) or '' (the caller has not heard from it): each field becomes the larger of
--       the two. A stored value that is not a plain time up to limit (junk, or written
--       before the host's clock stepped back) is dropped, and so is a key of another type:
--       kept, it would make a peer look current forever or stop the sharing for good.
-- Returns, per pair, the stored time after the update (false: none).
local key, limit = KEYS[1], tonumber(ARGV[2])
local kind = call('TYPE', key)['ok']
if kind ~= 'hash' and kind ~= 'none' then call('DEL', key) end
local out, wrote = {}, false
for i = 3, #ARGV - 1, 2 do
  local peer, mine = ARGV[i], ARGV[i + 1]
  local raw = call('HGET', key, peer)
  local had = raw and #raw <= 16 and string.match(raw, '^%d+$') and tonumber(raw) or nil
  if had and had > limit then had = nil end
  local new = mine ~= '' and tonumber(mine) or nil
  if new and (not had or had < new) then
    call('HSET', key, peer, mine)
    had, raw, wrote = new, mine, true
  elseif raw and not had then
    call('HDEL', key, peer)
  end
  out[#out + 1] = had and raw or false
end
if wrote then call('PEXPIRE', key, ARGV[1]) end
return out
