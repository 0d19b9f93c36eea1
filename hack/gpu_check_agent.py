"""GPU check for the node agent's nvidia runtime, run on a lent NVIDIA machine (H200) in about two minutes.

Usage (from the repository root, any Python 3.11+ with nvidia-ml-py):
    python3 hack/gpu_check_agent.py [--bytes N] [--json OUT]

It builds a ``daybreak`` link tree in a temporary directory (the repository
folders map to subpackages through setuptools' package-dir, so a plain
checkout is not importable as ``daybreak``), then uses the agent's own code:
the nvidia runtime enumerates the GPUs (PCI bus id, memory), allocates 1 GiB,
copies host -> device -> device -> host with a checksum, exports an IPC
handle and tries a dma-buf export, reporting the exact result; finally the
node topology of the real /sys is printed with that runtime merged in, and
what RDMA registration would say. Needs neither pydantic nor kubernetes.
Exit status: 0 all checks passed, 1 a check failed, 2 no usable NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "hack"))  # linktree.py, also with PYTHONSAFEPATH set

import linktree  # noqa: E402


def say(line: str) -> None:
    print(line, flush=True)


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"


def pattern(nbytes: int) -> bytearray:
    """Non-trivial host data quickly: numpy's generator when present, else a repeated urandom block."""
    try:
        import numpy as np

        return bytearray(np.random.default_rng(20240601).integers(0, 256, size=nbytes, dtype=np.uint8).tobytes())
    except ImportError:
        block = os.urandom(1 << 20)
        data = bytearray(block * (nbytes // len(block) + 1))
        del data[nbytes:]
        for i in range(0, nbytes, 4096):  # make every page distinct
            data[i:i + 8] = i.to_bytes(8, "little")
        return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=1 << 30, help="buffer size (default 1 GiB)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--check-imports", action="store_true",
                        help="only import what the check needs (exit 0, or 3 naming what is missing) and stop")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"python": sys.version.split()[0]}
    started = time.monotonic()

    tree = linktree.import_source_tree(REPO)
    from daybreak.agent.registration import Registrar
    from daybreak.agent.runtime import RuntimeCallError, RuntimeUnavailable, Unsupported
    from daybreak.agent.runtime.nvidia import NvidiaRuntime, describe
    from daybreak.agent.topo_cmd import render
    from daybreak.agent.topology import discover

    blocked = [m for m in ("pydantic", "kubernetes", "kubernetes_asyncio", "kopf") if m in sys.modules]
    if args.check_imports:
        print(f"gpu_check_agent: imports ok (heavy modules imported: {blocked or 'none'})")
        return 1 if blocked else 0
    say(f"python={results['python']} daybreak_tree={tree} heavy_modules_imported={blocked or 'none'}")

    try:
        rt = NvidiaRuntime.load()
    except RuntimeUnavailable as exc:
        say(f"NO NVIDIA GPU: the nvidia runtime did not load: {exc.reason}")
        results["error"] = exc.reason
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 2

    failures: list[str] = []
    devices = rt.devices()
    results["driver_version"] = rt.driver_version
    results["devices"] = [d.__dict__ for d in devices]
    say(f"cuda_driver_version={rt.driver_version} devices={len(devices)}")
    for line in describe(devices):
        say(f"  {line}")
    links = rt.peer_links()
    say(f"nvlink_bundles={[(p.a, p.b, f'NV{p.links}') for p in links] or 'none'}")

    n = args.bytes
    host = pattern(n)
    want = hashlib.sha256(host).hexdigest()
    say(f"host buffer: {n} bytes sha256={want[:16]}...")
    a = b = None
    try:
        t = time.monotonic()
        a = rt.allocate(0, n)
        b = rt.allocate(0, n)
        say(f"allocate: 2 x {n} bytes on device 0 ok ({time.monotonic() - t:.3f}s) "
            f"a=0x{a.address:x} b=0x{b.address:x} size={a.size}")

        t = time.monotonic()
        rt.copy_to_device(a, host)
        h2d = time.monotonic() - t
        t = time.monotonic()
        rt.copy_device(b, a, n)
        d2d = time.monotonic() - t
        back = bytearray(n)
        t = time.monotonic()
        rt.copy_to_host(back, b)
        d2h = time.monotonic() - t
        got = hashlib.sha256(back).hexdigest()
        ok = got == want
        results["copy"] = {"bytes": n, "h2d_s": h2d, "d2d_s": d2d, "d2h_s": d2h, "checksum_ok": ok}
        say(f"copy host->device {gbps(n, h2d)}, device->device {gbps(n, d2d)}, device->host {gbps(n, d2h)} "
            "(pageable host memory, synchronous)")
        say(f"checksum: {'MATCH' if ok else 'MISMATCH'} sha256={got[:16]}...")
        if not ok:
            failures.append("checksum mismatch after host->device->device->host")

        handle = rt.ipc_handle(a)
        results["ipc_handle_bytes"] = len(handle)
        say(f"ipc handle: {len(handle)} bytes, {handle[:16].hex()}...")

        try:
            fd = rt.export_dmabuf(a)
            target = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(fd)
            results["dmabuf"] = {"supported": True, "fd": fd, "target": target, "size": st.st_size}
            say(f"dma-buf export: SUPPORTED fd={fd} -> {target} (fstat size {st.st_size})")
            os.close(fd)
        except Unsupported as exc:
            results["dmabuf"] = {"supported": False, "reason": str(exc)}
            say(f"dma-buf export: UNSUPPORTED: {exc}")
        except RuntimeCallError as exc:
            results["dmabuf"] = {"supported": False, "error": str(exc)}
            say(f"dma-buf export: FAILED: {exc}")
    except (RuntimeCallError, ValueError, MemoryError) as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        say(f"FAILED: {exc}")
    finally:
        for buf in (a, b):
            if buf is not None:
                rt.free(buf)

    topo = discover("/sys", runtime=rt.name, runtime_devices=devices, peer_links=links)
    say("--- daybreak topo (real /sys, nvidia runtime merged) ---")
    say(render(topo))
    results["topology"] = topo.to_json()
    gpus_seen = [g.pci_bus_id for g in topo.gpus]
    if not all(d.pci_bus_id in gpus_seen for d in devices):
        failures.append(f"sysfs topology missed a runtime device: runtime {[d.pci_bus_id for d in devices]}, "
                        f"topology {gpus_seen}")
    reg = Registrar.open([nic.name for nic in topo.nics if nic.active], peer_memory=bool(topo.peer_memory))
    results["rdma"] = reg.status
    say(f"registration: {reg.status}; transports={reg.transports()}")
    reg.close()
    rt.close()

    results["elapsed_s"] = time.monotonic() - started
    results["failures"] = failures
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    say(f"RESULT: {'PASS' if not failures else 'FAIL: ' + '; '.join(failures)} "
        f"(elapsed {results['elapsed_s']:.1f}s)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
