"""Unit tests for the API models: quantities, parsing raw objects, defaults, the KV compatibility key."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from daybreak.api import (
    Condition,
    ConditionStatus,
    EngineKind,
    KVDtype,
    KVLayout,
    KVPool,
    PDDeployment,
    QuantityError,
    format_bytes,
    kv_namespace,
    parse_bytes,
    parse_quantity,
)
from daybreak.api.kube import set_condition
from daybreak.api.kvcompat import kv_namespace_payload
from daybreak.api.kvpool import EvictionPolicy, Transport
from daybreak.api.pddeployment import CachePolicy

# --- quantities -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0),
    ("1024", 1024),
    ("64Gi", 64 * 2**30),
    ("1Ki", 1024),
    ("1.5Ki", 1536),
    ("1.5Ti", 3 * 2**39),
    ("500M", 500_000_000),
    ("1k", 1000),
    ("2E", 2 * 10**18),
    ("1Ei", 2**60),
    ("1e9", 10**9),
    ("1E+3", 1000),
    (".5Gi", 2**29),
    ("1.", 1),
    ("1.3", 2),  # rounds up, like resource.Quantity.Value()
])
def test_parse_bytes_accepts_kubernetes_forms(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", [
    "", "-1Gi", "+1Gi", "64GB", "64gi", "64 Gi", "1.5.2", "Gi", "100m", "5u", "1e-3", "1e999", "0x10", "1Gi ", "1_000",
])
def test_parse_bytes_rejects_non_sizes(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_bytes(text)


def test_parse_bytes_rejects_negative_integers_and_booleans() -> None:
    with pytest.raises(QuantityError, match="negative"):
        parse_bytes(-1)
    with pytest.raises(QuantityError, match="boolean"):
        parse_bytes(True)
    assert parse_bytes(7) == 7


@pytest.mark.parametrize(("text", "expected"), [
    ("100m", 1), ("-1Gi", -(2**30)), ("1500m", 2), ("+2", 2), ("1e-3", 1), ("5n", 1), ("0.5", 1),
])
def test_parse_quantity_full_grammar(text: str, expected: int) -> None:
    assert parse_quantity(text) == expected


def test_parse_quantity_rejects_garbage_and_huge_exponents() -> None:
    for bad in ("abc", "1Gb", "1e100"):
        with pytest.raises(QuantityError):
            parse_quantity(bad)


@pytest.mark.parametrize(("value", "text"), [(0, "0"), (1000, "1000"), (1024, "1Ki"), (64 * 2**30, "64Gi"),
                                             (1536, "1536"), (3 * 2**40, "3Ti")])
def test_format_bytes(value: int, text: str) -> None:
    assert format_bytes(value) == text


@given(st.integers(min_value=0, max_value=2**63))
def test_format_then_parse_round_trips(value: int) -> None:
    assert parse_bytes(format_bytes(value)) == value


# --- parsing raw objects ---------------------------------------------------------------------------


def pool_body(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 3,
                     "creationTimestamp": "2025-01-01T00:00:00Z", "managedFields": [{"manager": "kubectl"}]},
        "spec": {"tiers": {"dram": {"bytesPerNode": "64Gi"}}, **spec},
    }


def pdd_body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "poolRef": {"name": "p"},
        "model": {"name": "m", "revision": "r", "kvLayout": {"numLayers": 32, "numKVHeads": 8, "headDim": 128}},
        "engine": {"kind": "sim"},
    }
    return {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "d"},
            "spec": {**base, **spec}}


def test_kvpool_from_body_parses_camel_case_and_fills_defaults() -> None:
    pool = KVPool.from_body(pool_body(eviction={"policy": "s3fifo"}))
    assert pool.metadata.name == "p" and pool.metadata.generation == 3
    assert pool.spec.tiers.dram is not None
    assert pool.spec.tiers.dram.bytes_per_node == 64 * 2**30
    assert pool.spec.tiers.dram.enabled is True
    assert pool.spec.tiers.ssd is None
    assert pool.spec.eviction.policy is EvictionPolicy.S3FIFO
    assert (pool.spec.eviction.high_watermark, pool.spec.eviction.low_watermark) == (0.9, 0.8)
    assert pool.spec.transport.preference == [Transport.SHM, Transport.LINK, Transport.TCP]  # rdma is opt-in
    assert pool.spec.agent.port == 7400
    assert pool.status.nodes.ready == 0
    quotas = pool.spec.quotas
    assert (quotas.held_fraction, quotas.pinned_fraction, quotas.max_pin_seconds,
            quotas.max_connections_per_credential) == (0.5, 0.25, 600, 128)


def test_from_body_accepts_any_mapping() -> None:
    class View(dict[str, Any]):
        """Stands in for kopf's Body: a Mapping that is not a plain dict."""

    body = View(pool_body())
    body["spec"] = View(body["spec"])
    assert KVPool.from_body(body).spec.tiers.dram is not None


