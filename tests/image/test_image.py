"""The container image builds here with `make image` and its entrypoint runs in a chroot as the image's user.

`make image` installs what the build needs (mmdebstrap, umoci) and reuses every cached layer, so a warm run
takes about a second; a cold one takes minutes (docs/image.md). The entrypoint, user and environment come
from the image's own OCI configuration, the root filesystem from umoci's unpack of the tagged image.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from daybreak.devenv import image as im
from daybreak.version import __version__

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1800)  # a cold build: root filesystem, wheels, three layers


@pytest.fixture(scope="module")
def built() -> im.Paths:
    if os.geteuid() != 0:
        pytest.fail("the image build needs root (chroot, file ownership); run the tests as root")
    proc = subprocess.run(["make", "image"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"make image failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return im.Paths(ROOT)


def _in_image(paths: im.Paths, argv: Sequence[str], *, entrypoint: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (after the entrypoint, as a container runtime would) as the image's user and environment."""
    config = im.image_config(paths, __version__)["config"]
    rootfs = paths.rootfs / "rootfs"
    command = [*config["Entrypoint"], *argv] if entrypoint else list(argv)
    return subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", f"--mount-proc={rootfs / 'proc'}",
         "chroot", f"--userspec={config['User']}", str(rootfs), "env", "-i", *config["Env"], *command],
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_the_image_is_tagged_with_the_version_and_runs_as_a_non_root_user(built: im.Paths) -> None:
    tags = im.tags(built)
    assert tags[__version__]["digest"] == tags["latest"]["digest"]
    config = im.image_config(built, __version__)
    assert config["os"] == "linux" and config["architecture"] == "amd64"
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Entrypoint"] == ["daybreak"]
    labels = config["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["org.opencontainers.image.title"] == "daybreak"
    # Three layers: Debian, the venv with the requirements, the project's wheel.
    assert len(config["rootfs"]["diff_ids"]) == 3
    passwd = (built.rootfs / "rootfs" / "etc" / "passwd").read_text()
    assert re.search(r"^daybreak:x:65532:65532:", passwd, re.M), passwd
    # The build machine's resolver must not be baked in.
    assert not (built.rootfs / "rootfs" / "etc" / "resolv.conf").exists()


def test_the_entrypoint_prints_the_package_version(built: im.Paths) -> None:
    proc = _in_image(built, ["version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"daybreak {__version__}"


def test_the_agent_help_runs_in_the_image(built: im.Paths) -> None:
    proc = _in_image(built, ["agent", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: daybreak agent")
    assert "--listen" in proc.stdout


def test_the_kubectl_plugin_and_status_command_are_in_the_image(built: im.Paths) -> None:
    proc = _in_image(built, ["kubectl-daybreak", "status", "--help"], entrypoint=False)
    assert proc.returncode == 0, proc.stderr
    assert "--all-namespaces" in proc.stdout and "-o {table,json}" in proc.stdout


def test_the_image_user_is_65532_and_pyverbs_imports_from_the_venv(built: im.Paths) -> None:
    probe = ("import os, pyverbs.device, pyverbs; "
             "print(os.getuid(), os.getgid(), pyverbs.__file__)")
    proc = _in_image(built, ["/opt/daybreak/bin/python", "-c", probe], entrypoint=False)
    assert proc.returncode == 0, proc.stderr
    uid, gid, where = proc.stdout.split()
    assert (uid, gid) == ("65532", "65532")
    assert where.startswith("/opt/daybreak/lib/python3.11/site-packages/pyverbs/")
    # rdma-core's user-space providers (what libibverbs loads for mlx5, efa, rxe, ...).
    drivers = {p.name for p in (built.rootfs / "rootfs" / "etc" / "libibverbs.d").iterdir()}
    assert {"mlx5.driver", "rxe.driver"} <= drivers


def test_a_second_build_reuses_every_layer(built: im.Paths) -> None:
    proc = subprocess.run(["make", "image"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    for layer in ("base", "deps", "app"):
        assert f"layer {layer} cached" in proc.stdout, proc.stdout


def test_the_dockerfile_runs_the_same_packages_and_steps_as_the_local_build() -> None:
    """The Dockerfile cannot be built here (no registry); it must at least not drift from the local build."""
    text = (ROOT / "image" / "Dockerfile").read_text()
    assert "image/packages.txt" in text and "image/setup.sh" in text and "hack/pyverbs.sh" in text
    for step in ("setup.sh user", "setup.sh deps", "setup.sh app"):
        assert step in text, step
    assert re.findall(r"^ARG VERSION=(\S+)$", text, re.M) == [__version__]
    assert re.search(r"^USER 65532:65532$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["daybreak"\]$', text, re.M)
