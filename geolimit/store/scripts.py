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


@cache
def load_script(name: str) -> LuaScript:
    """The script ``geolimit/store/lua/<name>.lua`` with the common prelude."""
    folder = resources.files("geolimit.store") / "lua"
    prelude = (folder / "common.lua").read_bytes()
    body = (folder / f"{name}.lua").read_bytes()
    source = prelude + b"\n" + body
    return LuaScript(name, source, hashlib.sha1(source).hexdigest().encode())