def test_unknown_metadata_is_kept_and_unknown_spec_fields_are_ignored() -> None:
    body = pool_body(futureField=True)
    pool = KVPool.from_body(body)
    dumped = pool.to_dict()
    assert dumped["metadata"]["creationTimestamp"] == "2025-01-01T00:00:00Z"
    assert "futureField" not in dumped["spec"]


def test_to_dict_is_camel_case_and_omits_unset_optionals() -> None:
    d = PDDeployment.from_body(pdd_body()).to_dict()
    spec = d["spec"]
    assert spec["poolRef"] == {"name": "p"}
    assert spec["model"]["kvLayout"] == {"numLayers": 32, "numKVHeads": 8, "headDim": 128, "dtype": "bfloat16",
                                         "blockTokens": 16}
    assert spec["updateStrategy"] == {"maxSurge": 1, "maxUnavailable": 0, "cache": "preserve"}
    assert "minReplicas" not in spec["prefill"]  # unset optionals never become nulls in a merge patch
    assert "image" not in spec["engine"]
    # Round trip: the wire form parses back to the same model.
    assert PDDeployment.from_body(d) == PDDeployment.from_body(pdd_body())


def test_snake_case_construction_works_too() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
    assert layout.to_dict() == {"numLayers": 2, "numKVHeads": 1, "headDim": 4, "dtype": "bfloat16", "blockTokens": 16}


@pytest.mark.parametrize(("body", "where"), [
    (pool_body(tiers={"dram": {"bytesPerNode": "64GB"}}), ("spec", "tiers", "dram", "bytesPerNode")),
    (pool_body(tiers={"dram": {"bytesPerNode": -1}}), ("spec", "tiers", "dram", "bytesPerNode")),
    (pool_body(eviction={"highWatermark": 1.5}), ("spec", "eviction", "highWatermark")),
    (pool_body(eviction={"policy": "fifo"}), ("spec", "eviction", "policy")),
    (pool_body(transport={"preference": ["carrier-pigeon"]}), ("spec", "transport", "preference", 0)),
    (pool_body(quotas={"heldFraction": 0}), ("spec", "quotas", "heldFraction")),
    (pool_body(quotas={"pinnedFraction": 1.5}), ("spec", "quotas", "pinnedFraction")),
    (pool_body(quotas={"maxConnectionsPerCredential": 0}), ("spec", "quotas", "maxConnectionsPerCredential")),
    (pdd_body(engine={"kind": "tgi"}), ("spec", "engine", "kind")),
    (pdd_body(updateStrategy={"maxSurge": "lots"}), ("spec", "updateStrategy", "maxSurge")),
    (pdd_body(prefill={"resources": {"limits": {"memory": "8 GB"}}}), ("spec", "prefill", "resources", "limits")),
])
def test_python_validation_names_the_field(body: dict[str, Any], where: tuple[Any, ...]) -> None:
    model = KVPool if body["kind"] == "KVPool" else PDDeployment
    with pytest.raises(ValidationError) as info:
        model.from_body(body)
    locs = [tuple(err["loc"]) for err in info.value.errors()]
    assert any(loc[: len(where)] == where for loc in locs), locs


def test_role_bounds_default_to_replicas() -> None:
    d = PDDeployment.from_body(pdd_body(decode={"replicas": 3, "maxReplicas": 8}))
    assert d.spec.decode.bounds == (3, 8)
    assert d.spec.prefill.bounds == (1, 1)


def test_status_round_trip_with_aliases() -> None:
    body = pdd_body()
    body["status"] = {"lastScale": {"time": "2025-01-01T00:00:00Z", "role": "decode", "from": 2, "to": 3,
                                    "reason": "itl above target"},
                      "kvNamespace": "kv1-x", "decode": {"readyReplicas": 2}}
    d = PDDeployment.from_body(body)
    assert d.status.last_scale is not None
    assert (d.status.last_scale.from_replicas, d.status.last_scale.to_replicas) == (2, 3)
    out = d.status.to_dict()
    assert out["lastScale"]["from"] == 2 and out["lastScale"]["time"] == "2025-01-01T00:00:00Z"
    assert out["decode"] == {"replicas": 0, "readyReplicas": 2, "updatedReplicas": 0}


