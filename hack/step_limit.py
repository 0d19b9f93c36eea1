"""How much of the step's missed TTFTs any planner must lose: the information limit of Poisson arrivals.

``python hack/step_limit.py`` (standard library only, about a minute) prints the three tables quoted in
docs/performance.md ("The step's information limit"):

1. The fastest a rise 0.3 -> 1.2 req/s can be seen: a Poisson CUSUM that knows both rates (Page, 1954; no
   detector sees a known change sooner at the same false-alarm rate, Moustakides, 1986), per threshold:
   the delay after the step, and how often a steady 0.3 req/s raises it falsely (each false alarm is a
   pod added and removed: two changes in a steady span).
2. The same CUSUM when it must learn the level it tests against (a 20 s mean of the counts while no rise is
   suspected), as a planner would: the false alarms the learned level adds.
3. What a lag costs: the bench's step peak (1.2 req/s for 40 s after 40 s at 0.3) on one prefill pod that
   takes S = 1.0 s a request (the planner's learned 322 tokens/s for 324 uncached tokens), one shared FIFO
   (the router's prefill room), a second pod serving ``lag`` seconds after the step: the requests whose
   TTFT passes the 4 s target (less 0.1 s for decode's first token). Decode and the hold are left out, so
   these are the fewest misses a lag can cost.
4. The same lag with the router's order of who takes a free slot (``router.roomOrder``, docs/serving.md):
   first come, first served (table 3's) against deadline (the first in line that can
   still make the target goes first, the first in line only when none can).
"""

from __future__ import annotations

import math
import random
import statistics

BASE, PEAK = 0.3, 1.2  # requests/s, the bench's step
SERVICE, TARGET = 1.0, 4.0 - 0.1  # seconds


def poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def cusum_alarm(rng: random.Random, rates: list[float], threshold: float, *, learn: bool) -> int | None:
    """The second (1 s interval) at which the CUSUM first alarms, None if it never does."""
    level: float | None = None if learn else BASE
    seen, score = 0.0, 0.0
    for t, lam in enumerate(rates, start=1):
        n = poisson(rng, lam)
        if level is None or (learn and seen < 20):  # the first level: a plain 20 s mean
            seen += 1
            level = ((level or 0.0) * (seen - 1) + n) / seen
            continue
        base = max(level, 0.05)
        rise = PEAK if not learn else 4.0 * base  # the rise it tests for
        step = n * math.log(rise / base) - (rise - base)
        score = max(0.0, score + step)
        if score == 0.0 and learn:
            level += (n - level) / 20.0
        if score >= threshold:
            return t
    return None


def detection_table(*, learn: bool, runs: int, steady_seconds: int, thresholds: tuple[float, ...]) -> None:
    rng = random.Random(7)
    print(f"{'threshold':>9}  {'delay mean':>10}  {'p50':>4}  {'p90':>4}  false alarms / 10 min at {BASE} req/s")
    for threshold in thresholds:
        delays = []
        for _ in range(runs):
            t = cusum_alarm(rng, [BASE] * 60 + [PEAK] * 60, threshold, learn=learn)
            if t is not None and t > 60:
                delays.append(t - 60)
        waits = []
        for _ in range(runs // 10):
            t = cusum_alarm(rng, [BASE] * steady_seconds, threshold, learn=learn)
            waits.append((t - (20 if learn else 0)) if t is not None else steady_seconds)
        alarms = 600.0 / statistics.mean(waits)
        delays.sort()
        print(f"{threshold:9.0f}  {statistics.mean(delays):9.1f}s  {delays[len(delays) // 2]:3d}s  "
              f"{delays[9 * len(delays) // 10]:3d}s  {alarms:.2f}")


def step_arrivals(rng: random.Random) -> list[float]:
    t, arrivals = 0.0, []
    while True:
        t += rng.expovariate(BASE if t < 40.0 else PEAK)
        if t >= 80.0:
            return arrivals
        arrivals.append(t)


def ordered_misses(arrivals: list[float], lag: float, *, deadline: bool = False) -> int:
    """The step's peak requests whose TTFT passes the target: one pod, a second free from ``40 + lag``, one
    line; at each free slot the order picks who starts (first come, first served unless ``deadline``)."""
    free = [0.0, 40.0 + lag]  # the second pod is free from when it serves
    line: list[float] = []
    i, missed = 0, 0
    while i < len(arrivals) or line:
        k = min(range(len(free)), key=free.__getitem__)
        now = free[k] if line else max(free[k], arrivals[i])
        while i < len(arrivals) and arrivals[i] <= now:
            line.append(arrivals[i])
            i += 1
        fresh = [a for a in line if now - a + SERVICE <= TARGET] if deadline else []
        a = fresh[0] if fresh else line[0]
        line.remove(a)
        free[k] = now + SERVICE
        missed += a >= 40.0 and now + SERVICE - a > TARGET
    return missed


def order_table(runs: int) -> None:
    rng = random.Random(5)
    print(f"{'lag':>4}  {'first come mean':>15}  {'p90':>4}  {'deadline mean':>13}  {'p90':>4}")
    for lag in (6, 8, 10, 12, 14):
        pairs = [(ordered_misses(a, lag, deadline=False), ordered_misses(a, lag, deadline=True))
                 for a in (step_arrivals(rng) for _ in range(runs))]
        fifo, edf = sorted(p[0] for p in pairs), sorted(p[1] for p in pairs)
        print(f"{lag:3d}s  {statistics.mean(fifo):15.1f}  {fifo[9 * runs // 10]:4d}  {statistics.mean(edf):13.1f}  "
              f"{edf[9 * runs // 10]:4d}")


def lag_table(runs: int) -> None:
    rng = random.Random(3)
    print(f"{'lag':>4}  {'misses mean':>11}  {'p90':>4}  (of ~48 peak requests; 95 in a run)")
    for lag in (0, 4, 6, 8, 10, 12, 14):
        found = sorted(ordered_misses(step_arrivals(rng), float(lag)) for _ in range(runs))
        print(f"{lag:3d}s  {statistics.mean(found):11.1f}  {found[9 * runs // 10]:4d}")


if __name__ == "__main__":
    print("1. CUSUM knowing both rates")
    detection_table(learn=False, runs=2000, steady_seconds=6000, thresholds=(3.0, 4.0, 5.0, 6.0, 7.0))
    print("\n2. CUSUM learning the level (20 s mean while quiet), testing for 4x it")
    detection_table(learn=True, runs=2000, steady_seconds=6000, thresholds=(5.0, 8.0, 11.0, 14.0, 17.0))
    print("\n3. TTFT misses in the step's peak by when the second prefill pod serves")
    lag_table(runs=4000)
    print("\n4. The same, by the router's order of who takes a free slot")
    order_table(runs=4000)
