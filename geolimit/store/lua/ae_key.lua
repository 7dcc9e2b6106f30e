-- ae_key: the sums S (see ae_common.lua) of ring positions p0 .. p1 - 1 of one
-- big key; the caller adds the chunks' sums and computes the key's digest.
-- KEYS: the key's registry (routing), the data key
-- ARGV: now_us, res_us, N, M, F, p0, p1, then the registry's codes (n, then per
--   slot: index, code1, code2)
-- Reply: {S mod P1, S mod P2, cells}
local now = tonumber(ARGV[1])
local res = tonumber(ARGV[2])
local rule = {(now - now % res) / res, tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}
local codes = read_codes(8)
local cells = {}
local n = cells_in_range(KEYS[2], rule, codes, tonumber(ARGV[6]), tonumber(ARGV[7]), cells)
local s1, s2 = sums_of(cells, n, codes)
return {s1, s2, n}