def test_set_condition_moves_transition_time_only_on_status_change() -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    t1 = t0 + timedelta(minutes=5)
    conds = set_condition([], Condition(type="Ready", status=ConditionStatus.FALSE, reason="AgentsNotReady"), now=t0)
    conds = set_condition(conds, Condition(type="Ready", status=ConditionStatus.FALSE, reason="Other"), now=t1)
    assert conds[0].last_transition_time == t0 and conds[0].reason == "Other"
    conds = set_condition(conds, Condition(type="Ready", status=ConditionStatus.TRUE), now=t1)
    assert conds[0].last_transition_time == t1
    conds = set_condition(conds, Condition(type="Degraded", status=ConditionStatus.FALSE), now=t1)
    assert [c.type for c in conds] == ["Ready", "Degraded"]


# --- KV layout sizes and the compatibility key -----------------------------------------------------


def test_bytes_per_token_and_block() -> None:
    llama8b = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=KVDtype.BFLOAT16, block_tokens=16)
    assert llama8b.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert llama8b.bytes_per_block == 131072 * 16
    fp8 = llama8b.model_copy(update={"dtype": KVDtype.FP8_E4M3, "block_tokens": 256})
    assert fp8.bytes_per_token == 65536 and fp8.bytes_per_block == 65536 * 256
    assert KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=KVDtype.FLOAT32).bytes_per_token == 8


BASE = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "model_revision": "0e9e39f",
        "layout": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128), "engine": EngineKind.VLLM}


def test_kv_namespace_golden_value() -> None:
    # Pinned forever: if this changes, every deployed cache is silently orphaned on upgrade.
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)
    payload = (b'daybreak.dev/kv-namespace/v1\n{"blockTokens":16,"dtype":"bfloat16","engine":"vllm","headDim":128,'
               b'"model":"m","numKVHeads":8,"numLayers":32,"revision":"r"}')
    assert kv_namespace_payload(model_name="m", model_revision="r", layout=layout, engine="vllm") == payload
    key = kv_namespace(model_name="m", model_revision="r", layout=layout, engine="vllm")
    assert key == "kv1-" + hashlib.sha256(payload).hexdigest()[:24]
    assert key == "kv1-6c23fd348b658b977980d054"


def test_kv_namespace_is_deterministic_and_label_safe() -> None:
    key = kv_namespace(**BASE)
    assert key == kv_namespace(**{**BASE, "layout": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128)})
    assert key == kv_namespace(**{**BASE, "engine": "vllm"})  # enum or its string: same key
    assert len(key) <= 63 and key.startswith("kv1-") and key.replace("-", "").isalnum()


@pytest.mark.parametrize("change", [
    {"model_name": "meta-llama/Llama-3.1-8B"},
    {"model_revision": "0e9e39g"},
    {"engine": EngineKind.SGLANG},
    {"engine": EngineKind.SIM},
    {"layout": KVLayout(num_layers=31, num_kv_heads=8, head_dim=128)},
    {"layout": KVLayout(num_layers=32, num_kv_heads=4, head_dim=128)},
    {"layout": KVLayout(num_layers=32, num_kv_heads=8, head_dim=64)},
    {"layout": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=KVDtype.FLOAT16)},
    {"layout": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=32)},
])
def test_any_byte_affecting_change_gives_a_new_key(change: dict[str, Any]) -> None:
    assert kv_namespace(**{**BASE, **change}) != kv_namespace(**BASE)


def test_kv_namespace_ignores_everything_else_in_the_spec() -> None:
    a = PDDeployment.from_body(pdd_body())
    b = PDDeployment.from_body(pdd_body(prefill={"replicas": 5}, engine={"kind": "sim", "image": "x:1", "args": ["-v"]},
                                        updateStrategy={"cache": "flush"}, autoscaling={"enabled": True}))
    assert b.spec.update_strategy.cache is CachePolicy.FLUSH
    assert a.spec.kv_namespace() == b.spec.kv_namespace()


def test_kv_namespace_fields_cannot_collide_by_concatenation() -> None:
    # "ab"+"c" vs "a"+"bc": a naive join would collide; the JSON payload keeps fields apart.
    one = kv_namespace(**{**BASE, "model_name": "ab", "model_revision": "c"})
    two = kv_namespace(**{**BASE, "model_name": "a", "model_revision": "bc"})
    assert one != two
