"""``LayerPipeline``: layer-by-layer moves on one I/O thread, ordered against the forward pass through ``LayerSync``.

The sync here records what the torch streams would be asked (``TorchStreamSync``
is the GPU's; it runs in hack/gpu_check.py on a device): which thread marks and
waits for what, in which order. The pool is a recording stand-in: these tests
are about ordering, the moves themselves are tested against real agents in
test_connector_layouts.py and test_connector_device.py.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from daybreak.connectors.blocks import (
    BlockMover,
    BlockTransfer,
    BlockViews,
    ConnectorConfigError,
    EngineLayout,
    HostSync,
    KVMemory,
    LayerPipeline,
    LayerRegion,
    layer_sync,
)

LAYERS = 3
BLOCK = 64


class RecordingSync:
    """A LayerSync that logs (thread, call, marker); markers are numbered as events would be."""

    def __init__(self, log: list[tuple[str, str, Any]]) -> None:
        self.log = log
        self.count = 0

    def _note(self, call: str, marker: Any = None) -> None:
        self.log.append((threading.current_thread().name, call, marker))

    def compute_done(self) -> int:
        self.count += 1
        self._note("compute_done", f"c{self.count}")
        return self.count

    def wait_compute(self, marker: Any) -> None:
        self._note("wait_compute", f"c{marker}")

    def io_done(self) -> int:
        self.count += 1
        self._note("io_done", f"i{self.count}")
        return self.count

    def wait_io(self, marker: Any) -> None:
        self._note("wait_io", f"i{marker}")

    def io_scope(self) -> Any:
        sync = self

        class Scope:
            def __enter__(self) -> None:
                sync._note("io_scope")

            def __exit__(self, *exc: object) -> None:
                return None

        return Scope()


class RecordingPool:
    """Stores pieces in a dict; logs each batch with its thread and key count."""

    def __init__(self, log: list[tuple[str, str, Any]]) -> None:
        self.log = log
        self.data: dict[str, bytes] = {}

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any], *, tier: str = "dram") -> list[int]:
        self.log.append((threading.current_thread().name, "put", len(keys)))
        for key, buf in zip(keys, buffers, strict=True):
            self.data[key] = bytes(buf)
        return [1] * len(keys)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        self.log.append((threading.current_thread().name, "get", len(keys)))
        out: list[int | None] = []
        for key, buf in zip(keys, buffers, strict=True):
            if key in self.data:
                buf[:len(self.data[key])] = self.data[key]
                out.append(len(self.data[key]))
            else:
                out.append(None)
        return out


def host_kv(fill: int) -> tuple[Any, BlockMover]:
    memory = (ctypes.c_ubyte * (LAYERS * 4 * BLOCK))(*([fill] * (LAYERS * 4 * BLOCK)))
    base = ctypes.addressof(memory)
    views = BlockViews([LayerRegion(address=base + i * 4 * BLOCK, num_blocks=4, block_bytes=BLOCK)
                        for i in range(LAYERS)])
    return memory, BlockMover(views, fingerprint="f", errors=(ValueError,))


def test_a_save_waits_for_its_layers_compute_on_the_io_thread_and_the_rest_go_in_one_batch() -> None:
    log: list[tuple[str, str, Any]] = []
    _, mover = host_kv(7)
    pipeline = LayerPipeline(mover, RecordingPool(log), sync=RecordingSync(log), thread_name="io")
    transfers = [BlockTransfer("r", (b"h0", b"h1"), (0, 2))]
    try:
        assert pipeline.save_layer(0, transfers)
        assert not pipeline.save_layer(0, transfers)  # a layer is saved once per step
        assert pipeline.save_layer(2, transfers)
        moved = pipeline.finish_saves(transfers)  # layer 1 was never reported: saved with the rest
    finally:
        pipeline.close()
    assert [m.keys for m in moved] == [2, 2, 2] and not pipeline.saving
    forward = threading.current_thread().name
    # The forward thread marks each layer's compute; the I/O thread waits for exactly that mark, then moves.
    for marker in ("c1", "c2", "c3"):
        made = log.index((forward, "compute_done", marker))
        waited = next(i for i, (t, c, m) in enumerate(log) if c == "wait_compute" and m == marker)
        assert waited > made and log[waited][0].startswith("io")
        assert log[waited + 1][1] == "io_scope" and log[waited + 2][1] == "put"
    puts = [(t, n) for t, c, n in log if c == "put"]
    assert all(t.startswith("io") for t, _ in puts) and [n for _, n in puts] == [2, 2, 2]


def test_a_layers_load_orders_the_forward_pass_after_that_layers_moves() -> None:
    log: list[tuple[str, str, Any]] = []
    pool = RecordingPool(log)
    _src, saver = host_kv(9)  # kept: the views point into it
    dst, loader = host_kv(0)
    saving = LayerPipeline(saver, pool)
    saving.finish_saves([BlockTransfer("r", (b"h",), (1,))])
    saving.close()
    pipeline = LayerPipeline(loader, pool, sync=RecordingSync(log), thread_name="io")
    try:
        pipeline.start_loads([BlockTransfer("r", (b"h",), (3,))])
        assert pipeline.loading
        moved = pipeline.wait_load(1)
        assert moved is not None and moved.failed == frozenset()
        assert pipeline.wait_load(1) is None  # waited once
        rest = pipeline.finish_loads()  # layers 0 and 2: nobody waited for them
    finally:
        pipeline.close()
    assert [m.failed for m in rest] == [frozenset(), frozenset()] and not pipeline.loading
    forward = threading.current_thread().name
    # Each layer: its moves, then an event on the I/O stream, and the forward pass waits on that event.
    done = [m for t, c, m in log if c == "io_done"]
    waited = [m for t, c, m in log if c == "wait_io"]
    assert len(done) == LAYERS and sorted(waited) == sorted(done)
    assert all(t == forward for t, c, _ in log if c == "wait_io")
    assert all(t.startswith("io") for t, c, _ in log if c in ("io_done", "get"))
    assert bytes(dst)[3 * BLOCK:4 * BLOCK] == bytes([9]) * BLOCK
    assert bytes(dst)[:3 * BLOCK] == bytes(3 * BLOCK)


def test_host_memory_needs_no_device_ordering() -> None:
    assert isinstance(layer_sync(KVMemory.parse("cpu")), HostSync)


def test_kv_memory_comes_from_torchs_device_string_and_a_split_layout_needs_even_halves() -> None:
    assert KVMemory.parse("cpu") == KVMemory("cpu") and not KVMemory.parse("cpu").on_device
    assert KVMemory.parse("cuda:3") == KVMemory("cuda", 3) and str(KVMemory("cuda", 3)) == "cuda:3"
    with pytest.raises(ConnectorConfigError, match="names no device index"):
        KVMemory.parse("cuda")
    layout = EngineLayout(platform="cuda", block_tokens=16, num_layers=2, num_kv_heads=3, head_dim=8,
                          dtype="bfloat16", kv_layout="LBNHC", head_slots=3, content_bytes=32, kv_split=True)
    with pytest.raises(ConnectorConfigError, match="same size"):
        EngineLayout(**{**layout.__dict__, "content_bytes": 33})
