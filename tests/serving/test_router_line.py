"""Who in the router's line for prefill room goes first (``serving/router/line.py``): pure logic."""

from __future__ import annotations

import pytest

from daybreak.serving.router.line import PrefillTime, Waiting, next_in_line


def test_a_prompt_s_prefill_is_its_tokens_at_the_recent_steps_seconds_per_token() -> None:
    time = PrefillTime()
    assert time.estimate(500) == 0.0  # nothing timed yet: every request can still make it
    time.observe(1.0, 300)
    assert time.estimate(600) == pytest.approx(2.0) and time.estimate(30) == pytest.approx(0.1)
    time.observe(3.0, 900)  # the same 3.3 ms a token: the running means keep the rate
    assert time.estimate(300) == pytest.approx(1.0)
    cached = PrefillTime()
    cached.observe(0.05, 0)  # every step found its prompt in a cache: the mean step, whatever the length
    assert cached.estimate(1000) == pytest.approx(0.05)


def test_with_a_target_a_long_prompt_that_can_no_longer_make_it_lets_a_short_one_go_first() -> None:
    time = PrefillTime()
    time.observe(1.0, 300)  # 3.3 ms a token
    long_ = Waiting(started=0.0, tokens=900)  # 3 s of prefill
    short = Waiting(started=0.5, tokens=150)  # 0.5 s
    line = [long_, short]
    # At 0.8 s the long one still makes a 4 s target (0.8 + 3.0): arrival order.
    assert next_in_line(line, now=0.8, target=4.0, prefill=time) is long_
    # At 1.5 s it cannot (1.5 + 3.0); the short one can (1.0 + 0.5). A mean step (1.75 s here) would have
    # counted the long one in time and let it hold the pod past the target for both.
    assert next_in_line(line, now=1.5, target=4.0, prefill=time) is short
    # Neither can: the first in line, and without a target always the first in line.
    assert next_in_line(line, now=4.5, target=4.0, prefill=time) is long_
    assert next_in_line(line, now=1.5, target=None, prefill=time) is long_
    with pytest.raises(ValueError, match="empty"):
        next_in_line([], now=0.0, target=4.0, prefill=time)
