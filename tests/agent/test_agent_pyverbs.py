"""The real distribution pyverbs (python3-pyverbs, installed by `make rdma-deps`) through our shim.

The rest of the registration tests run against a fake of the pyverbs surface;
this one loads the real bindings, so an enum-API or import-path change in the
distribution package shows up here rather than on a customer's RDMA node.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from daybreak.agent.registration import RdmaUnavailable, Registrar, Verbs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pyverbs") is None,
    reason="python3-pyverbs is not installed in this venv (make rdma-deps installs it where apt-get works)",
)


def test_real_pyverbs_loads_with_its_enum_module_and_access_flags() -> None:
    verbs = Verbs.load()
    assert verbs.enum_module in ("pyverbs.libibverbs_enums", "pyverbs.enums")
    # LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ are 1 | 2 | 4 in every rdma-core release.
    assert verbs.access & 0b111 == 0b111


def test_device_listing_matches_the_machine() -> None:
    verbs = Verbs.load()
    present = sorted(p.name for p in Path("/sys/class/infiniband").glob("*")) if Path("/sys/class/infiniband").is_dir() else []
    if present:
        assert sorted(verbs.device_names()) == present
    else:
        with pytest.raises(RdmaUnavailable, match="get_device_list failed"):
            verbs.device_names()


def test_registrar_on_a_machine_without_the_named_nic_falls_back_to_tcp() -> None:
    reg = Registrar.open(["mlx5_does_not_exist"])
    assert not reg.rdma
    assert reg.transports() == ["tcp"]
    assert reg.status.startswith("rdma unavailable: ")
