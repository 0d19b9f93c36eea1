"""How many of the Azure trace's TTFTs a planner that reacts must lose: the trace's burst against a lag.

``.venv/bin/python hack/trace_limit.py`` (no cluster, about 15 s) prints the table quoted in docs/performance.md
(2026-12-08, sixth session) and docs/serving.md ("Who goes first"). It replays the bench's own sample of the trace (the first 160 s of every
5th request, times x 0.5, prompts scaled by the bench's fitted factor: ``daybreak bench elastic --trace
traces/azure_llm_code_2023.csv --sample 5 --time-scale 0.5 --trace-seconds 160``) through a model of the
prefill side only:

- each request's prefill takes the sim engine's cost model time for its prompt (the bench's engine args);
- one line in the router (``router.prefillConcurrency: 1``), a free pod takes the first request in it that can
  still meet the target (``router.roomOrder: deadline``), the first in line when none can. Whether a request
  can is judged as the router judges it: its wait plus a prefill estimated from the steps timed so far (running
  means, weight 0.2), either one mean step for every request (``mean step``: the router until 2026-12-08) or
  the request's own prompt tokens at the mean seconds per token (``own prefill``: ``serving/router/line.py``);
- TTFT = wait + prefill; a miss is over the 4 s target less ``--first-token-seconds`` (0.1) for the hand-over
  and decode's first token.

Pod counts compared:

- ``fixed 4``: fixed-peak's four prefill pods throughout;
- ``ideal, lag L``: a planner that sees the router's line at every instant with no noise and asks for the
  pods that start the next request within the target (the backlog rule, ``planner.estimate_prefill``), 1..4;
  the pods it adds serve ``L`` seconds after it asks, the pods it no longer needs go after the 20 s down
  window. L = 0 is a planner whose pods are there the moment work waits; the measured runs' L is the time
  from a burst's first queued request to the new pods serving (two scrapes, the start, the router's watch).

Decode and the rates' noise are left out, so these are the fewest misses a lag can cost on this trace.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from daybreak.bench.elastic import (
    ENGINE_ARGS,
    MAX_PODS,
    fit_token_scale,
    stats_of,
    trace_points,
)
from daybreak.serving.router.line import PrefillTime, Waiting, next_in_line
from daybreak.serving.sim.costmodel import CostModel

TRACE = Path(__file__).resolve().parent.parent / "traces" / "azure_llm_code_2023.csv"
TTFT, ITL = 4.0, 0.08
FIRST_TOKEN = 0.1  # seconds from a prefill's end to decode's first token (default of --first-token-seconds)
DOWN_WINDOW = 20.0
DT = 0.01  # seconds per simulation step


def engine_cost() -> CostModel:
    """The sim engine's cost model with the bench's engine arguments."""
    args = dict(zip(ENGINE_ARGS[0::2], ENGINE_ARGS[1::2], strict=False))
    return CostModel(time_scale=float(args["--time-scale"]),
                     prefill_per_token_seconds=float(args["--prefill-per-token-seconds"]))


def requests(*, sample: int, time_scale: float, seconds: float) -> list[tuple[float, int, float]]:
    """(sent at, prompt tokens, prefill seconds) of the bench's replay of the trace."""
    points = trace_points(TRACE, sample=sample, time_scale=time_scale, seconds=seconds)
    factor, _ = fit_token_scale(stats_of(points), ttft=TTFT, itl=ITL)
    cost = engine_cost()
    step = cost.step_base_seconds * cost.time_scale
    out = []
    for at, prompt, _ in points:
        tokens = max(1, round(prompt * factor))
        out.append((at, tokens, cost.prefill_seconds(tokens) + step))
    return out


