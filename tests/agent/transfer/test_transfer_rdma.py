"""The rdma transport against a fake of the pyverbs API surface (no RDMA device exists here).

The fake enforces the rules the real verbs stack enforces and our code must
respect: a QP is created in INIT, reaches RTS only through ``to_rts`` with a
destination, ``post_send`` works only in RTS, the responder QP must allow remote
access, lkeys/rkeys and ranges are checked, a QP moved to ERR flushes its work.
Two engines in one process each get their own fake NICs on one shared fake
fabric; queue pairs are set up over the engines' real tcp servers.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from daybreak.agent.transfer import Status, TransferEngine, TransferRequest, metrics
from daybreak.agent.transfer.paths import NoPath, SliceSpec, TopologyView, plan
from daybreak.agent.transfer.rdma import RdmaTransport, RdmaUnavailable, enum
from daybreak.testing.transfer_peer import pattern

MiB = 1 << 20

# IBV_* values as rdma-core defines them
E = SimpleNamespace(
    IBV_QPT_RC=2, IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4,
    IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_READ=4, IBV_SEND_SIGNALED=2, IBV_WC_SUCCESS=0, IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_ACCESS_ERR=10, IBV_WC_RETRY_EXC_ERR=12, IBV_PORT_ACTIVE=4, IBV_MTU_1024=3, IBV_MTU_4096=5,
    IBV_QPS_RESET=0, IBV_QPS_INIT=1, IBV_QPS_RTR=2, IBV_QPS_RTS=3, IBV_QPS_ERR=6, IBV_QP_STATE=1,
)


class VerbsError(Exception):
    """Stands in for pyverbs' PyverbsRDMAError."""


class Fabric:
    """The wire between fake NICs: QPs by (nic, qpn), MRs by rkey, NICs that are cut, a switch that stalls."""

    def __init__(self) -> None:
        self.qps: dict[tuple[str, int], Any] = {}  # the fake QP objects
        self.gids: dict[str, str] = {}  # gid -> nic
        self.mrs: dict[int, Any] = {}  # the fake MR objects by rkey
        self.down: set[str] = set()
        self.stall = False  # accepted work never completes (a hung switch)
        self.posted: dict[str, int] = {}  # nic -> work requests posted
        self.keys = itertools.count(0x1000)
        self.lock = threading.Lock()


