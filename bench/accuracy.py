"""Accuracy harness: ``python bench/accuracy.py`` is ``geolimit bench accuracy``.

    python bench/accuracy.py [--scenario NAME ...] [--duration SECONDS] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geolimit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "accuracy", *sys.argv[1:]]))
