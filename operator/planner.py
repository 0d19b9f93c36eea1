"""The SLA planner: how many prefill and decode pods a PDDeployment needs, from its engines' metrics.

Pure model plus a small stateful stabiliser; no I/O (``metrics_scrape`` reads
the pods, ``engine_metrics`` parses their text into samples and windows, the
controller writes the decision). Inputs are the metrics every engine exposes
under vLLM's names, so the same planner drives the sim engine and vLLM:

- prefill is sized for time to first token: arrival rate (first tokens per
  second, from the TTFT histogram's count) x uncached prompt tokens per request
  (prompt tokens minus prefix-cache hits, engine-local and through the KV
  connector, i.e. the pool) is the work offered; a pod's prefill
  throughput is learned from the intervals in which it was busy (see
  ``PrefillLearning``). Per pod the model is a single queue: one request alone takes
  S = uncached / throughput, and TTFT ~ S / (1 - utilisation), so meeting the
  target T allows utilisation 1 - S/T.
- decode is sized for inter-token latency: ITL grows with the batch
  (ITL = a + c x batch, fitted over the recent (batch, ITL) points of every
  pod, both taken from the ITL histogram: see ``batch_point``); the largest
  batch within the target is (T - a) / c, and the concurrency at the target
  (tokens/s x T, Little's law, plus the queue) divided by it is the pods needed.

Rates need a lookback to be more than Poisson noise; the work the pods hold at
the last scrape (requests running + waiting) needs none. So besides the rate,
a backlog that the pods there are cannot clear within the target (prefill: the
next request would start too late; decode: the sequences held would wait for a
batch slot longer than the TTFT target leaves after prefill, ``decode_slot_pods``;
of the requests prefill holds, only those its pods can hand over while a
sequence decodes, ``handed_over``) asks for more pods through a short window
(``backlog_step``): a step shows in the requests held an interval or two before
the rates have seen it.
The backlog's step is one pod, or up to double the role (prefill: or 4 pods
more, HPA's default) once the rates agree that many are needed (a backlog
alone also holds what queued while the pods were short, which they drain once
there are enough).

Before a pod's throughput is learned, or the ITL line can be fitted, the
planner falls back to the latency ratio (observed / target) so it still scales
up. Where the target is out of reach (one request alone misses it) the model
sizes for the best it can do (prefill a quarter busy, decode one sequence per
pod), never for "every pod allowed". A latency that misses while the model
says the pods suffice adds one pod, but only once every pod asked for has
reported for a whole lookback (right after a scale-up the latency is still that
of the fewer pods: counting it again overshoots).

Scale-in has hysteresis: the estimate carries a hold, the pods needed for
(1 - margin) x the target, and the role shrinks only to whole pods at or above
it (and never while the latency misses), so the pod taken away is not wanted
back next interval. The stabiliser then turns the recommendation into
replicas: a relative dead band, the lowest recommendation of the scale-up
window (a spike must last; the backlog's pod needs two scrapes), the highest
of the scale-down window measured also from the role's last scale-up (the load must stay low the whole window,
the planner must have watched that long, and the last pod added must have
shown what it does), a maximum step each way and the role's bounds. A pod
without metrics (new, or its scrape failed) is never taken for idle: while
one exists the role does not scale in.

Policies (``autoscaling.policy``) shape the model's estimate before it is
rounded and stabilised, so a new policy plugs in without forking
``RolePlanner.step``: ``reactive`` (the default) sizes for the demand seen;
``predictive`` sizes for the demand forecast one start-up time ahead (Holt's
linear trend, ``Forecast``) and holds pods while the forecast over the next
start-up time plus the scale-down window wants them. The start-up time is
learned per role from the pods the planner asked for (decision to Ready,
``StartupLearning``), not a constant.

Scale to zero (``minReplicas: 0``): with no traffic for the scale-down window
the estimate is zero pods and the stabiliser takes the role there; decode
stays at one pod while any prefill pod still exists (a terminating prefill
pod is still handing its KV over). The way back is the router's count of
requests it holds for lack of engines (``daybreak_router_held_requests``,
passed in as ``held``): at zero, one held request starts both roles at once.
Without that signal (no router reporting it) a role never goes below one pod,
since nothing could bring it back.

COUNTERS ARE DELTAS: every rate comes from two samples of the same pod; a
counter that went down means the engine restarted, and that pod has no window
until its next sample.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from daybreak.operator.engine_metrics import (
    HELD_REQUESTS,
    Histogram,
    PodSample,
    PodWindow,
    merge_histograms,
    window,
)

BUSY_RUNNING = 0.5  # mean running requests from which Little's law is trusted for a prefill pod's throughput
MAX_UTILISATION = 0.95  # never plan a prefill pod fuller than this, however loose the target
LOOKBACK_INTERVALS = 2  # rates are measured over this many intervals (decisions are still made every interval)
# ... and over no less than this: at a few requests per second a shorter window's rate is mostly Poisson noise.
MIN_LOOKBACK_SECONDS = 6.0
# Fades per DECAY_SECONDS of planning, not per interval: at a 1 s interval a per-interval 0.98 faded a learned
# throughput three times as fast as at 3 s, and prefill was sized for 0.62 utilisation where 0.70 held.
DECAY_SECONDS = 3.0
THROUGHPUT_DECAY = 0.98  # per DECAY_SECONDS with a busy pod: a learned prefill throughput fades slowly (the engine may have changed)
FIT_POINTS = 64  # (batch, ITL) points kept per role for the decode fit
MIN_BATCH_SPREAD = 1.0  # batches must differ by this much before the slope is trusted
OUTPUT_DECAY = 0.8  # per DECAY_SECONDS with finished decode requests: the mean output length follows the workload
QUEUED_WAITING = 1.0  # requests waiting at both ends of a window that says the pod ran all it could (DecodeLearning)
SCALE_IN_MARGIN = 0.2  # a pod goes only when the model meets (1 - this) x the target without it (hysteresis)
# The least utilisation prefill is planned at. Near (or past) the point where one request alone takes the
# TTFT target, 1 - S/T goes to zero and the pod count to infinity, though no pod count brings the latency
# under S: past S/T = 0.75 the planner keeps pods a quarter busy (TTFT ~ 1.33 S) instead of asking for
# every pod allowed (the old "as many pods as allowed" rule overshot to the bounds on one noisy window).
MIN_UTILISATION = 0.25
# Start-up time (decision to Ready) assumed per role until a pod the planner asked for has become Ready.
DEFAULT_STARTUP_SECONDS = 30.0
STARTUP_DECAY = 0.5  # weight of the older start-up estimate when a new pod's time is learned
# Holt's linear trend on a role's demand: level and trend smoothing per interval. The level follows the rates
# (themselves a lookback's mean) quickly; the trend more slowly, so one noisy interval is not a slope.
HOLT_ALPHA = 0.5
HOLT_BETA = 0.3
HOLT_DAMPING = 0.9  # per DECAY_SECONDS ahead: the trend's reach tops out at 27 s worth of slope
# The trend counts only when the last TREND_POINTS demands have a least-squares slope TREND_T standard errors
# from zero: a steady but noisy load's slope is noise (extrapolated over a start-up time it would resize pods).
TREND_POINTS = 6
TREND_T = 3.0
MAX_GROWTH = 4.0  # the forecast never asks for more than this many times the pods the demand now needs
# A prefill backlog's step may add this many pods even where that is more than doubling the role: HPA's default
# scale-up (100% of the pods or 4 pods per period, whichever is more). From one pod, doubling alone took three
# intervals to reach the 4 pods a burst's backlog and rates both asked for (the Azure trace's 95 s burst).
URGENT_STEP_PODS = 4




# -- the model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Targets:
    """The AutoscalingSpec knobs the planner reads (seconds)."""

    ttft_seconds: float
    itl_seconds: float
    interval_seconds: float
    scale_up_stabilization_seconds: float
    scale_down_stabilization_seconds: float
    max_scale_up_step: int = 4
    max_scale_down_step: int = 1
    tolerance: float = 0.1
    scale_in_margin: float = SCALE_IN_MARGIN


def lookback_seconds(targets: Targets) -> float:
    """How far back rates are measured: LOOKBACK_INTERVALS intervals, and never under MIN_LOOKBACK_SECONDS."""
    return max(LOOKBACK_INTERVALS * targets.interval_seconds, MIN_LOOKBACK_SECONDS)


def up_window_seconds(targets: Targets) -> float:
    """The stabiliser's window for a rate-based scale-up: the configured one, and never under the lookback
    plus half an interval (rates span the lookback, so one burst interval lifts every recommendation made
    within it; half an interval of slack for scrape jitter)."""
    return max(targets.scale_up_stabilization_seconds, lookback_seconds(targets) + 0.5 * targets.interval_seconds)


def decision_lag_seconds(targets: Targets) -> float:
    """How far behind the arrivals a rate-based scale-up is asked for, before any pod starts: a rate is the
    mean over the lookback (centred half of it back), the stabiliser takes the lowest recommendation over
    its up window (on a rising load, the oldest), and the next decision is up to an interval away."""
    return 0.5 * lookback_seconds(targets) + up_window_seconds(targets) + targets.interval_seconds


@dataclass(frozen=True)
class Estimate:
    """The model's answer for one role: pods needed (a real number), why, and the numbers behind it.

    ``hold`` is the scale-in floor: the pods the model needs to meet (1 - margin) x the target. The role
    shrinks only to whole pods at or above it, so a pod removed leaves room and the next interval does not
    want it back (the 3 -> 2 -> 3 flap). None means "the same as ``pods``".
    """

    pods: float | None  # None: nothing to go on (no pod reported)
    reason: str
    numbers: dict[str, float]
    hold: float | None = None
    missed: bool = False  # the latency missed the target with all ``current`` pods serving (settled)
    settled: bool = False  # the latency seen is that of ``current`` pods
    demand: float | None = None  # the load the estimate sized for (requests/s or tokens/s + queued)
    # Pods the work held right now asks for (one more than ``current``), not a rate: the stabiliser takes it
    # through the configured up window alone (the rates' longer window filters the echo of a Poisson burst;
    # a backlog is no echo, it is requests already waiting). None: the backlog fits the pods there are.
    urgent: int | None = None


@dataclass
class PrefillLearning:
    """What the planner learned about one role's prefill pods: uncached tokens per second one pod can compute.

    Three lower bounds per window: the tokens it computed per second (tight when it ran flat out), the
    tokens per second of service time (Little's law: service time = mean running / completions per second,
    when busy), and uncached tokens per request over the mean TTFT (TTFT is at least the prefill time: tight
    when requests did not queue). All are low by the batch factor for an engine that batches prefills (then
    the planner over-provisions, never under-). Lower bounds combine by maximum: the estimate is the largest
    seen, fading by THROUGHPUT_DECAY per DECAY_SECONDS while busy so a changed engine is relearned.
    """

    tokens_per_second: float | None = None

    def observe(self, windows: Iterable[PodWindow], *, seconds: float = DECAY_SECONDS) -> None:
        """``seconds``: planning time since the last call (the interval), what the fading is measured in."""
        seen: list[float] = []
        for w in windows:
            if w.uncached_tokens is None or w.uncached_tokens <= 0:
                continue
            bound = w.uncached_tokens / w.seconds
            # A mean of two gauge readings is only fair when the pod was busy and they agree.
            if w.mean_running >= BUSY_RUNNING and abs(w.running_change) <= 0.25 * w.mean_running:
                bound = max(bound, w.uncached_tokens / (w.mean_running * w.seconds))
            ttft = w.ttft.mean() if w.ttft is not None else None
            if ttft and w.requests > 0:
                # TTFT >= the prefill time itself: tight when requests did not queue (low load), where the
                # two bounds above are weak.
                bound = max(bound, w.uncached_tokens / w.requests / ttft)
            seen.append(bound)
        # Fade only while a pod was busy (where a changed engine would show): fading across idle intervals
        # let the estimate sink to the weak low-load bounds, which asked for more pods, which made every pod
        # idler still (the over-provisioning spiral of a long peak).
        busy = any(w.mean_running >= BUSY_RUNNING for w in windows)
        decay = THROUGHPUT_DECAY ** (seconds / DECAY_SECONDS) if busy else 1.0
        faded = None if self.tokens_per_second is None else self.tokens_per_second * decay
        if seen:
            self.tokens_per_second = max(seen) if faded is None else max(faded, max(seen))
        else:
            self.tokens_per_second = faded


@dataclass
class DecodeLearning:
    """(mean batch, mean ITL) points of one role's decode pods, for the ITL = a + c x batch fit.

    One point per whole-request batch size, the latest winning: a steady load keeps refreshing its own point
    without pushing out the points seen at other batch sizes, so the slope survives a long steady phase.
    """

    points: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Output tokens (ITL observations) and requests, faded per interval: their ratio is the mean output
    # length that turns prefill's arrival rate into decode's coming tokens per second.
    produced: float = 0.0
    finished: float = 0.0
    # The most sequences a pod runs at once. Read from the engine's command line when it sets one
    # (``configured``: vLLM's --max-num-seqs in engine.args); else learned from windows in which requests
    # waited while the running count stayed flat: a pod only queues when it runs all it can, so what it ran
    # then is its cap (the highest such mean), and never less than the most any pod was seen running. None
    # until a pod queued; until then the ITL target alone bounds the batch. Learning needs a queue that lasts
    # a lookback, which a short burst may never give: on the Azure trace decode stayed at one pod for 20 s of
    # its burst with neither a slope nor a learned cap.
    batch_cap: float | None = None
    configured: float | None = None
    ran_most: float = 0.0  # the most sequences any pod was seen running at a scrape

    def tokens_per_request(self) -> float | None:
        return self.produced / self.finished if self.finished >= 1.0 else None

    def observe(self, windows: Iterable[PodWindow], *, seconds: float = DECAY_SECONDS) -> None:
        """``seconds``: planning time since the last call (the interval), what the fading is measured in."""
        windows = list(windows)
        for w in windows:
            self.ran_most = max(self.ran_most, w.mean_running + abs(w.running_change) / 2)
            # Queued at both scrapes and the running count flat: pinned at the cap. (A window in which the
            # batch was still filling, running 1 -> 3 with a queue at its end, read a cap of 2 where the pods
            # ran 4. And a request loading its KV from the pool counts as waiting for a moment: one scrape
            # that caught one read a cap of 2 on a pod that runs 4, and decode went to 3 pods at 0.3 req/s.)
            queued_throughout = w.mean_waiting - abs(w.waiting_growth) / 2  # the fewer waiting at either end
            if queued_throughout >= QUEUED_WAITING and abs(w.running_change) < 0.5 and w.mean_running >= 1.0:
                ran = float(round(w.mean_running))
                self.batch_cap = ran if self.batch_cap is None else max(self.batch_cap, ran)
        if self.configured is not None:
            self.batch_cap = self.configured  # the engine was told: nothing to learn
        elif self.batch_cap is not None:
            self.batch_cap = max(self.batch_cap, float(round(self.ran_most)))
        produced = sum(w.itl.count for w in windows if w.itl is not None and w.requests > 0)
        finished = sum(w.requests for w in windows if w.itl is not None and w.requests > 0)
        if finished > 0:
            decay = OUTPUT_DECAY ** (seconds / DECAY_SECONDS)
            self.produced = self.produced * decay + produced
            self.finished = self.finished * decay + finished
        for w in windows:
            point = batch_point(w)
            if point is not None:
                bucket = round(point[0])
                self.points.pop(bucket, None)
                self.points[bucket] = point
                while len(self.points) > FIT_POINTS:
                    self.points.pop(next(iter(self.points)))

    def fit(self) -> tuple[float, float] | None:
        """(a, c) with c > 0 by least squares, or None when the batches seen are too alike to give a slope."""
        if len(self.points) < 2:
            return None
        xs = [p[0] for p in self.points.values()]
        ys = [p[1] for p in self.points.values()]
        if max(xs) - min(xs) < MIN_BATCH_SPREAD:
            return None
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if c <= 0:
            return None
        return max(0.0, my - c * mx), c


def batch_point(w: PodWindow) -> tuple[float, float] | None:
    """(mean decode batch, mean ITL) of one window, both from the ITL histogram (Little's law).

    The sum of the inter-token gaps observed in a window is the sequence-seconds spent decoding, so over the
    window's length it is the mean number of sequences decoding; its mean is the ITL those sequences saw.
    Both describe the same tokens. The running gauge (two instants at the window's ends, and counting
    sequences still loading KV) does not: its noise flattened the fitted slope (a fit of 7 ms per sequence
    against the cost model's 12 ms said one pod could batch eight, and decode scaled late).

    A window in which the batch moved (a scale step, a burst ending) is no point: its token-weighted ITL
    belongs to no one batch (a window draining from 64 to 7 put ITL 61 ms at batch 18, 45 ms on the line).
    """
    if w.itl is None or w.itl.count <= 0 or w.itl.sum <= 0:
        return None
    batch = w.itl.sum / w.seconds
    if abs(w.running_change) > max(1.0, 0.5 * batch):
        return None
    return batch, w.itl.sum / w.itl.count


def _latency(windows: list[PodWindow], pick: str) -> Histogram | None:
    return merge_histograms(h for w in windows if (h := getattr(w, pick)) is not None)


def prefill_pods(*, rate: float, uncached: float, throughput: float, target: float) -> tuple[float, float, bool]:
    """(pods, planned utilisation, reachable) for ``rate`` requests/s of ``uncached`` tokens each."""
    alone = uncached / throughput
    reachable = alone < target
    utilisation = max(MIN_UTILISATION, min(MAX_UTILISATION, 1.0 - alone / target))
    return rate * uncached / (throughput * utilisation), utilisation, reachable


def urgent_most(role: str, current: int) -> int:
    """The most pods a backlog's step may ask for: double the role, and for prefill at least URGENT_STEP_PODS
    more (HPA's default). Prefill's step is bounded by the rates' pods too, which lag a rise, so it cannot
    overshoot far; decode's counts the sequences still in prefill and, before its slope is fitted, bounds
    the step only by one pod more than it has, and a larger step overshot there (4 pods where 3 served)."""
    return max(2 * current, current + URGENT_STEP_PODS) if role == "prefill" else 2 * current


def backlog_step(backlog: float, *, current: int, tolerance: float, sustained: float, most: int) -> int | None:
    """Pods for the work held now when it needs more than ``current`` (outside the dead band), else None.

    A backlog says the pods are short now, not by how much for long: it also holds what queued while they
    were short, which the pods drain once there are enough (sized on the backlog alone, a 10x overload asked
    for 5 pods where 3 serve the rate, then gave two back in the peak). So the step is bounded twice: by
    ``sustained``, the pods the rates ask for (what is needed once the queue has drained), and by ``most``
    (``urgent_most``: HPA's per-period step). It is always at least one pod: right after a step the rates'
    lookback has not seen it yet, and the backlog alone says the pods there are fall behind.
    """
    needed = round_with_tolerance(backlog, current=current, tolerance=tolerance)
    if needed <= current:
        return None
    return max(current + 1, min(needed, most, math.ceil(sustained - 1e-9)))


def decode_slot_pods(held: float, *, batch: float, seconds_per_sequence: float | None, wait: float) -> float:
    """Pods for ``held`` decode sequences when each may wait up to ``wait`` seconds for a batch slot.

    ``n`` pods run ``n x batch`` sequences and each slot frees once its sequence ends, every
    ``seconds_per_sequence`` (output tokens x ITL) on average, so within ``wait`` they start another
    ``n x batch x wait / seconds_per_sequence``: ``n >= held / (batch x (1 + wait / seconds_per_sequence))``.
    With no wait allowed, or no output length learned, every sequence needs a slot now: ``held / batch``.
    (A slot for every sequence asked 4 decode pods for a burst that 2-3 serve within the TTFT target, and
    one queued sequence of a Poisson burst added a pod for it.)
    """
    if seconds_per_sequence is None or seconds_per_sequence <= 0 or wait <= 0:
        return held / batch
    return held / (batch * (1.0 + wait / seconds_per_sequence))


def handed_over(prefilling: float, *, rate: float | None, lifetime: float | None) -> float:
    """The sequences prefill holds now that can need a decode slot at the same time.

    Prefill passes them on no faster than its pods complete prefills (``rate``, requests/s, for the pods it has
    or has asked for), and each holds a slot for ``lifetime`` seconds (output tokens x ITL), so at most
    ``rate x lifetime`` of them overlap in decode; the rest arrive as earlier ones finish. All of them when
    either is unknown. (Counted whole, the Azure trace's burst of 23 short requests queued in prefill asked
    for 5.75 decode pods of 4 sequences, where prefill's 4 pods hand over 3.5 a second, each done in 2.4 s:
    decode went to 4 pods and 2 served fixed-peak within ITL.)
    """
    if rate is None or lifetime is None or rate <= 0 or lifetime <= 0:
        return prefilling
    return min(prefilling, rate * lifetime)


def _held_why(held: float, prefilling: float, coming: float) -> str:
    if coming < prefilling:
        return (f"{held:.3g} sequences in flight now ({coming:.3g} of the {prefilling:.0f} in prefill overlap at "
                f"its hand-over rate)")
    return f"{held:.0f} sequences in flight now (with {prefilling:.0f} in prefill)"


def estimate_prefill(windows: list[PodWindow], *, target: float, learned: PrefillLearning, current: int,
                     settled_seconds: float = math.inf, lookback_seconds: float = 0.0,
                     margin: float = SCALE_IN_MARGIN, tolerance: float = 0.1, upstream: float = 0.0,
                     upstream_growth: float = 0.0) -> Estimate:
    """Prefill pods needed to keep TTFT under ``target`` at the observed arrival rate and uncached prompt length.

    ``upstream``: requests the routers hold now for prefill room (``router.prefillConcurrency``), which no
    engine's queue shows; ``upstream_growth``: how fast that grew over the lookback (requests/s). Both are
    prefill's demand as much as the engines' own queues, and their mean wait (Little's law) is added to the
    engines' TTFT p90, which starts when a request reaches an engine.

    ``settled_seconds``: how long every pod asked for has been reporting. The latency seen is that of
    ``current`` pods only once that covers the lookback plus the TTFT itself (a request finishing now
    queued for its whole TTFT, maybe before the last pod served): only then may a latency that misses
    add a pod the model did not ask for.

    Besides the rate, the work held now bounds the pods from below: ``L`` requests in flight are about
    ``L x S`` seconds of prefill, and a request arriving now starts within ``target - S`` only if the pods
    clear that work first, so pods >= L x S / (target - S). The rate needs a lookback to be more than noise;
    the requests in flight are counted at the last scrape, so a step shows within an interval (urgent).
    """
    if not windows:
        return Estimate(None, "no prefill pod has reported metrics yet", {})
    # Arrivals = first tokens produced + growth of the queue: a saturated pod's completions alone hide demand.
    rate = sum((w.requests + max(0.0, w.waiting_growth)) / w.seconds for w in windows) + max(0.0, upstream_growth)
    uncached_total = sum(w.uncached_tokens or 0.0 for w in windows)
    requests = sum(w.requests for w in windows)
    hist = _latency(windows, "ttft")
    p90 = hist.quantile(0.9) if hist else None
    if p90 is not None and upstream > 0 and rate > 0:
        # The engines time a request from when it reached them: a wait in the router comes first. Little's law
        # gives its mean (held / arrival rate), which the TTFT the clients see, and decode's slot wait, include.
        p90 += upstream / rate
    held = sum(w.in_flight_now for w in windows) + upstream
    numbers: dict[str, float] = {"arrival_rate": rate, "target_ttft_s": target,
                                 "queued": sum(w.mean_waiting for w in windows) + upstream,
                                 "running": sum(w.mean_running for w in windows), "in_flight_now": held}
    if upstream:
        numbers["router_held"] = upstream
        if rate > 0:
            numbers["router_wait_s"] = upstream / rate
    if p90 is not None:
        numbers["ttft_p90_s"] = p90
    uncached = uncached_total / requests if requests > 0 else None
    if uncached is not None:
        numbers["uncached_tokens"] = uncached
    throughput = learned.tokens_per_second
    if throughput is not None:
        numbers["pod_tokens_per_s"] = throughput
    if rate <= 0 and numbers["queued"] <= 0 and numbers["running"] <= 0:
        return Estimate(0.0, "no prefill requests", numbers)
    missing = p90 is not None and p90 > target
    settled = settled_seconds >= lookback_seconds + (p90 or 0.0)
    if throughput is not None and uncached is not None:
        alone = uncached / throughput
        numbers["service_s"] = alone
        pods, utilisation, reachable = prefill_pods(rate=rate, uncached=uncached, throughput=throughput,
                                                     target=target)
        hold, _, _ = prefill_pods(rate=rate, uncached=uncached, throughput=throughput, target=target * (1 - margin))
        numbers["utilisation"] = utilisation
        if reachable:
            why = (f"{rate:.3g} req/s x {uncached:.0f} uncached tokens at {throughput:.0f} tokens/s per pod, "
                   f"utilisation <= {utilisation:.2f} for TTFT {target:g}s")
        else:
            why = (f"one request alone needs {alone:.3g}s of prefill, over the {target:g}s TTFT target: "
                   f"{rate:.3g} req/s sized at utilisation {utilisation:.2f}")
        urgent: int | None = None
        if reachable:
            backlog = held * alone / (target - alone)
            numbers["backlog_pods"] = backlog
            urgent = backlog_step(backlog, current=current, tolerance=tolerance, sustained=pods,
                                  most=urgent_most("prefill", current))
            if urgent is not None:
                why += f"; {held:.0f} in flight now: {backlog:.3g} pods start the next within TTFT"
            hold = max(hold, min(backlog, current + 1.0))
        floor = hist.quantile_floor(0.9) if hist else None
        if floor is not None and floor >= target and pods <= current and settled:
            # The model thinks the pods suffice but the latency certainly misses (the whole p90 bucket is over
            # the target, not just its interpolation) with every pod serving: trust the latency, one pod more.
            pods = current + 1.0
            why += f"; but TTFT p90 is over {floor:.3g}s, above target: one more"
        if missing:
            hold = max(hold, float(current))  # never shrink while the latency misses
        numbers["pods"], numbers["hold"] = pods, hold
        return Estimate(pods, why, numbers, hold=hold, missed=missing and settled, settled=settled, demand=rate,
                        urgent=urgent)
    # Throughput not learned yet (no pod has had a queue): only the latency can say more pods are needed.
    if missing and p90 is not None and settled:
        pods = len(windows) * p90 / target
        numbers["pods"] = pods
        return Estimate(pods, f"TTFT p90 {p90:.3g}s over target {target:g}s (throughput not learned yet)", numbers,
                        hold=max(pods, float(current)))
    numbers["pods"] = float(current)
    return Estimate(float(current), "TTFT within target; prefill throughput not learned yet", numbers)


def decode_pods(*, tokens: float, queued: float, a: float, c: float, target: float,
                max_batch: float = math.inf) -> tuple[float, float]:
    """(pods, sequences per pod) for ``tokens``/s and ``queued`` requests under ITL = a + c x batch <= target.

    ``max_batch``: the pods' own cap on running sequences (vLLM's ``max_num_seqs``), where it binds before the
    target does: the planner passes the cap it learned from pods that queued (``DecodeLearning.batch_cap``),
    the bench's fixed sizings the cap their pods run with.
    """
    batch = min((target - a) / c, max_batch)
    if batch < 1:
        # Even batch 1 misses: one sequence per pod is the best there is (more pods buy nothing).
        return tokens * (a + c) + queued, 1.0
    # Little's law: at the target ITL the tokens/s now produced keep tokens x target requests running.
    return (tokens * target + queued) / batch, batch


def estimate_decode(windows: list[PodWindow], *, target: float, learned: DecodeLearning, current: int,
                    settled_seconds: float = math.inf, lookback_seconds: float = 0.0,
                    margin: float = SCALE_IN_MARGIN, arrivals: float | None = None,
                    prefilling: float = 0.0, tolerance: float = 0.1, wait: float = 0.0,
                    handover: float | None = None) -> Estimate:
    """Decode pods needed to keep ITL under ``target`` for the tokens the role produces and the requests queued.

    ``settled_seconds`` as for prefill; an ITL is measured as it happens, so the lookback alone must pass.
    ``arrivals``: the requests per second prefill admits now (its arrival rate). Decode serves them a prefill
    later, so arrivals x the learned output tokens per request is decode's coming load: the role is sized for
    the larger of that and what it produces now (without it decode waited for its own batch and latency).
    As for prefill, the sequences held now bound the pods from below (each needs a slot in a batch within the
    target), counted at the last scrape: urgent when that alone asks for more pods. ``prefilling``: the
    requests prefill holds now, each a decode sequence one prefill from now (decode's own count showed a
    burst only once prefill had passed it on, two to four seconds late). ``handover``: the requests per second
    prefill's pods (those it has or asked for) complete flat out; of the requests it holds, only as many as
    overlap in decode at that rate need slots together (``handed_over``). ``wait``: how long a sequence may
    queue for a slot (what the TTFT target leaves after prefill): slots that free within it count
    (``decode_slot_pods``).
    """
    settled = settled_seconds >= lookback_seconds
    if not windows:
        return Estimate(None, "no decode pod has reported metrics yet", {})
    in_flight = sum(w.mean_running + w.mean_waiting for w in windows)
    # The standing queue needs slots, but while pods asked for are still starting it is the backlog they
    # will drain, not new demand: counting it then grew the role again each interval of the start-up lag.
    standing = sum(w.mean_waiting for w in windows) if settled else 0.0
    tokens = sum((w.itl.count if w.itl is not None else 0.0) / w.seconds for w in windows)
    # A growing queue is demand the pods did not serve: as tokens/s (its arrival rate x tokens per request),
    # so it weighs the same whatever the window's length; a bare count only when nothing finished yet.
    growth = sum(max(0.0, w.waiting_growth) for w in windows)
    finished = sum(w.requests for w in windows)
    produced = sum(w.itl.count for w in windows if w.itl is not None)
    if finished > 0 and produced > 0:
        tokens += sum(max(0.0, w.waiting_growth) / w.seconds for w in windows) * produced / finished
        queued = standing
    else:
        queued = standing + growth
    hist = _latency(windows, "itl")
    mean_itl = hist.mean() if hist else None
    numbers: dict[str, float] = {"in_flight": in_flight, "queued": queued, "tokens_per_s": tokens,
                                 "target_itl_s": target}
    if mean_itl is not None:
        numbers["itl_mean_s"] = mean_itl
    per_request = learned.tokens_per_request()
    ahead = False
    if arrivals is not None and per_request is not None:
        coming = arrivals * per_request
        numbers["arrival_rate"], numbers["output_tokens"], numbers["coming_tokens_per_s"] = (
            arrivals, per_request, coming)
        if coming > tokens:
            tokens, ahead = coming, True
    if in_flight <= 0 and tokens <= 0:
        return Estimate(0.0, "no decode requests in flight", numbers)
    missing = mean_itl is not None and mean_itl > target
    # The sequences held now, each needing a batch slot within the target: the requests in prefill too, as
    # many of them as prefill can hand over within a sequence's time in decode.
    own = sum(w.in_flight_now for w in windows)
    fit = learned.fit()
    if fit is not None:
        a, c = fit
        numbers["itl_base_s"], numbers["itl_per_request_s"] = a, c
        cap = learned.batch_cap if learned.batch_cap is not None else math.inf
        pods, batch = decode_pods(tokens=tokens, queued=queued, a=a, c=c, target=target, max_batch=cap)
        hold, _ = decode_pods(tokens=tokens, queued=queued, a=a, c=c, target=target * (1 - margin), max_batch=cap)
        if learned.batch_cap is not None:
            numbers["batch_cap"] = learned.batch_cap
        numbers["max_batch"] = batch
        if (target - a) / c < 1:
            why = (f"ITL at batch 1 is {a + c:.3g}s, over the {target:g}s target: one sequence per pod for "
                   f"{tokens:.3g} tokens/s and {queued:.3g} queued")
        else:
            why = (f"{tokens:.3g} tokens/s and {queued:.3g} queued, at most {batch:.3g} per pod for ITL "
                   f"{target:g}s (ITL = {a:.3g} + {c:.3g} x batch)")
        if ahead:
            why += f" (sized ahead: prefill admits {arrivals:.3g} req/s x {per_request:.0f} output tokens)"
        # A slot frees every output-length x ITL; the ITL at the batch planned is at most the target.
        lifetime = per_request * min(target, a + c * batch) if per_request is not None else None
        coming = handed_over(prefilling, rate=handover, lifetime=lifetime)
        held = own + coming
        slots = decode_slot_pods(held, batch=batch, seconds_per_sequence=lifetime, wait=wait)
        numbers["in_flight_now"], numbers["backlog_pods"], numbers["slot_wait_s"] = held, slots, wait
        urgent = backlog_step(slots, current=current, tolerance=tolerance, sustained=pods,
                              most=urgent_most("decode", current))
        if urgent is not None:
            why += f"; {_held_why(held, prefilling, coming)}: {slots:.3g} pods of {batch:.3g}"
        hold = max(hold, min(slots, current + 1.0))
        if missing and pods <= current and settled:
            pods = current + 1.0
            why += f"; but ITL {mean_itl:.3g}s is over target: one more"
        if missing:
            hold = max(hold, float(current))
        numbers["pods"], numbers["hold"] = pods, hold
        return Estimate(pods, why, numbers, hold=hold, missed=missing and settled, settled=settled,
                        demand=tokens + queued, urgent=urgent)
    if missing and mean_itl is not None and settled:
        # No slope yet: ITL taken as proportional to the batch (a = 0); only ever used to scale up, and only
        # once the pods asked for all serve (their latency is not known before).
        pods = len(windows) * mean_itl / target
        numbers["pods"] = pods
        return Estimate(pods, f"ITL {mean_itl:.3g}s over target {target:g}s (batch slope not fitted yet)", numbers,
                        hold=max(pods, float(current)))
    if learned.batch_cap is not None:
        # No slope yet (a new deployment whose load rose before its batches spread), but a pod has queued: the
        # cap bounds every pod's batch, so the sequences held now need that many slots. Up only: without the
        # slope the rates cannot say how few pods would do.
        cap = learned.batch_cap
        # The ITL measured is at a batch up to the cap: the target bounds the ITL a full pod would see.
        lifetime = per_request * target if per_request is not None else None
        coming = handed_over(prefilling, rate=handover, lifetime=lifetime)
        held = own + coming
        slots = decode_slot_pods(held, batch=cap, seconds_per_sequence=lifetime, wait=wait)
        # Without the slope the rates still bound what the role needs once the queue drains: the tokens/s
        # coming at the ITL measured keep tokens x ITL sequences running (Little), at most ``cap`` a pod. The
        # ITL measured at a smaller batch is low, so this bound is too: the backlog's step is never cut below
        # one pod.
        sustained = tokens * mean_itl / cap if mean_itl is not None else 0.0
        urgent = backlog_step(slots, current=current, tolerance=tolerance, sustained=max(current + 1.0, sustained),
                              most=urgent_most("decode", current))
        pods = max(float(current), slots)
        numbers.update(pods=pods, batch_cap=cap, in_flight_now=held, backlog_pods=slots, sustained_pods=sustained,
                       slot_wait_s=wait)
        why = f"batch slope not fitted yet; {_held_why(held, prefilling, coming)}, at most {cap:g} per pod: {slots:.3g} pods"
        return Estimate(pods, why, numbers, hold=pods, settled=settled, demand=tokens + queued, urgent=urgent)
    numbers["pods"] = float(current)
    return Estimate(float(current), "ITL within target; batch slope not fitted yet", numbers)


def recommend(est: Estimate, *, current: int, tolerance: float) -> int | None:
    """Whole pods for an estimate: up past the dead band at once; down only as far as the hold allows."""
    if est.pods is None:
        return None
    rounded = round_with_tolerance(est.pods, current=current, tolerance=tolerance)
    if rounded >= current:
        return rounded
    hold = est.pods if est.hold is None else max(est.hold, est.pods)
    return min(current, max(rounded, math.ceil(hold - 1e-9)))


def round_with_tolerance(pods: float, *, current: int, tolerance: float) -> int:
    """Whole pods for an estimate, changing ``current`` only outside a relative dead band (no flapping)."""
    if pods > current * (1 + tolerance):
        return math.ceil(pods - 1e-9)
    lower = math.ceil(pods * (1 + tolerance) - 1e-9)
    return lower if lower < current else current


# -- forecast, start-up time and policies ----------------------------------------------------------------
@dataclass
class Forecast:
    """Holt's linear trend (double exponential smoothing) on one role's demand, sampled each interval.

    Why Holt and not a seasonal (Holt-Winters) or ARIMA fit: the planner must act on the rising edge of a
    burst within a few intervals of history, where a seasonal model has not yet seen one period (the Azure
    trace's bursts are minutes apart and irregular) and an ARIMA fit on a dozen noisy points is mostly noise.
    A level and a slope, updated in O(1) per interval, are what "one start-up time ahead" needs; a period,
    when there is one, shows as the slope of its rising edge. Dynamo's planner offers constant, ARIMA and
    Prophet predictors of the next interval's request count measured at completions; here the demand comes
    from arrivals and the queue (see ``estimate_prefill``), so the forecast starts from what is sent, not from
    what has finished.

    The trend is used only while significant: the least-squares slope of the last ``TREND_POINTS``
    demands must be ``TREND_T`` standard errors from zero and agree in sign with Holt's. A steady load with
    Poisson noise then forecasts its level (no scale change), while a ramp or a rising edge is
    extrapolated, damped (``HOLT_DAMPING`` per ``DECAY_SECONDS``) so no horizon reaches past 27 s worth of
    slope, whatever the interval (damped per interval, a 1 s interval's forecast reached 9 s).
    """

    level: float | None = None
    trend: float = 0.0  # demand per second
    last: float | None = None  # when the level was last updated
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=TREND_POINTS))

    def observe(self, *, now: float, value: float) -> None:
        if self.level is None or self.last is None:
            self.level, self.last = value, now
            self.recent.append((now, value))
            return
        dt = now - self.last
        if dt <= 0:
            return
        self.recent.append((now, value))
        predicted = self.level + self.trend * dt
        level = HOLT_ALPHA * value + (1 - HOLT_ALPHA) * predicted
        self.trend = HOLT_BETA * (level - self.level) / dt + (1 - HOLT_BETA) * self.trend
        self.level, self.last = max(0.0, level), now

    def slope_t(self) -> float:
        """The t-statistic of the recent points' least-squares slope (0 with too few points or no spread)."""
        n = len(self.recent)
        if n < 4:
            return 0.0
        xs = [t for t, _ in self.recent]
        ys = [v for _, v in self.recent]
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0:
            return 0.0
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
        if residual <= 1e-12 * max(1.0, my * my):
            return math.copysign(math.inf, slope) if slope else 0.0
        return slope / math.sqrt(residual / (n - 2) / sxx)

    def significant(self) -> bool:
        """The recent demands have a slope, beyond their noise, in the direction Holt's trend points."""
        t = self.slope_t()
        return self.trend != 0.0 and abs(t) >= TREND_T and (t > 0) == (self.trend > 0)

    def predict(self, horizon: float, *, trusted: bool | None = None) -> float | None:
        """The demand ``horizon`` seconds after the last update; None before any. ``trusted``: whether the
        trend counts (None: only while ``significant``)."""
        if self.level is None:
            return None
        if not (self.significant() if trusted is None else trusted):
            return self.level
        # Damped (Gardner): the k-th DECAY_SECONDS ahead adds HOLT_DAMPING**k of its slope, so a long horizon (a
        # start-up plus the scale-down window) cannot carry a rising edge past the crest it is heading for.
        n = horizon / DECAY_SECONDS
        steps = HOLT_DAMPING * (1 - HOLT_DAMPING ** n) / (1 - HOLT_DAMPING)
        return max(0.0, self.level + self.trend * DECAY_SECONDS * steps)

    def peak(self, horizon: float, *, trusted: bool | None = None) -> float | None:
        """The most demand forecast over the next ``horizon`` seconds (a line peaks at one of its ends)."""
        ahead = self.predict(horizon, trusted=trusted)
        return None if ahead is None or self.level is None else max(self.level, ahead)


@dataclass
class StartupLearning:
    """One role's start-up time, decision to Ready, learned from the pods the role starts.

    Each pod asked for is an ask with the time it was decided; a pod seen Ready for the first time answers
    the oldest ask, and the time between them is one start-up. A pod that answers no ask (there before the
    planner, or started by a rollout or a replacement) is timed from its creation instead, when that is
    known: the same start less the operator's reconcile, which is what the planner would have waited for.
    So the prior (``DEFAULT_STARTUP_SECONDS``) stands only until the role's first pods are Ready, not until
    the planner's own first scale-up (a 30 s prior on 1 s pods made the forecast ask x3.4-4 over 40 s).
    The estimate is a running mean (``STARTUP_DECAY``) so a changed image or node is followed. A scale-in
    drops the asks still open (those pods were never going to come).
    """

    prior: float = DEFAULT_STARTUP_SECONDS
    seconds: float | None = None
    asks: deque[float] = field(default_factory=deque)
    known: set[str] = field(default_factory=set)  # pods already counted
    learned: int = 0

    def estimate(self) -> float:
        return self.prior if self.seconds is None else self.seconds

    def asked(self, *, now: float, count: int) -> None:
        self.asks.extend([now] * max(0, count))

    def dropped(self) -> None:
        self.asks.clear()

    def observe(self, *, ready: Mapping[str, float], pods: Collection[str],
                created: Mapping[str, float] | None = None) -> None:
        """``ready``: each Ready pod of the role and when it became Ready (the planner's clock); ``pods``: all
        the role's pods (a pod counted stays known while it exists, so a readiness flap is no new start);
        ``created``: when pods were created (the planner's clock), for pods nobody asked for."""
        created = created or {}
        for pod, at in sorted(ready.items(), key=lambda item: item[1]):
            if pod in self.known:
                continue
            self.known.add(pod)
            if self.asks and self.asks[0] <= at and (pod not in created or created[pod] >= self.asks[0]):
                self._learn(at - self.asks.popleft())
            elif pod in created and created[pod] <= at:
                self._learn(at - created[pod])  # nobody here asked for it: its own start, creation to Ready
        self.known &= set(pods) | set(ready)  # forget pods that went away (names are not reused)

    def _learn(self, took: float) -> None:
        self.seconds = took if self.seconds is None else (1 - STARTUP_DECAY) * took + STARTUP_DECAY * self.seconds
        self.learned += 1


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may read besides the estimate: the role's clocks and learned start-up time."""

    role: str
    now: float
    current: int
    targets: Targets
    startup_seconds: float
    forecast: Forecast


class Policy(Protocol):
    """A planner policy: turns the model's estimate for this interval into the one the stabiliser sees.

    ``shape`` may raise or lower ``pods`` (what to scale to) and ``hold`` (the scale-in floor) and should
    say why in ``reason``; it must not do I/O. The stabiliser, bounds and scale-to-zero rules apply after.
    """

    name: str

    def shape(self, est: Estimate, ctx: PolicyContext) -> Estimate: ...


class ReactivePolicy:
    """The demand seen now, as the model sized it (the default)."""

    name = "reactive"

    def shape(self, est: Estimate, ctx: PolicyContext) -> Estimate:
        return est


class PredictivePolicy:
    """The demand forecast one start-up time plus the planner's own decision lag ahead.

    The horizon is the time from the demand the rates measured to pods serving it: the decision lag
    (``decision_lag_seconds``: half the lookback, the up window, an interval) and the role's learned
    start-up time. Up: the pods the model needs now, times the forecast's growth over the horizon (at most
    MAX_GROWTH), so pods asked for now are Ready when the demand they are for arrives. Down: the hold is
    raised to the pods the highest forecast over the horizon plus the scale-down window needs, so a role
    does not shed a pod it would have to start again before the window ends.

    The trend counts while it is significant (``Forecast.significant``), or while the work held says the
    pods are short now (``Estimate.urgent``) and Holt's trend rises: a backlog is evidence of its own that
    the demand outruns the pods, independent of the rates' noise. Then the backlog's step asks for the
    forecast's pods too (up to double the role), so a rising edge is caught up in one step, not one pod a
    window behind it.
    """

    name = "predictive"

    def shape(self, est: Estimate, ctx: PolicyContext) -> Estimate:
        f = ctx.forecast
        if est.pods is None or est.demand is None or f.level is None or f.level <= 0:
            return est
        horizon = ctx.startup_seconds + decision_lag_seconds(ctx.targets)
        short = est.urgent is not None
        trusted = f.significant() or (short and f.trend > 0)
        ahead = f.predict(horizon, trusted=trusted) or 0.0
        peak = f.peak(horizon + ctx.targets.scale_down_stabilization_seconds, trusted=trusted) or 0.0
        growth = min(MAX_GROWTH, ahead / f.level)
        staying = min(MAX_GROWTH, peak / f.level)
        numbers = dict(est.numbers, forecast_growth=growth, forecast_horizon_s=horizon, forecast_trend=f.trend)
        pods, hold, reason = est.pods, est.hold, est.reason
        if growth > 1.0:
            pods = est.pods * growth
            reason += f"; forecast x{growth:.2f} in {horizon:.0f}s (start-up {ctx.startup_seconds:.0f}s): sized ahead"
        if staying > 1.0:
            hold = max(est.pods if hold is None else hold, est.pods * staying)
        urgent = est.urgent
        if est.urgent is not None and growth > 1.0:
            # The forecast's pods are an extrapolation, not work held: they may double the role, no more (given
            # HPA's 4 pods, the step's 1 -> 4 prefill for a peak that 3 serve put pod-seconds at 1.06x fixed-peak).
            urgent = max(est.urgent, min(2 * ctx.current, math.ceil(pods - 1e-9)))
        numbers["pods"] = pods
        return dataclasses.replace(est, pods=pods, hold=hold, reason=reason, numbers=numbers,
                                   demand=est.demand * max(1.0, growth), urgent=urgent)


POLICIES: dict[str, Callable[[], Policy]] = {"reactive": ReactivePolicy, "predictive": PredictivePolicy}


def policy_for(name: str) -> Policy:
    """The policy named by ``autoscaling.policy``; raises ValueError naming the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"autoscaling.policy {name!r}: choose one of {', '.join(sorted(POLICIES))}") from None


# -- the stabiliser --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """The planner's output for one role."""

    role: str
    current: int
    desired: int
    reason: str
    numbers: dict[str, float]

    @property
    def changed(self) -> bool:
        return self.desired != self.current


class Stabiliser:
    """Recommendations over time -> replicas: windows, steps and bounds (HPA's behaviour, per role).

    Up: the lowest recommendation over the scale-up window (a spike must last), at most the maximum step;
    the window is never shorter than the rates' lookback plus half an interval (one burst interval is not
    demand). The pods a backlog asks for (``Estimate.urgent``: the work held, not a rate) need only the
    configured window, and at least two scrapes that each ask for more than there is; the latest of them
    sizes the step (a backlog that grew between them is still growing), and the maximum step bounds it.
    Down: the highest recommendation over the scale-down window (the load must have stayed low the whole
    window), and the window is also measured from the role's last scale-up: the recommendations made
    while the added pods were still starting (or the load was still climbing) say little, and a step up
    followed by a steady peak must never shrink inside the window. Later steps down may follow each
    interval: the hold (scale-in margin) makes each one safe on its own.
    """

    def __init__(self) -> None:
        # (when, recommended, the pods the work held asked for: 0 when it fits those there were)
        self.history: deque[tuple[float, int, int]] = deque()
        self.started: float | None = None
        self.last_scale_up: float | None = None  # when the replicas last grew (by us or by anyone)
        self.last_current: int | None = None

    def decide(self, *, now: float, current: int, recommended: int | None, bounds: tuple[int, int],
               targets: Targets, can_scale_in: bool, urgent: int | None = None) -> tuple[int, str]:
        desired, why = self._decide(now=now, current=current, recommended=recommended, bounds=bounds,
                                    targets=targets, can_scale_in=can_scale_in, urgent=urgent)
        if self.last_current is not None and current > self.last_current:
            self.last_scale_up = now  # grew since the last interval (ours applied late, or a human's)
        if desired > current:
            self.last_scale_up = now
        self.last_current = desired
        return desired, why

    def _decide(self, *, now: float, current: int, recommended: int | None, bounds: tuple[int, int],
                targets: Targets, can_scale_in: bool, urgent: int | None) -> tuple[int, str]:
        low, high = bounds
        if self.started is None:
            self.started = now
        if current < low or current > high:
            return min(max(current, low), high), f"replicas {current} outside bounds {low}..{high}"
        if recommended is None:
            return current, "no recommendation"
        recommended = min(max(recommended, low), high)
        self.history.append((now, recommended, min(urgent or 0, high)))
        up_seconds = up_window_seconds(targets)
        keep = max(up_seconds, targets.scale_down_stabilization_seconds)
        while self.history and self.history[0][0] < now - keep - targets.interval_seconds:
            self.history.popleft()
        # The up window covers the rates' lookback, or a lone burst would pass as sustained demand and add a
        # pod that is held through the peak. Requests held now are no such echo: an urgent recommendation
        # needs only the configured window.
        up = min(r for t, r, _ in self.history if t >= now - up_seconds)
        if up > current:
            desired = min(up, current + targets.max_scale_up_step)
            return desired, f"scale up: lowest recommendation over {up_seconds:g}s is {up}"
        # Two scrapes at least: one reading of the requests held is a moment, not yet a backlog. Once every
        # reading over the window asks for more than there is, the latest says how many: a backlog that grew
        # between the readings is the burst still arriving (the lowest reading cost the Azure trace's burst an
        # interval per step: 1 -> 2 -> 4 prefill pods where the second reading asked for 4 at once).
        short = max(targets.scale_up_stabilization_seconds, 1.5 * targets.interval_seconds)
        readings = [u for t, _, u in self.history if t >= now - short]
        if len(readings) >= 2 and min(readings) > current:
            pressed = readings[-1]
            desired = min(pressed, current + targets.max_scale_up_step)
            return desired, f"scale up: the work held asked for more than {current} over {short:g}s, now {pressed}"
        down = max(max(r, u) for t, r, u in self.history if t >= now - targets.scale_down_stabilization_seconds)
        if down < current:
            window = targets.scale_down_stabilization_seconds
            watched = now - self.started
            if watched < window:
                return current, f"would scale in to {down}, but watched only {watched:.0f}s of the {window:g}s window"
            grew = self.last_scale_up
            if self.last_current is not None and current > self.last_current:
                grew = now
            if grew is not None and now - grew < window:
                return current, (f"would scale in to {down}, but the role grew {now - grew:.0f}s ago, "
                                 f"within the {window:g}s window")
            if not can_scale_in:
                return current, f"would scale in to {down}, but a pod has no metrics yet (not taken as idle)"
            desired = max(down, current - targets.max_scale_down_step)
            return desired, f"scale in: highest recommendation over {window:g}s is {down}"
        return current, "steady"


@dataclass
class RolePlanner:
    """One role's memory between intervals: last sample per pod, what was learned, the stabiliser."""

    role: str
    samples: dict[str, PodSample] = field(default_factory=dict)  # the latest per pod
    history: dict[str, deque[PodSample]] = field(default_factory=dict)
    prefill: PrefillLearning = field(default_factory=PrefillLearning)
    decode: DecodeLearning = field(default_factory=DecodeLearning)
    stabiliser: Stabiliser = field(default_factory=Stabiliser)
    last_windows: dict[str, PodWindow] = field(default_factory=dict)
    unsettled_at: float | None = None  # the last interval with a silent pod, too few pods or a change
    # (pods, demand) at which the latency was last seen missing with every pod serving: the model was wrong
    # there, so the role does not go back to that many pods until the demand has fallen by the margin.
    missed_at: tuple[int, float] | None = None
    sized_for: float | None = None  # the demand measured (before the policy) when the role last scaled up
    policy: Policy = field(default_factory=ReactivePolicy)
    forecast: Forecast = field(default_factory=Forecast)
    startup: StartupLearning = field(default_factory=StartupLearning)
    upstream: deque[tuple[float, float]] = field(default_factory=deque)  # (time, requests the routers held)

    def step(self, *, now: float, pods: Iterable[str], samples: Mapping[str, PodSample], current: int,
             bounds: tuple[int, int], targets: Targets, arrivals: float | None = None,
             prefilling: float = 0.0, ready_at: Mapping[str, float] | None = None,
             created_at: Mapping[str, float] | None = None, held: float | None = None,
             prefill_left: int = 0, max_num_seqs: int | None = None,
             prefill_ttft: float | None = None, upstream: float = 0.0,
             handover: float | None = None) -> Decision:
        """One interval: ``pods`` are the role's pods that exist, ``samples`` this round's scrapes of them.

        ``arrivals`` (decode only): prefill's arrival rate this interval, requests per second; ``prefilling``
        (decode only): the requests prefill holds at its last scrape. ``ready_at``: the role's Ready pods and
        when each became Ready, on ``now``'s clock (None: a pod with a sample counts as Ready now), for the
        start-up time; ``created_at``: when pods were created (same clock), to time the pods nobody asked
        for. ``held``: requests the router holds for lack of engines (None: no router reports it;
        then the role never goes to zero). ``prefill_left`` (decode only): prefill pods that still exist,
        terminating ones included (decode goes to zero only after them). ``max_num_seqs`` (decode): the
        running-sequence cap the engine's command line sets (None: learned from queues). ``prefill_ttft``
        (decode only): prefill's TTFT p90 over the lookback; what the TTFT target leaves after it is how
        long a sequence may wait for a decode slot (None: no wait allowed, a slot for every sequence).
        ``upstream`` (prefill only): requests the routers hold for prefill room (``router.prefillConcurrency``).
        ``handover`` (decode only): requests per second prefill's pods complete flat out, for the pods it has or
        has just asked for (``prefill_handover``); None: not learned yet.
        """
        pods = list(pods)
        high = bounds[1]
        self.startup.observe(ready=ready_at if ready_at is not None else {p: now for p in pods if p in samples},
                             pods=pods, created=created_at)
        if current == 0 and (held or 0.0) > 0 and high > 0:
            return self._wake(now=now, held=held or 0.0, bounds=bounds)
        lookback = lookback_seconds(targets)
        windows: list[PodWindow] = []
        silent: list[str] = []
        for pod in pods:
            new = samples.get(pod)
            if new is None:
                silent.append(pod)
                continue
            past = self.history.setdefault(pod, deque(maxlen=math.ceil(lookback / targets.interval_seconds) + 1))
            # Rates over up to the lookback: a Poisson burst in one short interval is not a trend.
            oldest = new.time - lookback - 0.5 * targets.interval_seconds
            old = next((p for p in past if p.time >= oldest), None)
            w = window(old, new) if old is not None else None
            if old is not None and w is None:
                past.clear()  # the engine restarted: its counters start again
            past.append(new)
            self.samples[pod] = new
            if w is None:
                silent.append(pod)
            else:
                windows.append(w)
        for gone in set(self.samples) - set(pods):
            del self.samples[gone]
        for gone in set(self.history) - set(pods):
            del self.history[gone]
        self.last_windows = {w.pod: w for w in windows}
        # Settled: every pod asked for has reported for a whole lookback, so the latency seen is what
        # ``current`` pods deliver (just after a scale-up it is still that of the fewer, overloaded pods).
        if silent or len(windows) < current or current != self.stabiliser.last_current or self.unsettled_at is None:
            self.unsettled_at = now
        settled_seconds = now - self.unsettled_at
        if self.role == "prefill":
            self.prefill.observe(windows, seconds=targets.interval_seconds)
            # The routers' queue grows with the arrivals no engine took: its growth over the lookback is demand.
            self.upstream.append((now, upstream))
            while len(self.upstream) > 1 and self.upstream[1][0] <= now - lookback:
                self.upstream.popleft()
            since, before = self.upstream[0]
            growth = (upstream - before) / (now - since) if now > since else 0.0
            est = estimate_prefill(windows, target=targets.ttft_seconds, learned=self.prefill, current=current,
                                   settled_seconds=settled_seconds, lookback_seconds=lookback,
                                   margin=targets.scale_in_margin, tolerance=targets.tolerance,
                                   upstream=upstream, upstream_growth=growth)
        else:
            self.decode.configured = float(max_num_seqs) if max_num_seqs is not None else None
            self.decode.observe(windows, seconds=targets.interval_seconds)
            est = estimate_decode(windows, target=targets.itl_seconds, learned=self.decode, current=current,
                                  settled_seconds=settled_seconds, lookback_seconds=lookback,
                                  margin=targets.scale_in_margin, arrivals=arrivals, prefilling=prefilling,
                                  tolerance=targets.tolerance, handover=handover,
                                  wait=max(0.0, targets.ttft_seconds - prefill_ttft) if prefill_ttft is not None else 0.0)
        est = self._remember_misses(est, current=current, margin=targets.scale_in_margin)
        demand = est.demand if est.demand is not None else (0.0 if est.pods == 0.0 else None)
        if demand is not None:
            self.forecast.observe(now=now, value=demand)
        startup = self.startup.estimate()
        # What the model measured, before the policy shaped it: "the same demand" is judged on this. The
        # forecast's growth changes with its horizon (and the horizon with the learned start-up), so judged on
        # the shaped demand a 12% rise of the measured one waited for "the pods asked for" (unit test).
        measured = est.demand
        est = self.policy.shape(est, PolicyContext(role=self.role, now=now, current=current, targets=targets,
                                                   startup_seconds=startup, forecast=self.forecast))
        numbers = dict(est.numbers)
        numbers["startup_s"] = startup
        if held is not None:
            numbers["held_requests"] = held
        numbers["pods_reporting"] = float(len(windows))
        numbers["pods_silent"] = float(len(silent))
        recommended = recommend(est, current=current, tolerance=targets.tolerance)
        reason = est.reason
        if (recommended is not None and recommended > current and not est.settled and measured is not None
                and self.sized_for is not None and measured <= self.sized_for * (1 + targets.tolerance)):
            # The pods asked for at this demand are still starting: the same demand is not a reason for more
            # (an early, noisy model would otherwise add a pod per interval of the start-up lag).
            recommended = current
            reason += f"; waiting for the pods asked for at {self.sized_for:.3g}"
        if recommended is not None:
            numbers["recommended"] = float(recommended)
        desired, why = self.stabiliser.decide(now=now, current=current, recommended=recommended, bounds=bounds,
                                              targets=targets, can_scale_in=not silent, urgent=est.urgent)
        if desired == 0 and current > 0:
            keep = self._why_not_zero(held=held, prefill_left=prefill_left)
            if keep:
                desired, why = 1, f"{why}, but {keep}"
                self.stabiliser.last_current = 1
        if desired > current:
            # Only pods that cover what the model asked for are "the pods asked for at this demand": a step
            # cut short (the backlog's bounded step, the maximum step) leaves the rest still wanted.
            self.sized_for = measured if recommended is not None and desired >= recommended else None
            self.startup.asked(now=now, count=desired - current)
        elif desired < current:
            self.startup.dropped()
        return Decision(role=self.role, current=current, desired=desired, reason=f"{why}; {reason}",
                        numbers=numbers)

    def _why_not_zero(self, *, held: float | None, prefill_left: int) -> str | None:
        """Why the role must keep one pod though the window says zero; None when zero is safe."""
        if held is None:
            return f"no router reports {HELD_REQUESTS}: nothing could start the role again from zero"
        if held > 0:
            return f"the router holds {held:.0f} requests"
        if self.role == "decode" and prefill_left > 0:
            return f"{prefill_left} prefill pods still exist (their in-flight KV is handed over first)"
        return None

    def _wake(self, *, now: float, held: float, bounds: tuple[int, int]) -> Decision:
        """From zero: the router holds requests, so start the role at once (no window: nobody serves them)."""
        low, high = bounds
        desired = min(high, max(1, low))
        self.stabiliser.last_scale_up = now
        self.stabiliser.last_current = desired
        if self.stabiliser.started is None:
            self.stabiliser.started = now
        # The interval after a wake may still see zero pods (the apply lags): ask for each pod once.
        self.startup.asked(now=now, count=desired - len(self.startup.asks))
        reason = (f"scale from zero: the router holds {held:.0f} requests; start-up about "
                  f"{self.startup.estimate():.0f}s")
        return Decision(role=self.role, current=0, desired=desired, reason=reason,
                        numbers={"held_requests": held, "startup_s": self.startup.estimate()})


    def _remember_misses(self, est: Estimate, *, current: int, margin: float) -> Estimate:
        """Raise the hold above a size whose latency was seen missing, in every interval whose demand is near
        the level that missed.

        The memory is not dropped on one quieter interval (a Poisson lull inside a steady peak): the scale-down
        window's maximum then still holds the pod. It goes when that size (or fewer) is seen meeting the target,
        settled, at a demand at least as high, or when a larger size misses.
        """
        if est.demand is None or est.pods is None:
            return est
        if est.missed and (self.missed_at is None or current >= self.missed_at[0]):
            self.missed_at = (current, est.demand)
        elif (self.missed_at is not None and est.settled and current <= self.missed_at[0]
              and est.demand >= self.missed_at[1]):
            self.missed_at = None  # this size met the target at that load after all
        if self.missed_at is None:
            return est
        pods, demand = self.missed_at
        if est.demand < (1 - margin) * demand:
            return est  # the load is well below the level that missed: the model may judge again
        hold = max(est.hold if est.hold is not None else est.pods, pods + 1.0)
        numbers = dict(est.numbers, hold=hold, missed_at_pods=float(pods))
        return dataclasses.replace(est, hold=hold, numbers=numbers,
                                   reason=est.reason + f"; not back to {pods} pods (they missed the target "
                                                       f"at this load)")


def prefill_handover(decision: Decision) -> float | None:
    """Requests per second prefill's pods complete flat out, for the pods it has or has just asked for (the
    larger: pods asked for serve within a start-up, pods being removed still finish what they hold); None
    until a pod's throughput and the prompts' uncached length are known."""
    throughput = decision.numbers.get("pod_tokens_per_s")
    uncached = decision.numbers.get("uncached_tokens")
    if not throughput or not uncached:
        return None
    return max(decision.current, decision.desired) * throughput / uncached


def deletion_costs(samples: Mapping[str, PodSample], pods: Iterable[str]) -> dict[str, int]:
    """``controller.kubernetes.io/pod-deletion-cost`` per pod: lowest = least in-flight work, least local cache.

    In-flight requests weigh most (a drained request costs a retry or a wait); the engine-local cache value
    the pool does not hold comes next (it must be written back or lost), then the cache fill. A pod with no
    sample costs the most: nothing proves it is idle.
    """
    costs: dict[str, int] = {}
    for pod in pods:
        s = samples.get(pod)
        if s is None:
            costs[pod] = 1_000_000_000
            continue
        cache = s.local_only_blocks if s.local_only_blocks is not None else 0.0
        usage = s.kv_usage if s.kv_usage is not None else 0.0
        in_flight = s.running + s.waiting
        costs[pod] = int(min(999_999_999, in_flight * 1_000_000 + min(cache, 9_999) * 100 + usage * 99))
    return costs
