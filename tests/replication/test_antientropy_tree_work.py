"""A peer's ``tree`` step costs at most one pass over the leaves, however it names nodes.

A signed peer that began an exchange with 2**20 leaves and asked for node 0 of level
1 2048 times in one request made the responder sum 2048 x 4096 leaves (160 ms of the
event loop a request; with 4 such loops `/v1/check` waited 1.4 s at p50). Each node is
now summed once a request.
"""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

from geolimit.replication.antientropy.common import MAX_NODES, _Digests, _node_sums


class CountingArray(array):  # type: ignore[type-arg]
    """An array that counts the elements its slices hand out."""

    read = 0

    def __getitem__(self, index: Any) -> Any:
        got = super().__getitem__(index)
        if isinstance(index, slice):
            CountingArray.read += len(got)
        return got


def digests(shards: int, leaves: int) -> _Digests:
    d = _Digests(shards, leaves)
    for g in range(0, shards * leaves, 7):
        d.add_leaf(g, g * 31 + 1)
    asyncio.run(d.reduce())
    d.leaves = True
    d.digests = CountingArray("Q", d.digests)
    d.counts = CountingArray("I", d.counts)
    return d


def test_the_same_node_named_2048_times_is_summed_once() -> None:
    d = digests(16, 65536)
    honest = _node_sums(d, 65536, 16, [0])
    CountingArray.read = 0
    sums, counts = _node_sums(d, 65536, 16, [0] * MAX_NODES)
    assert (sums, counts) == (honest[0] * MAX_NODES, honest[1] * MAX_NODES)
    assert CountingArray.read == 2 * 4096  # digests and counts of one node, not of 2048


def test_a_request_reads_each_leaf_at_most_once() -> None:
    d = digests(16, 65536)
    CountingArray.read = 0
    nodes = [g % 256 for g in range(MAX_NODES)]  # every node of level 1, each named 8 times
    _node_sums(d, 65536, 16, nodes)
    assert CountingArray.read == 2 * 16 * 65536
