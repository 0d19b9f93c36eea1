"""The chart as rendered: lint-clean, golden output, values checked by the schema, monitors and dashboards."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartlib import CHART, KUBE_VERSION, Helm, Render

from daybreak.operator.pool_policy import PoolPolicy

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("DAYBREAK_UPDATE_GOLDEN") == "1"
# Everything optional switched on: confined to two namespaces, monitors, dashboards, an image allow-list.
FULL = ("--set", "operator.watchNamespaces={team-a,team-b}", "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.podMonitor.enabled=true", "--set", "dashboards.enabled=true",
        "--set", "poolPolicy.allowedAgentImages={registry.example/daybreak/}",
        "--set", "poolPolicy.agentPriorityClassName=daybreak-agents", "--set", "image.tag=0.1.0-test")
VARIANTS = {"default": (), "full": FULL}


def _kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_chart_lints_clean_with_defaults_and_everything_enabled(helm: Helm) -> None:
    for extra in VARIANTS.values():
        out = helm("lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION, *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 chart(s) failed" in out.stdout and "[WARNING]" not in out.stdout, out.stdout


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_chart_matches_the_golden_file(variant: str, render_text: Callable[..., str]) -> None:
    """Any change to what the chart renders shows up here; regenerate on purpose with DAYBREAK_UPDATE_GOLDEN=1."""
    text = render_text(*VARIANTS[variant])
    golden = GOLDEN / f"{variant}.yaml"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: run DAYBREAK_UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == golden.read_text(), (
        f"helm template output differs from {golden.relative_to(CHART.parent.parent)}; if the change is "
        f"intended run: DAYBREAK_UPDATE_GOLDEN=1 .venv/bin/pytest tests/chart/test_chart_values.py")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with the same key twice (the API server keeps only one)."""


