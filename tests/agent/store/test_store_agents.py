"""Store agents as real processes: cross-process put/get, replicas, restart, eviction, integrity, auth."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from daybreak.client import KVPoolClient, KVPoolError
from daybreak.pool import protocol as p
from daybreak.pool.connection import AuthenticationFailed, Connection, RemoteError, parse_address
from daybreak.pool.shm import SHM_DIR
from daybreak.testing.store_agent import LocalAgent, free_port


def start(pool: dict[str, object], *, port: int | None = None, peers: list[str] | None = None, replicas: int = 1,
          dram: str = "64Mi", extra: list[str] | None = None) -> LocalAgent:
    address = f"127.0.0.1:{port or free_port()}"
    agent = LocalAgent(address=address, token_file=pool["token_file"], pool=str(pool["name"]),  # type: ignore[arg-type]
                       dram=dram, peers=peers or [], replicas=replicas, extra=extra or [])
    pool["agents"].append(agent)  # type: ignore[attr-defined]
    return agent.start()


def token(pool: dict[str, object]) -> str:
    return Path(pool["token_file"]).read_text().strip()  # type: ignore[arg-type]


def tuple_address(address: str) -> tuple[str, int]:
    return parse_address(address)


def blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def run_client(code: str, **env: str) -> str:
    """Run a client in a separate Python process; returns its stdout."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONSAFEPATH": "1", **env}, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_put_in_one_process_get_in_another(pool: dict[str, object], transport: str) -> None:
    agent = start(pool)
    run_client(f"""
        import numpy as np
        from daybreak.client import KVPoolClient
        c = KVPoolClient(endpoints=["{agent.address}"], token=open("{pool['token_file']}").read().strip(),
                         namespace="ns", transport="{transport}")
        rng = np.random.default_rng(7)
        data = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1 << 20, 65536, 1, 12345)]
        assert c.batch_put(["a", "b", "c", "d"], data) == [1, 1, 1, 1]
        c.close()
    """)
    expected = []
    rng = np.random.default_rng(7)
    for n in (1 << 20, 65536, 1, 12345):
        expected.append(rng.integers(0, 256, n, dtype=np.uint8))
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns", transport=transport) as c:  # type: ignore[arg-type]
        out = [np.zeros(1 << 20, np.uint8) for _ in range(4)]
        sizes = c.batch_get_into(["a", "b", "c", "d", "missing"], [*out, bytearray(8)])
        assert sizes == [1 << 20, 65536, 1, 12345, None]
        for got, want in zip(out, expected, strict=True):
            assert np.array_equal(got[:len(want)], want)
        # The namespace is part of the key: another namespace sees nothing.
        with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="other") as other:
            assert other.batch_exists(["a"]) == [False]


def test_wrong_token_is_refused_and_logged(pool: dict[str, object]) -> None:
    agent = start(pool)
    # A wrong secret cannot even complete the handshake: the agent's proof does not check out.
    with pytest.raises(KVPoolError, match="did not prove"):
        KVPoolClient(endpoints=[agent.address], token="not-the-token", namespace="ns")
    with pytest.raises(AuthenticationFailed):
        Connection(agent.address, token=b"x" * 64)
    # A client that ignores the agent's proof and answers anyway is refused by the agent.
    raw = Connection.__new__(Connection)
    raw.address, raw.sock = agent.address, socket.create_connection(tuple_address(agent.address), timeout=10)
    raw._ids = itertools.count(1)
    rid = raw._send(p.Op.HELLO, p.Hello("rogue", "admin", os.urandom(16)).encode())
    raw._reply(rid)
    rid = raw._send(p.Op.HELLO, p.HelloProof(b"\0" * 32).encode())
    with pytest.raises(RemoteError, match="authentication failed"):
        raw._reply(rid)
    raw.close()
    # The agent keeps serving the right token.
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns") as c:
        assert c.batch_put(["k"], [b"v"]) == [1]
    assert agent.wait_log("reason=wrong_credential"), agent.log[-2000:]


