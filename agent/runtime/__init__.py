"""Accelerator runtimes behind one interface: sunrise (Tang/PTML), nvidia (NVML/CUDA), host.

Standard library only at import time: vendor modules load inside ``load_runtime``.
"""

from daybreak.agent.runtime.base import (
    AcceleratorRuntime,
    DeviceBuffer,
    DeviceInfo,
    HostRegistration,
    PeerLink,
    RuntimeCallError,
    RuntimeUnavailable,
    Unsupported,
    normalize_bus_id,
)
from daybreak.agent.runtime.loader import LoadedRuntime, load_runtime

__all__ = [
    "AcceleratorRuntime",
    "DeviceBuffer",
    "DeviceInfo",
    "HostRegistration",
    "LoadedRuntime",
    "PeerLink",
    "RuntimeCallError",
    "RuntimeUnavailable",
    "Unsupported",
    "load_runtime",
    "normalize_bus_id",
]
