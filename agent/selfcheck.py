"""``daybreak selfcheck``: move a pattern through every data path this node has; byte-exact or not, and how fast.

What an operator runs on a new node (and what replaced the ``hack/gpu_check_*``
scripts and ``testing/devicecheck``). Each path moves random bytes one way and
back and compares every byte:

- ``shm``: two transfer engines of this node, host memory through /dev/shm;
- ``tcp``: two engines over loopback tcp;
- ``rdma``: two engines as two nodes over this node's RDMA NICs (the NIC loops the bytes back);
- ``device``: the accelerator runtime's own copies, host -> device -> device -> host (the
  allocation, copy and IPC-export calls every device path stands on);
- ``link``: device memory to device memory of ANOTHER PROCESS through the accelerator
  runtime (IPC handle + peer copy; CUDA opens no IPC handle in the process that exported it);
- ``pool``: host buffers put into a store agent and got back (``KVPoolClient``);
- ``device-pool``: device buffers put into an agent's HBM tier and got back through the engine.

The pool paths start a private standalone agent (``daybreak agent --standalone``, its
/dev/shm segments removed afterwards) unless ``--pool-endpoint`` names one to use.

A path this node does not have (no RDMA device, no accelerator) is *absent*: ``ok`` is
false, ``gb_per_s`` null and ``reason`` says what is missing; it does not fail the
command unless ``--require`` names it. A path that exists but moves wrong bytes, falls
back to another transport or errors is *failed* and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from daybreak.agent.runtime import load_runtime
from daybreak.agent.runtime.base import AcceleratorRuntime, DeviceBuffer
from daybreak.agent.store.tiers import slug
from daybreak.agent.transfer import registry as transport_registry
from daybreak.agent.transfer.batch import RequestResult, TransferRequest
from daybreak.agent.transfer.engine import TransferEngine
from daybreak.agent.transfer.transport import LocalSegment
from daybreak.pool.shm import SHM_DIR, ShmSegment

log = logging.getLogger(__name__)

PATHS = ("shm", "tcp", "rdma", "device", "link", "pool", "device-pool")
MiB = 1 << 20
EXIT_OK, EXIT_FAILED = 0, 1
# Generous for a 2-core machine moving 64 MiB through a Python tcp stack; a hung path still ends.
TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class PathResult:
    """One path's outcome; ``to_json`` is the ``--json`` entry."""

    path: str
    ok: bool
    gb_per_s: float | None = None
    """Bytes moved both ways over the seconds the moves took (write/put and read/get), 1e9 bytes per second."""
    reason: str | None = None
    """Why the path failed or is absent; None when ok."""
    absent: bool = False
    """The node lacks this path (not a failure unless required)."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gb_per_s"] = None if self.gb_per_s is None else round(self.gb_per_s, 3)
        return out


def absent(path: str, reason: str) -> PathResult:
    return PathResult(path=path, ok=False, reason=reason, absent=True)


def failed(path: str, reason: str) -> PathResult:
    return PathResult(path=path, ok=False, reason=reason)


@dataclass(frozen=True)
class Options:
    """What the check moves and where (the command-line flags of the same names)."""

    size_bytes: int = 64 * MiB
    block_bytes: int = 4 * MiB
    """Block size of the pool paths (one key per block)."""
    runtime: str = "auto"
    sunrise_lib_dir: str = ""
    pool_endpoint: str = ""
    """An agent to use for the pool paths (``host:port``) instead of starting a private one."""
    token_file: str = ""
    """The pool token of ``pool_endpoint`` (the pool secret or a namespace credential)."""
    namespace: str = "daybreak-selfcheck"
    timeout_seconds: float = TIMEOUT_SECONDS


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _transports_used(results: Sequence[RequestResult]) -> set[str]:
    return {r.transport for r in results}


def _fallbacks(engine: TransferEngine, *batches: Sequence[RequestResult]) -> str:
    """Which fallbacks the engine took and what failed, for a path that did not carry its bytes alone."""
    took = ", ".join(f"{a} -> {b}" for a, b in engine.bytes_fell_back) or "no fallback recorded"
    said = "; ".join(dict.fromkeys(r.error for batch in batches for r in batch if r.error))
    return f"fell back {took}" + (f": {said}" if said else "; the engine's log has the cause")


class _DisabledReasons(logging.Handler):
    """Collects the registry's 'transfer <name> disabled ... cause=...' lines: why a transport stayed off."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.causes: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("transfer ") and " disabled " in message and "cause=" in message:
            name = message.split()[1]
            self.causes[name] = message.split("cause=", 1)[1].split(" fallback=")[0].strip("'\"")


