"""What a peer's cell costs the receiver's Redis, in instructions per key (callgrind), and why.

    python bench/merge_costs.py [--keys 5000] [--redis-server PATH] [--json PATH]

P8 (``bench/gossip.py --p8``) is bound by the receiver's redis-server running
``merge.lua``. This takes that cost apart on P8's key shape (fields ``h``, ``e``,
``p1`` and four cells of the peer's slot; one new cell per key arrives), with one
redis-server under ``valgrind --tool=callgrind`` (``apt-get install valgrind``):

1. the real ``merge.lua`` (``EVALSHA``, apply mode ``2`` as the agent sends a
   vetted blob), all keys in one blob;
2. what single ``redis.call`` shapes cost per key, above a loop that only builds
   each key's name: ``HGETALL`` of the 8 fields, ``HMGET`` of 4 names and of 8
   missing ones, ``HDEL`` of 1 and 8 names, ``HEXISTS``, ``HSET`` of 3 fields;
3. the layout question: a minimal read-walk-write of today's ring layout (one
   ``HGETALL``, the walk, one ``HSET``) against a prototype layout in which a peer's
   cell is a field named by its absolute bucket and slot (``bucket * 1024 + slot``),
   so that a merge reads 4 names with ``HMGET`` and never moves a head
   (docs/design.md, P8).

Baseline in the same run: a pipelined ``HSET`` of one field per key from redis-py,
as P8's wall-clock baseline. Instruction counts do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from p8_instructions import Counted, callgrind_binary

from geolimit import Rule
from geolimit.store.scripts import load_script

RULE = Rule("api", 10**9, 60, 1)  # P8's rule
TAG = "gl:{0}"
REGISTRY = TAG + "#r"
PEER_SLOT = 1  # the peer's slot index in the registry below
CELLS = 4  # cells each key holds already (P8's fourth round)

# A name per key, the decoded blob and the rule lookup: shared by the two layouts' loops.
_PROLOGUE = r"""
local fmt = string.format
local t = cmsgpack.unpack(ARGV[1])
local keys, cells = t[1], t[2]
local stamp = ARGV[2]
local rules = {api = true}
local fnames = setmetatable({}, {__index = function(c, x) local s = fmt('%d', x) c[x] = s return s end})
local nums = setmetatable({}, {__index = function(c, s) local v = tonumber(s) or 0 c[s] = v return v end})
local inc = 0
"""

RING_COPY = _PROLOGUE + r"""
local M = tonumber(ARGV[3])
for i = 1, #keys do
  local o = 4 * (i - 1)
  local b, x, v = cells[o + 1], cells[o + 2], cells[o + 3]
  local suffix = keys[i]
  if rules[string.sub(suffix, 1, string.find(suffix, ':', 1, true) - 1)] then
    local f = x * M + b % M
    local key = 'gl:{0}:' .. suffix
    local flat = redis.call('HGETALL', key)
    local hs, v0, w0 = nil, 0, 0
    local n1, n2 = fnames[f], fnames[-f - 1]
    for y = 1, #flat, 2 do
      local name = flat[y]
      if name == 'h' then hs = flat[y + 1]
      elseif name == n1 then v0 = nums[flat[y + 1]]
      elseif name == n2 then w0 = nums[flat[y + 1]] end
    end
    if hs ~= fnames[b] and hs ~= fnames[b - 1] then local _ = tonumber(hs) end
    if v > v0 then
      inc = inc + 1
      redis.call('HSET', key, 'h', fnames[b], n1, fnames[v], 'p1', stamp)
    end
  end
end
return inc
"""

ABSOLUTE = _PROLOGUE + r"""
for i = 1, #keys do
  local o = 4 * (i - 1)
  local b, x, v = cells[o + 1], cells[o + 2], cells[o + 3]
  local suffix = keys[i]
  if rules[string.sub(suffix, 1, string.find(suffix, ':', 1, true) - 1)] then
    local f = b * 1024 + x
    local key = 'gl:{0}:' .. suffix
    local n1, n2 = fnames[f], fnames[-f - 1]
    local got = redis.call('HMGET', key, n1, n2, 'e', 'g')
    local v0 = got[1] and nums[got[1]] or 0
    if v > v0 then
      inc = inc + 1
      redis.call('HSET', key, n1, fnames[v], 'p1', stamp)
    end
  end
