"""The public API is a curated, pinned surface, and every error is in one tree."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import geolimit
from geolimit import errors

#: ``geolimit.__all__``, in order: adding or removing a name is an API change.
PUBLIC = [
    "AsyncLimiter",
    "AuthenticationError",
    "ConfigError",
    "Decision",
    "GeolimitError",
    "KeyLayout",
    "Limiter",
    "ManualClock",
    "ProtocolError",
    "RateLimited",
    "RequestError",
    "Rule",
    "RuleDecision",
    "StorageError",
    "UnknownRuleError",
    "Usage",
    "alimit",
    "limit",
    "limited",
    "parse_rate",
]

#: ``geolimit.errors.__all__``: every error class geolimit defines for callers to catch.
ERRORS = [
    "AuthenticationError",
    "BadRequest",
    "ClockSkewError",
    "ConfigError",
    "GeolimitError",
    "NetsimError",
    "PeerRefused",
    "PortInUseError",
    "ProtocolError",
    "RateLimited",
    "RequestError",
    "StorageError",
    "TransportError",
    "UnknownRuleError",
]

#: Where an error is raised, callers may import it from there too: the same class.
ALSO_IMPORTABLE_FROM = [
    ("geolimit", "RateLimited"),
    ("geolimit.decorators", "RateLimited"),
    ("geolimit.replication.transport", "TransportError"),
    ("geolimit.replication.transport", "PeerRefused"),
    ("geolimit.netsim", "NetsimError"),
    ("geolimit.netsim.link", "NetsimError"),
    ("geolimit.server.api", "BadRequest"),
    ("geolimit.store.embedded.server", "PortInUseError"),
]


def geolimit_modules() -> list[str]:
    """Every module of the package (``__main__`` would run the CLI)."""
    found = pkgutil.walk_packages(geolimit.__path__, "geolimit.")
    return sorted(m.name for m in found if not m.name.endswith("__main__"))


def test_all_is_exactly_the_pinned_names() -> None:
    assert geolimit.__all__ == PUBLIC
    namespace: dict[str, object] = {}
    exec("from geolimit import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(PUBLIC)


def test_public_errors_are_the_tree_in_geolimit_errors() -> None:
    assert errors.__all__ == ERRORS
    for name in PUBLIC:
        value = getattr(geolimit, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            assert value is getattr(errors, name), f"geolimit.{name} is not geolimit.errors.{name}"
    for name in ERRORS:
        error = getattr(errors, name)
        assert error.__module__ == "geolimit.errors", name
        assert issubclass(error, errors.GeolimitError), f"{name} is not a GeolimitError"


@pytest.mark.parametrize(("module", "name"), ALSO_IMPORTABLE_FROM)
def test_errors_stay_importable_where_they_are_raised(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_no_module_defines_a_public_error_outside_geolimit_errors() -> None:
    strays = []
    for module_name in geolimit_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__ == module_name != "geolimit.errors" and not name.startswith("_")):
                strays.append(f"{module_name}.{name}")
    assert strays == [], "public errors belong in geolimit/errors.py"


def test_one_except_clause_catches_what_the_api_raises() -> None:
    with pytest.raises(geolimit.GeolimitError) as bad_rule:
        geolimit.Rule("has space", 5, 10)
    assert isinstance(bad_rule.value, geolimit.ConfigError)
    assert isinstance(bad_rule.value, ValueError), "ConfigError stays a ValueError for older callers"
    unknown = errors.UnknownRuleError("api", ["b", "a"])
    assert isinstance(unknown, LookupError)
    assert str(unknown) == "unknown rule 'api'; known rules: a, b"
    refused = errors.BadRequest("'cost' must be an integer", "cost")
    assert (refused.field, refused.status) == ("cost", 400)
    assert isinstance(refused, geolimit.RequestError)
    assert errors.PeerRefused("no", 400).status == 400
    assert issubclass(errors.PeerRefused, errors.TransportError)
    assert issubclass(errors.AuthenticationError, errors.ProtocolError)
    assert issubclass(errors.NetsimError, RuntimeError)


def test_bad_arguments_to_public_helpers_raise_errors_of_the_tree() -> None:
    with pytest.raises(geolimit.RequestError, match="never goes backwards"):
        geolimit.ManualClock().advance(-1.0)
    layout = geolimit.KeyLayout()
    assert layout.parse_data_key(layout.data_key("api", b"u:1")) == (layout.shard_of(b"u:1"), "api", b"u:1")
    for junk in (b"zzz", b"gl:{x}:api:u", b"gl:{3}api:u", b"gl:{3}:api", b"gl:{3}:\xff:u"):
        with pytest.raises(geolimit.RequestError, match="not a geolimit data key"):
            layout.parse_data_key(junk)


#: What a service imports to rate-limit: the library, the middleware, the agent and the proxy.
RUNTIME = ["geolimit", "geolimit.middleware", "geolimit.server.run", "geolimit.proxy.run", "geolimit.cli"]
#: Test and demo support: never imported by RUNTIME (store.embedded loads ctypes and starts
#: redis-server processes; sim, netsim and demo are harnesses).
SUPPORT = ["geolimit.store.embedded", "geolimit.sim", "geolimit.netsim", "geolimit.demo", "ctypes"]


def test_the_runtime_never_imports_test_and_demo_support() -> None:
    code = (f"import importlib, sys\nfor m in {RUNTIME!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'ctypes' or m.startswith({tuple(SUPPORT)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_library_never_imports_the_replication_layer() -> None:
    """``import geolimit`` (the limiters, rules, errors) is the layer below the agent:
    an app that only rate-limits loads none of the gossip, escrow or anti-entropy code."""
    code = ("import sys, geolimit, geolimit.middleware\n"
            "print(sorted(m for m in sys.modules if m.startswith(('geolimit.replication', 'geolimit.server'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
