"""Transfer engine across a true network path: two engines in their own network namespaces joined by a veth pair."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from support import layout as pack

from daybreak.testing.transfer_peer import PeerProcess, pattern

pytestmark = pytest.mark.netns

MiB = 1 << 20
SIZES = [1, 3, 4096, 65_537, MiB + 1, 16 * MiB, 64 * MiB]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Net:
    ns_a: str
    ns_b: str
    addr_a: str
    addr_b: str
    dev_b: str


@pytest.fixture
def veth() -> Iterator[Net]:
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"dbt-{tag}-a", f"dbt-{tag}-b"
    dev_a, dev_b = f"dbt{tag}a", f"dbt{tag}b"  # interface names: 15 characters at most
    # private addresses that exist only inside our two namespaces
    octet = int(tag[:2], 16)
    addr_a, addr_b = f"10.231.{octet}.1", f"10.231.{octet}.2"
    try:
        _ip("netns", "add", ns_a)
    except FileNotFoundError:
        pytest.skip("network namespaces: the `ip` command (iproute2) is not installed")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces not permitted here: `ip netns add` said {exc.stderr.strip()!r}")
    try:
        _ip("netns", "add", ns_b)
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        _ip("link", "set", dev_a, "netns", ns_a)
        _ip("link", "set", dev_b, "netns", ns_b)
        _ip("-n", ns_a, "addr", "add", f"{addr_a}/30", "dev", dev_a)
        _ip("-n", ns_b, "addr", "add", f"{addr_b}/30", "dev", dev_b)
        for ns, dev in ((ns_a, dev_a), (ns_b, dev_b)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        yield Net(ns_a, ns_b, addr_a, addr_b, dev_b)
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def pair(veth: Net) -> Iterator[tuple[PeerProcess, PeerProcess, Net]]:
    total = sum(s + 4096 for s in SIZES)
    a = PeerProcess(segment_bytes=total, node="host-a", listen=f"{veth.addr_a}:0",
                    prefix=["ip", "netns", "exec", veth.ns_a])
    try:
        b = PeerProcess(segment_bytes=total, node="host-b", listen=f"{veth.addr_b}:0",
                        prefix=["ip", "netns", "exec", veth.ns_b])
    except BaseException:
        a.close()
        raise
    try:
        yield a, b, veth
    finally:
        a.close()
        b.close()


def test_mixed_sizes_cross_namespaces_byte_exact(pair: tuple[PeerProcess, PeerProcess, Net]) -> None:
    a, b, net = pair
    assert json.loads(b.descriptor)["tcp_endpoint"].startswith(net.addr_b)
    rid = a.open(b.descriptor)
    layout = pack(SIZES)
    for i, (off, size) in enumerate(layout):
        a.fill(i + 1, off, size)
    results = a.batch([("write", rid, off, off, size) for off, size in layout], timeout_s=60)
    assert [r["status"] for r in results] == ["completed"] * len(layout), results
    assert {r["transport"] for r in results} == {"tcp"}
    for i, (off, size) in enumerate(layout):
        expected = hashlib.sha256(pattern(i + 1, size)).hexdigest()
        assert b.hash(off, size) == a.hash(off, size) == expected, f"WRITE of {size} bytes differs"
    for i, (off, size) in enumerate(layout):
        b.fill(50 + i, off, size)
    results = a.batch([("read", rid, off, off, size) for off, size in layout], timeout_s=60)
    assert [r["status"] for r in results] == ["completed"] * len(layout), results
    for i, (off, size) in enumerate(layout):
        assert a.hash(off, size) == hashlib.sha256(pattern(50 + i, size)).hexdigest(), f"READ of {size} differs"


def test_cut_link_times_out_killed_peer_fails(pair: tuple[PeerProcess, PeerProcess, Net]) -> None:
    a, b, net = pair
    rid = a.open(b.descriptor)
    big = SIZES[-1]
    off = pack(SIZES)[-1][0]
    assert a.batch([("write", rid, 0, 0, 1)], timeout_s=10)[0]["status"] == "completed"
    # a cut cable sends no RST: only the deadline can end these requests
    _ip("-n", net.ns_b, "link", "set", net.dev_b, "down")
    results = a.batch([("write", rid, off, off, big), ("read", rid, off, off, big)], timeout_s=2)
    assert [r["status"] for r in results] == ["timeout", "timeout"], results
    _ip("-n", net.ns_b, "link", "set", net.dev_b, "up")
    # a killed peer's kernel resets the connections: the batch fails with the cause, well before its deadline
    assert a.batch([("write", rid, 0, 0, 1)], timeout_s=30)[0]["status"] == "completed"
    killer = threading.Timer(0.2, b.kill)
    killer.start()
    try:
        results = a.batch([("write", rid, off, off, big)] * 200, timeout_s=120)
    finally:
        killer.join()
    statuses = [r["status"] for r in results]
    assert "failed" in statuses and "timeout" not in statuses and "pending" not in statuses, statuses
    cause = next(r["error"] for r in results if r["status"] == "failed")
    assert b.proc.poll() is not None
    assert "tcp" in cause and ("refused" in cause or "lost" in cause or "closed" in cause or "reset" in cause), cause
