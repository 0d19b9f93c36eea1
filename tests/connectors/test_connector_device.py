"""The connector core on KV caches in device memory: the Sunrise stand-in's device memory, a real agent process.

Every engine's KV cache is one allocation of the stand-in Tang runtime
(``tests/sunrise_lib``: device memory the runtime's copies and peer copies
address, host memory underneath) with vLLM 0.32's per-layer views of one GPU
backend's layout rebuilt over it, from ``fixtures/vllm_kv_layouts.json`` (the
layouts the installed vLLM's GPU attention backends register). Engines move
its block pieces as ``DeviceRef``s through the transfer engine their pod builds
(``blocks.pod_engine``: ``load_runtime('sunrise')`` + ``engine_for_pod``), into
an agent that runs the same stand-in with an HBM tier and a DRAM tier. Nothing
here ran on a real accelerator (docs/engines.md).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sunrise_lib.build import build, node

from daybreak.agent.runtime.base import DeviceBuffer
from daybreak.agent.runtime.sunrise import SunriseRuntime
from daybreak.client import KVPoolClient, KVPoolError
from daybreak.client.datapath import DeviceRef
from daybreak.connectors.blocks import (
    BlockMover,
    BlockTransfer,
    BlockViews,
    ConnectorConfigError,
    EngineLayout,
    KVMemory,
    LayerPipeline,
    PodEngine,
    PoolSettings,
    block_keys,
    layer_region,
    pod_engine,
    require_device_path,
)
from daybreak.testing.store_agent import LocalAgent, cleanup_pool, free_port

HERE = Path(__file__).resolve().parent
DUMP: dict[str, Any] = json.loads((HERE / "fixtures" / "vllm_kv_layouts.json").read_text())
PAGE = DUMP["page"]
# The layouts vLLM 0.32's GPU attention backends register (the CPU backend's aside).
GPU_LAYOUTS = sorted({name for backend, info in DUMP["backends"].items() if not backend.startswith("CPU")
                      for name in info.get("supported_kv_cache_layouts") or ()})
ERRORS = (KVPoolError, OSError, ValueError)
KV_DEVICE = 1  # the engines' accelerator; the agent's HBM tier is on every device of the node


def engine_layout(name: str, *, platform: str = "sunrise", kv_split: bool = False) -> EngineLayout:
    return EngineLayout(platform=platform, block_tokens=PAGE["block_tokens"], num_layers=PAGE["layers"],
                        num_kv_heads=PAGE["kv_heads"], head_dim=PAGE["head_size"], dtype=PAGE["dtype"],
                        kv_layout=name, head_slots=PAGE["kv_heads"], content_bytes=2 * PAGE["head_size"] * 2,
                        kv_split=kv_split)


class DeviceKV:
    """One engine's KV cache in device memory: vLLM's views of layout ``name`` over one device allocation."""

    def __init__(self, rt: SunriseRuntime, name: str, *, fill: bool, tier: str = "dram") -> None:
        dump = DUMP["layouts"][name]
        self.rt = rt
        self.layout = engine_layout(name)
        self.size = int(dump["buffer_bytes"])
        self.buffer = rt.allocate(KV_DEVICE, self.size)
        rt.copy_to_device(self.buffer, os.urandom(self.size) if fill else bytes(self.size))
        self.views = BlockViews([
            layer_region(v["layer"], address=self.buffer.address + v["offset_bytes"], shape=v["shape"],
                         strides=v["strides"], itemsize=v["itemsize"], layout=self.layout,
                         num_blocks=PAGE["blocks"], device=KV_DEVICE)
            for v in dump["views"]])
        self.mover = BlockMover(self.views, fingerprint=self.layout.fingerprint(), errors=ERRORS,
                                tier=tier)  # type: ignore[arg-type]

    def raw(self) -> bytes:
        out = bytearray(self.size)
        self.rt.copy_to_host(out, self.buffer)
        return bytes(out)

    def block(self, block: int, *, layers: tuple[int, ...] | None = None) -> list[bytes]:
        """Every piece of one block (of ``layers``), in key order, read back from the device."""
        raw, base = self.raw(), self.buffer.address
        refs = self.views.views([block], layers=layers)
        assert all(isinstance(r, DeviceRef) and r.device == KV_DEVICE for r in refs)
        return [raw[r.ptr - base:r.ptr - base + r.size] for r in refs]  # type: ignore[union-attr]

    def free(self) -> None:
        self.rt.free(self.buffer)


def hashes(n: int) -> tuple[bytes, ...]:
    return tuple(os.urandom(32) for _ in range(n))


@dataclass
class Node:
    """A node of the stand-in: its runtime library, a store agent with HBM + DRAM tiers, its pool credential."""

    libdir: Path
    agent: LocalAgent
    token: str
    rt: SunriseRuntime

    def settings(self) -> PoolSettings:
        return PoolSettings(endpoints=(self.agent.address,), token=self.token, namespace="ns")

    def stats(self) -> dict[str, str]:
        with KVPoolClient([self.agent.address], token=self.token, namespace="ns", transport="tcp") as c:
            stats: dict[str, str] = next(iter(c._conns.values())).stats()
        return stats


@pytest.fixture(scope="module")
def sunrise(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    work = tmp_path_factory.mktemp("device-kv")
    libdir = build(work / "lib")
    pool = f"dev{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as env:
        # The stand-in's node (read by this process's runtimes and the agent's): two devices, one link.
        env.setenv("DAYBREAK_FAKE_SUNRISE", node(["0000:12:00.0", "0000:13:00.0"], links=[[0, 0, 1, 0]],
                                                 memory_bytes=1 << 30))
        env.delenv("DAYBREAK_FAKE_SUNRISE_FAIL", raising=False)
        env.setenv("DAYBREAK_SUNRISE_LIB_DIR", str(libdir))
        env.setenv("DAYBREAK_RUNTIME", "sunrise")
        env.delenv("NODE_NAME", raising=False)  # engines and the standalone agent: this host's name, one node
        env.delenv("DAYBREAK_TRANSPORTS", raising=False)
        agent = LocalAgent(address=f"127.0.0.1:{free_port()}", token_file=work / "token", pool=pool, dram="64Mi",
                           extra=["--hbm", "16Mi"], log_path=work / "agent.log")
        agent.start()
        rt = SunriseRuntime.load(lib_dir=str(libdir))
        try:
            assert _wait(agent, "event=preflight transport=link works=True"), "".join(agent.lines[-30:])
            yield Node(libdir=libdir, agent=agent, token=agent.token_file.read_text().strip(), rt=rt)
        finally:
            rt.close()
            agent.stop()
            cleanup_pool(pool)


def _wait(agent: LocalAgent, text: str, timeout_seconds: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if any(text in line for line in agent.lines):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def engines(sunrise: Node) -> Iterator[tuple[Any, Any]]:
    """Two engine pods' clients (another engine each, as a prefill and a decode pod), built as the connector does."""
    made: list[tuple[PodEngine, KVPoolClient]] = []
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    try:
        for _ in range(2):
            pod = pod_engine(sunrise.settings(), platform="sunrise")
            assert pod.engine is not None, pod.missing
            made.append((pod, KVPoolClient([sunrise.agent.address], token=sunrise.token, namespace=namespace,
                                           engine=pod.engine)))
        yield made[0][1], made[1][1]
    finally:
        for pod, client in made:
            client.close()
            pod.close()


