"""The GPU check of issue 20: the vLLM connector core on CUDA KV caches, through a standalone agent's HBM and DRAM tiers.

Run it from a bare checkout on a lent GPU machine (python3 with numpy and torch built for CUDA; no vLLM, no
registry; what else it imports comes from wheels in .whl/: ``python3 hack/linktree.py --wheels 3.X``
elsewhere, then carry .whl/ along)::

    python3 hack/gpu_check.py          # one H200: expected 2-3 minutes (not run yet); the JSON summary is last
    python3 hack/gpu_check.py --cpu    # the same code on the Sunrise stand-in (tests/sunrise_lib, needs gcc)

What it does, in order:

1. starts ``daybreak agent --standalone`` with an HBM tier and a DRAM tier (the nvidia runtime; ``--cpu``:
   the stand-in's "device" memory);
2. process A allocates FlashAttention-layout KV tensors (per layer ``[2, num_blocks, block_size,
   num_kv_heads, head_size]``, bf16; ``EngineLayout(kv_split=True)``) on the device, fills them at random and
   saves blocks through the connector core exactly as the vLLM worker does (``pod_engine`` ->
   ``KVPoolClient(engine=...)``, ``layer_region`` / ``BlockViews`` / ``BlockMover``: every piece of every block
   and layer in one scatter-gather batch of ``DeviceRef``s), per tier and per piece size (2 MiB and up),
   timed against torch's D2H copy of the same bytes into a pinned host tensor (cudaMemcpy);
3. process B (another process, so another CUDA context) loads those blocks into its own tensors, at other
   block ids, timed against the H2D copy; the sha256 of every loaded piece must be A's;
4. layer by layer (``LayerPipeline`` with ``TorchStreamSync``: the I/O thread's own CUDA stream, one event
   per layer): A runs a step of one dummy kernel per layer that also rewrites the layer's blocks, with and
   without saving each layer as it finishes (compute on the default stream and on a side stream), and B a
   step with and without loading each layer before its kernel; the step-time overhead says how much of the
   transfer the compute hides (target <= 10%), and B checks the pipelined saves' bytes (an I/O thread that
   read a layer before its kernel finished would have saved the old bytes);
5. runs ``daybreak selfcheck --json``.

It prints one JSON summary at the end (and writes it to ``$OUT/gpu_check.json`` when ``$OUT`` is set), and
exits 1 when a byte was wrong or a step failed; missed speed targets are reported, not failures.
``--cpu`` moves the same bytes through the same calls over the stand-in's device memory (host memory
underneath) with a numpy "kernel": it proves the script's code path (tests/connectors/test_gpu_check.py runs
it), not any GPU figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import linktree  # noqa: E402  (hack/ is not a package)

MiB = 1 << 20
# What the check imports beyond the standard library and the selfcheck's needs.
GPU_NEEDS = ["numpy", "torch", "pynvml"]
CPU_NEEDS = ["numpy"]
NAMESPACE = "gpu-check"


# -- what one run moves ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """The KV geometry and sizes of a run (GPU or ``--cpu``), shared by both processes."""

    layers: int
    kv_heads: int
    head_size: int
    blocks: int
    """Blocks moved per batch (one vLLM step's worth); each layer's tensor holds twice as many."""
    pieces_kib: tuple[int, ...]
    """Bytes of one K (or V) piece of one block and layer: the pool's value size."""
    rounds: int
    tiers: tuple[str, ...] = ("hbm", "dram")
    compute_ratio: float = 1.5
    """The dummy kernel's time per layer over the save's time per layer (prefill compute usually exceeds it)."""
    slack_mib: int = 256

    def block_tokens(self, piece_kib: int) -> int:
        per_token = self.kv_heads * self.head_size * 2  # bf16 K (or V) of one token
        tokens = piece_kib * 1024 // per_token
        if tokens < 1 or tokens * per_token != piece_kib * 1024:
            raise SystemExit(f"gpu_check: a {piece_kib} KiB piece is not whole tokens of {per_token} bytes")
        return tokens

    def shape(self, piece_kib: int) -> tuple[int, int, int, int, int]:
        """FlashAttention's per-layer KV tensor: [2, num_blocks, block_size, num_kv_heads, head_size]."""
        return (2, 2 * self.blocks, self.block_tokens(piece_kib), self.kv_heads, self.head_size)

    def batch_bytes(self, piece_kib: int) -> int:
        return self.layers * self.blocks * 2 * piece_kib * 1024

    def tier_bytes(self) -> int:
        """What one tier must hold with room to spare (nothing may be evicted before B reads it): A keeps the
        last round of each piece size and of each pipelined variant (two) and removes the others, so at most one
        more batch is there at a time."""
        held = sum(self.batch_bytes(p) for p in self.pieces_kib) + max(self.batch_bytes(p) for p in self.pieces_kib)
        held += 2 * self.batch_bytes(self.pieces_kib[0])
        return held * 3 // 2 + self.slack_mib * MiB


GPU_PLAN = Plan(layers=8, kv_heads=8, head_size=128, blocks=4, pieces_kib=(2048, 8192), rounds=3)
CPU_PLAN = Plan(layers=2, kv_heads=2, head_size=64, blocks=2, pieces_kib=(64, 256), rounds=2, slack_mib=16)


# -- device memory: torch on CUDA, or the Sunrise stand-in ----------------------------------------------------

def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


class TorchCuda:
    """KV tensors, copies and a dummy kernel on one CUDA device through torch."""

    platform = "cuda"

    def __init__(self, index: int = 0) -> None:
        import torch

        self.torch = torch
        self.index = index
        self.device = torch.device("cuda", index)
        torch.cuda.set_device(self.device)
        self.name = torch.cuda.get_device_name(self.device)
        self._a = torch.randn(2048, 2048, device=self.device, dtype=torch.bfloat16)
        self._b = torch.randn(2048, 2048, device=self.device, dtype=torch.bfloat16)
        self._out = torch.empty(2048, 2048, device=self.device, dtype=torch.bfloat16)
        self.side = torch.cuda.Stream(device=self.device)

    def kv(self, shape: Sequence[int], *, fill: bool) -> Any:
        t = self.torch.empty(tuple(shape), dtype=self.torch.bfloat16, device=self.device)
        if fill:
            t.view(self.torch.int16).random_(-32768, 32767)
        else:
            t.zero_()
        return t

    def address(self, kv: Any) -> int:
        return int(kv.data_ptr())

    def read(self, kv: Any, offset: int, size: int) -> bytes:
        flat = kv.view(self.torch.uint8).reshape(-1)
        return bytes(flat[offset:offset + size].cpu().numpy().tobytes())

    def patterns(self, kv: Any, blocks: Sequence[int]) -> Any:
        """What ``stamp`` writes into ``blocks`` of ``kv``: random, changed by ``vary`` every round."""
        pattern = self.torch.empty_like(kv[:, :len(blocks)])
        pattern.view(self.torch.int16).random_(-32768, 32767)
        return (pattern, self.torch.tensor(list(blocks), device=self.device))

    def vary(self, pattern: Any) -> None:
        pattern[0].view(self.torch.int16).add_(1)

    def stamp(self, kv: Any, pattern: Any) -> None:
        """The dummy kernel's output: the layer's blocks rewritten (on the current stream, after its matmuls)."""
        kv.index_copy_(1, pattern[1], pattern[0])

    def compute(self, reps: int) -> None:
        for _ in range(reps):
            self.torch.matmul(self._a, self._b, out=self._out)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def seconds_per_rep(self) -> float:
        self.compute(10)
        self.synchronize()
        started = time.perf_counter()
        self.compute(100)
        self.synchronize()
        return (time.perf_counter() - started) / 100

    def side_stream(self) -> Any:
        return self.torch.cuda.stream(self.side)

    def layer_sync(self) -> Any:
        """What the vLLM worker uses on this device: ``TorchStreamSync`` (an I/O stream, an event per layer)."""
        from daybreak.connectors.blocks import KVMemory, layer_sync

        return layer_sync(KVMemory(self.platform, self.index))

    def memcpy_gbps(self, nbytes: int, rounds: int) -> tuple[float, float]:
        """cudaMemcpy of ``nbytes`` (torch copies between device and a pinned host tensor): (D2H, H2D) GB/s."""
        torch = self.torch
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        best = [float("inf"), float("inf")]
        for _ in range(rounds + 1):  # the first round warms up
            for i, (dst, src) in enumerate(((host, dev), (dev, host))):
                self.synchronize()
                started = time.perf_counter()
                dst.copy_(src)
                self.synchronize()
                best[i] = min(best[i], time.perf_counter() - started)
        del dev, host
        return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9

    def free(self, kv: Any) -> None:
        del kv

    def close(self) -> None:
        self.torch.cuda.empty_cache()


class StandIn:
    """The same on the Sunrise stand-in (``--cpu``): device memory of the test Tang library, a numpy kernel."""

    platform = "sunrise"

    def __init__(self, lib_dir: str, index: int = 0) -> None:
        import numpy as np

        from daybreak.agent.runtime.base import DeviceBuffer
        from daybreak.agent.runtime.sunrise import SunriseRuntime

        self.np = np
        self.Buffer = DeviceBuffer
        self.rt = SunriseRuntime.load(lib_dir=lib_dir)
        self.index = index
        self.name = self.rt.devices()[index].model + " (stand-in)"
        self._a = np.random.default_rng(1).random((96, 96), dtype=np.float32)
        self.side = None

    def kv(self, shape: Sequence[int], *, fill: bool) -> Any:
        size = 2
        for s in shape:
            size *= s
        buf = self.rt.allocate(self.index, size)
        self.rt.copy_to_device(buf, os.urandom(size) if fill else bytes(size))
        return buf

    def address(self, kv: Any) -> int:
        return int(kv.address)

    def read(self, kv: Any, offset: int, size: int) -> bytes:
        out = bytearray(size)
        self.rt.copy_to_host(out, kv, offset=offset)
        return bytes(out)

    def patterns(self, kv: Any, blocks: Sequence[int]) -> Any:
        return {"blocks": list(blocks), "seed": int.from_bytes(os.urandom(4), "little"), "round": 0}

    def vary(self, pattern: Any) -> None:
        pattern["round"] += 1

    def stamp(self, kv: Any, pattern: Any) -> None:
        plane = kv.size // 2
        per_block = plane // (2 * len(pattern["blocks"]))  # each plane holds twice the moved blocks
        rng = self.np.random.default_rng((pattern["seed"], pattern["round"]))
        for half in (0, plane):
            for block in pattern["blocks"]:
                self.rt.copy_to_device(kv, rng.bytes(per_block), offset=half + block * per_block)

    def compute(self, reps: int) -> None:
        for _ in range(reps):
            self._a @ self._a

    def synchronize(self) -> None:
        return None

    def seconds_per_rep(self) -> float:
        started = time.perf_counter()
        self.compute(50)
        return (time.perf_counter() - started) / 50

    def side_stream(self) -> Any:
        return _null()

    def layer_sync(self) -> Any:
        """The stand-in has no streams (its copies and the numpy kernel are synchronous): ``HostSync``."""
        from daybreak.connectors.blocks import HostSync

        return HostSync()

    def memcpy_gbps(self, nbytes: int, rounds: int) -> tuple[float, float]:
        buf = self.rt.allocate(self.index, nbytes)
        host = bytearray(nbytes)
        best = [float("inf"), float("inf")]
        try:
            for _ in range(rounds):
                started = time.perf_counter()
                self.rt.copy_to_host(host, buf)
                best[0] = min(best[0], time.perf_counter() - started)
                started = time.perf_counter()
                self.rt.copy_to_device(buf, host)
                best[1] = min(best[1], time.perf_counter() - started)
        finally:
            self.rt.free(buf)
        return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9

    def free(self, kv: Any) -> None:
        self.rt.free(kv)

    def close(self) -> None:
        self.rt.close()


def _memory(spec: dict[str, Any]) -> Any:
    return StandIn(spec["sunrise_lib_dir"]) if spec["cpu"] else TorchCuda()


# -- one engine's KV cache through the connector core ---------------------------------------------------------

class Cache:
    """L layers of FlashAttention KV tensors on the device, seen by the connector core as the vLLM worker sees them."""

    def __init__(self, memory: Any, plan: Plan, piece_kib: int, *, fill: bool, engine: Any, tier: str) -> None:
        from daybreak.connectors.blocks import (
            BlockMover,
            BlockViews,
            EngineLayout,
            KVMemory,
            layer_region,
            require_device_path,
        )

        self.memory = memory
        self.shape = plan.shape(piece_kib)
        self.layout = EngineLayout(platform=memory.platform, block_tokens=self.shape[2], num_layers=plan.layers,
                                   num_kv_heads=plan.kv_heads, head_dim=plan.head_size, dtype="bfloat16",
                                   kv_layout="LBNHC", head_slots=plan.kv_heads, content_bytes=4 * plan.head_size,
                                   kv_split=True)
        self.tensors = [memory.kv(self.shape, fill=fill) for _ in range(plan.layers)]
        names = [f"model.layers.{i}.self_attn.attn" for i in range(plan.layers)]
        # What register_kv_caches checks before anything moves: the engine can move this device's memory.
        device = require_device_path(names[0], KVMemory(memory.platform, memory.index), engine)
        self.views = BlockViews([layer_region(name, address=memory.address(t), shape=self.shape,
                                              strides=_strides(self.shape), itemsize=2, layout=self.layout,
                                              num_blocks=self.shape[1], device=device)
                                 for name, t in zip(names, self.tensors, strict=True)])
        self.mover = BlockMover(self.views, fingerprint=self.layout.fingerprint(),
                                errors=(OSError, ValueError, RuntimeError), tier=tier)  # type: ignore[arg-type]

    def digest(self, blocks: Sequence[int]) -> str:
        """sha256 over every piece of ``blocks`` (every layer), in key order (``BlockViews.views``'), read back."""
        digest = hashlib.sha256()
        for block in blocks:
            for region, tensor in zip(self.views.regions, self.tensors, strict=True):
                base = block * region.layout.block_stride
                for offset, length in region.layout.regions:
                    digest.update(self.memory.read(tensor, base + offset, length))
        return digest.hexdigest()

    def free(self) -> None:
        for t in self.tensors:
            self.memory.free(t)
        self.tensors = []


def _transfers(hashes: Sequence[str], blocks: Sequence[int]) -> list[Any]:
    from daybreak.connectors.blocks import BlockTransfer

    return [BlockTransfer("gpu-check", tuple(bytes.fromhex(h) for h in hashes), tuple(blocks))]


def _hashes(n: int) -> list[str]:
    return [os.urandom(16).hex() for _ in range(n)]


def _client(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The pod's transfer engine and a client on it, as the vLLM worker builds them."""
    from daybreak.client import KVPoolClient
    from daybreak.connectors.blocks import PoolSettings, pod_engine

    settings = PoolSettings(endpoints=(spec["endpoint"],), token=spec["token"], namespace=NAMESPACE)
    pod = pod_engine(settings, platform="sunrise" if spec["cpu"] else "cuda")
    if pod.engine is None:
        raise SystemExit(f"gpu_check: no transfer engine for device memory: {pod.missing}")
    return pod, KVPoolClient([spec["endpoint"]], token=spec["token"], namespace=NAMESPACE, engine=pod.engine)


def _engine_report(pod: Any) -> dict[str, Any]:
    """Bytes the pod's transfer engine moved per transport, and what fell back from where to where."""
    return {"transports": dict(pod.engine.bytes_used),
            "fell_back": {f"{a}->{b}": n for (a, b), n in pod.engine.bytes_fell_back.items()}}


def _close(client: Any, pod: Any, memory: Any) -> None:
    """The pool client, then the pod's engine and runtime, then the device memory of the run."""
    client.close()
    pod.close()
    memory.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _step(memory: Any, cache: Cache, patterns: list[Any], reps: int, *, pipeline: Any = None,
          transfers: Any = None, side: bool = False) -> float:
    """One forward step: per layer a dummy kernel that ends by rewriting the layer's blocks, then (with
    ``pipeline``) that layer's save queued behind it; returns the seconds until the step and its saves are done."""
    for p in patterns:
        memory.vary(p)
    memory.synchronize()
    started = time.perf_counter()
    with memory.side_stream() if side else _null():
        for layer, kv in enumerate(cache.tensors):
            memory.compute(reps)
            memory.stamp(kv, patterns[layer])
            if pipeline is not None:
                pipeline.save_layer(layer, transfers)
        if pipeline is not None:
            moved = pipeline.finish_saves(transfers)
            if any(m.error or m.done != m.keys for m in moved):
                raise RuntimeError(f"a pipelined save failed: {[m.error for m in moved if m.error][:1]}")
        memory.synchronize()
    return time.perf_counter() - started


def _hidden(plain: float, pipelined: float, transfer: float) -> float:
    """The share of the transfer's own time the compute hid: 1 when the step took no longer, 0 when it took at
    least the whole transfer longer (a pipeline that costs more than moving the bytes alone is also 0)."""
    extra = max(0.0, pipelined - plain)
    return round(max(0.0, 1 - extra / transfer), 4) if transfer > 0 else 0.0


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


# -- process A: saves -------------------------------------------------------------------------------------------

def role_save(spec: dict[str, Any]) -> dict[str, Any]:
    from daybreak.connectors.blocks import LayerPipeline

    plan = Plan(**{**spec["plan"], "pieces_kib": tuple(spec["plan"]["pieces_kib"]),
                   "tiers": tuple(spec["plan"]["tiers"])})
    memory = _memory(spec)
    pod, client = _client(spec)
    out: dict[str, Any] = {"device": memory.name, "configs": [], "pipeline": []}
    blocks = list(range(1, 2 * plan.blocks, 2))  # the odd blocks: B loads them into the even ones
    try:
        for piece in plan.pieces_kib:
            nbytes = plan.batch_bytes(piece)
            d2h, _ = memory.memcpy_gbps(nbytes, plan.rounds)
            for tier in plan.tiers:
                cache = Cache(memory, plan, piece, fill=True, engine=pod.engine, tier=tier)
                try:
                    hashes, best = [], float("inf")
                    for _ in range(plan.rounds):  # new keys every round: a put of stored keys is no put
                        _drop(client, cache, hashes)
                        hashes = _hashes(plan.blocks)
                        memory.synchronize()
                        started = time.perf_counter()
                        moved = cache.mover.save(client, _transfers(hashes, blocks))
                        seconds = time.perf_counter() - started
                        if moved.error or moved.done != moved.keys:
                            raise RuntimeError(f"save of {piece} KiB pieces to {tier}: {moved.done}/{moved.keys} "
                                               f"keys stored {moved.error}")
                        best = min(best, seconds)
                    out["configs"].append({"tier": tier, "piece_bytes": piece * 1024, "bytes": nbytes,
                                           "keys": moved.keys, "save_gb_per_s": _gbps(nbytes, best),
                                           "d2h_gb_per_s": round(d2h, 3), "hashes": hashes,
                                           "digest": cache.digest(blocks)})
                    if piece == plan.pieces_kib[0]:
                        out["pipeline"] += _pipelined_saves(memory, plan, cache, client, blocks, tier=tier,
                                                            per_layer=best / plan.layers, sync=memory.layer_sync(),
                                                            pipeline_type=LayerPipeline)
                finally:
                    cache.free()
        out.update(_engine_report(pod))
    finally:
        _close(client, pod, memory)
    return out


def _pipelined_saves(memory: Any, plan: Plan, cache: Cache, client: Any, blocks: list[int], *, tier: str,
                     per_layer: float, sync: Any, pipeline_type: Any) -> list[dict[str, Any]]:
    """Step time with and without layer-by-layer saves, compute on the default stream and on a side stream."""
    reps = max(1, round(per_layer * plan.compute_ratio / memory.seconds_per_rep()))
    patterns = [memory.patterns(kv, blocks) for kv in cache.tensors]
    results = []
    for side in (False, True) if memory.side is not None else (False,):
        plain = min(_step(memory, cache, patterns, reps, side=side) for _ in range(plan.rounds))
        pipeline = pipeline_type(cache.mover, client, sync=sync)
        try:
            best, hashes = float("inf"), []
            for _ in range(plan.rounds):
                _drop(client, cache, hashes)
                hashes = _hashes(plan.blocks)
                best = min(best, _step(memory, cache, patterns, reps, pipeline=pipeline,
                                       transfers=_transfers(hashes, blocks), side=side))
        finally:
            pipeline.close()
        results.append({"tier": tier, "compute_stream": "side" if side else "default", "kernel_reps_per_layer": reps,
                        "step_seconds": round(plain, 6), "step_with_saves_seconds": round(best, 6),
                        "save_alone_seconds": round(per_layer * plan.layers, 6),
                        "overhead": round(best / plain - 1, 4),
                        "hidden": _hidden(plain, best, per_layer * plan.layers),
                        "hashes": hashes, "digest": cache.digest(blocks)})  # the last step's bytes
    return results


def _drop(client: Any, cache: Cache, hashes: Sequence[str]) -> None:
    """Remove an earlier round's blocks (B reads only the last round's): the tiers stay small."""
    from daybreak.connectors.blocks import block_keys

    if hashes:
        client.remove(block_keys(cache.layout.fingerprint(), [bytes.fromhex(h) for h in hashes], cache.views.num_layers,
                                 cache.views.pieces_per_layer))


# -- process B: loads -------------------------------------------------------------------------------------------

def role_load(spec: dict[str, Any]) -> dict[str, Any]:
    from daybreak.connectors.blocks import LayerPipeline

    plan = Plan(**{**spec["plan"], "pieces_kib": tuple(spec["plan"]["pieces_kib"]),
                   "tiers": tuple(spec["plan"]["tiers"])})
    saved = spec["saved"]
    memory = _memory(spec)
    pod, client = _client(spec)
    out: dict[str, Any] = {"device": memory.name, "configs": [], "pipeline": [], "pipelined_saves_exact": []}
    blocks = list(range(0, 2 * plan.blocks, 2))  # the even blocks: A saved from the odd ones
    try:
        for config in saved["configs"]:
            piece = config["piece_bytes"] // 1024
            _, h2d = memory.memcpy_gbps(config["bytes"], plan.rounds)
            cache = Cache(memory, plan, piece, fill=False, engine=pod.engine, tier=config["tier"])
            try:
                best, failed = float("inf"), 0
                for _ in range(plan.rounds):  # the same keys every round: reads leave them in place
                    memory.synchronize()
                    started = time.perf_counter()
                    moved = cache.mover.load(client, _transfers(config["hashes"], blocks))
                    best = min(best, time.perf_counter() - started)
                    failed += len(moved.failed)
                exact = failed == 0 and cache.digest(blocks) == config["digest"]
                out["configs"].append({"tier": config["tier"], "piece_bytes": config["piece_bytes"],
                                       "load_gb_per_s": _gbps(config["bytes"], best), "h2d_gb_per_s": round(h2d, 3),
                                       "failed_blocks": failed, "byte_exact": exact})
                if config is saved["configs"][0]:
                    for variant in saved["pipeline"]:  # the pipelined saves' last step, byte for byte
                        moved = cache.mover.load(client, _transfers(variant["hashes"], blocks))
                        out["pipelined_saves_exact"].append(not moved.failed and
                                                            cache.digest(blocks) == variant["digest"])
                    out["pipeline"] = _pipelined_loads(memory, plan, cache, client, blocks, config["hashes"],
                                                       per_layer=best / plan.layers,
                                                       sync=memory.layer_sync(),
                                                       pipeline_type=LayerPipeline)
            finally:
                cache.free()
        out.update(_engine_report(pod))
    finally:
        _close(client, pod, memory)
    return out


def _pipelined_loads(memory: Any, plan: Plan, cache: Cache, client: Any, blocks: list[int], hashes: list[str],
                     *, per_layer: float, sync: Any, pipeline_type: Any) -> dict[str, Any]:
    """Step time with and without loading each layer right before its kernel (``wait_for_layer_load``)."""
    reps = max(1, round(per_layer * plan.compute_ratio / memory.seconds_per_rep()))

    def step(pipeline: Any = None) -> float:
        memory.synchronize()
        started = time.perf_counter()
        if pipeline is not None:
            pipeline.start_loads(_transfers(hashes, blocks))
        for layer in range(plan.layers):
            if pipeline is not None:
                moved = pipeline.wait_load(layer)
                if moved is None or moved.failed:
                    raise RuntimeError(f"layer {layer}: a pipelined load failed")
            memory.compute(reps)
        memory.synchronize()
        return time.perf_counter() - started

    plain = min(step() for _ in range(plan.rounds))
    pipeline = pipeline_type(cache.mover, client, sync=sync)
    try:
        best = min(step(pipeline) for _ in range(plan.rounds))
    finally:
        pipeline.close()
    return {"kernel_reps_per_layer": reps, "step_seconds": round(plain, 6), "step_with_loads_seconds": round(best, 6),
            "load_alone_seconds": round(per_layer * plan.layers, 6), "overhead": round(best / plain - 1, 4),
            "hidden": _hidden(plain, best, per_layer * plan.layers)}


# -- the driver -------------------------------------------------------------------------------------------------

def _child(role: str, spec: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Run a role in a fresh process (its own CUDA context); its last stdout line is its JSON result."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--role", role],
                         input=json.dumps(spec), capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"})
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"process {role} exited {out.returncode}: {out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _selfcheck(cpu: bool, lib_dir: str, *, timeout: float) -> dict[str, Any]:
    argv = [sys.executable, "-m", "daybreak.agent.selfcheck", "--json"]
    argv += (["--runtime", "sunrise", "--sunrise-lib-dir", lib_dir, "--mib", "4", "--block-mib", "1"] if cpu
             else ["--runtime", "nvidia", "--mib", "256"])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "PYTHONSAFEPATH": "1"})
    except subprocess.TimeoutExpired:
        return {"exit": None, "error": f"daybreak selfcheck did not finish in {timeout:.0f} s"}
    try:
        report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"exit": out.returncode, "error": out.stderr[-2000:]}
    report["exit"] = out.returncode
    return report


