"""Issue 12, the data plane attacked with real agent processes and sockets on 127.0.0.1 (every loop bounded).

Each test prints what it measured (``-s`` shows it): memory under the flood, connections held,
requests served during the attack, blocks lost.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from daybreak.agent.transfer import wire
from daybreak.agent.transfer.control import client_handshake, dial, parse_endpoint
from daybreak.agent.transfer.descriptor import SegmentDescriptor
from daybreak.client import KVPoolAuthorizationError, KVPoolClient
from daybreak.pool import capability
from daybreak.pool import protocol as p
from daybreak.pool.checksum import crc32c
from daybreak.pool.connection import Connection, RemoteError, parse_address
from daybreak.pool.credentials import agent_credential, namespace_credential
from daybreak.pool.shm import SHM_DIR
from daybreak.pool.sockets import recv_exact
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port


def start(pool: dict[str, object], *, dram: str = "64Mi", extra: list[str] | None = None,
          peers: list[str] | None = None, port: int | None = None) -> LocalAgent:
    agent = LocalAgent(address=f"127.0.0.1:{port or free_port()}", token_file=pool["token_file"],  # type: ignore[arg-type]
                       pool=str(pool["name"]), dram=dram, peers=peers or [], extra=extra or [])
    pool["agents"].append(agent)  # type: ignore[attr-defined]
    return agent.start()


def secret(pool: dict[str, object]) -> bytes:
    return Path(pool["token_file"]).read_text().strip().encode()  # type: ignore[arg-type]


def rss_bytes(agent: LocalAgent) -> int:
    assert agent.proc is not None
    for line in Path(f"/proc/{agent.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def admin(agent: LocalAgent, pool: dict[str, object]) -> Connection:
    return Connection(agent.address, token=secret(pool))


# -- finding 3: the namespace is a server-enforced boundary ------------------------------------------------

def test_namespace_credential_is_confined_to_its_namespace(pool: dict[str, object]) -> None:
    agent = start(pool)
    made = subprocess.run([sys.executable, "-m", "daybreak", "credentials", "--pool-secret-file",
                           str(pool["token_file"]), "--namespace", "team-a"], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert made.returncode == 0, made.stderr
    cred_a = made.stdout.strip()
    assert cred_a == namespace_credential(secret(pool), "team-a") and cred_a.startswith("dbk1.team-a.")
    with KVPoolClient(endpoints=[agent.address], token=cred_a, namespace="team-a", transport="tcp") as a:
        assert a.batch_put(["k"], [b"a-data"]) == [1]
        out = bytearray(16)
        assert a.batch_get_into(["k"], [out]) == [6]
    victim_cred = namespace_credential(secret(pool), "team-b")
    with KVPoolClient(endpoints=[agent.address], token=victim_cred, namespace="team-b", transport="tcp") as b:
        assert b.batch_put(["v"], [b"b-data"]) == [1]
    # The library says so at once...
    with pytest.raises(KVPoolAuthorizationError, match="scoped to namespace 'team-a'"):
        KVPoolClient(endpoints=[agent.address], token=cred_a, namespace="team-b")
    # ... and the agent refuses every op on another namespace's keys from a raw connection.
    attempts = {
        "get": lambda c: c.get_into(["team-b/v"], [memoryview(bytearray(16))]),
        "exists": lambda c: c.exists(["team-b/v"]),
        "remove": lambda c: c.remove(["team-b/v"]),
        "put": lambda c: c.put(["team-b/v"], [memoryview(b"forged")], [0]),
        "locate": lambda c: c.locate(["team-b/v"]),
        "record": lambda c: c.record("127.0.0.1:1", ["team-a/x"]),
        "ping": lambda c: c.ping(p.Member("fake", "127.0.0.1:9", 0)),
    }
    for name, attempt in attempts.items():
        conn = Connection(agent.address, token=cred_a.encode())
        with pytest.raises(RemoteError, match="not authorized"):
            attempt(conn)
        conn.close()
        print(f"cross-namespace {name}: refused")
    # The victim's block is intact.
    with KVPoolClient(endpoints=[agent.address], token=victim_cred, namespace="team-b", transport="tcp") as b:
        out = bytearray(16)
        assert b.batch_get_into(["v"], [out]) == [6] and bytes(out[:6]) == b"b-data"
    # The pool secret stays the admin credential: every namespace.
    conn = admin(agent, pool)
    assert [i.status for i in conn.exists(["team-a/k", "team-b/v"])] == [p.Status.OK, p.Status.OK]
    conn.close()
    assert agent.wait_log("event=request_refused"), agent.log[-2000:]


# -- finding 5: no secret on the wire, no replay ---------------------------------------------------------------

def test_captured_handshake_cannot_be_replayed(pool: dict[str, object]) -> None:
    agent = start(pool)
    host, port = parse_address(agent.address)
    # Capture a real client's handshake bytes through a one-shot relay.
    relay = socket.create_server(("127.0.0.1", 0))
    captured = bytearray()
    def pump() -> None:
        client_side, _ = relay.accept()
        with client_side, socket.create_connection((host, port)) as upstream:
            client_side.settimeout(5)
            upstream.settimeout(5)
            for _ in range(2):  # HELLO, then the proof (each answered by the agent)
                frame = client_side.recv(65536)
                captured.extend(frame)
                upstream.sendall(frame)
                client_side.sendall(upstream.recv(65536))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    good = Connection(f"127.0.0.1:{relay.getsockname()[1]}", token=secret(pool), timeout_seconds=10)
    t.join(10)
    relay.close()
    good.close()
    assert secret(pool) not in captured, "the secret never travels"
    # Replay both client frames on a fresh connection: the agent's nonce differs, the proof fails.
    with socket.create_connection((host, port), timeout=10) as replay:
        replay.sendall(captured)
        answers = b""
        while True:
            try:
                chunk = replay.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            answers += chunk
    header = p.unpack_header(answers[-(len(answers) - _first_frame_len(answers)):][:p.HEADER_SIZE])
    assert header.op == p.Op.ERROR and b"authentication failed" in answers
    assert agent.wait_log("reason=wrong_credential"), agent.log[-2000:]


def _first_frame_len(raw: bytes) -> int:
    h = p.unpack_header(raw[:p.HEADER_SIZE])
    return p.HEADER_SIZE + h.meta_len + h.data_len


# -- finding 4: membership cannot be forged ------------------------------------------------------------------

def test_forged_member_never_joins_and_never_gets_a_write(pool: dict[str, object]) -> None:
    real = start(pool)
    fake = socket.create_server(("127.0.0.1", 0))  # a "member" that records whoever dials it
    fake.settimeout(0.2)
    fake_address = f"127.0.0.1:{fake.getsockname()[1]}"
    cred = namespace_credential(secret(pool), "ns")
    # A namespace credential may not PING or RECORD (a forged member, or reads redirected).
    conn = Connection(real.address, token=cred.encode())
    with pytest.raises(RemoteError, match="not authorized"):
        conn.ping(p.Member(fake_address, fake_address, 0))
    conn.close()
    # A process that cannot prove the agent credential is refused outright.
    with pytest.raises(Exception, match="did not prove"):
        Connection(real.address, token=b"dbk1-agent." + b"0" * 64).ping(p.Member(fake_address, fake_address, 0))
    # Only the agent credential makes a member (and a bounded list: see peers.MAX_PEERS).
    peer = Connection(real.address, token=agent_credential(secret(pool)).encode())
    assert fake_address not in [m.address for m in peer.members()]
    peer.close()
    dialed = 0
    with KVPoolClient(endpoints=[real.address], token=cred, namespace="ns", transport="tcp") as c:
        assert c.members() == [real.address]
        stored = c.batch_put([f"w{i}" for i in range(40)], [b"x" * 100] * 40)
        assert stored == [1] * 40
        out = [bytearray(100) for _ in range(40)]
        assert c.batch_get_into([f"w{i}" for i in range(40)], out) == [100] * 40
    with pytest.raises(TimeoutError):
        fake.accept()  # nobody ever dialled the fake member: it received neither a handshake nor a write
    fake.close()
    print(f"forged member: writes caught=0/40, connections received={dialed}")


# -- finding 6: pre-authentication bounds ----------------------------------------------------------------------

def test_preauth_flood_costs_little_and_clients_keep_being_served(pool: dict[str, object]) -> None:
    agent = start(pool, extra=["--handshake-seconds", "20"])
    host, port = parse_address(agent.address)
    cred = namespace_credential(secret(pool), "ns")
    client = KVPoolClient(endpoints=[agent.address], token=cred, namespace="ns", transport="tcp")
    before = rss_bytes(agent)
    flood: list[socket.socket] = []
    served = 0
    held = 0
    try:
        for i in range(1000):
            s = socket.create_connection((host, port), timeout=10)
            if i % 2:  # a header claiming 4 MiB of metadata, then silence; or silence from the start
                s.sendall(p.pack_header(op=p.Op.HELLO, meta_len=p.MAX_META_BYTES))
            flood.append(s)
            if i % 100 == 99:
                assert client.batch_put([f"f{i}"], [b"y" * 4096]) == [1]
                served += 1
                # New clients too, not only the one already connected.
                with KVPoolClient(endpoints=[agent.address], token=cred, namespace="ns", transport="tcp") as fresh:
                    assert fresh.batch_exists([f"f{i}"]) == [True]
                served += 1
        time.sleep(0.5)
        peak = rss_bytes(agent)
        stats = admin(agent, pool).stats()
        held = int(stats["connections"])
    finally:
        for s in flood:
            s.close()
        client.close()
    growth = peak - before
    print(f"pre-auth flood: 1000 connections, rss {before >> 20} -> {peak >> 20} MiB (+{growth >> 20} MiB), "
          f"held by the agent={held}, requests served during it={served}")
    assert growth < 100 << 20
    assert served == 20


def test_slowloris_is_closed_at_the_handshake_deadline(pool: dict[str, object]) -> None:
    agent = start(pool, extra=["--handshake-seconds", "2"])
    host, port = parse_address(agent.address)
    hello = b"".join(p.frame(p.Op.HELLO, p.Hello("slow", "admin", os.urandom(16)).encode(), request_id=1))
    slow = [socket.create_connection((host, port), timeout=10) for _ in range(50)]
    started = time.monotonic()
    closed_at: dict[int, float] = {}
    for step in itertools.count():
        if len(closed_at) == len(slow) or time.monotonic() - started > 15:
            break
        for i, s in enumerate(slow):
            if i in closed_at:
                continue
            try:
                s.sendall(hello[step:step + 1])  # one byte a tick
                s.settimeout(0.01)
                if s.recv(1) == b"":
                    closed_at[i] = time.monotonic() - started
            except TimeoutError:
                pass
            except OSError:
                closed_at[i] = time.monotonic() - started
        time.sleep(0.2)
    for s in slow:
        s.close()
    with KVPoolClient(endpoints=[agent.address], token=secret(pool).decode(), namespace="ns") as c:
        assert c.batch_put(["after"], [b"ok"]) == [1]
    print(f"slowloris: {len(closed_at)}/50 closed, last after {max(closed_at.values()):.1f} s (deadline 2 s)")
    assert len(closed_at) == 50 and max(closed_at.values()) < 8


# -- finding 7: authenticated denial of service -------------------------------------------------------------

def test_reservation_without_data_evicts_nothing_and_expires(pool: dict[str, object]) -> None:
    agent = start(pool, dram="16Mi", extra=["--io-seconds", "2"])
    cred = namespace_credential(secret(pool), "victim")
    victim = KVPoolClient(endpoints=[agent.address], token=cred, namespace="victim", transport="tcp")
    keys = [f"v{i}" for i in range(12)]
    assert victim.batch_put(keys, [bytes([i]) * (1 << 20) for i in range(12)]) == [1] * 12
    # The attacker (its own namespace) promises 120 MiB in one PUT header and sends nothing.
    attacker = Connection(agent.address, token=namespace_credential(secret(pool), "evil").encode())
    meta = p.PutRequest([f"evil/{i}" for i in range(120)], [1 << 20] * 120, [0] * 120).encode()
    attacker.sock.sendall(b"".join(p.frame(p.Op.PUT, meta, request_id=9, data_len=120 << 20)))
    time.sleep(1)
    during = victim.batch_exists(keys)
    other = KVPoolClient(endpoints=[agent.address], token=namespace_credential(secret(pool), "third"),
                         namespace="third", transport="tcp")
    assert other.batch_put(["t"], [b"z" * 4096]) == [1], "new writes are not blocked"
    # The stalled PUT is dropped at its deadline.
    attacker.sock.settimeout(10)
    try:
        gone = attacker.sock.recv(1) == b""
    except ConnectionResetError:
        gone = True
    assert gone
    lost = 12 - sum(victim.batch_exists(keys))
    print(f"empty 120 MiB PUT: victim blocks lost={lost}, present during the attack={sum(during)}/12")
    assert all(during) and lost == 0
    victim.close()
    other.close()


def test_unread_get_reply_does_not_pin_blocks(pool: dict[str, object]) -> None:
    agent = start(pool, dram="64Mi", extra=["--io-seconds", "2"])
    cred = namespace_credential(secret(pool), "ns")
    c = KVPoolClient(endpoints=[agent.address], token=cred, namespace="ns", transport="tcp")
    assert c.batch_put(["big"], [b"b" * (16 << 20)]) == [1]
    reader = Connection(agent.address, token=cred.encode())
    reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader._send(p.Op.GET, p.KeysRequest(["ns/big"], [16 << 20]).encode())  # ... and never read the reply
    deadline = time.monotonic() + 20
    removed = False
    while time.monotonic() < deadline and not removed:
        removed = c.remove(["big"]) == [True]
        time.sleep(0.5)
    reader.close()
    print(f"unread GET: block released and removed={removed}")
    assert removed
    c.close()


def test_reservation_ids_belong_to_their_connection(pool: dict[str, object]) -> None:
    agent = start(pool)
    cred = namespace_credential(secret(pool), "ns").encode()
    owner, thief = Connection(agent.address, token=cred), Connection(agent.address, token=cred)
    reply = owner.alloc(["ns/a"], [4096], [0])
    assert thief.commit(reply.lease_id, abort=True) == []  # not the thief's to abort
    assert [i.status for i in owner.commit(reply.lease_id)] == [p.Status.CORRUPT]  # zeros, not the claimed crc
    owner.close()
    thief.close()


def test_put_with_a_wrong_checksum_is_not_stored(pool: dict[str, object]) -> None:
    agent = start(pool)
    conn = Connection(agent.address, token=namespace_credential(secret(pool), "ns").encode())
    infos = conn.put(["ns/bad"], [memoryview(b"payload")], [12345])
    assert infos[0].status == p.Status.CORRUPT
    assert conn.exists(["ns/bad"])[0].status == p.Status.MISS
    conn.close()


def test_oversized_record_holder_is_refused_not_served(pool: dict[str, object]) -> None:
    agent = start(pool)
    conn = Connection(agent.address, token=agent_credential(secret(pool)).encode())
    with pytest.raises((RemoteError, OSError, ValueError)):
        conn.record("h" * 600, ["ns/a"])
    conn.close()
    with KVPoolClient(endpoints=[agent.address], token=secret(pool).decode(), namespace="ns") as c:
        assert c.batch_get_into(["a", "b"], [bytearray(4), bytearray(4)]) == [None, None]


# -- finding 8: files and secrets on the node -------------------------------------------------------------

def test_shm_files_are_private_and_planted_ones_are_not_adopted(pool: dict[str, object], tmp_path: Path) -> None:
    port = free_port()
    prefix = f"daybreak-{pool['name']}-127.0.0.1_{port}"
    victim = tmp_path / "victim-file"
    victim.write_bytes(b"precious")
    (SHM_DIR / f"{prefix}-dram-0").symlink_to(victim)
    agent = start(pool, port=port, dram="16Mi")
    assert victim.read_bytes() == b"precious", "a planted symlink is never followed"
    for path in SHM_DIR.glob(f"{prefix}-*"):
        assert not path.is_symlink() and path.stat().st_mode & 0o077 == 0, path
    agent.kill()


def test_weak_or_shared_secret_file_is_refused(tmp_path: Path) -> None:
    weak = tmp_path / "weak"
    weak.write_text("12345\n")
    weak.chmod(0o600)
    shared = tmp_path / "shared"
    shared.write_text("x" * 64)
    shared.chmod(0o666)
    for path, reason in ((weak, "fewer than 32"), (shared, "writable by others")):
        out = subprocess.run([sys.executable, "-m", "daybreak", "agent", "--standalone", "--listen",
                              f"127.0.0.1:{free_port()}", "--dram", "8Mi", "--token-file", str(path), "--pool",
                              f"w{uuid.uuid4().hex[:6]}"], capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode != 0 and reason in out.stderr, out.stderr[-500:]
    fresh = tmp_path / "fresh"
    name = f"w{uuid.uuid4().hex[:6]}"
    agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=fresh, pool=name, dram="8Mi").start()
    assert fresh.stat().st_mode & 0o777 == 0o600
    agent.stop()
    cleanup_pool(name)


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening tcp socket the process holds, from /proc (ipv4 and ipv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as host-order 32-bit words
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, packed), int(hex_port, 16)))
    return found


def test_every_listener_binds_the_listen_host_metrics_included(pool: dict[str, object]) -> None:
    # Issue 12 finding 8: "the metrics port binds 0.0.0.0 even with --listen 127.0.0.1". The store, the
    # transfer engine and /metrics must all bind the --listen host and nothing wider.
    metrics_port = free_port()
    agent = start(pool, dram="16Mi", extra=["--metrics-port", str(metrics_port)])
    assert agent.proc is not None
    listeners = _listening(agent.proc.pid)
    print(f"listeners of an agent with --listen 127.0.0.1: {sorted(listeners)}")
    assert ("127.0.0.1", metrics_port) in listeners, listeners
    assert len(listeners) >= 3, f"store, transfer engine and metrics expected: {listeners}"
    assert {host for host, _ in listeners} == {"127.0.0.1"}, listeners
    with socket.create_connection(("127.0.0.1", metrics_port), timeout=10) as ok:
        ok.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert ok.recv(12).startswith(b"HTTP/1.0 200")
    with pytest.raises(ConnectionRefusedError):  # another local address: a 0.0.0.0 bind would answer here
        socket.create_connection(("127.0.0.2", metrics_port), timeout=10).close()
    agent.kill()


# -- finding 9: stopped agents leave nothing behind -------------------------------------------------------

def test_clean_stop_leaves_nothing_in_dev_shm(pool: dict[str, object]) -> None:
    agent = start(pool, dram="16Mi")
    with KVPoolClient(endpoints=[agent.address], token=secret(pool).decode(), namespace="ns") as c:
        assert c.batch_put(["k"], [b"v" * 1000]) == [1]
    assert list(SHM_DIR.glob(f"daybreak-{pool['name']}-*"))
    assert agent.stop() == 0
    left = list(SHM_DIR.glob(f"daybreak-{pool['name']}-*"))
    print(f"clean stop: files left in {SHM_DIR}={len(left)}")
    assert left == []


def test_keep_segments_then_orphan_reclaim(pool: dict[str, object]) -> None:
    port = free_port()
    agent = start(pool, dram="16Mi", port=port, extra=["--keep-segments"])
    assert agent.stop() == 0
    kept = list(SHM_DIR.glob(f"daybreak-{pool['name']}-*"))
    assert kept, "--keep-segments keeps the tier for a restart"
    # Nobody restarts it: another agent's start reclaims it once it is older than the bound.
    other = start(pool, dram="16Mi", extra=["--orphan-seconds", "0"])
    assert not [p_ for p_ in kept if p_.exists()], "the orphaned tier is reclaimed"
    assert other.wait_log("event=orphan_reclaimed"), other.log[-2000:]
    other.stop()


def test_member_list_is_bounded() -> None:
    from daybreak.agent.store.peers import MAX_PEERS, Membership

    members = Membership(address="127.0.0.1:1", token=b"x" * 32)
    for i in range(MAX_PEERS + 30):  # 1,030 names, as in the report
        members.heard(p.Member(f"fake{i}", f"10.9.{i // 250}.{i % 250}:7480", 0))
    assert len(members.members()) == MAX_PEERS + 1  # the bound, plus itself
    members.close()


# -- finding 5: TLS for the tcp path, and what it costs ----------------------------------------------------

def test_tls_store_protocol_and_its_cost(pool: dict[str, object], tmp_path: Path) -> None:
    cert, key = tmp_path / "agent.pem", tmp_path / "agent.key"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    plain = start(pool, dram="128Mi")
    tls = start(pool, dram="128Mi", extra=["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert)])
    data = [os.urandom(4 << 20) for _ in range(8)]
    rates = {}
    for label, agent, ca in (("plain", plain, None), ("tls", tls, str(cert))):
        with KVPoolClient(endpoints=[agent.address], token=secret(pool).decode(), namespace="ns", transport="tcp",
                          tls_ca_file=ca) as c:
            started = time.perf_counter()
            for _ in range(4):
                assert c.batch_put([f"b{i}" for i in range(8)], data) == [1] * 8
                out = [bytearray(4 << 20) for _ in range(8)]
                assert c.batch_get_into([f"b{i}" for i in range(8)], out) == [4 << 20] * 8
                assert out == [bytearray(d) for d in data]
            rates[label] = 2 * 4 * 32 / (time.perf_counter() - started)
    # Without TLS the client cannot even start a handshake with the TLS agent.
    with pytest.raises(Exception):  # noqa: B017 - refused or reset, depending on timing
        KVPoolClient(endpoints=[tls.address], token=secret(pool).decode(), namespace="ns", transport="tcp",
                     timeout_seconds=5)
    print(f"tls cost: plain {rates['plain']:.0f} MiB/s, tls {rates['tls']:.0f} MiB/s (put+get, 4 MiB blocks)")


# -- issue 22 finding 1: no residue through reservations --------------------------------------------------------

_VICTIM = b"VICTIM-SECRET-KV"  # 16 bytes: a victim block is this pattern over and over


def _victim_blocks(count: int, size: int) -> list[bytes]:
    return [(_VICTIM[:-2] + b"%02d" % (i % 100)) * (size // len(_VICTIM)) for i in range(count)]


def _residue_in(data: bytes | bytearray) -> bool:
    return _VICTIM[:-2] in data


def _attack(agent: LocalAgent, pool: dict[str, object], *, count: int, size: int, agent_crc: bool,
            alloc: bool = False, batch: int = 8) -> tuple[int, int]:
    """The attacker reserves ``count`` blocks, ``batch`` at a time until its namespace's held quota refuses
    more, commits them without writing a byte and reads them back by GET.

    Returns (blocks the agent published, blocks that came back holding victim bytes)."""
    cred = namespace_credential(secret(pool), "attacker").encode()
    conn = Connection(agent.address, token=cred)
    zero_crc = crc32c(bytes(size))
    published: list[str] = []
    leases: list[int] = []
    for start in range(0, count, batch):
        keys = [f"attacker/r{i}" for i in range(start, min(count, start + batch))]
        try:
            if alloc:  # same-node ALLOC: the checksum the agent checks at COMMIT is the attacker's own guess
                reply = conn.alloc(keys, [size] * len(keys), [zero_crc] * len(keys))
            else:
                reply = conn.xalloc(keys, [size] * len(keys), [zero_crc] * len(keys), agent_crc=agent_crc)
        except RemoteError as exc:  # the held quota (docs/store.md, Fair share) bounds what one namespace reserves
            assert "quota exceeded" in str(exc)
            break
        leases.append(reply.lease_id)
        published += [k for k, info in zip(keys, reply.blocks, strict=True) if info.status == p.Status.OK]
    committed = 0
    for lease in leases:  # all reserved first (the most residue one namespace can hold), then published
        committed += sum(info.status == p.Status.OK for info in conn.commit(lease))
    leaked = 0
    readable = 0
    for key in published:
        out = bytearray(size)
        [info] = conn.get_into([key], [memoryview(out)])
        if info.status != p.Status.OK:
            continue
        readable += 1
        leaked += _residue_in(out)
    conn.close()
    assert readable == committed
    return readable, leaked


@pytest.mark.parametrize("agent_crc", [True, False], ids=["agent-crc", "zero-crc"])
def test_reserving_a_removed_blocks_extent_returns_no_victim_bytes(pool: dict[str, object], agent_crc: bool) -> None:
    agent = start(pool)
    count, size = 24, 1 << 20
    victim = Connection(agent.address, token=namespace_credential(secret(pool), "victim").encode())
    blocks = _victim_blocks(count, size)
    keys = [f"victim/b{i}" for i in range(count)]
    assert all(i.status == p.Status.OK for i in victim.put(keys, [memoryview(b) for b in blocks],
                                                           [crc32c(b) for b in blocks]))
    assert all(i.status == p.Status.OK for i in victim.remove(keys))
    victim.close()
    published, leaked = _attack(agent, pool, count=count, size=size, agent_crc=agent_crc)
    print(f"attacker published {published} of {count} unwritten reservations, {leaked} held victim bytes")
    # The agent cleared every extent first: what it published is zeros (so a zero checksum matches), never residue.
    assert leaked == 0 and published == count


def test_same_node_alloc_of_a_removed_blocks_extent_returns_no_victim_bytes(pool: dict[str, object]) -> None:
    agent = start(pool)
    count, size = 8, 1 << 20
    victim = Connection(agent.address, token=namespace_credential(secret(pool), "victim").encode())
    blocks = _victim_blocks(count, size)
    keys = [f"victim/b{i}" for i in range(count)]
    victim.put(keys, [memoryview(b) for b in blocks], [crc32c(b) for b in blocks])
    victim.remove(keys)
    victim.close()
    published, leaked = _attack(agent, pool, count=count, size=size, agent_crc=False, alloc=True)
    print(f"ALLOC: attacker published {published} unwritten reservations, {leaked} held victim bytes")
    assert leaked == 0 and published == count  # zeros, which the attacker's zero checksum matches


def test_reserving_past_the_tier_evicts_live_victims_and_returns_none_of_their_bytes(
        pool: dict[str, object]) -> None:
    agent = start(pool, dram="64Mi")
    size = 1 << 20
    victim = Connection(agent.address, token=namespace_credential(secret(pool), "victim").encode())
    blocks = _victim_blocks(40, size)
    keys = [f"victim/b{i}" for i in range(40)]
    stored = victim.put(keys, [memoryview(b) for b in blocks], [crc32c(b) for b in blocks])
    assert all(i.status == p.Status.OK for i in stored)
    published, leaked = _attack(agent, pool, count=48, size=size, agent_crc=True)
    live = sum(i.status == p.Status.OK for i in victim.exists(keys))
    victim.close()
    print(f"48 MiB asked for on a 64 MiB tier: {published} attacker blocks published (the held quota stops the "
          f"rest), {40 - live} of 40 victim blocks evicted, {leaked} held victim bytes")
    assert leaked == 0
    assert published <= 32  # half the tier: the namespace's held quota
    # Eviction runs the tier down to its low watermark (0.8 x 64 MiB) and the attacker holds at most its
    # quota (32 MiB), so the victim keeps at least the 19 MiB between them (its 40 MiB exceed a fair half).
    assert live >= int(0.8 * 64) - 32


# -- issue 22 finding 5: one-sided access needs a capability, and no pool secret ------------------------------

class OneSided:
    """A raw connection to an agent's transfer-engine tcp server, speaking ``agent/transfer/wire`` by hand."""

    def __init__(self, endpoint: str, token: str) -> None:
        self.sock = dial(parse_endpoint(endpoint, field_name="endpoint"), timeout_s=10, tls=None)
        self.sock.settimeout(10)
        client_handshake(self.sock, engine_id="test-peer", token=token)
        self.ids = itertools.count(1)

    def request(self, kind: wire.FrameType, handle: int, offset: int, length: int, capability: bytes | None,
                payload: bytes = b"") -> tuple[wire.FrameType, bytes]:
        """One READ or WRITE of one extent; (answer type, data or error text)."""
        caps = wire.pack_capabilities([capability]) if capability is not None else b""
        head = wire.pack_header(kind, frame_id=next(self.ids), count=1, payload_len=len(payload),
                                flags=wire.FLAG_CAPS if capability is not None else 0, caps_len=len(caps))
        self.sock.sendall(head + wire.pack_extents([wire.Extent(handle, offset, length)]) + caps + payload)
        hdr = wire.parse_header(recv_exact(self.sock, wire.HEADER.size))
        if hdr.type is wire.FrameType.DATA:
            recv_exact(self.sock, hdr.count * wire.EXTENT.size)
        return hdr.type, bytes(recv_exact(self.sock, hdr.payload_len)) if hdr.payload_len else b""

    def close(self) -> None:
        self.sock.close()


