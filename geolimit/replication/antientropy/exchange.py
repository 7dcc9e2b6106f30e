"""Anti-entropy: the responder's state of one exchange."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from geolimit.replication.antientropy.common import _Digests, _Plan
from geolimit.replication.antientropy.local import _Listing
from geolimit.replication.antientropy.scan import _Progress


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned exchange's failure is not "never retrieved"


@dataclass(eq=False)
class _Exchange:
    """The responder's state for one exchange."""

    xid: bytes
    peer: str
    plan: _Plan
    touched: float
    reply: dict[str, Any]
    progress: _Progress = field(default_factory=_Progress)
    digest_task: asyncio.Task[_Digests] | None = None
    leaf_task: asyncio.Task[None] | None = None  # the leaves of the shards in leaf_scope (after a shards-only pass)
    leaf_scope: bytes | None = None
    reduce_task: asyncio.Task[None] | None = None
    list_task: asyncio.Task[None] | None = None
    list_key: bytes = b""
    listing: _Listing | None = None

    def cancel(self) -> None:
        for task in (self.digest_task, self.leaf_task, self.reduce_task, self.list_task):
            if task is not None and not task.done():
                task.cancel()