def _no_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dupes = sorted({str(k) for k in keys if keys.count(k) > 1})
    if dupes:
        raise AssertionError(f"duplicate keys {dupes} at line {node.start_mark.line + 1}")
    return dict(loader.construct_mapping(node, deep=deep))


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_rendered_object_repeats_a_key(variant: str, render_text: Callable[..., str]) -> None:
    """Issue 12 finding 8: the agents' ClusterRole had app.kubernetes.io/component twice."""
    docs = [d for d in yaml.load_all(render_text(*VARIANTS[variant]), Loader=_UniqueKeyLoader) if d]
    agent_role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "daybreak-agent")
    assert agent_role["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"


@pytest.mark.parametrize(("args", "key"), [
    (("--set", "operator.replicas=0"), "operator/replicas"),
    (("--set", "operator.replicas=two"), "operator/replicas"),
    (("--set", "replicas=3"), "replicas"),  # the pre-0.2 top-level key: refused, not silently ignored
    (("--set", "image.repository="), "image/repository"),
    (("--set", "image.pullPolicy=Sometimes"), "image/pullPolicy"),
    (("--set-string", "metrics.serviceMonitor.enabled=yes"), "metrics/serviceMonitor/enabled"),
    (("--set-string", "dashboards.enabled=true"), "dashboards/enabled"),
    (("--set-json", 'poolPolicy.allowedSSDRoots=["/"]'), "poolPolicy/allowedSSDRoots/0"),
    (("--set-json", 'poolPolicy.allowedSSDRoots=["/var/lib/../../etc"]'), "poolPolicy/allowedSSDRoots/0"),
    (("--set-json", 'poolPolicy.allowedSSDRoots=["relative/dir"]'), "poolPolicy/allowedSSDRoots/0"),
    (("--set-json", 'poolPolicy.allowedAgentImages=["a,b"]'), "poolPolicy/allowedAgentImages/0"),
    (("--set-json", 'poolPolicy.allowedTolerationKeys=["bad key"]'), "poolPolicy/allowedTolerationKeys/0"),
    (("--set", "poolPolicy.admission=maybe"), "poolPolicy/admission"),
    (("--set", "poolPolicy.agentPortRange=7400"), "poolPolicy/agentPortRange"),
    (("--set", "poolPolicy.poolGroupRange=0-10"), "poolPolicy/poolGroupRange"),
    (("--set", "operator.watchNamespaces[0]=Team_A"), "operator/watchNamespaces/0"),
])
def test_invalid_values_are_refused_naming_the_key(helm: Helm, args: tuple[str, ...], key: str) -> None:
    out = helm("template", "dbk", str(CHART), "--kube-version", KUBE_VERSION, *args)
    assert out.returncode != 0, f"{args} was accepted"
    assert "schema" in out.stderr, out.stderr
    # helm names the value by JSON pointer ("at '/operator/replicas'"), an unknown key by its name.
    assert f"at '/{key}'" in out.stderr or f"properties '{key}' not allowed" in out.stderr, out.stderr


def test_the_operator_runs_restricted_with_probes_and_resources(render: Render) -> None:
    (deployment,) = _kinds(render())["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["runAsNonRoot"] is True
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(container)
    assert container["resources"]["limits"]["memory"] == "384Mi"
    assert "--policy-dir=/etc/daybreak-operator/policy" in container["args"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/daybreak-operator/policy"] == "policy"
    (cm,) = [c for c in _kinds(render())["ConfigMap"] if c["metadata"]["name"] == "dbk-daybreak-pool-policy"]
    assert {"configMap": {"name": "dbk-daybreak-pool-policy"}, "name": "policy"} in pod["volumes"]
    # The chart's policy defaults are the operator's built-in defaults.
    assert PoolPolicy.from_data(cm["data"]) == PoolPolicy()


def test_monitors_and_dashboards_render_only_when_enabled(render: Render) -> None:
    plain = _kinds(render())
    assert not {"ServiceMonitor", "PodMonitor"} & set(plain)
    assert all("grafana_dashboard" not in (c["metadata"].get("labels") or {}) for c in plain["ConfigMap"])
    full = _kinds(render(*FULL))
    monitors = {m["metadata"]["name"]: m for m in full["ServiceMonitor"] + full["PodMonitor"]}
    assert set(monitors) == {"dbk-daybreak-operator", "dbk-daybreak-agents", "dbk-daybreak-engines"}
    assert len(full["PodMonitor"]) == 2 and all(m["apiVersion"] == "monitoring.coreos.com/v1"
                                                for m in monitors.values())
    agents = next(m for m in full["PodMonitor"] if m["metadata"]["name"] == "dbk-daybreak-agents")
    assert agents["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert agents["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    dashboards = [c for c in full["ConfigMap"] if (c["metadata"].get("labels") or {}).get("grafana_dashboard") == "1"]
    files = {name for c in dashboards for name in c["data"]}
    assert files == {p.name for p in (CHART / "dashboards").glob("*.json")} and len(files) >= 2
    for c in dashboards:
        for text in c["data"].values():
            assert json.loads(text)["panels"]


def _exported_metric_names() -> set[str]:
    """What the agent and operator really export (their registries), as Prometheus exposes them."""
    from prometheus_client import REGISTRY, CollectorRegistry

    from daybreak.agent.store.metrics import StoreMetrics
    from daybreak.agent.transfer import metrics as _transfer  # noqa: F401  (registers in the default registry)
    from daybreak.operator import metrics as operator_metrics

    names: set[str] = set()
    store = StoreMetrics(registry=CollectorRegistry())
    registries = [REGISTRY, operator_metrics.REGISTRY, store.registry]
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            for sample in family.samples:
                names.add(sample.name)
            if family.type == "histogram":
                names.add(f"{family.name}_bucket")
            if family.type == "counter":
                names.add(f"{family.name}_total")
    return names


def test_dashboards_query_only_metrics_the_product_exports() -> None:
    exported = _exported_metric_names()
    used: set[str] = set()
    engine: set[str] = set()
    for path in (CHART / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                used |= set(re.findall(r"\b(daybreak_[a-z_]+)", target["expr"]))
                engine |= set(re.findall(r"(vllm:[a-z_]+)", target["expr"]))
    assert used, "no Daybreak metric in the dashboards"
    assert used <= exported, f"dashboards query metrics nobody exports: {sorted(used - exported)}"
    # vLLM's names (docs.vllm.ai metrics design): TTFT and inter-token latency histograms, request counts.
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"} <= engine
