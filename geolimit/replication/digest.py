"""The live window of a rule, and a coarse partition of the subject space (pure).

Used by whole-window reads (``ReplicationStore.read_live``: the demo, the
simulator and tests). Anti-entropy proper has its own digests (antientropy.py).
"""

from __future__ import annotations

import zlib

from geolimit.core.rule import Rule
from geolimit.core.window import bucket_of

__all__ = ["PARTITIONS", "live_range", "partition_of"]

PARTITIONS = 64


def partition_of(subject: bytes) -> int:
    return zlib.crc32(subject) % PARTITIONS


def live_range(rule: Rule, now_us: int) -> tuple[int, int]:
    """The buckets anti-entropy covers: the window plus the clock-skew allowance."""
    current = bucket_of(now_us, rule.resolution_us)
    return current - rule.buckets, current + rule.future