def test_malformed_frames_close_only_that_connection(pool: dict[str, object]) -> None:
    agent = start(pool)
    host, port = agent.address.split(":")
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns", transport="tcp") as c:
        assert c.batch_put(["before"], [b"x" * 1000]) == [1]
        good = Connection(agent.address, token=token(pool).encode())
        cases = [
            b"GARBAGE!" * 3,                                                       # bad magic
            p.pack_header(op=p.Op.HELLO, meta_len=p.MAX_META_BYTES + 1),           # oversized metadata
            p.pack_header(op=p.Op.HELLO, meta_len=p.MAX_PREAUTH_META_BYTES + 1),   # over the pre-auth limit
            p.pack_header(op=p.Op.PUT, meta_len=4) + b"\x01\x00\x00\x00",         # unauthenticated PUT
        ]
        for raw in cases:
            with socket.create_connection((host, int(port))) as s:
                s.sendall(raw)
                s.settimeout(10)
                try:
                    got = s.recv(65536)
                except ConnectionResetError:  # closed with the frame's unread bytes still queued
                    got = b""
                assert got == b""  # closed by the agent
        # An authenticated connection sending a truncated PUT record is closed too...
        bad = Connection(agent.address, token=token(pool).encode())
        bad.sock.sendall(p.pack_header(op=p.Op.PUT, meta_len=3) + b"\xff\xff\xff")
        bad.sock.settimeout(10)
        assert bad.sock.recv(65536) == b""
        # ... while the other connections carry on.
        assert good.exists(["ns/before"])[0].status == p.Status.OK
        out = bytearray(1000)
        assert c.batch_get_into(["before"], [out]) == [1000] and out == b"x" * 1000
        good.close()
    assert agent.wait_log("event=connection_closed", count=3), agent.log[-2000:]


def test_restart_readopts_dram_blocks(pool: dict[str, object]) -> None:
    port = free_port()
    agent = start(pool, port=port)
    data = blocks(8, 256 * 1024, seed=1)
    keys = [f"r{i}" for i in range(8)]
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns") as c:
        assert c.batch_put(keys, data) == [1] * 8
    agent.kill()  # a crash: no hand-off, no clean shutdown
    agent = start(pool, port=port)
    assert agent.wait_log("blocks=8"), agent.log[-2000:]
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns", transport="tcp") as c:
        out = [np.zeros(256 * 1024, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, out) == [256 * 1024] * 8
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))


def test_torn_block_after_crash_is_a_miss(pool: dict[str, object]) -> None:
    port = free_port()
    agent = start(pool, port=port)
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns") as c:
        assert c.batch_put(["whole", "torn"], [b"a" * 8192, b"b" * 8192]) == [1, 1]
    agent.kill()
    # Overwrite part of one block in the segment, as a writer dying mid-copy would leave it.
    name = str(pool["name"])
    segment = next(SHM_DIR.glob(f"daybreak-{name}-*-dram-0"))
    raw = bytearray(segment.read_bytes()[: 1 << 20])
    where = raw.find(b"b" * 8192)
    assert where >= 0
    with segment.open("r+b") as f:
        f.seek(where + 100)
        f.write(b"Z" * 50)
    agent = start(pool, port=port)
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns") as c:
        out = [bytearray(8192), bytearray(8192)]
        assert c.batch_get_into(["whole", "torn"], out) == [8192, None]
        assert out[0] == b"a" * 8192 and b"b" * 8192 != out[1]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_corrupted_dram_block_is_a_miss_and_removed(pool: dict[str, object], transport: str) -> None:
    agent = start(pool)
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns", transport=transport) as c:
        assert c.batch_put(["c"], [b"c" * 65536]) == [1]
        segment = next(SHM_DIR.glob(f"daybreak-{pool['name']}-*-dram-0"))
        raw = segment.read_bytes()[: 1 << 20]
        with segment.open("r+b") as f:  # a bit flip in memory behind the agent's back
            f.seek(raw.find(b"c" * 65536) + 5)
            f.write(b"!")
        out = bytearray(65536)
        assert c.batch_get_into(["c"], [out]) == [None]
        assert c.batch_exists(["c"]) == [False]  # dropped by the agent after re-verifying
    assert agent.wait_log("event=block_corrupt tier=dram"), agent.log[-2000:]


def test_corrupted_ssd_block_file_is_a_miss(pool: dict[str, object]) -> None:
    ssd = Path(pool["tmp"]) / "ssd"  # type: ignore[arg-type]
    agent = start(pool, dram="8Mi", extra=["--ssd-path", str(ssd), "--ssd", "64Mi", "--eviction", "lru"])
    keys = [f"s{i}" for i in range(24)]
    data = blocks(24, 1 << 20, seed=3)
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns", transport="tcp") as c:
        for i in range(0, 24, 4):  # 24 MiB into an 8 MiB DRAM tier: the oldest blocks go to SSD
            assert c.batch_put(keys[i:i + 4], data[i:i + 4]) == [1] * 4
        files = sorted(ssd.rglob("*.blk"))
        assert len(files) >= 12
        # Flip bytes in one block file; keep the others intact.
        victim = files[0]
        with victim.open("r+b") as f:
            f.seek(-100, os.SEEK_END)
            f.write(b"\x00" * 10)
        out = [np.zeros(1 << 20, np.uint8) for _ in keys]
        sizes = c.batch_get_into(keys, out)
        missing = [i for i, s in enumerate(sizes) if s is None]
        assert len(missing) == 1, sizes  # exactly the corrupted one, promoted blocks verified
        assert all(np.array_equal(out[i], data[i]) for i in range(24) if i not in missing)
    assert agent.wait_log("event=block_corrupt tier=ssd"), agent.log[-2000:]


