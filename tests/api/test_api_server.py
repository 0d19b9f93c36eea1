"""The CRDs against a real kube-apiserver: bad input rejected naming the field, defaults, explain, columns.

One CRD install per test session (module fixture), all objects in namespace ``api-test``. kubectl gets its
own discovery cache directory so a cache filled before the CRDs existed cannot hide them.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from daybreak.api import KVPool, PDDeployment, parse_bytes
from daybreak.api.registry import CRD_KINDS
from daybreak.devenv.cluster import LocalCluster
from daybreak.testing import e2e

ROOT = Path(__file__).resolve().parents[2]
NS = "api-test"
DELETE = object()  # marks a key to remove in a variant


class Api:
    """kubectl bound to the test cluster, namespace and a private discovery cache."""

    def __init__(self, kube: LocalCluster, cache_dir: Path) -> None:
        self.kube = kube
        self.cache_dir = cache_dir

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.kube.kubectl(f"--cache-dir={self.cache_dir}", *args, stdin=stdin, check=check)

    def apply(self, manifest: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-n", NS, *extra, "-f", "-", stdin=yaml.safe_dump(manifest), check=False)

    def get(self, plural: str, name: str) -> dict[str, Any]:
        out = self.kubectl("get", "-n", NS, plural, name, "-o", "json").stdout
        return json.loads(out)


def _wait_for(what: str, probe: Any, timeout: float = 60.0) -> Any:
    return e2e.wait_for(what, probe, timeout=timeout, interval=0.25)


@pytest.fixture(scope="module")
def api(kube: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """CRDs applied and Established."""
    client = Api(kube, tmp_path_factory.mktemp("kubectl-cache"))
    client.kubectl("apply", "-f", str(ROOT / "crds"))  # exactly what the docs tell users to run
    client.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                   *(f"crd/{m.crd.name}" for m in CRD_KINDS))
    if client.kubectl("get", "namespace", NS, check=False).returncode != 0:
        client.kubectl("create", "namespace", NS)
    yield client


def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def _variant(base: dict[str, Any], name: str, edits: dict[str, Any]) -> dict[str, Any]:
    """``base`` renamed, with dotted-path edits applied under spec (DELETE removes the key)."""
    out = copy.deepcopy(base)
    out["metadata"] = {"name": name}
    for dotted, value in edits.items():
        node = out if dotted.startswith("metadata.") else out["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


POOL = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "KVPool", "metadata": {"name": "x"},
        "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}}
PDD = {"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "x"},
       "spec": {"poolRef": {"name": "kv-minimal"},
                "model": {"name": "m", "revision": "r", "kvLayout": {"numLayers": 2, "numKVHeads": 1, "headDim": 8}},
                "engine": {"kind": "sim"}}}

# (id, base, spec edits, substrings the error must contain: the offending field's path first)
INVALID: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = [
    ("pool-missing-tiers", POOL, {"tiers": DELETE}, ["spec.tiers", "Required value"]),
    ("pool-empty-tiers", POOL, {"tiers": {}}, ["spec.tiers", "at least one of tiers.hbm"]),
    ("pool-all-tiers-disabled", POOL, {"tiers.dram.enabled": False}, ["spec.tiers", "at least one of"]),
    ("pool-malformed-quantity", POOL, {"tiers.dram.bytesPerNode": "64GB"}, ["spec.tiers.dram.bytesPerNode"]),
    ("pool-negative-size-int", POOL, {"tiers.dram.bytesPerNode": -5}, ["spec.tiers.dram.bytesPerNode"]),
    ("pool-negative-size-str", POOL, {"tiers.dram.bytesPerNode": "-1Gi"}, ["spec.tiers.dram.bytesPerNode"]),
    ("pool-milli-bytes", POOL, {"tiers.dram.bytesPerNode": "100m"}, ["spec.tiers.dram.bytesPerNode"]),
    ("pool-size-wrong-type", POOL, {"tiers.dram.bytesPerNode": True}, ["spec.tiers.dram.bytesPerNode"]),
    ("pool-hbm-without-size", POOL, {"tiers.hbm": {"enabled": True}}, ["spec.tiers.hbm.bytesPerDevice",
                                                                         "Required value"]),
    ("pool-ssd-relative-path", POOL, {"tiers.ssd": {"path": "data/kv", "bytesPerNode": "1Ti"}},
     ["spec.tiers.ssd.path"]),
    ("pool-watermark-out-of-range", POOL, {"eviction.highWatermark": 1.5}, ["spec.eviction.highWatermark"]),
    ("pool-low-above-high", POOL, {"eviction": {"highWatermark": 0.9, "lowWatermark": 0.95}},
     ["spec.eviction.lowWatermark", "lowWatermark must be less than highWatermark"]),
    ("pool-unknown-policy", POOL, {"eviction.policy": "fifo"}, ["spec.eviction.policy", "Unsupported value"]),
    ("pool-unknown-transport", POOL, {"transport.preference": ["rdma", "carrier-pigeon"]},
     ["spec.transport.preference[1]", "Unsupported value"]),
    ("pool-duplicate-transport", POOL, {"transport.preference": ["tcp", "tcp"]},
     ["spec.transport.preference[1]", "Duplicate value"]),
    ("pool-empty-transport", POOL, {"transport.preference": []}, ["spec.transport.preference"]),
    ("pool-zero-replication", POOL, {"replication.replicas": 0}, ["spec.replication.replicas"]),
    ("pool-lease-wrong-type", POOL, {"leaseSeconds": "ten"}, ["spec.leaseSeconds"]),
    ("pool-quota-held-zero", POOL, {"quotas.heldFraction": 0}, ["spec.quotas.heldFraction"]),
    ("pool-quota-connections-zero", POOL, {"quotas.maxConnectionsPerCredential": 0},
     ["spec.quotas.maxConnectionsPerCredential"]),
    ("pool-port-out-of-range", POOL, {"agent.port": 70000}, ["spec.agent.port"]),
    ("pool-bad-toleration-operator", POOL, {"tolerations": [{"key": "a", "operator": "Maybe"}]},
     ["spec.tolerations[0].operator"]),
    ("pool-bad-resource-quantity", POOL, {"agent.resources": {"limits": {"memory": "8 GB"}}},
     ["spec.agent.resources.limits.memory"]),
    ("pool-unknown-field", POOL, {"tierz": {}}, ["spec.tierz", "unknown field"]),
    # hugePages was removed from the API (nothing backed the DRAM tier with huge pages): refused, not dropped.
    ("pool-huge-pages-removed", POOL, {"tiers.dram.hugePages": True}, ["spec.tiers.dram.hugePages",
                                                                        "unknown field"]),
    ("pool-tls-without-secret-name", POOL, {"tls": {}}, ["spec.tls.secretName", "Required value"]),
    ("pool-tls-empty-secret-name", POOL, {"tls": {"secretName": ""}}, ["spec.tls.secretName"]),
    ("pool-tls-secret-name-not-dns", POOL, {"tls": {"secretName": "Pool_TLS"}}, ["spec.tls.secretName"]),
    ("pool-name-starts-with-digit", POOL, {"metadata.name": "1pool"}, ["metadata.name must be a DNS-1035 label"]),
    ("pdd-name-with-dot", PDD, {"metadata.name": "a.b"}, ["metadata.name must be a DNS-1035 label"]),
    ("pdd-missing-poolref", PDD, {"poolRef": DELETE}, ["spec.poolRef", "Required value"]),
    ("pdd-empty-pool-name", PDD, {"poolRef": {"name": ""}}, ["spec.poolRef.name"]),
    ("pdd-min-above-replicas", PDD, {"prefill": {"replicas": 2, "minReplicas": 3}},
     ["spec.prefill.minReplicas", "minReplicas must be less than or equal to replicas"]),
    ("pdd-replicas-above-max", PDD, {"decode": {"replicas": 5, "maxReplicas": 4}},
     ["spec.decode.replicas", "replicas must be less than or equal to maxReplicas"]),
    ("pdd-negative-replicas", PDD, {"decode": {"replicas": -1}}, ["spec.decode.replicas"]),
    ("pdd-zero-on-prefill-only", PDD, {"prefill": {"replicas": 1, "minReplicas": 0, "maxReplicas": 4}},
     ["spec.decode.minReplicas", "must be set on both prefill and decode"]),
    ("pdd-zero-without-router", PDD, {"prefill": {"replicas": 1, "minReplicas": 0, "maxReplicas": 4},
                                      "decode": {"replicas": 1, "minReplicas": 0, "maxReplicas": 4},
                                      "router": {"enabled": False}},
     ["spec.router.enabled", "needs router.enabled"]),
    ("pdd-negative-prefill-concurrency", PDD, {"router": {"prefillConcurrency": -1}},
     ["spec.router.prefillConcurrency"]),
    ("pdd-decode-prefill-without-concurrency", PDD, {"router": {"decodePrefill": 2}},
     ["spec.router.decodePrefill", "decodePrefill needs prefillConcurrency"]),
    ("pdd-deadline-without-concurrency", PDD, {"router": {"roomOrder": "deadline"}},
     ["spec.router.roomOrder", "roomOrder deadline needs prefillConcurrency"]),
    ("pdd-unknown-room-order", PDD, {"router": {"prefillConcurrency": 1, "roomOrder": "shortest"}},
     ["spec.router.roomOrder", "Unsupported value"]),
    ("pdd-unknown-planner-policy", PDD, {"autoscaling": {"enabled": True, "policy": "psychic"}},
     ["spec.autoscaling.policy", "Unsupported value"]),
    ("pdd-replicas-wrong-type", PDD, {"prefill": {"replicas": "two"}}, ["spec.prefill.replicas"]),
    ("pdd-unknown-engine", PDD, {"engine": {"kind": "tgi", "image": "x"}}, ["spec.engine.kind",
                                                                            "Unsupported value"]),
    ("pdd-sglang-not-supported", PDD, {"engine": {"kind": "sglang", "image": "x"}},
     ["spec.engine.kind", "kind sglang is not supported yet"]),
    ("pdd-vllm-without-image", PDD, {"engine": {"kind": "vllm"}}, ["spec.engine.image",
                                                                   "image is required unless kind is sim"]),
    ("pdd-zero-layers", PDD, {"model.kvLayout.numLayers": 0}, ["spec.model.kvLayout.numLayers"]),
    ("pdd-unknown-dtype", PDD, {"model.kvLayout.dtype": "fp4"}, ["spec.model.kvLayout.dtype"]),
    ("pdd-missing-revision", PDD, {"model.revision": DELETE}, ["spec.model.revision", "Required value"]),
    ("pdd-surge-and-unavailable-zero", PDD, {"updateStrategy": {"maxSurge": 0, "maxUnavailable": "0%"}},
     ["spec.updateStrategy.maxUnavailable", "must not both be 0"]),
    ("pdd-malformed-surge", PDD, {"updateStrategy": {"maxSurge": "lots"}}, ["spec.updateStrategy.maxSurge"]),
    ("pdd-unknown-cache-policy", PDD, {"updateStrategy": {"cache": "keep"}}, ["spec.updateStrategy.cache"]),
    ("pdd-zero-ttft", PDD, {"autoscaling": {"ttftSeconds": 0}}, ["spec.autoscaling.ttftSeconds"]),
    ("pdd-env-without-name", PDD, {"engine": {"kind": "sim", "env": [{"value": "1"}]}},
     ["spec.engine.env[0].name", "Required value"]),
]


def test_at_least_twenty_invalid_manifests() -> None:
    assert len(INVALID) >= 20


@pytest.mark.parametrize(("case", "base", "edits", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifest_is_rejected_naming_the_field(api: Api, case: str, base: dict[str, Any],
                                                       edits: dict[str, Any], expected: list[str]) -> None:
    manifest = _variant(base, case, edits)
    proc = api.apply(manifest)
    message = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"accepted: {message}"
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in: {message}"
    name = manifest["metadata"]["name"]
    assert "NotFound" in api.kubectl("get", "-n", NS, manifest["kind"].lower(), name, check=False).stderr


# Python parses leniently on purpose (an older operator must read newer objects): unknown fields are dropped.
PYTHON_ACCEPTS = {"pool-unknown-field", "pool-huge-pages-removed"}


@pytest.mark.parametrize(("case", "base", "edits", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_python_models_reject_the_same_manifests(case: str, base: dict[str, Any], edits: dict[str, Any],
                                                 expected: list[str]) -> None:
    """No server needed: the models and the CRD agree on what is invalid (CEL rules included)."""
    model = KVPool if base["kind"] == "KVPool" else PDDeployment
    manifest = _variant(base, case, edits)
    if case in PYTHON_ACCEPTS:
        model.from_body(manifest)
        return
    with pytest.raises(ValidationError):
        model.from_body(manifest)


def test_scale_to_zero_on_both_roles_behind_the_router_is_accepted(api: Api) -> None:
    zero = {"replicas": 1, "minReplicas": 0, "maxReplicas": 4}
    manifest = _variant(PDD, "to-zero", {"prefill": zero, "decode": zero,
                                         "autoscaling": {"enabled": True, "policy": "predictive"}})
    PDDeployment.from_body(manifest)
    proc = api.apply(manifest, "--dry-run=server")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_valid_base_manifests_are_accepted(api: Api) -> None:
    # The invalid cases differ from these in one place: without this, a broken base would pass them all.
    for base in (POOL, PDD):
        proc = api.apply(_variant(base, "valid-base", {}), "--dry-run=server")
        assert proc.returncode == 0, proc.stderr


def test_examples_pass_server_dry_run(api: Api) -> None:
    proc = api.kubectl("apply", "-n", NS, "--dry-run=server", "-f", str(ROOT / "examples"), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    objects = sum(1 for path in (ROOT / "examples").glob("*.yaml") for d in yaml.safe_load_all(path.read_text()) if d)
    assert proc.stdout.count("(server dry run)") == objects


def _normalise(spec: Any, key: str = "") -> Any:
    """Drop empty containers (the server leaves unset fields out) and read byte sizes as integers."""
    if isinstance(spec, dict):
        return {k: _normalise(v, k) for k, v in spec.items() if v not in ({}, [])}
    if isinstance(spec, list):
        return [_normalise(v) for v in spec]
    if key in ("bytesPerNode", "bytesPerDevice"):
        return parse_bytes(spec)
    return spec


@pytest.fixture(scope="module")
def applied(api: Api) -> Api:
    api.kubectl("apply", "-n", NS, "-f", str(ROOT / "examples"))
    return api


def test_server_defaults_show_in_get_and_match_python_defaults(applied: Api) -> None:
    pool = applied.get("kvpools", "kv-minimal")
    spec = pool["spec"]
    assert spec["eviction"] == {"policy": "lru", "highWatermark": 0.9, "lowWatermark": 0.8}
    assert spec["replication"] == {"replicas": 1}
    assert spec["transport"] == {"preference": ["shm", "link", "tcp"]}
    assert spec["agent"] == {"port": 7400}
    assert spec["leaseSeconds"] == 10
    assert spec["tiers"]["dram"] == {"bytesPerNode": "8Gi", "enabled": True}
    as_yaml = applied.kubectl("get", "-n", NS, "kvp", "kv-minimal", "-o", "yaml").stdout
    assert "highWatermark: 0.9" in as_yaml and "leaseSeconds: 10" in as_yaml
    # Every example: what the server stored equals what the Python models fill in.
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for example in (d for d in yaml.safe_load_all(path.read_text()) if d):
            _check_stored(applied, example, path)


def _check_stored(applied: Api, example: dict[str, Any], path: Path) -> None:
    """What the server stored for one example object equals what the Python models fill in."""
    model: type[KVPool] | type[PDDeployment] = KVPool if example["kind"] == "KVPool" else PDDeployment
    stored = applied.get(model.crd.plural, example["metadata"]["name"])
    assert _normalise(stored["spec"]) == _normalise(model.from_body(example).to_dict()["spec"]), path.name
    assert model.from_body(stored).spec == model.from_body(example).spec


def test_pdd_defaults(applied: Api) -> None:
    spec = applied.get("pddeployments", "sim-llama")["spec"]
    assert spec["model"]["kvLayout"]["dtype"] == "bfloat16" and spec["model"]["kvLayout"]["blockTokens"] == 16
    assert spec["updateStrategy"] == {"maxSurge": 1, "maxUnavailable": 0, "cache": "preserve"}
    assert spec["router"] == {"enabled": True, "replicas": 1, "cacheStatistics": False,  # no auth unless named
                              "prefillConcurrency": 0, "decodePrefill": 0, "roomOrder": "arrival"}
    assert spec["autoscaling"]["enabled"] is False and spec["autoscaling"]["intervalSeconds"] == 15


def test_status_keeps_known_and_unknown_fields(applied: Api) -> None:
    """The operator's status patches (and kopf's own status keys) survive; bad status values do not."""
    patch = {"status": {"observedGeneration": 1, "nodes": {"desired": 2, "ready": 2},
                        "capacity": {"dram": 2 * 8 * 2**30},
                        "conditions": [{"type": "Ready", "status": "True", "reason": "AgentsReady",
                                        "lastTransitionTime": "2025-01-01T00:00:00Z"}],
                        "kopf": {"progress": {"handler": {"started": "2025-01-01T00:00:00Z"}}}}}
    applied.kubectl("patch", "-n", NS, "kvp", "kv-minimal", "--subresource=status", "--type=merge",
                    "-p", json.dumps(patch))
    status = applied.get("kvpools", "kv-minimal")["status"]
    assert status["kopf"] == patch["status"]["kopf"]
    assert status["nodes"] == {"desired": 2, "ready": 2}
    assert KVPool.from_body(applied.get("kvpools", "kv-minimal")).status.capacity.dram == 16 * 2**30
    bad = applied.kubectl("patch", "-n", NS, "kvp", "kv-minimal", "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": {"conditions": [{"type": "Ready", "status": "Maybe"}]}}),
                          check=False)
    assert bad.returncode != 0 and "status.conditions[0].status" in bad.stderr


def test_explain_lists_documented_fields(applied: Api) -> None:
    def explain() -> str | None:
        proc = applied.kubectl("explain", "kvpool.spec.tiers", check=False)
        return proc.stdout if proc.returncode == 0 and "dram" in proc.stdout else None

    text = _wait_for("kubectl explain to see the CRD schema", explain)
    assert "Storage tiers and their sizes; at least one must be present and enabled." in text
    for name, doc in (("hbm", "Accelerator memory tier."), ("dram", "Host memory tier."), ("ssd", "Local SSD tier.")):
        assert name in text and doc in text
    dram = applied.kubectl("explain", "kvpool.spec.tiers.dram").stdout
    assert "bytesPerNode" in dram and "Host memory per node given to the pool" in dram
    layout = applied.kubectl("explain", "pdd.spec.model.kvLayout").stdout
    assert "numKVHeads" in layout and "Tokens per cache block" in layout


def _table(text: str, header_marker: str) -> list[dict[str, str]]:
    """Rows of the kubectl table whose header contains ``header_marker``, cut at the header's column starts."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NAME") and header_marker in line)
    header = lines[start]
    names = [n for n in header.split("  ") if n.strip()]
    starts = [header.index(n.strip()) for n in names]
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("NAME"):
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows.append(dict(zip([n.strip() for n in names], cells, strict=True)))
    return rows