def fake_verbs(fabric: Fabric, nics: list[str]) -> SimpleNamespace:
    """A module-like namespace with the pyverbs names the transport uses."""

    class Context:
        def __init__(self, *, name: str) -> None:
            if name not in nics:
                raise VerbsError(f"no device {name}")
            self.name = name
            self.gid_table = [f"fe80:0000:0000:0000:0000:0000:0000:{nics.index(name) + 1:04x}",
                              f"0000:0000:0000:0000:0000:ffff:0a00:{abs(hash(name)) % 0xFFFF:04x}"]
            for gid in self.gid_table:
                fabric.gids[gid] = name

        def query_port(self, port: int) -> SimpleNamespace:
            return SimpleNamespace(state=E.IBV_PORT_ACTIVE, lid=0, active_mtu=E.IBV_MTU_4096)

        def query_gid(self, port: int, index: int) -> str:
            if index >= len(self.gid_table):
                raise VerbsError("Failed to query gid")
            return self.gid_table[index]

        def close(self) -> None:
            pass

    class PD:
        def __init__(self, ctx: Context) -> None:
            self.ctx = ctx

        def close(self) -> None:
            pass

    class CQ:
        def __init__(self, ctx: Context, cqe: int, context: Any, channel: Any, vector: int) -> None:
            self.ctx = ctx
            self.entries: deque[SimpleNamespace] = deque()
            self.lock = threading.Lock()

        def push(self, wr_id: int, status: int) -> None:
            with self.lock:
                self.entries.append(SimpleNamespace(wr_id=wr_id, status=status))

        def poll(self, num_entries: int = 1) -> tuple[int, list[SimpleNamespace]]:
            with self.lock:
                out = [self.entries.popleft() for _ in range(min(num_entries, len(self.entries)))]
            return len(out), out

        def close(self) -> None:
            pass

    class QPCap:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    class QPInitAttr(QPCap):
        pass

    class QPAttr:
        def __init__(self, *, port_num: int = 1, qp_state: int | None = None) -> None:
            self.port_num = port_num
            self.qp_state = qp_state
            self.qp_access_flags = 0
            self.dest_qp_num: int | None = None
            self.ah_attr: Any = None

    class QP:
        numbers = itertools.count(100)

        def __init__(self, pd: PD, init: QPInitAttr, attr: QPAttr | None = None) -> None:
            assert init.qp_type == E.IBV_QPT_RC, "only RC queue pairs"
            self.pd = pd
            self.nic = pd.ctx.name
            self.cq: CQ = init.scq
            self.qp_num = next(QP.numbers)
            self.state = E.IBV_QPS_INIT if attr is not None else E.IBV_QPS_RESET
            self.access = attr.qp_access_flags if attr is not None else 0
            self.remote: tuple[str, int] | None = None
            self.pending: list[int] = []
            fabric.qps[(self.nic, self.qp_num)] = self

        def to_rts(self, attr: QPAttr) -> None:
            if self.state != E.IBV_QPS_INIT:
                raise VerbsError(f"to_rts from state {self.state}: QP must be in INIT")
            if attr.dest_qp_num is None or attr.ah_attr is None or not attr.ah_attr.is_global:
                raise VerbsError("RTR needs dest_qp_num and a global route")
            dgid = str(attr.ah_attr.gr.dgid)
            if dgid not in fabric.gids:
                raise VerbsError(f"unknown dgid {dgid}")
            self.remote = (fabric.gids[dgid], attr.dest_qp_num)
            self.access = attr.qp_access_flags
            self.state = E.IBV_QPS_RTS

        def modify(self, attr: QPAttr, mask: int) -> None:
            assert mask == E.IBV_QP_STATE
            if attr.qp_state == E.IBV_QPS_ERR:
                self.state = E.IBV_QPS_ERR
                for wr_id in self.pending:
                    self.cq.push(wr_id, E.IBV_WC_WR_FLUSH_ERR)
                self.pending.clear()

        def post_send(self, wr: SendWR) -> None:
            if self.state != E.IBV_QPS_RTS:
                raise VerbsError(f"post_send in state {self.state}")
            with fabric.lock:
                fabric.posted[self.nic] = fabric.posted.get(self.nic, 0) + 1
            assert self.remote is not None
            remote = fabric.qps.get(self.remote)
            status = E.IBV_WC_SUCCESS
            if self.nic in fabric.down or self.remote[0] in fabric.down or remote is None \
                    or remote.state != E.IBV_QPS_RTS or remote.remote != (self.nic, self.qp_num):
                status = E.IBV_WC_RETRY_EXC_ERR
            else:
                sge = wr.sg[0]
                local = next((m for m in fabric.mrs.values() if m.lkey == sge.lkey and m.pd.ctx.name == self.nic),
                             None)
                target = fabric.mrs.get(wr.rkey)
                needed = E.IBV_ACCESS_REMOTE_WRITE if wr.opcode == E.IBV_WR_RDMA_WRITE else E.IBV_ACCESS_REMOTE_READ
                if local is None or not local.covers(sge.addr, sge.length):
                    status = 4  # IBV_WC_LOC_PROT_ERR
                elif target is None or target.pd.ctx.name != remote.nic or not target.covers(wr.raddr, sge.length) \
                        or not (target.access & needed) or not (remote.access & needed):
                    status = E.IBV_WC_REM_ACCESS_ERR
                elif fabric.stall:
                    self.pending.append(wr.wr_id)
                    return
                elif wr.opcode == E.IBV_WR_RDMA_WRITE:
                    ctypes.memmove(wr.raddr, sge.addr, sge.length)
                else:
                    ctypes.memmove(sge.addr, wr.raddr, sge.length)
            if status != E.IBV_WC_SUCCESS:
                self.state = E.IBV_QPS_ERR
            self.cq.push(wr.wr_id, status)

        def close(self) -> None:
            fabric.qps.pop((self.nic, self.qp_num), None)

    class MR:
        def __init__(self, pd: PD, length: int, access: int, *, address: int) -> None:
            self.pd, self.length, self.access, self.address = pd, length, access, address
            self.lkey = self.rkey = next(fabric.keys)
            fabric.mrs[self.rkey] = self

        def covers(self, addr: int, length: int) -> bool:
            return self.address <= addr and addr + length <= self.address + self.length

        def close(self) -> None:
            fabric.mrs.pop(self.rkey, None)

    @dataclass
    class SGE:
        addr: int
        length: int
        lkey: int

    class SendWR:
        def __init__(self, *, wr_id: int, opcode: int, num_sge: int, sg: list[SGE], send_flags: int) -> None:
            assert num_sge == len(sg) == 1 and send_flags & E.IBV_SEND_SIGNALED
            self.wr_id, self.opcode, self.sg = wr_id, opcode, sg
            self.rkey = self.raddr = -1

        def set_wr_rdma(self, rkey: int, addr: int) -> None:
            self.rkey, self.raddr = rkey, addr

    class GID:
        def __init__(self, *, val: str) -> None:
            self.val = val

        def __str__(self) -> str:
            return self.val

    def get_device_list() -> list[SimpleNamespace]:
        if not nics:
            raise VerbsError("Failed to get devices list")
        return [SimpleNamespace(name=n.encode()) for n in nics]

    return SimpleNamespace(
        enums=E,
        device=SimpleNamespace(get_device_list=get_device_list, Context=Context),
        pd=SimpleNamespace(PD=PD),
        mr=SimpleNamespace(MR=MR),
        cq=SimpleNamespace(CQ=CQ),
        qp=SimpleNamespace(QPCap=QPCap, QPInitAttr=QPInitAttr, QPAttr=QPAttr, QP=QP),
        addr=SimpleNamespace(GID=GID, GlobalRoute=lambda *, dgid, sgid_index: SimpleNamespace(dgid=dgid,
                                                                                              sgid_index=sgid_index),
                             AHAttr=lambda **kw: SimpleNamespace(**kw)),
        wr=SimpleNamespace(SGE=SGE, SendWR=SendWR),
    )


