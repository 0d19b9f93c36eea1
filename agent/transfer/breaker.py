"""The circuit breaker that trips a failing transfer path for a cool-down that doubles while it keeps failing.

A path is (transport, peer engine). ``threshold`` failures in a row trip it;
while tripped, selection skips it and requests take the next transport of
their chain. When the cool-down ends the path is half-open: the next request
tries it; success closes it (a recovery), failure trips it again for twice
the previous cool-down, up to ``max_cooldown_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from daybreak.agent.transfer import metrics

log = logging.getLogger(__name__)

PathKey = tuple[str, str]  # (transport, peer engine id)


@dataclass(slots=True)
class _PathState:
    failures: int = 0
    tripped: bool = False
    open_until: float = 0.0
    cooldown_s: float = 0.0
    trips: int = 0


class CircuitBreaker:
    def __init__(self, *, threshold: int = 3, base_cooldown_s: float = 1.0, max_cooldown_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1:
            raise ValueError(f"breaker threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self.base_cooldown_s = base_cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._paths: dict[PathKey, _PathState] = {}

    def allow(self, key: PathKey) -> bool:
        """False while the path's cool-down runs; True when closed or half-open."""
        state = self._paths.get(key)
        return state is None or not state.tripped or self._clock() >= state.open_until

    def cooldown_left(self, key: PathKey) -> float:
        state = self._paths.get(key)
        if state is None or not state.tripped:
            return 0.0
        return max(0.0, state.open_until - self._clock())

    def success(self, key: PathKey) -> None:
        state = self._paths.get(key)
        if state is None or (state.failures == 0 and not state.tripped):
            return
        with self._lock:
            recovered = state.tripped
            state.failures = 0
            state.tripped = False
            state.cooldown_s = 0.0
        if recovered:
            metrics.PATH_RECOVERIES.labels(key[0]).inc()
            metrics.PATHS_OPEN.labels(key[0]).dec()
            log.info("transfer path recovered transport=%s peer=%s trips=%d", key[0], key[1], state.trips)

    def failure(self, key: PathKey, cause: str = "") -> None:
        with self._lock:
            state = self._paths.setdefault(key, _PathState())
            state.failures += 1
            if state.tripped:
                if self._clock() < state.open_until:
                    return  # a straggler from before the trip: the cool-down already covers it
                # half-open trial failed: trip again for twice as long
                state.cooldown_s = min(self.max_cooldown_s, state.cooldown_s * 2)
                newly = False
            elif state.failures >= self.threshold:
                state.tripped = True
                state.cooldown_s = self.base_cooldown_s
                newly = True
            else:
                return
            state.open_until = self._clock() + state.cooldown_s
            state.trips += 1
            cooldown = state.cooldown_s
        metrics.PATH_TRIPS.labels(key[0]).inc()
        if newly:
            metrics.PATHS_OPEN.labels(key[0]).inc()
        log.warning("transfer path tripped transport=%s peer=%s cooldown_s=%.1f failures=%d cause=%r",
                    key[0], key[1], cooldown, state.failures, cause)

    def snapshot(self) -> dict[PathKey, tuple[bool, float]]:
        """(tripped, seconds left) per known path, for status pages and tests."""
        return {k: (s.tripped, self.cooldown_left(k)) for k, s in self._paths.items()}
