"""One credentials loader for operator, agent and engines: which source wins, and what a missing one says."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daybreak.client.kubeconfig import KubeConfig, KubeConfigError, load_kube_config


def _kubeconfig(path: Path, *, server: str, namespace: str) -> Path:
    path.write_text(f"""
apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}"}}}}]
users: [{{name: u, user: {{token: secret-token}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u, namespace: {namespace}}}}}]
current-context: x
""")
    return path


def _service_account(folder: Path, *, namespace: str) -> Path:
    folder.mkdir()
    (folder / "token").write_text("pod-token")
    (folder / "ca.crt").write_text("not checked until a request")
    (folder / "namespace").write_text(namespace)
    return folder


def _load(kubeconfig: str | None, **kw: str) -> KubeConfig:
    return asyncio.run(load_kube_config(kubeconfig, **kw))


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No KUBECONFIG, not in a Pod, and a HOME without ~/.kube/config."""
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_a_given_kubeconfig_wins_even_in_a_pod(bare_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bare_env.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    path = _kubeconfig(tmp_path / "kc", server="https://127.0.0.1:6443", namespace="team-a")
    loaded = _load(str(path))
    assert (loaded.in_cluster, loaded.default_namespace) == (False, "team-a")
    assert loaded.configuration.host == "https://127.0.0.1:6443"


def test_kubeconfig_from_the_environment_outside_a_pod(bare_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bare_env.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kc", server="https://127.0.0.2:6443", namespace="b")))
    loaded = _load(None)
    assert (loaded.in_cluster, loaded.default_namespace, loaded.configuration.host) == (
        False, "b", "https://127.0.0.2:6443")


def test_in_a_pod_the_service_account_wins_over_a_stray_kubeconfig(bare_env: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    bare_env.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    bare_env.setenv("KUBERNETES_SERVICE_PORT", "443")
    bare_env.setenv("KUBECONFIG", "/nonexistent")
    sa = _service_account(tmp_path / "sa", namespace="pods-ns")
    loaded = _load(None, service_account_dir=str(sa))
    assert (loaded.in_cluster, loaded.default_namespace, loaded.token_path) == (True, "pods-ns", str(sa / "token"))
    assert loaded.configuration.host == "https://10.0.0.1:443"


def test_no_source_at_all_is_one_error_naming_each(bare_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match=r"no KUBECONFIG set, no in-cluster ServiceAccount .*\.kube/config"):
        _load(None)
    with pytest.raises(KubeConfigError, match=r"no KUBECONFIG set and no in-cluster ServiceAccount"):
        _load("", service_account_dir=str(tmp_path / "none"))


def test_an_unreadable_kubeconfig_names_the_file(bare_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match=r"kubeconfig .*/missing: .*set KUBECONFIG"):
        _load(str(tmp_path / "missing"))
