"""Things a newcomer hits first: `python -m geolimit` next to the clone, a port already in use."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_dash_m_geolimit_from_the_directory_that_holds_the_clone(tmp_path: Path) -> None:
    (tmp_path / "geolimit").symlink_to(ROOT, target_is_directory=True)  # as `git clone .../geolimit` makes
    out = subprocess.run([sys.executable, "-m", "geolimit", "--version"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("geolimit ")


def test_agent_on_a_port_in_use_is_a_one_line_error(tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "gossip.key").write_bytes(secrets.token_bytes(32))
    os.chmod(tmp_path / "gossip.key", 0o600)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        (tmp_path / "region.toml").write_text(
            f'[region]\nname = "a"\nredis_url = "{redis_url}"\nlisten = "127.0.0.1:{port}"\n'
            f'key_prefix = "nc{secrets.token_hex(4)}"\n'
            f'secret_file = "gossip.key"\n\n[gossip]\ninterval = 0.1\npeers = []\n\n'
            f'[[rule]]\nname = "api"\nlimit = "10/10s"\n'
        )
        out = subprocess.run([sys.executable, "-m", "geolimit", "agent", "--config", str(tmp_path / "region.toml")],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"geolimit: error: agent a: cannot listen: {errors[0].partition('cannot listen: ')[2]}"], out.stderr
    assert "address already in use" in errors[0].lower()
    assert "Traceback" not in out.stderr


def _commands() -> dict[str, list[str]]:
    """Every CLI command (``"bench accuracy"``, ...) and its documented option strings."""
    import argparse

    from geolimit.cli import build_parser

    found: dict[str, list[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            found[" ".join(path)] = [
                option for a in parser._actions if a.help != argparse.SUPPRESS
                for option in a.option_strings if option.startswith("--") and option != "--help"
            ]

    walk(build_parser(), [])
    return found


def test_readme_cli_table_lists_every_command_and_flag() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Command line", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1]: line for line in table.splitlines() if line.startswith("| `geolimit ")}
    for command, options in _commands().items():
        row = next((r for usage, r in rows.items() if usage.startswith(f"geolimit {command} ")
                    or usage == f"geolimit {command}"), None)
        assert row is not None, f"`geolimit {command}` is missing from the README's CLI table"
        missing = [o for o in options if o not in row]
        assert not missing, f"`geolimit {command}`: {missing} missing from the README's CLI table"
    assert "geolimit-demo.png" in rows[next(u for u in rows if u.startswith("geolimit demo"))]
    assert "55 s" in rows[next(u for u in rows if u.startswith("geolimit demo"))]
