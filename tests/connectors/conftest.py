"""Fixtures the vLLM tests share: the vLLM environment's interpreter and the tiny model built locally."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from daybreak.devenv import vllmenv


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The interpreter of ``make vllm-env``; a missing environment fails (never skips) with how to install it."""
    try:
        return vllmenv.require()
    except vllmenv.VllmEnvError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``daybreak.testing.tinymodel``'s small random-weight Llama (128-token blocks on vLLM's CPU backend)."""
    out = tmp_path_factory.mktemp("tiny-model") / "model"
    subprocess.run([str(vllm_python), "-m", "daybreak.testing.tinymodel", "--out", str(out)], check=True,
                   env={"HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"},
                   capture_output=True, timeout=300)
    return out
