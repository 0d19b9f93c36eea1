"""Store benchmark: Daybreak's KV store vs Mooncake Store (tcp) and Redis, writer and reader in separate processes.

Every system gets the same workload: batches of 16 values (1 MiB and 64 KiB),
written by one process and read back by another, first on one host
(loopback) and then across two network namespaces joined by a veth pair (the
server side in one, writer and reader in the other: tcp against tcp). It
prints GB/s and per-batch p50/p99 latency for put and get, the ratios, the
same-node (shared-memory) get against a plain memcpy of the same bytes (a
fresh reader, then the same reads with its mappings in place), the first puts
after an agent starts against the steady put rate, and the agent's peak RSS
while it serves a full DRAM tier (``--rss-gib``).
An anchor that cannot run here is reported with the exact reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BATCH = 16
SIZES = {"1MiB": 1 << 20, "64KiB": 64 << 10}


# -- workers (run in child processes) ------------------------------------------------------------


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _summary(total_bytes: int, seconds: float, lat: list[float]) -> dict[str, float]:
    return {"gbps": total_bytes / seconds / 1e9, "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3}


def _loop(batches: int, fn: Any) -> tuple[float, list[float]]:
    fn(-1)  # warm-up batch (connections, mappings), not timed
    lat = []
    start = time.perf_counter()
    for b in range(batches):
        t = time.perf_counter()
        fn(b)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - start, lat


def _buffers(size: int, *, fill: bool) -> Any:
    import numpy as np

    arena = np.zeros(BATCH * size, np.uint8)
    if fill:
        arena[:] = np.random.default_rng(1).integers(0, 256, arena.size, dtype=np.uint8)
    return arena, [arena[i * size:(i + 1) * size] for i in range(BATCH)]


def _worker_ours(cfg: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from daybreak.client import KVPoolClient

    size, batches, role = cfg["size"], cfg["batches"], cfg["role"]
    deadline = time.monotonic() + 60
    while True:  # role "first" is started before its agent: connect as soon as it serves
        try:
            client = KVPoolClient(endpoints=[cfg["address"]], token=cfg["token"], namespace="bench",
                                  transport=cfg["transport"], verify=cfg.get("verify", True))
            break
        except Exception:
            if cfg["role"] != "first" or time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    _arena, bufs = _buffers(size, fill=role != "get")
    keys = [[f"{cfg['tag']}-{b}-{i}" for i in range(BATCH)] for b in range(-1, batches)]
    if role in ("put", "first"):
        def step(b: int) -> None:
            if client.batch_put(keys[b + 1], bufs) != [1] * BATCH:
                raise RuntimeError("put failed")
    else:
        def step(b: int) -> None:
            if client.batch_get_into(keys[b + 1], bufs) != [size] * BATCH:
                raise RuntimeError("get missed")
    seconds, lat = _loop(batches, step)
    result: dict[str, Any] = _summary(size * BATCH * batches, seconds, lat)
    if role == "get":  # the last batch read back byte for byte
        _, want = _buffers(size, fill=True)
        if any(bytes(a) != bytes(w) for a, w in zip(bufs, want, strict=True)):
            raise RuntimeError("get returned wrong bytes")
        if cfg.get("memcpy"):
            # The same bytes with a plain memcpy, right after, in the same process and buffers.
            source = np.ones(size * BATCH * batches, np.uint8)

            def copy(b: int) -> None:
                base = max(b, 0) * BATCH * size
                for i, dst in enumerate(bufs):
                    np.copyto(dst, source[base + i * size: base + (i + 1) * size])

            mseconds, _ = _loop(batches, copy)
            result["memcpy_gbps"] = size * BATCH * batches / mseconds / 1e9
            # The same reads again with this process's mappings of the segments in place (an engine
            # that has run a while), alternating with the memcpy so both see the same machine load:
            # best of three each.
            warm, plain = [], []
            for _ in range(3):
                seconds, _ = _loop(batches, step)
                warm.append(size * BATCH * batches / seconds / 1e9)
                mseconds, _ = _loop(batches, copy)
                plain.append(size * BATCH * batches / mseconds / 1e9)
            result["warm_gbps"], result["warm_memcpy_gbps"] = max(warm), max(plain)
    client.close()
    return result


def _mooncake_setup(cfg: dict[str, Any], *, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(f"{cfg['host']}:{cfg['te_port']}", f"http://{cfg['master_host']}:{cfg['http_port']}/metadata",
                     segment, 64 << 20, "tcp", "", f"{cfg['master_host']}:{cfg['rpc_port']}")
    if rc != 0:
        raise RuntimeError(f"mooncake setup returned {rc}")
    return store


def _worker_mooncake(cfg: dict[str, Any]) -> dict[str, Any]:
    size, batches, role = cfg["size"], cfg["batches"], cfg["role"]
    store = _mooncake_setup(cfg, segment=0)
    arena, bufs = _buffers(size, fill=role == "put")
    base = arena.ctypes.data
    if store.register_buffer(base, arena.nbytes) != 0:
        raise RuntimeError("mooncake register_buffer failed")
    ptrs = [base + i * size for i in range(BATCH)]
    sizes = [size] * BATCH
    keys = [[f"{cfg['tag']}-{b}-{i}" for i in range(BATCH)] for b in range(-1, batches)]
    if role == "put":
        def step(b: int) -> None:
            rcs = store.batch_put_from(keys[b + 1], ptrs, sizes)
            if any(rc != 0 for rc in rcs):
                raise RuntimeError(f"mooncake batch_put_from: {rcs}")
    else:
        def step(b: int) -> None:
            got = store.batch_get_into(keys[b + 1], ptrs, sizes)
            if list(got) != sizes:
                raise RuntimeError(f"mooncake batch_get_into: {got}")
    seconds, lat = _loop(batches, step)
    if role == "get":
        _, want = _buffers(size, fill=True)
        if any(bytes(a) != bytes(w) for a, w in zip(bufs, want, strict=True)):
            raise RuntimeError("mooncake get returned wrong bytes")
    store.unregister_buffer(base)
    store.close()
    return _summary(size * BATCH * batches, seconds, lat)


def _worker_mooncake_holder(cfg: dict[str, Any]) -> dict[str, Any]:
    """A process that only contributes the global segment (the role our agent plays)."""
    store = _mooncake_setup(cfg, segment=cfg["segment"])
    print("READY", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()
    return {}


def _worker_redis(cfg: dict[str, Any]) -> dict[str, Any]:
    import redis

    size, batches, role = cfg["size"], cfg["batches"], cfg["role"]
    r = redis.Redis(host=cfg["host"], port=cfg["port"])
    _arena, bufs = _buffers(size, fill=role == "put")
    keys = [[f"{cfg['tag']}-{b}-{i}" for i in range(BATCH)] for b in range(-1, batches)]
    if role == "put":
        def step(b: int) -> None:
            pipe = r.pipeline(transaction=False)
            for k, v in zip(keys[b + 1], bufs, strict=True):
                pipe.set(k, memoryview(v))
            pipe.execute()
    else:
        def step(b: int) -> None:
            pipe = r.pipeline(transaction=False)
            for k in keys[b + 1]:
                pipe.get(k)
            for dst, value in zip(bufs, pipe.execute(), strict=True):
                dst[:] = memoryview(value)  # into the caller's buffer, as the others do
    seconds, lat = _loop(batches, step)
    r.close()
    return _summary(size * BATCH * batches, seconds, lat)


WORKERS = {"ours": _worker_ours, "mooncake": _worker_mooncake,
           "mooncake_holder": _worker_mooncake_holder, "redis": _worker_redis}


def worker_main(raw: str) -> None:
    cfg = json.loads(raw)
    print("RESULT " + json.dumps(WORKERS[cfg["kind"]](cfg)), flush=True)


# -- orchestration ---------------------------------------------------------------------------------


@dataclass
class Host:
    """Where a process runs: the root namespace or one side of a NetnsPair."""

    address: str = "127.0.0.1"
    prefix: list[str] = field(default_factory=list)


def _python(host: Host, cfg: dict[str, Any]) -> list[str]:
    code = "import sys; from daybreak.bench.store import worker_main; worker_main(sys.argv[1])"
    return [*host.prefix, sys.executable, "-c", code, json.dumps(cfg)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONSAFEPATH": "1", "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


def _run_worker(host: Host, cfg: dict[str, Any], *, timeout_seconds: float = 300) -> dict[str, Any]:
    out = subprocess.run(_python(host, cfg), capture_output=True, text=True, timeout=timeout_seconds, env=_env(),
                         cwd="/")
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"{cfg['kind']} {cfg.get('role', '')} failed (exit {out.returncode}): {' | '.join(tail)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(host: Host, port: int, *, timeout_seconds: float = 30) -> None:
    probe = f"import socket; socket.create_connection(('{host.address}', {port}), timeout=1).close()"
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if subprocess.run([*host.prefix, sys.executable, "-c", probe], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {host.address}:{port} after {timeout_seconds:.0f} s")


@contextlib.contextmanager
def _process(cmd: list[str], *, ready: str | None = None, timeout_seconds: float = 60) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd="/")
    try:
        if ready is not None:
            deadline = time.monotonic() + timeout_seconds
            lines: list[str] = []
            assert proc.stdout is not None
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{cmd[0]} exited: {''.join(lines[-5:])}")
                lines.append(line)
                if ready in line:
                    break
            else:
                raise RuntimeError(f"{cmd[0]} not ready after {timeout_seconds:.0f} s")
        # Keep draining output so a chatty server never blocks on a full pipe.
        import threading

        threading.Thread(target=lambda: proc.stdout and proc.stdout.read(), daemon=True).start()
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _pair(host: Host, cfg: dict[str, Any]) -> dict[str, Any]:
    put = _run_worker(host, {**cfg, "role": "put"})
    get = _run_worker(host, {**cfg, "role": "get"})
    return {"put": put, "get": get}


def bench_ours(server: Host, client: Host, *, transport: str, sizes: dict[str, int], mib: int,
               work: Path) -> dict[str, Any]:
    from daybreak.testing.store_agent import LocalAgent, cleanup_pool

    pool = f"bench{uuid.uuid4().hex[:6]}"
    token = work / f"{pool}.token"
    dram = f"{max(2 * mib * len(sizes) + 256, 1024)}Mi"
    agent = LocalAgent(address=f"{server.address}:{_free_port()}", token_file=token, pool=pool, dram=dram,
                       netns=server.prefix[-1] if server.prefix else "")
    first: dict[str, Any] = {}
    writer = None
    if transport in ("auto", "tcp") and not server.prefix:
        # The first puts after a start: the writer is up and waiting before the agent starts, and
        # puts 64 MiB of 1 MiB values the moment the agent serves, while its tier is still being backed.
        token.write_text(uuid.uuid4().hex + "\n")
        cfg = {"kind": "ours", "address": agent.address, "token": token.read_text().strip(), "size": 1 << 20,
               "batches": 4, "transport": transport, "tag": "first", "role": "first"}
        writer = subprocess.Popen(_python(client, cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=_env(), cwd="/")
    agent.start()
    if writer is not None:
        out, err = writer.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"first-puts writer failed: {err.strip().splitlines()[-3:]}")
        first = json.loads(lines[0][7:])
        first["fill_done_before_end"] = any("event=prefault_done" in line for line in agent.lines)
    # The steady rows: a serving agent has its tier backed long before this; do not time the fill.
    agent.wait_for("event=prefault_", timeout_seconds=120)
    try:
        results: dict[str, Any] = {"first_put": first} if first else {}
        for label, size in sizes.items():
            cfg = {"kind": "ours", "address": agent.address, "token": token.read_text().strip(), "size": size,
                   "batches": max(2, (mib << 20) // (size * BATCH)), "transport": transport, "tag": label,
                   "memcpy": transport == "auto"}
            results[label] = _pair(client, cfg)
            if transport == "auto":
                # The same reads once more without the client's CRC check, to show what it costs.
                results[label]["get_noverify"] = _run_worker(client, {**cfg, "role": "get", "verify": False})
        return results
    finally:
        agent.stop()
        cleanup_pool(pool)


def mooncake_unavailable() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"mooncake-transfer-engine-non-cuda is not installed ({exc}); pip install -e '.[bench]'"
    if _mooncake_master() is None:
        return "mooncake_master not found next to the Python interpreter or on PATH"
    return None


def _mooncake_master() -> str | None:
    beside = Path(sys.executable).with_name("mooncake_master")
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


def bench_mooncake(server: Host, client: Host, *, sizes: dict[str, int], mib: int) -> dict[str, Any]:
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    master = [*server.prefix, str(_mooncake_master()), "--enable_http_metadata_server=true",
              f"--rpc_port={rpc}", f"--http_metadata_server_port={http}", f"--metrics_port={metrics}",
              f"--rpc_address={server.address}", f"--http_metadata_server_host={server.address}",
              f"--metrics_host={server.address}", "--logtostderr=false"]
    base = {"master_host": server.address, "rpc_port": rpc, "http_port": http}
    segment = max(2 * mib * len(sizes) + 256, 1024) << 20
    with _process(master):
        _wait_port(server, rpc)
        _wait_port(server, http)
        holder = {**base, "kind": "mooncake_holder", "host": server.address, "te_port": _free_port(),
                  "segment": segment}
        with _process(_python(server, holder), ready="READY", timeout_seconds=60):
            results = {}
            for label, size in sizes.items():
                cfg = {**base, "kind": "mooncake", "host": client.address, "te_port": _free_port(), "size": size,
                       "batches": max(2, (mib << 20) // (size * BATCH)), "tag": label}
                results[label] = {"put": _run_worker(client, {**cfg, "role": "put"}),
                                  "get": _run_worker(client, {**cfg, "role": "get", "te_port": _free_port()})}
            return results


def redis_unavailable() -> str | None:
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        return f"redis (the Python client) is not installed ({exc}); pip install -e '.[bench]'"
    if shutil.which("redis-server") is None:
        return "redis-server not found on PATH (make bench-deps installs Debian's redis-server)"
    return None


def bench_redis(server: Host, client: Host, *, sizes: dict[str, int], mib: int, work: Path) -> dict[str, Any]:
    port = _free_port()
    cmd = [*server.prefix, str(shutil.which("redis-server")), "--port", str(port), "--bind", server.address,
           "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(work)]
    with _process(cmd):
        _wait_port(server, port)
        results = {}
        for label, size in sizes.items():
            cfg = {"kind": "redis", "host": server.address, "port": port, "size": size,
                   "batches": max(2, (mib << 20) // (size * BATCH)), "tag": label}
            results[label] = _pair(client, cfg)
        return results


def bench_rss(*, gib: int, work: Path) -> dict[str, Any]:
    """Fill a ``gib`` GiB DRAM tier through shared memory, read it all back, report the agent's peak RSS."""
    from daybreak.pool.connection import Connection
    from daybreak.testing.store_agent import LocalAgent, cleanup_pool

    pool = f"rss{uuid.uuid4().hex[:6]}"
    token = work / f"{pool}.token"
    agent = LocalAgent(address=f"127.0.0.1:{_free_port()}", token_file=token, pool=pool, dram=f"{gib}Gi",
                       extra=["--high-watermark", "1.0", "--low-watermark", "0.95"])
    agent.start()
    agent.wait_for("event=prefault_", timeout_seconds=300)
    try:
        # 1 MiB blocks, 90% of the tier (below the high watermark, so nothing is evicted).
        batches = int(gib * 1024 * 0.9) // BATCH
        cfg = {"kind": "ours", "address": agent.address, "token": token.read_text().strip(), "size": 1 << 20,
               "batches": batches, "transport": "auto", "tag": "rss"}
        _pair(Host(), cfg)
        conn = Connection(agent.address, token=token.read_text().strip().encode())
        stats = conn.stats()
        conn.close()
        return {"tier_gib": gib, "stored_gib": int(stats["dram_used"]) / (1 << 30),
                "rss_peak_gib": int(stats["rss_peak_bytes"]) / (1 << 30)}
    finally:
        agent.stop()
        cleanup_pool(pool)


