"""KVNode status.transports: the transports the agent's engine really brought up, not a fixed list."""

from __future__ import annotations

from pathlib import Path

from daybreak.agent.publish import kvnode_status
from daybreak.agent.registration import Registrar
from daybreak.agent.topology import discover

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


def test_kvnode_transports_are_those_the_engine_runs_with_their_bytes() -> None:
    topo = discover(FIXTURES / "numa_unknown")
    # The pool allowed shm and tcp; the engine brought both up and moved bytes over shm only.
    transfer = [{"transport": "shm", "state": "works", "bytesUsed": 8192},
                {"transport": "tcp", "state": "works", "bytesUsed": 0}]
    status = kvnode_status(topo, Registrar(reason="pyverbs not importable"), node_name="n1", transfer=transfer,
                           capacity={"dram": 1 << 20})
    wire = status.to_dict()
    assert wire["transports"] == ["shm", "tcp"]  # before: the registrar's ["tcp"], whatever ran
    assert [(t["transport"], t.get("bytesUsed", 0)) for t in wire["transfer"]] == [("shm", 8192), ("tcp", 0)]


def test_the_stores_own_bytes_join_each_transports_condition() -> None:
    from daybreak.agent.main import _with_store_bytes
    from daybreak.agent.store import metrics as m

    store_metrics = m.StoreMetrics()
    store_metrics.moved("shm", "write", 4096)
    store_metrics.moved("shm", "read", 1024)
    store_metrics.moved("tcp", "read", 300)
    store_metrics.moved("tls", "write", 700)  # the stream over TLS is still tcp
    got = _with_store_bytes([{"transport": "shm", "state": "works", "bytesUsed": 5},
                             {"transport": "tcp", "state": "works", "bytesUsed": 0}], store_metrics)
    assert [(c["transport"], c["bytesUsed"], c["storeBytes"]) for c in got] == [("shm", 5, 5120), ("tcp", 0, 1000)]
