"""The vLLM connector's pure decisions: settings, layout checks, keys, load/save plans, views into KV memory."""

from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

import pytest

from daybreak.api.kvcompat import KVLayout, KVPlatform, kv_namespace, kv_namespace_payload
from daybreak.connectors.blocks import (
    BlockViews,
    ConnectorConfigError,
    EngineLayout,
    LayerRegion,
    PoolSettings,
    RequestTracker,
    block_keys,
    check_layout,
    leading_hits,
    loadable_blocks,
)

# vLLM's CPU backend: LBHNC pages of 4 KV heads x 128 tokens x (K and V of 64 bf16 values).
CPU = EngineLayout(platform="cpu", block_tokens=128, num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16",
                   kv_layout="LBHNC", head_slots=4, content_bytes=256)
DECLARED = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=128, platform=KVPlatform.CPU)


def test_settings_come_from_the_extra_config_first_then_the_operators_environment(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("filetoken\n")
    env = {"DAYBREAK_POOL_ENDPOINTS": "a:1,b:2", "DAYBREAK_POOL_TOKEN": "envtoken", "DAYBREAK_KV_NAMESPACE": "kv1-x",
           "DAYBREAK_KV_LAYOUT": DECLARED.model_dump_json(by_alias=True)}
    from_env = PoolSettings.resolve({}, env)
    assert from_env.endpoints == ("a:1", "b:2") and from_env.token == "envtoken" and from_env.namespace == "kv1-x"
    assert from_env.layout == DECLARED
    explicit = PoolSettings.resolve({"endpoints": ["c:3"], "token_file": str(token), "namespace": "ns"}, env)
    assert explicit.endpoints == ("c:3",) and explicit.token == "filetoken" and explicit.namespace == "ns"
    assert "filetoken" not in repr(explicit)


@pytest.mark.parametrize(("extra", "env", "message"), [
    ({"token": "t", "namespace": "n"}, {}, "no pool endpoints"),
    ({}, {}, "no pool token"),  # the cheap checks first: a bad setting fails before any pool lookup
    ({"endpoints": ["a:1"]}, {}, "no pool token"),
    ({"endpoints": ["a:1"], "token_file": "/nonexistent/token"}, {}, "cannot read the pool token"),
    ({"endpoints": ["a:1"], "token": "t"}, {}, "no kvNamespace"),
    ({"endpoints": ["a:1"], "token": "t", "namespace": "n", "kv_layout": {"numLayers": 0}}, {}, "not a valid kvLayout"),
])
def test_missing_or_bad_settings_say_what_to_set(extra: dict[str, object], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        PoolSettings.resolve(extra, env)


def test_a_block_size_other_than_the_layouts_is_refused_naming_both() -> None:
    check_layout(DECLARED, CPU)
    check_layout(None, CPU)  # standalone use: nothing declared, nothing to contradict
    with pytest.raises(ConnectorConfigError, match=r"block size is 128 tokens but .*blockTokens is 16"):
        check_layout(DECLARED.model_copy(update={"block_tokens": 16}), CPU)


@pytest.mark.parametrize(("update", "message"), [
    ({"num_layers": 5}, "numLayers is 5 but the engine's KV cache has 4"),
    ({"num_kv_heads": 8}, "numKVHeads is 8"),
    ({"head_dim": 128}, "headDim is 128"),
    ({"dtype": "float16"}, "dtype is float16 but the engine's KV cache has bfloat16"),
    ({"platform": None}, "set kvLayout.platform: cpu"),
])
def test_every_other_layout_mismatch_is_refused(update: dict[str, object], message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        check_layout(DECLARED.model_copy(update=update), CPU)
    cuda = EngineLayout(**{**CPU.__dict__, "platform": "cuda"})
    with pytest.raises(ConnectorConfigError, match=r"remove kvLayout\.platform"):
        check_layout(DECLARED, cuda)


def test_tensor_parallel_ranks_hold_a_share_of_the_declared_heads() -> None:
    check_layout(DECLARED, EngineLayout(**{**CPU.__dict__, "num_kv_heads": 2, "tp_size": 2, "tp_rank": 1}))


def test_keys_differ_across_byte_layouts_and_follow_vllms_block_hashes() -> None:
    cuda = EngineLayout(**{**CPU.__dict__, "platform": "cuda"})
    assert CPU.fingerprint() != cuda.fingerprint() and len(CPU.fingerprint()) == 12
    assert CPU.fingerprint() == EngineLayout(**CPU.__dict__).fingerprint()
    rank1 = EngineLayout(**{**CPU.__dict__, "tp_rank": 1, "tp_size": 2})
    assert rank1.fingerprint() != CPU.fingerprint()
    keys = block_keys("fp", [b"\x01" * 32, b"\x02" * 32], 2)
    assert keys == [f"vllm-fp-{'01' * 32}-0", f"vllm-fp-{'01' * 32}-1", f"vllm-fp-{'02' * 32}-0",
                    f"vllm-fp-{'02' * 32}-1"]
    assert CPU.block_bytes_per_layer == 2 * 4 * 128 * 64 * 2


def test_kv_namespace_separates_cpu_blocks_and_keeps_every_older_key() -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)
    assert kv_namespace(model_name="m", model_revision="r", layout=layout, engine="vllm") == "kv1-6c23fd348b658b977980d054"
    cpu = layout.model_copy(update={"platform": KVPlatform.CPU})
    payload = kv_namespace_payload(model_name="m", model_revision="r", layout=cpu, engine="vllm")
    assert payload.endswith(b',"platform":"cpu"}') or b'"platform":"cpu"' in payload
    key = kv_namespace(model_name="m", model_revision="r", layout=cpu, engine="vllm")
    assert key == "kv1-" + hashlib.sha256(payload).hexdigest()[:24] and key != "kv1-6c23fd348b658b977980d054"


def test_loadable_blocks_always_leave_the_last_prompt_token_to_compute() -> None:
    assert loadable_blocks(700, 128) == 5
    assert loadable_blocks(640, 128) == 4  # exactly 5 blocks: the 5th holds the last token
    assert loadable_blocks(641, 128) == 5
    assert loadable_blocks(1, 128) == 0 and loadable_blocks(0, 128) == 0
    assert leading_hits([True, True, False, True], start=0) == 2
    assert leading_hits([False, True, True, False], start=1) == 2
    assert leading_hits([True], start=3) == 0


def test_a_tracker_loads_once_and_saves_each_completed_prompt_block_once() -> None:
    hashes = [bytes([i]) * 32 for i in range(5)]
    t = RequestTracker(request_id="r", prompt_tokens=700, block_tokens=128, block_hashes=hashes,
                       block_ids=[10, 11, 12, 13, 14, 15])
    t.in_pool = 2
    t.plan_load(first_block=1, count=1)
    load = t.take_load()
    assert load is not None and load.block_ids == (11,) and load.block_hashes == (hashes[1],)
    assert t.take_load() is None
    assert t.plan_save(computed_tokens=200) is None  # blocks 0-1 are in the pool already
    save = t.plan_save(computed_tokens=520)  # chunked prefill: blocks 2 and 3 complete
    assert save is not None and save.block_ids == (12, 13)
    save = t.plan_save(computed_tokens=701)  # the rest of the prompt and a decode token: block 4
    assert save is not None and save.block_ids == (14,)
    assert t.plan_save(computed_tokens=900) is None  # decode blocks are not saved
    with pytest.raises(ValueError, match="past the"):
        t.plan_load(first_block=4, count=3)


def test_block_views_write_straight_into_the_kv_memory() -> None:
    layers = [(ctypes.c_ubyte * (3 * 16))() for _ in range(2)]
    views = BlockViews([LayerRegion(address=ctypes.addressof(m), num_blocks=3, block_bytes=16) for m in layers])
    out = views.views([2, 0])
    assert [len(v) for v in out] == [16] * 4
    out[0][:] = b"a" * 16  # block 2, layer 0
    out[3][:] = b"b" * 16  # block 0, layer 1
    assert bytes(layers[0])[32:48] == b"a" * 16 and bytes(layers[1])[:16] == b"b" * 16
    assert bytes(layers[0])[:32] == b"\0" * 32
    with pytest.raises(IndexError, match="outside"):
        views.views([3])


def test_the_save_tier_is_dram_unless_the_extra_config_asks_for_hbm() -> None:
    from daybreak.connectors.blocks import save_tier

    assert save_tier(None) == "dram" and save_tier("HBM") == "hbm" and save_tier("dram") == "dram"
    with pytest.raises(ConnectorConfigError, match="tier must be 'dram' or 'hbm', got 'ssd'"):
        save_tier("ssd")
