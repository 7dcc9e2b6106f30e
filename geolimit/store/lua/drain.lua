-- drain: move up to max_keys of this shard's changed keys into every peer's
-- outbox (bounded work per call: more keys only when one RENAME moves them, in
-- O(1)), renew the agent's lease and publish peer freshness, forgetting peers
-- that are no longer configured.
-- KEYS: registry, changed, peers
-- ARGV: now_us|'', region, nonce, candidate incarnation, lease_us, max_keys,
--       regions, clock correction (µs, stored as registry field 'k': common.lua),
--       npeers, then per peer: name, age_us
-- Reply: {own_slot_id, changed_left, taken, then per peer: outbox_len, oldest_us|-1}
local now = clock(ARGV[1])
local reg, chg, peers = KEYS[1], KEYS[2], KEYS[3]
local own = ensure_registry(reg, ARGV[2], ARGV[3], ARGV[4])
local k = tonumber(ARGV[8])
call('HSET', reg, 'a', fmt(now + tonumber(ARGV[5])), 'k', fmt(k))
local max_keys = tonumber(ARGV[6])
local tag = tag_of(reg)
local npeers = tonumber(ARGV[9])
local names, fresh, keep = {}, {'#R', ARGV[7]}, {['#R'] = true}
local a = 10
for i = 1, npeers do
  local name = ARGV[a]
  names[i] = name
  keep[name] = true
  fresh[#fresh + 1] = name
  fresh[#fresh + 1] = fmt(now + k - tonumber(ARGV[a + 1]))  -- on the region clock, as hit.lua reads it
  a = a + 2
end
-- Peers removed from the configuration disappear, with their outboxes.
local known = call('HKEYS', peers)
for i = 1, #known do
  local old = known[i]
  if not keep[old] then
    call('HDEL', peers, old)
    call('UNLINK', tag .. '#o:' .. old, tag .. '#t:' .. old)
    for w = 0, 7 do call('UNLINK', tag .. '#f:' .. old .. ':' .. w) end
  end
end
call('HSET', peers, unpack(fresh))
-- Fan out at most max_keys changed keys. When they all fit, a peer whose outbox
-- is empty gets a copy of the changed hash (COPY / RENAME, no per-key Lua; with
-- one peer the RENAME is O(1) whatever the size, so it takes every key); the
-- others merge the entries into what they already hold.
local n, taken = call('HLEN', chg), 0
if n > 0 then
  local empty = {}
  for i = 1, npeers do
    if call('EXISTS', tag .. '#o:' .. names[i]) == 0 then empty[#empty + 1] = i end
  end
  if n <= max_keys or (npeers == 1 and #empty == 1) then
    local flat, e = nil, 1
    for i = 1, npeers do
      if empty[e] == i then
        e = e + 1
      else
        flat = flat or call('HGETALL', chg)
        enqueue(tag .. '#o:' .. names[i], tag .. '#t:' .. names[i], flat, now)
      end
    end
    for j = 1, #empty do
      local name = names[empty[j]]
      if j < #empty then call('COPY', chg, tag .. '#o:' .. name) else call('RENAME', chg, tag .. '#o:' .. name) end
      call('SET', tag .. '#t:' .. name, fmt(now), 'NX')
    end
    if #empty == 0 then call('UNLINK', chg) end
    taken = n
  else
    local flat = take(chg, n, max_keys, now)
    for i = 1, npeers do
      enqueue(tag .. '#o:' .. names[i], tag .. '#t:' .. names[i], flat, now)
    end
    local del = {}
    for i = 1, #flat, 2 do del[#del + 1] = flat[i] end
    chunked('HDEL', chg, del, 1000)
    taken = #del
  end
end
local out = {ARGV[2] .. '/' .. own, n - taken, taken}
for i = 1, npeers do
  out[#out + 1] = call('HLEN', tag .. '#o:' .. names[i])
  out[#out + 1] = tonumber(call('GET', tag .. '#t:' .. names[i])) or -1
end
return out