@contextlib.contextmanager
def _disabled_reasons() -> Iterator[_DisabledReasons]:
    handler = _DisabledReasons()
    registry = transport_registry.log  # the logger that says why a transport stayed off
    level = registry.level
    registry.addHandler(handler)
    if registry.getEffectiveLevel() > logging.INFO:
        registry.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        registry.removeHandler(handler)
        registry.setLevel(level)


# -- host paths: two engines in this process ---------------------------------------------------------------

def check_host_path(path: str, *, options: Options, verbs: Any = None) -> PathResult:
    """shm, tcp or rdma between two engines: write a pattern into the far engine's segment, read it back.

    rdma: the two engines carry different node names, so their route is rdma (then tcp); on a
    real node the queue pairs connect through the NIC and back.
    """
    size = options.size_bytes
    tag = uuid.uuid4().hex[:8]
    transports = {"shm": ("shm",), "tcp": ("tcp",), "rdma": ("rdma", "tcp")}[path]
    nodes = (f"selfcheck-{tag}", f"selfcheck-{tag}" if path != "rdma" else f"selfcheck-{tag}-far")
    shm: ShmSegment | None = None
    with _disabled_reasons() as reasons, \
            TransferEngine(node=nodes[0], transports=transports, verbs=verbs) as near, \
            TransferEngine(node=nodes[1], transports=transports, verbs=verbs) as far:
        if path not in near.transports:
            return absent(path, reasons.causes.get(path, f"the {path} transport did not start"))
        try:
            if path == "shm":
                shm = ShmSegment.create(f"daybreak-selfcheck-{tag}", size)
                far_memory: Any = shm
                far_view = shm.buffer
            else:
                far_memory = bytearray(size)
                far_view = memoryview(far_memory)
            segment = far.register_segment(far_memory, name=f"selfcheck-{path}")
            remote = near.open_remote(segment.descriptor.to_json())
            route = near.route(remote)
            if route[:1] != (path,):
                return failed(path, f"the engine routes this segment over {list(route)}, not {path}")
            data = os.urandom(size)
            local = bytearray(data)
            # Registered like an engine's KV memory (rdma moves only registered memory: an MR per NIC).
            mine = near.register_segment(local, name=f"selfcheck-{path}-local")
            # One untimed pass first: page faults of fresh memory and connection set-up are not the path's speed.
            near.transfer([TransferRequest.write(remote, 0, mine)], timeout_s=options.timeout_seconds)
            far_view[:] = bytes(size)
            started = time.perf_counter()
            wrote = near.transfer([TransferRequest.write(remote, 0, mine)], timeout_s=options.timeout_seconds)
            write_s = time.perf_counter() - started
            if bytes(far_view) != data:
                return failed(path, "the bytes written differ from the pattern")
            local[:] = bytes(size)
            started = time.perf_counter()
            read = near.transfer([TransferRequest.read(remote, 0, mine)], timeout_s=options.timeout_seconds)
            read_s = time.perf_counter() - started
            used = _transports_used(wrote) | _transports_used(read)
            if used != {path}:
                return failed(path, f"bytes went by {sorted(used)}, not {path} alone ("
                                    f"{_fallbacks(near, wrote, read)})")
            if bytes(local) != data:
                return failed(path, "the bytes read back differ from the pattern")
            del far_view
            return PathResult(path=path, ok=True, gb_per_s=_gbps(2 * size, write_s + read_s))
        except Exception as exc:
            return failed(path, f"{type(exc).__name__}: {exc}")
        finally:
            if shm is not None:
                far.close()  # stop serving before unmapping
                with contextlib.suppress(BufferError):
                    shm.close()
                shm.unlink()


