"""bench/antientropy.py (P10) still runs its repair exchange to the end, with either merge.

Its merge callbacks are handed to :class:`AntiEntropy`, whose ``Merge`` signature grew an
``admit`` argument; the bench kept the old one, so the no-difference runs passed and the
repair run died with a ``TypeError`` at 1M keys after a minute of filling. A small run of
each merge (a few seconds) must repair every key it made differ, find nothing the run
after, and leave the changed keys equal cell by cell.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "antientropy.py"


@pytest.mark.parametrize("merge", ["store", "naive"])
def test_a_small_run_repairs_every_difference_and_then_finds_none(tmp_path: Path, merge: str) -> None:
    out = tmp_path / "ae.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--keys", "3000", "--repeat", "1", "--merge", merge, "--check-rate", "100",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    first, second = data["repair"][0]["result"], data["repair"][1]["result"]
    made = sum(data["verify"]["kinds"].values())
    assert made == 30  # 1 % of 3,000 keys
    assert first["keys_differing"] == made
    assert first["keys_received"] > 0  # both directions
    assert first["keys_sent"] > 0
    assert second["keys_differing"] == 0
    assert data["verify"]["changed_keys_unequal"] == 0
    assert data["verify"]["random_keys_unequal"] == 0
    assert "PASS  repaired within 2 runs" in run.stdout
