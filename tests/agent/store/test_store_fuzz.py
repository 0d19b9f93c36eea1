"""Fuzz the store's frame parser in-process and a live agent over sockets (about 60 s in all).

In-process: any bytes either decode or raise ProtocolError, nothing else.
Live: random, truncated and mutated frames on their own connections never
crash the agent nor disturb a well-behaved client on another connection.
"""

from __future__ import annotations

import socket
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daybreak.client import KVPoolClient
from daybreak.pool import protocol as p
from daybreak.pool.connection import Connection
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

pytestmark = pytest.mark.fuzz

PARSER_SECONDS = 30.0
LIVE_SECONDS = 28.0
FUZZ = settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))

VALID: list[tuple[p.Op, bytes]] = [
    (p.Op.HELLO, p.Hello("client", "ns:ns", b"n" * 16).encode()),
    (p.Op.HELLO, p.HelloProof(b"p" * 32).encode()),
    (p.Op.PUT, p.PutRequest(["ns/a", "ns/b"], [10, 20], [1, 2], 5, 0).encode()),
    (p.Op.GET, p.KeysRequest(["ns/a", "ns/b"], [10, 20]).encode()),
    (p.Op.EXISTS, p.KeysRequest(["ns/a"]).encode()),
    (p.Op.RELEASE, p.LeaseRequest(7).encode()),
    (p.Op.ALLOC, p.AllocRequest(["k"], [4096], [9]).encode()),
    (p.Op.PING, p.MembersReply([p.Member("a", "127.0.0.1:1", 0)]).encode()),
]
REPLIES: list[tuple[type, bytes]] = [
    (p.BlocksReply, p.BlocksReply([p.BlockInfo(p.Status.OK, 5, 6, "seg", 4096)], 3).encode()),
    (p.HelloReply, p.HelloReply("a", "pool", "probe", b"n" * 16, 10, 2).encode()),
    (p.HelloChallenge, p.HelloChallenge(b"n" * 16, b"p" * 32).encode()),
    (p.MembersReply, p.MembersReply([p.Member("a", "b", 1)]).encode()),
    (p.TextReply, p.TextReply("x=1").encode()),
]


def run_for(seconds: float, fn: Callable[[], None]) -> int:
    """Call a hypothesis test repeatedly until ``seconds`` have passed; returns how many sessions ran."""
    deadline = time.monotonic() + seconds
    sessions = 0
    while time.monotonic() < deadline:
        fn()
        sessions += 1
    return sessions


def mutate(data: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
    raw = bytearray(data)
    for pos, value in flips:
        if raw:
            raw[pos % len(raw)] = value
    return bytes(raw[: cut % (len(raw) + 1)] if cut >= 0 else raw)


def decode_any(header: bytes, meta: bytes) -> None:
    try:
        h = p.unpack_header(header)
        p.decode_request(h.op, meta)
    except p.ProtocolError:
        pass


mutations = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6)


@FUZZ
@given(header=st.binary(min_size=p.HEADER_SIZE, max_size=p.HEADER_SIZE), meta=st.binary(max_size=512),
       which=st.integers(0, len(VALID) - 1), flips=mutations, cut=st.integers(-1, 4096))
def _parser_case(header: bytes, meta: bytes, which: int, flips: list[tuple[int, int]], cut: int) -> None:
    decode_any(header, meta)  # pure noise
    op, body = VALID[which]
    good_header = p.pack_header(op=op, meta_len=len(body))
    decode_any(good_header, mutate(body, flips, cut))  # a valid header, damaged metadata
    decode_any(mutate(good_header, flips, -1), body)  # a damaged header, valid metadata
    kind, reply = REPLIES[which % len(REPLIES)]
    try:
        kind.decode(mutate(reply, flips, cut))
    except p.ProtocolError:
        pass


@FUZZ
@given(keys=st.lists(st.text(min_size=1, max_size=40), max_size=8), sizes=st.lists(st.integers(0, 2**40), max_size=8))
def _roundtrip_case(keys: list[str], sizes: list[int]) -> None:
    sizes = (sizes + [0] * len(keys))[: len(keys)]
    msg = p.PutRequest(keys, [min(s, p.MAX_BLOCK_BYTES) for s in sizes], [s & 0xFFFFFFFF for s in sizes], 3, 1)
    assert p.PutRequest.decode(msg.encode()) == msg
    req = p.KeysRequest(keys, [min(s, 2**63) for s in sizes])
    assert p.KeysRequest.decode(req.encode()) == req


def test_frame_parser_fuzz() -> None:
    sessions = run_for(PARSER_SECONDS * 0.8, _parser_case)
    sessions += run_for(PARSER_SECONDS * 0.2, _roundtrip_case)
    assert sessions >= 2


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[LocalAgent]:
    pool = f"fz{uuid.uuid4().hex[:8]}"
    a = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=tmp_path / "token", pool=pool, dram="32Mi")
    a.start()
    yield a
    a.kill()
    cleanup_pool(pool)


def test_live_agent_survives_fuzzed_connections(agent: LocalAgent) -> None:
    token = agent.token_file.read_text().strip()
    host, port = agent.address.split(":")
    good = KVPoolClient(endpoints=[agent.address], token=token, namespace="ns", transport="tcp")
    payload = bytes(range(256)) * 16
    assert good.batch_put(["steady"], [payload]) == [1]
    checks = 0

    def send(raw: bytes, *, after_hello: bool) -> None:
        try:
            # After the handshake: a real one (challenge-response), then the damaged frame on that socket.
            s = Connection(agent.address, token=token.encode(), timeout_seconds=5).sock if after_hello else \
                socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            return
        with s:
            try:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except OSError:
                pass  # the agent closing on us is the expected outcome

    @FUZZ
    @given(which=st.integers(0, len(VALID) - 1), flips=mutations, cut=st.integers(-1, 4096),
           noise=st.binary(max_size=256), after_hello=st.booleans(),
           lengths=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)))
    def case(which: int, flips: list[tuple[int, int]], cut: int, noise: bytes, after_hello: bool,
             lengths: tuple[int, int]) -> None:
        nonlocal checks
        op, body = VALID[which]
        damaged = mutate(body, flips, cut)
        frames = [
            b"".join(p.frame(op, damaged, request_id=2)),
            mutate(b"".join(p.frame(op, body, request_id=2)), flips, -1),
            p.HEADER.pack(p.MAGIC, p.VERSION, int(op), 0, 2, lengths[0], lengths[1]) + noise,
            noise,
        ]
        send(frames[which % len(frames)] + struct.pack("<I", len(noise)), after_hello=after_hello)
        checks += 1
        if checks % 25 == 0:
            out = bytearray(len(payload))
            assert good.batch_get_into(["steady"], [out]) == [len(payload)] and bytes(out) == payload

    run_for(LIVE_SECONDS, case)
    assert agent.proc is not None and agent.proc.poll() is None, agent.log[-2000:]
    out = bytearray(len(payload))
    assert good.batch_get_into(["steady"], [out]) == [len(payload)] and bytes(out) == payload
    assert checks > 50
    good.close()
