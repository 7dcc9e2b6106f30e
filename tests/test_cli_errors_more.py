"""The numeric flags of ``geolimit agent``, ``proxy``, ``demo`` and ``bench accuracy``: a value out of
range is a usage error naming the flag (exit 2, one line, nothing started), as in test_cli_errors.py.

Once, ``agent --flush-timeout -1`` was a runtime error (exit 1) not naming the flag,
``bench accuracy --duration 0`` or ``-5`` ran the whole suite for nothing, ``--duration nan``
never ended, ``demo`` checked its flags only after parsing, in its own words, and ``proxy
--workers two`` was argparse's "invalid int value", ``--workers 0`` a config error (exit 1).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from geolimit.cli import build_parser
from geolimit.demo.run import _check_arguments
from geolimit.sim.report import run_accuracy_bench
from tests.support.cli_usage import assert_usage_error, run_cli

AGENT = ["agent", "--config", "region.toml"]  # a usage error comes before the config is read
PROXY = ["proxy", "--config", "proxy.toml"]
CASES = [
    *(("agent", AGENT, "--flush-timeout", v, "a number of seconds of at least 0")
      for v in ("-1", "-0.5", "nan", "inf", "soon")),
    *(("agent", AGENT, "--workers", v, "a whole number from 1 to 64") for v in ("0", "65", "-1", "two")),
    *(("proxy", PROXY, "--workers", v, "a whole number from 1 to 64") for v in ("0", "65", "-1", "two", "1.5")),
    *(("demo", ["demo"], "--seconds", v, "a number of seconds from 3 to 86400")
      for v in ("0", "-1", "2.5", "nan", "inf", "86400.5", "1e9")),
    *(("demo", ["demo"], "--latency", v, "a number of seconds from 0 to 5") for v in ("-0.01", "5.5", "nan", "inf")),
    *(("demo", ["demo"], "--regions", v, "a whole number from 2 to 8") for v in ("0", "-2", "1", "9", "2.5")),
    *(("bench accuracy", ["bench", "accuracy"], "--duration", v,
       "a number of seconds greater than 0 and at most 3600, such as 5 or 0.5")
      for v in ("0", "-5", "nan", "inf", "3600.5", "1e12")),
]


@pytest.mark.parametrize(("command", "args", "flag", "value", "expected"), CASES,
                         ids=[f"{c[0].replace(' ', '-')}{c[2]}={c[3]}" for c in CASES])
def test_out_of_range_numeric_flag_is_a_usage_error(
    command: str, args: list[str], flag: str, value: str, expected: str,
) -> None:
    line = assert_usage_error(run_cli(*args, flag, value), command, flag)
    assert f"must be {expected}, got {value!r}" in line, line


def test_flush_timeout_zero_is_accepted(tmp_path: Path) -> None:
    """0 stays valid (stop without waiting for the outboxes): parsing passes, the config is next."""
    missing = tmp_path / "nope.toml"
    out = run_cli("agent", "--config", str(missing), "--flush-timeout", "0")
    assert out.returncode == 1, out
    assert "argument --flush-timeout" not in out.stderr, out.stderr
    assert "does not exist" in out.stderr, out.stderr


@pytest.mark.parametrize(("flag", "value"), [
    ("--regions", "1"), ("--regions", "2"), ("--regions", "8"), ("--regions", "9"),
    ("--seconds", "2.999"), ("--seconds", "3"), ("--seconds", "86400"), ("--seconds", "86400.001"), ("--seconds", "1e9"),
    ("--latency", "-0.001"), ("--latency", "0"), ("--latency", "5"), ("--latency", "5.001"),
])
def test_demo_flags_and_run_demo_agree_on_the_bounds(flag: str, value: str) -> None:
    """The CLI writes the demo's bounds out (parsing does not import the demo): they must match
    what run_demo itself accepts."""
    try:
        build_parser().parse_args(["demo", flag, value])
        cli_ok = True
    except SystemExit:
        cli_ok = False
    options: dict[str, Any] = {"regions": 3, "seconds": 55.0, "policy": "share", "plot": "", "latency": 0.05}
    options[flag.lstrip("-")] = int(value) if flag == "--regions" else float(value)
    assert cli_ok == (_check_arguments(**options) is None)


@pytest.mark.parametrize("duration", [0.0, -5.0, math.nan, math.inf, 3600.5, 1e12])
def test_run_accuracy_bench_refuses_a_bad_duration(duration: float, capsys: pytest.CaptureFixture[str]) -> None:
    """The Python API too, before it starts a redis-server (nan never ended, 1e12 ran for ages)."""
    assert run_accuracy_bench(["standard"], duration=duration, redis_url="redis://127.0.0.1:1/0") == 2
    assert "--duration must be a number of seconds greater than 0 and at most 3600" in capsys.readouterr().err