def test_get_shows_printer_columns(applied: Api) -> None:
    applied.kubectl("patch", "-n", NS, "kvp", "kv-minimal", "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"nodes": {"desired": 2, "ready": 2}}}))
    applied.kubectl("patch", "-n", NS, "pdd", "sim-llama", "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"kvNamespace": "kv1-test", "prefill": {"readyReplicas": 1},
                                           "decode": {"readyReplicas": 2},
                                           "conditions": [{"type": "Ready", "status": "True"}]}}))
    out = applied.kubectl("get", "-n", NS, "kvp,pdd").stdout
    pools = {row["NAME"]: row for row in _table(out, "READY NODES")}
    assert list(pools["kvpool.daybreak.dev/kv-minimal"]) == ["NAME", "READY NODES", "DRAM", "SSD", "AGE"]
    minimal = pools["kvpool.daybreak.dev/kv-minimal"]
    assert (minimal["READY NODES"], minimal["DRAM"], minimal["SSD"]) == ("2", "8Gi", "")
    production = pools["kvpool.daybreak.dev/kv-production"]
    assert (production["DRAM"], production["SSD"]) == ("256Gi", "3Ti")
    deployments = {row["NAME"]: row for row in _table(out, "KV-NS")}
    sim = deployments["pddeployment.daybreak.dev/sim-llama"]
    assert list(sim) == ["NAME", "PREFILL", "DECODE", "READY", "KV-NS", "AGE"]
    assert (sim["PREFILL"], sim["DECODE"], sim["READY"], sim["KV-NS"]) == ("1", "2", "True", "kv1-test")
    wide = applied.kubectl("get", "-n", NS, "pdd", "llama-70b", "-o", "wide").stdout
    row = _table(wide, "KV-NS")[0]
    assert (row["POOL"], row["ENGINE"], row["MODEL"]) == ("kv-production", "vllm", "meta-llama/Llama-3.1-70B-Instruct")
    assert "kv-minimal" in applied.kubectl("get", "-n", NS, "daybreak").stdout  # the category
