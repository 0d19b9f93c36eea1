"""The one pyverbs shim: imports the bindings, hides the two enum layouts, and says why RDMA is unavailable.

pyverbs is optional and comes from the distribution (Debian ``python3-pyverbs``).
rdma-core v59 and later expose the ``IBV_*`` constants as members of enum
classes in ``pyverbs.libibverbs_enums``; older releases (Debian's 44) as module
constants in ``pyverbs.enums``. ``Verbs.load`` imports whichever exists and
``enum`` reads a constant from either. Both users stand on this module: the
node side's memory registrar (``agent/registration.py``) and the rdma transport.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from daybreak.agent.runtime.base import Unsupported
from daybreak.errors import DaybreakError

Importer = Callable[[str], ModuleType]

# The pyverbs modules the registrar needs; the rdma transport adds the queue-pair ones.
REGISTRATION_MODULES = ("device", "pd", "mr")
TRANSPORT_MODULES = ("device", "pd", "mr", "cq", "qp", "addr", "wr")
ENUM_MODULES = ("pyverbs.libibverbs_enums", "pyverbs.enums")  # rdma-core v59 and later first
# ABI values of ibv_access_flags (verbs.h); used only if neither enum module names them.
_ACCESS_FALLBACK = {"IBV_ACCESS_LOCAL_WRITE": 1, "IBV_ACCESS_REMOTE_WRITE": 2, "IBV_ACCESS_REMOTE_READ": 4}


class RdmaUnavailable(DaybreakError):
    """RDMA cannot be used here (pyverbs missing, no devices, no active port); the message is the reason."""


def lookup(enums: Any, name: str) -> int | None:
    """``IBV_*`` constant by name: module level (old pyverbs.enums) or inside an enum class (v59); None if absent."""
    value = getattr(enums, name, None)
    if value is not None:
        return int(value)
    for item in vars(enums).values():
        if isinstance(item, type):
            member = getattr(item, name, None)
            if member is not None:
                return int(member)
    return None


def enum(verbs: Any, name: str) -> int:
    """``IBV_*`` constant of ``verbs.enums`` by name; RdmaUnavailable when this pyverbs lacks it."""
    value = lookup(verbs.enums, name)
    if value is None:
        raise RdmaUnavailable(f"pyverbs has no constant {name}")
    return value


class Verbs:
    """The pyverbs surface Daybreak uses, whichever rdma-core generation provides it.

    Attributes ``device``, ``pd``, ``mr`` (and with the transport modules ``cq``, ``qp``,
    ``addr``, ``wr``) are the pyverbs modules; ``enums`` the enum module and
    ``enum_module`` its name; ``access`` LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ.
    """

    def __init__(self, *, modules: dict[str, ModuleType], enums: ModuleType, enum_module: str) -> None:
        for name, module in modules.items():
            setattr(self, name, module)
        self.device: Any = modules["device"]
        self.pd: Any = modules["pd"]
        self.mr: Any = modules["mr"]
        self.enums = enums
        self.enum_module = enum_module
        access = 0
        for name, value in _ACCESS_FALLBACK.items():
            found = lookup(enums, name)
            access |= value if found is None else found
        self.access = access

    def __getattr__(self, name: str) -> Any:
        # cq, qp, addr, wr: set in __init__ when loaded; a clear error when they were not
        raise AttributeError(f"pyverbs module {name!r} was not loaded (Verbs.load(modules=...))")

    @classmethod
    def load(cls, importer: Importer = importlib.import_module, *,
             modules: Sequence[str] = REGISTRATION_MODULES) -> Verbs:
        """Import pyverbs' ``modules`` and whichever enum module exists; RdmaUnavailable otherwise."""
        try:
            loaded = {m: importer(f"pyverbs.{m}") for m in modules}
        except ImportError as exc:
            raise RdmaUnavailable(f"pyverbs not importable ({exc}); install python3-pyverbs and put "
                                  "/usr/lib/python3/dist-packages on the path (make rdma-deps)") from None
        for name in ENUM_MODULES:
            try:
                return cls(modules=loaded, enums=importer(name), enum_module=name)
            except ImportError:
                continue
        raise RdmaUnavailable("pyverbs has neither libibverbs_enums nor enums")

    def device_names(self) -> list[str]:
        try:
            devices = self.device.get_device_list()
        except Exception as exc:  # PyverbsRDMAError('Failed to get devices list') where there are none
            raise RdmaUnavailable(f"pyverbs get_device_list failed: {exc}") from None
        return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]

    def open(self, name: str) -> tuple[Any, Any]:
        """A device context and a protection domain on it."""
        ctx = self.device.Context(name=name)
        try:
            return ctx, self.pd.PD(ctx)
        except Exception:
            ctx.close()
            raise

    def reg_host(self, pd: Any, address: int, length: int) -> Any:
        return self.mr.MR(pd, length, self.access, address=address)

    def reg_dmabuf(self, pd: Any, fd: int, length: int, *, offset: int = 0) -> Any:
        cls = getattr(self.mr, "DmaBufMR", None)
        if cls is None:
            raise Unsupported("pyverbs has no DmaBufMR (rdma-core older than v34)")
        try:
            return cls(pd, length, self.access, dmabuf=fd, offset=offset)
        except TypeError as exc:
            # rdma-core's DmaBufMR takes only its own DRM-allocated DmaBuf object, not a foreign fd.
            raise Unsupported(f"pyverbs DmaBufMR does not accept a dma-buf fd ({exc})") from None
