#!/usr/bin/env python3
"""GPU check for the store's HBM tier: put/get 1 MiB and 16 MiB blocks host<->HBM vs plain copies, byte-exact.

Run from the repository root on a machine with an NVIDIA GPU:

    python3 hack/gpu_check_store.py [--gib 2] [--rounds 3]

Needs only the standard library, numpy and prometheus-client: the package is
imported straight from the source tree (no install), and wheels found in
``.whl/`` (nvidia-ml-py, crc32c, prometheus-client) are unpacked onto the path
when the interpreter lacks them (``--check-imports`` tries just that). For each block size it times, in the same run and on
the same pageable host buffers:

- raw:  the runtime's plain host-to-device / device-to-host copy of every block;
- tier: the store's HBM tier path, blocks reserved, copied and committed in
  batches of 16 (put), then acquired, copied out and released (get);

and prints GB/s and the ratio tier/raw (target >= 0.8), then checks every
block read back from the tier byte for byte. Exit status 0 when every check
passed, 1 when one failed, 2 when there is no usable NVIDIA GPU (with why).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 16


def _import_tree(*, needs: list[str]) -> None:
    """Make ``daybreak.*`` importable from the source folders; exit 3 naming what ``needs`` lacks (``hack/linktree.py``)."""
    sys.path.insert(0, str(ROOT / "hack"))  # linktree.py, also with PYTHONSAFEPATH set
    import linktree

    linktree.prepare(ROOT, "gpu_check_store", needs)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gib", type=float, default=2.0, help="bytes moved per measurement, in GiB")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per case (the best one is reported)")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--check-imports", action="store_true",
                        help="only import what the check needs (exit 0, or 3 naming what is missing) and stop")
    args = parser.parse_args()

    _import_tree(needs=["numpy", "prometheus_client"])
    import numpy as np

    from daybreak.agent.runtime import load_runtime
    from daybreak.agent.store.engine import BlockStore, Reservation, StoreConfig
    from daybreak.agent.store.tiers import HbmTier

    if args.check_imports:
        print("gpu_check_store: imports ok")
        return 0

    loaded = load_runtime("nvidia")
    if loaded.name != "nvidia" or not loaded.runtime.devices():
        why = "; ".join(f"{k}: {v}" for k, v in loaded.skipped.items()) or "no devices"
        print(f"gpu_check_store: no usable NVIDIA GPU here ({why}); nothing was measured", file=sys.stderr)
        return 2
    rt = loaded.runtime
    dev = rt.devices()[args.device]
    print(f"device {args.device}: {dev.model} {dev.pci_bus_id} {dev.memory_bytes / 2**30:.0f} GiB")

    total = int(args.gib * (1 << 30))
    prefix = f"daybreak-gpucheck-{uuid.uuid4().hex[:6]}"
    hbm = HbmTier(runtime=rt, device=args.device, capacity=2 * total + (64 << 20))
    store = BlockStore(StoreConfig(prefix=prefix, dram_bytes=64 << 20, hbm=hbm,
                                   high_watermark=0.95, low_watermark=0.9))
    store.open()
    raw_dev = rt.allocate(args.device, total)
    failures = 0
    try:
        for size in (1 << 20, 16 << 20):
            count = total // size
            host = np.random.default_rng(size).integers(0, 256, count * size, dtype=np.uint8)
            out = np.zeros_like(host)
            blocks = [host[i * size:(i + 1) * size] for i in range(count)]
            outs = [out[i * size:(i + 1) * size] for i in range(count)]
            best = {"raw put": 0.0, "raw get": 0.0, "tier put": 0.0, "tier get": 0.0}
            for r in range(args.rounds):
                keys = [f"r{r}-{size}-{i}" for i in range(count)]
                t = time.perf_counter()
                for i, b in enumerate(blocks):
                    rt.copy_to_device(raw_dev, b, offset=i * size)
                best["raw put"] = max(best["raw put"], _gbps(total, time.perf_counter() - t))
                t = time.perf_counter()
                for i, o in enumerate(outs):
                    rt.copy_to_host(o, raw_dev, offset=i * size)
                best["raw get"] = max(best["raw get"], _gbps(total, time.perf_counter() - t))

                t = time.perf_counter()
                for start in range(0, count, BATCH):
                    batch = []
                    for i in range(start, min(start + BATCH, count)):
                        res = store.reserve(keys[i], size, 0, tier="hbm")
                        if not isinstance(res, Reservation) or res.tier != "hbm":
                            raise RuntimeError(f"no HBM space for block {i}: {res}")
                        store.write_hbm(res, blocks[i])
                        batch.append(res)
                    store.commit(batch)
                best["tier put"] = max(best["tier put"], _gbps(total, time.perf_counter() - t))
                out[:] = 0
                t = time.perf_counter()
                for start in range(0, count, BATCH):
                    held = store.acquire(keys[start:start + BATCH])
                    for j, block in enumerate(held):
                        if block is None or block.tier != "hbm":
                            raise RuntimeError(f"block {start + j} not in HBM")
                        store.read_hbm_into(block, outs[start + j])
                    store.release(held)
                best["tier get"] = max(best["tier get"], _gbps(total, time.perf_counter() - t))
                exact = bool(np.array_equal(out, host))
                failures += not exact
                store.remove(keys)
                print(f"  round {r}: {size >> 20} MiB x {count}: byte-exact={exact}")
            label = f"{size >> 20} MiB"
            for op in ("put", "get"):
                ratio = best[f"tier {op}"] / best[f"raw {op}"]
                ok = ratio >= 0.8
                failures += not ok
                print(f"{label} {op}: HBM tier {best[f'tier {op}']:.2f} GB/s, plain "
                      f"{'H2D' if op == 'put' else 'D2H'} copy {best[f'raw {op}']:.2f} GB/s, ratio {ratio:.2f} "
                      f"({'ok' if ok else 'BELOW 0.8'})")
    finally:
        rt.free(raw_dev)
        store.close(unlink=True)
    print("PASS" if not failures else f"FAIL ({failures} check(s) failed)")
    return 0 if not failures else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    sys.exit(main())
