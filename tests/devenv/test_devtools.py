"""The tool builder's pure logic: wrapper replace lines and override order."""

from __future__ import annotations

from pathlib import Path

import pytest

from daybreak.devenv import tools
from daybreak.devenv.versions import TOOLS

GOMOD = """module k8s.io/kubernetes

go 1.26.0

require (
\tk8s.io/api v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go // a comment
\tgithub.com/foo/bar v1.0.0 => github.com/fork/bar v1.0.1
)

replace example.com/single => ../single
"""


def test_wrapper_maps_local_replaces_to_published_versions() -> None:
    lines = tools.wrapper_replaces(TOOLS["kubernetes"], GOMOD)
    assert lines == [
        "k8s.io/api => k8s.io/api v0.37.2",
        "k8s.io/client-go => k8s.io/client-go v0.37.2",
        "github.com/foo/bar v1.0.0 => github.com/fork/bar v1.0.1",
        "example.com/single => example.com/single v0.37.2",
    ]


def test_local_replace_without_version_is_an_error() -> None:
    with pytest.raises(tools.ToolError, match="local path"):
        tools.wrapper_replaces(TOOLS["helm"], "replace x => ./x\n")


def test_overrides_win_over_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "kube-apiserver"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    assert tools.find("kube-apiserver") == fake
    explicit = tmp_path / "other-apiserver"
    explicit.write_text("")
    monkeypatch.setenv("TEST_ASSET_KUBE_APISERVER", str(explicit))
    assert tools.find("kube-apiserver") == explicit
    monkeypatch.setenv("TEST_ASSET_KUBE_APISERVER", str(tmp_path / "missing"))
    with pytest.raises(tools.ToolError, match="does not exist"):
        tools.find("kube-apiserver")


def test_missing_binary_names_the_command_that_builds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYBREAK_TOOLS_DIR", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.delenv("TEST_ASSET_ETCD", raising=False)
    with pytest.raises(tools.ToolError, match="make tools"):
        tools.find("etcd")
