"""Running ``python -m geolimit`` once and checking its one-line usage errors."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["assert_usage_error", "run_cli"]


def run_cli(*args: str, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """``geolimit ARGS`` to completion (60 s at most), stderr captured."""
    return subprocess.run([sys.executable, "-m", "geolimit", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=60)


def assert_usage_error(out: subprocess.CompletedProcess[str], command: str, argument: str) -> str:
    """The one stderr line of a usage error of ``geolimit COMMAND`` about ``argument``; nothing on stdout
    (`try --embedded` prints the embedded server's URL there once it started one)."""
    assert (out.returncode, out.stdout) == (2, ""), out
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"geolimit {command}: error: argument {argument}: "), out.stderr
    assert out.stderr.endswith(f" (see 'geolimit {command} --help')\n"), out.stderr
    return out.stderr.rstrip()
