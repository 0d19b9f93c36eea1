"""A KVPool's spec.tls: the agents' mounted Secret and TLS settings, the engines' and router's CA-only mount and env."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from daybreak.agent.settings import AgentSettings
from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment, Role
from daybreak.client import POOL_TLS_CA_ENV, pool_tls_ca_file
from daybreak.operator import deployment as pdd_mod
from daybreak.operator import pool as pool_mod
from daybreak.pool.tls import TlsSettingsError
from daybreak.serving import sim

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "example.test/daybreak:1"
SECRET = "kv-tls"


def _load(name: str) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update({"namespace": "ns1", "uid": "uid-1", "generation": 1})
    return dict(body)


def _pool(*, tls: bool) -> KVPool:
    body = _load("kvpool-minimal.yaml")
    if tls:
        body["spec"]["tls"] = {"secretName": SECRET}
    return KVPool.from_body(body)


def _pdd() -> PDDeployment:
    return PDDeployment.from_body(_load("pddeployment-sim.yaml"))


def _daemonset(pool: KVPool) -> dict[str, Any]:
    out = pool_mod.build(pool, image=IMAGE, metrics_port=9401)
    return next(m for m in out.applied if m["kind"] == "DaemonSet")


def _settings(pool: KVPool) -> dict[str, Any]:
    out = pool_mod.build(pool, image=IMAGE, metrics_port=9401)
    config = next(m for m in out.applied if m["kind"] == "ConfigMap")
    return dict(yaml.safe_load(config["data"][pool_mod.AGENT_CONFIG_FILE]))


def _serving_pods(pool: KVPool) -> dict[Role, dict[str, Any]]:
    out = pdd_mod.build(_pdd(), pool, image=IMAGE)
    return {role: m["spec"]["template"] for role, m in out.applied if m["kind"] == "Deployment"}


def test_tls_pool_agents_mount_the_secret_read_only_and_serve_tls_with_it() -> None:
    ds = _daemonset(_pool(tls=True))
    pod = ds["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume == {"name": "tls", "secret": {"secretName": SECRET, "items": [
        {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"},
        {"key": "ca.crt", "path": "ca.crt"}]}}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    assert mount == {"name": "tls", "mountPath": pool_mod.TLS_DIR, "readOnly": True}
    settings = _settings(_pool(tls=True))
    assert settings["tls_cert_file"] == f"{pool_mod.TLS_DIR}/tls.crt"
    assert settings["tls_key_file"] == f"{pool_mod.TLS_DIR}/tls.key"
    assert settings["tls_ca_file"] == f"{pool_mod.TLS_DIR}/ca.crt"
    # The same settings object the standalone agent reads, so `daybreak agent --config` accepts the file.
    parsed = AgentSettings.model_validate(settings)
    assert (parsed.tls_cert_file, parsed.tls_key_file) == (settings["tls_cert_file"], settings["tls_key_file"])


def test_plain_pool_has_no_tls_volume_and_no_tls_settings() -> None:
    pod = _daemonset(_pool(tls=False))["spec"]["template"]["spec"]
    assert "tls" not in {v["name"] for v in pod["volumes"]}
    settings = _settings(_pool(tls=False))
    assert not any(settings.get(k) for k in ("tls_cert_file", "tls_key_file", "tls_ca_file"))


def test_turning_tls_on_changes_the_config_hash_so_agents_roll() -> None:
    def config_hash(pool: KVPool) -> str:
        return str(_daemonset(pool)["spec"]["template"]["metadata"]["annotations"][pool_mod.CONFIG_HASH_ANNOTATION])

    assert config_hash(_pool(tls=True)) != config_hash(_pool(tls=False))
    body = _load("kvpool-minimal.yaml")
    body["spec"]["tls"] = {"secretName": "other-tls"}
    assert config_hash(KVPool.from_body(body)) != config_hash(_pool(tls=True))


def test_tls_pool_grants_no_secret_read() -> None:
    """Pods mount the Secret; neither the agent's Role nor anything else the pool creates reads Secrets."""
    out = pool_mod.build(_pool(tls=True), image=IMAGE, metrics_port=9401)
    for manifest in out.applied:
        for rule in manifest.get("rules") or []:
            if "secrets" in rule.get("resources", []):
                assert set(rule["verbs"]) == {"create"}, rule