def replay(reqs: list[tuple[float, int, float]], *, lag: float | None, target: float,
           own: bool) -> tuple[list[tuple[float, float]], float]:
    """[(sent at, TTFT)] and prefill pod-seconds: four pods throughout when ``lag`` is None, else the ideal
    planner whose added pods serve ``lag`` seconds after it asks. ``own``: the line's order estimates each
    request's prefill from its tokens, else one mean step for all."""
    mean_service = sum(s for _, _, s in reqs) / len(reqs)
    # The router's own order and running means; a step timed as computing no tokens makes every estimate the
    # mean step (``PrefillTime.estimate``), the order before 2026-12-08.
    timed = PrefillTime()
    end = reqs[-1][0] + 60.0
    pods = MAX_PODS if lag is None else 1
    busy: list[float] = [0.0] * MAX_PODS  # when each pod slot is free; only the first ``pods`` serve
    coming: list[float] = []  # when asked-for pods serve
    wanted_at: list[tuple[float, int]] = []  # (when, pods the line asked for), for the down window
    line: list[Waiting] = []
    index: dict[Waiting, int] = {}
    ttft: list[tuple[float, float]] = []
    i, t, pod_seconds = 0, 0.0, 0.0
    while t < end and (i < len(reqs) or line or any(b > t for b in busy)):
        while i < len(reqs) and reqs[i][0] <= t:
            line.append(Waiting(reqs[i][0], reqs[i][1]))
            index[line[-1]] = i
            i += 1
        if lag is not None:
            while coming and coming[0] <= t:
                coming.pop(0)
                pods += 1
            # The backlog rule: the work held (waiting and the rest of what is running) must leave the next
            # request time to start within the target.
            held = sum(reqs[index[w]][2] for w in line) + sum(max(0.0, b - t) for b in busy[:pods])
            need = max(1, min(MAX_PODS, math.ceil(held / (target - mean_service) - 1e-9)))
            wanted_at.append((t, need))
            while wanted_at and wanted_at[0][0] < t - DOWN_WINDOW:
                wanted_at.pop(0)
            if need > pods + len(coming):
                coming.extend([t + lag] * (need - pods - len(coming)))
            highest = max(n for _, n in wanted_at)
            if not coming and highest < pods and all(b <= t for b in busy[highest:pods]):
                pods = highest  # the idle pods past what the window wanted go
        for k in range(pods):
            if busy[k] <= t and line:
                first = next_in_line(line, now=t, target=TTFT, prefill=timed)
                line.remove(first)
                at, tokens, seconds = reqs[index.pop(first)]
                busy[k] = t + seconds
                ttft.append((at, busy[k] - at))
                # Timed when it ends in the router; counted here when it starts (the model's one shortcut).
                timed.observe(seconds, tokens if own else 0)
        pod_seconds += pods * DT
        t += DT
    return sorted(ttft), pod_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=5)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--trace-seconds", type=float, default=160.0)
    parser.add_argument("--first-token-seconds", type=float, default=FIRST_TOKEN,
                        help="from a prefill's end to the first token: taken off the TTFT target")
    a = parser.parse_args()
    target = TTFT - a.first_token_seconds
    reqs = requests(sample=a.sample, time_scale=a.time_scale, seconds=a.trace_seconds)
    services = [s for _, _, s in reqs]
    print(f"{len(reqs)} requests, prefill {min(services):.2f}-{max(services):.2f} s "
          f"(mean {sum(services) / len(services):.2f} s), TTFT target {TTFT:g} s "
          f"(misses: over {target:g} s of prefill line)")
    print(f"{'':>16}  {'mean step':^28}  {'own prefill':^28}".rstrip())
    print((f"{'prefill pods':>16}  " + f"{'misses':>6}  {'within':>6}  {'95-105 s':>8}  {'pod-s':>5}  " * 2).rstrip())
    for lag in (None, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        row = f"{'fixed 4' if lag is None else f'ideal, lag {lag:g} s':>16}  "
        for own in (False, True):
            ttft, pod_seconds = replay(reqs, lag=lag, target=target, own=own)
            missed = [at for at, took in ttft if took > target]
            burst = sum(1 for at in missed if 95.0 <= at < 105.0)
            row += f"{len(missed):6d}  {1 - len(missed) / len(reqs):6.1%}  {burst:8d}  {pod_seconds:5.0f}  "
        print(row.rstrip())


if __name__ == "__main__":
    main()
