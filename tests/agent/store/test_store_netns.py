"""Across two network namespaces joined by a veth pair: an agent in one, writer and reader processes around it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daybreak.testing.store_agent import LocalAgent, NetnsPair, cleanup_pool, free_port

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def netns() -> Iterator[NetnsPair]:
    reason = NetnsPair.unavailable()
    if reason:
        pytest.skip(reason)
    with NetnsPair() as pair:
        yield pair


def client(pair: NetnsPair, side: int, code: str) -> str:
    out = subprocess.run([*pair.exec_prefix(side), sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_put_and_get_across_namespaces(netns: NetnsPair, tmp_path: Path) -> None:
    pool = f"ns{uuid.uuid4().hex[:8]}"
    token = tmp_path / "token"
    agents = [LocalAgent(address=f"{netns.addresses[side]}:{free_port()}", token_file=token, pool=pool,
                         dram="32Mi", netns=netns.names[side]) for side in (0, 1)]
    agents[0].peers = [agents[1].address]
    agents[1].peers = [agents[0].address]
    agents[0].replicas = agents[1].replicas = 2
    try:
        for a in agents:
            a.start()
        endpoints = [a.address for a in agents]
        # Writer in namespace B, over TCP through the veth pair to both agents (two replicas).
        client(netns, 1, f"""
            import numpy as np
            from daybreak.client import KVPoolClient
            c = KVPoolClient(endpoints={endpoints!r}, token=open("{token}").read().strip(), namespace="ns",
                             transport="tcp")
            assert sorted(c.members()) == sorted({endpoints!r}), c.members()
            data = [np.full(1 << 20, i, np.uint8) for i in range(16)]
            assert c.batch_put([f"x{{i}}" for i in range(16)], data) == [2] * 16
        """)
        # Agent B goes away for good; a reader in namespace A still finds every block on agent A.
        agents[1].kill()
        out = client(netns, 0, f"""
            import numpy as np
            from daybreak.client import KVPoolClient
            c = KVPoolClient(endpoints={endpoints[:1]!r}, token=open("{token}").read().strip(), namespace="ns",
                             transport="tcp")
            out = [np.zeros(1 << 20, np.uint8) for _ in range(16)]
            sizes = c.batch_get_into([f"x{{i}}" for i in range(16)], out)
            assert sizes == [1 << 20] * 16, sizes
            assert all((o == i).all() for i, o in enumerate(out))
            print("read", len(sizes))
        """)
        assert "read 16" in out
    finally:
        for a in agents:
            a.kill()
        cleanup_pool(pool)