# -- device link: a peer process ---------------------------------------------------------------------------

class _Peer:
    """A transfer engine with one device segment in a child process (``python -m daybreak.agent.selfcheck --peer``)."""

    def __init__(self, *, node: str, device: int, size: int, options: Options) -> None:
        argv = [sys.executable, "-m", "daybreak.agent.selfcheck", "--peer", "--node", node, "--device", str(device),
                "--bytes", str(size), "--runtime", options.runtime, "--sunrise-lib-dir", options.sunrise_lib_dir]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONSAFEPATH": "1"})
        self.descriptor = self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process exited with {self.proc.wait()} before answering")
        return line.strip()

    def sha256(self, offset: int, length: int) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"hash {offset} {length}\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _device_sha256(runtime: AcceleratorRuntime, buffer: DeviceBuffer, length: int) -> str:
    digest = hashlib.sha256()
    piece = bytearray(min(length, 64 * MiB))
    for start in range(0, length, len(piece)):
        view = memoryview(piece)[:min(len(piece), length - start)]
        runtime.copy_to_host(view, buffer, offset=start)
        digest.update(view)
    return digest.hexdigest()


def check_link(runtime: AcceleratorRuntime, *, options: Options) -> PathResult:
    """Device 0 of this process to a device of a peer process (device 1 when there is one) and back."""
    devices = runtime.devices()
    size = options.size_bytes
    node = f"selfcheck-{uuid.uuid4().hex[:8]}"
    local: DeviceBuffer | None = None
    peer: _Peer | None = None
    try:
        peer = _Peer(node=node, device=1 if len(devices) > 1 else 0, size=size, options=options)
        local = runtime.allocate(devices[0].index, size)
        data = os.urandom(size)
        want = hashlib.sha256(data).hexdigest()
        runtime.copy_to_device(local, data)
        with TransferEngine(node=node, runtime=runtime, transports=("link", "tcp")) as engine:
            if "link" not in engine.transports:
                return failed("link", "the link transport did not start although the runtime has devices")
            segment: LocalSegment = engine.register_segment(local, name="selfcheck-link")
            remote = engine.open_remote(peer.descriptor)
            if not (remote.descriptor.device and remote.descriptor.device.ipc_handle):
                return failed("link", f"the {runtime.name} runtime exported no IPC handle for the peer's memory")
            started = time.perf_counter()
            wrote = engine.transfer([TransferRequest.write(remote, 0, segment)], timeout_s=options.timeout_seconds)
            write_s = time.perf_counter() - started
            if peer.sha256(0, size) != want:
                return failed("link", "the bytes written differ from the pattern")
            runtime.copy_to_device(local, bytes(size))
            started = time.perf_counter()
            read = engine.transfer([TransferRequest.read(remote, 0, segment)], timeout_s=options.timeout_seconds)
            read_s = time.perf_counter() - started
            used = _transports_used(wrote) | _transports_used(read)
            if used != {"link"}:
                return failed("link", f"bytes went by {sorted(used)}, not the link alone ("
                                      f"{_fallbacks(engine, wrote, read)})")
            if _device_sha256(runtime, local, size) != want:
                return failed("link", "the bytes read back differ from the pattern")
            return PathResult(path="link", ok=True, gb_per_s=_gbps(2 * size, write_s + read_s))
    except Exception as exc:
        return failed("link", f"{type(exc).__name__}: {exc}")
    finally:
        if peer is not None:
            peer.close()
        if local is not None:
            runtime.free(local)


