"""The rates the dispatcher's live snapshots tell (`NOTIFY pepsi_live`, `dispatch.services.live`).

`LiveRates` is pure: it takes successive snapshots
(`pepsi.admin.watch.live_snapshot`: one notification parsed, the parts of a
split one joined) and tells per-stage rates over the last WINDOW seconds,
whether the dispatcher restarted (its counters start again: so does the
history) and whether it is still heard from. The listeners that feed one
(`pepsi top`, the web console) are in `pepsi.admin.watch.live_listener`.

Times: a snapshot's `t` is the dispatcher's wall clock, and spaces the
snapshots; when it arrived is the reader's own (monotonic) clock, which says
how old the last one is. The two are never compared.

How the rates are taken. The counters are cumulative since the dispatcher's
start, so a rate is a difference between two points over their time apart.
Beyond the snapshots, three facts give points: the counters were all 0 at
the start; a busy dispatcher sends every `interval`, and an idle one within
an `interval` of any change, so between two consecutive snapshots (seq n,
n+1) nothing changed until `interval` before the second, and nothing has
changed since the last one until `interval` ago; and a snapshot's
`quiet_since` says since when its counters have not changed. The window
ends now (or at the last snapshot, within an interval of it) and starts
WINDOW seconds earlier, at the nearest point these facts give; a start more
than a window before that is too coarse (a long-running dispatcher's start,
say): the first point inside the window is taken instead, and the window is
shorter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pepsi.admin.watch.live_snapshot import LiveSnapshot

WINDOW = 10.0  # seconds the rates average over
STALE_INTERVALS = 3  # silence past the heartbeat and this many intervals: not heard from
DISPATCH_RATED = ("claims", "claimed")

# LiveView.state
NONE = "none"  # no snapshot yet (an idle dispatcher's next one may be a heartbeat away)
LIVE = "live"
STALE = "stale"  # none for too long: the dispatcher is not running, or cannot be heard
STOPPED = "stopped"  # the dispatcher said it stopped


@dataclass(frozen=True)
class StageRates:
    rates: Mapping[str, float | None]  # counter -> per second
    in_flight: int = 0
    workers: int = 0


@dataclass(frozen=True)
class LiveView:
    """What the live snapshots say now."""

    state: str  # NONE, LIVE, STALE, STOPPED
    window: float | None = None  # seconds the rates span; None: no rates
    age: float | None = None  # seconds since the last snapshot arrived
    pid: int | None = None
    started: float | None = None  # the dispatcher's start, Unix time
    stages: Mapping[str, StageRates] = field(default_factory=dict)
    dispatch: Mapping[str, float | None] = field(default_factory=dict)  # claims/s, claimed/s
    dropped: int = 0  # stages the dispatcher left out of its snapshots

    @property
    def available(self) -> bool:
        """Rates to show: the dispatcher is heard from and two points are known."""
        return self.state == LIVE and self.window is not None

    def rate(self, stage: str, counter: str) -> float | None:
        """A stage's rate; a stage the running dispatcher does not name did nothing."""
        rates = self.stages.get(stage)
        if rates is None:
            return None if self.dropped or not self.available else 0.0
        return rates.rates.get(counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "window_s": _round(self.window),
            "age_s": _round(self.age),
            "pid": self.pid,
            "started": self.started,
            "stages": {
                name: {
                    "rates": {k: _round(v) for k, v in s.rates.items()},
                    "in_flight": s.in_flight,
                    "workers": s.workers,
                }
                for name, s in self.stages.items()
            },
            "dispatch": {k: _round(v) for k, v in self.dispatch.items()},
            "dropped": self.dropped,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


Counters = dict[tuple[str, str], int]  # (stage, counter) or ("", dispatch counter) -> n


@dataclass(frozen=True)
class _Point:
    t: float  # the dispatcher's clock
    seq: int | None  # None: not a snapshot of its own (a quiet point)
    counters: Counters


def _counters(snapshot: LiveSnapshot) -> Counters:
    """The counters to rate, zeros left out (so that equal counters compare equal)."""
    out: Counters = {("", k): n for k, n in snapshot.dispatch.items() if k in DISPATCH_RATED and n}
    for name, stage in snapshot.stages.items():
        out.update(((name, k), n) for k, n in stage.counters.items() if n)
    return out


class LiveRates:
    """Successive snapshots in, rates out (see the module's docstring). Pure: the times
    are parameters (`received` and `now` on one monotonic clock of the reader's)."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self.last: LiveSnapshot | None = None
        self.received = 0.0
        self.points: list[_Point] = []

    def feed(self, snapshot: LiveSnapshot, received: float) -> None:
        last = self.last
        counters = _counters(snapshot)
        restarted = last is None or (snapshot.pid, snapshot.started) != (last.pid, last.started)
        if not restarted and last is not None and snapshot.seq <= last.seq:
            return  # a repeat, or out of order: nothing new
        if restarted:
            # all counters were 0 at the start: the first point, seq 0
            self.points = [_Point(snapshot.started, 0, {})]
        elif any(counters.get(k, 0) < n for k, n in self.points[-1].counters.items()):
            self.points = []  # counters went back: start over rather than rate negatively
        previous = self.points[-1] if self.points else _Point(float("-inf"), None, {})
        if previous.t < snapshot.quiet_since < snapshot.at:
            self.points.append(_Point(snapshot.quiet_since, None, counters))
        if snapshot.at > previous.t:
            self.points.append(_Point(snapshot.at, snapshot.seq, counters))
        elif snapshot.at == previous.t:
            self.points[-1] = _Point(snapshot.at, snapshot.seq, counters)
        self.last, self.received = snapshot, received
        self._prune()

    def _prune(self) -> None:
        """Keep what a window can still start from."""
        horizon = self.points[-1].t - 3 * self.window
        while len(self.points) > 2 and self.points[1].t <= horizon:
            del self.points[0]

    def state(self, now: float) -> str:
        last = self.last
        if last is None:
            return NONE
        if last.final:
            return STOPPED
        if now - self.received > last.heartbeat + STALE_INTERVALS * last.interval:
            return STALE
        return LIVE

    def view(self, now: float) -> LiveView:
        last = self.last
        state = self.state(now)
        if last is None:
            return LiveView(state)
        age = max(0.0, now - self.received)
        span = self._span(now) if state == LIVE else None
        window: float | None = None
        stages: dict[str, StageRates] = {}
        dispatch: dict[str, float | None] = {}
        if span is not None:
            start, end, (counters_start, counters_end) = span
            window = seconds = end - start

            def rate(key: tuple[str, str]) -> float | None:
                before, after = counters_start.get(key, 0), counters_end.get(key, 0)
                return None if after < before else (after - before) / seconds

        else:

            def rate(key: tuple[str, str]) -> float | None:
                return None

        for name, stage in last.stages.items():
            rates = {k: rate((name, k)) for k in stage.counters}
            stages[name] = StageRates(rates, stage.in_flight, stage.workers)
        dispatch = {k: rate(("", k)) for k in DISPATCH_RATED}
        return LiveView(
            state=state, window=window, age=age, pid=last.pid, started=last.started,
            stages=stages, dispatch=dispatch, dropped=last.dropped,
        )  # fmt: skip

    def _span(self, now: float) -> tuple[float, float, tuple[Counters, Counters]] | None:
        """(start, end, (counters at start, at end)) of the rates' window, or None."""
        last = self.last
        assert last is not None
        points = self.points
        interval = last.interval
        # nothing changed since the last snapshot until an interval ago
        end = points[-1].t + max(0.0, now - self.received - interval)
        target = end - self.window
        before = [i for i, p in enumerate(points) if p.t <= target]
        if before:
            i = before[-1]
            here = points[i]
            start = here.t
            if i + 1 < len(points):
                after = points[i + 1]
                if after.counters == here.counters:
                    start = max(here.t, min(target, after.t))
                elif here.seq is not None and after.seq == here.seq + 1:
                    start = max(here.t, min(target, after.t - interval))
            else:
                start = target  # the last point: nothing changed since
            if start >= end - 2 * self.window:
                return start, end, (here.counters, points[-1].counters)
        later = [p for p in points[:-1] if p.t > target]
        if not later:
            return None
        first = later[0]
        if end - first.t < interval / 2:
            return None  # too short to tell a rate
        return first.t, end, (first.counters, points[-1].counters)
