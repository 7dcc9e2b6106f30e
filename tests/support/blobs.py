"""Read merge blobs back into cells (tests only; the agent never decodes a blob in Python)."""

from __future__ import annotations

from geolimit.replication.redis_io import unpack_blob
from geolimit.replication.wire import Blob, Cell6


def unblob(blobs: list[Blob]) -> list[Cell6]:
    """Every cell of ``blobs`` as ``(rule, subject, bucket, slot id, value, floor)``."""
    out: list[Cell6] = []
    for _, blob in blobs:
        slots, keys = unpack_blob(blob)
        for suffix, flat in keys:
            rule, _, subject = suffix.partition(b":")
            for i in range(0, len(flat), 4):
                out.append((rule.decode(), subject, flat[i], slots[flat[i + 1]].decode(), flat[i + 2], flat[i + 3]))
    return out
