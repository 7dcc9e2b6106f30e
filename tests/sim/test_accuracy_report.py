"""``geolimit bench accuracy`` runs end to end (short, in virtual time) and reports against the oracle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_accuracy_prints_targets_and_json(redis_url: str, tmp_path: Path) -> None:
    out_json = tmp_path / "acc.json"
    run = subprocess.run(
        [sys.executable, "-m", "geolimit.cli", "bench", "accuracy", "--scenario", "standard",
         "--scenario", "partition-share", "--duration", "12", "--json", str(out_json), "--redis-url", redis_url],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "P3 max over-admission, standard" in run.stdout
    assert "no replication" in run.stdout
    assert "static split" in run.stdout
    data = json.loads(out_json.read_text())
    runs = {(r["scenario"], r["variant"]): r for r in data["runs"]}
    geo = runs[("standard", "geolimit")]["accuracy"]
    alone = runs[("standard", "no replication")]["accuracy"]
    # Replication is what keeps the regions near the global limit: without it they admit ~3x.
    assert alone["max_over_pct"] > 100
    assert geo["max_over_pct"] < 10
    assert runs[("partition-share", "geolimit")]["convergence_after_heal_s"] is not None


def test_unknown_scenarios_are_refused() -> None:
    run = subprocess.run([sys.executable, "-m", "geolimit.cli", "bench", "accuracy", "--scenario", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "unknown scenario(s) nope" in run.stderr
