"""How many loaders each source gets (pure, no Dask).

The policy combines a proactive and a reactive rule, with hysteresis:

proactive
    A source must supply ``demand = weight_ahead × consumption`` tokens/s,
    where ``weight_ahead`` is the largest weight its schedule (and live
    re-mixes) give it over the look-ahead window, and ``consumption`` is the
    service's token rate.  One loader supplies ``threads / seconds_per_token``
    tokens/s (measured), so the source needs
    ``ceil(headroom × demand / per_loader)`` loaders.
reactive
    When the planner spent more than ``starve_fraction`` of the last window
    waiting for a source's data, and the source's measured capacity is below
    ``2 × headroom ×`` its demand corrected for the wait (``demand / (1 -
    starved)``: without it the planner would have planned that much faster;
    at most ``MAX_STARVED_BOOST``×), or is not measured yet, that source is
    the bottleneck: one more loader than it has now.  Waits for a source whose
    loaders can supply more than twice what it needs are read latency (its
    first units, or units re-read after a re-split), which another loader
    would not shorten.
hysteresis
    Scaling up happens at once (after ``cooldown`` seconds since the source's
    last change), at most doubling the count per change; scaling down only
    after the smaller target has held for ``scale_down_after`` seconds, one
    loader at a time.  When the reactive rule has to add back a loader within
    ``scale_down_after`` of a scale-down, that count becomes the source's floor
    until its demand falls below the one seen then divided by ``headroom`` (no
    7 → 6 → 7 flapping).
CPU cap
    A loader reports the CPU seconds of its work and the time it waited for a
    core next to its busy seconds; a window's ``cpu_fraction`` (CPU seconds /
    busy seconds less that wait) near 1 means the
    source is CPU-bound, and a loader keeps ``threads × cpu_fraction`` cores
    busy.  The cluster has ``cores`` threads (the workers' ``nthreads``); when
    the sources' CPU needs (``demand × cpu_per_token``) exceed them, each gets
    its share of ``cores`` in proportion to its need, else all of them.  A
    source is held at ``cpu_cap = round(its cores / (threads × cpu_fraction))``
    loaders (at least 1), where ``cpu_fraction`` is the largest measured so
    far (contention only lowers it: waiting for the GIL counts as busy time),
    and goes to the cap in one change, not by doubling: more loaders than the
    cores hold only share them.  Until the fraction was measured over
    ``MIN_CPU_WINDOWS`` windows the cap is at most the cores' count over
    ``threads``, or the loaders the source has, if more (a first window can be
    slowed by other threads holding the GIL, which would let the cap overshoot
    and come back).  When the cluster grows the cap grows with it.
saturation
    Each source's capacity (``loaders × threads / seconds_per_token``, the
    seconds waiting for a core left out) is
    recorded per loader count once a change has settled (``cooldown``).  If
    the loaders added since the count below, ``n₀``, each supply less than
    ``MIN_EFFICIENCY`` of what each of the ``n₀`` did, they share an exhausted
    resource (the GIL, a store, or the cores where the wait for a core is not
    measured: busy time per token grows
    with every loader): the source is held at the count that resource allows
    from then on, and the loaders above it are removed at once (down to that
    count, not below: further scale-downs follow the hysteresis).  A saturation
    found on fewer ``cores`` than the cluster has now is probed again.

Every target is clamped to ``[min_loaders, max_loaders]`` of the source.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from msd_dask.core.config import Config, ScalingConfig

__all__ = ["usable_cores", "SourceLoad", "ScalingPolicy", "Scaler", "ReadCostAtCount",
           "proactive_target", "demand", "cpu_caps", "pick_loader", "MAX_STARVED_BOOST",
           "MIN_EFFICIENCY", "CPU_ROUND", "MIN_CPU_WINDOWS"]

#: The most the starvation correction multiplies a source's measured demand by.
MAX_STARVED_BOOST = 5.0

#: Loaders added to a source must raise its measured capacity by at least this share
#: of what the first ones supply each; less means they share an exhausted resource
#: (the cores, for CPU-bound preprocessing) and the source is held at the count that
#: the resource allows.
MIN_EFFICIENCY = 0.5

#: ``cores / (threads × cpu_fraction)`` is rounded to the nearest count: a
#: fraction of a loader above the cores still shares them (e.g. 2 cores at a CPU
#: fraction of 0.9: 2.2 -> 2 loaders).
CPU_ROUND = 0.5
#: a source's CPU cap moves off its last value only once that count is this many
#: loaders' worth past the rounding edge (a share near an edge, e.g. 5.5 loaders' worth,
#: whose demand wobbles by 2%, moved the cap 5 -> 6 -> 5 every few seconds: a review)
CAP_BAND = 0.25

#: Windows with a CPU measurement before the cap may exceed what fully CPU-bound loaders
#: need (``cores / threads``).
MIN_CPU_WINDOWS = 3


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; every core where the platform
    has no ``sched_getaffinity``, as macOS and Windows: the loaders' C heap cap raised there
    before it saw the C library was not glibc, a review)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class SourceLoad:
    """What the service measured about one source over the last window.

    Attributes
    ----------
    loaders : int
        Loaders serving the source now.
    weight_ahead : float
        Largest normalised weight of the source over the look-ahead window.
    consumption : float
        Tokens per second the whole service delivered over the window.
    seconds_per_token : float
        Loader read + preprocess seconds per token (0 when not measured yet).
    threads : int
        Documents a loader processes at once (its pool's size, else its read threads).
    starved : float
        Fraction of the window the planner waited for this source's data.
    cpu_per_token : float
        Loader CPU seconds per token, its pool's included (0 when not measured).
    cpu_fraction : float
        Over the last window, the loaders' CPU seconds / their busy seconds less the
        time they waited for a core (0: not measured).
    cores : float
        Threads of the cluster's workers (0: not known).
    core_wait_per_token : float
        Of ``seconds_per_token``, the seconds the loaders' threads were runnable but
        waited for a core (other threads had them; 0: not measured).
    """

    loaders: int
    weight_ahead: float
    consumption: float
    seconds_per_token: float
    threads: int = 1
    starved: float = 0.0
    cpu_per_token: float = 0.0
    cpu_fraction: float = 0.0
    cores: float = 0.0
    core_wait_per_token: float = 0.0


@dataclass(frozen=True)
class ScalingPolicy:
    """The loader policy's knobs: the ``scaling:`` section and each source's loader bounds.

    ``limits`` maps a source to its ``(min, max)`` loaders; a source without
    one gets ``scaling.min_loaders`` and ``scaling.max_loaders``.
    """

    scaling: ScalingConfig = ScalingConfig()
    limits: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def bounds(self, source: str) -> tuple[int, int]:
        return self.limits.get(source, (self.scaling.min_loaders, self.scaling.max_loaders))

    @classmethod
    def from_config(cls, cfg: Config) -> ScalingPolicy:
        """The policy of a service config (``scaling:`` and ``sources[].min/max_loaders``)."""
        sc = cfg.scaling
        limits = {}
        for s in cfg.sources:
            lo = s.min_loaders or sc.min_loaders
            limits[s.name] = (lo, max(lo, s.max_loaders or sc.max_loaders))
        return cls(sc, limits)


def pick_loader(slots: list[int], outstanding: Mapping[int, int] | None, turn: int) -> int:
    """The loader slot to give a source's next unit to.

    Parameters
    ----------
    slots : list of int
        The source's slots that take new units, in their round-robin order
        (not empty).
    outstanding : mapping, optional
        Units each slot was given and has not reported yet (a missing slot: 0).
    turn : int
        A counter the caller advances once per unit given out.

    Returns
    -------
    int
        The slot with the fewest outstanding units; ties go to the first from
        ``slots[turn % len(slots)]`` on, so equal loaders take turns.  A loader
        that reads faster (e.g. on a less busy worker) thus gets more units,
        instead of waiting for its equal share while a slower one falls behind.
        Which loader reads a unit never changes the stream's documents.
    """
    if not slots:
        raise ValueError("pick_loader: the source has no loader slot to give a unit to")
    start = turn % len(slots)
    counts = outstanding or {}
    return min(slots[start:] + slots[:start], key=lambda slot: counts.get(slot, 0))


def demand(load: SourceLoad, corrected: bool = False) -> float:
    """Tokens/s the source must supply: ``weight_ahead × consumption``.

    ``corrected``: divided by ``1 - starved`` (at most ``MAX_STARVED_BOOST``×).
    """
    wanted = load.weight_ahead * load.consumption
    if not (load.consumption > 0 and load.weight_ahead > 0 and math.isfinite(wanted)):
        return 0.0  # (none, or not a measurement: NaN or inf raised in the rules' rounding)
    busy = max(1.0 - min(max(load.starved, 0.0), 1.0), 1.0 / MAX_STARVED_BOOST)
    return wanted / (busy if corrected else 1.0)


def proactive_target(load: SourceLoad, headroom: float) -> int:
    """Loaders the source needs to supply its :func:`demand` with ``headroom``.

    The demand is not corrected for starvation here: at a service's start the
    planner waits for first reads and plans its prefetch in a burst, and the
    correction would push every source to its maximum (the reactive rule uses it).
    """
    if not 0 < load.seconds_per_token < math.inf:
        return 0  # not measured yet
    per_loader = max(1, load.threads) / load.seconds_per_token
    return math.ceil(headroom * demand(load) / per_loader)


def cpu_caps(loads: Mapping[str, SourceLoad], fractions: Mapping[str, float],
             windows: Mapping[str, int] | None = None,
             previous: Mapping[str, int] | None = None) -> dict[str, int]:
    """Loaders each CPU-measured source can keep busy on the cluster's cores.

    Parameters
    ----------
    loads : mapping
        The sources' loads (``cores`` and ``cpu_per_token`` as measured).
    fractions : mapping
        Per source, the CPU fraction of its loaders' busy time to use (the
        largest seen: see :class:`Scaler`); sources without one get no cap.
    windows : mapping, optional
        Per source, the windows the fraction was measured over; below
        :data:`MIN_CPU_WINDOWS` the cap is at most ``cores / threads`` or the
        source's loaders now, whichever is more (all: none): a fraction not yet
        confirmed stops the source from growing past what fully CPU-bound loaders
        need, but does not remove loaders (a pool larger than the cores, e.g. 8
        threads waiting on a store on 2 cores, would go to 1 loader and back).
    previous : mapping, optional
        Per source, its cap of the last call: kept until the share is :data:`CAP_BAND`
        of a loader past the edge of rounding to it.

    Returns
    -------
    dict
        ``source -> cap`` for the sources with a measured CPU fraction and known cores.
    """
    cores = max((ld.cores for ld in loads.values()), default=0.0)
    if cores <= 0:
        return {}
    need = {s: demand(ld) * ld.cpu_per_token for s, ld in loads.items()}
    total = sum(need.values())
    out = {}
    for s, ld in loads.items():
        f = fractions.get(s, 0.0)
        if f <= 0:
            continue
        # its share of the cores: in proportion to the needs where they exceed the cores,
        # else its need and every core the others do not need (the same at total == cores:
        # a share that jumped there from the need to all cores made a source at the cores'
        # limit gain and lose loaders with the noise of its demand, a review)
        share = cores * need[s] / total if total > cores else need[s] + (cores - total)
        threads = max(1, ld.threads)
        worth = share / (threads * f)  # loaders' worth of the share
        cap = max(1, math.floor(worth + CPU_ROUND))
        last = None if previous is None else previous.get(s)
        if last is not None and last - CPU_ROUND - CAP_BAND <= worth < last + CPU_ROUND + CAP_BAND:
            cap = last
        if windows is not None and windows.get(s, 0) < MIN_CPU_WINDOWS:
            cap = min(cap, max(1, math.floor(cores / threads), ld.loaders))
        out[s] = cap
    return out


def _bottleneck(load: SourceLoad, policy: ScalingPolicy) -> bool:
    """The reactive rule: starved, and not (measurably) supplied twice over."""
    if load.starved <= policy.scaling.starve_fraction:
        return False
    if load.seconds_per_token <= 0:
        return True
    capacity = load.loaders * load.threads / load.seconds_per_token
    return capacity < 2 * policy.scaling.headroom * demand(load, corrected=True)


class PlannedRate:
    """A service's consumption (``SourceLoad.consumption``): the tokens/s its planner
    planned over the last ``span`` seconds of readings.

    The planner plans a round of steps at a time as the constructors make room, so a
    window of one poll (a second) saw no token or a whole round: with 2 s steps in
    rounds of 3 the proactive target followed the rounds, scale-ups at once and
    scale-downs never (a round inside every ``scale_down_after`` kept the higher
    count; a review: 1 loader's worth held at 5).  The policy passes its
    ``scale_down_after`` as ``span``: the rate a scale-down waits for.  Until ``span``
    has passed, the rate since the first reading.
    """

    def __init__(self, span: float) -> None:
        self.span = float(span)
        #: (time, tokens planned) of the readings kept: the newest and those of the span
        self._seen: deque[tuple[float, float]] = deque()

    def update(self, now: float, planned: float) -> float:
        """The rate at time ``now`` with ``planned`` tokens planned so far (a count that
        went back, a re-created planner's, starts the readings again)."""
        seen = self._seen
        if seen and (planned < seen[-1][1] or now <= seen[-1][0]):
            if planned < seen[-1][1]:
                seen.clear()
            else:
                return _rate(seen[0], seen[-1])
        seen.append((float(now), float(planned)))
        while len(seen) > 2 and now - seen[1][0] >= self.span:
            seen.popleft()
        return _rate(seen[0], seen[-1])


def _rate(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Tokens per second between two readings ``(time, tokens)`` (0 at one time)."""
    return (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else 0.0


class ReadCostAtCount:
    """Each source's loader seconds and core-wait seconds per token read at its current
    loader count (``SourceLoad.seconds_per_token`` and ``core_wait_per_token``).

    The loaders' counters run from the service's start, so figures taken from them
    mix in every count the source had: the saturation rule
    (:meth:`Scaler._measure`) compares the capacity of counts, and after an hour at two
    loaders the figure at eight barely moved from theirs, so loaders that added nothing
    looked as if each added a loader's worth (a review: 2 → 8 loaders, then stuck at 5
    where the store supplied 2 loaders' worth).  Here the figures are those since the
    count last changed; until tokens were read at the new count, those of the count
    before (at first, since the start).
    """

    def __init__(self) -> None:
        #: source -> (loaders, (tokens, read seconds, core-wait seconds) when the count
        #: changed, the figures of the count before)
        self._since: dict[str, tuple[int, tuple[float, float, float],
                                     tuple[float, float] | None]] = {}

    def update(self, source: str, loaders: int, tokens: float, read_seconds: float,
               wait_seconds: float) -> tuple[float, float]:
        """``(seconds, core-wait seconds)`` per token of ``source`` from its loaders'
        counters now (summed over the loaders, gone ones included); ``(0, 0)`` where
        nothing was read yet."""
        now = (float(tokens), float(read_seconds), float(wait_seconds))
        kept = self._since.get(source)
        if kept is None or kept[0] != loaders or now[0] < kept[1][0]:
            # a new count (or counters that started again: a re-created planner's loaders)
            before = None if kept is None or now[0] < kept[1][0] else (
                _per_token(kept[1], now) or kept[2])
            kept = self._since[source] = (loaders, now, before)
        return (_per_token(kept[1], now) or kept[2]
                or _per_token((0.0, 0.0, 0.0), now) or (0.0, 0.0))


def _per_token(a: tuple[float, float, float],
               b: tuple[float, float, float]) -> tuple[float, float] | None:
    """Seconds and core-wait seconds per token between two readings of the counters
    (``None``: no token read between them)."""
    tokens = b[0] - a[0]
    if tokens <= 0:
        return None
    return (b[1] - a[1]) / tokens, max(0.0, b[2] - a[2]) / tokens


class Scaler:
    """Turns measured loads into loader counts, with hysteresis.

    Parameters
    ----------
    policy : ScalingPolicy
    """

    def __init__(self, policy: ScalingPolicy):
        self.policy = policy
        self._changed: dict[str, float] = {}
        self._low_since: dict[str, float] = {}
        #: source -> since when its loaders are over its CPU cap (and not saturated)
        self._over_cap_since: dict[str, float] = {}
        self._down_at: dict[str, float] = {}   # last scale-down of a source
        #: source -> (loaders, demand): no scale-down below it while demand holds
        self.floors: dict[str, tuple[int, float]] = {}
        #: source -> {loaders: measured capacity in tokens/s} (settled measurements)
        self.capacity: dict[str, dict[int, float]] = {}
        #: source -> the most loaders that still add capacity (see MIN_EFFICIENCY)
        self.saturated: dict[str, int] = {}
        #: source -> the cluster's cores when its saturation was found
        self._saturated_cores: dict[str, float] = {}
        #: source -> the largest CPU fraction of its loaders' busy time measured
        self.cpu_fraction: dict[str, float] = {}
        #: source -> windows with a CPU measurement
        self.cpu_windows: dict[str, int] = {}
        #: source -> loaders its share of the cluster's cores keeps busy (last decide)
        self.cpu_caps: dict[str, int] = {}
        #: source -> its last measured CPU seconds per token: taken for a window that
        #: measured none (a loader just added has not measured yet)
        self.cpu_per_token: dict[str, float] = {}

    def target(self, source: str, load: SourceLoad) -> int:
        """The count the rules ask for now, before hysteresis."""
        lo, hi = self.policy.bounds(source)
        want = proactive_target(load, self.policy.scaling.headroom)
        if _bottleneck(load, self.policy):
            want = max(want, load.loaders + 1)
        return max(lo, int(min(hi, want, self.limit(source))))

    def limit(self, source: str) -> int | float:
        """The most loaders the CPU cap and the saturation rule allow (inf: no limit)."""
        return min(self.saturated.get(source, math.inf), self.cpu_caps.get(source, math.inf))

    def _measure(self, now: float, source: str, load: SourceLoad) -> None:
        """Record the source's capacity at its count; detect loaders that add none.

        With capacity ``c₀`` measured at ``n₀`` loaders (the largest count
        measured below the current one) and ``c`` at ``n``, each of the ``n - n₀``
        loaders added is worth ``(c - c₀) / (n - n₀)`` against ``c₀ / n₀`` for
        each of the first ones.  Below :data:`MIN_EFFICIENCY` of that, the
        source is held at ``n₀ + ceil((c - c₀) / (c₀ / n₀))`` loaders: the added
        loaders that brought capacity are kept, no more are added.

        The time the loaders waited for a core is not counted: the cores are the CPU
        cap's to share out (:func:`cpu_caps`), and threads of other processes (or the
        service's own event loops) taking a core from a CPU-bound loader would make
        a second loader on two cores look like one that adds too little.
        """
        if load.seconds_per_token <= 0 or \
                now - self._changed.get(source, -math.inf) < self.policy.scaling.cooldown:
            return  # not measured yet, or the new loaders have not settled
        caps = self.capacity.setdefault(source, {})
        n = load.loaders
        busy = load.seconds_per_token - load.core_wait_per_token
        caps[n] = n * load.threads / (busy if busy > 0 else load.seconds_per_token)
        below = [k for k in caps if k < n]
        if not below:
            return
        n0 = max(below)
        each = caps[n0] / n0
        added = (caps[n] - caps[n0]) / each
        if added < MIN_EFFICIENCY * (n - n0):
            # (the most cores it was confirmed on: a window of a worker paused, fewer cores,
            # then one of them all read as a cluster that grew, and the source was probed
            # again, 3 -> 6 -> 3 loaders; a review)
            was = self._saturated_cores.get(source, 0.0) if source in self.saturated else 0.0
            self.saturated[source] = n0 + max(0, math.ceil(added - 1e-9))
            self._saturated_cores[source] = max(was, load.cores)

    def _measure_cpu(self, loads: Mapping[str, SourceLoad]) -> None:
        """Keep each source's largest CPU fraction; re-probe saturations on more cores.

        A window with no core running (its one worker paused) measures nothing: the caps
        stay (they went, and a CPU-bound source doubled and came back at each such poll;
        a review)."""
        if max((ld.cores for ld in loads.values()), default=0.0) <= 0 and self.cpu_caps:
            return
        for source, load in loads.items():
            if load.cpu_fraction > 0:
                f = min(1.0, load.cpu_fraction)
                self.cpu_fraction[source] = max(self.cpu_fraction.get(source, 0.0), f)
                self.cpu_windows[source] = self.cpu_windows.get(source, 0) + 1
            if source in self.saturated and load.cores > self._saturated_cores.get(source, 0.0):
                # the cluster grew since the source saturated: what held it may not now
                del self.saturated[source]
                self._saturated_cores.pop(source, None)
                self.capacity.pop(source, None)
        # (a window that measured no CPU per token, one of the loaders just added, read as a
        # source needing no core: the other sources took every core for a window, grew to
        # it and were cut back at the next; a review)
        for source, load in loads.items():
            if load.cpu_per_token > 0:
                self.cpu_per_token[source] = load.cpu_per_token
        measured = {s: ld if ld.cpu_per_token > 0 or s not in self.cpu_per_token
                    else replace(ld, cpu_per_token=self.cpu_per_token[s])
                    for s, ld in loads.items()}
        self.cpu_caps = cpu_caps(measured, self.cpu_fraction, self.cpu_windows, self.cpu_caps)

    def decide(self, now: float, loads: Mapping[str, SourceLoad]) -> dict[str, int]:
        """Loader counts to apply at time ``now`` (only sources that change)."""
        out: dict[str, int] = {}
        p = self.policy
        self._measure_cpu(loads)
        for source, load in loads.items():
            self._measure(now, source, load)
            want = self.target(source, load)
            last = self._changed.get(source, -math.inf)
            floor = self.floors.get(source)
            if floor is not None and demand(load) < floor[1] / p.scaling.headroom:
                del self.floors[source]  # demand fell: the floor no longer holds
                floor = None
            limit = self.limit(source)
            if floor is not None:
                want = max(want, int(min(floor[0], p.bounds(source)[1], limit)))
            if load.loaders > max(limit, p.bounds(source)[0]):
                # loaders that add nothing (saturated): removed at once; over the CPU cap
                # alone, once they stayed over it scale_down_after (a cap that dips for a
                # poll, a worker paused or the demand's noise, took loaders off and put
                # them back each time: a review)
                over = self._over_cap_since.setdefault(source, now)
                waits = self.saturated.get(source, math.inf) >= load.loaders and \
                    now - over < p.scaling.scale_down_after
                if not waits and now - last >= p.scaling.cooldown:
                    out[source] = max(int(limit), p.bounds(source)[0])
                    self._changed[source] = now
                    self._down_at[source] = now
                    self._low_since.pop(source, None)
                    self._over_cap_since.pop(source, None)
                continue
            self._over_cap_since.pop(source, None)
            if want > load.loaders:
                self._low_since.pop(source, None)
                if now - last >= p.scaling.cooldown:
                    # at most double at a time: each step is measured (see _measure); the
                    # CPU cap is known without trying: go there at once
                    if want < self.cpu_caps.get(source, math.inf):
                        want = min(want, max(2 * load.loaders, p.bounds(source)[0]))
                    out[source] = want
                    self._changed[source] = now
                    if now - self._down_at.get(source, -math.inf) < p.scaling.scale_down_after \
                            and _bottleneck(load, p) and demand(load) > 0:
                        # the last scale-down starved the planner: hold this count (while
                        # demand stays; none measured, no floor: it could never lapse)
                        self.floors[source] = (want, demand(load))
            elif want < load.loaders:
                since = self._low_since.setdefault(source, now)
                if now - since >= p.scaling.scale_down_after and now - last >= p.scaling.cooldown:
                    out[source] = load.loaders - 1
                    self._changed[source] = now
                    self._low_since[source] = now
                    self._down_at[source] = now
            else:
                self._low_since.pop(source, None)
        return out
