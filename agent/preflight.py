"""No silent fallback: the agent's transport preflight at start and the per-transport conditions it publishes.

At start every transport the engine brought up proves itself once: a host
buffer (and for link a device buffer) is registered and a loopback WRITE then
READ through exactly that transport moves a pattern and reads it back. A
transport that fails, or whose request completed only on a later transport
of its chain, is ``degraded`` with the reason. While the agent runs, the
engine counts the bytes every completed request moved per transport and the
bytes that fell back from their preferred transport
(``daybreak_transfer_fallback_bytes``); ``conditions`` folds both into one
condition per transport for the node's ``KVNode`` (``status.transports``).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from daybreak.agent.transfer.batch import Status, TransferRequest
from daybreak.agent.transfer.transport import RemoteSegment
from daybreak.pool.shm import ShmSegment

log = logging.getLogger(__name__)

PROBE_BYTES = 1 << 16


@dataclass
class TransportCheck:
    transport: str
    works: bool
    reason: str = ""


class Preflight:
    """Runs the loopback checks on one started engine and turns what it saw into KVNode conditions."""

    def __init__(self, *, engine: Any, runtime: Any = None) -> None:
        self.engine = engine
        self.runtime = runtime
        self.checks: dict[str, TransportCheck] = {}

    def run(self) -> Preflight:
        for name in self.engine.transports:
            try:
                check = self._check(name)
            except Exception as exc:  # a check that blows up is a finding, never a crash of the agent
                check = TransportCheck(name, False, f"preflight raised {type(exc).__name__}: {exc}")
            self.checks[name] = check
            level = logging.INFO if check.works else logging.WARNING
            log.log(level, "event=preflight transport=%s works=%s reason=%r", name, check.works, check.reason)
        return self

    def _check(self, name: str) -> TransportCheck:
        pattern = os.urandom(PROBE_BYTES)
        cleanup: list[Any] = []
        try:
            if name == "shm":
                seg = ShmSegment.create(f"daybreak-preflight-{uuid.uuid4().hex[:12]}", PROBE_BYTES)
                cleanup.append(seg.unlink)
                cleanup.append(seg.close)
                target = self.engine.register_segment(seg)
            elif name == "link":
                if self.runtime is None or not list(self.runtime.devices()):
                    return TransportCheck(name, False, "no accelerator runtime with a device to check the link on")
                buffer = self.runtime.allocate(0, PROBE_BYTES)
                cleanup.append(lambda: self.runtime.free(buffer))
                target = self.engine.register_segment(buffer)
            else:  # tcp, rdma: plain host memory
                target = self.engine.register_segment(bytearray(PROBE_BYTES))
            cleanup.insert(0, lambda: self.engine.unregister_segment(target))
            remote = RemoteSegment(target.descriptor, same_node=name != "rdma")
            remote.chain = self.engine._chain(remote, local_device=False)  # rdma: as a peer on another node
            if not remote.chain or remote.chain[0] != name:
                return TransportCheck(name, False, f"the segment's route is {'->'.join(remote.chain) or 'empty'}, "
                                                   f"not {name}")
            back = bytearray(PROBE_BYTES)
            source: Any = pattern
            if name == "rdma":  # rdma moves registered memory only: a registered local side
                local = bytearray(2 * PROBE_BYTES)
                local[:PROBE_BYTES] = pattern
                source = self.engine.register_segment(local)
                cleanup.insert(0, lambda: self.engine.unregister_segment(source))
            for request in (TransferRequest.write(remote, 0, source, length=PROBE_BYTES),
                            TransferRequest.read(remote, 0, source if name == "rdma" else back,
                                                 local_offset=PROBE_BYTES if name == "rdma" else 0,
                                                 length=PROBE_BYTES)):
                batch = self.engine.submit([request], timeout_s=5.0)
                batch.wait()
                result = batch.results[0]
                if result.status is not Status.COMPLETED:
                    return TransportCheck(name, False, f"loopback {request.op.value} failed: {result.error}")
                if result.transport != name:
                    return TransportCheck(name, False, f"loopback {request.op.value} fell back to "
                                                       f"{result.transport}: {result.error or 'path failed'}")
            if name == "rdma":
                back[:] = local[PROBE_BYTES:]
            if bytes(back) != pattern:
                return TransportCheck(name, False, "loopback read back different bytes")
            return TransportCheck(name, True)
        finally:
            for undo in cleanup:  # unregister, unlink, then close
                try:
                    undo()
                except Exception:
                    log.debug("preflight cleanup failed transport=%s", name, exc_info=True)

    def conditions(self) -> list[dict[str, Any]]:
        """One condition per transport: ``works`` or ``degraded`` with the reason, plus what traffic used."""
        fell = getattr(self.engine, "bytes_fell_back", {})
        used = getattr(self.engine, "bytes_used", {})
        out = []
        for name, check in self.checks.items():
            lost = {to: n for (frm, to), n in fell.items() if frm == name}
            reason = check.reason
            if check.works and lost:
                reason = "requests fell back: " + ", ".join(f"{n} bytes to {to}" for to, n in sorted(lost.items()))
            out.append({"transport": name, "state": "works" if check.works and not lost else "degraded",
                        "reason": reason, "bytesUsed": used.get(name, 0),
                        "bytesFellBack": sum(lost.values())})
        return out