def check_device(runtime: AcceleratorRuntime, *, options: Options) -> PathResult:
    """Host -> device 0 -> a second buffer on device 0 -> host through the runtime, and an IPC handle export."""
    size = options.size_bytes
    device = runtime.devices()[0].index
    buffers: list[DeviceBuffer] = []
    try:
        buffers = [runtime.allocate(device, size), runtime.allocate(device, size)]
        data = os.urandom(size)
        back = bytearray(size)
        started = time.perf_counter()
        runtime.copy_to_device(buffers[0], data)
        runtime.copy_device(buffers[1], buffers[0], size)
        runtime.copy_to_host(back, buffers[1])
        seconds = time.perf_counter() - started
        if back != data:
            return failed("device", "host -> device -> device -> host changed the bytes")
        if not runtime.ipc_handle(buffers[0]):
            return failed("device", f"the {runtime.name} runtime exported an empty IPC handle")
        return PathResult(path="device", ok=True, gb_per_s=_gbps(3 * size, seconds))
    except Exception as exc:
        return failed("device", f"{type(exc).__name__}: {exc}")
    finally:
        for buf in buffers:
            runtime.free(buf)


def _peer_main(args: argparse.Namespace) -> int:
    """The child side of ``check_link``: serve one device segment, answer ``hash OFF LEN`` until ``quit``."""
    loaded = load_runtime(args.runtime, sunrise_lib_dir=args.sunrise_lib_dir)
    runtime = loaded.runtime
    buffer = runtime.allocate(args.device, args.bytes)
    try:
        with TransferEngine(node=args.node, runtime=runtime, transports=("link", "tcp")) as engine:
            segment = engine.register_segment(buffer, name="selfcheck-peer")
            print(segment.descriptor.to_json(), flush=True)
            for line in sys.stdin:
                words = line.split()
                if not words or words[0] == "quit":
                    break
                if words[0] == "hash":
                    offset, length = int(words[1]), int(words[2])
                    piece = bytearray(length)
                    runtime.copy_to_host(piece, buffer, offset=offset)
                    print(hashlib.sha256(piece).hexdigest(), flush=True)
    finally:
        runtime.free(buffer)
    return 0


# -- pool paths: a store agent -------------------------------------------------------------------------------