@pytest.fixture
def fabric() -> Fabric:
    return Fabric()


@pytest.fixture
def pair(fabric: Fabric) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    tag = uuid.uuid4().hex[:6]
    a = TransferEngine(node=f"host-a-{tag}", transports=("rdma", "tcp"), verbs=fake_verbs(fabric, ["a0", "a1"]))
    b = TransferEngine(node=f"host-b-{tag}", transports=("rdma", "tcp"), verbs=fake_verbs(fabric, ["b0", "b1"]))
    with a, b:
        yield a, b


def _segment(engine: TransferEngine, size: int, seed: int) -> tuple[Any, bytearray]:
    memory = bytearray(pattern(seed, size))
    return engine.register_segment(memory, name=f"seg{seed}"), memory


def test_rdma_write_and_read_striped_over_both_nics(pair: tuple[TransferEngine, TransferEngine],
                                                    fabric: Fabric) -> None:
    a, b = pair
    assert "rdma" in a.transports and "rdma" in b.transports
    local, src = _segment(a, 16 * MiB, 1)
    target, dst = _segment(b, 16 * MiB, 2)
    assert [r.nic for r in target.descriptor.rdma] == ["b0", "b1"]
    # the routable (IPv4-mapped) GID wins over the link-local one
    assert all(r.gid.startswith("0000:0000:0000:0000:0000:ffff:") for r in target.descriptor.rdma)
    remote = a.open_remote(target.descriptor.to_json())
    assert a.route(remote) == ("rdma", "tcp")
    results = a.submit([TransferRequest.write(remote, 0, local, length=16 * MiB)], timeout_s=10).wait()
    assert results[0].status is Status.COMPLETED and results[0].transport == "rdma", results[0].error
    assert hashlib.sha256(dst).digest() == hashlib.sha256(src).digest()
    # 16 slices of 1 MiB, alternating between the two NIC pairs
    assert fabric.posted == {"a0": 8, "a1": 8}
    # READ back into another part of the local segment (a plain view into it: found by address)
    dst[:MiB] = pattern(9, MiB)
    view = memoryview(src)[3 * MiB:4 * MiB]
    a.transfer([TransferRequest.read(remote, 0, view)], timeout_s=10)
    assert bytes(view) == pattern(9, MiB)


