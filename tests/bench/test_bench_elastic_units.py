"""The pure parts of `daybreak bench elastic`: SLO share, pod-second integration, reaction time, sizing."""

from __future__ import annotations

import pytest

from daybreak.bench.elastic import model_replicas, pod_seconds, ratios, reaction, slo_share
from daybreak.serving.load.summary import RequestRecord


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
    assert ratios({"planner": result(0.95, 300), "fixed-peak": result(0.95, 400)})["target_met"] is False
    assert ratios({"planner": result(0.95, 250, failed=1), "fixed-peak": result(0.95, 400)})["target_met"] is False
