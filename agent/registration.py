"""Register the store's memory with every usable RDMA NIC through pyverbs, keeping lkey/rkey/IOVA per NIC.

pyverbs is optional and comes from the distribution (Debian ``python3-pyverbs``),
loaded through the one shim, ``daybreak.agent.runtime.verbs``. Host segments get a plain ``MR``; device segments a
``DmaBufMR`` over the runtime's dma-buf fd (IOVA = offset, not the virtual
address) or, failing that, a peer-memory ``MR`` on the device address.
Without pyverbs, without RDMA devices, or when nothing registers, the
registrar reports ``rdma unavailable: <reason>`` and the node advertises tcp
only: a logged fallback, never an error.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from daybreak.agent.runtime.base import AcceleratorRuntime, DeviceBuffer, Unsupported
from daybreak.agent.runtime.verbs import Importer, RdmaUnavailable, Verbs

log = logging.getLogger(__name__)

Method = Literal["host", "dmabuf", "peermem"]

__all__ = ["MemoryRegistrar", "RdmaUnavailable", "Registrar", "Registration", "Segment", "Verbs", "host_segment"]


@dataclass(frozen=True)
class Segment:
    """A region the store serves: host memory (shared-memory segment) or device memory."""

    name: str
    address: int
    length: int
    kind: Literal["host", "device"] = "host"
    buffer: DeviceBuffer | None = None  # device segments: the runtime's buffer (for dma-buf export)

    def __post_init__(self) -> None:
        if self.length <= 0:
            raise ValueError(f"length: segment {self.name!r} must have a positive length, got {self.length}")
        if self.kind == "device" and self.buffer is None:
            raise ValueError(f"buffer: device segment {self.name!r} needs its DeviceBuffer")


def host_segment(name: str, buffer: Any) -> Segment:
    """A host Segment for a writable buffer (a ShmSegment's ``buffer``, an mmap); the caller keeps it mapped."""
    with memoryview(buffer) as view:
        if view.readonly:
            raise ValueError(f"buffer: segment {name!r} must be writable memory")
        nbytes = view.nbytes
        with view.cast("B") as flat:
            chars = (ctypes.c_char * nbytes).from_buffer(flat)
            address = ctypes.addressof(chars)
            del chars  # release the export at once: only the address is kept
    return Segment(name=name, address=address, length=nbytes)


@dataclass(frozen=True)
class Registration:
    """One segment on one NIC: what a remote peer needs for RDMA READ/WRITE."""

    segment: str
    nic: str
    lkey: int
    rkey: int
    iova: int
    length: int
    method: Method

    def to_json(self) -> dict[str, Any]:
        return {"segment": self.segment, "nic": self.nic, "lkey": self.lkey, "rkey": self.rkey, "iova": self.iova,
                "length": self.length, "method": self.method}


class MemoryRegistrar(Protocol):
    """What the node agent needs from whatever registers the store's memory: the Registrar below, or an
    adapter over the rdma transport's own MRs (so the published keys are the ones peers must use)."""

    @property
    def rdma(self) -> bool: ...

    @property
    def status(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def nic_names(self) -> list[str]: ...

    @property
    def registrations(self) -> Mapping[str, Sequence[Registration]]: ...

    @property
    def problems(self) -> Mapping[str, str]: ...

    def transports(self) -> list[str]: ...

    def register(self, segment: Segment, *, runtime: AcceleratorRuntime | None = None) -> Sequence[Registration]: ...

    def deregister(self, name: str) -> None: ...

    def close(self) -> None: ...


@dataclass
class _Nic:
    name: str
    ctx: Any
    pd: Any


@dataclass
class Registrar:
    """Per-NIC protection domains and the MRs of every registered segment."""

    verbs: Verbs | None = None
    nics: list[_Nic] = field(default_factory=list)
    reason: str = ""
    peer_memory: bool = False
    registrations: dict[str, list[Registration]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)  # segment -> why (part of) it did not register
    _mrs: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def rdma(self) -> bool:
        return bool(self.nics)

    @property
    def status(self) -> str:
        return "rdma available" if self.rdma else f"rdma unavailable: {self.reason}"

    @property
    def nic_names(self) -> list[str]:
        return [n.name for n in self.nics]

    def transports(self) -> list[str]:
        return ["rdma", "tcp"] if self.rdma and any(self.registrations.values()) else ["tcp"]

    @classmethod
    def open(cls, nic_names: Sequence[str], *, peer_memory: bool = False,
             importer: Importer = importlib.import_module) -> Registrar:
        """Open each named NIC (those the topology found with an ACTIVE port); never raises."""
        if not nic_names:
            return cls._unavailable("no RDMA device with an ACTIVE port")
        try:
            verbs = Verbs.load(importer)
            present = set(verbs.device_names())
        except RdmaUnavailable as exc:
            return cls._unavailable(str(exc))
        if not present:
            return cls._unavailable("pyverbs lists no RDMA devices")
        reg = cls(verbs=verbs, peer_memory=peer_memory)
        failures = []
        for name in nic_names:
            if name not in present:
                failures.append(f"{name}: not listed by pyverbs")
                continue
            try:
                ctx, pd = verbs.open(name)
            except Exception as exc:
                failures.append(f"{name}: {exc}")
                log.warning("rdma nic=%s step=open error=%r", name, str(exc))
                continue
            reg.nics.append(_Nic(name, ctx, pd))
        if not reg.nics:
            return cls._unavailable("; ".join(failures) or "no usable RDMA device")
        log.info("rdma status=available nics=%s enums=%s", ",".join(n.name for n in reg.nics), verbs.enum_module)
        return reg

    @classmethod
    def _unavailable(cls, reason: str) -> Registrar:
        log.info("rdma status=unavailable reason=%r transports=tcp", reason)
        return cls(reason=reason)

    def register(self, segment: Segment, *, runtime: AcceleratorRuntime | None = None) -> list[Registration]:
        """Register ``segment`` with every open NIC; idempotent by segment name."""
        if segment.name in self.registrations:
            return self.registrations[segment.name]
        done: list[Registration] = []
        mrs: list[Any] = []
        verbs = self.verbs
        if verbs is None:
            self.problems[segment.name] = self.status
            return done
        for nic in self.nics:
            method: Method
            try:
                if segment.kind == "host":
                    mr = verbs.reg_host(nic.pd, segment.address, segment.length)
                    iova, method = segment.address, "host"
                else:
                    mr, iova, method = self._register_device(verbs, nic, segment, runtime)
            except Exception as exc:  # pyverbs raises PyverbsRDMAError/PyverbsError; Unsupported from us
                self.problems[segment.name] = f"{nic.name}: {exc}"
                log.warning("rdma segment=%s nic=%s kind=%s error=%r", segment.name, nic.name, segment.kind, str(exc))
                continue
            mrs.append(mr)
            done.append(Registration(segment=segment.name, nic=nic.name, lkey=int(mr.lkey), rkey=int(mr.rkey),
                                     iova=iova, length=segment.length, method=method))
        self.registrations[segment.name] = done
        self._mrs[segment.name] = mrs
        return done

    def _register_device(self, verbs: Verbs, nic: _Nic, segment: Segment,
                         runtime: AcceleratorRuntime | None) -> tuple[Any, int, Method]:
        assert segment.buffer is not None
        why = []
        if runtime is not None:
            fd = -1
            try:
                fd = runtime.export_dmabuf(segment.buffer)
                return verbs.reg_dmabuf(nic.pd, fd, segment.length), 0, "dmabuf"
            except Unsupported as exc:
                why.append(f"dma-buf: {exc}")
            finally:
                if fd >= 0:
                    # The MR holds its own reference to the dma-buf; our fd is no longer needed.
                    with contextlib.suppress(OSError):
                        os.close(fd)
        if self.peer_memory:
            return verbs.reg_host(nic.pd, segment.address, segment.length), segment.address, "peermem"
        why.append("peer memory: no peer-memory client loaded")
        raise Unsupported("; ".join(why))

    def deregister(self, name: str) -> None:
        for mr in self._mrs.pop(name, []):
            with contextlib.suppress(Exception):
                mr.close()
        self.registrations.pop(name, None)
        self.problems.pop(name, None)

    def close(self) -> None:
        """Deregister everything, then free PDs and contexts (shutdown)."""
        for name in list(self._mrs):
            self.deregister(name)
        for nic in self.nics:
            for obj in (nic.pd, nic.ctx):
                with contextlib.suppress(Exception):
                    obj.close()
        self.nics.clear()

    def to_json(self) -> dict[str, Any]:
        return {"rdma": self.rdma, "status": self.status, "nics": self.nic_names,
                "transports": self.transports(),
                "registrations": [r.to_json() for regs in self.registrations.values() for r in regs],
                "problems": dict(self.problems)}
