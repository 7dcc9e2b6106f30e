"""Anti-entropy digests (pure).

Both sides of an exchange summarise the cells of the *live window*, taken from
the initiator's clock, in 64 partitions of the subject space. Two regions with
the same cells get the same digests whatever their storage order, because a
partition's digest is the sum (mod 2**63) of its keys' digests and a key's
digest hashes its cells in sorted order.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable, Mapping

from geolimit.core.rule import Rule
from geolimit.core.window import bucket_of

__all__ = ["PARTITIONS", "key_digest", "live_range", "partition_digests", "partition_of"]

PARTITIONS = 64
_MASK = (1 << 63) - 1


def partition_of(subject: bytes) -> int:
    return zlib.crc32(subject) % PARTITIONS


def live_range(rule: Rule, now_us: int) -> tuple[int, int]:
    """The buckets anti-entropy covers: the window plus the clock-skew allowance."""
    current = bucket_of(now_us, rule.resolution_us)
    return current - rule.buckets, current + rule.future


def key_digest(rule: str, subject: bytes, cells: Iterable[tuple[int, str, int, int]]) -> int:
    """Digest of one key's cells ``(bucket, slot, value, floor)``; order does not matter."""
    h = hashlib.blake2b(digest_size=8)
    h.update(rule.encode() + b"\x00" + subject + b"\x00")
    for bucket, slot, value, floor in sorted(c for c in cells if c[2] or c[3]):
        h.update(struct.pack(">QQQ", bucket, value, floor) + slot.encode() + b"\x00")
    return int.from_bytes(h.digest(), "big") & _MASK


def partition_digests(
    keys: Mapping[tuple[str, bytes], Iterable[tuple[int, str, int, int]]],
) -> dict[int, int]:
    """``{partition: digest}`` over every key that has a non-empty cell."""
    out: dict[int, int] = {}
    for (rule, subject), cells in keys.items():
        cells = [c for c in cells if c[2] or c[3]]
        if not cells:
            continue
        part = partition_of(subject)
        out[part] = (out.get(part, 0) + key_digest(rule, subject, cells)) & _MASK
    return out
