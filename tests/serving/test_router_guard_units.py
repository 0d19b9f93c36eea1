"""The router's admission pieces alone: credentials, per-client counts, salts, the output cap, private usage,
and what the operator renders for ``spec.router.auth`` and ``spec.router.cacheStatistics``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daybreak.api.kvpool import KVPool
from daybreak.api.pddeployment import PDDeployment
from daybreak.client import block_hashes
from daybreak.operator import deployment as pdd_mod
from daybreak.serving import openai
from daybreak.serving.router.auth import AuthConfigError, Credentials, credential_salt
from daybreak.serving.router.limits import ConcurrencyLimits, client_id

TOKEN = "a-token-of-enough-length"


def test_credentials_map_a_bearer_token_to_its_name_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "alice").write_text(TOKEN + "\n")
    (tmp_path / "short").write_text("too-short")
    (tmp_path / "..data").mkdir()
    creds = Credentials(tmp_path)
    assert creds.names == ["alice"]
    assert creds.identify(f"Bearer {TOKEN}") == "alice" and creds.identify(f"bearer  {TOKEN} ") == "alice"
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer too-short", "Bearer "):
        assert creds.identify(header) is None, header
    # A re-read that finds nothing keeps the last good set (a transient error must not lock everyone out).
    (tmp_path / "alice").unlink()
    assert creds.load() is False and creds.identify(f"Bearer {TOKEN}") == "alice"
    with pytest.raises(AuthConfigError, match="no credential"):
        Credentials(tmp_path)
    with pytest.raises(AuthConfigError, match="cannot list"):
        Credentials(tmp_path / "missing")


def test_credential_salts_never_collide_across_credentials() -> None:
    assert credential_salt("alice", None) == credential_salt("alice", "")
    assert credential_salt("alice", None) != credential_salt("bob", None)
    # Whatever bob sends as his own salt, the result is bob's, never alice's.
    assert credential_salt("bob", credential_salt("alice", None)) != credential_salt("alice", None)
    assert credential_salt("a", '","b') != credential_salt('a","', "b")


def test_a_salt_changes_every_block_key() -> None:
    tokens = list(range(64))
    plain, salted = block_hashes(tokens, block_tokens=16), block_hashes(tokens, block_tokens=16, salt="t")
    assert len(plain) == len(salted) == 4 and not set(plain) & set(salted)


def test_concurrency_is_counted_per_client_and_released() -> None:
    limits = ConcurrencyLimits(per_client=2)
    a, b = client_id(credential=None, peer="10.0.0.1"), client_id(credential="alice", peer="10.0.0.1")
    assert a != b
    assert limits.try_acquire(a) and limits.try_acquire(a) and not limits.try_acquire(a)
    assert limits.try_acquire(b)
    limits.release(a)
    assert limits.try_acquire(a)
    for _ in range(2):
        limits.release(a)
    assert limits.in_flight(a) == 0 and a not in limits._in_flight
    assert all(ConcurrencyLimits(per_client=0).try_acquire(a) for _ in range(1000))


def test_max_tokens_must_fit_the_context_beside_the_prompt() -> None:
    assert openai.max_tokens({"max_tokens": 96}, context_length=100, prompt_tokens=4) == 96
    assert openai.max_tokens({}, context_length=100, prompt_tokens=90) == 10  # the default shrinks to fit
    with pytest.raises(openai.RequestError, match=r"max_tokens: 97 .*context length 100.* 4 tokens is 96"):
        openai.max_tokens({"max_tokens": 97}, context_length=100, prompt_tokens=4)
    with pytest.raises(openai.RequestError, match="max_completion_tokens"):
        openai.max_tokens({"max_completion_tokens": 1000}, context_length=100, prompt_tokens=4)
    with pytest.raises(openai.RequestError, match=r"^prompt: 100 tokens leave no room"):
        openai.max_tokens({"max_tokens": 1}, context_length=100, prompt_tokens=100)


def test_cache_salt_is_checked_and_usage_can_be_made_private() -> None:
    assert openai.cache_salt({}) is None and openai.cache_salt({"cache_salt": "t"}) == "t"
    for bad in ("", 3, ["x"], "x" * 1025):
        with pytest.raises(openai.RequestError, match="cache_salt"):
            openai.cache_salt({"cache_salt": bad})
    usage = openai.usage_dict(prompt_tokens=10, completion_tokens=2, cached_tokens=8, daybreak={})
    assert openai.without_cache_statistics(usage) == {"prompt_tokens": 10, "completion_tokens": 2,
                                                      "total_tokens": 12}


def _router_container(spec_router: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pool = KVPool.model_validate({"metadata": {"name": "pool", "namespace": "ns"},
                                  "spec": {"tiers": {"dram": {"bytesPerNode": "1Gi"}}}})
    pdd = PDDeployment.model_validate({
        "metadata": {"name": "sim", "namespace": "ns"},
        "spec": {"poolRef": {"name": "pool"}, "model": {"name": "m", "revision": "r1", "kvLayout": {
            "numLayers": 2, "numKVHeads": 1, "headDim": 8, "blockTokens": 16}},
            "engine": {"kind": "sim"}, "router": spec_router}})
    template = pdd_mod.router_template(pdd, pool, image="daybreak:test")
    return template["spec"], template["spec"]["containers"][0]


def test_the_operator_mounts_the_router_auth_secret_and_passes_the_flags() -> None:
    spec, container = _router_container({})
    assert "--auth-dir" not in container["command"] and "--cache-statistics" not in container["command"]
    assert "--debug-headers" not in container["command"]
    spec, container = _router_container({"auth": {"secretName": "router-tokens"}, "cacheStatistics": True})
    command = container["command"]
    assert command[command.index("--auth-dir") + 1] == pdd_mod.ROUTER_AUTH_DIR
    assert "--cache-statistics" in command
    assert {"name": "router-auth", "secret": {"secretName": "router-tokens"}} in spec["volumes"]
    assert {"name": "router-auth", "mountPath": pdd_mod.ROUTER_AUTH_DIR, "readOnly": True} in \
        container["volumeMounts"]
    with pytest.raises(ValueError, match="secretName"):
        _router_container({"auth": {"secretName": "Not_A_Name"}})