def _standin(work: Path) -> str:
    """Build the Sunrise stand-in (gcc) and describe its node: one device, so the agent's HBM tier is there."""
    sys.path.insert(0, str(REPO / "tests"))
    from sunrise_lib.build import build, node

    lib_dir = build(work / "sunrise-lib")
    os.environ["DAYBREAK_FAKE_SUNRISE"] = node(["0000:12:00.0"], memory_bytes=4 << 30)
    os.environ.pop("DAYBREAK_FAKE_SUNRISE_FAIL", None)
    os.environ["DAYBREAK_SUNRISE_LIB_DIR"] = str(lib_dir)
    return str(lib_dir)


def summarize(saved: dict[str, Any], loaded: dict[str, Any], selfcheck: dict[str, Any], *, cpu: bool,
              seconds: float) -> dict[str, Any]:
    """One JSON object: per tier and piece size the GB/s of save and load against cudaMemcpy, the pipelined
    steps, the selfcheck; ``ok`` is byte-exactness and completion, ``targets`` the issue's speed targets."""
    configs = []
    for s, got in zip(saved["configs"], loaded["configs"], strict=True):
        configs.append({"tier": s["tier"], "piece_bytes": s["piece_bytes"], "bytes": s["bytes"], "keys": s["keys"],
                        "save_gb_per_s": s["save_gb_per_s"], "d2h_gb_per_s": s["d2h_gb_per_s"],
                        "save_vs_memcpy": round(s["save_gb_per_s"] / s["d2h_gb_per_s"], 3),
                        "load_gb_per_s": got["load_gb_per_s"], "h2d_gb_per_s": got["h2d_gb_per_s"],
                        "load_vs_memcpy": round(got["load_gb_per_s"] / got["h2d_gb_per_s"], 3),
                        "byte_exact": got["byte_exact"]})
    saves = [{k: v for k, v in p.items() if k not in ("hashes", "digest")} | {"byte_exact": exact}
             for p, exact in zip(saved["pipeline"], loaded["pipelined_saves_exact"], strict=True)]
    big = [c for c in configs if c["piece_bytes"] >= 2 * MiB]
    ok = (all(c["byte_exact"] for c in configs) and all(p["byte_exact"] for p in saves) and bool(saves)
          and bool(configs))
    return {
        "check": "gpu_check", "mode": "cpu (Sunrise stand-in: code path only, no GPU figures)" if cpu else "gpu",
        "device": saved["device"], "ok": ok, "seconds": round(seconds, 1), "configs": configs,
        "pipelined_saves": saves, "pipelined_loads": loaded["pipeline"],
        "transports": {"save": saved["transports"], "load": loaded["transports"],
                       "fell_back": {"save": saved["fell_back"], "load": loaded["fell_back"]}},
        # The targets, for GPU figures only (None: --cpu, where there are none).
        "targets": None if cpu else {
            "save_load_at_least_0.8_of_memcpy_for_2MiB_pieces": bool(big) and all(
                c["save_vs_memcpy"] >= 0.8 and c["load_vs_memcpy"] >= 0.8 for c in big),
            "pipelined_save_adds_at_most_10pct": bool(saves) and min(p["overhead"] for p in saves) <= 0.10,
        },
        "selfcheck": selfcheck,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the Sunrise stand-in instead of CUDA (no GPU needed)")
    parser.add_argument("--role", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--pieces-kib", default="", help="piece sizes in KiB (default: 2048,8192; --cpu 64,256)")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds, best kept (default 3; --cpu 2)")
    parser.add_argument("--no-selfcheck", action="store_true", help="skip `daybreak selfcheck --json`")
    args = parser.parse_args(argv)
    if args.role:  # a child: the driver already made the tree importable (PYTHONPATH)
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        spec = json.loads(sys.stdin.read())
        result = role_save(spec) if args.role == "save" else role_load(spec)
        print(json.dumps(result))
        return 0
    linktree.prepare(REPO, "gpu_check", [*linktree.SELFCHECK_NEEDS, *(CPU_NEEDS if args.cpu else GPU_NEEDS)])
    started = time.perf_counter()
    plan = CPU_PLAN if args.cpu else GPU_PLAN
    if args.pieces_kib:
        plan = Plan(**{**plan.__dict__, "pieces_kib": tuple(int(p) for p in args.pieces_kib.split(","))})
    if args.rounds:
        plan = Plan(**{**plan.__dict__, "rounds": args.rounds})
    work = Path(tempfile.mkdtemp(prefix="daybreak-gpu-check-"))
    try:
        lib_dir = _standin(work) if args.cpu else ""
        try:
            saved, loaded = _moves(plan, cpu=args.cpu, lib_dir=lib_dir)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return _emit({"check": "gpu_check", "ok": False, "error": str(exc)[-4000:]}, 1)
        selfcheck = {} if args.no_selfcheck else _selfcheck(args.cpu, lib_dir, timeout=90)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(saved, loaded, selfcheck, cpu=args.cpu, seconds=time.perf_counter() - started)
    return _emit(summary, 0 if summary["ok"] else 1)


def _moves(plan: Plan, *, cpu: bool, lib_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A private standalone agent with both tiers; process A saves into it, then process B loads."""
    from daybreak.agent.selfcheck import _PrivateAgent

    agent = _PrivateAgent(dram_bytes=plan.tier_bytes(), hbm_bytes=plan.tier_bytes(),
                          runtime="sunrise" if cpu else "nvidia", sunrise_lib_dir=lib_dir)
    try:
        spec: dict[str, Any] = {"cpu": cpu, "sunrise_lib_dir": lib_dir, "endpoint": agent.address,
                                "token": agent.token, "plan": {**plan.__dict__, "pieces_kib": list(plan.pieces_kib),
                                                               "tiers": list(plan.tiers)}}
        saved = _child("save", spec, timeout=180)
        loaded = _child("load", {**spec, "saved": saved}, timeout=180)
    finally:
        agent.close()  # its /dev/shm segments go with it
    return saved, loaded


def _emit(summary: dict[str, Any], status: int) -> int:
    text = json.dumps(summary, sort_keys=True)
    out = os.environ.get("OUT", "")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.json").write_text(text + "\n")
    print(text, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
