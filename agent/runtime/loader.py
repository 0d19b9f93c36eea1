"""Choose the accelerator runtime at run time: sunrise, then nvidia, then host; each failure is one log line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from daybreak.agent.runtime.base import AcceleratorRuntime, RuntimeUnavailable
from daybreak.agent.runtime.host import HostRuntime

log = logging.getLogger(__name__)

ORDER = ("sunrise", "nvidia")


@dataclass
class LoadedRuntime:
    """The runtime in use and why each earlier candidate was skipped (published in the node status)."""

    runtime: AcceleratorRuntime
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.runtime.name


def _load_sunrise(lib_dir: str) -> AcceleratorRuntime:
    from daybreak.agent.runtime.sunrise import SunriseRuntime

    return SunriseRuntime.load(lib_dir=lib_dir)


def _load_nvidia(lib_dir: str) -> AcceleratorRuntime:
    from daybreak.agent.runtime.nvidia import NvidiaRuntime

    return NvidiaRuntime.load()


LOADERS: dict[str, Callable[[str], AcceleratorRuntime]] = {"sunrise": _load_sunrise, "nvidia": _load_nvidia}


def load_runtime(choice: str = "auto", *, sunrise_lib_dir: str = "") -> LoadedRuntime:
    """Try the chosen runtime (or all, for ``auto``) and fall back to host; never raises for lack of a GPU."""
    if choice not in ("auto", "host", *ORDER):
        raise ValueError(f"runtime: expected auto, sunrise, nvidia or host, got {choice!r}")
    candidates = ORDER if choice == "auto" else tuple(c for c in ORDER if c == choice)
    skipped: dict[str, str] = {}
    for name in candidates:
        try:
            runtime = LOADERS[name](sunrise_lib_dir)
        except RuntimeUnavailable as exc:
            skipped[name] = exc.reason
            log.info("runtime=%s status=unavailable reason=%r", name, exc.reason)
            continue
        except Exception as exc:  # a vendor library misbehaving must not take the agent down
            skipped[name] = f"{type(exc).__name__}: {exc}"
            log.warning("runtime=%s status=failed reason=%r", name, skipped[name])
            continue
        log.info("runtime=%s status=loaded devices=%d", name, len(runtime.devices()))
        return LoadedRuntime(runtime, skipped)
    log.info("runtime=host status=loaded devices=0")
    return LoadedRuntime(HostRuntime(), skipped)
