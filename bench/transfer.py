"""Transfer engine throughput (tcp, shm) against a raw Python stream, memcpy and Mooncake's transfer engine.

Every row is a WRITE batch from this process into a segment owned by another
process (writer and reader in different processes), timed from ``submit`` to
the last completion, repeated for at least ``--seconds``; ours and its
baseline alternate for ``--rounds`` rounds and each keeps its best round. The
baselines do the same job by hand in the same run:

- ``python-stream``: one loopback TCP connection, ``sendall`` of the batch's bytes
  into a receiver process that ``recv_into``s them and answers one byte.
- ``memcpy``: slice assignment of each block into the same mapped segment.
- ``mooncake-tcp``: Mooncake's ``TransferEngine`` (pip mooncake-transfer-engine-non-cuda)
  over its tcp transport with its own HTTP metadata server, ``batch_transfer_sync_write``
  of the same blocks, initiator and target in their own processes.
- ``tcp``: for the ``tcp+tls`` rows, our own plain tcp to a plain peer, so the ratio is
  what TLS costs (both peers take a fresh self-signed certificate for 127.0.0.1).

``gbps`` is gigabytes (10^9 bytes) per second.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from daybreak.agent.transfer import ShmSegment, TransferEngine, TransferRequest
from daybreak.testing.transfer_peer import PeerProcess, pattern

# tcp+tls vs tcp is a cost to report, not a goal: the "target" only flags a TLS path slower than a quarter of plain.
TARGETS = {"python-stream": 0.8, "memcpy": 0.7, "mooncake-tcp": 2.0, "tcp": 0.25}


@dataclass
class Row:
    transport: str
    block_bytes: int
    batch: int
    gbps: float
    baseline: str
    baseline_gbps: float | None
    ratio: float | None
    target: float
    note: str = ""


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="64K,1M,16M", help="block sizes (default: 64K,1M,16M)")
    parser.add_argument("--batches", default="1,32", help="requests per batch (default: 1,32)")
    parser.add_argument("--seconds", type=float, default=0.3, help="minimum time per measurement round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each side counts")
    parser.add_argument("--transports", default="tcp,tls,shm",
                        help="ours to measure (default: tcp,tls,shm; tls is tcp+TLS against plain tcp)")
    parser.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake comparison")
    parser.add_argument("--tcp-connections", type=int, default=2)
    parser.add_argument("--slice-bytes", type=_size, default=4 << 20)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")


def _rate(fn: Callable[[], None], nbytes: int, seconds: float) -> float:
    fn()  # warm-up: connections, mappings, page faults
    count, start = 0, time.perf_counter()
    while True:
        fn()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 3:
            return count * nbytes / elapsed / 1e9


def _best_of(sides: list[Callable[[], float]], *, rounds: int) -> list[float]:
    """Measure each side in turn, ``rounds`` times, and keep each side's best round.

    Alternating keeps slow phases of a shared machine from landing on one side only.
    """
    best = [0.0] * len(sides)
    for _ in range(rounds):
        for i, side in enumerate(sides):
            best[i] = max(best[i], side())
    return best


_RAW_RECEIVER = textwrap.dedent("""
    import socket, struct, sys
    size = int(sys.argv[1])
    buf = memoryview(bytearray(b"\\1" * size))
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(8)
    while True:
        got = conn.recv_into(head, 8)
        if got < 8:
            break
        (n,) = struct.unpack("!Q", head)
        pos = 0
        while pos < n:
            pos += conn.recv_into(buf[pos:n], n - pos) or sys.exit(0)
        conn.sendall(b"k")
""")


class _RawStream:
    """The raw limit: one Python loopback stream, sendall / recv_into, one byte of answer per batch."""

    def __init__(self, size: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _RAW_RECEIVER, str(size)], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ack = bytearray(1)

    def send(self, view: memoryview) -> None:
        self.sock.sendall(struct.pack("!Q", len(view)))
        self.sock.sendall(view)
        if self.sock.recv_into(self.ack, 1) != 1:
            raise ConnectionError("raw receiver closed the stream")

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=10)


_MOONCAKE_TARGET = textwrap.dedent("""
    import ctypes, sys
    from mooncake.engine import TransferEngine
    meta, name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    engine = TransferEngine()
    if engine.initialize(name, meta, "tcp", "") != 0:
        sys.exit("mooncake target: initialize failed")
    buf = (ctypes.c_char * size)()
    ctypes.memset(buf, 1, size)
    if engine.register_memory(ctypes.addressof(buf), size) != 0:
        sys.exit("mooncake target: register_memory failed")
    print(ctypes.addressof(buf), flush=True)
    sys.stdin.read()
