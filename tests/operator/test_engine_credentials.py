"""The engines' namespace-credential Secret: its name, shape and what the minter picks (pure builders)."""

from __future__ import annotations

from typing import Any

import pytest

from daybreak.agent.credentials_minter import namespaces_in_use
from daybreak.pool.credentials import CredentialError, Scope, namespace_credential, parse
from daybreak.pool.engine_secret import SECRET_KEY, credential_secret_name, engine_credential_secret

SECRET = b"s" * 40


def test_one_secret_name_per_kv_namespace_stable_and_valid() -> None:
    a, b = credential_secret_name("sim-llama", "ns-a"), credential_secret_name("sim-llama", "ns-b")
    assert a.startswith("sim-llama-kv-") and b.startswith("sim-llama-kv-") and a != b
    assert credential_secret_name("sim-llama", "ns-a") == a  # the operator and the agents agree
    long = credential_secret_name("x" * 253, "ns-a")
    assert len(long) == 253 and long.endswith(a.removeprefix("sim-llama"))


def test_secret_holds_the_namespace_credential_owned_by_the_deployment() -> None:
    body: Any = engine_credential_secret(pool_secret=SECRET, kv_namespace="ns-a", pdd="sim-llama", pdd_uid="u-1",
                                         namespace="team", pool="kv")
    assert body["metadata"]["name"] == credential_secret_name("sim-llama", "ns-a")
    assert body["metadata"]["namespace"] == "team" and body["immutable"] is True
    assert body["metadata"]["ownerReferences"] == [{"apiVersion": "daybreak.dev/v1alpha1", "kind": "PDDeployment",
                                                    "name": "sim-llama", "uid": "u-1"}]
    assert body["metadata"]["annotations"] == {"daybreak.dev/kv-namespace": "ns-a"}
    token = body["stringData"][SECRET_KEY]
    assert token == namespace_credential(SECRET, "ns-a")
    scope, _ = parse(token)
    assert scope == Scope("ns:", "ns-a")  # never the pool secret (admin)
    assert SECRET.decode() not in token


def test_a_namespace_the_agents_would_refuse_is_never_minted() -> None:
    with pytest.raises(CredentialError):
        engine_credential_secret(pool_secret=SECRET, kv_namespace="../x", pdd="p", pdd_uid="u", namespace="n",
                                 pool="kv")


def test_minted_namespaces_cover_a_rollout() -> None:
    pdd = {"metadata": {"name": "p"}, "spec": {"poolRef": {"name": "kv"}},
           "status": {"kvNamespace": "new-ns", "retiringKVNamespace": {"kvNamespace": "old-ns"}}}
    # The spec here does not validate as a PDDeployment: the status names are still minted, bad ones dropped.
    assert namespaces_in_use(pdd) == ["new-ns", "old-ns"]
    pdd["status"] = {"kvNamespace": "bad/ns"}
    assert namespaces_in_use(pdd) == []
