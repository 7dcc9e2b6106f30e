"""Lua scripts shipped as package data, as ``EVALSHA`` scripts and as one function library.

Each script is ``common.lua`` (the shared prelude), then ``escrow.lua`` (escrow
mode's functions) or, for the replication scripts, ``outbox.lua``, then the script's own
file (or its files in order, :data:`_PARTS`: ``merge`` is three), loaded once with :mod:`importlib.resources`. Clients run them by SHA
(``EVALSHA``) and load them once per connection target on ``NOSCRIPT``.

On servers with Redis functions (Redis >= 7), the same scripts also make up one
library, :func:`function_library`: one copy of the preludes and one function per
script (``geolimit_<sha>_<script>``), called with ``FCALL`` and the same keys and
arguments. An ``EVALSHA`` call runs the whole prelude again (it defines dozens of
local functions) before the script's body; a function runs only the body. The
library is built from the same files, so both ways run the same code:

* the preludes run on the first call after the library is loaded, not while it
  loads (``redis.call`` does not exist at load time), and set up once;
* each script's body becomes a function over ``KEYS`` and ``ARGV``, scoped as in
  its ``EVALSHA`` form (the outbox prelude is visible only to the scripts that
  include it);
* the preludes' per-call state (:data:`_PRELUDE_STATE`) is reset before each body; their
  bounded caches (:data:`_PRELUDE_CACHES`, pure functions of their keys) are kept.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

__all__ = ["LIBRARY_SCRIPTS", "FunctionLibrary", "LuaScript", "function_library", "load_script"]


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: bytes
    sha: bytes  # hex digest, as EVALSHA wants it
    #: Its name in :func:`function_library` (for FCALL), or None: EVALSHA only.
    function: bytes | None = None


@dataclass(frozen=True)
class FunctionLibrary:
    name: bytes  # geolimit_<sha of the library>
    source: bytes  # FUNCTION LOAD's argument


#: Scripts that need the replication prelude (``outbox.lua``: outbox entries) instead of ``escrow.lua``.
_OUTBOX_SCRIPTS = frozenset({"drain", "pack", "settle", "merge", "unpark", "reclaim", "freshen"})
#: The scripts of the function library, in order: common.lua's first, then outbox.lua's.
LIBRARY_SCRIPTS = ("hit", "reset", "replay", "prune", "escrow_drain", "escrow_give", "escrow_merge", "heard", "repair_request", "drain",
                   "pack", "settle", "merge", "unpark", "reclaim", "freshen")
#: Top-level locals of the preludes that hold state of one call, and their initial value.
_PRELUDE_STATE = {"now_ms_cache": "nil"}
#: Top-level locals of the preludes that hold a bounded cache kept between a library's calls: a pure
#: function of its keys (``strnum``: string -> number), so a call may meet it in any state.
_PRELUDE_CACHES = frozenset({"strnum", "strnum_count"})
#: Top-level locals of the preludes that are set once and never change.
_PRELUDE_CONSTANTS = frozenset({"tonumber", "ceil", "fmod", "call", "SUB", "MAX_VALUE", "MARGIN", "QUANTA", "strnum_mt",
                                "NONE", "ZEROS", "SUBS", "STRNUM_CAP"})


#: Scripts kept in several files (each under ~400 lines), joined in this order into one chunk.
_PARTS = {"merge": ("merge", "merge_paths", "merge_apply")}


def _read(name: str) -> bytes:
    return (resources.files("geolimit.store") / "lua" / f"{name}.lua").read_bytes()


def _read_script(name: str) -> bytes:
    """A script's own text: its file, or its parts (:data:`_PARTS`) joined."""
    return b"\n".join(_read(part) for part in _PARTS.get(name, (name,)))


@cache
def load_script(name: str) -> LuaScript:
    """The script ``geolimit/store/lua/<name>.lua`` with its prelude(s)."""
    preludes = ("common", "policy", "outbox") if name in _OUTBOX_SCRIPTS else ("common", "policy", "escrow")
    source = b"\n".join([*(_read(p) for p in preludes), _read_script(name)])
    function = _function_name(name) if name in LIBRARY_SCRIPTS else None
    return LuaScript(name, source, hashlib.sha1(source).hexdigest().encode(), function)


def _check_prelude_locals(prelude: bytes) -> None:
    """Refuse a prelude whose top-level variables are neither known constants nor known
    per-call state: a library keeps them between calls, EVALSHA does not."""
    for line in prelude.decode().splitlines():
        match = re.match(r"local\s+(?!function\b)([\w\s,]+?)\s*(=|$|--)", line)
        if match is None:
            continue
        for var in (v.strip() for v in match.group(1).split(",")):
            if var not in _PRELUDE_CONSTANTS | _PRELUDE_STATE.keys() | _PRELUDE_CACHES:
                raise RuntimeError(
                    f"prelude top-level local {var!r} is not in _PRELUDE_CONSTANTS, _PRELUDE_STATE or "
                    "_PRELUDE_CACHES (geolimit/store/scripts.py): say whether it is a constant, per-call "
                    "state or a cache kept between calls"
                )


def _body(name: str) -> str:
    reset = "".join(f"  {var} = {value}\n" for var, value in _PRELUDE_STATE.items())
    return f"  scripts[{name!r}] = function()\n{reset}{_read_script(name).decode()}\n  end\n"


@cache
def _library_template() -> str:
    common, policy, escrow, outbox = _read("common"), _read("policy"), _read("escrow"), _read("outbox")
    for prelude in (common, policy, escrow, outbox):
        _check_prelude_locals(prelude)
    plain = "".join(_body(n) for n in LIBRARY_SCRIPTS if n not in _OUTBOX_SCRIPTS)
    with_outbox = "".join(_body(n) for n in LIBRARY_SCRIPTS if n in _OUTBOX_SCRIPTS)
    register = "".join(
        f"redis.register_function('@TAG@_{n}', function(keys, args)\n"
        f"  KEYS, ARGV = keys, args\n"
        f"  return (fns or setup())[{n!r}]()\nend)\n"
        for n in LIBRARY_SCRIPTS
    )
    return (
        "#!lua name=@TAG@\n"
        "-- geolimit's scripts (geolimit/store/lua), built by geolimit/store/scripts.py.\n"
        "local KEYS, ARGV, fns\n"
        "local function build()\n"
        "local scripts = {}\n"
        f"{common.decode()}\n{policy.decode()}\n{escrow.decode()}\n{plain}"
        f"do\n{outbox.decode()}\n{with_outbox}end\n"
        "return scripts\n"
        "end\n"
        "local function setup() fns = build() return fns end\n"
        f"{register}"
    )


def _tag() -> str:
    return "geolimit_" + hashlib.sha1(_library_template().encode()).hexdigest()[:16]


def _function_name(name: str) -> bytes:
    return f"{_tag()}_{name}".encode()


@cache
def function_library() -> FunctionLibrary:
    """The Redis function library of :data:`LIBRARY_SCRIPTS` (for ``FUNCTION LOAD``)."""
    tag = _tag()
    return FunctionLibrary(tag.encode(), _library_template().replace("@TAG@", tag).encode())
