"""The command line, run as a real subprocess."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "geolimit.cli", *args], capture_output=True, text=True, timeout=60)


def test_version() -> None:
    out = _run("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("geolimit ")


def test_python_dash_m_geolimit_is_the_same_command() -> None:
    out = subprocess.run([sys.executable, "-m", "geolimit", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _run("--version").stdout


def test_try_against_a_real_redis(redis_url: str, redis_client: object) -> None:
    out = _run("try", "--redis", redis_url, "--times", "4", "3/10s", "user:42")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["allowed", "allowed", "allowed", "denied"]


def test_bad_rate_is_a_clear_error(redis_url: str) -> None:
    out = _run("try", "--redis", redis_url, "3 per fortnight", "u")
    assert out.returncode == 2  # a usage error (tests/test_cli_local_args.py)
    assert "argument rate: invalid rate '3 per fortnight'" in out.stderr


def _agent_config(tmp_path: Path, listen: str = "127.0.0.1:7400") -> Path:
    """A valid region file (nothing is started: the tests below stop at the configuration)."""
    (tmp_path / "gossip.key").write_text(secrets.token_hex(32) + "\n")
    config = tmp_path / "region.toml"
    config.write_text(
        f'[region]\nname = "a"\nredis_url = "redis://127.0.0.1:1/0"\nlisten = "{listen}"\n'
        'secret_file = "gossip.key"\n[gossip]\ninterval = 0.1\n[[rule]]\nname = "api"\nlimit = "100/10s"\n'
    )
    return config


def test_agent_help_shows_workers_but_not_the_internal_worker_index() -> None:
    out = _run("agent", "--help")
    assert out.returncode == 0, out.stderr
    assert "--workers N" in out.stdout
    assert "[region] workers" in out.stdout
    assert "--worker-index" not in out.stdout


def test_agent_workers_flag_is_checked_before_anything_starts(tmp_path: Path) -> None:
    config = _agent_config(tmp_path)
    for value in ("0", "65", "two"):  # a usage error, as the other flags: exit 2, one line naming the flag
        out = _run("agent", "--config", str(config), "--workers", value)
        assert (out.returncode, out.stderr) == (2, "geolimit agent: error: argument --workers: must be a whole "
                                                f"number from 1 to 64, got {value!r} (see 'geolimit agent --help')\n")
    (tmp_path / "port0").mkdir()
    out = _run("agent", "--config", str(_agent_config(tmp_path / "port0", "127.0.0.1:0")), "--workers", "2")
    assert out.returncode == 1
    assert "--workers = 2 needs a fixed port in region.listen" in out.stderr
    out = _run("agent", "--config", str(config), "--workers", "2", "--worker-index", "2")
    assert (out.returncode, out.stderr.strip()) == (1, "geolimit: error: --worker-index must be from 0 to 1, got 2")


def test_malformed_urls_are_one_line_errors() -> None:
    """Once, an unclosed IPv6 bracket or a URL without a scheme ended in a ValueError traceback."""
    expected = "geolimit: error: --agent must be an http:// or https:// URL such as 'http://127.0.0.1:7400', got "
    for args in (("status", "--agent", "http://[::1"), ("status", "--agent", "notaurl"),
                 ("check", "--agent", "http://[::1", "api", "u"), ("check", "--agent", "ftp://x", "api", "u")):
        out = _run(*args)
        assert (out.returncode, out.stderr.strip()) == (2, f"{expected}{args[2]!r}"), args
    out = _run("check", "--agent", "http://127.0.0.1:9", "api", "u")  # nothing listens on the discard port
    assert out.returncode == 3
    assert out.stderr.startswith("geolimit: error: agent http://127.0.0.1:9 unreachable: ")
    out = _run("try", "--redis", "redis://[::1", "3/10s", "u")
    assert (out.returncode, out.stderr.strip()) == (1, "geolimit: error: invalid Redis URL 'redis://[::1': Invalid IPv6 URL")
