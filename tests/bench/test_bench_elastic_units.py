"""The pure parts of `daybreak bench elastic`: SLO share, pod-second integration, reaction time, sizing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from daybreak.bench.elastic import model_replicas, pod_seconds, ratios, reaction, slo_share
from daybreak.serving.load.summary import RequestRecord
from daybreak.serving.load.trace import TRACES_DIR


def rec(*, ok: bool = True, ttft: float | None = 1.0, itl: list[float] | None = None) -> RequestRecord:
    return RequestRecord(sent_at=0.0, ok=ok, ttft_s=ttft, itl_s=[0.02, 0.02] if itl is None else itl)


def test_slo_share_counts_each_target_and_both_and_a_failed_request_meets_neither() -> None:
    records = [
        rec(),                              # both
        rec(ttft=5.0),                      # ITL only
        rec(itl=[0.01, 0.09]),              # mean gap 0.05 > 0.045: TTFT only
        rec(itl=[]),                        # one token: no gap, ITL met
        rec(ok=False, ttft=None, itl=[]),   # failed: neither
    ]
    share = slo_share(records, ttft=4.0, itl=0.045)
    assert share == {"ttft": 3 / 5, "itl": 3 / 5, "both": 2 / 5}
    assert slo_share([], ttft=4.0, itl=0.045) == {"ttft": None, "itl": None, "both": None}


def test_pod_seconds_holds_each_sample_until_the_next_and_clips_to_the_span() -> None:
    samples = [(0.0, 2), (10.0, 4), (20.0, 3)]
    assert pod_seconds(samples, start=0.0, end=30.0) == pytest.approx(2 * 10 + 4 * 10 + 3 * 10)
    # Clipped: starts mid-way through the 4-pod stretch, ends before the last sample.
    assert pod_seconds(samples, start=15.0, end=18.0) == pytest.approx(4 * 3)
    # Before the first sample the first count holds; unsorted input is fine.
    assert pod_seconds([(5.0, 3), (2.0, 1)], start=0.0, end=6.0) == pytest.approx(1 * 5 + 3 * 1)
    assert pod_seconds(samples, start=5.0, end=5.0) == 0.0
    assert pod_seconds([], start=0.0, end=5.0) == 0.0


def test_reaction_is_the_step_to_the_first_sample_with_more_ready_pods() -> None:
    samples = [(0.0, 1), (9.0, 1), (11.0, 1), (17.5, 2), (30.0, 3)]
    assert reaction(samples, step=10.0) == pytest.approx(7.5)
    assert reaction([(0.0, 2), (20.0, 2)], step=10.0) is None


def test_fixed_sizing_comes_from_the_cost_model_and_the_planners_formulas() -> None:
    # 320 uncached tokens x 3 ms = 0.96 s of prefill; ITL = 20 ms + 12 ms x batch would allow batch 5 within
    # 80 ms, but the pods hold at most MAX_BATCH = 4 sequences: that bound is the batch sized for.
    assert model_replicas(0.3, ttft=4.0, itl=0.08) == (1, 1)  # the base rate
    assert model_replicas(1.2, ttft=4.0, itl=0.08) == (2, 2)  # 4x: 1.2 x 0.96 / 0.76 = 1.5; 76.8 x 0.08 / 4 = 1.5
    assert model_replicas(2.4, ttft=4.0, itl=0.08) == (4, 4)  # 153.6 x 0.08 / 4 = 3.1 (batch 5 would give 3)
    assert model_replicas(0.001, ttft=4.0, itl=0.08) == (1, 1)  # never below one


def test_ratios_and_the_target() -> None:
    def result(both: float, pods: float, failed: int = 0) -> dict[str, object]:
        return {"slo": {"both": both}, "pod_seconds": pods, "failed_requests": failed}

    out = ratios({"planner": result(0.95, 250), "fixed-peak": result(0.95, 400), "fixed-avg": result(0.5, 200)})
    assert out["planner_vs_fixed-peak"] == {"slo_both": pytest.approx(1.0), "pod_seconds": pytest.approx(0.625)}
    assert out["planner_vs_fixed-avg"]["pod_seconds"] == pytest.approx(1.25)
    assert out["target_met"] is True
    assert ratios({"planner": result(0.95, 310), "fixed-peak": result(0.95, 400)})["target_met"] is False
    # The sinusoid's and the trace's bound is 0.60x; under 95% within both is never met; nor a steady change.
    assert ratios({"planner": result(0.95, 250), "fixed-peak": result(0.95, 400)},
                  pod_seconds_target=0.6)["target_met"] is False
    assert ratios({"planner": result(0.94, 200), "fixed-peak": result(0.94, 400)})["target_met"] is False
    assert ratios({"planner": result(0.96, 200), "fixed-peak": result(1.0, 400)})["target_met"] is False  # -4 pts
    assert ratios({"planner": result(0.97, 200), "fixed-peak": result(1.0, 400)})["target_met"] is True  # -3 pts
    assert ratios({"planner": {**result(0.97, 200), "steady_changes": 1},
                   "fixed-peak": result(1.0, 400)})["target_met"] is False
    assert ratios({"planner": result(0.95, 250, failed=1), "fixed-peak": result(0.95, 400)})["target_met"] is False


AZURE = TRACES_DIR / "azure_llm_code_2023.csv"  # in the repository (traces/README.md)


def _args(**overrides: object) -> argparse.Namespace:
    from daybreak.bench.elastic import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args([])
    for key, value in overrides.items():
        setattr(ns, key, value)
    return ns


def _azure_rows(tmp_path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path = tmp_path / "azure.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for at, prompt, output in rows:
        whole = int(at)
        lines.append(f"2023-11-16 18:{17 + whole // 60:02d}:{whole % 60:02d}.{round((at - whole) * 1e7):07d},"
                     f"{prompt},{output}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_s_tokens_are_fitted_so_its_busiest_30s_needs_at_most_four_pods_per_role(tmp_path: Path) -> None:
    from daybreak.bench.elastic import MAX_PODS, fit_token_scale, model_pods, trace_stats, trace_workload

    # 2 req/s for the first minute, then a burst of 8 req/s for 30 s, long prompts and outputs.
    rows = [(i * 0.5, 6000, 300) for i in range(120)] + [(60 + i / 8, 6000, 300) for i in range(240)]
    path = _azure_rows(tmp_path, rows)
    stats = trace_stats(path, sample=1, time_scale=1.0)
    assert stats.requests == 360 and stats.mean_input == 6000
    assert 5.0 <= stats.busiest_minute_rate <= 8.1 and stats.busiest_30s_rate >= 7.9
    prompt, output = fit_token_scale(stats, ttft=4.0, itl=0.08)
    assert 0 < prompt < 1 and 0 < output <= 1
    workload = trace_workload(stats, factor=prompt, output_factor=output)
    p, d = model_pods(stats.busiest_30s_rate, ttft=4.0, itl=0.08, **workload)
    assert p <= MAX_PODS + 1e-6 and d <= MAX_PODS + 1e-6  # fixed-peak's window fits the bounds
    assert p > MAX_PODS - 0.5  # the largest factor that fits, not just any
    minute = model_pods(stats.busiest_minute_rate, ttft=4.0, itl=0.08, **workload)
    assert max(minute) <= MAX_PODS + 1e-6
    # --sample 4 divides the rate by four: the tokens need less scaling down.
    sampled = trace_stats(path, sample=4, time_scale=1.0)
    assert sampled.requests == 90
    assert fit_token_scale(sampled, ttft=4.0, itl=0.08)[0] > prompt
    # --time-scale 0.5 replays twice as fast: twice the rate, more scaling down.
    faster = trace_stats(path, sample=1, time_scale=0.5)
    assert faster.busiest_30s_rate > stats.busiest_30s_rate
    assert fit_token_scale(faster, ttft=4.0, itl=0.08)[0] < prompt


def test_the_bench_sizes_fixed_configurations_from_the_trace_and_builds_the_load(tmp_path: Path) -> None:
    from daybreak.bench.elastic import MAX_PODS, load_argv, sizing

    rows = [(i * 0.5, 3000, 50) for i in range(240)]
    path = _azure_rows(tmp_path, rows)
    sized = sizing(_args(trace=path, sample=2, time_scale=0.5))
    assert sized["mean_rate"] == pytest.approx(2.0, rel=0.05)
    for key in ("fixed_peak_replicas", "fixed_avg_replicas"):
        assert all(1 <= n <= MAX_PODS for n in sized[key])
    argv = load_argv(_args(trace=path, sample=2, time_scale=0.5, trace_seconds=None),
                     token_scale=sized["token_scale"])
    assert argv[:6] == ["--trace", str(path), "--sample", "2", "--time-scale", "0.5"]
    assert "--token-scale" in argv and "--output-scale" in argv


def test_shapes_give_the_load_its_rate_spec_and_the_fixed_sizings_their_mean_and_peak() -> None:
    from daybreak.bench.elastic import load_argv, shape_rates

    step = _args()
    mean, peak = shape_rates(step)
    assert peak == pytest.approx(1.2) and mean == pytest.approx(0.3 * (40 + 160 + 80) / 160)
    assert "--rate-steps" in load_argv(step, token_scale=(1.0, 1.0))
    sine = _args(shape="sine", period_seconds=80.0)
    mean, peak = shape_rates(sine)
    assert mean == pytest.approx(0.75, rel=0.01) and peak == pytest.approx(1.2)  # 2 whole periods of 0.3..1.2
    argv = load_argv(sine, token_scale=(1.0, 1.0))
    assert argv[argv.index("--rate-shape") + 1] == "sine:1x:4x:80s"
    ramp = load_argv(_args(shape="ramp"), token_scale=(1.0, 1.0))
    assert ramp[ramp.index("--rate-shape") + 1] == "ramp:1x:4x:80s"


def test_start_up_delays_reach_the_engines_and_each_gets_its_own_comparison() -> None:
    from daybreak.bench.elastic import pdd_manifest, run_revision, startup_values

    assert startup_values("1,30,120") == [1.0, 30.0, 120.0]
    with pytest.raises(SystemExit, match="--startup-seconds"):
        startup_values("soon")
    args = pdd_manifest("x", replicas=(1, 1), autoscaling={}, startup_seconds=30.0)["spec"]["engine"]["args"]
    assert args[-2:] == ["--startup-seconds", "30"]
    assert "--startup-seconds" not in pdd_manifest("x", replicas=(1, 1), autoscaling={})["spec"]["engine"]["args"]
    # The router's prefill bound is the same for every configuration, and a valid spec.
    from daybreak.api.pddeployment import PDDeployment as Pdd

    bounded = Pdd.model_validate(pdd_manifest("x", replicas=(1, 1), autoscaling={}, prefill_concurrency=2))
    assert bounded.spec.router.prefill_concurrency == 2 and bounded.spec.router.room_order == "arrival"
    ordered = Pdd.model_validate(pdd_manifest("x", replicas=(1, 1), autoscaling={}, prefill_concurrency=1,
                                              room_order="deadline"))
    assert ordered.spec.router.room_order == "deadline"
    # Every run its own KV namespace (the revision is part of it): no run reads what an earlier one wrote.
    from daybreak.api.pddeployment import PDDeployment

    runs = [(name, startup, seed) for name in ("el-planner", "el-predictive", "el-fixed-peak")
            for startup in (1.0, 30.0) for seed in (7, 8)]
    spaces = {PDDeployment.model_validate(pdd_manifest(name, replicas=(1, 1), autoscaling={},
                                                       revision=run_revision(name, startup, seed))).spec.kv_namespace()
              for name, startup, seed in runs}
    assert len(spaces) == len(runs)

    def result(both: float, pods: float) -> dict[str, object]:
        return {"slo": {"both": both}, "pod_seconds": pods, "failed_requests": 0}

    out = ratios({"planner@1s": result(0.95, 50), "predictive@1s": result(0.95, 60), "fixed-peak@1s": result(0.95, 100),
                  "planner@120s": result(0.5, 50), "fixed-peak@120s": result(0.9, 100)})
    assert out["target_met@1s"] is True and out["predictive_target_met@1s"] is True  # 0.5x and 0.6x
    assert out["target_met@120s"] is False
    assert out["predictive_vs_fixed-peak@1s"]["pod_seconds"] == pytest.approx(0.6)


def test_the_azure_trace_fits_with_sampling() -> None:
    from daybreak.bench.elastic import fit_token_scale, trace_stats

    stats = trace_stats(AZURE, sample=10, time_scale=0.1)
    assert stats.requests == 882
    prompt, output = fit_token_scale(stats, ttft=4.0, itl=0.08)
    assert 0.05 < prompt < 0.5 and output == 1.0


def test_steady_changes_count_pod_changes_only_inside_the_steps_settled_phases() -> None:
    from daybreak.bench.elastic import steady_changes, steady_windows

    args = argparse.Namespace(trace=None, shape="step", base_seconds=40.0, peak_seconds=40.0, after_seconds=80.0,
                              down_window=20.0, interval=3.0)
    windows = steady_windows(args)
    assert windows == [(0.0, 40.0), (106.0, 160.0)]
    timeline = [[0.0, 1, 1], [20.0, 2, 1], [41.0, 3, 3], [90.0, 1, 1], [110.0, 1, 1], [120.0, 2, 1]]
    # 20 s (base phase) and 120 s (settled last phase) count; the step's own changes at 41 s and 90 s do not.
    assert steady_changes(timeline, windows) == 2
    assert steady_windows(argparse.Namespace(**{**vars(args), "shape": "sine"})) == []


def test_the_oracle_holds_each_role_s_pods_the_down_window_after_the_last_moment_they_were_needed() -> None:
    from daybreak.bench.elastic import oracle_pod_seconds

    # The bench's step, 0.3 -> 1.2 -> 0.3 req/s over 40 / 40 / 80 s: 1 + 1 pods, 2 + 2 in the peak.
    def step(t: float) -> float:
        return 1.2 if 40 <= t < 80 else 0.3

    def replicas(rate: float) -> tuple[int, int]:
        return (1, 1) if rate < 1 else (2, 2)

    assert oracle_pod_seconds(step, span=160, hold=0, replicas=replicas) == pytest.approx(2 * 160 + 2 * 40)
    # The two peak pods stay 20 s more: 440 of fixed-peak's 640 (0.69x, against the step's 0.75x target).
    assert oracle_pod_seconds(step, span=160, hold=20, replicas=replicas) == pytest.approx(2 * 160 + 2 * 60)
    # Per role: a prefill pod needed early and a decode pod needed late are not one pod held across both.
    assert oracle_pod_seconds(lambda t: t, span=10, hold=100, step=1.0,
                              replicas=lambda r: (2, 1) if r < 5 else (1, 2)) == pytest.approx(10 * 3 + 5)


def test_the_bench_reports_an_oracle_floor_below_fixed_peak_for_shapes_and_traces(tmp_path: Path) -> None:
    from daybreak.bench.elastic import TARGET_POD_SECONDS, sizing

    sine = sizing(_args(shape="sine", base_rate=0.1, peak_factor=24, period_seconds=80, base_seconds=40,
                        peak_seconds=40, after_seconds=80, down_window=20.0))
    peak = sum(sine["fixed_peak_replicas"]) * 160
    # The model's pods for the sinusoid, held the 20 s window: 910 pod-s, 0.71x fixed-peak's 4 + 4, above the
    # 0.60x target; with no window 680 (0.53x). The target asks for a shorter window, not a better planner.
    assert sine["oracle_pod_seconds_no_hold"] < sine["oracle_pod_seconds"] < peak
    assert sine["oracle_pod_seconds"] / peak > TARGET_POD_SECONDS["sine"] > sine["oracle_pod_seconds_no_hold"] / peak
    rows = [(i * 0.5, 3000, 50) for i in range(120)] + [(60 + i / 8, 3000, 50) for i in range(240)]
    trace = sizing(_args(trace=_azure_rows(tmp_path, rows), sample=1, time_scale=1.0, trace_seconds=None,
                         down_window=20.0))
    assert trace["oracle_pod_seconds_no_hold"] < trace["oracle_pod_seconds"]
    assert trace["oracle_pod_seconds"] < sum(trace["fixed_peak_replicas"]) * 90


def test_repeated_seeds_pool_into_one_row_and_keep_each_run() -> None:
    """``--seeds 7,8``: each configuration runs once per seed; its row's shares are over all the runs'
    requests, its pod-seconds their mean, and each run stays in the JSON with the spread."""
    from daybreak.bench.elastic import load_argv, pooled, seed_values

    assert seed_values("7, 8,9") == [7, 8, 9]
    for bad in ("7,7", "-1", "x", ""):
        with pytest.raises(SystemExit, match="--seeds"):
            seed_values(bad)
    argv = load_argv(_args(shape="sine"), token_scale=(1.0, 1.0), seed=8)
    assert argv[argv.index("--seed") + 1] == "8"

    def run(seed: int, requests: int, both: float, pods: float, steady: int | None) -> dict[str, Any]:
        return {"config": "planner", "startup_seconds": 1.0, "seed": seed, "replicas_at_start": [1, 1],
                "requests": requests, "failed_requests": 1 if seed == 8 else 0,
                "slo": {"ttft": both, "itl": 1.0, "both": both}, "pod_seconds": pods, "span_s": 160.0,
                "peak_ready": {"prefill": 3 if seed == 7 else 4, "decode": 2},
                "reaction_s": {"prefill": 4.0 if seed == 7 else None, "decode": 6.0},
                "scale_events": 5, "steady_changes": steady}

    one = run(7, 100, 0.9, 500.0, 1)
    assert pooled([one]) is one  # one seed: the row is the run, as before
    row = pooled([one, run(8, 300, 0.98, 700.0, 2)])
    assert row["requests"] == 400 and row["failed_requests"] == 1 and row["seeds"] == [7, 8]
    assert row["slo"]["both"] == pytest.approx((0.9 * 100 + 0.98 * 300) / 400)  # over all requests
    assert row["pod_seconds"] == 600.0 and row["spread"] == {"both": [0.9, 0.98], "pod_seconds": [500.0, 700.0]}
    assert row["peak_ready"] == {"prefill": 4, "decode": 2} and row["reaction_s"] == {"prefill": 4.0, "decode": 6.0}
    assert row["scale_events"] == 10 and row["steady_changes"] == 3 and len(row["runs"]) == 2
    assert pooled([one, run(8, 300, 0.98, 700.0, None)])["steady_changes"] is None  # a shape with no steady span