# -- moves ------------------------------------------------------------------------------------------------------

def test_the_fixture_has_gpu_backend_layouts_to_test() -> None:
    assert GPU_LAYOUTS and set(GPU_LAYOUTS) <= set(DUMP["layouts"])
    assert "LBNHC" in GPU_LAYOUTS and "LHBNC" in GPU_LAYOUTS  # one piece per block and layer; one per head slot


@pytest.mark.parametrize("tier", ["hbm", "dram"])
@pytest.mark.parametrize("name", GPU_LAYOUTS)
def test_a_device_kv_save_loads_byte_exact_into_another_engine_with_the_same_layout(
        name: str, tier: str, sunrise: Node, engines: tuple[KVPoolClient, KVPoolClient]) -> None:
    prefill, decode = engines
    a = DeviceKV(sunrise.rt, name, fill=True, tier=tier)
    b = DeviceKV(sunrise.rt, name, fill=False)
    empty = DeviceKV(sunrise.rt, name, fill=False)
    try:
        before = sunrise.stats()
        h = hashes(2)
        saved = a.mover.save(prefill, [BlockTransfer("r1", h, (1, 3))])
        assert saved.error == "" and saved.done == saved.keys == 2 * PAGE["layers"] * a.layout.regions_per_layer
        after = sunrise.stats()
        assert int(after[f"blocks_{tier}"]) - int(before[f"blocks_{tier}"]) == saved.keys  # the tier asked for
        loaded = b.mover.load(decode, [BlockTransfer("r2", h, (4, 0))])
        assert loaded.failed == frozenset() and loaded.error == ""
        assert loaded.done == 2 * PAGE["layers"] * a.layout.block_bytes_per_layer
        assert b.block(4) == a.block(1) and b.block(0) == a.block(3)
        # Nothing else of the receiving cache was written: the two blocks' pieces over zeros.
        expected = bytearray(empty.raw())
        for dst, src in ((4, 1), (0, 3)):
            for ref, piece in zip(empty.views.views([dst]), a.block(src), strict=True):
                assert isinstance(ref, DeviceRef)
                at = ref.ptr - empty.buffer.address
                expected[at:at + ref.size] = piece
        assert b.raw() == bytes(expected)
        # The engines moved device memory themselves (one-sided), nothing went through the store's stream.
        for client in engines:
            assert client._datapath is not None and sum(client._datapath.used.values()) > 0
    finally:
        for kv in (a, b, empty):
            kv.free()