class _PrivateAgent:
    """``daybreak agent --standalone`` as a child, for the pool paths; its /dev/shm segments go with it."""

    def __init__(self, *, dram_bytes: int, hbm_bytes: int, runtime: str, sunrise_lib_dir: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="daybreak-selfcheck-"))
        self.pool = f"selfcheck-{uuid.uuid4().hex[:8]}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.address = f"127.0.0.1:{port}"
        self.token_file = self.dir / "token"
        argv = [sys.executable, "-m", "daybreak", "agent", "--standalone", "--listen", self.address,
                "--dram", str(dram_bytes), "--token-file", str(self.token_file), "--pool", self.pool]
        if hbm_bytes:
            argv += ["--hbm", str(hbm_bytes)]
        env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1", "DAYBREAK_RUNTIME": runtime,
               "DAYBREAK_SUNRISE_LIB_DIR": sunrise_lib_dir}
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd="/")
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if "event=ready" in line:
                    ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 60
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the private store agent did not start: " + "".join(self.lines[-5:]).strip())

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        for path in SHM_DIR.glob(f"daybreak-{slug(self.pool)}-*"):
            path.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def check_pool(path: str, *, options: Options, runtime: AcceleratorRuntime | None = None) -> PathResult:
    """Blocks put into a store agent and got back: host buffers (``pool``) or device buffers (``device-pool``)."""
    from daybreak.client import KVPoolClient

    block = min(options.block_bytes, options.size_bytes)
    count = max(1, options.size_bytes // block)
    device = path == "device-pool"
    agent: _PrivateAgent | None = None
    buffers: list[DeviceBuffer] = []
    engine: TransferEngine | None = None
    try:
        if options.pool_endpoint:
            endpoint = options.pool_endpoint
            token = Path(options.token_file).read_text().strip() if options.token_file else ""
            if not token:
                return failed(path, "--pool-endpoint needs --token-file (the pool token or a namespace credential)")
        else:
            agent = _PrivateAgent(dram_bytes=2 * count * block + 64 * MiB,
                                  hbm_bytes=2 * count * block + 64 * MiB if device else 0,
                                  runtime=runtime.name if device and runtime is not None else "host",
                                  sunrise_lib_dir=options.sunrise_lib_dir)
            endpoint, token = agent.address, agent.token
        if device:
            assert runtime is not None
            engine = TransferEngine(token=token, runtime=runtime).start()
        keys = [f"selfcheck-{uuid.uuid4().hex[:8]}-{i}" for i in range(count)]
        data = [os.urandom(block) for _ in range(count)]
        with KVPoolClient([endpoint], token=token, namespace=options.namespace, engine=engine) as client:
            if device:
                assert runtime is not None
                dev = runtime.devices()[0].index
                buffers = [runtime.allocate(dev, block) for _ in range(2 * count)]
                src, dst = buffers[:count], buffers[count:]
                for buf, payload in zip(src, data, strict=True):
                    runtime.copy_to_device(buf, payload)
                put_from: Sequence[Any] = src
                get_into: Sequence[Any] = dst
            else:
                put_from = data
                get_into = [bytearray(block) for _ in range(count)]
            started = time.perf_counter()
            stored = client.batch_put(keys, put_from, tier="hbm" if device else "dram")
            put_s = time.perf_counter() - started
            if not all(stored):
                return failed(path, f"the pool stored {sum(1 for s in stored if s)} of {count} blocks")
            started = time.perf_counter()
            sizes = client.batch_get_into(keys, get_into)
            get_s = time.perf_counter() - started
            client.remove(keys)
            if sizes != [block] * count:
                return failed(path, f"{sum(1 for s in sizes if s != block)} of {count} blocks came back missing "
                                    "or short")
            if device:
                assert runtime is not None
                back = [_device_sha256(runtime, buf, block) for buf in get_into]
                if back != [hashlib.sha256(d).hexdigest() for d in data]:
                    return failed(path, "the blocks got back differ from the pattern")
                used = set(engine.bytes_used) if engine is not None else set()
                if "link" not in used:
                    return failed(path, f"device blocks went by {sorted(used) or 'nothing'}, not the link "
                                        f"(fell back: {engine.bytes_fell_back if engine else {}})")
            elif [bytes(b) for b in get_into] != data:
                return failed(path, "the blocks got back differ from the pattern")
            return PathResult(path=path, ok=True, gb_per_s=_gbps(2 * count * block, put_s + get_s))
    except Exception as exc:
        return failed(path, f"{type(exc).__name__}: {exc}")
    finally:
        if runtime is not None:
            for buf in buffers:
                runtime.free(buf)
        if engine is not None:
            engine.close()
        if agent is not None:
            agent.close()


# -- the whole check --------------------------------------------------------------------------------------------

def run_checks(paths: Sequence[str] = PATHS, *, options: Options | None = None, verbs: Any = None,
               on_result: Callable[[PathResult], None] | None = None) -> list[PathResult]:
    """Check ``paths`` in order; ``verbs`` is a pyverbs-compatible module for rdma (default: import pyverbs)."""
    options = options or Options()
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"paths: unknown {unknown}, expected some of {list(PATHS)}")
    results: list[PathResult] = []
    runtime: AcceleratorRuntime | None = None
    no_device = ""
    if {"device", "link", "device-pool"} & set(paths):
        loaded = load_runtime(options.runtime, sunrise_lib_dir=options.sunrise_lib_dir)
        if loaded.runtime.devices():
            runtime = loaded.runtime
        else:
            why = "; ".join(f"{name}: {cause}" for name, cause in loaded.skipped.items())
            no_device = "no accelerator" + (f" ({why})" if why else f" (runtime {options.runtime})")
    try:
        for path in paths:
            if path in ("shm", "tcp", "rdma"):
                result = check_host_path(path, options=options, verbs=verbs)
            elif path == "pool":
                result = check_pool(path, options=options)
            elif runtime is None:
                result = absent(path, no_device)
            elif path == "device":
                result = check_device(runtime, options=options)
            elif path == "link":
                result = check_link(runtime, options=options)
            else:
                result = check_pool(path, options=options, runtime=runtime)
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        if runtime is not None:
            runtime.close()
    return results