def test_engines_and_router_of_a_tls_pool_get_only_the_ca_and_the_env_pointing_at_it() -> None:
    pods = _serving_pods(_pool(tls=True))
    assert set(pods) == {Role.PREFILL, Role.DECODE, Role.ROUTER}
    for role, template in pods.items():
        spec = template["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "pool-ca"]
        # Only ca.crt is projected: the Secret's private key never reaches an engine or the router.
        assert volume == {"name": "pool-ca", "projected": {"sources": [{"secret": {
            "name": SECRET, "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}, role
        assert not any("secret" in v for v in spec["volumes"]), role
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "pool-ca"]
        assert mount == {"name": "pool-ca", "mountPath": pdd_mod.POOL_CA_DIR, "readOnly": True}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[POOL_TLS_CA_ENV] == f"{pdd_mod.POOL_CA_DIR}/ca.crt", role
    # The engines keep their same-node shared-memory mount next to the CA.
    for role in (Role.PREFILL, Role.DECODE):
        assert {v["name"] for v in pods[role]["spec"]["volumes"]} == {"dev-shm", "pool-ca"}


def test_engines_of_a_plain_pool_get_no_ca() -> None:
    for role, template in _serving_pods(_pool(tls=False)).items():
        spec = template["spec"]
        assert "pool-ca" not in {v["name"] for v in spec.get("volumes", [])}, role
        assert POOL_TLS_CA_ENV not in {e["name"] for e in spec["containers"][0]["env"]}, role


def test_tls_pool_changes_the_pdd_revision_so_engines_roll() -> None:
    assert (pdd_mod.build(_pdd(), _pool(tls=True), image=IMAGE).revision
            != pdd_mod.build(_pdd(), _pool(tls=False), image=IMAGE).revision)


# -- the engines' one reader of the CA env -------------------------------------------------------
def test_pool_tls_ca_file_reads_the_env_and_the_flag_wins(tmp_path: Path) -> None:
    ca, flag = tmp_path / "ca.crt", tmp_path / "flag.crt"
    ca.write_text("pem")
    flag.write_text("pem")
    assert pool_tls_ca_file({}) is None
    assert pool_tls_ca_file({POOL_TLS_CA_ENV: "  "}) is None
    assert pool_tls_ca_file({POOL_TLS_CA_ENV: str(ca)}) == str(ca)
    assert pool_tls_ca_file({POOL_TLS_CA_ENV: str(ca)}, override=str(flag)) == str(flag)


def test_pool_tls_ca_file_refuses_an_unreadable_file_naming_its_source(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.crt")
    with pytest.raises(TlsSettingsError, match=rf"nope\.crt.*\${POOL_TLS_CA_ENV}.*unreadable"):
        pool_tls_ca_file({POOL_TLS_CA_ENV: missing})
    with pytest.raises(TlsSettingsError, match="from the flag"):
        pool_tls_ca_file({}, override=missing)


def test_sim_engine_takes_the_ca_from_the_operators_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("pem")
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    base = ["--pool-endpoints", "127.0.0.1:7400", "--token", "t" * 32]
    monkeypatch.delenv(POOL_TLS_CA_ENV, raising=False)
    assert sim.settings_from(parser.parse_args(base)).pool_tls_ca_file is None
    monkeypatch.setenv(POOL_TLS_CA_ENV, str(ca))
    settings = sim.settings_from(parser.parse_args(base))
    assert settings.pool_tls_ca_file == str(ca)
    assert f"pool_tls=ca:{ca}" in settings.describe()
    monkeypatch.setenv(POOL_TLS_CA_ENV, str(tmp_path / "missing.crt"))
    with pytest.raises(ValueError, match="unreadable"):
        sim.settings_from(parser.parse_args(base))