def _engine_segment(conn: Connection) -> SegmentDescriptor:
    [dram] = [SegmentDescriptor.from_json(e.descriptor) for e in conn.segments() if e.tier == 0]
    return dram


def test_one_sided_reads_and_writes_need_a_capability_for_exactly_that_extent(pool: dict[str, object]) -> None:
    agent = start(pool, extra=["--lease-seconds", "2"])
    cred = {ns: namespace_credential(secret(pool), ns) for ns in ("victim", "attacker")}
    size = 64 << 10
    victim = Connection(agent.address, token=cred["victim"].encode())
    secret_block = _victim_blocks(1, size)[0]
    assert victim.put(["victim/b"], [memoryview(secret_block)], [crc32c(secret_block)])[0].status == p.Status.OK
    mine = os.urandom(size)
    attacker = Connection(agent.address, token=cred["attacker"].encode())
    assert attacker.put(["attacker/a"], [memoryview(mine)], [crc32c(mine)])[0].status == p.Status.OK
    seg = _engine_segment(attacker)
    READ, WRITE, DATA, ACK, ERROR = (wire.FrameType.READ, wire.FrameType.WRITE, wire.FrameType.DATA,
                                     wire.FrameType.ACK, wire.FrameType.ERROR)

    # The engine pod proves its namespace credential: no pool secret anywhere in this test.
    engine = OneSided(seg.tcp_endpoint, cred["attacker"])
    located = attacker.xlocate(["attacker/a"])
    [info], read_cap = located.blocks, located.capability(0)
    assert info.where == seg.segment_id and len(read_cap) == capability.SIZE
    assert engine.request(READ, seg.tcp_handle, info.offset, size, read_cap) == (DATA, mine)  # the normal path
    assert engine.request(READ, seg.tcp_handle, info.offset + 4096, 4096, read_cap)[0] is DATA  # inside: fine

    refusals = {
        "no capability": (READ, info.offset, size, None),
        "an empty capability": (READ, info.offset, size, b""),
        "another offset range": (READ, 0 if info.offset else size, size, read_cap),
        "a range past its end": (READ, info.offset, size + 4096, read_cap),
        "a forged MAC": (READ, info.offset, size, read_cap[:-1] + bytes([read_cap[-1] ^ 1])),
        "a widened range": (READ, 0, seg.size, _widened(read_cap, offset=0, length=seg.size)),
        "a WRITE with a READ grant": (WRITE, info.offset, size, read_cap),
    }
    for what, (kind, offset, length, cap) in refusals.items():
        answer, text = engine.request(kind, seg.tcp_handle, offset, length, cap,
                                      payload=b"x" * length if kind is WRITE else b"")
        assert answer is ERROR and b"not authorized" in text, (what, answer, text[:200])
        print(f"one-sided {kind.name} with {what}: refused ({text.decode()[:90]})")
    # Another namespace's connection cannot spend the attacker's capability; the pool secret needs one too.
    other = OneSided(seg.tcp_endpoint, cred["victim"])
    assert other.request(READ, seg.tcp_handle, info.offset, size, read_cap)[0] is ERROR
    admin_engine = OneSided(seg.tcp_endpoint, secret(pool).decode())
    assert admin_engine.request(READ, seg.tcp_handle, 0, seg.size, None)[0] is ERROR
    # Revoked: RELEASE ends the lease, and with it the capability, before its expiry.
    attacker.release(located.lease_id)
    attacker.exists(["attacker/a"])  # RELEASE has no reply: a round trip on the same connection orders it first
    answer, text = engine.request(READ, seg.tcp_handle, info.offset, size, read_cap)
    assert answer is ERROR and b"revoked" in text, text
    # Expired: a lease nobody released, past --lease-seconds.
    late = attacker.xlocate(["attacker/a"])
    time.sleep(3.5)
    answer, text = engine.request(READ, seg.tcp_handle, late.blocks[0].offset, size, late.capability(0))
    assert answer is ERROR and (b"expired" in text or b"revoked" in text), text

    # WRITE: the reservation's capability lands bytes; COMMIT revokes it.
    new = os.urandom(size)
    reserved = attacker.xalloc(["attacker/w"], [size], [crc32c(new)])
    write_cap = reserved.capability(0)
    [slot] = reserved.blocks
    assert engine.request(READ, seg.tcp_handle, slot.offset, size, write_cap)[0] is ERROR  # WRITE grants no READ
    assert engine.request(WRITE, seg.tcp_handle, slot.offset, size, write_cap, payload=new)[0] is ACK
    assert attacker.commit(reserved.lease_id)[0].status == p.Status.OK
    assert engine.request(WRITE, seg.tcp_handle, slot.offset, size, write_cap, payload=bytes(size))[0] is ERROR
    out = bytearray(size)
    assert attacker.get_into(["attacker/w"], [memoryview(out)])[0].status == p.Status.OK and bytes(out) == new

    # A malformed frame closes that connection only; the others keep being served.
    bad = OneSided(seg.tcp_endpoint, cred["attacker"])
    bad.sock.sendall(b"\x00" * wire.HEADER.size)
    assert bad.sock.recv(1) == b""
    bad.close()
    fresh = attacker.xlocate(["attacker/a"])
    assert engine.request(READ, seg.tcp_handle, fresh.blocks[0].offset, size, fresh.capability(0)) == (DATA, mine)
    attacker.release(fresh.lease_id)
    for c in (engine, other, admin_engine):
        c.close()
    # The victim's block was never touched.
    out = bytearray(size)
    assert victim.get_into(["victim/b"], [memoryview(out)])[0].status == p.Status.OK and bytes(out) == secret_block
    victim.close()
    attacker.close()
    assert agent.wait_log("tcp one-sided request refused"), agent.log[-2000:]


def _widened(cap: bytes, *, offset: int, length: int) -> bytes:
    """The capability with its range rewritten (and its MAC left as it was): what a forger would try."""
    body = bytearray(cap)
    struct.pack_into("!QQ", body, 20, offset, length)
    return bytes(body)