def exit_status(results: Sequence[PathResult], *, required: Sequence[str] = ()) -> int:
    """1 when a present path failed or a required one is absent; absent paths alone pass."""
    for r in results:
        if not r.ok and (not r.absent or r.path in required):
            return EXIT_FAILED
    return EXIT_OK


def render(result: PathResult) -> str:
    state = "ok" if result.ok else ("absent" if result.absent else "FAILED")
    speed = f"{result.gb_per_s:8.2f} GB/s" if result.gb_per_s is not None else f"{'-':>8}     "
    return f"{result.path:<12} {state:<7} {speed}" + (f"  {result.reason}" if result.reason else "")


def _csv(raw: str) -> list[str]:
    return [p.strip() for p in raw.split(",") if p.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "move a pattern through every data path of this node; byte-exact or not, and GB/s"
    parser.add_argument("--json", action="store_true", help='print {"paths": [{"path", "ok", "gb_per_s", '
                        '"reason", "absent"}, ...]} instead of lines')
    parser.add_argument("--paths", default=",".join(PATHS), help=f"paths to check (default all: {','.join(PATHS)})")
    parser.add_argument("--require", default="", help="paths whose absence fails the check (e.g. rdma,link)")
    parser.add_argument("--mib", type=int, default=64, help="bytes moved per path, in MiB (default 64)")
    parser.add_argument("--block-mib", type=int, default=4, help="block size of the pool paths, MiB (default 4)")
    parser.add_argument("--runtime", default=os.environ.get("DAYBREAK_RUNTIME", "auto"),
                        choices=["auto", "sunrise", "nvidia", "host"], help="accelerator runtime (default auto)")
    parser.add_argument("--sunrise-lib-dir", default=os.environ.get("DAYBREAK_SUNRISE_LIB_DIR", ""),
                        help="directory of libtangrt_shared.so / libptml_shared.so")
    parser.add_argument("--pool-endpoint", default="", help="host:port of an agent for the pool paths "
                        "(default: start a private standalone agent)")
    parser.add_argument("--token-file", default="", help="token of --pool-endpoint's pool")
    parser.add_argument("--namespace", default="daybreak-selfcheck", help="kvNamespace of the pool paths' blocks")


def run(args: argparse.Namespace) -> int:
    paths, required = _csv(args.paths), _csv(args.require)
    for name, given in (("--paths", paths), ("--require", required)):
        bad = [p for p in given if p not in PATHS]
        if bad:
            print(f"daybreak selfcheck: {name}: unknown path(s) {bad}; choose from {','.join(PATHS)}", file=sys.stderr)
            return 2
    if args.mib < 1 or args.block_mib < 1:
        print("daybreak selfcheck: --mib and --block-mib must be at least 1", file=sys.stderr)
        return 2
    options = Options(size_bytes=args.mib * MiB, block_bytes=args.block_mib * MiB, runtime=args.runtime,
                      sunrise_lib_dir=args.sunrise_lib_dir, pool_endpoint=args.pool_endpoint,
                      token_file=args.token_file, namespace=args.namespace)
    results = run_checks(paths, options=options,
                         on_result=None if args.json else lambda r: print(render(r), flush=True))
    status = exit_status(results, required=required)
    if args.json:
        print(json.dumps({"paths": [r.to_json() for r in results]}))
    else:
        print("SELFCHECK " + ("PASSED" if status == EXIT_OK else "FAILED"), flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m daybreak.agent.selfcheck``: the same as ``daybreak selfcheck``, or with ``--peer`` the link peer."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--peer"]:
        peer = argparse.ArgumentParser(prog="daybreak.agent.selfcheck --peer")
        peer.add_argument("--peer", action="store_true")
        peer.add_argument("--node", required=True)
        peer.add_argument("--device", type=int, required=True)
        peer.add_argument("--bytes", type=int, required=True)
        peer.add_argument("--runtime", default="auto")
        peer.add_argument("--sunrise-lib-dir", default="")
        return _peer_main(peer.parse_args(argv))
    parser = argparse.ArgumentParser(prog="daybreak selfcheck")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
