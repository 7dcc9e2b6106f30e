-- prune: drop a peer's outbox entries whose data key no longer exists (it
-- expired while the peer could not be reached), one bounded HSCAN page a call,
-- so an outbox stays bounded by the live keys however long a partition lasts.
-- KEYS: registry (the shard's tag is the registry name less its last 2 bytes)
-- ARGV: peer, cursor, count
-- Reply: {next cursor ('0' once the whole outbox was scanned), entries scanned,
--   entries dropped, entries left}
local tag = string.sub(KEYS[1], 1, -3)
local box, since = tag .. '#o:' .. ARGV[1], tag .. '#t:' .. ARGV[1]
local page = call('HSCAN', box, ARGV[2], 'COUNT', tonumber(ARGV[3]))
local flat, gone = page[2], {}
for i = 1, #flat, 2 do
  if call('EXISTS', flat[i]) == 0 then gone[#gone + 1] = flat[i] end
end
if #gone > 0 then chunked('HDEL', box, gone, 1000) end
local left = call('HLEN', box)
if left == 0 then call('DEL', since) end
return {page[1], #flat / 2, #gone, left}