""")

_MOONCAKE_INITIATOR = textwrap.dedent("""
    import ctypes, sys, time
    from mooncake.engine import TransferEngine
    meta, name, target, peer_addr, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    engine = TransferEngine()
    if engine.initialize(name, meta, "tcp", "") != 0:
        sys.exit("mooncake initiator: initialize failed")
    src = (ctypes.c_char * size)()
    ctypes.memset(src, 7, size)
    base = ctypes.addressof(src)
    if engine.register_memory(base, size) != 0:
        sys.exit("mooncake initiator: register_memory failed")
    print("ready", flush=True)
    for line in sys.stdin:  # "BLOCK BATCH SECONDS" -> GB/s of one round
        block, batch, seconds = int(line.split()[0]), int(line.split()[1]), float(line.split()[2])
        locs = [base + i * block for i in range(batch)]
        peers = [peer_addr + i * block for i in range(batch)]
        lens = [block] * batch
        def once():
            rc = engine.batch_transfer_sync_write(target, locs, peers, lens)
            if rc != 0:
                sys.exit(f"mooncake batch_transfer_sync_write returned {rc}")
        once()
        n, t0 = 0, time.perf_counter()
        while True:
            once(); n += 1
            dt = time.perf_counter() - t0
            if dt >= seconds and n >= 3:
                break
        print(n * block * batch / dt / 1e9, flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Mooncake:
    """Mooncake's transfer engine over tcp: metadata server, target and initiator, each its own process."""

    def __init__(self, size: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.reason = ""
        self.initiator: subprocess.Popen[str] | None = None
        env = {**os.environ, "GLOG_minloglevel": "2", "PYTHONSAFEPATH": "1"}
        probe = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True,
                               env=env)
        if probe.returncode != 0:
            lines = probe.stderr.strip().splitlines()
            self.reason = f"mooncake unavailable: {lines[-1] if lines else f'exit {probe.returncode}'}"
            return
        server_bin = os.path.join(os.path.dirname(sys.executable), "mooncake_http_metadata_server")
        meta_port = _free_port()
        self.procs.append(subprocess.Popen([server_bin, "--host", "127.0.0.1", "--port", str(meta_port),
                                            "--log-level", "WARNING"], env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, text=True))
        meta = f"http://127.0.0.1:{meta_port}/metadata"
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", meta_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.procs[0].poll() is not None:
                    self.reason = "mooncake metadata server did not start"
                    return
                time.sleep(0.1)
        target_name = f"127.0.0.1:{_free_port()}"
        target = subprocess.Popen([sys.executable, "-c", _MOONCAKE_TARGET, meta, target_name, str(size)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.procs.append(target)
        assert target.stdout is not None
        line = target.stdout.readline()
        if not line.strip().isdigit():
            self.reason = f"mooncake target failed: {(target.stderr.read() if target.stderr else '').strip()[-300:]}"
            return
        self.initiator = subprocess.Popen(
            [sys.executable, "-c", _MOONCAKE_INITIATOR, meta, f"127.0.0.1:{_free_port()}", target_name,
             line.strip(), str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env)
        self.procs.append(self.initiator)
        assert self.initiator.stdout is not None
        if self.initiator.stdout.readline().strip() != "ready":
            self._failed("initiator did not start")

    def _failed(self, what: str) -> None:
        err = ""
        if self.initiator is not None and self.initiator.stderr is not None:
            self.initiator.kill()
            err = self.initiator.stderr.read().strip()[-300:]
        self.reason = f"mooncake {what}: {err}"
        self.initiator = None

    def rate(self, block: int, batch: int, seconds: float) -> float:
        """GB/s of one measurement round (0.0 once Mooncake has failed; ``reason`` says why)."""
        if self.initiator is None:
            return 0.0
        assert self.initiator.stdin is not None and self.initiator.stdout is not None
        try:
            self.initiator.stdin.write(f"{block} {batch} {seconds}\n")
            self.initiator.stdin.flush()
            return float(self.initiator.stdout.readline())
        except (OSError, ValueError):
            self._failed("initiator failed")
            return 0.0

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
            proc.terminate()
            proc.wait(timeout=10)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(rows: list[Row]) -> None:
    head = f"{'transport':<9} {'block':>7} {'batch':>5} {'GB/s':>6}  {'baseline':<14} {'GB/s':>6} {'ratio':>6} {'target':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        block = f"{r.block_bytes >> 20}M" if r.block_bytes >= 1 << 20 else f"{r.block_bytes >> 10}K"
        ratio = _fmt(r.ratio)
        mark = "" if r.ratio is None else (" ok" if r.ratio >= r.target else " LOW")
        line = (f"{r.transport:<9} {block:>7} {r.batch:>5} {r.gbps:>6.2f}  {r.baseline:<14} "
                f"{_fmt(r.baseline_gbps):>6} {ratio:>6} {'>=' + str(r.target):>7}{mark}")
        print(line + (f"  ({r.note})" if r.note else ""))


def run(args: argparse.Namespace) -> int:
    sizes = [_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    wanted = [t.strip() for t in args.transports.split(",") if t.strip()]
    cases = [(size, batch) for size in sizes for batch in batches]
    total = max(size * batch for size, batch in cases)
    rows: list[Row] = []
    src = bytearray(pattern(1, total))
    src_view = memoryview(src)
    shm_name = f"dbt-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    peer_node = f"bench-peer-{uuid.uuid4().hex[:6]}"
    print(f"transfer bench: sizes={args.sizes} batches={args.batches} seconds={args.seconds} rounds={args.rounds} "
          f"tcp_connections={args.tcp_connections} slice_bytes={args.slice_bytes} cpus={os.cpu_count()}", flush=True)
    mooncake = _Mooncake(total) if "tcp" in wanted and not args.no_mooncake else None
    try:
        with PeerProcess(segment_bytes=total, shm_name=shm_name, node=peer_node, transports="shm,tcp",
                         tcp_connections=args.tcp_connections, slice_bytes=args.slice_bytes) as peer:
            try:
                if "tcp" in wanted:
                    rows += _tcp_rows(args, peer, src_view, cases, total, mooncake)
                if "tls" in wanted:
                    rows += _tls_rows(args, peer, src_view, cases, total)
                if "shm" in wanted:
                    rows += _shm_rows(args, peer, src_view, cases, shm_name, peer_node)
            finally:
                ShmSegment.path_of(shm_name).unlink(missing_ok=True)
    finally:
        if mooncake is not None:
            mooncake.close()
    order = {"tcp": 0, "tcp+tls": 1}
    rows.sort(key=lambda r: (order.get(r.transport, 2), r.baseline == "mooncake-tcp", r.block_bytes, r.batch))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0


def _tcp_rows(args: argparse.Namespace, peer: PeerProcess, src: memoryview, cases: list[tuple[int, int]],
              total: int, mooncake: _Mooncake | None) -> list[Row]:
    rows: list[Row] = []
    raw = _RawStream(total)
    try:
        with TransferEngine(node="bench-local", transports=("tcp",), tcp_connections=args.tcp_connections,
                            slice_bytes=args.slice_bytes) as engine:
            remote = engine.open_remote(peer.descriptor)
            for size, batch in cases:
                nbytes = size * batch
                ours = _engine_fn(engine, remote, src, size, batch)

                def stream(n: int = nbytes) -> None:
                    raw.send(src[:n])

                sides: list[Callable[[], float]] = [partial(_rate, ours, nbytes, args.seconds),
                                                    partial(_rate, stream, nbytes, args.seconds)]
                if mooncake is not None:
                    sides.append(partial(mooncake.rate, size, batch, args.seconds))
                best = _best_of(sides, rounds=args.rounds)
                rows.append(_row("tcp", size, batch, best[0], "python-stream", best[1]))
                if mooncake is not None:
                    rows.append(_row("tcp", size, batch, best[0], "mooncake-tcp", best[2] or None,
                                     note=mooncake.reason))
    finally:
        raw.close()
    return rows


def _self_signed(directory: str) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 (its own CA) and its key, as PEM files under ``directory``."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = os.path.join(directory, "bench.pem"), os.path.join(directory, "bench.key")
    with open(cert_file, "wb") as fh:
        fh.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    return cert_file, key_file


def _tls_rows(args: argparse.Namespace, peer: PeerProcess, src: memoryview, cases: list[tuple[int, int]],
              total: int) -> list[Row]:
    """tcp+TLS (``pool.tls``, as an agent with ``tls_cert_file`` runs it) against plain tcp, rounds alternating."""
    import tempfile

    from daybreak.pool.tls import contexts

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="dbt-bench-tls-") as directory:
        cert, key = _self_signed(directory)
        with PeerProcess(segment_bytes=total, node=f"bench-tls-{uuid.uuid4().hex[:6]}", transports="tcp",
                         tcp_connections=args.tcp_connections, slice_bytes=args.slice_bytes,
                         tls_cert=cert, tls_key=key, tls_ca=cert) as tls_peer, \
                TransferEngine(node="bench-local", transports=("tcp",), tcp_connections=args.tcp_connections,
                               slice_bytes=args.slice_bytes,
                               tls=contexts(cert_file=cert, key_file=key, ca_file=cert)) as tls_engine, \
                TransferEngine(node="bench-local", transports=("tcp",), tcp_connections=args.tcp_connections,
                               slice_bytes=args.slice_bytes) as plain_engine:
            tls_remote = tls_engine.open_remote(tls_peer.descriptor)
            plain_remote = plain_engine.open_remote(peer.descriptor)
            for size, batch in cases:
                nbytes = size * batch
                best = _best_of([partial(_rate, _engine_fn(tls_engine, tls_remote, src, size, batch), nbytes,
                                         args.seconds),
                                 partial(_rate, _engine_fn(plain_engine, plain_remote, src, size, batch), nbytes,
                                         args.seconds)], rounds=args.rounds)
                rows.append(_row("tcp+tls", size, batch, best[0], "tcp", best[1]))
    return rows


def _shm_rows(args: argparse.Namespace, peer: PeerProcess, src: memoryview, cases: list[tuple[int, int]],
              shm_name: str, peer_node: str) -> list[Row]:
    rows: list[Row] = []
    mapped = ShmSegment.attach(shm_name)
    try:
        with TransferEngine(node=peer_node, transports=("shm",)) as engine:
            remote = engine.open_remote(peer.descriptor)
            for size, batch in cases:
                ours = _engine_fn(engine, remote, src, size, batch)

                def memcpy(size: int = size, batch: int = batch) -> None:
                    dst = mapped.buffer
                    for i in range(batch):
                        dst[i * size:(i + 1) * size] = src[i * size:(i + 1) * size]

                best = _best_of([partial(_rate, ours, size * batch, args.seconds),
                                 partial(_rate, memcpy, size * batch, args.seconds)], rounds=args.rounds)
                rows.append(_row("shm", size, batch, best[0], "memcpy", best[1]))
    finally:
        mapped.close()
    return rows


def _engine_fn(engine: TransferEngine, remote: Any, src: memoryview, size: int, batch: int) -> Callable[[], None]:
    requests = [TransferRequest.write(remote, i * size, src, local_offset=i * size, length=size) for i in range(batch)]

    def once() -> None:
        handle = engine.submit(requests, timeout_s=60)
        handle.wait()
        if not handle.ok:
            handle.raise_for_status()

    return once


def _row(transport: str, size: int, batch: int, gbps: float, baseline: str, base: float | None, *,
         note: str = "") -> Row:
    ratio = gbps / base if base else None
    return Row(transport, size, batch, round(gbps, 3), baseline, None if base is None else round(base, 3),
               None if ratio is None else round(ratio, 3), TARGETS[baseline], note)
