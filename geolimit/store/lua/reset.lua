-- reset: forget every count this region can see for the given keys, by raising
-- each slot's floor to its value (a replicated, max-merged reset floor).
-- Concurrent hits that another region has not yet replicated still count.
-- KEYS: registry, changed, peers, then the data keys.
-- ARGV: now_us|'', region, nonce, then per key: res_us, N, M.
-- Returns per key the count in the window that was forgotten.
-- Every number written to Redis goes through fmt (exact integers, never '1e+17').
local function fmt(x) return string.format('%d', x) end
local now = clock(ARGV[1])
local regs = call('HMGET', KEYS[1], '@', 'a', 'k')  -- own slot, lease, clock correction (common.lua)
local track = tracking(KEYS[1], ARGV[2], ARGV[3], now, regs)
local gnow = now + (tonumber(regs[3]) or 0)  -- the region clock
local out = {}
for j = 4, #KEYS do
  local key = KEYS[j]
  local a = 4 + (j - 4) * 3
  local res, N, M = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local c = bucket(gnow, res)
  local sums, _, h, _, stale = load_window(key, c, N, M, false)
  local before = 0
  for d = 0, N do before = before + sums[d] end
  out[#out + 1] = before
  if h ~= nil then
    if #stale > 0 then chunked('HDEL', key, stale, 1000) end
    local flat = call('HGETALL', key)
    local floors, set = {}, {}
    for i = 1, #flat, 2 do
      local f = tonumber(flat[i])
      if f and f < 0 then floors[-f - 1] = tonumber(flat[i + 1]) end
    end
    for i = 1, #flat, 2 do
      local f = tonumber(flat[i])
      if f and f >= 0 then
        local v = tonumber(flat[i + 1])
        if v and v > (floors[f] or 0) then
          set[#set + 1] = fmt(-f - 1)
          set[#set + 1] = fmt(v)
        end
      end
    end
    if #set > 0 then
      chunked('HSET', key, set, 1000)
      if track then call('HSET', KEYS[2], key, '-1') end
    end
  end
end
return out
