"""The generated CRDs and docs: in sync with the models, structural, and the examples parse."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.api import KVPool, PDDeployment, crdgen
from daybreak.api.docgen import render
from daybreak.api.registry import CRD_KINDS
from daybreak.api.schema import SchemaError, check_structural, crd_document, structural_schema, walk
from daybreak.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_crds_match_the_models() -> None:
    for name, text in crdgen.generate().items():
        path = ROOT / "crds" / name
        assert path.is_file(), f"{path} missing: run `make crds`"
        assert path.read_text() == text, f"{path} is stale: run `make crds`"
    generated = set(crdgen.generate())
    extra = {p.name for p in (ROOT / "crds").glob("*.yaml")} - generated
    assert not extra, f"crds/ holds files no model generates: {extra}"


def test_checked_in_docs_match_the_models() -> None:
    assert (ROOT / "docs" / "api.md").read_text() == render(CRD_KINDS), "docs/api.md is stale: run `make crds`"


def test_cli_check_mode(tmp_path: Path) -> None:
    assert cli_main(["crds", "--out", str(tmp_path), "--docs", str(tmp_path / "api.md"), "--check"]) == 1
    assert cli_main(["crds", "--out", str(tmp_path), "--docs", str(tmp_path / "api.md")]) == 0
    assert cli_main(["crds", "--out", str(tmp_path), "--docs", str(tmp_path / "api.md"), "--check"]) == 0
    (tmp_path / "daybreak.dev_kvpools.yaml").write_text("# hand edit\n")
    args = argparse.Namespace(out=tmp_path, docs=None, check=True)
    assert crdgen.run(args) == 1


def test_registry_is_consistent() -> None:
    assert KVPool in CRD_KINDS and PDDeployment in CRD_KINDS
    names = [m.crd.name for m in CRD_KINDS]
    assert len(set(names)) == len(names)
    assert KVPool.crd.short_names == ("kvp",) and PDDeployment.crd.short_names == ("pdd",)
    assert all("daybreak" in m.crd.categories for m in CRD_KINDS)


@pytest.mark.parametrize("model", CRD_KINDS, ids=lambda m: m.crd.kind)
def test_crd_shape(model: Any) -> None:
    doc = crd_document(model)
    version = doc["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]
    check_structural(schema)
    assert schema["required"] == ["spec"]
    status = schema["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert not any("default" in node for _, node in walk(status)), "status fields must have no defaults"
    # camelCase everywhere on the wire
    for path, _ in walk(schema):
        assert "_" not in path.split(".")[-1], path


def test_schema_carries_ranges_enums_patterns_and_rules() -> None:
    spec = structural_schema(KVPool)["properties"]["spec"]["properties"]
    hw = spec["eviction"]["properties"]["highWatermark"]
    assert (hw["minimum"], hw["exclusiveMinimum"], hw["maximum"]) == (0, True, 1)
    assert spec["eviction"]["properties"]["policy"]["enum"] == ["lru", "s3fifo"]
    size = spec["tiers"]["properties"]["dram"]["properties"]["bytesPerNode"]
    assert size["x-kubernetes-int-or-string"] is True and size["pattern"].startswith("^")
    assert spec["tiers"]["x-kubernetes-validations"]
    assert spec["replication"]["default"] == {"replicas": 1}
    pdd = structural_schema(PDDeployment)["properties"]["spec"]["properties"]
    rules = [r["rule"] for r in pdd["prefill"]["x-kubernetes-validations"]]
    assert any("minReplicas <= self.replicas" in r for r in rules)
    assert pdd["model"]["properties"]["kvLayout"]["properties"]["numKVHeads"]["minimum"] == 1


def test_check_structural_catches_violations() -> None:
    good = structural_schema(KVPool)
    broken = copy.deepcopy(good)
    del broken["properties"]["spec"]["properties"]["leaseSeconds"]["type"]
    with pytest.raises(SchemaError, match="leaseSeconds: no type"):
        check_structural(broken)
    broken = copy.deepcopy(good)
    broken["properties"]["spec"]["properties"]["agent"]["properties"]["port"]["$ref"] = "#/x"
    with pytest.raises(SchemaError, match=r"agent.port: keys not allowed"):
        check_structural(broken)
    broken = copy.deepcopy(good)
    del broken["properties"]["spec"]["properties"]["tiers"]["description"]
    with pytest.raises(SchemaError, match="tiers: no description"):
        check_structural(broken)


def _examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.yaml"))


def _documents(path: Path) -> list[dict]:
    """Every object of an example file (the demo's holds a pool and a deployment)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_examples_cover_the_four_scenarios() -> None:
    kinds = [d["kind"] for p in _examples() for d in _documents(p)]
    assert kinds.count("KVPool") >= 2 and kinds.count("PDDeployment") >= 2


@pytest.mark.parametrize("path", _examples(), ids=lambda p: p.name)
def test_examples_parse_with_the_models(path: Path) -> None:
    for body in _documents(path):
        model = {m.crd.kind: m for m in CRD_KINDS}[body["kind"]]
        obj = model.from_body(body)
        assert obj.metadata.name


def test_every_cel_rule_has_a_python_twin() -> None:
    from daybreak.api.base import ApiModel

    def models(cls: type[ApiModel]) -> list[type[ApiModel]]:
        out = [cls]
        for sub in cls.__subclasses__():
            out.extend(models(sub))
        return out

    rules = [(m.__name__, r) for m in models(ApiModel) for r in m.__cel_rules__]
    assert len(rules) >= 5
    missing = [(name, r.rule) for name, r in rules if r.check is None]
    assert not missing, f"CEL rules without a Python check: {missing}"
