"""Per-peer state of the gossip engine and its tunables."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from geolimit.core.rule import Rule

__all__ = ["EngineSettings", "PeerState", "heartbeat_for"]


@dataclass(frozen=True)
class EngineSettings:
    interval: float = 0.1
    anti_entropy_interval: float = 30.0
    max_backoff: float = 0.2  # retries keep probing a failed peer this often, so a heal is noticed fast
    probe_cells: int = 200  # cells per attempt while a peer is failing
    max_cells_per_message: int = 10_000  # bounds how long a peer spends merging one request
    send_timeout: float = 5.0  # the transport's timeout: messages that take half of it get smaller
    heartbeat: float = 1.0  # send (possibly empty) deltas at least this often
    lease_ttl: float = 15.0
    window: int = 4  # messages in flight per peer (at most 8)
    drain_passes: int = 16  # bounded drain calls per shard and round
    ae_max_keys: int = 200_000  # keys listed and repaired per anti-entropy run (the next run goes on)
    #: Periodic exchanges compare only buckets that ended at least this long ago (cells of
    #: later ones may still be in deltas); exchanges something asked for compare all.
    ae_settle: float = 10.0
    ae_duty: float = 1.0  # share of Redis time anti-entropy scans may take (each script call is ~1 ms anyway)
    anti_entropy: bool = True  # initiate exchanges (one worker per region does; every worker serves them)
    #: Several workers per region: they share, through the region's Redis, anti-entropy requests
    #: (ae_requests.py) and when each peer's deltas last reached any of them (heard.py).
    several_workers: bool = False
    worker: int = 0  # this worker's index, of ``workers`` (takeover.py)
    workers: int = 1


#: A burst's first message carries 1/RAMP_START of the message limit (PeerState.ramp_limit).
RAMP_START = 8

#: Exchanges whose clock samples are kept per peer (about 2 s of heartbeats when idle).
CLOCK_SAMPLES = 8


def heartbeat_for(interval: float, rules: Iterable[Rule]) -> float:
    """How often an idle agent sends an (empty) delta: a quarter of the shortest
    ``partition_after`` of the gossip rules that watch peers' freshness (``predict``,
    or a ``share`` / ``closed`` partition policy), at most 1 s and at least one interval.

    A healthy peer's counts are up to a heartbeat, two intervals and a round trip old
    here (see ``GossipEngine.peer_ages``). With a heartbeat of 1 s and the default
    ``partition_after`` of 1 s, an idle but healthy peer looked partitioned for the
    last ~0.2 s of every second: ``closed`` rules denied everything, ``share`` rules
    reserved a fair share, and predictions ended at once in every region.
    """
    watched = (r.partition_after for r in rules if not r.escrow and (r.predict or r.partition != "local"))
    shortest = min(watched, default=4.0)
    return max(interval, min(1.0, shortest / 4))


@dataclass
class PeerState:
    name: str
    last_ok: float | None = None  # when it last answered us
    last_heard: float | None = None  # when its last delta (or heartbeat) reached us
    update_us: int = 0  # the sender's clock (Message.now_us) of its latest delta here (0: none yet)
    last_attempt: float | None = None
    failures: int = 0
    errors: int = 0
    last_error: str | None = None
    last_error_at: float | None = None  # when (engine clock) last_error happened
    reported_down: frozenset[str] = frozenset()  # peers its last report said it cannot reach
    #: peer -> when (our clock) this peer's reports first showed its link to that peer down,
    #: until an exchange with that peer is asked for or a report shows the link up
    #: (Receiver.note_reach, Receiver.lapse_down_reports)
    down_reported: dict[str, float] = field(default_factory=dict)
    prune_cursors: dict[int, bytes] = field(default_factory=dict)  # shard -> outbox scan cursor (see prune.lua)
    prune_next: int = 0  # index into the owned shards of the next shard to prune
    next_attempt: float = 0.0
    reach: dict[str, float] = field(default_factory=dict)
    reach_at: float = 0.0
    failing: frozenset[str] = frozenset()  # peers this peer reports it cannot deliver to
    ae_needed: bool = True
    ae_running: bool = False
    ae_asked_at: float | None = None  # when the last exchange that something asked for started
    ae_due: float = 0.0
    ae_concluded: bool = False
    ae_after_wipe: bool = False  # the next exchange repairs our wiped Redis: relay what it merges to all
    ae_ok: int = 0
    ae_failures: int = 0  # anti-entropy runs failed in a row (not a sign the peer is down)
    ae_last_error: str | None = None
    ae_retry_at: float = 0.0  # backoff after a failed anti-entropy run
    refused: int = 0  # cells of batches this peer refused (dropped; anti-entropy repairs them)
    cells_sent: int = 0
    cells_received: int = 0
    rtt: float = 0.0  # smoothed round trip of our messages to this peer (seconds)
    #: (round trip, offset) of our last exchanges with this peer, for its clock offset (see
    #: Receiver.note_clock_sample): the least-delayed one is the best estimate.
    clock_samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=CLOCK_SAMPLES))
    skew: float = 0.0  # smoothed estimate of the peer's clock minus ours (seconds)
    skew_known: bool = False  # skew holds at least one sample (the agreed clock counts it)
    clock_refusals: int = 0  # its signed messages refused for a time outside the auth window
    refused_offset: float | None = None  # the last such message's time minus ours (seconds)
    refused_offset_at: float | None = None  # when (our clock)
    pending: dict[int, int] = field(default_factory=dict)  # shard -> keys queued in Redis for this peer
    oldest_us: int | None = None  # when the oldest queued change was queued (µs, Redis clock)
    flight_since: dict[int, int] = field(default_factory=dict)  # in-flight slot -> its oldest change (µs)
    failing_since: float | None = None  # while failing: its last acknowledgement (or first failed attempt)
    # Exchanges it answered with 401 "auth" (it does not accept our signature: another secret).
    auth_refusals: int = 0
    auth_refused: bool = False  # its latest answer was such a refusal (a success clears it)
    auth_refused_reason: str | None = None  # what it said
    auth_refused_at: float | None = None  # when (engine clock)
    auth_warned_at: float | None = None  # when the last warning about it was logged
    auth_held_back: int = 0  # refusals since that warning
    flying: set[int] = field(default_factory=set)  # in-flight message slots
    flight_keys: dict[int, int] = field(default_factory=dict)  # in-flight slot -> keys it carries
    unsettled: set[int] = field(default_factory=set)  # slots whose outcome could not be recorded
    cursor: int = 0  # shard the next message starts packing from (fairness)
    message_cells: int = 0  # cells per message for this peer while it is slow (0: the maximum)
    ramp_cells: int = 0  # the next message's cap while a burst ramps up (0: none, see ramp_limit)
    # One message packs at a time: the first is sent (and merged by the peer) while the next packs.
    packing: asyncio.Lock = field(default_factory=asyncio.Lock)

    def shift_times(self, by: float) -> None:
        """Move every time recorded on the engine clock by ``by`` seconds (the clock stepped)."""
        for name in ("last_ok", "last_heard", "last_attempt", "last_error_at", "ae_asked_at", "failing_since",
                     "refused_offset_at", "auth_refused_at", "auth_warned_at"):
            when = getattr(self, name)
            if when is not None:
                setattr(self, name, when + by)
        for name in ("next_attempt", "reach_at", "ae_due", "ae_retry_at"):
            when = getattr(self, name)
            if when:
                setattr(self, name, when + by)

    def message_limit(self, settings: EngineSettings) -> int:
        """Cells per message to this peer now."""
        return self.message_cells or settings.max_cells_per_message

    def start_ramp(self, limit: int) -> None:
        """Nothing is in flight to this peer: the next messages ramp up to ``limit`` cells."""
        self.ramp_cells = max(1, limit // RAMP_START)

    def ramp_limit(self, limit: int) -> int:
        """The cap of the next message of a burst, within ``limit``, and grow the ramp.

        A burst (see :meth:`start_ramp`) sends first a message of an eighth of
        ``limit``, then each one half as large again, up to ``limit``: the peer starts
        merging after a short pack instead of a full one, and the next message packs
        while it merges (packing a cell costs about as much as merging it).
        """
        cap = self.ramp_cells or limit
        grown = cap + (cap + 1) // 2
        self.ramp_cells = 0 if grown >= limit else grown
        return min(cap, limit)

    def resize(self, settings: EngineSettings, cells: int, took: float | None) -> None:
        """Adapt the message size to this peer: halve it when a message of ``cells`` failed
        (``took`` None) or took over half the send timeout, double it back when a
        full one took under an eighth. A peer that merges slowly then never sees a message
        it cannot merge within the timeout: a timed-out message was often merged
        all the same, and sending it again is the work the peer had no time for."""
        current = self.message_limit(settings)
        if took is None or took > settings.send_timeout / 2:
            if cells > settings.probe_cells and cells * 2 > current:
                self.message_cells = max(settings.probe_cells, current // 2)
        elif took < settings.send_timeout / 8 and cells * 2 >= current and current < settings.max_cells_per_message:
            grown = 2 * current
            self.message_cells = 0 if grown >= settings.max_cells_per_message else grown

    def lag(self, now: float) -> float:
        """Seconds this peer is behind (``now``: the engine clock): the age of the oldest change
        it has not acknowledged, queued in its outbox or in flight (a message to a peer that
        never answers stays in flight until the timeout), and, while its exchanges fail (any
        way: refused, unreachable, timed out), at least the time since it acknowledged any."""
        oldest = min((t for t in (self.oldest_us, *self.flight_since.values()) if t is not None), default=None)
        lag = 0.0 if oldest is None else now - oldest / 1e6
        if self.failures and self.failing_since is not None:
            lag = max(lag, now - self.failing_since)
        return max(0.0, lag)

    @property
    def queued(self) -> int:
        """Keys not yet acknowledged by this peer: queued (as of the last drain or pack) or in flight."""
        return sum(self.pending.values()) + sum(self.flight_keys.values())

    @property
    def unsent(self) -> int:
        """Keys queued in this peer's outbox, not in flight."""
        return sum(self.pending.values())


def message_caps(shards: list[int], pending: dict[int, int], room: int) -> tuple[list[int], list[int]]:
    """The shards of one batch of pack calls and each one's cell cap, within ``room``.

    A shard may take its whole outbox (``pending``: keys, about one cell each in
    a steady stream) or an even share of the room left, whichever is more; the
    caps never add up to more than ``room``.
    """
    batch: list[int] = []
    caps: list[int] = []
    for i, shard in enumerate(shards):
        if room <= 0:
            break
        cap = min(room, max(pending.get(shard, 0), room // (len(shards) - i)))
        if cap <= 0:
            break
        batch.append(shard)
        caps.append(cap)
        room -= cap
    return batch, caps
