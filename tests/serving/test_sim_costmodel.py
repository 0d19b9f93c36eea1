"""The sim engine's cost model: its calibration to the example layout, and how each term grows."""

from __future__ import annotations

import pytest

from daybreak.api.kvcompat import KVLayout
from daybreak.serving.sim.costmodel import EXAMPLE_BLOCK_BYTES, CostModel, PrefillChunk, knob_names


def test_example_block_is_the_llama_8b_layouts_block() -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)
    assert layout.bytes_per_token == 128 * 1024
    assert EXAMPLE_BLOCK_BYTES == layout.bytes_per_block == 2 * 1024 * 1024


def test_prefill_runs_at_about_ten_thousand_tokens_a_second_and_grows_superlinearly() -> None:
    model = CostModel()
    for tokens in (512, 2048, 8192):
        rate = tokens / model.prefill_seconds(tokens)
        assert 8_000 <= rate <= 12_000, (tokens, rate)
    per_token_short = model.prefill_seconds(1024) / 1024
    per_token_long = model.prefill_seconds(32768) / 32768
    assert per_token_long > 1.15 * per_token_short  # attention makes long prompts dearer per token
    # The same chunk costs more after a long cached prefix than at the start of the prompt.
    assert model.prefill_seconds(2048, context=30000) > model.prefill_seconds(2048, context=0)
    assert model.prefill_seconds(0) == 0.0


def test_decode_step_is_ten_to_twenty_ms_at_batch_one_and_grows_with_batch_and_context() -> None:
    model = CostModel()
    single = model.decode_seconds(batch=1, context_tokens=1024)
    assert 0.010 <= single <= 0.020
    assert model.decode_seconds(batch=32, context_tokens=32 * 1024) > single
    assert model.decode_seconds(batch=1, context_tokens=100_000) > single
    assert model.decode_seconds(batch=64, context_tokens=64 * 4096) < 0.1  # still a decode step, not a prefill


def test_loading_a_block_from_the_pool_is_much_cheaper_than_computing_it() -> None:
    model = CostModel()
    load = model.load_seconds(blocks=1, block_bytes=EXAMPLE_BLOCK_BYTES)
    compute = model.prefill_seconds(16)
    assert load * 5 < compute
    assert model.load_seconds(blocks=10, block_bytes=EXAMPLE_BLOCK_BYTES) == pytest.approx(10 * load)
    assert model.load_seconds(blocks=0, block_bytes=EXAMPLE_BLOCK_BYTES) == 0.0
    # Bandwidth term plus the per-block overhead, exactly as documented.
    assert load == pytest.approx(EXAMPLE_BLOCK_BYTES / model.load_bandwidth_bytes_per_second
                                 + model.load_per_block_seconds)


def test_a_mixed_step_pays_the_fixed_cost_once() -> None:
    model = CostModel()
    decode = model.decode_seconds(batch=4, context_tokens=4000)
    chunk = PrefillChunk(tokens=512, context=100)
    mixed = model.step_seconds(decode_batch=4, decode_context_tokens=4000, chunks=[chunk])
    assert mixed == pytest.approx(decode + model.prefill_seconds(512, context=100))
    prefill_only = model.step_seconds(decode_batch=0, decode_context_tokens=0, chunks=[chunk])
    assert prefill_only == pytest.approx(model.step_base_seconds + model.prefill_seconds(512, context=100))
    assert model.step_seconds(decode_batch=0, decode_context_tokens=0, chunks=[]) == 0.0


def test_time_scale_multiplies_every_duration() -> None:
    base, fast = CostModel(), CostModel(time_scale=0.01)
    pairs = [
        (base.prefill_seconds(3000, context=500), fast.prefill_seconds(3000, context=500)),
        (base.decode_seconds(batch=8, context_tokens=9000), fast.decode_seconds(batch=8, context_tokens=9000)),
        (base.load_seconds(blocks=7, block_bytes=4096), fast.load_seconds(blocks=7, block_bytes=4096)),
        (base.step_seconds(decode_batch=3, decode_context_tokens=30, chunks=[PrefillChunk(100, 0)]),
         fast.step_seconds(decode_batch=3, decode_context_tokens=30, chunks=[PrefillChunk(100, 0)])),
    ]
    for slow, quick in pairs:
        assert quick == pytest.approx(slow * 0.01)


def test_bad_knobs_are_refused_with_the_knob_named() -> None:
    with pytest.raises(ValueError, match="prefill_per_token_seconds"):
        CostModel(prefill_per_token_seconds=-1)
    with pytest.raises(ValueError, match="load_bandwidth_bytes_per_second"):
        CostModel(load_bandwidth_bytes_per_second=0)
    assert "time_scale" in knob_names() and len(knob_names()) == 8
    assert CostModel().replace(time_scale=2.0).time_scale == 2.0
