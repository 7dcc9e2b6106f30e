-- Anti-entropy prelude: geolimit/replication/antientropy.py prepends it to
-- ae_scan.lua, ae_key.lua and ae_read.lua (not to the app's scripts).
--
-- Digests (geolimit.replication.antientropy mirrors them in Python for tests
-- and big keys). Two primes P just under 2^26, P = 2 mod 3 (cubing mod P is a
-- bijection); for each:
--   weight of (slot code, bucket) = (code * A^2 + bh * A + bl)^3 mod P
--   (bh, bl: the bucket's 26-bit limbs), and its square for floors;
--   S = sum over the key's live non-zero cells of
--       weight * (value mod P) + weight^2 * (floor mod P)    (mod P)
--   key digest part = (seed + S)^3 mod P.
-- The key digest is part1 * 2^26 + part2 (52 bits); a range's digest is the sum
-- of its keys' digests mod 2^52. So a digest depends neither on storage order
-- nor on slot indices, S can be summed over chunks of a big key, and a range is
-- the sum of its sub-ranges. The cubes make a change that cancels in one key's
-- linear sum show in the key's digest, and keep keys with the same cells from
-- cancelling each other (their seeds differ).
-- Every operand stays below 2^53, where Lua's a % b (a - floor(a / b) * b) is
-- exact for integers: any IEEE double machine computes the same digest.
-- Seed: sha1(rule:subject) hex digits 1-13 (52 bits: seed1 = low 26 bits,
-- seed2 = high 26 bits); the key's leaf: seed2 modulo the leaves per shard (a
-- power of two <= 2^16). Slot code: sha1(slot id) hex digits 1-6 and 7-12 (two 24-bit numbers),
-- computed by the caller and passed in ARGV.
local call, tonumber = redis.call, tonumber
local sub, find = string.sub, string.find
local P1, A1, P2, A2 = 67108859, 57568332, 67108763, 39432167
local W26, W52, W53 = 67108864, 4503599627370496, 9007199254740992

-- Per call caches: a field name or value string -> its number (false: invalid).
local fieldnums, valnums = {}, {}

-- An integer field name (a value field >= 0, a floor field < 0), else false.
local function fieldnum(s)
  local f = fieldnums[s]
  if f == nil then
    f = tonumber(s)
    if not (f and f % 1 == 0 and f > -W52 and f < W52) then f = false end
    fieldnums[s] = f
  end
  return f
end

-- A stored value or floor: an integer in [0, 2^53), else false.
local function num(s)
  if not s then return false end
  local v = valnums[s]
  if v == nil then
    v = tonumber(s)
    if not (v and v >= 0 and v < W53 and v % 1 == 0) then v = false end
    valnums[s] = v
  end
  return v
end

-- rules[name] = {c, N, M, F} from ARGV[a..]: n, then n x (name, res_us, N, M, F).
local function read_rules(a, now)
  local rules = {}
  local n = tonumber(ARGV[a])
  a = a + 1
  for _ = 1, n do
    local res = tonumber(ARGV[a + 1])
    rules[ARGV[a]] = {(now - now % res) / res, tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])}
    a = a + 5
  end
  return rules, a
end

-- codes[index] = {c1, c2, weights cache} from ARGV[a..]: n, then n x (index,
-- c1, c2). A slot id has one code table (and cache) in all shards of a call.
-- Returns codes, the next ARGV index, n.
local interned = {}
local function read_codes(a)
  local n = tonumber(ARGV[a])
  local codes = {}
  a = a + 1
  for _ = 1, n do
    local c1, c2 = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local id = c1 * 16777216 + c2
    local code = interned[id]
    if not code then
      code = {c1, c2, {}}
      interned[id] = code
    end
    codes[tonumber(ARGV[a])] = code
    a = a + 3
  end
  return codes, a, n
end

-- The key's leaf (of L per shard) and seed from sha1(rule:subject).
local function seed(suffix, L)
  local x = tonumber(sub(redis.sha1hex(suffix), 1, 13), 16)
  local k1 = x % W26
  local k2 = (x - k1) / W26
  return k2 % L, k1, k2
end

-- A key's head bucket from its HGETALL (usually the first field), or c if it has none.
local function head_of(flat, c)
  if flat[1] == 'h' then return fieldnum(flat[2]) or c end
  for i = 3, #flat, 2 do
    if flat[i] == 'h' then return fieldnum(flat[i + 1]) or c end
  end
  return c
end

-- The live non-zero cells of a key's HGETALL whose slot index is in known,
-- into out as slot, bucket, value, floor, ...; returns their number.
-- rule = {c, N, M, F}. Fields that are not integers (or values that are not
-- integers in [0, 2^53)) are ignored; a missing head counts as bucket c.
local bases = {}
local function cells_of(flat, rule, known, out)
  local c, N, M, F = rule[1], rule[2], rule[3], rule[4]
  local nf = #flat
  local h = head_of(flat, c)
  local lo, hi, n = c - N, c + F, 0
  local floors
  for i = 1, nf, 2 do
    local f = fieldnum(flat[i])
    if f then
      local v = num(flat[i + 1])
      if v and v > 0 then
        if f < 0 then
          floors = floors or {}
          floors[-f - 1] = v
        else
          local pos = f % M
          local slot = (f - pos) / M
          if known[slot] then
            local b = h - (h - pos) % M
            if b >= lo and b <= hi then
              out[n + 1], out[n + 2], out[n + 3], out[n + 4] = slot, b, v, 0
              n = n + 4
              bases[n] = f
            end
          end
        end
      end
    end
  end
  if floors then
    for k = 4, n, 4 do
      local base = bases[k]
      local fl = floors[base]
      if fl then
        out[k] = fl
        floors[base] = nil
      end
    end
    for base, fl in pairs(floors) do
      local pos = base % M
      local slot = (base - pos) / M
      if known[slot] then
        local b = h - (h - pos) % M
        if b >= lo and b <= hi then
          out[n + 1], out[n + 2], out[n + 3], out[n + 4] = slot, b, 0, fl
          n = n + 4
        end
      end
    end
  end
  return n / 4
