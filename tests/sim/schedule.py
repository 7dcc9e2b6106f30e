"""Simulation schedules as plain data: steps over named regions, and the cluster they run on.

``repr`` of a :class:`Schedule` is Python that rebuilds it, so a failing example
that hypothesis prints can be pasted into a regression test.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMES = "abcd"


@dataclass(frozen=True)
class Hit:
    region: str
    subject: int
    rules: str  # "fine", "coarse" or "fine+coarse" (one all-or-nothing hit)
    cost: int = 1

    def __repr__(self) -> str:
        return f"Hit({self.region!r}, {self.subject}, {self.rules!r}, {self.cost})"


@dataclass(frozen=True)
class Advance:
    seconds: float

    def __repr__(self) -> str:
        return f"Advance({self.seconds})"


@dataclass(frozen=True)
class Cut:
    a: str
    b: str
    both: bool = True

    def __repr__(self) -> str:
        return f"Cut({self.a!r}, {self.b!r}, {self.both})"


@dataclass(frozen=True)
class Heal:
    a: str
    b: str
    both: bool = True

    def __repr__(self) -> str:
        return f"Heal({self.a!r}, {self.b!r}, {self.both})"


@dataclass(frozen=True)
class Isolate:
    region: str

    def __repr__(self) -> str:
        return f"Isolate({self.region!r})"


@dataclass(frozen=True)
class Rejoin:
    region: str

    def __repr__(self) -> str:
        return f"Rejoin({self.region!r})"


@dataclass(frozen=True)
class SetFaults:
    a: str
    b: str
    drop_request: float = 0.0
    drop_response: float = 0.0
    duplicate: float = 0.0
    both: bool = True

    def __repr__(self) -> str:
        return (f"SetFaults({self.a!r}, {self.b!r}, {self.drop_request}, {self.drop_response}, "
                f"{self.duplicate}, {self.both})")


@dataclass(frozen=True)
class Jitter:
    seconds: float  # 0 turns jitter off; more than the gaps between sends reorders messages

    def __repr__(self) -> str:
        return f"Jitter({self.seconds})"


@dataclass(frozen=True)
class RestartAgent:
    region: str

    def __repr__(self) -> str:
        return f"RestartAgent({self.region!r})"


@dataclass(frozen=True)
class Wipe:
    region: str
    sync: bool = True

    def __repr__(self) -> str:
        return f"Wipe({self.region!r}, {self.sync})"


Step = Hit | Advance | Cut | Heal | Isolate | Rejoin | SetFaults | Jitter | RestartAgent | Wipe


@dataclass(frozen=True)
class Schedule:
    steps: tuple[Step, ...]
    regions: int = 3
    skew: tuple[float, ...] = ()  # clock offset per region (seconds; pairwise within MAX_CLOCK_SKEW)
    latency: float = 0.05
    shards: int = 4
    seed: int = 1
    namespace: int = 0  # subjects are b"ns<namespace>:<subject>"
    ae_interval: float = 30.0

    @property
    def names(self) -> list[str]:
        return list(NAMES[: self.regions])

    def subject(self, index: int) -> bytes:
        return b"ns%d:%d" % (self.namespace, index)
