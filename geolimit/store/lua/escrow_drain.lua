-- escrow_drain: take up to ARGV[1] escrow keys of one shard that changed since
-- the agent last looked (hash <tag>#e, written by hit.lua and escrow_merge.lua
-- while the agent's lease lasts) and return each with its fields.
-- KEYS: the shard's changed-escrow hash.
-- Returns {key, {field, value, ...}, key, {...}, ...} (keys that no longer exist are left out).
local got = call('HSCAN', KEYS[1], '0', 'COUNT', ARGV[1])
local names = got[2]
local max = tonumber(ARGV[1])
local taken, out = {}, {}
for i = 1, #names, 2 do
  if #taken >= max then break end
  taken[#taken + 1] = names[i]
end
if #taken > 0 then chunked('HDEL', KEYS[1], taken, 1000) end
for _, key in ipairs(taken) do
  local flat = call('HGETALL', key)
  if #flat > 0 then
    out[#out + 1] = key
    out[#out + 1] = flat
  end
end
return out