def test_queue_pairs_follow_the_state_machine(pair: tuple[TransferEngine, TransferEngine], fabric: Fabric) -> None:
    a, b = pair
    local, _ = _segment(a, MiB, 1)
    target, _ = _segment(b, MiB, 2)
    remote = a.open_remote(target.descriptor)
    a.transfer([TransferRequest.write(remote, 0, local)], timeout_s=10)
    ours = [qp for (nic, _), qp in fabric.qps.items() if nic.startswith("a")]
    theirs = [qp for (nic, _), qp in fabric.qps.items() if nic.startswith("b")]
    assert len(ours) == len(theirs) == 2
    assert all(qp.state == E.IBV_QPS_RTS for qp in ours + theirs)
    # each of our QPs points at one of theirs and back
    for qp in ours:
        assert qp.remote is not None
        back = fabric.qps[qp.remote]
        assert back.remote == (qp.nic, qp.qp_num)
        assert back.access & E.IBV_ACCESS_REMOTE_WRITE and back.access & E.IBV_ACCESS_REMOTE_READ


def test_failed_nic_slices_retry_on_the_other(pair: tuple[TransferEngine, TransferEngine], fabric: Fabric) -> None:
    a, b = pair
    local, src = _segment(a, 8 * MiB, 1)
    target, dst = _segment(b, 8 * MiB, 2)
    remote = a.open_remote(target.descriptor)
    a.transfer([TransferRequest.write(remote, 0, local, length=MiB)], timeout_s=10)  # pairs up
    retries = metrics.RETRIES.labels("rdma")._value.get()
    fabric.down.add("b1")  # a cable to one of the peer's NICs is cut
    results = a.submit([TransferRequest.write(remote, 0, local)], timeout_s=10).wait()
    assert results[0].status is Status.COMPLETED and results[0].transport == "rdma", results[0].error
    assert dst == src
    assert metrics.RETRIES.labels("rdma")._value.get() > retries
    dead = [qp for (nic, _), qp in fabric.qps.items() if nic == "a1"]
    assert dead and all(qp.state == E.IBV_QPS_ERR for qp in dead)


def test_all_nics_down_falls_back_to_tcp(pair: tuple[TransferEngine, TransferEngine], fabric: Fabric) -> None:
    a, b = pair
    local, src = _segment(a, 4 * MiB, 1)
    target, dst = _segment(b, 4 * MiB, 2)
    remote = a.open_remote(target.descriptor)
    fabric.down.update({"b0", "b1"})
    fallbacks = metrics.FALLBACKS.labels("rdma", "tcp")._value.get()
    results = a.submit([TransferRequest.write(remote, 0, local)], timeout_s=20).wait()
    assert results[0].status is Status.COMPLETED, results[0].error
    assert results[0].transport == "tcp"
    assert dst == src
    assert metrics.FALLBACKS.labels("rdma", "tcp")._value.get() == fallbacks + 1


def test_stalled_fabric_times_out_and_flushes(pair: tuple[TransferEngine, TransferEngine], fabric: Fabric) -> None:
    a, b = pair
    local, _ = _segment(a, 4 * MiB, 1)
    target, _ = _segment(b, 4 * MiB, 2)
    remote = a.open_remote(target.descriptor)
    a.transfer([TransferRequest.write(remote, 0, local, length=10)], timeout_s=10)
    fabric.stall = True
    results = a.submit([TransferRequest.read(remote, 0, local)], timeout_s=0.5).wait()
    assert results[0].status is Status.TIMEOUT
    # the queue pairs that carried it were moved to ERR: the NIC no longer writes into our buffer
    ours = [qp for (nic, _), qp in fabric.qps.items() if nic.startswith("a")]
    assert ours and all(qp.state == E.IBV_QPS_ERR and not qp.pending for qp in ours)


def test_no_devices_is_a_logged_fallback(fabric: Fabric, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="daybreak.agent.transfer")
    with TransferEngine(transports=("rdma", "tcp"), verbs=fake_verbs(fabric, [])) as engine:
        assert engine.transports == ("tcp",)
    assert "rdma disabled" in caplog.text and "Failed to get devices list" in caplog.text
    with pytest.raises(RdmaUnavailable, match="no usable RDMA device"):
        RdmaTransport(engine, verbs=fake_verbs(fabric, ["x0"]), nics=["y0"])