def test_flash_attentions_split_kv_tensors_move_as_two_pieces_per_block_and_layer(
        sunrise: Node, engines: tuple[KVPoolClient, KVPoolClient]) -> None:
    """FlashAttention's per-layer ``[2, num_blocks, block_size, num_kv_heads, head_size]``: K and V a plane apart."""
    layout = engine_layout("LBNHC", kv_split=True)
    shape = (2, PAGE["blocks"], PAGE["block_tokens"], PAGE["kv_heads"], PAGE["head_size"])
    strides = (shape[1] * shape[2] * shape[3] * shape[4], shape[2] * shape[3] * shape[4], shape[3] * shape[4],
               shape[4], 1)
    size = 2 * shape[0] * strides[0]  # bf16

    def cache(fill: bool) -> tuple[list[DeviceBuffer], BlockMover]:
        buffers = [sunrise.rt.allocate(KV_DEVICE, size) for _ in range(PAGE["layers"])]
        for buf in buffers:
            sunrise.rt.copy_to_device(buf, os.urandom(size) if fill else bytes(size))
        views = BlockViews([layer_region(f"l{i}", address=buf.address, shape=shape, strides=strides, itemsize=2,
                                         layout=layout, num_blocks=PAGE["blocks"], device=KV_DEVICE)
                            for i, buf in enumerate(buffers)])
        return buffers, BlockMover(views, fingerprint=layout.fingerprint(), errors=ERRORS, tier="hbm")

    def read(buf: DeviceBuffer, at: int, n: int) -> bytes:
        out = bytearray(n)
        sunrise.rt.copy_to_host(out, DeviceBuffer(buf.device, buf.address + at, n))
        return bytes(out)

    src, save = cache(True)
    dst, load = cache(False)
    try:
        assert layout.regions_per_layer == 2 and layout.fingerprint() != engine_layout("LBNHC").fingerprint()
        h = hashes(1)
        assert save.save(engines[0], [BlockTransfer("r", h, (2,))]).done == 2 * PAGE["layers"]
        assert load.load(engines[1], [BlockTransfer("r", h, (0,))]).failed == frozenset()
        page = strides[1] * 2
        for a, b in zip(src, dst, strict=True):
            for plane in (0, 1):  # K, then V
                assert read(b, plane * strides[0] * 2, page) == read(a, plane * strides[0] * 2 + 2 * page, page)
    finally:
        for buf in src + dst:
            sunrise.rt.free(buf)


def test_layer_by_layer_saves_and_loads_of_device_kv_through_the_pipeline(
        sunrise: Node, engines: tuple[KVPoolClient, KVPoolClient]) -> None:
    a = DeviceKV(sunrise.rt, "LHBNC", fill=True, tier="hbm")
    b = DeviceKV(sunrise.rt, "LHBNC", fill=False)
    saving, loading = LayerPipeline(a.mover, engines[0]), LayerPipeline(b.mover, engines[1])
    try:
        h = hashes(2)
        transfers = [BlockTransfer("r", h, (0, 2))]
        assert saving.save_layer(1, transfers) and not saving.save_layer(1, transfers)
        saved = saving.finish_saves(transfers)  # layer 1 alone, then layer 0 as the rest
        assert [m.keys for m in saved] == [2 * a.layout.regions_per_layer] * 2 and all(not m.error for m in saved)
        loading.start_loads([BlockTransfer("r", h, (3, 1))])
        for layer in range(PAGE["layers"]):
            moved = loading.wait_load(layer)
            assert moved is not None and moved.failed == frozenset()
            assert b.block(3, layers=(layer,)) == a.block(0, layers=(layer,))
        assert loading.finish_loads() == [] and b.block(1) == a.block(2)
    finally:
        saving.close()
        loading.close()
        a.free()
        b.free()


