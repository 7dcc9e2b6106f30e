"""The low mark's claim (design section 2), checked on a data key's raw fields."""

from __future__ import annotations

from collections.abc import Mapping

from geolimit.core.cells import bucket_at


def assert_mark_holds(key: bytes, fields: Mapping[bytes, bytes], ring: int) -> bool:
    """Assert that no value or floor field of ``key`` lies below its mark ``l``;
    False if the key has no mark (or no head)."""
    if b"l" not in fields or b"h" not in fields:
        return False
    low, head = int(fields[b"l"]), int(fields[b"h"])
    for name in fields:
        try:
            f = int(name)
        except ValueError:
            continue
        bucket = bucket_at((-f - 1 if f < 0 else f) % ring, head, ring)
        assert bucket >= low, f"{key!r}: field {name!r} is bucket {bucket}, below the mark {low}: {dict(fields)}"
    return True