def test_kill_an_agent_and_read_its_keys_from_replicas(pool: dict[str, object]) -> None:
    ports = [free_port() for _ in range(3)]
    addresses = [f"127.0.0.1:{q}" for q in ports]
    agents = [start(pool, port=q, peers=[a for a in addresses if not a.endswith(f":{q}")], replicas=2)
              for q in ports]
    keys = [f"rep{i}" for i in range(60)]
    data = blocks(60, 32 * 1024, seed=4)
    run_client(f"""
        import numpy as np
        from daybreak.client import KVPoolClient
        c = KVPoolClient(endpoints={addresses!r}, token=open("{pool['token_file']}").read().strip(), namespace="ns")
        rng = np.random.default_rng(4)
        data = [rng.integers(0, 256, 32 * 1024, dtype=np.uint8) for _ in range(60)]
        assert c.batch_put({keys!r}, data) == [2] * 60, "two copies each"
    """)
    agents[0].kill()
    with KVPoolClient(endpoints=addresses[1:], token=token(pool), namespace="ns", transport="tcp") as c:
        out = [np.zeros(32 * 1024, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, out) == [32 * 1024] * 60
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))


LOADER = """
import random, sys, time, zlib
from pathlib import Path
import numpy as np
from daybreak.client import KVPoolClient

endpoints, token, stop, log = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
c = KVPoolClient(endpoints=endpoints, token=token, namespace="ns", transport="tcp")
value = lambda k: np.random.default_rng(zlib.crc32(k.encode())).integers(0, 256, 8192, dtype=np.uint8)
written, misses, n = [], 0, 0
while not stop.exists():
    keys = [f"load-{n}-{i}" for i in range(8)]
    n += 1
    copies = c.batch_put(keys, [value(k) for k in keys])
    written += [k for k, got in zip(keys, copies) if got]
    sample = random.sample(written, min(16, len(written)))
    out = [np.zeros(8192, np.uint8) for _ in sample]
    for k, size, o in zip(sample, c.batch_get_into(sample, out), out):
        if size != 8192 or not np.array_equal(o, value(k)):
            misses += 1
            print(f"miss {k} size={size} t={time.time():.3f} members={c.members()}", file=sys.stderr, flush=True)
    time.sleep(0.01)
log.write_text("\\n".join(written) + f"\\nmisses={misses}\\n")
"""