# -- reporting --------------------------------------------------------------------------------------


def _row(case: str, system: str, label: str, r: dict[str, Any]) -> str:
    put, get = r["put"], r["get"]
    return (f"| {case} | {system} | {label} | {put['gbps']:.2f} | {put['p50_ms']:.2f} | {put['p99_ms']:.2f} "
            f"| {get['gbps']:.2f} | {get['p50_ms']:.2f} | {get['p99_ms']:.2f} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=256, help="MiB written and read per system and value size")
    parser.add_argument("--skip-netns", action="store_true", help="only the one-host case")
    parser.add_argument("--rss-gib", type=int, default=0,
                        help="also measure the agent's peak RSS serving a DRAM tier of this many GiB (e.g. 4)")
    parser.add_argument("--json", help="write all results to this file")


def run(args: argparse.Namespace) -> int:
    sizes = SIZES
    report: dict[str, Any] = {"cases": {}, "skipped": {}}
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="daybreak-bench-store-") as tmp:
        work = Path(tmp)
        cases: list[tuple[str, Host, Host, Any]] = [("one host", Host(), Host(), contextlib.nullcontext())]
        if not args.skip_netns:
            from daybreak.testing.store_agent import NetnsPair

            reason = NetnsPair.unavailable()
            if reason:
                report["skipped"]["two netns"] = reason
                print(f"two-namespace case skipped: {reason}")
            else:
                pair = NetnsPair()
                cases.append(("two netns (veth)", Host(pair.addresses[0], pair.exec_prefix(0)),
                              Host(pair.addresses[1], pair.exec_prefix(1)), pair))
        for case, server, client, ctx in cases:
            with ctx:
                results: dict[str, Any] = {}
                one_host = case == "one host"
                systems: list[tuple[str, Any]] = []
                if one_host:
                    systems.append(("daybreak shm", lambda s=server, c=client: bench_ours(
                        s, c, transport="auto", sizes=sizes, mib=args.mib, work=work)))
                systems.append(("daybreak tcp", lambda s=server, c=client: bench_ours(
                    s, c, transport="tcp", sizes=sizes, mib=args.mib, work=work)))
                for name, unavailable, fn in (
                        ("mooncake tcp", mooncake_unavailable,
                         lambda s=server, c=client: bench_mooncake(s, c, sizes=sizes, mib=args.mib)),
                        ("redis", redis_unavailable,
                         lambda s=server, c=client: bench_redis(s, c, sizes=sizes, mib=args.mib, work=work))):
                    reason = unavailable()
                    if reason:
                        report["skipped"][f"{case}/{name}"] = reason
                        print(f"{name} ({case}) skipped: {reason}")
                    else:
                        systems.append((name, fn))
                for name, fn in systems:
                    print(f"... {case}: {name}", flush=True)
                    try:
                        results[name] = fn()
                    except Exception as exc:  # an anchor failing here is reported, not fatal
                        report["skipped"][f"{case}/{name}"] = str(exc)
                        print(f"{name} ({case}) failed: {exc}")
                        continue
                    for label in sizes:
                        rows.append(_row(case, name, label, results[name][label]))
                report["cases"][case] = results
        if args.rss_gib:
            print(f"... peak RSS with a {args.rss_gib} GiB DRAM tier", flush=True)
            report["rss"] = bench_rss(gib=args.rss_gib, work=work)

    print("\n| case | system | value | put GB/s | put p50 ms | put p99 ms | get GB/s | get p50 ms | get p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nRatios (get GB/s, ours / anchor; targets: >= 2.5x Mooncake, >= 5x Redis on 1 MiB):")
    for case, results in report["cases"].items():
        ours = results.get("daybreak tcp")
        for anchor in ("mooncake tcp", "redis"):
            if ours and anchor in results:
                for label in sizes:
                    g = ours[label]["get"]["gbps"] / results[anchor][label]["get"]["gbps"]
                    pt = ours[label]["put"]["gbps"] / results[anchor][label]["put"]["gbps"]
                    print(f"- {case}, {label}: daybreak tcp vs {anchor}: get {g:.2f}x, put {pt:.2f}x")
        shm = results.get("daybreak shm")
        if shm:
            for anchor in ("mooncake tcp", "redis"):
                if anchor in results:
                    g = shm["1MiB"]["get"]["gbps"] / results[anchor]["1MiB"]["get"]["gbps"]
                    print(f"- {case}, 1MiB: daybreak shm vs {anchor}: get {g:.2f}x")
            for label in sizes:
                get, copy = shm[label]["get"]["gbps"], shm[label]["get"]["memcpy_gbps"]
                raw = shm[label]["get_noverify"]
                print(f"- same-node get vs memcpy of the same bytes in the reader process, {label}: "
                      f"{get:.2f} / {copy:.2f} GB/s = {get / copy:.2f} (target >= 0.6); without the CRC check "
                      f"{raw['gbps']:.2f} / {raw['memcpy_gbps']:.2f} GB/s = {raw['gbps'] / raw['memcpy_gbps']:.2f}")
                warm, wcopy = shm[label]["get"].get("warm_gbps"), shm[label]["get"].get("warm_memcpy_gbps")
                if warm and wcopy:
                    rwarm, rcopy = raw.get("warm_gbps", 0.0), raw.get("warm_memcpy_gbps", 0.0)
                    print(f"  the same reads again, mappings in place, alternating with the memcpy (best of 3): "
                          f"{warm:.2f} / {wcopy:.2f} GB/s = {warm / wcopy:.2f}; without the check "
                          f"{rwarm:.2f} / {rcopy:.2f} GB/s = {rwarm / rcopy if rcopy else 0.0:.2f}")
    for case, results in report["cases"].items():
        for system, rows_ in results.items():
            f = rows_.get("first_put")
            if f:
                steady = rows_["1MiB"]["put"]["gbps"]
                print(f"- {case}, {system}: first puts after the agent starts (1MiB, 64 MiB, tier fill "
                      f"{'done' if f['fill_done_before_end'] else 'still running'} when they ended): {f['gbps']:.2f} GB/s"
                      f" vs steady put {steady:.2f} GB/s = {f['gbps'] / steady:.2f} (target >= 0.8)")
    if "rss" in report:
        r = report["rss"]
        print(f"- agent peak RSS serving a {r['tier_gib']} GiB DRAM tier ({r['stored_gib']:.2f} GiB stored): "
              f"{r['rss_peak_gib']:.2f} GiB (target < 4.5 GiB)")
    for what, reason in report["skipped"].items():
        print(f"- not measured: {what}: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
