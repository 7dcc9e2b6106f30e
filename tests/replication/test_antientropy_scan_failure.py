"""An anti-entropy scan that fails while it is still planning (reading a second node's registries)
raises that failure and leaves no scan of the first node behind unawaited.

Seen in CI on the Redis Cluster fixture: ``RuntimeWarning: coroutine '_Local._stream' was never
awaited`` (a pass stopped while it read the next node's registries dropped the scans it had made).
"""

from __future__ import annotations

import gc
import warnings

import pytest

from geolimit.errors import StorageError
from geolimit.replication.antientropy.common import _Plan
from geolimit.replication.antientropy.local import _Local
from geolimit.replication.antientropy.scan import _Progress
from tests.replication.antientropy_support import NOW_US, RULES, Region, regions, servers

__all__ = ["regions", "servers"]  # fixtures


async def test_a_scan_failing_between_two_nodes_raises_and_leaves_no_scan_unawaited(
    regions: tuple[Region, Region], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = regions

    async def two_nodes(self: _Local) -> list[tuple[int, list[int]]]:  # as a cluster of two masters
        return [(0, list(range(8))), (8, list(range(8, 16)))]

    real_codes, calls = _Local._codes, []

    async def codes(self: _Local, shards: list[int]) -> dict[int, list[bytes]]:
        calls.append(shards)
        if len(calls) == 2:
            raise StorageError("the second node is gone")
        return await real_codes(self, shards)

    monkeypatch.setattr(_Local, "_groups", two_nodes)
    monkeypatch.setattr(_Local, "_codes", codes)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(StorageError, match="the second node is gone"):
            await _Local(a.store, a.layout, 64).digests(_Plan(NOW_US, dict(RULES), 64, 16), _Progress())
        gc.collect()
    assert len(calls) == 2
    assert not [w for w in seen if "was never awaited" in str(w.message)], [str(w.message) for w in seen]
