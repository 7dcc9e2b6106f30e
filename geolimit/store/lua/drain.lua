-- drain: move up to max_keys of this shard's changed keys into every peer's
-- outbox (bounded work per call: more keys only when one RENAME moves them, in
-- O(1)), renew the agent's lease and publish peer freshness, forgetting peers
-- that are no longer configured.
-- KEYS: registry, changed, peers
-- ARGV: now_us|'', region, nonce, candidate incarnation, lease_us, max_keys,
--       regions, clock correction (µs, stored as registry field 'k': common.lua),
--       npeers, then per peer: name, age_us
-- Reply: {own_slot_id, changed_left, taken, then per peer: outbox_len, oldest_us|-1,
--        then, only if any, the list of the keys of another type deleted (see below)}
-- A key this script writes that holds another type (junk an operator or a bug left)
-- would fail this call and every decision on the shard for good: on WRONGTYPE the
-- call deletes those of its keys that hold another type and runs again (nothing is
-- checked while no call fails; what the first run did is redone or left as done).
local now = clock(ARGV[1])
local reg, chg, peers = KEYS[1], KEYS[2], KEYS[3]
local tag, npeers, taken = tag_of(reg), tonumber(ARGV[9]), 0
local function run()
  local own = ensure_registry(reg, ARGV[2], ARGV[3], ARGV[4])
  local k = tonumber(ARGV[8])
  call('HSET', reg, 'a', fmt(now + tonumber(ARGV[5])), 'k', fmt(k))
  local max_keys = tonumber(ARGV[6])
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
  local n, took = call('HLEN', chg), 0
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
      took = n
    else
      local flat = take(chg, n, max_keys, now)
      for i = 1, npeers do
        enqueue(tag .. '#o:' .. names[i], tag .. '#t:' .. names[i], flat, now)
      end
      local del = {}
      for i = 1, #flat, 2 do del[#del + 1] = flat[i] end
      chunked('HDEL', chg, del, 1000)
      took = #del
    end
  end
  taken = taken + took  -- a run that fails after this point took them all the same
  local out = {ARGV[2] .. '/' .. own, n - took, taken}
  for i = 1, npeers do
    local len = call('HLEN', tag .. '#o:' .. names[i])
    local since = tonumber(call('GET', tag .. '#t:' .. names[i]))
    if len > 0 and not since then  -- an outbox without its time (a junk one deleted): its age from now
      call('SET', tag .. '#t:' .. names[i], fmt(now))
      since = now
    end
    out[#out + 1] = len
    out[#out + 1] = since or -1
  end
  return out
end

-- The keys of another type among those run() writes, deleted: {key, ...}.
local function clear_junk()
  local want = {reg, 'hash', chg, 'hash', peers, 'hash'}
  for i = 10, 9 + 2 * npeers, 2 do
    want[#want + 1], want[#want + 2] = tag .. '#o:' .. ARGV[i], 'hash'
    want[#want + 1], want[#want + 2] = tag .. '#t:' .. ARGV[i], 'string'
  end
  return delete_junk(want)  -- (outbox.lua)
end

local ok, out = pcall(run)
if ok then return out end
local err = error_text(out)
if not wrongtype(out) then return redis.error_reply(err) end
local gone = clear_junk()
if #gone == 0 then return redis.error_reply(err) end
out = run()
out[#out + 1] = gone
return out
