#!/usr/bin/env python3
"""GPU check for the store's engine data path: a client device buffer put to and got from the HBM tier of an
agent in another process over the link (CUDA IPC), byte-exact, with its GB/s next to cudaMemcpy.

Run from the repository root on a machine with an NVIDIA GPU (NOT RUN YET: no GPU was lent to the task
that wrote it):

    python3 hack/gpu_check_datapath.py [--mib 256] [--block-mib 16] [--rounds 3]

It starts ``daybreak agent --standalone --hbm <2x mib>`` as a child process (its HBM tier is one device
allocation, registered with the agent's transfer engine and exported by CUDA IPC), then in this process
allocates device buffers, fills them, and through ``KVPoolClient(engine=TransferEngine(runtime=nvidia))``
puts them with ``tier="hbm"`` (XALLOC, link WRITE device->device through the IPC mapping, COMMIT with the
agent's CRC) and gets them back into other device buffers (XLOCATE, link READ, RELEASE). Every block is
compared by sha256 of its bytes copied to the host. Baseline in the same run: the runtime's
device-to-device copy (cuMemcpyDtoD / cudaMemcpy) of the same bytes. Exit 0 when everything was
byte-exact and the link carried every byte, 1 when a check failed, 2 without a usable GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_tree(*, needs: list[str]) -> None:
    """Make ``daybreak.*`` importable from the source folders; exit 3 naming what ``needs`` lacks (``hack/linktree.py``)."""
    sys.path.insert(0, str(ROOT / "hack"))  # linktree.py, also with PYTHONSAFEPATH set
    import linktree

    linktree.prepare(ROOT, "gpu_check_datapath", needs)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per round, in MiB")
    parser.add_argument("--block-mib", type=int, default=16, help="block size in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check-imports", action="store_true",
                        help="only import what the check needs (exit 0, or 3 naming what is missing) and stop")
    args = parser.parse_args()
    # The engine's segment descriptors are pydantic models, its counters prometheus ones, and the agent
    # this check starts (the same interpreter, PYTHONPATH set by the tree) reads its settings with both.
    _import_tree(needs=["pydantic", "prometheus_client", "yaml"])
    from daybreak.agent.runtime import load_runtime
    from daybreak.agent.transfer import TransferEngine
    from daybreak.client import KVPoolClient
    from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

    if args.check_imports:
        print("gpu_check_datapath: imports ok")
        return 0

    loaded = load_runtime("nvidia")
    if loaded.name != "nvidia" or not loaded.runtime.devices():
        print(f"no usable NVIDIA GPU: {loaded.skipped}")
        return 2
    rt = loaded.runtime
    block = args.block_mib << 20
    count = max(1, (args.mib << 20) // block)
    pool = f"gpudp{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix="daybreak-gpudp-"))
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=work / "token", pool=pool, dram="256Mi",
                       extra=["--hbm", f"{2 * count * args.block_mib + 64}Mi"], log_path=work / "agent.log")
    failures = 0
    os.environ["DAYBREAK_RUNTIME"] = "nvidia"
    agent.start(timeout_seconds=120)
    try:
        print([line.strip() for line in agent.lines if "preflight" in line])
        token = agent.token_file.read_text().strip()
        src = [rt.allocate(0, block) for _ in range(count)]
        dst = [rt.allocate(0, block) for _ in range(count)]
        want = []
        for i, buf in enumerate(src):
            payload = os.urandom(block) if i < 2 else bytes([i % 251]) * block
            rt.copy_to_device(buf, memoryview(payload))
            want.append(hashlib.sha256(payload).hexdigest())
        with TransferEngine(token=token, runtime=rt) as engine, \
                KVPoolClient([agent.address], token=token, namespace="gpu", engine=engine) as client:
            best = {"put": 0.0, "get": 0.0, "memcpy": 0.0}
            for r in range(args.rounds):
                keys = [f"r{r}-{i}" for i in range(count)]
                t = time.perf_counter()
                stored = client.batch_put(keys, src, tier="hbm")
                best["put"] = max(best["put"], _gbps(count * block, time.perf_counter() - t))
                t = time.perf_counter()
                sizes = client.batch_get_into(keys, dst)
                best["get"] = max(best["get"], _gbps(count * block, time.perf_counter() - t))
                t = time.perf_counter()
                for a, b in zip(dst, src, strict=True):
                    rt.copy_device(a, b, block)
                best["memcpy"] = max(best["memcpy"], _gbps(count * block, time.perf_counter() - t))
                sizes = client.batch_get_into(keys, dst)
                exact = stored == [1] * count and sizes == [block] * count
                for buf, digest in zip(dst, want, strict=True):
                    out = bytearray(block)
                    rt.copy_to_host(out, buf)
                    exact = exact and hashlib.sha256(out).hexdigest() == digest
                print(f"  round {r}: {count} x {args.block_mib} MiB: byte-exact={exact}")
                failures += not exact
            if set(engine.bytes_used) != {"link"}:
                print(f"FAIL: bytes went by {engine.bytes_used}, not only the link (fell back: {engine.bytes_fell_back})")
                failures += 1
            for op in ("put", "get"):
                print(f"{args.block_mib} MiB {op} device buffer <-> HBM tier of another process: {best[op]:.2f} GB/s, "
                      f"device-to-device copy {best['memcpy']:.2f} GB/s, ratio {best[op] / best['memcpy']:.2f}")
        for buf in src + dst:
            rt.free(buf)
    finally:
        agent.stop()
        cleanup_pool(pool)
    print("PASS" if not failures else f"FAIL ({failures} check(s) failed)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