end
return inc
"""

CALLS = {
    "name only": "for i = 1, %d do local k = 'k' .. i end return 1",
    "HGETALL (8 fields)": "for i = 1, %d do local k = 'k' .. i redis.call('HGETALL', k) end return 1",
    "HMGET 4 names (2 there)": "for i = 1, %d do local k = 'k' .. i redis.call('HMGET', k, 'h', 'e', ARGV[3], ARGV[4]) end return 1",
    "HMGET 8 missing names": "for i = 1, %d do local k = 'k' .. i redis.call('HMGET', k, unpack(ARGV)) end return 1",
    "HDEL 1 missing name": "for i = 1, %d do local k = 'k' .. i redis.call('HDEL', k, ARGV[1]) end return 1",
    "HDEL 8 missing names": "for i = 1, %d do local k = 'k' .. i redis.call('HDEL', k, unpack(ARGV)) end return 1",
    "HEXISTS": "for i = 1, %d do local k = 'k' .. i redis.call('HEXISTS', k, ARGV[1]) end return 1",
    "HSET 3 fields": ("for i = 1, %d do local k = 'k' .. i "
                      "redis.call('HSET', k, 'h', '1795792212', '80', '384', 'p1', '1795792212922362:1:2000000') end return 1"),
}
MISSING = ["17", "-18", "80", "-81", "18", "-19", "81", "-82"]


def fill(client: redis.Redis, keys: int, name: Any, fields: Any) -> None:
    client.flushall()
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        pipe.hset(name(i), mapping=fields(i))
    pipe.execute()


def measure(server: Counted, keys: int) -> dict[str, float]:
    client = redis.Redis(port=server.port)
    sec, usec = client.time()
    now_us = sec * 1_000_000 + usec
    c, M = now_us // RULE.resolution_us, RULE.ring
    e = str(now_us // 1000 + RULE.ttl_ms + RULE.ttl_ms // 4)
    rise = f"{now_us - 2_000_000}:1:2000000"
    out: dict[str, float] = {}

    def counted(label: str, run: Any) -> float:
        server.zero()
        run()
        per = server.instructions(f"m{len(out)}") / keys  # callgrind_control drops a dump whose tag has "("
        out[label] = per
        return per

    def ring_fields(_: int) -> dict[str, str]:
        fields = {"h": str(c - 2), "e": e, "p1": rise}
        for k in range(CELLS):
            b = c - 2 - 2 * (CELLS - 1 - k)
            fields[str(PEER_SLOT * M + b % M)] = str(64 * (k + 1))
        return fields

    def absolute_fields(_: int) -> dict[str, str]:
        fields = {"h": str(c - 2), "e": e, "p1": rise}
        for k in range(CELLS):
            fields[str((c - 2 - 2 * (CELLS - 1 - k)) * 1024 + PEER_SLOT)] = str(64 * (k + 1))
        return fields

    names = [f"api:k:{i}" for i in range(keys)]
    cells: list[int] = []
    for _ in range(keys):
        cells += [c, 0, 64 * (CELLS + 1), 0]

    # 1. The real merge.lua, as the agent calls it (ARGV as geolimit/replication/redis_io.py builds it).
    fill(client, keys, lambda i: f"{TAG}:api:k:{i}", ring_fields)
    client.hset(REGISTRY, mapping={"@": "own1", "b/own1": "0", "a/inc1": "1", "#": "2"})
    merge = load_script("merge").source
    argv = [str(now_us), "b", "nonce", "2", "delta", "100000", "64", "1024", "1000", "60000000", "2", "a", "b",
            "1", "api", str(RULE.resolution_us), str(RULE.buckets), str(M), str(RULE.future), str(RULE.ttl_ms), "1",
            "0", msgpack.packb([["a/inc1"], names, [1] * keys, cells]), "2000000"]
    sha = client.script_load(merge)
    counted("merge.lua", lambda: client.evalsha(sha, 1, REGISTRY, *argv))
    if int(client.hget(f"{TAG}:api:k:7", str(PEER_SLOT * M + c % M)) or 0) != 64 * (CELLS + 1):
        raise RuntimeError("merge.lua did not write the cell: the bench's arguments are out of date")

    # 2. Single calls, above the loop that only builds a key's name.
    for label, body in CALLS.items():
        fill(client, keys, lambda i: f"k{i + 1}", lambda _: {"h": "1795792210", "e": "1795792290922", "p1": rise,
                                                             "71": "64", "73": "128", "75": "192", "77": "256", "79": "320"})
        counted(label, lambda body=body: client.eval(body % keys, 0, *MISSING))

    # 3. The two layouts, the same cells, the same loop around them.
    blob = msgpack.packb([names, [x for i in range(keys) for x in (c, PEER_SLOT, 64 * (CELLS + 1), 0)]])
    fill(client, keys, lambda i: f"{TAG}:api:k:{i}", ring_fields)
    counted("ring layout (copy)", lambda: client.eval(RING_COPY, 0, blob, rise, str(M)))
    fill(client, keys, lambda i: f"{TAG}:api:k:{i}", absolute_fields)
    counted("absolute-bucket layout (prototype)", lambda: client.eval(ABSOLUTE, 0, blob, rise))

    # Baseline: a pipelined HSET of one field per key from redis-py.
    client.flushall()

    def baseline() -> None:
        pipe = client.pipeline(transaction=False)
        for i in range(keys):
            pipe.hset(f"bench:{i}", "5", i)
        pipe.execute()

    counted("baseline: pipelined HSET", baseline)
    client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=5000)
    parser.add_argument("--redis-server", help="the binary (default: as EmbeddedRedis finds it)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    binary = callgrind_binary(args.redis_server, "merge_costs.py")
    if binary is None:
        return 2
    folder = Path(tempfile.mkdtemp(prefix="geolimit-merge-costs-"))
    server = Counted("m", binary, folder)
    try:
        out = measure(server, args.keys)
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    base = out["name only"]
    print(f"instructions per key ({args.keys} keys, {binary}):")
    for label, per in out.items():
        extra = f"  ({(per - base) / 1000:.1f}k above 'name only')" if label in CALLS and label != "name only" else ""
        print(f"  {label:38} {per / 1000:7.1f}k{extra}")
    ring, absolute = out["ring layout (copy)"], out["absolute-bucket layout (prototype)"]
    print(f"absolute-bucket layout / ring layout: {absolute / ring:.2f}; "
          f"merge.lua / baseline HSET: {out['merge.lua'] / out['baseline: pipelined HSET']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"keys": args.keys, "redis_server": binary, "per_key": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
