"""A self-check of the engine's device-memory paths on a machine with a real accelerator runtime.

``python -m daybreak.testing.devicecheck [--mib N]`` allocates device
memory in this process and in a peer process (same node), moves it both ways
through whatever chain the engine picks (link where the runtime can open the
peer's IPC handle, else tcp staged through host memory), checks every byte by
hash and prints the route and throughput. Exit status 0 means byte-exact.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import uuid

from daybreak.agent.runtime import load_runtime
from daybreak.agent.transfer.batch import TransferRequest
from daybreak.agent.transfer.engine import TransferEngine
from daybreak.testing.transfer_peer import PeerProcess

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mib", type=int, default=512, help="device memory per side, MiB")
    parser.add_argument("--block-mib", type=int, default=4)
    parser.add_argument("--runtime", default="auto")
    args = parser.parse_args(argv)
    loaded = load_runtime(args.runtime)
    runtime = loaded.runtime
    print(f"runtime={loaded.name} skipped={loaded.skipped} devices={[d.model for d in runtime.devices()]}", flush=True)
    if not runtime.devices():
        print("no accelerator: nothing to check", flush=True)
        return 2
    size, block = args.mib * MiB, args.block_mib * MiB
    node = f"check-{uuid.uuid4().hex[:6]}"
    local_buf = runtime.allocate(0, size)
    failures = 0
    with PeerProcess(segment_bytes=size, node=node, transports="link,shm,tcp", device=0,
                     runtime=loaded.name) as peer, TransferEngine(node=node, runtime=runtime) as engine:
        local = engine.register_segment(local_buf, name="local-hbm")
        remote = engine.open_remote(peer.descriptor)
        print(f"transports={engine.transports} route={engine.route(remote)} "
              f"ipc_handle={'yes' if remote.descriptor.device and remote.descriptor.device.ipc_handle else 'no'}",
              flush=True)
        data = os.urandom(size)
        runtime.copy_to_device(local_buf, data)
        want = hashlib.sha256(data).hexdigest()
        for op in ("write", "read"):
            if op == "read":
                peer_hash = peer.hash(0, size)
                runtime.copy_to_device(local_buf, bytes(size))
            requests = [(TransferRequest.write if op == "write" else TransferRequest.read)(
                remote, off, local, local_offset=off, length=block) for off in range(0, size, block)]
            start = time.perf_counter()
            results = engine.transfer(requests, timeout_s=300)
            elapsed = time.perf_counter() - start
            if op == "write":
                got = peer.hash(0, size)
            else:
                out = bytearray(size)
                runtime.copy_to_host(out, local_buf)
                got = hashlib.sha256(out).hexdigest()
                want = peer_hash
            ok = got == want
            failures += not ok
            print(f"{op}: {size / MiB:.0f} MiB in {len(requests)} requests via {sorted({r.transport for r in results})} "
                  f"{size / elapsed / 1e9:.2f} GB/s byte-exact={ok}", flush=True)
        host = bytearray(os.urandom(8 * MiB))
        engine.transfer([TransferRequest.write(remote, 0, host)])
        ok = peer.hash(0, len(host)) == hashlib.sha256(host).hexdigest()
        failures += not ok
        print(f"host->device write: byte-exact={ok}", flush=True)
    runtime.free(local_buf)
    print("DEVICE CHECK " + ("PASSED" if not failures else f"FAILED ({failures})"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
