"""The RLS script: ``hit.lua``'s decision, all-or-nothing over a whole request.

The script is built from the package's own ``common.lua`` and ``hit.lua``, so it
decides exactly as :meth:`~geolimit.AsyncLimiter.hit` does: ``hit.lua``'s body
becomes a function, run once per transaction with every request peeking, and,
when every enforced request of the transaction is admitted, once more with every
request consuming (the same state, so the same answers, now counted). Shadow
requests are then counted only if they are within their own limit. A transaction
of one request is sent consuming already (unless a rule is in escrow mode, whose
denied consuming hit records demand): one pass of ``hit.lua``, itself all-or-nothing
over the request's rules, decides and counts it exactly as the two passes would.
Arguments: see :func:`geolimit.server.rls.decide.encode_batch`.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources

from geolimit.store.scripts import LuaScript

__all__ = ["rls_script"]

_TRANSACTIONS = b"""
-- rls: decide transactions of hit.lua requests, each all-or-nothing over its
-- enforced requests (see geolimit/server/rls/script.py).
local now = string.format('%d', clock(ARGV[1]))
local region, nonce = ARGV[2], ARGV[3]
local out = {}
local ai, ki = 5, 1
for _ = 1, tonumber(ARGV[4]) do
  local nk, nreq, na = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  ai = ai + 3
  local enforced, consume_at, reply_at = {}, {}, {}
  for r = 1, nreq do
    enforced[r], consume_at[r], reply_at[r] = ARGV[ai] == '1', tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
    ai = ai + 3
  end
  local keys, argv = {}, {now, region, nonce, tostring(nreq)}
  for i = 1, nk do keys[i] = KEYS[ki + i - 1] end
  for i = 1, na do argv[4 + i] = ARGV[ai + i - 1] end
  ki, ai = ki + nk, ai + na
  local reply = decide(keys, argv)
  local admitted = true
  if nreq == 1 and argv[consume_at[1]] == '1' then
    -- one request sent consuming (no escrow rule): hit.lua is all-or-nothing by itself
    admitted = not enforced[1] or reply[reply_at[1]] == 1
  else
    for r = 1, nreq do
      if enforced[r] and reply[reply_at[r]] ~= 1 then admitted = false end
    end
    if admitted then
      for r = 1, nreq do argv[consume_at[r]] = '1' end
      reply = decide(keys, argv)
    end
  end
  out[#out + 1] = admitted and 1 or 0
  for i = 1, #reply do out[#out + 1] = reply[i] end
end
return out
"""


@cache
def rls_script() -> LuaScript:
    """``common.lua``, ``policy.lua``, ``hit.lua`` as ``local function decide(KEYS, ARGV)``, then the transaction loop."""
    folder = resources.files("geolimit.store") / "lua"
    source = b"\n".join([
        (folder / "common.lua").read_bytes(),
        (folder / "policy.lua").read_bytes(),
        b"local function decide(KEYS, ARGV)",
        (folder / "hit.lua").read_bytes(),
        b"end",
        _TRANSACTIONS,
    ])
    return LuaScript("rls", source, hashlib.sha1(source).hexdigest().encode())