def test_elastic_pool_three_two_three_keeps_every_block(pool: dict[str, object]) -> None:
    ports = [free_port() for _ in range(3)]
    addresses = [f"127.0.0.1:{q}" for q in ports]
    agents = [start(pool, port=q, peers=[a for a in addresses if not a.endswith(f":{q}")]) for q in ports]
    tmp = Path(pool["tmp"])  # type: ignore[arg-type]
    keys: list[str] = []
    data: list[np.ndarray] = []
    # A second process keeps writing and reading through every change of membership.
    loader = subprocess.Popen([sys.executable, "-c", LOADER, ",".join(addresses), token(pool), str(tmp / "stop"),
                               str(tmp / "loaded")], env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/",
                              stderr=subprocess.PIPE, text=True)
    with KVPoolClient(endpoints=addresses, token=token(pool), namespace="ns", transport="tcp") as c:
        def write(round_: int) -> None:
            new = [f"e{round_}-{i}" for i in range(40)]
            vals = blocks(40, 16 * 1024, seed=round_)
            assert c.batch_put(new, vals) == [1] * 40  # one copy only: hand-off is all that saves them
            keys.extend(new)
            data.extend(vals)

        def read_all() -> None:
            out = [np.zeros(16 * 1024, np.uint8) for _ in keys]
            assert c.batch_get_into(keys, out) == [16 * 1024] * len(keys)
            assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))

        write(0)
        time.sleep(1)
        # 3 -> 2: the leaving agent hands its blocks to their new homes, then exits.
        assert agents[2].stop() == 0
        assert agents[2].wait_log("event=handoff_done"), agents[2].log[-2000:]
        write(1)
        read_all()
        time.sleep(1)
        # 2 -> 3: a fresh agent (empty memory) joins; blocks whose home it now is are pulled on read.
        cleanup_pool_agent = agents[2].address.replace(":", "_")
        for path in SHM_DIR.glob(f"daybreak-{pool['name']}-{cleanup_pool_agent}-*"):
            path.unlink()
        start(pool, port=ports[2], peers=addresses[:2])
        deadline = time.monotonic() + 20
        while len(c.members()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(c.members()) == 3
        write(2)
        time.sleep(1)
        (tmp / "stop").touch()
        assert loader.wait(timeout=60) == 0, loader.stderr.read() if loader.stderr else ""
        read_all()
        # Everything the loader wrote during the changes is still there, byte for byte.
        lines = (tmp / "loaded").read_text().split()
        assert lines[-1] == "misses=0", (loader.stderr.read() if loader.stderr else "") + "".join(
            f"\n--- {a.address}\n" + a.log[-3000:] for a in pool["agents"])  # type: ignore[attr-defined]
        loaded = lines[:-1]
        assert len(loaded) > 50
        out = [np.zeros(8192, np.uint8) for _ in loaded]
        assert c.batch_get_into(loaded, out) == [8192] * len(loaded)
        for k, o in zip(loaded, out, strict=True):
            assert np.array_equal(o, np.random.default_rng(zlib.crc32(k.encode())).integers(0, 256, 8192, dtype=np.uint8))


def test_fill_past_high_watermark_keeps_leased_and_evicts_lru(pool: dict[str, object]) -> None:
    # 16 MiB DRAM, 1 MiB blocks: high watermark 0.75 = 12 blocks, low 0.5 = 8 blocks.
    agent = start(pool, dram="16Mi", extra=["--eviction", "lru", "--high-watermark", "0.75",
                                            "--low-watermark", "0.5", "--lease-seconds", "60"])
    size = 1 << 20
    data = blocks(14, size, seed=5)
    keys = [f"w{i}" for i in range(14)]
    with KVPoolClient(endpoints=[agent.address], token=token(pool), namespace="ns", transport="tcp") as c:
        assert c.batch_put(keys[:11], data[:11]) == [1] * 11
        # A reader holds a lease on w0 and w1 (located, not yet released), as a same-node copy would.
        reader = Connection(agent.address, token=token(pool).encode())
        lease = reader.locate(["ns/w0", "ns/w1"])
        assert [b.status for b in lease.blocks] == [p.Status.OK, p.Status.OK]
        # w2..w4 are read again, so they are the most recently used.
        assert c.batch_get_into(keys[2:5], [bytearray(size) for _ in range(3)]) == [size] * 3
        # Three more blocks push the tier past 12 of 16 MiB: eviction frees it down to 8 blocks,
        # taking the six least recently used that are not leased (w5..w10).
        assert c.batch_put(keys[11:14], data[11:14]) == [1] * 3
        present = dict(zip(keys, c.batch_exists(keys), strict=True))
        assert present["w0"] and present["w1"], "leased blocks survive"
        assert all(present[k] for k in ("w2", "w3", "w4")), "recently read blocks survive"
        assert all(present[k] for k in keys[11:14]), "new blocks are stored"
        gone = [k for k, here in present.items() if not here]
        assert gone == [f"w{i}" for i in range(5, 11)], gone
        stats = reader.stats()
        assert int(stats["dram_used"]) <= 8 * size
        reader.release(lease.lease_id)
        reader.close()


def test_local_first_writes_are_recorded_at_the_home(pool: dict[str, object]) -> None:
    ports = [free_port() for _ in range(3)]
    addresses = [f"127.0.0.1:{q}" for q in ports]
    for q in ports:
        start(pool, port=q, peers=[a for a in addresses if not a.endswith(f":{q}")])
    keys = [f"lf{i}" for i in range(30)]
    data = blocks(30, 8192, seed=9)
    # The writer's own agent is its first endpoint (reached through shared memory): every block lands there.
    with KVPoolClient(endpoints=addresses, token=token(pool), namespace="ns") as writer:
        deadline = time.monotonic() + 20
        while len(writer.members()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert writer.batch_put(keys, data) == [1] * 30
    stats = [Connection(a, token=token(pool).encode()).stats() for a in addresses]
    assert [int(s["blocks"]) for s in stats] == [30, 0, 0]
    # Each key's home (rendezvous over the three) records where its block lives.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pointers = [int(Connection(a, token=token(pool).encode()).stats()["pointers"]) for a in addresses]
        if sum(pointers) == 30 - sum(1 for k in keys if rank_home(f"ns/{k}", addresses) == addresses[0]):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"homes recorded {pointers} pointers")
    # A reader elsewhere (tcp, another endpoint) asks the homes and is sent to the holder.
    with KVPoolClient(endpoints=[addresses[2]], token=token(pool), namespace="ns", transport="tcp") as reader:
        out = [np.zeros(8192, np.uint8) for _ in keys]
        assert reader.batch_get_into(keys, out) == [8192] * 30
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    # Followed, not copied: the homes still hold no blocks of their own.
    assert [int(Connection(a, token=token(pool).encode()).stats()["blocks"]) for a in addresses] == [30, 0, 0]


def rank_home(key: str, addresses: list[str]) -> str:
    from daybreak.pool.placement import rank

    return rank(key, addresses)[0]