def test_engines_with_different_layouts_or_platforms_never_share_a_key(
        sunrise: Node, engines: tuple[KVPoolClient, KVPoolClient]) -> None:
    prints = {name: engine_layout(name).fingerprint() for name in DUMP["layouts"]}
    prints["cpu"] = engine_layout("LBHNC", platform="cpu").fingerprint()
    prints["cuda"] = engine_layout("LBHNC", platform="cuda").fingerprint()
    prints["split"] = engine_layout("LBNHC", kv_split=True).fingerprint()
    assert len(set(prints.values())) == len(prints)
    source = DeviceKV(sunrise.rt, "LBHNC", fill=True)
    h = hashes(1)
    others = [DeviceKV(sunrise.rt, name, fill=False) for name in GPU_LAYOUTS if name != "LBHNC"]
    try:
        assert source.mover.save(engines[0], [BlockTransfer("r", h, (2,))]).done == PAGE["layers"]
        for other in others:
            moved = other.mover.load(engines[1], [BlockTransfer("r", h, (2,))])
            assert moved.failed == {2} and moved.done == 0, other.layout.kv_layout  # a miss, never a misread
            assert not any(other.raw())
        # The same layout on the CPU: its keys are not the device engine's.
        cpu = block_keys(prints["cpu"], h, PAGE["layers"])
        assert engines[1].batch_exists(cpu) == [False] * len(cpu)
        assert engines[1].batch_exists(block_keys(prints["LBHNC"], h, PAGE["layers"])) == [True] * PAGE["layers"]
    finally:
        source.free()
        for other in others:
            other.free()


# -- refusals ---------------------------------------------------------------------------------------------------

class _HostOnlyEngine:
    runtime = None


def test_device_kv_without_an_engine_with_the_platforms_runtime_is_refused_naming_what_is_missing(
        sunrise: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = "model.layers.0.self_attn.attn"
    assert require_device_path(layer, KVMemory.parse("cpu"), None) is None  # host memory needs nothing
    with pytest.raises(ConnectorConfigError, match=r"KV cache is in cuda:0 memory, which moves only through a "
                       r"transfer engine with the nvidia runtime, and the pool client has no transfer engine"):
        require_device_path(layer, KVMemory.parse("cuda:0"), None)
    with pytest.raises(ConnectorConfigError, match=r"transfer engine has no runtime"):
        require_device_path(layer, KVMemory.parse("sunrise:1"), _HostOnlyEngine())
    with pytest.raises(ConnectorConfigError, match=r"xpu:0 memory, which no Daybreak runtime drives"):
        require_device_path(layer, KVMemory.parse("xpu:0"), None)
    # A node whose Tang libraries are not where the pod looks: no engine, and the reason in the error.
    monkeypatch.setenv("DAYBREAK_SUNRISE_LIB_DIR", str(tmp_path))
    monkeypatch.setattr("daybreak.agent.runtime.sunrise.DEFAULT_DIRS", ())
    pod = pod_engine(sunrise.settings(), platform="sunrise")
    assert pod.engine is None and pod.missing.startswith("the sunrise runtime did not load: ")
    with pytest.raises(ConnectorConfigError) as err:
        require_device_path(layer, KVMemory.parse("sunrise:1"), pod.engine, missing=pod.missing)
    assert "the pool client has no transfer engine (the sunrise runtime did not load: " in str(err.value)
    assert "_shared.so" in str(err.value)  # the library it could not load
    # The runtime loads but does not see the tensor's device.
    monkeypatch.setenv("DAYBREAK_SUNRISE_LIB_DIR", str(sunrise.libdir))
    with pod_or_close(pod_engine(sunrise.settings(), platform="sunrise")) as ok:
        assert require_device_path(layer, KVMemory.parse("sunrise:1"), ok.engine) == 1
        with pytest.raises(ConnectorConfigError, match=r"sees devices \[0, 1\] only"):
            require_device_path(layer, KVMemory.parse("sunrise:7"), ok.engine)
    assert pod_engine(sunrise.settings(), platform="cpu") == PodEngine()  # host KV: no engine at all


class pod_or_close:
    def __init__(self, pod: PodEngine) -> None:
        self.pod = pod

    def __enter__(self) -> PodEngine:
        return self.pod

    def __exit__(self, *exc: object) -> None:
        self.pod.close()
