"""A transfer engine in its own process, driven line by line over stdin: the peer for tests and benchmarks.

Run as ``python -m daybreak.testing.transfer_peer --segment-bytes N [--shm-name NAME] ...``.
It starts an engine, registers one segment and prints its descriptor as the
first line of stdout, then answers one line per command:

    hash OFF LEN                 -> sha256 hex of segment[OFF:OFF+LEN]
    fill SEED OFF LEN            -> "ok" after filling segment[OFF:OFF+LEN] with pattern(SEED)
    open DESCRIPTOR_JSON         -> remote id (an integer)
    batch TIMEOUT_S SPEC[,SPEC]  -> JSON list of {status, transport, error}; SPEC is OP:RID:LOFF:ROFF:LEN
                                    with OP read or write, moving between our segment and remote RID
    quit                         -> exits (so does end of input: the parent died)

``--tls-cert/--tls-key/--tls-ca`` (``PeerProcess(tls_cert=...)``) make its tcp TLS-only, as an
agent's engine is with the same settings; ``--token`` sets the engine token.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from daybreak.agent.transfer.batch import Op, TransferRequest
from daybreak.agent.transfer.engine import TransferEngine
from daybreak.agent.transfer.transport import LocalSegment, RemoteSegment
from daybreak.logs import setup_logging
from daybreak.pool.shm import ShmSegment
from daybreak.pool.tls import contexts


class PeerProcess:
    """Parent-side handle of a peer process: start it, send commands, kill it."""

    def __init__(self, *, segment_bytes: int, shm_name: str = "", node: str = "", listen: str = "127.0.0.1:0",
                 transports: str = "shm,tcp", checksum: bool = False, tcp_connections: int = 2,
                 slice_bytes: int = 4 << 20, prefix: Sequence[str] = (), log_level: str = "WARNING",
                 device: int = -1, runtime: str = "auto", sunrise_lib_dir: str = "", token: str = "",
                 tls_cert: str = "", tls_key: str = "", tls_ca: str = "") -> None:
        argv = [*prefix, sys.executable, "-m", "daybreak.testing.transfer_peer",
                "--segment-bytes", str(segment_bytes), "--listen", listen, "--transports", transports,
                "--tcp-connections", str(tcp_connections), "--slice-bytes", str(slice_bytes),
                "--log-level", log_level]
        if shm_name:
            argv += ["--shm-name", shm_name]
        if node:
            argv += ["--node", node]
        if checksum:
            argv.append("--checksum")
        for flag, value in (("--token", token), ("--tls-cert", tls_cert), ("--tls-key", tls_key),
                            ("--tls-ca", tls_ca)):
            if value:
                argv += [flag, value]
        if device >= 0:
            argv += ["--device", str(device), "--runtime", runtime, "--sunrise-lib-dir", sunrise_lib_dir]
        self.shm_name = shm_name
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.descriptor = self._line()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process exited with {self.proc.wait()} before answering")
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def hash(self, offset: int, length: int) -> str:
        return self.ask(f"hash {offset} {length}")

    def fill(self, seed: int, offset: int, length: int) -> None:
        if self.ask(f"fill {seed} {offset} {length}") != "ok":
            raise RuntimeError("fill failed")

    def open(self, descriptor: str) -> int:
        return int(self.ask(f"open {descriptor}"))

    def batch(self, specs: Sequence[tuple[str, int, int, int, int]], *, timeout_s: float) -> list[dict[str, str]]:
        spec = ",".join(":".join(str(x) for x in s) for s in specs)
        answer: list[dict[str, str]] = json.loads(self.ask(f"batch {timeout_s} {spec}"))
        return answer

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hash(segment: LocalSegment, runtime: Any, offset: int, length: int) -> str:
    """sha256 of a segment range, host or device memory (read out in 64 MiB pieces)."""
    if segment.buffer is not None:
        return hashlib.sha256(segment.buffer[offset:offset + length]).hexdigest()
    digest = hashlib.sha256()
    chunk = bytearray(min(length, 64 << 20))
    for start in range(offset, offset + length, len(chunk)):
        piece = memoryview(chunk)[:min(len(chunk), offset + length - start)]
        runtime.copy_to_host(piece, segment.transport_state["device_buffer"], offset=start)
        digest.update(piece)
    return digest.hexdigest()


def pattern(seed: int, length: int) -> bytes:
    """Deterministic pseudo-random bytes, the same in every process (AES-CTR keyed by the seed: GB/s)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    encryptor = Cipher(algorithms.AES(seed.to_bytes(16, "little")), modes.CTR(bytes(16))).encryptor()
    return encryptor.update(bytes(length)) + encryptor.finalize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--segment-bytes", type=int, required=True)
    parser.add_argument("--shm-name", default="", help="back the segment with /dev/shm/NAME (unlinked on exit)")
    parser.add_argument("--node", default="")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--tcp-connections", type=int, default=2)
    parser.add_argument("--slice-bytes", type=int, default=4 << 20)
    parser.add_argument("--checksum", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--device", type=int, default=-1, help="put the segment in this accelerator's memory")
    parser.add_argument("--runtime", default="auto", help="accelerator runtime for --device (auto, sunrise, nvidia)")
    parser.add_argument("--sunrise-lib-dir", default="")
    parser.add_argument("--token", default="", help="engine token (peers must prove the same)")
    parser.add_argument("--tls-cert", default="", help="PEM certificate: tcp serves and dials TLS only")
    parser.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle the peers' certificates are checked against")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)

    runtime: Any = None
    shm = ShmSegment.create(args.shm_name, args.segment_bytes) if args.shm_name else None
    memory: object = shm if shm is not None else bytearray(args.segment_bytes)
    if args.device >= 0:
        from daybreak.agent.runtime import load_runtime

        runtime = load_runtime(args.runtime, sunrise_lib_dir=args.sunrise_lib_dir).runtime
        memory = runtime.allocate(args.device, args.segment_bytes)
    engine = TransferEngine(node=args.node or None, listen=args.listen, transports=args.transports.split(","),
                            tcp_connections=args.tcp_connections, slice_bytes=args.slice_bytes,
                            checksum=args.checksum, runtime=runtime, token=args.token,
                            tls=contexts(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca)).start()
    segment = engine.register_segment(memory, name=args.shm_name or "peer")
    view = segment.buffer
    remotes: list[RemoteSegment] = []
    print(segment.descriptor.to_json(), flush=True)
    try:
        for line in sys.stdin:
            words = line.split(maxsplit=1)
            if not words:
                continue
            command, rest = words[0], (words[1] if len(words) > 1 else "")
            if command == "quit":
                break
            if command == "hash":
                off, length = map(int, rest.split())
                print(_hash(segment, runtime, off, length), flush=True)
            elif command == "fill":
                seed, off, length = map(int, rest.split())
                if view is not None:
                    view[off:off + length] = pattern(seed, length)
                else:
                    runtime.copy_to_device(memory, pattern(seed, length), offset=off)
                print("ok", flush=True)
            elif command == "open":
                remotes.append(engine.open_remote(rest.strip()))
                print(len(remotes) - 1, flush=True)
            elif command == "batch":
                timeout, spec = rest.split()
                requests = []
                for item in spec.split(","):
                    op, rid, loff, roff, size = item.split(":")
                    requests.append(TransferRequest(Op(op), remotes[int(rid)], int(roff), segment,
                                                    local_offset=int(loff), length=int(size)))
                results = engine.submit(requests, timeout_s=float(timeout)).wait()
                print(json.dumps([{"status": r.status.value, "transport": r.transport, "error": r.error}
                                  for r in results]), flush=True)
            else:
                print(f"error unknown command {command!r}", flush=True)
    finally:
        engine.close()
        del view
        if shm is not None:
            shm.unlink()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    sys.exit(main())
