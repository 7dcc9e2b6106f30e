"""msgpack decoding with a cap on the number of containers (arrays and maps).

msgpack's own limits bound each object (``max_array_len`` and the like), not how
many there are: a 16 MB body of 16 million empty arrays passes every per-object
limit and costs about 1 GB and several seconds to decode, on the event loop. A
peer's envelope holds at most a few thousand arrays and a blob exactly five, so
:func:`unpack_bounded` counts the containers as msgpack builds them (its list and
object hooks, called once per container) and stops at the first one too many:
a bomb is refused after microseconds, whatever its size.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["unpack_bounded"]


class _TooManyContainers(ValueError):
    """More arrays and maps than the caller allows (raised from inside msgpack's decoder)."""


def unpack_bounded(data: bytes, max_containers: int, **limits: Any) -> Any:
    """``msgpack.unpackb(data, **limits)``, refusing more than ``max_containers`` arrays
    and maps in all (:class:`_TooManyContainers`; msgpack's own errors pass through)."""
    count = 0

    def counted(obj: Any) -> Any:
        nonlocal count
        count += 1
        if count > max_containers:
            raise _TooManyContainers(f"more than {max_containers} arrays and maps")
        return obj

    return msgpack.unpackb(data, list_hook=counted, object_hook=counted, **limits)
