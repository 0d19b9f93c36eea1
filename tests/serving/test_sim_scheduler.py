"""The sim engine's scheduler (pure step planning, then the loop on a fake clock) and its local cache."""

from __future__ import annotations

import asyncio

import pytest

from daybreak.serving.prompt import block_content, block_keys
from daybreak.serving.sim.costmodel import CostModel
from daybreak.serving.sim.engine import Engine, EngineConfig, Role, SeqState, apply_step, plan_step, step_cost
from daybreak.serving.sim.kv import LocalCache, fill_block


def seq(rid: int, *, prompt: int, cached: int = 0, max_tokens: int = 4) -> SeqState:
    return SeqState(rid=rid, prompt_tokens=prompt, cached_tokens=cached, max_tokens=max_tokens)


def test_decode_rows_come_first_and_prefill_gets_the_budget_left_in_arrival_order() -> None:
    decoding = seq(1, prompt=10)
    decoding.computed, decoding.generated = 10, 1
    long, short = seq(2, prompt=5000), seq(3, prompt=100)
    plan = plan_step([decoding, long, short], token_budget=2048)
    assert plan.decode == [decoding]
    assert [(s.rid, n) for s, n in plan.chunks] == [(2, 2047)]  # one budget token went to the decode row
    apply_step(plan)
    assert decoding.generated == 2 and long.computed == 2047 and long.prefilling
    plan = plan_step([decoding, long, short], token_budget=2048)
    assert [(s.rid, n) for s, n in plan.chunks] == [(2, 2047)]
    apply_step(plan)
    plan = plan_step([decoding, long, short], token_budget=2048)
    assert [(s.rid, n) for s, n in plan.chunks] == [(2, 906), (3, 100)]  # the rest, then the next prompt


def test_the_step_that_finishes_a_prompt_samples_its_first_token() -> None:
    s = seq(1, prompt=300, cached=256, max_tokens=1)
    plan = plan_step([s], token_budget=2048)
    assert [(x.rid, n) for x, n in plan.chunks] == [(1, 44)]  # only what the cache lacks is computed
    called = []
    s.on_prefilled = lambda: called.append(True)
    assert apply_step(plan) == [s]
    assert called == [True] and s.generated == 1 and s.finished
    assert plan_step([s], token_budget=2048).empty


def test_step_cost_charges_context_of_decode_rows_and_prefill_chunks() -> None:
    model = CostModel()
    a = seq(1, prompt=1000, cached=992)
    a.computed, a.generated = 8, 3
    b = seq(2, prompt=4000, cached=1600)
    plan = plan_step([a, b], token_budget=512)
    cost = step_cost(plan, model)
    expected = model.step_seconds(decode_batch=1, decode_context_tokens=1003, chunks=[])
    expected += model.prefill_seconds(511, context=1600)
    assert cost == pytest.approx(expected)


def test_local_cache_is_an_lru_of_prefixes() -> None:
    cache = LocalCache(3)
    cache.insert(["a", "b", "c"])
    assert cache.prefix(["a", "b", "x"]) == 2  # touches a and b: c is now least recently used
    cache.insert(["d"])
    assert cache.prefix(["c"]) == 0 and cache.prefix(["a", "b", "d"]) == 3
    assert cache.prefix(["b"], touch=False) == 1
    empty = LocalCache(0)
    empty.insert(["a"])
    assert len(empty) == 0
    with pytest.raises(ValueError, match="capacity"):
        LocalCache(-1)


@pytest.mark.parametrize("size", [1, 63, 64, 65, 4096, 100_000])
def test_fill_block_writes_exactly_the_contract_bytes(size: int) -> None:
    buffer = bytearray(size)
    fill_block(buffer, namespace="ns", key="k1")
    assert bytes(buffer) == block_content("ns", "k1", size)
    fill_block(buffer, namespace="other", key="k1")
    assert bytes(buffer) != block_content("ns", "k1", size)