end

-- Same for ring positions p0 .. p1 - 1 of every slot index in known (one HMGET
-- of 2 * #slots * (p1 - p0) + 1 fields): the chunked read of a big key.
local function cells_in_range(key, rule, known, p0, p1, out)
  local c, N, M, F = rule[1], rule[2], rule[3], rule[4]
  local fields, order = {'h'}, {}
  for slot in pairs(known) do
    for p = p0, p1 - 1 do
      local f = slot * M + p
      fields[#fields + 1] = f
      fields[#fields + 1] = -f - 1
      order[#order + 1] = slot
      order[#order + 1] = p
    end
  end
  local got = call('HMGET', key, unpack(fields))
  local h = fieldnum(got[1] or 'h') or c
  local lo, hi, n = c - N, c + F, 0
  for i = 1, #order, 2 do
    local v = num(got[i + 1]) or 0
    local fl = num(got[i + 2]) or 0
    if v > 0 or fl > 0 then
      local p = order[i + 1]
      local b = h - (h - p) % M
      if b >= lo and b <= hi then
        out[n + 1], out[n + 2], out[n + 3], out[n + 4] = order[i], b, v, fl
        n = n + 4
      end
    end
  end
  return n / 4
end

-- The weights of (slot code, bucket): {value1, value2, floor1, floor2}, cached
-- in the code per bucket.
local function weights(code, b)
  local cache = code[3]
  local w = cache[b]
  if not w then
    local bl = b % W26
    local bh = (b - bl) / W26
    local x = ((code[1] * A1 + bh) % P1 * A1 + bl) % P1
    local y = ((code[2] * A2 + bh) % P2 * A2 + bl) % P2
    x = (x * x % P1) * x % P1
    y = (y * y % P2) * y % P2
    w = {x, y, x * x % P1, y * y % P2}
    cache[b] = w
  end
  return w
end

-- S (mod P1, mod P2) of n cells of out (cells_of, cells_in_range).
local function sums_of(out, n, codes)
  local s1, s2 = 0, 0
  for i = 1, 4 * n, 4 do
    local w = weights(codes[out[i]], out[i + 1])
    local v, f = out[i + 2], out[i + 3]
    s1 = s1 + w[1] * (v % P1) % P1
    s2 = s2 + w[2] * (v % P2) % P2
    if f > 0 then
      s1 = s1 + w[3] * (f % P1) % P1
      s2 = s2 + w[4] * (f % P2) % P2
    end
  end
  return s1 % P1, s2 % P2
end

-- A key's digest from its seed and S.
local function key_digest(k1, k2, s1, s2)
  local x = (k1 + s1) % P1
  local y = (k2 + s2) % P2
  return (x * x % P1) * x % P1 * W26 + (y * y % P2) * y % P2
end

-- S (mod P1, mod P2) and the number of live non-zero values and floors of a
-- key's HGETALL, in one pass (a value and its floor are separate terms of S).
-- The hot loop of a digest pass. What a field name stands for (its weights, or
-- false: not a live cell of a known slot) depends only on the name, the key's
-- head, the rule and the registry, so it is worked out once per call for each
-- (rule, registry, head, name): keys mostly share a few heads.
local terms_by = {}  -- rule -> codes -> head -> name -> {w1, w2} | false
local function terms_of(rule, codes, h)
  local by_codes = terms_by[rule]
  if not by_codes then
    by_codes = {}
    terms_by[rule] = by_codes
  end
  local by_head = by_codes[codes]
  if not by_head then
    by_head = {}
    by_codes[codes] = by_head
  end
  local terms = by_head[h]
  if not terms then
    terms = {}
    by_head[h] = terms
  end
  return terms
end

local function term(name, rule, codes, h)
  local f = fieldnum(name)
  if not f then return false end
  local c, N, M, F = rule[1], rule[2], rule[3], rule[4]
  local base = f
  if f < 0 then base = -f - 1 end
  local pos = base % M
  local code = codes[(base - pos) / M]
  if not code then return false end
  local b = h - (h - pos) % M
  if b < c - N or b > c + F then return false end
  local w = weights(code, b)
  if f >= 0 then return {w[1], w[2]} end
  return {w[3], w[4]}
end

local function key_sums(flat, rule, codes)
  local h = head_of(flat, rule[1])
  local terms = terms_of(rule, codes, h)
  local s1, s2, n = 0, 0, 0
  for i = 1, #flat, 2 do
    local name = flat[i]
    local t = terms[name]
    if t == nil then
      t = term(name, rule, codes, h)
      terms[name] = t
    end
    if t then
      local v = num(flat[i + 1])  -- cached per call: stored values repeat, and tonumber() costs ~2k instructions
      if v and v > 0 then
        s1 = s1 + t[1] * (v % P1) % P1
        s2 = s2 + t[2] * (v % P2) % P2
        n = n + 1
      end
    end
  end
  return s1 % P1, s2 % P2, n
end
