"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs_against_a_real_redis(redis_url: str, redis_client: object) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), redis_url],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[4].startswith("hit 5: allowed")
    assert lines[5].startswith("hit 6: denied")
    assert "api+burst for user:7: [True, True, False]" in out.stdout
