"""The planner against a fluid model of prefill and decode pods: step up, steady, step down, steps, bounds, silence."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from daybreak.operator.engine_metrics import Histogram, PodSample, PodWindow, parse_metrics
from daybreak.operator.planner import (
    Decision,
    DecodeLearning,
    RolePlanner,
    Stabiliser,
    Targets,
    backlog_step,
    deletion_costs,
    estimate_decode,
    handed_over,
    policy_for,
    prefill_handover,
    round_with_tolerance,
    urgent_most,
)

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))
INTERVAL = 5.0


def targets(**overrides: float) -> Targets:
    base = {"ttft_seconds": 1.0, "itl_seconds": 0.05, "interval_seconds": INTERVAL,
            "scale_up_stabilization_seconds": INTERVAL, "scale_down_stabilization_seconds": 30.0,
            "max_scale_up_step": 4, "max_scale_down_step": 1, "tolerance": 0.1}
    base.update(overrides)
    return Targets(**base)  # type: ignore[arg-type]


@dataclass
class PodCounters:
    ttft: dict[float, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    ttft_sum: float = 0.0
    itl: dict[float, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    itl_sum: float = 0.0
    prompt: float = 0.0
    hits: float = 0.0
    running: float = 0.0
    waiting: float = 0.0

    def observe(self, hist: dict[float, float], value: float, n: float) -> None:
        for le in BUCKETS:
            if value <= le:
                hist[le] += n

    def sample(self, pod: str, now: float) -> PodSample:
        return PodSample(
            pod=pod, time=now, running=self.running, waiting=self.waiting,
            ttft=Histogram(tuple(self.ttft.items()), self.ttft_sum, self.ttft[float("inf")]),
            itl=Histogram(tuple(self.itl.items()), self.itl_sum, self.itl[float("inf")]),
            prompt_tokens=self.prompt, cache_hits=self.hits,
        )


class FluidRole:
    """Prefill: one queue per pod, 1000 uncached tokens/s, 500 of 800 prompt tokens uncached (S = 0.5 s).
    Decode: ITL = 0.01 + 0.002 x batch, 100 output tokens per request."""

    def __init__(self, role: str, replicas: int, *, startup: int = 0) -> None:
        self.role = role
        self.pods: dict[str, PodCounters] = {}
        self.starting: dict[str, int] = {}  # pod -> intervals before it serves and answers scrapes
        self.startup = startup
        self.serial = 0
        self.backlog = 0.0
        self.resize(replicas)
        self.starting.clear()  # the initial pods are up

    def resize(self, n: int) -> None:
        while len(self.pods) < n:
            self.serial += 1
            name = f"{self.role}-{self.serial:03d}"
            self.pods[name] = PodCounters()
            if self.startup:
                self.starting[name] = self.startup
        while len(self.pods) > n:
            # the newest first, like a ReplicaSet deleting the pods not ready yet
            victim = max(self.pods)
            self.pods.pop(victim)
            self.starting.pop(victim, None)

    def serving(self) -> dict[str, PodCounters]:
        return {p: c for p, c in self.pods.items() if p not in self.starting}

    def advance(self, rate: float, dt: float) -> None:
        for pod in list(self.starting):
            self.starting[pod] -= 1
            if self.starting[pod] <= 0:
                del self.starting[pod]
        serving = self.serving()
        n = len(serving)
        per = rate / n
        for c in serving.values():
            if self.role == "prefill":
                mu = 1000.0 / 500.0
                rho = per / mu
                if rho < 0.98:
                    c.running, c.waiting = rho, rho * rho / (1 - rho)
                    ttft, done = 0.5 / (1 - rho), per * dt
                else:  # overloaded: it completes mu per second and its queue grows
                    c.running = 1.0
                    c.waiting += (per - mu) * dt
                    ttft, done = 10.0, mu * dt
                c.observe(c.ttft, ttft, done)
                c.ttft_sum += ttft * done
                c.prompt += 800 * done
                c.hits += 300 * done
            else:
                a, slope, out, max_batch = 0.01, 0.002, 100, 64
                denom = 1 - per * out * slope
                batch = per * out * a / denom if denom > 0 else float("inf")
                if batch <= max_batch:
                    c.running, c.waiting = batch, 0.0
                    itl = a + slope * batch
                    tokens = per * dt * out
                else:  # the batch is full: the rest queues
                    c.running = max_batch
                    itl = a + slope * max_batch
                    tokens = max_batch / itl * dt
                    c.waiting += per * dt - tokens / out
                c.observe(c.itl, itl, tokens)
                c.itl_sum += itl * tokens
                started = tokens / out  # requests served this interval, each with its first token
                c.observe(c.ttft, itl, started)
                c.ttft_sum += itl * started

    def samples(self, now: float) -> dict[str, PodSample]:
        return {pod: c.sample(pod, now) for pod, c in self.serving().items()}


def drive(role: str, *, replicas: int, bounds: tuple[int, int], rates: list[float],
          t: Targets | None = None, startup: int = 0, ahead: bool = False, policy: str = "reactive",
          planner: RolePlanner | None = None, decisions: list[Decision] | None = None) -> list[tuple[float, int, str]]:
    """Run the planner one decision per interval; new pods serve after ``startup`` intervals (0: at once).

    ``ahead`` (decode): pass prefill's arrival rate, which is the rate decode sees one interval later.
    ``decisions``: when given, every Decision is appended to it (for its numbers).

    Returns (time, replicas, reason) per interval.
    """
    t = t or targets()
    fluid = FluidRole(role, replicas, startup=startup)
    planner = planner or RolePlanner(role, policy=policy_for(policy))
    now = 0.0
    trail: list[tuple[float, int, str]] = []
    arrivals = list(rates[1:]) + rates[-1:]
    for i, rate in enumerate(rates):
        fluid.advance(rate, INTERVAL)
        now += INTERVAL
        decision = planner.step(now=now, pods=list(fluid.pods), samples=fluid.samples(now), current=replicas,
                                bounds=bounds, targets=t, arrivals=arrivals[i] if ahead else None)
        if decisions is not None:
            decisions.append(decision)
        replicas = decision.desired
        fluid.resize(replicas)
        trail.append((now, replicas, decision.reason))
    return trail


def test_prefill_step_up_four_times_scales_up_within_three_intervals() -> None:
    # 1 req/s fits 1 pod (rho 0.5, TTFT 1.0 s... at target); 4 req/s needs about 4 / (2 x 0.5) = 4 pods.
    trail = drive("prefill", replicas=2, bounds=(1, 20), rates=[1.0] * 6 + [4.0] * 10)
    before = trail[5][1]
    # three: the up window spans the two-interval lookback plus one (a single burst interval must not pass)
    assert trail[8][1] > before, trail[5:9]
    assert trail[-1][1] >= 4


def test_decode_step_up_four_times_scales_up_within_three_intervals() -> None:
    # A settled base first (2 pods do not fit 20 req/s: the start itself scales up, over the up window).
    trail = drive("decode", replicas=2, bounds=(1, 20), rates=[20.0] * 20 + [80.0] * 10)
    before = trail[19][1]
    # three: the up window spans the two-interval lookback plus one (a single burst interval must not pass)
    assert trail[22][1] > before, trail[19:23]


def test_steady_load_changes_nothing_once_settled() -> None:
    for role, rate in (("prefill", 3.0), ("decode", 50.0)):
        trail = drive(role, replicas=2, bounds=(1, 20), rates=[rate] * 60)
        settled = [r for _, r, _ in trail[30:]]
        assert len(set(settled)) == 1, (role, trail)


def test_step_down_scales_in_only_after_the_stabilisation_window() -> None:
    window = 30.0
    trail = drive("prefill", replicas=2, bounds=(1, 20), rates=[4.0] * 12 + [1.0] * 20,
                  t=targets(scale_down_stabilization_seconds=window))
    peak = trail[11][1]
    step_time = trail[11][0]
    for now, replicas, _ in trail[12:]:
        if now < step_time + window:
            assert replicas == peak, (now, trail)
    assert trail[-1][1] < peak
    # and then one pod at a time (max step down 1)
    sizes = [r for _, r, _ in trail]
    assert all(b >= a - 1 for a, b in itertools.pairwise(sizes))


def noisy(rate: float, n: int, *, seed: int, spread: float = 0.3) -> list[float]:
    """``n`` intervals of a steady load whose per-interval rate wanders +-``spread`` (a Poisson-ish process)."""
    rng = random.Random(seed)
    return [rate * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def sizes_after(trail: list[tuple[float, int, str]], start: int) -> list[int]:
    return [r for _, r, _ in trail[start:]]


def test_a_steady_noisy_load_makes_no_change_once_settled() -> None:
    # Pods take two intervals to start, the rate wanders +-15% around its mean (about the Poisson noise of
    # a hundred requests per lookback): once the role has settled, nothing moves (the old planner, with no
    # hold on scale-in, took a pod away and wanted it back). Not covered: a role sized right at the knee of
    # its latency curve (prefill 8/s here, mean TTFT at the target) still adds a late pod when a noisy
    # interval misses the p90; the 20% margin does not cover noise as large as the headroom left.
    cases = [(role, rate, seed) for role, rate in (("prefill", 3.0), ("prefill", 5.0), ("decode", 10.0))
             for seed in (1, 2, 3, 4)]
    for role, rate, seed in cases:
        trail = drive(role, replicas=2, bounds=(1, 20), rates=noisy(rate, 80, seed=seed, spread=0.15), startup=2)
        settled = sizes_after(trail, 30)
        assert len(set(settled)) == 1, (role, rate, [(t, r) for t, r, _ in trail])


def test_a_step_up_then_a_steady_peak_never_scales_in() -> None:
    # 1x -> 4x, the peak held (noisy) for many windows: the planner sizes up from the model and never
    # takes a pod away during the peak (the old one overshot while the new pods started, then shrank).
    window = 30.0
    for role, base, seed in (("prefill", 1.0, 5), ("decode", 2.5, 6)):
        rates = noisy(base, 12, seed=seed, spread=0.1) + noisy(4 * base, 60, seed=seed + 10, spread=0.15)
        trail = drive(role, replicas=1, bounds=(1, 20), rates=rates, startup=2,
                      t=targets(scale_down_stabilization_seconds=window))
        peak = sizes_after(trail, 12)
        assert peak[2] > trail[11][1], (role, trail[10:15])  # raised within two intervals of the step
        assert all(b >= a for a, b in itertools.pairwise(peak)), (role, [(t, r) for t, r, _ in trail])
        assert max(peak) < 20, (role, peak)  # sized from the model, not pushed to the bounds


def test_a_step_down_after_a_lagged_step_up_scales_in_only_after_the_window() -> None:
    # The first pod taken away after the step up comes a full window after the step down, never during
    # the peak (the old planner overshot while the new pods started and handed pods back in the peak).
    window = 30.0
    for role, base, seed in (("prefill", 1.0, 7), ("decode", 2.5, 8)):
        rates = [base] * 8 + noisy(4 * base, 16, seed=seed, spread=0.15) + noisy(base, 40, seed=seed + 10, spread=0.15)
        trail = drive(role, replicas=1, bounds=(1, 20), rates=rates, startup=2,
                      t=targets(scale_down_stabilization_seconds=window))
        step_down = trail[23][0]
        after_up = trail[8:]
        assert max(r for _, r, _ in after_up) > 1, (role, trail)
        first_in = next(t for (_, a, _), (t, b, _) in itertools.pairwise(after_up) if b < a)
        assert first_in >= step_down + window, (role, first_in - step_down, [(t, r) for t, r, _ in trail])
        assert trail[-1][1] < trail[23][1], (role, trail[-1])


def test_max_step_limits_each_decision() -> None:
    trail = drive("decode", replicas=1, bounds=(1, 100), rates=[5.0] * 3 + [400.0] * 9,
                  t=targets(max_scale_up_step=2))
    sizes = [1] + [r for _, r, _ in trail]
    assert max(b - a for a, b in itertools.pairwise(sizes)) <= 2
    assert sizes[-1] > 3


def test_bounds_hold_both_ways() -> None:
    up = drive("prefill", replicas=2, bounds=(2, 3), rates=[20.0] * 8)
    assert max(r for _, r, _ in up) == 3
    down = drive("prefill", replicas=3, bounds=(2, 3), rates=[0.0] * 20,
                 t=targets(scale_down_stabilization_seconds=10.0))
    assert min(r for _, r, _ in down) == 2


def test_a_pod_without_metrics_is_not_idle() -> None:
    t = targets(scale_down_stabilization_seconds=0.0)
    planner = RolePlanner("decode")
    planner.decode.points = {5: (5.0, 0.02), 20: (20.0, 0.05)}  # learned earlier: ITL = 0.01 + 0.002 x batch
    fluid = FluidRole("decode", 3)
    now = 0.0
    silent = "decode-003"
    for _ in range(10):
        fluid.advance(1.0, INTERVAL)
        now += INTERVAL
        samples = {p: s for p, s in fluid.samples(now).items() if p != silent}
        decision = planner.step(now=now, pods=list(fluid.pods), samples=samples, current=3, bounds=(1, 10),
                                targets=t)
        assert decision.desired == 3, decision
    assert "no metrics" in decision.reason
    # once it reports (two samples make a window), the idle role does scale in
    for _ in range(2):
        fluid.advance(1.0, INTERVAL)
        now += INTERVAL
        decision = planner.step(now=now, pods=list(fluid.pods), samples=fluid.samples(now), current=3,
                                bounds=(1, 10), targets=t)
    assert decision.desired == 2, decision


def test_no_metrics_at_all_keeps_replicas() -> None:
    planner = RolePlanner("prefill")
    for i in range(5):
        decision = planner.step(now=5.0 * i, pods=["a", "b"], samples={}, current=2, bounds=(1, 10),
                                targets=targets(scale_down_stabilization_seconds=0.0))
        assert decision.desired == 2


def test_restarted_engine_counters_are_not_a_window() -> None:
    planner = RolePlanner("prefill")
    fluid = FluidRole("prefill", 1)
    fluid.advance(3.0, INTERVAL)
    planner.step(now=5, pods=list(fluid.pods), samples=fluid.samples(5), current=1, bounds=(1, 5), targets=targets())
    fluid.pods["prefill-1"] = PodCounters()  # restarted: counters back to zero
    d = planner.step(now=10, pods=list(fluid.pods), samples=fluid.samples(10), current=1, bounds=(1, 5),
                     targets=targets())
    assert d.numbers["pods_silent"] == 1


def test_tolerance_band() -> None:
    assert round_with_tolerance(2.05, current=2, tolerance=0.1) == 2
    assert round_with_tolerance(2.3, current=2, tolerance=0.1) == 3
    assert round_with_tolerance(2.3, current=3, tolerance=0.1) == 3
    assert round_with_tolerance(1.5, current=3, tolerance=0.1) == 2
    assert round_with_tolerance(0.4, current=0, tolerance=0.1) == 1


def test_deletion_cost_prefers_idle_pods_with_little_local_cache() -> None:
    samples = {
        "busy": PodSample(pod="busy", time=0, running=2, waiting=0, kv_usage=0.1, local_only_blocks=0),
        "warm": PodSample(pod="warm", time=0, running=0, waiting=0, kv_usage=0.9, local_only_blocks=50),
        "cold": PodSample(pod="cold", time=0, running=0, waiting=0, kv_usage=0.1, local_only_blocks=0),
    }
    costs = deletion_costs(samples, ["busy", "warm", "cold", "silent"])
    assert sorted(costs, key=costs.__getitem__) == ["cold", "warm", "busy", "silent"]


def test_parse_vllm_text() -> None:
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="m"} 2.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="m"} 1.0',
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{model_name="m"} 40.0',
        "# TYPE vllm:inter_token_latency_seconds histogram",
        'vllm:inter_token_latency_seconds_bucket{le="0.05",model_name="m"} 3.0',
        'vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 4.0',
        'vllm:inter_token_latency_seconds_sum{model_name="m"} 0.2',
        'vllm:inter_token_latency_seconds_count{model_name="m"} 4.0',
        "",
    ])
    s = parse_metrics(text, pod="p", time=1.0)
    assert (s.running, s.waiting, s.cache_hits) == (2.0, 1.0, 40.0)
    assert s.itl is not None and s.itl.count == 4.0 and s.itl.quantile(0.5) is not None


def test_one_burst_interval_adds_no_pod_but_a_sustained_step_does_within_the_window() -> None:
    # Rates span two intervals, so one burst interval lifts two recommendations in a row: with a one-interval
    # up window that passed as demand (issue 13's overshoot). The up window covers the lookback plus one.
    # Prefill only: the decode fluid's burst leaves a queue gauge that a third window still averages in (see
    # docs/operations.md, Known limits).
    for role, base, burst in (("prefill", 1.0, 4.0),):
        trail = drive(role, replicas=2, bounds=(1, 20), rates=[base] * 20 + [burst] + [base] * 12)
        settled = trail[19][1]
        assert [r for _, r, _ in trail[20:]] == [settled] * 13, (role, trail[19:])
        trail = drive(role, replicas=2, bounds=(1, 20), rates=[base] * 20 + [burst] * 8)
        assert trail[22][1] > trail[19][1], (role, trail[19:23])  # the third high interval scales up


def test_decode_is_sized_ahead_from_prefill_arrivals() -> None:
    # Prefill admits the step an interval before decode's own tokens show it: decode sized from arrivals x
    # the learned output length (100 tokens) through its ITL fit scales up an interval earlier.
    rates = [15.0] * 20 + [60.0] * 8  # 15 req/s: 4 pods, under the target (20 sits on it)
    late = drive("decode", replicas=2, bounds=(1, 40), rates=rates)
    early = drive("decode", replicas=2, bounds=(1, 40), rates=rates, ahead=True)
    assert late[19][1] == early[19][1], (late[18:20], early[18:20])
    # Without arrivals only the backlog at decode shows the step in time, and it at most doubles the role
    # (the requests queued while the pods were short are no measure of the load); sized ahead, decode
    # reaches the pods the new rate needs (16) two intervals sooner.
    assert late[21][1] <= 2 * late[19][1], late[19:22]
    assert early[23][1] >= 16 > late[23][1], (early[19:24], late[19:24])
    assert any("sized ahead" in reason for _, _, reason in early[19:24]), early[19:24]
    # At a steady load arrivals say what decode sees: no change either way once settled.
    steady = drive("decode", replicas=2, bounds=(1, 40), rates=[15.0] * 40, ahead=True)
    assert len({r for _, r, _ in steady[20:]}) == 1, steady[20:]


def test_the_decode_fit_takes_the_batch_from_the_itl_sum_not_the_noisy_running_gauge() -> None:
    # A decode pod at ITL = 0.02 + 0.012 x batch (the bench's cost model), mean batch 0.5 .. 4.5. The running
    # gauge is read at two instants and counts sequences still loading KV: here it reads the mean batch plus
    # up to +-1 of noise. The ITL histogram's sum over the window is the sequence-seconds decoded (Little's
    # law), so it gives the batch of the very tokens the ITL describes: the fit finds the true line. (Fitted
    # on the gauge, the same windows gave a slope far too flat, and decode scaled late.)
    rng = random.Random(5)
    learned = DecodeLearning()
    for i in range(60):
        batch = 0.5 + (i % 9) * 0.5
        itl = 0.02 + 0.012 * batch
        seconds = 6.0
        tokens = batch / itl * seconds
        start = max(0.0, batch + rng.uniform(-1, 1))
        end = max(0.0, start + rng.uniform(-1, 1))
        learned.observe([PodWindow(
            pod="d", seconds=seconds, requests=tokens / 64, uncached_tokens=None,
            mean_running=(start + end) / 2, mean_waiting=0.0, running_change=end - start, waiting_growth=0.0,
            ttft=None, itl=Histogram(((float("inf"), tokens),), itl * tokens, tokens))])
    fit = learned.fit()
    assert fit is not None
    a, c = fit
    assert abs(a - 0.02) < 0.002 and abs(c - 0.012) < 0.001, fit


def test_a_prefill_backlog_scales_up_before_the_rates_window_has_passed_and_no_further_than_the_rates() -> None:
    # 0.5 -> 3 req/s on one prefill pod (2 req/s flat out): its queue grows by 5 requests an interval. The
    # rates need their window (the lookback plus half an interval: three recommendations) before they may
    # scale; the requests held now are no echo of a burst, so two scrapes of them (the configured up window)
    # scale an interval earlier. The step goes past doubling (HPA's 4 pods more) to the pods the rates ask for
    # (3 req/s x 0.5 s at utilisation 0.5: 3 pods), and no further: the queue also holds what waited while the
    # pod was short (11 in flight asked for 11 pods).
    trail = drive("prefill", replicas=1, bounds=(1, 20), rates=[0.5] * 10 + [3.0] * 6)
    before = trail[9][1]
    assert before == 1, trail[:10]
    first = next(i for i in range(10, 16) if trail[i][1] > before)
    assert first == 11, trail[9:14]
    assert trail[first][1] == 3 and "work held" in trail[first][2], trail[first]
    assert max(r for _, r, _ in trail) == 3, trail[9:]


def test_a_backlog_step_is_hpa_s_per_period_step_for_prefill_and_doubling_for_decode() -> None:
    # Sized on a backlog of 12 pods' work with the rates asking for 9: prefill may go 1 -> 5 (4 pods more), then
    # 5 -> 9 (the rates' pods, under double); decode doubles.
    assert backlog_step(12.0, current=1, tolerance=0.1, sustained=9.0, most=urgent_most("prefill", 1)) == 5
    assert backlog_step(12.0, current=5, tolerance=0.1, sustained=9.0, most=urgent_most("prefill", 5)) == 9
    assert backlog_step(12.0, current=1, tolerance=0.1, sustained=9.0, most=urgent_most("decode", 1)) == 2
    assert backlog_step(12.0, current=3, tolerance=0.1, sustained=9.0, most=urgent_most("decode", 3)) == 6
    # A backlog within the dead band asks for nothing; one the rates do not yet back still adds a pod.
    assert backlog_step(1.05, current=1, tolerance=0.1, sustained=4.0, most=urgent_most("prefill", 1)) is None
    assert backlog_step(3.0, current=1, tolerance=0.1, sustained=0.5, most=urgent_most("prefill", 1)) == 2


def test_a_backlog_confirmed_by_two_scrapes_is_sized_by_the_latest_and_a_single_one_adds_nothing() -> None:
    # The rates ask for 1 pod throughout (they lag a burst); the work held asks for 2, then 4. The first reading
    # is a moment; the second confirms the backlog, and the latest reading sizes the step: 1 -> 4 at once, where
    # sizing by the lowest reading went 1 -> 2 and waited an interval for 4 (the Azure trace's 95 s burst).
    t = targets(interval_seconds=1.0, scale_up_stabilization_seconds=1.0)
    growing = Stabiliser()
    assert growing.decide(now=1.0, current=1, recommended=1, bounds=(1, 8), targets=t,
                          can_scale_in=True, urgent=2)[0] == 1
    desired, why = growing.decide(now=2.0, current=1, recommended=1, bounds=(1, 8), targets=t,
                                  can_scale_in=True, urgent=4)
    assert desired == 4 and "work held" in why, why
    # One reading between two that fit the pods is no backlog: nothing added.
    blip = Stabiliser()
    for now, urgent in ((1.0, None), (2.0, 4), (3.0, None)):
        assert blip.decide(now=now, current=1, recommended=1, bounds=(1, 8), targets=t,
                           can_scale_in=True, urgent=urgent)[0] == 1, now
    # A backlog that shrank between the readings asks for what the latest says, still at least one pod more.
    draining = Stabiliser()
    draining.decide(now=1.0, current=1, recommended=1, bounds=(1, 8), targets=t, can_scale_in=True, urgent=4)
    assert draining.decide(now=2.0, current=1, recommended=1, bounds=(1, 8), targets=t,
                           can_scale_in=True, urgent=2)[0] == 2
    # The maximum step bounds it as before.
    capped = Stabiliser()
    capped.decide(now=1.0, current=1, recommended=1, bounds=(1, 8), targets=t, can_scale_in=True, urgent=2)
    assert capped.decide(now=2.0, current=1, recommended=1, bounds=(1, 8),
                         targets=dataclasses.replace(t, max_scale_up_step=2), can_scale_in=True, urgent=6)[0] == 3


def test_decode_counts_the_requests_prefill_holds_as_sequences_a_prefill_away() -> None:
    # Decode at one pod, ITL = 0.02 + 0.012 x batch: five sequences fit the 80 ms target. It holds two now; the
    # burst is still in prefill (six requests), so decode's own count would show it only a prefill later.
    learned = DecodeLearning(points={1: (1.0, 0.032), 3: (3.0, 0.056)})
    w = PodWindow(pod="d", seconds=6.0, requests=1.0, uncached_tokens=None, mean_running=2.0, mean_waiting=0.0,
                  running_change=0.0, waiting_growth=0.0, ttft=None,
                  itl=Histogram(((float("inf"), 150.0),), 150 * 0.044, 150.0), in_flight_now=2.0)
    alone = estimate_decode([w], target=0.08, learned=learned, current=1)
    assert alone.urgent is None, alone
    ahead = estimate_decode([w], target=0.08, learned=learned, current=1, prefilling=6.0)
    assert ahead.urgent == 2 and ahead.numbers["in_flight_now"] == 8.0, ahead


def test_decode_learns_the_pods_batch_cap_from_windows_in_which_requests_waited() -> None:
    # ITL = 0.02 + 0.012 x batch allows batch 5 within 80 ms, but the pods run at most 4 (max_num_seqs): a pod
    # that queues shows it. Until one queued the target alone bounds the batch; after, the cap does, and the
    # same 150 tokens/s need 150 x 0.08 / 4 = 3 pods, not 2.4.
    learned = DecodeLearning(points={1: (1.0, 0.032), 3: (3.0, 0.056)})

    def w(running: float, waiting: float) -> PodWindow:
        return PodWindow(pod="d", seconds=6.0, requests=1.0, uncached_tokens=None, mean_running=running,
                         mean_waiting=waiting, running_change=0.0, waiting_growth=0.0, ttft=None,
                         itl=Histogram(((float("inf"), 900.0),), 900 * 0.068, 900.0), in_flight_now=running)

    before = estimate_decode([w(3.0, 0.0)], target=0.08, learned=learned, current=1)
    assert before.pods == pytest.approx(150 * 0.08 / 5) and "batch_cap" not in before.numbers
    learned.observe([w(3.0, 0.0)])  # not queued: says nothing of the cap
    assert learned.batch_cap is None
    filling = PodWindow(pod="d", seconds=6.0, requests=1.0, uncached_tokens=None, mean_running=2.0,
                        mean_waiting=0.6, running_change=2.0, waiting_growth=1.0, ttft=None, itl=None)
    learned.observe([filling])  # the batch was still filling (1 -> 3) when the queue formed: not the cap
    assert learned.batch_cap is None
    learned.observe([w(2.0, 0.5)])  # one scrape caught a request waiting (loading its KV): no queue
    assert learned.batch_cap is None
    learned.observe([w(3.0, 2.0), w(2.0, 1.0)])  # queued at both scrapes, running flat: the most it ran then
    assert learned.batch_cap == 3.0
    ran = PodWindow(pod="d", seconds=6.0, requests=1.0, uncached_tokens=None, mean_running=3.0, mean_waiting=0.0,
                    running_change=2.0, waiting_growth=0.0, ttft=None, itl=None)
    learned.observe([ran])  # a pod ran 4 at once (2 -> 4): the cap is at least that
    assert learned.batch_cap == 4.0
    after = estimate_decode([w(4.0, 0.0)], target=0.08, learned=learned, current=1)
    assert after.pods == pytest.approx(150 * 0.08 / 4) and after.numbers["max_batch"] == 4.0


def test_before_the_decode_slope_is_fitted_a_pod_that_queued_asks_for_the_slots_its_sequences_need() -> None:
    # A new deployment whose load rose before its batches spread: no ITL slope, ITL within target (the pod
    # caps its batch), so the rates say nothing. Once a pod has queued, its cap bounds every batch: 9 sequences
    # held (6 on the pod, 3 still in prefill) need 9 / 4 slots -> one pod more now, through the short window.
    learned = DecodeLearning()
    queued = PodWindow(pod="d", seconds=3.0, requests=1.0, uncached_tokens=None, mean_running=4.0, mean_waiting=2.0,
                       running_change=0.0, waiting_growth=2.0, ttft=None,
                       itl=Histogram(((float("inf"), 150.0),), 150 * 0.068, 150.0), in_flight_now=6.0)
    blind = estimate_decode([queued], target=0.08, learned=learned, current=1, prefilling=3.0)
    assert blind.pods == 1.0 and blind.urgent is None and "not fitted" in blind.reason, blind
    learned.observe([queued])
    assert learned.fit() is None and learned.batch_cap == 4.0
    est = estimate_decode([queued], target=0.08, learned=learned, current=1, prefilling=3.0)
    assert est.urgent == 2 and est.pods == pytest.approx(9 / 4), est


def test_a_decode_cap_set_on_the_engine_command_line_sizes_a_burst_before_any_slope_or_queue_was_learned() -> None:
    # The Azure trace's burst: one decode pod, short outputs (one batch size seen, no slope), and the queue has
    # been there for two scrapes only (not a lookback: no cap learned from it). Told the engine runs at most 4
    # sequences (--max-num-seqs 4 in engine.args), the 15 held need 3.75 pods; the rates (79.5 tokens/s at ITL
    # 68 ms keep 5.4 sequences running: 1.35 pods of 4) bound the backlog's step, which is never under one pod.
    # Not told, the planner has nothing to size the burst on and stays at one pod.
    t = targets(interval_seconds=1.0, scale_up_stabilization_seconds=1.0, itl_seconds=0.08)

    def sample(now: float, *, running: float, waiting: float, tokens: float) -> PodSample:
        itl = Histogram(((float("inf"), tokens),), 0.068 * tokens, tokens)
        return PodSample(pod="d-1", time=now, running=running, waiting=waiting, itl=itl,
                         ttft=Histogram(((float("inf"), tokens / 27),), 0.1 * tokens / 27, tokens / 27))

    def last(max_num_seqs: int | None) -> Decision:
        planner = RolePlanner("decode")
        decision = None
        calm = [sample(float(i), running=1.0, waiting=0.0, tokens=15.0 * i) for i in range(8)]
        burst = [sample(8.0, running=4.0, waiting=10.0, tokens=15.0 * 7 + 60.0),
                 sample(9.0, running=4.0, waiting=11.0, tokens=15.0 * 7 + 120.0)]
        for s in [*calm, *burst]:
            decision = planner.step(now=s.time, pods=["d-1"], samples={"d-1": s}, current=1, bounds=(1, 4),
                                    targets=t, max_num_seqs=max_num_seqs)
        assert decision is not None
        assert planner.decode.fit() is None
        return decision

    told = last(4)
    assert told.numbers["batch_cap"] == 4.0 and told.numbers["backlog_pods"] == pytest.approx(15 / 4), told
    assert told.numbers["sustained_pods"] == pytest.approx(79.5 * 0.068 / 4), told
    assert told.desired == 2 and "work held" in told.reason, told
    blind = last(None)
    assert blind.desired == 1 and "batch_cap" not in blind.numbers and "not fitted" in blind.reason, blind


def test_decode_counts_only_the_requests_prefill_can_hand_over_while_a_sequence_decodes() -> None:
    # The Azure trace's burst: 23 short requests (30 output tokens) queued in prefill, 2 sequences on decode, at
    # most 4 a pod, no slope yet. Prefill's 4 pods complete 4 x 349 / 405 = 3.45 requests a second and each
    # holds a decode slot for 30 x 80 ms = 2.4 s, so at most 8.3 of the 23 are in decode together: 10.3
    # sequences, 2.6 pods, where counting all 23 asked for 6.25 and held that many until the slope was fitted
    # (the run went to 4 decode pods, the bound, for 45 s; fixed-peak's 2 served its ITL).
    learned = DecodeLearning(batch_cap=4.0, produced=300.0, finished=10.0)
    w = PodWindow(pod="d", seconds=3.0, requests=1.0, uncached_tokens=None, mean_running=2.0, mean_waiting=0.0,
                  running_change=0.0, waiting_growth=0.0, ttft=None,
                  itl=Histogram(((float("inf"), 60.0),), 60 * 0.05, 60.0), in_flight_now=2.0)
    prefill = Decision(role="prefill", current=2, desired=4, reason="",
                       numbers={"pod_tokens_per_s": 349.0, "uncached_tokens": 405.0})
    rate = prefill_handover(prefill)
    assert rate == pytest.approx(4 * 349 / 405)
    bounded = estimate_decode([w], target=0.08, learned=learned, current=2, prefilling=23.0, handover=rate)
    assert bounded.numbers["in_flight_now"] == pytest.approx(2 + rate * 2.4), bounded
    assert bounded.pods == pytest.approx((2 + rate * 2.4) / 4) and bounded.hold == bounded.pods, bounded
    assert bounded.urgent == 3 and "of the 23 in prefill" in bounded.reason, bounded
    whole = estimate_decode([w], target=0.08, learned=learned, current=2, prefilling=23.0)
    assert whole.pods == pytest.approx(25 / 4) and whole.numbers["in_flight_now"] == 25.0, whole
    # A queue prefill hands over within a sequence's time is counted whole, and so is one whose rate is unknown.
    assert handed_over(5.0, rate=3.45, lifetime=2.4) == 5.0
    assert handed_over(23.0, rate=None, lifetime=2.4) == 23.0
    assert prefill_handover(dataclasses.replace(prefill, numbers={})) is None
    # Prefill scaling in still finishes what its pods hold: the larger of the two counts.
    assert prefill_handover(dataclasses.replace(prefill, current=4, desired=3)) == pytest.approx(rate)


def test_a_decode_sequence_may_wait_for_a_slot_as_long_as_the_ttft_target_leaves_after_prefill() -> None:
    # One decode pod of at most 4 sequences (ITL = 0.02 + 0.012 x batch: 68 ms at 4), 64-token outputs: a slot
    # frees every 64 x 68 ms / 4 = 1.1 s. A Poisson burst puts a fifth sequence on it. With prefill's TTFT
    # p90 at 1.2 s of the 4 s target, that sequence may wait 2.8 s: it starts in time, no pod is added
    # (one was, for 27 s, in the step's last phase). With prefill already at the target, no wait is left.
    learned = DecodeLearning(points={1: (1.0, 0.032), 3: (3.0, 0.056)}, batch_cap=4.0, configured=4.0,
                             produced=640.0, finished=10.0)
    w = PodWindow(pod="d", seconds=6.0, requests=1.0, uncached_tokens=None, mean_running=4.0, mean_waiting=0.5,
                  running_change=0.0, waiting_growth=1.0, ttft=None,
                  itl=Histogram(((float("inf"), 350.0),), 350 * 0.068, 350.0), in_flight_now=5.0)
    room = estimate_decode([w], target=0.08, learned=learned, current=1, wait=4.0 - 1.2)
    assert room.urgent is None and room.numbers["backlog_pods"] == pytest.approx(5 / (4 * (1 + 2.8 / 4.352))), room
    none = estimate_decode([w], target=0.08, learned=learned, current=1, wait=0.0)
    assert none.urgent == 2 and none.numbers["backlog_pods"] == pytest.approx(5 / 4), none
    # The step's peak: 16 sequences (3 still in prefill) on 2 pods. A slot each asked for 4 pods; 2 s left of
    # the target after prefill, 16 / (4 x 1.46) = 2.7 ask for 3.
    peak = dataclasses.replace(w, in_flight_now=6.5)
    pods = [peak, dataclasses.replace(peak, pod="e")]
    est = estimate_decode(pods, target=0.08, learned=learned, current=2, prefilling=3.0, wait=2.0)
    assert est.numbers["backlog_pods"] == pytest.approx(16 / (4 * (1 + 2 / 4.352))), est
    assert est.urgent == 3, est
    assert estimate_decode(pods, target=0.08, learned=learned, current=2, prefilling=3.0).urgent == 4


# -- forecast, start-up time, policies, scale to zero -------------------------------------------------------------
def first_above(trail: list[tuple[float, int, str]], level: int) -> float:
    return next(t for t, r, _ in trail if r > level)


def test_the_forecast_extrapolates_a_ramp_and_a_steady_series_forecasts_its_level() -> None:
    from daybreak.operator.planner import Forecast

    ramp = Forecast()
    for i in range(12):
        ramp.observe(now=5.0 * i, value=1.0 + 0.1 * i)  # +0.02 per second
    assert ramp.level is not None and abs(ramp.level - 2.1) < 0.05
    ahead = ramp.predict(30.0)
    # Extrapolated (not the level), damped a little below the straight line (2.1 + 0.02 x 30).
    assert ahead is not None and 2.1 + 0.3 < ahead <= 2.1 + 0.02 * 30 + 0.05, ahead
    assert ramp.peak(30.0) == ahead
    steady = Forecast()
    for i in range(12):
        steady.observe(now=5.0 * i, value=3.0)
    assert steady.predict(120.0) == 3.0 and not steady.significant()
    # Noise around a level is rarely a trend (a run of six falling points can be): the forecast is the level
    # in at least nine intervals of ten, and the planner's windows and dead band absorb the rest (below).
    trended = total = 0
    for seed in range(1, 8):
        f = Forecast()
        for i, v in enumerate(noisy(3.0, 60, seed=seed, spread=0.15)):
            f.observe(now=5.0 * i, value=v)
            if i > 10:
                total += 1
                trended += f.predict(30.0) != f.level
    assert trended <= 0.1 * total, (trended, total)


def shortfall(trail: list[tuple[float, int, str]], rates: list[float]) -> int:
    """Pod-intervals below what the rate needs (the fluid prefill pod serves 1 req/s within the target)."""
    return sum(max(0, math.ceil(rate - 1e-9) - n) for (_, n, _), rate in zip(trail, rates, strict=True))


def test_a_ramp_is_met_earlier_by_the_predictive_policy_when_pods_take_time_to_start() -> None:
    # Prefill, pods take three intervals to start; the rate climbs steadily from 1 to 6 req/s.
    rates = [1.0] * 8 + [1.0 + 0.25 * i for i in range(25)] + [7.0] * 10
    runs = {p: drive("prefill", replicas=2, bounds=(1, 20), rates=rates, startup=3, policy=p,
                     t=targets(scale_down_stabilization_seconds=60.0)) for p in ("reactive", "predictive")}
    # Both double on the first backlog (2 -> 4); the pod after that comes earlier when sized ahead.
    assert first_above(runs["predictive"], 4) < first_above(runs["reactive"], 4), runs
    assert shortfall(runs["predictive"], rates) < shortfall(runs["reactive"], rates), runs
    assert any("forecast x" in why for _, _, why in runs["predictive"])
    # Sized ahead, not pushed to the bounds.
    assert max(r for _, r, _ in runs["predictive"]) < 12


def test_a_sinusoid_s_rising_edge_asks_early() -> None:
    period = 40  # intervals
    rates = [1.0] * 6 + [1.0 + 2.5 * (1 - math.cos(2 * math.pi * i / period)) for i in range(period)]
    for start in (1, 2):
        runs = {p: drive("prefill", replicas=start, bounds=(1, 20), rates=rates, startup=3, policy=p)
                for p in ("reactive", "predictive")}
        ahead, behind = shortfall(runs["predictive"], rates), shortfall(runs["reactive"], rates)
        # From one pod the reactive planner falls behind the edge; from two its backlog step keeps up too.
        assert ahead < behind if start == 1 else ahead <= behind, (start, ahead, behind, runs)
        assert first_above(runs["predictive"], 4) <= first_above(runs["reactive"], 4), runs


def test_a_backlog_lets_the_predictive_policy_trust_a_rising_trend_the_noise_test_would_not() -> None:
    from daybreak.operator.planner import Estimate, Forecast, PolicyContext, PredictivePolicy

    # A rising edge seen through noisy 1 s rates: Holt's trend rises, the 6-point test does not pass.
    f = Forecast()
    for i, v in enumerate([1.0, 1.3, 1.1, 1.6, 1.3, 1.8, 1.5, 2.0]):
        f.observe(now=float(i), value=v)
    assert f.trend > 0 and not f.significant()
    t = targets(interval_seconds=1.0, scale_up_stabilization_seconds=1.0)
    ctx = PolicyContext(role="prefill", now=7.0, current=2, targets=t, startup_seconds=1.0, forecast=f)
    calm = Estimate(2.2, "rates", {}, demand=2.0)
    assert PredictivePolicy().shape(calm, ctx).pods == 2.2  # no backlog: the noise test decides, no trend
    # The work held says two pods are short now (the backlog's step: 3): the trend counts, and the step asks
    # for the pods the forecast needs over the horizon, up to double the role.
    short = PredictivePolicy().shape(dataclasses.replace(calm, urgent=3), ctx)
    assert short.numbers["forecast_growth"] > 1.0 and short.pods > 2.2
    assert short.urgent == min(4, math.ceil(short.pods)) and short.urgent > 3, short


def test_a_steady_noisy_load_makes_no_change_under_the_predictive_policy_either() -> None:
    for role, rate, seed in (("prefill", 3.0, 1), ("prefill", 5.0, 2), ("decode", 10.0, 3)):
        trail = drive(role, replicas=2, bounds=(1, 20), rates=noisy(rate, 80, seed=seed, spread=0.15), startup=2,
                      policy="predictive")
        assert len(set(sizes_after(trail, 30))) == 1, (role, rate, [(t, r) for t, r, _ in trail])


def test_the_start_up_time_is_learned_from_decision_to_ready() -> None:
    from daybreak.operator.planner import DEFAULT_STARTUP_SECONDS, StartupLearning

    s = StartupLearning()
    s.observe(ready={"a": 0.0}, pods=["a"])  # there before the planner: not timed
    assert s.estimate() == DEFAULT_STARTUP_SECONDS
    s.asked(now=10.0, count=2)
    s.observe(ready={"a": 0.0, "b": 100.0}, pods=["a", "b", "c"])
    assert s.estimate() == 90.0
    s.observe(ready={"a": 0.0, "b": 100.0, "c": 112.0}, pods=["a", "b", "c"])
    assert s.estimate() == (90.0 + 102.0) / 2
    s.observe(ready={"a": 0.0, "c": 112.0}, pods=["a", "b", "c"])  # b not ready for a moment: no new start
    s.observe(ready={"a": 0.0, "b": 150.0, "c": 112.0}, pods=["a", "b", "c"])
    assert s.learned == 2
    # Pods nobody asked for are timed from their creation: those there before the planner, a rollout's.
    s = StartupLearning()
    s.observe(ready={"a": 50.0}, pods=["a", "b"], created={"a": 47.0, "b": 49.0})
    assert (s.estimate(), s.learned) == (3.0, 1)
    s.asked(now=60.0, count=1)
    s.observe(ready={"a": 50.0, "b": 55.0}, pods=["a", "b"], created={"a": 47.0, "b": 49.0})
    assert s.estimate() == (6.0 + 3.0) / 2 and list(s.asks) == [60.0]  # b, created before the ask, answers none
    s.observe(ready={"a": 50.0, "b": 55.0, "c": 65.0}, pods=["a", "b", "c"], created={"c": 61.0})
    assert not s.asks and s.estimate() == (5.0 + 4.5) / 2  # c answers the ask: decision to Ready
    # Through the planner: pods that start three intervals after the decision teach it about that.
    planner = RolePlanner("prefill")
    drive("prefill", replicas=1, bounds=(1, 20), rates=[1.0] * 6 + [4.0] * 12, startup=3, planner=planner)
    assert planner.startup.learned >= 1
    assert 2 * INTERVAL <= planner.startup.estimate() <= 4 * INTERVAL, planner.startup


def test_a_second_policy_plugs_in_without_touching_step() -> None:
    import dataclasses

    from daybreak.operator.planner import Estimate, PolicyContext

    class OneMore:
        name = "one-more"

        def shape(self, est: Estimate, ctx: PolicyContext) -> Estimate:
            if est.pods is None:
                return est
            return dataclasses.replace(est, pods=ctx.current + 1.0, hold=ctx.current + 1.0, reason="one more")

    planner = RolePlanner("prefill", policy=OneMore())
    trail = drive("prefill", replicas=2, bounds=(1, 6), rates=[3.0] * 20, planner=planner)
    assert trail[-1][1] == 6 and "one more" in trail[-1][2]
    assert policy_for("predictive").name == "predictive" and policy_for("reactive").name == "reactive"
    try:
        policy_for("psychic")
    except ValueError as exc:
        assert "autoscaling.policy" in str(exc) and "predictive" in str(exc)
    else:
        raise AssertionError("an unknown policy must be refused")


def test_both_roles_go_to_zero_after_the_down_window_prefill_first_and_come_back_on_a_held_request() -> None:
    t = targets(scale_down_stabilization_seconds=30.0)
    prefill, decode = FluidRole("prefill", 1), FluidRole("decode", 1)
    p_planner, d_planner = RolePlanner("prefill"), RolePlanner("decode")
    p_n = d_n = 1
    now = 0.0
    trail: list[tuple[float, int, int]] = []
    for i in range(40):
        rate = 1.0 if i < 6 else 0.0
        for fluid, n in ((prefill, p_n), (decode, d_n)):
            if n:
                fluid.advance(rate * (1 if fluid is prefill else 10), INTERVAL)
        now += INTERVAL
        p = p_planner.step(now=now, pods=list(prefill.pods), samples=prefill.samples(now), current=p_n,
                           bounds=(0, 4), targets=t, held=0.0)
        d = d_planner.step(now=now, pods=list(decode.pods), samples=decode.samples(now), current=d_n,
                           bounds=(0, 4), targets=t, held=0.0, prefill_left=len(prefill.pods))
        p_n, d_n = p.desired, d.desired
        prefill.resize(p_n)
        decode.resize(d_n)
        trail.append((now, p_n, d_n))
    idle_since = 6 * INTERVAL
    zero_p = next(at for at, p_n_, _ in trail if p_n_ == 0)
    zero_d = next(at for at, _, d_n_ in trail if d_n_ == 0)
    assert zero_p >= idle_since + 30.0, trail  # not before a whole down window without traffic
    assert zero_d > zero_p, trail  # decode after prefill has gone (its KV handed over)
    assert trail[-1][1:] == (0, 0)
    # At zero, the router holding a request starts both roles at once (no window: nobody serves it).
    now += INTERVAL
    p = p_planner.step(now=now, pods=[], samples={}, current=0, bounds=(0, 4), targets=t, held=2.0)
    d = d_planner.step(now=now, pods=[], samples={}, current=0, bounds=(0, 4), targets=t, held=2.0)
    assert (p.desired, d.desired) == (1, 1) and "scale from zero" in p.reason
    # Nothing held: they stay at zero.
    q = RolePlanner("prefill").step(now=now, pods=[], samples={}, current=0, bounds=(0, 4), targets=t, held=0.0)
    assert q.desired == 0


def test_without_the_router_s_held_signal_a_role_keeps_one_pod() -> None:
    t = targets(scale_down_stabilization_seconds=20.0)
    fluid = FluidRole("prefill", 1)
    planner = RolePlanner("prefill")
    n, now = 1, 0.0
    for _ in range(20):
        fluid.advance(0.0, INTERVAL)
        now += INTERVAL
        d = planner.step(now=now, pods=list(fluid.pods), samples=fluid.samples(now), current=n, bounds=(0, 4),
                         targets=t, held=None)
        n = d.desired
    assert n == 1 and "daybreak_router_held_requests" in d.reason


def test_the_router_s_held_gauge_and_pods_ready_times_are_read_for_the_planner() -> None:
    from daybreak.operator.autoscaler import created_at, ready_at
    from daybreak.operator.engine_metrics import RouterBacklog, parse_router_backlog

    text = ("# TYPE daybreak_router_held_requests gauge\n"
            "daybreak_router_held_requests{deployment=\"a\"} 2\n"
            "daybreak_router_held_requests{deployment=\"b\"} 1\n")
    assert parse_router_backlog(text) == RouterBacklog(held=3.0, decode_prefill=0.0)
    assert parse_router_backlog(text + "# TYPE daybreak_router_decode_prefill_requests gauge\n"
                                "daybreak_router_decode_prefill_requests 2\n") == RouterBacklog(3.0, 2.0)
    assert parse_router_backlog("# TYPE other gauge\nother 1\n") is None
    assert parse_router_backlog("not prometheus {{{") is None
    pods = [{"metadata": {"name": "p1"}, "status": {"conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-02T08:00:00Z"}]}},
            {"metadata": {"name": "p2"}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}},
            {"metadata": {"name": "p3"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]
    from datetime import datetime

    wall = datetime.fromisoformat("2026-12-02T08:00:30+00:00").timestamp()
    assert ready_at(pods, now_wall=wall, now=1000.0) == {"p1": 970.0, "p3": 1000.0}
    pods[0]["metadata"]["creationTimestamp"] = "2026-12-02T07:59:50Z"
    pods[1]["metadata"]["creationTimestamp"] = "2026-12-02T07:59:55Z"
    pods[1]["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 1}]  # its Ready is a restart's
    assert created_at(pods, now_wall=wall, now=1000.0) == {"p1": 960.0}


def test_what_the_planner_learned_fades_per_second_whatever_the_interval() -> None:
    # A learned prefill throughput fades while pods are busy (the engine may have changed), per second of
    # planning: at a 1 s interval the per-interval fade ran three times as fast as at 3 s, and prefill was
    # sized for a lower throughput than it had.
    from daybreak.operator.planner import PrefillLearning

    busy = PodWindow(pod="p", seconds=6.0, requests=1.0, uncached_tokens=60.0, mean_running=1.0, mean_waiting=0.0,
                     running_change=0.0, waiting_growth=0.0, ttft=None, itl=None)
    busy_no_prompt = dataclasses.replace(busy, uncached_tokens=0.0)  # running, nothing computed: only the fade
    fast, slow = PrefillLearning(), PrefillLearning()
    fast.observe([busy], seconds=1.0)
    slow.observe([busy], seconds=3.0)
    assert fast.tokens_per_second == slow.tokens_per_second == 10.0  # 60 tokens over 6 s
    for _ in range(30):
        fast.observe([busy_no_prompt], seconds=1.0)
    for _ in range(10):
        slow.observe([busy_no_prompt], seconds=3.0)
    assert fast.tokens_per_second is not None and slow.tokens_per_second is not None
    assert fast.tokens_per_second == pytest.approx(slow.tokens_per_second)
    assert fast.tokens_per_second == pytest.approx(10.0 * 0.98**10)


def test_a_predictive_role_is_held_back_only_by_the_demand_it_measured_not_by_its_forecast() -> None:
    # While pods asked for are starting, a rise within the tolerance of the demand they were asked at is no
    # reason for more. That demand is the measured one: judged on the forecast-shaped demand, a rise of 12%
    # (4.97 -> 5.57 req/s) waited for the pods asked for "at 7.12" (the forecast's growth changes with its
    # horizon, and the horizon with the learned start-up time).
    rates = [1.0] * 8 + [1.0 + 0.5 * i for i in range(12)]
    decisions: list[Decision] = []
    drive("prefill", replicas=2, bounds=(1, 40), rates=rates, startup=2, policy="predictive", decisions=decisions)
    waited, asked_at = [], None
    for d in decisions:
        measured = d.numbers.get("arrival_rate", 0.0)
        if "waiting for the pods asked for" in d.reason:
            waited.append((measured, asked_at))
        if d.desired > d.current:
            asked_at = measured
    replicas = decisions[-1].desired
    assert replicas > 2
    assert all(asked is not None and measured <= asked * 1.1 + 1e-9 for measured, asked in waited), waited


def test_requests_the_router_holds_for_prefill_room_are_prefill_s_backlog_and_demand() -> None:
    """With ``router.prefillConcurrency`` the pods' queues stay short and the excess waits in the router: the
    held count (and how fast it grows) must size prefill as the engines' own queue would have."""

    last: list[Decision] = []

    def run(held: list[float]) -> list[int]:
        t = targets()
        fluid = FluidRole("prefill", 2)
        planner = RolePlanner("prefill")
        sizes, now, replicas = [], 0.0, 2
        for upstream in [0.0] * 30 + held:
            fluid.advance(1.0, INTERVAL)  # the pods serve it: the engines see no more than that
            now += INTERVAL
            d = planner.step(now=now, pods=list(fluid.pods), samples=fluid.samples(now), current=replicas,
                             bounds=(1, 20), targets=t, upstream=upstream)
            replicas = d.desired
            fluid.resize(replicas)
            sizes.append(replicas)
        last.append(d)
        return sizes

    steady = run([0.0] * 4)
    assert len(set(steady[20:])) == 1, steady
    growing = run([10.0, 20.0, 30.0, 40.0])
    assert growing[:30] == steady[:30] and growing[-1] > steady[-1], (steady, growing)
    # The engines time a request from its arrival there: the router's wait (Little's law) is added to the p90.
    assert last[1].numbers["router_wait_s"] > 0
    assert last[1].numbers["ttft_p90_s"] > last[0].numbers["ttft_p90_s"] + last[1].numbers["router_wait_s"] / 2
