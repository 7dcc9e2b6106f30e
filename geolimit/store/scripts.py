"""Lua scripts shipped as package data.

Each script is ``common.lua`` (the shared prelude) followed by the script's own
file, loaded once with :mod:`importlib.resources`. Clients run them by SHA
(``EVALSHA``) and load them once per connection target on ``NOSCRIPT``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources

__all__ = ["LuaScript", "load_script"]


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: bytes
    sha: bytes  # hex digest, as EVALSHA wants it


#: Scripts that also need the replication prelude (``outbox.lua``: outbox entries).
_OUTBOX_SCRIPTS = frozenset({"drain", "pack", "settle", "merge"})


@cache
def load_script(name: str) -> LuaScript:
    """The script ``geolimit/store/lua/<name>.lua`` with its prelude(s)."""
    folder = resources.files("geolimit.store") / "lua"
    preludes = ("common", "outbox") if name in _OUTBOX_SCRIPTS else ("common",)
    parts = [(folder / f"{p}.lua").read_bytes() for p in preludes]
    source = b"\n".join([*parts, (folder / f"{name}.lua").read_bytes()])
    return LuaScript(name, source, hashlib.sha1(source).hexdigest().encode())
