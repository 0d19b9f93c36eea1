"""The connector core on vLLM's real KV cache layouts, in host memory, against a real agent.

The views are vLLM's own: ``vllm_kv_layouts.py`` lets the installed vLLM 0.32
allocate a small KV cache in every ``KVCacheLayout`` (the layouts its CPU and
GPU attention backends register) and records the per-layer ``[B, H, N, C]``
views it hands to ``register_kv_caches``; ``fixtures/vllm_kv_layouts.json`` is
that dump, checked in (with the vLLM version), so these tests run without vLLM;
the one marked ``vllm`` regenerates it and checks it is current. Each test
rebuilds the views over its own host memory, byte for byte where vLLM put them.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daybreak.client import KVPoolClient, KVPoolError
from daybreak.connectors.blocks import (
    BlockMover,
    BlockTransfer,
    BlockViews,
    ConnectorConfigError,
    EngineLayout,
    block_keys,
    layer_region,
    layout_order,
)
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "vllm_kv_layouts.json"
DUMP: dict[str, Any] = json.loads(FIXTURE.read_text())
PAGE = DUMP["page"]
LAYOUTS = sorted(DUMP["layouts"])
ERRORS = (KVPoolError, OSError, ValueError)


def engine_layout(name: str, *, platform: str = "cuda") -> EngineLayout:
    """The EngineLayout the connector derives for the dumped page in layout ``name``."""
    return EngineLayout(platform=platform, block_tokens=PAGE["block_tokens"], num_layers=PAGE["layers"],
                        num_kv_heads=PAGE["kv_heads"], head_dim=PAGE["head_size"], dtype=PAGE["dtype"],
                        kv_layout=name, head_slots=PAGE["kv_heads"], content_bytes=2 * PAGE["head_size"] * 2)


class HostKV:
    """One engine's KV cache: vLLM's views of ``name`` rebuilt over a host buffer of the same size."""

    def __init__(self, name: str, *, fill: bool) -> None:
        dump = DUMP["layouts"][name]
        self.layout = engine_layout(name)
        self.memory = (ctypes.c_ubyte * dump["buffer_bytes"])()
        if fill:
            ctypes.memmove(self.memory, os.urandom(dump["buffer_bytes"]), dump["buffer_bytes"])
        base = ctypes.addressof(self.memory)
        self.views = BlockViews([layer_region(v["layer"], address=base + v["offset_bytes"], shape=v["shape"],
                                              strides=v["strides"], itemsize=v["itemsize"], layout=self.layout,
                                              num_blocks=PAGE["blocks"]) for v in dump["views"]])
        self.mover = BlockMover(self.views, fingerprint=self.layout.fingerprint(), errors=ERRORS)

    def block(self, block: int) -> list[bytes]:
        """Every piece of every layer of one block, in key order."""
        return [bytes(v) for v in self.views.views([block])]

    def raw(self) -> bytes:
        return bytes(self.memory)


def hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    work = tmp_path_factory.mktemp("layouts")
    pool = f"lay{uuid.uuid4().hex[:8]}"
    running = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=work / "token", pool=pool, dram="64Mi",
                         log_path=work / "agent.log").start()
    yield running
    running.stop()
    cleanup_pool(pool)


@pytest.fixture
def client(agent: LocalAgent) -> Iterator[KVPoolClient]:
    with KVPoolClient([agent.address], token=agent.token_file.read_text().strip(),
                      namespace=f"ns-{uuid.uuid4().hex[:8]}") as c:
        yield c


# -- what the installed vLLM says ---------------------------------------------------------------------------

@pytest.mark.vllm
def test_the_checked_in_dump_is_what_the_installed_vllm_reports(vllm_python: Path) -> None:
    out = subprocess.run([str(vllm_python), str(HERE / "vllm_kv_layouts.py")], capture_output=True, text=True,
                         timeout=600, env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == DUMP, f"regenerate {FIXTURE.relative_to(HERE.parents[1])} with this vLLM"


def test_the_dump_covers_every_layout_the_backends_register() -> None:
    assert DUMP["vllm"] == "0.32.0"
    declared = {name for b in DUMP["backends"].values() for name in b.get("supported_kv_cache_layouts") or ()}
    assert declared and declared <= set(LAYOUTS)
    assert DUMP["backends"]["CPU_ATTN"]["supported_kv_cache_layouts"] == ["LBHNC"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layouts_pieces_follow_from_its_name(name: str) -> None:
    layout = engine_layout(name)
    page = PAGE["kv_heads"] * PAGE["block_tokens"] * 2 * PAGE["head_size"] * 2
    assert layout.block_bytes_per_layer == page
    # One piece when a block's head slots, tokens and content are adjacent in memory; else one per head slot.
    assert layout.regions_per_layer == (1 if name.endswith(("HNC", "NHC")) else PAGE["kv_heads"])
    assert sum(layout.regions().lengths) == page
    assert "".join("LBHNC"[d] for d in layout_order(name)) == name


# -- moves ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", LAYOUTS)
def test_a_save_from_one_engine_loads_byte_exact_into_another_with_the_same_layout(
        name: str, client: KVPoolClient) -> None:
    a, b = HostKV(name, fill=True), HostKV(name, fill=False)
    h = hashes(2)
    saved = a.mover.save(client, [BlockTransfer("r1", (h[0], h[1]), (1, 3))])
    assert saved.error == "" and saved.done == saved.keys == 2 * PAGE["layers"] * a.layout.regions_per_layer
    # The other engine holds the same prefix in other block ids.
    loaded = b.mover.load(client, [BlockTransfer("r2", (h[0], h[1]), (4, 0))])
    assert loaded.failed == frozenset() and loaded.error == ""
    assert loaded.done == 2 * PAGE["layers"] * a.layout.block_bytes_per_layer
    assert b.block(4) == a.block(1) and b.block(0) == a.block(3)
    # Nothing else of the receiving cache was written: its bytes are the two blocks' pieces and zeros.
    expected = HostKV(name, fill=False)
    for dst, src in ((4, 1), (0, 3)):
        for view, piece in zip(expected.views.views([dst]), a.block(src), strict=True):
            view[:] = piece
    assert b.raw() == expected.raw()


@pytest.mark.parametrize("name", ["LBHNC", "BHLNC"])
def test_layer_by_layer_saves_and_loads_move_each_layers_pieces_alone(name: str, client: KVPoolClient) -> None:
    a, b = HostKV(name, fill=True), HostKV(name, fill=False)
    h = tuple(hashes(2))
    per_layer = 2 * a.layout.regions_per_layer
    saved = a.mover.save(client, [BlockTransfer("r", h, (0, 2))], layers=(1,))
    assert saved.error == "" and saved.keys == saved.done == per_layer
    # Only layer 1 is in the pool: a whole-block load fails both blocks, a layer-1 load brings exactly it.
    assert b.mover.load(client, [BlockTransfer("r", h, (3, 1))]).failed == {3, 1}
    layer1 = b.mover.load(client, [BlockTransfer("r", h, (3, 1))], layers=(1,))
    assert layer1.failed == frozenset() and layer1.keys == per_layer
    assert b.views.views([3], layers=(1,)) == a.views.views([0], layers=(1,))
    assert a.mover.save(client, [BlockTransfer("r", h, (0, 2))], layers=(0,)).done == per_layer
    for layer in (0, 1):
        assert b.mover.load(client, [BlockTransfer("r", h, (3, 1))], layers=(layer,)).failed == frozenset()
    assert b.block(3) == a.block(0) and b.block(1) == a.block(2)


def test_engines_with_different_layouts_never_share_a_key(client: KVPoolClient) -> None:
    prints = {name: engine_layout(name).fingerprint() for name in LAYOUTS}
    prints["cpu"] = engine_layout("LBHNC", platform="cpu").fingerprint()
    assert len(set(prints.values())) == len(prints)
    h = hashes(1)
    keys = {name: set(block_keys(prints[name], h, PAGE["layers"], engine_layout(name).regions_per_layer))
            for name in LAYOUTS}
    for x in LAYOUTS:
        for y in LAYOUTS:
            assert x == y or not keys[x] & keys[y]
    source = HostKV("LBHNC", fill=True)
    assert source.mover.save(client, [BlockTransfer("r", tuple(h), (2,))]).done == PAGE["layers"]
    for name in LAYOUTS:
        if name == "LBHNC":
            continue
        other = HostKV(name, fill=False)
        moved = other.mover.load(client, [BlockTransfer("r", tuple(h), (2,))])
        assert moved.failed == {2} and moved.done == 0, name  # a miss: recomputed, never misread
        assert not any(other.raw())


def test_a_block_missing_or_short_in_one_piece_fails_alone(client: KVPoolClient) -> None:
    source = HostKV("LHBNC", fill=True)  # three pieces (head slots) per block and layer
    h = hashes(3)
    assert source.mover.save(client, [BlockTransfer("r", tuple(h), (0, 1, 2))]).error == ""
    pieces = PAGE["layers"] * source.layout.regions_per_layer
    keys = block_keys(source.layout.fingerprint(), h, PAGE["layers"], source.layout.regions_per_layer)
    assert keys[pieces + 4].endswith("-1-1")  # block 1, layer 1, head slot 1
    assert client.remove([keys[pieces + 4]]) == [True]
    assert client.batch_put([keys[2 * pieces]], [b"\0" * 100]) == [1]  # block 2, layer 0, piece 0 truncated
    target = HostKV("LHBNC", fill=False)
    moved = target.mover.load(client, [BlockTransfer("r", tuple(h), (3, 4, 0))])
    assert moved.failed == {4, 0} and moved.error == ""
    assert target.block(3) == source.block(0)


class _Down:
    """A pool that fails every call, as the client raises when no agent answers."""

    def batch_put(self, keys: Any, buffers: Any, *, tier: str = "dram") -> list[int]:
        raise KVPoolError("no agent of the pool answered")

    def batch_get_into(self, keys: Any, buffers: Any) -> list[int | None]:
        raise KVPoolError("no agent of the pool answered")


def test_a_pool_that_fails_fails_every_block_of_the_load_and_only_costs_the_save() -> None:
    kv = HostKV("LBNHC", fill=True)
    before = kv.raw()
    moved = kv.mover.load(_Down(), [BlockTransfer("r", tuple(hashes(2)), (1, 2))])
    assert moved.failed == {1, 2} and "no agent of the pool answered" in moved.error
    saved = kv.mover.save(_Down(), [BlockTransfer("r", tuple(hashes(1)), (0,))])
    assert saved.done == 0 and "no agent" in saved.error
    assert kv.raw() == before


# -- refusals ---------------------------------------------------------------------------------------------------

def _view(name: str) -> dict[str, Any]:
    view: dict[str, Any] = DUMP["layouts"][name]["views"][0]
    return view


def test_a_tensor_that_is_not_in_the_fingerprinted_layout_is_refused_naming_both() -> None:
    nhc = _view("LBNHC")
    with pytest.raises(ConnectorConfigError, match=r"lays its dims out as BNHC in memory, not as the layout LBHNC"):
        layer_region("l0", address=4096, shape=nhc["shape"], strides=nhc["strides"], itemsize=2,
                     layout=engine_layout("LBHNC"))
    v = _view("LBHNC")
    with pytest.raises(ConnectorConfigError, match=r"pages of 3 head slots x 16 tokens x 32 bytes, not 6 x 16 x 32"):
        layer_region("l0", address=4096, shape=v["shape"], strides=v["strides"], itemsize=2,
                     layout=EngineLayout(**{**engine_layout("LBHNC").__dict__, "head_slots": 6}))
    with pytest.raises(ConnectorConfigError, match=r"kernel blocks split vLLM's blocks"):
        layer_region("l0", address=4096, shape=v["shape"], strides=v["strides"], itemsize=2,
                     layout=engine_layout("LBHNC"), num_blocks=PAGE["blocks"] // 2)
    with pytest.raises(ConnectorConfigError, match="not a vLLM KVCacheLayout name"):
        engine_layout("NHD")