def test_enum_shim_reads_old_and_new_pyverbs_layouts() -> None:
    old = SimpleNamespace(enums=SimpleNamespace(IBV_QPT_RC=2))

    class ibv_qp_type:  # named as in pyverbs.libibverbs_enums
        IBV_QPT_RC = 2

    new = SimpleNamespace(enums=SimpleNamespace(ibv_qp_type=ibv_qp_type))
    assert enum(old, "IBV_QPT_RC") == enum(new, "IBV_QPT_RC") == 2
    with pytest.raises(RdmaUnavailable, match="IBV_NOPE"):
        enum(new, "IBV_NOPE")


# -- planner -------------------------------------------------------------------------------------
VIEW = TopologyView(
    nics=["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"],
    ranked={0: ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"], 1: ["mlx5_1", "mlx5_0", "mlx5_2", "mlx5_3"],
            2: ["mlx5_2", "mlx5_3", "mlx5_0", "mlx5_1"], 3: ["mlx5_3", "mlx5_2", "mlx5_0", "mlx5_1"]},
    gdr={0: ["mlx5_0"], 1: ["mlx5_1"], 2: [], 3: []},
    links={2: [0, 3], 3: [2]},
)
LIVE = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]


def test_host_slices_round_robin_over_live_nics() -> None:
    placed = plan([SliceSpec(i, None) for i in range(6)], view=VIEW, live=["mlx5_1", "mlx5_3"])
    assert [p.nic for p in placed] == ["mlx5_1", "mlx5_3"] * 3
    assert not any(p.stage_device is not None or p.stage_host for p in placed)


def test_device_slices_take_their_device_gdr_nic() -> None:
    placed = plan([SliceSpec("a", 0), SliceSpec("b", 1), SliceSpec("c", 0)], view=VIEW, live=LIVE)
    assert [(p.key, p.nic) for p in placed] == [("a", "mlx5_0"), ("b", "mlx5_1"), ("c", "mlx5_0")]


def test_device_without_gdr_stages_over_the_link_not_host() -> None:
    (placed,) = plan([SliceSpec("x", 2)], view=VIEW, live=LIVE)
    assert placed.stage_device == 0 and placed.nic == "mlx5_0" and not placed.stage_host
    # device 3 links only to device 2, which has no GDR NIC either: host staging is the last resort
    (placed,) = plan([SliceSpec("y", 3)], view=VIEW, live=LIVE)
    assert placed.stage_host and placed.nic == "mlx5_3"


def test_retry_avoids_the_nic_that_failed() -> None:
    (placed,) = plan([SliceSpec("a", 0)], view=VIEW, live=LIVE, exclude={"a": ["mlx5_0"]})
    # device 0's only GDR NIC failed: no linked device has one, so host staging on the next ranked NIC
    assert placed.nic == "mlx5_1" and placed.stage_host
    with pytest.raises(NoPath):
        plan([SliceSpec("h", None)], view=VIEW, live=["mlx5_0"], exclude={"h": ["mlx5_0"]})
    with pytest.raises(NoPath):
        plan([SliceSpec("h", None)], view=VIEW, live=[])


def test_planner_on_a_discovered_eight_gpu_node() -> None:
    from pathlib import Path

    from daybreak.agent.topology import discover

    view = TopologyView.from_topology(discover(Path(__file__).resolve().parents[2] / "fixtures" / "sysfs" / "dgx8"))
    assert "mlx5_5" not in view.nics  # its port is DOWN
    placed = plan([SliceSpec(("g6", i), 6) for i in range(4)] + [SliceSpec(("g0", 0), 0)], view=view, live=view.nics)
    # GPU6 has two NICs under its switch and stripes over both; GPU0 uses its own
    assert [p.nic for p in placed] == ["mlx5_6", "mlx5_7", "mlx5_6", "mlx5_7", "mlx5_0"]
    assert not any(p.stage_host or p.stage_device is not None for p in placed)