class FakeClock:
    """Time that moves only when the engine sleeps; records each modelled duration."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def make_engine(clock: FakeClock, **config: object) -> Engine:
    cfg = EngineConfig(role=Role.BOTH, block_tokens=16, **config)  # type: ignore[arg-type]
    return Engine(cfg, pool=None, sleep=clock.sleep, clock=clock.time)


def test_a_lone_request_takes_one_prefill_step_then_one_step_per_token() -> None:
    clock = FakeClock()

    async def main() -> list[int]:
        engine = make_engine(clock)
        engine.start()
        tokens = list(range(100))
        handle = engine.submit(tokens, block_keys(tokens, 16), max_tokens=5)
        out = [t async for t in handle.tokens()]
        await engine.stop()
        assert handle.usage.computed_tokens == 100 and handle.usage.cached_tokens == 0
        assert handle.usage.completion_tokens == 5
        return out

    assert run(main()) == [0, 1, 2, 3, 4]
    model = CostModel()
    expected = [model.step_base_seconds + model.prefill_seconds(100)]
    expected += [model.decode_seconds(batch=1, context_tokens=100 + i) for i in range(1, 5)]
    assert clock.sleeps == pytest.approx(expected)


def test_max_batch_keeps_later_requests_waiting_and_local_hits_skip_compute() -> None:
    clock = FakeClock()

    async def main() -> None:
        engine = make_engine(clock, max_batch=2, max_step_tokens=64)
        engine.start()
        prompts = [[i] * 40 for i in range(3)]
        handles = [engine.submit(p, block_keys(p, 16), max_tokens=3) for p in prompts]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(engine.running) <= 2
        seen_waiting = False
        while engine.in_flight:
            if engine.waiting:
                seen_waiting = True
                assert len(engine.running) == 2
            await asyncio.sleep(0)
        assert seen_waiting
        for h in handles:
            assert [t async for t in h.tokens()] == [0, 1, 2]
        # The same prompt again: its two full blocks are in the local cache, only the tail is computed.
        again = engine.submit(prompts[0], block_keys(prompts[0], 16), max_tokens=1)
        assert [t async for t in again.tokens()] == [0]
        assert again.usage.local_hit_tokens == 32 and again.usage.computed_tokens == 8
        assert again.usage.pool_hit_tokens == 0
        # A fully cached prompt still computes its last token (its logits are needed).
        whole = [7] * 32
        first = engine.submit(whole, block_keys(whole, 16), max_tokens=1)
        [t async for t in first.tokens()]
        second = engine.submit(whole, block_keys(whole, 16), max_tokens=1)
        [t async for t in second.tokens()]
        assert second.usage.computed_tokens == 1 and second.usage.cached_tokens == 31
        await engine.stop()

    run(main())


def test_a_prefill_engine_answers_after_one_token_and_an_aborted_request_frees_its_slot() -> None:
    clock = FakeClock()

    async def main() -> None:
        engine = Engine(EngineConfig(role=Role.PREFILL, max_batch=1), pool=None, sleep=clock.sleep, clock=clock.time)
        engine.start()
        h = engine.submit([1] * 20, [], max_tokens=50)
        assert [t async for t in h.tokens()] == [0]
        long = engine.submit([2] * 20, [], max_tokens=1)
        long.abort()
        assert [t async for t in long.tokens()] == []
        nxt = engine.submit([3] * 20, [], max_tokens=1)
        assert [t async for t in nxt.tokens()] == [0]
        assert engine.in_flight == 0 and not engine.running and not engine.waiting
        await engine.stop()

    run(main())


def test_config_refuses_a_step_budget_smaller_than_the_batch() -> None:
    with pytest.raises(ValueError, match="max-step-tokens"):
        EngineConfig(max_batch=64, max_step_tokens=32)
    with pytest.raises(ValueError, match="max-num-seqs"):
        EngineConfig(max_batch=0)
