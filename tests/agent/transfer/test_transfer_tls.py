"""TLS on the transfer engine's tcp transport (issue 12 finding 5): real peer processes on loopback.

The certificates are the agent's settings (``tls_cert_file``/``tls_key_file``/``tls_ca_file``); each is
self-signed for 127.0.0.1, so it is its own CA, and a second one plays the wrong CA.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daybreak.agent.settings import AgentSettings
from daybreak.agent.transfer import EngineConfig, Status, TransferEngine, TransferRequest, wire
from daybreak.pool.tls import TlsSettingsError, contexts
from daybreak.testing.transfer_peer import PeerProcess, pattern

MiB = 1 << 20
TOKEN = "t" * 32
SIZES = [1, 4096, 65_537, MiB + 3, 4 * MiB - 1, 16 * MiB]


def _cert(directory: Path, name: str) -> tuple[str, str]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                           "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                           "-keyout", str(key), "-out", str(cert)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    directory = tmp_path_factory.mktemp("tls")
    return {"pool": _cert(directory, "pool"), "other": _cert(directory, "other")}


@pytest.fixture
def tls_peer(certs: dict[str, tuple[str, str]]) -> Iterator[PeerProcess]:
    cert, key = certs["pool"]
    with PeerProcess(segment_bytes=64 * MiB, node="peer-tls", transports="tcp", token=TOKEN,
                     tls_cert=cert, tls_key=key, tls_ca=cert) as peer:
        yield peer


def _engine(certs: dict[str, tuple[str, str]], name: str | None) -> TransferEngine:
    tls = None
    if name is not None:
        cert, key = certs[name]
        tls = contexts(cert_file=cert, key_file=key, ca_file=cert)
    return TransferEngine(node="local-tls", transports=("tcp",), token=TOKEN, tls=tls)


def _sha(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def test_tls_transfers_are_byte_exact_both_ways_between_processes(certs: dict[str, tuple[str, str]],
                                                                  tls_peer: PeerProcess) -> None:
    with _engine(certs, "pool") as engine:
        local = bytearray(64 * MiB)
        segment = engine.register_segment(local, name="local")
        remote = engine.open_remote(tls_peer.descriptor)
        # Writes of every size, then reads of what the peer filled, in one batch: both directions run on
        # the same striped connections at once (the case a shared SSLSocket would get wrong).
        tls_peer.fill(7, 32 * MiB, sum(SIZES))
        data = pattern(3, sum(SIZES))
        local[:len(data)] = data
        requests, offset = [], 0
        for size in SIZES:
            requests.append(TransferRequest.write(remote, offset, segment, local_offset=offset, length=size))
            requests.append(TransferRequest.read(remote, 32 * MiB + offset, segment, local_offset=32 * MiB + offset,
                                                 length=size))
            offset += size
        results = engine.transfer(requests, timeout_s=120)
        assert [r.status for r in results] == [Status.COMPLETED] * len(requests)
        assert {r.transport for r in results} == {"tcp"}
        assert tls_peer.hash(0, len(data)) == _sha(data)
        assert _sha(local[32 * MiB:32 * MiB + len(data)]) == _sha(pattern(7, len(data)))
        # The peer dials us too (its reads and writes of our segment), also over TLS.
        rid = tls_peer.open(segment.descriptor.to_json())
        answer = tls_peer.batch([("read", rid, 0, 0, 5 * MiB), ("write", rid, 40 * MiB, 8 * MiB, 3 * MiB)],
                                timeout_s=60)
        assert [a["status"] for a in answer] == ["completed", "completed"], answer
        assert tls_peer.hash(0, 5 * MiB) == _sha(local[:5 * MiB])
        assert tls_peer.hash(40 * MiB, 3 * MiB) == _sha(local[8 * MiB:11 * MiB])


def test_plaintext_peer_is_refused_with_a_clear_error_and_nobody_else_is_affected(
        certs: dict[str, tuple[str, str]], tls_peer: PeerProcess) -> None:
    with _engine(certs, "pool") as good, _engine(certs, None) as plain:
        remote = good.open_remote(tls_peer.descriptor)
        good.transfer([TransferRequest.write(remote, 0, b"before")])  # its TLS connections are up
        result = plain.submit([TransferRequest.write(plain.open_remote(tls_peer.descriptor), 100, b"plain")],
                              timeout_s=10).wait()[0]
        assert result.status is Status.FAILED
        assert "requires TLS" in result.error
        # What a plaintext client sees on the wire: one ERROR frame that says why, then the close.
        with socket.create_connection(remote.descriptor.tcp_address, timeout=10) as raw:
            body = json.dumps({"engine_id": "plain", "scope": "admin", "nonce": os.urandom(16).hex()}).encode()
            raw.sendall(wire.pack_header(wire.FrameType.HELLO, frame_id=0, payload_len=len(body)) + body)
            hdr = wire.parse_header(raw.recv(wire.HEADER.size, socket.MSG_WAITALL))
            assert hdr.type is wire.FrameType.ERROR
            assert b"requires TLS" in raw.recv(hdr.payload_len, socket.MSG_WAITALL)
            assert raw.recv(1) == b""
        good.transfer([TransferRequest.write(remote, 200, b"after")])
        assert tls_peer.hash(0, 6) == _sha(b"before") and tls_peer.hash(200, 5) == _sha(b"after")
        assert tls_peer.hash(100, 5) != _sha(b"plain")


def test_a_peer_whose_certificate_the_ca_did_not_sign_is_refused(certs: dict[str, tuple[str, str]],
                                                                 tls_peer: PeerProcess) -> None:
    with _engine(certs, "other") as stranger, _engine(certs, "pool") as good:
        result = stranger.submit([TransferRequest.write(stranger.open_remote(tls_peer.descriptor), 0, b"stranger")],
                                 timeout_s=10).wait()[0]
        assert result.status is Status.FAILED
        assert "CERTIFICATE_VERIFY_FAILED" in result.error
        assert tls_peer.hash(0, 8) != _sha(b"stranger")
        # ...and in the other direction: the TLS peer dialling an engine with the wrong certificate refuses it.
        local = bytearray(MiB)
        rid = tls_peer.open(stranger.register_segment(local, name="s").descriptor.to_json())
        answer = tls_peer.batch([("write", rid, 0, 0, 4096)], timeout_s=10)
        assert answer[0]["status"] == "failed" and "CERTIFICATE_VERIFY_FAILED" in answer[0]["error"], answer
        assert local[:4096] == bytes(4096)
        good.transfer([TransferRequest.write(good.open_remote(tls_peer.descriptor), 0, b"good")])
        assert tls_peer.hash(0, 4) == _sha(b"good")


def test_an_agents_engine_takes_the_stores_tls_settings(certs: dict[str, tuple[str, str]],
                                                        tls_peer: PeerProcess) -> None:
    cert, key = certs["pool"]
    settings = AgentSettings.load(environ={"DAYBREAK_TLS_CERT_FILE": cert, "DAYBREAK_TLS_KEY_FILE": key,
                                           "DAYBREAK_TLS_CA_FILE": cert})
    with TransferEngine.from_config(EngineConfig.for_agent(settings, token=TOKEN)) as engine:
        assert engine.tls is not None
        engine.transfer([TransferRequest.write(engine.open_remote(tls_peer.descriptor), 0, b"agent")])
        assert tls_peer.hash(0, 5) == _sha(b"agent")
    with pytest.raises(TlsSettingsError, match="tls_cert_file"):
        AgentSettings.load(environ={"DAYBREAK_TLS_CERT_FILE": cert, "DAYBREAK_TLS_KEY_FILE": "/nonexistent"}).tls()


def test_an_idle_tls_connection_outlives_the_handshake_deadline(certs: dict[str, tuple[str, str]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The deadline that bounds the TLS handshake and HELLO must be gone once they are done.
    from daybreak.agent.transfer import tcp

    monkeypatch.setattr(tcp, "HANDSHAKE_SECONDS", 0.5)
    with _engine(certs, "pool") as server, _engine(certs, "pool") as client:
        memory = bytearray(MiB)
        remote = client.open_remote(server.register_segment(memory, name="kv").descriptor)
        assert client.transfer([TransferRequest.write(remote, 0, b"first")])[0].attempts == 1
        time.sleep(1.5)  # three handshake deadlines of idleness
        assert client.transfer([TransferRequest.write(remote, 8, b"second")])[0].attempts == 1
        assert memory[:5] == b"first" and memory[8:14] == b"second"


def test_an_engine_pods_engine_speaks_tls_to_the_agents_when_the_pool_gives_a_ca(
        certs: dict[str, tuple[str, str]], tls_peer: PeerProcess) -> None:
    """``EngineConfig.for_engine_pod`` with ``DAYBREAK_POOL_TLS_CA_FILE``: the pod's engine dials TLS (it serves
    none: it has no certificate) and reaches a TLS-only peer; without the CA it is refused."""
    from daybreak.api.enginepod import EnginePodEnv

    cert, _ = certs["pool"]
    pod = EnginePodEnv(transports=["tcp"], pool_tls_ca_file=cert)
    with TransferEngine.from_config(EngineConfig.for_engine_pod(pod, token=TOKEN)) as engine:
        assert engine.tls is not None and engine.tls.server is None
        engine.transfer([TransferRequest.write(engine.open_remote(tls_peer.descriptor), 0, b"podtls")])
        assert tls_peer.hash(0, 6) == _sha(b"podtls")
        host, _, port = engine.tcp_endpoint.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as raw:  # it serves nobody
            assert raw.recv(1) == b""
    plain = EnginePodEnv(transports=["tcp"])
    with TransferEngine.from_config(EngineConfig.for_engine_pod(plain, token=TOKEN)) as engine:
        batch = engine.submit([TransferRequest.write(engine.open_remote(tls_peer.descriptor), 0, b"nope")],
                              timeout_s=5.0)
        assert [r.status for r in batch.wait()] == [Status.FAILED]
