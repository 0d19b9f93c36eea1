"""``DaybreakConnector``: vLLM's ``KVConnectorBase_V1`` on a Daybreak KV pool (prefix blocks shared across engines).

Load it with ``--kv-transfer-config '{"kv_connector": "DaybreakConnector",
"kv_connector_module_path": "daybreak.connectors.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"endpoints": ["host:port"], "token_file": F, "namespace": NS}}'``
(the extra config falls back to the operator's ``DAYBREAK_*`` environment;
see ``daybreak.connectors.blocks.PoolSettings``). In an operator's pod the
agents come from the KVPool's published ``status.endpoints``, read once at
start through the Kubernetes API (``DAYBREAK_POOL_REF``; the client learns the
rest of the pool from them), so no cluster DNS is needed. Roles: ``kv_producer``
(prefill: saves, never loads), ``kv_consumer`` (decode: loads, never saves),
``kv_both``.

Scheduler side: ``get_num_new_matched_tokens`` asks the pool, in one batched
exists, which leading full prompt blocks it holds beyond the engine's own
prefix cache; once vLLM has allocated blocks, the load (pool -> those blocks)
and, step by step as prefill completes blocks, the saves (blocks -> pool) go
into the step's metadata. Worker side, layer by layer on one I/O thread
(``daybreak.connectors.blocks.LayerPipeline``): ``start_load_kv`` starts one
``batch_get_into`` per layer straight into the KV tensors' block pieces and each
attention layer waits for its own (``wait_for_layer_load``); ``save_kv_layer``
starts a layer's ``batch_put`` from the same pieces as soon as the layer has
run, and ``wait_for_save`` waits for them all (``BlockMover`` does the moves). On
an accelerator the I/O thread has its own CUDA stream and is ordered against the
forward pass by one event per layer (a save waits for its layer's kernels, the
forward pass's stream for a layer's load). No intermediate copies: host KV
caches move through same-node agents' shared-memory segments (one memcpy each
way); device KV caches through the pod's transfer engine (below).

KV layouts: the ``KVCacheLayout`` vLLM's engine core resolved for the
attention backend (``KVCacheConfig.kv_cache_layout``: ``LBHNC`` on the CPU
backend, ``LBNHC``, ``LHBNC``, ``BLHNC``... on GPU backends) says where a
block's bytes are: one piece per layer, or one per head slot when another
dim lies between the head slots and the tokens. It is part of the key fingerprint (with the
platform: CPU and GPU engines never share keys), and ``register_kv_caches`` checks every tensor's
real strides against it.

Device KV caches: on an accelerator the worker builds the pod's transfer engine
(``blocks.pod_engine``: the platform's runtime through
``daybreak.agent.runtime.load_runtime``, the engine from the pod's contract through
``daybreak.client.datapath.engine_for_pod``), hands it to its pool client and
closes it at shutdown; the client moves each block piece as a ``DeviceRef`` by
the path the agent allows (device link into an HBM tier, DMA into a DRAM
segment, GPUDirect rdma). A runtime that does not load makes
``register_kv_caches`` fail naming it. ``tier: hbm`` in the extra config keeps
saved blocks in the agents' HBM tier. On CPU nothing of this runs.

A load that misses or fails reports its blocks through
``get_block_ids_with_load_errors`` and vLLM recomputes them (the connector
sets ``kv_load_failure_policy`` to ``recompute`` unless ``on_load_error`` in
the extra config says ``fail``): a pool problem costs time, never wrong KV.
A failed save only costs a future miss.

THE POOL CLIENT IS NOT THREAD-SAFE: each side (scheduler, worker) owns one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from daybreak.client import KVPoolClient, KVPoolError, pool_tls_ca_file
from daybreak.connectors.blocks import (
    BlockMover,
    BlockTransfer,
    BlockViews,
    ConnectorConfigError,
    EngineLayout,
    KVMemory,
    LayerPipeline,
    Moved,
    PodEngine,
    PoolSettings,
    RequestTracker,
    block_keys,
    check_layout,
    layer_region,
    layer_sync,
    leading_hits,
    loadable_blocks,
    pod_engine,
    require_device_path,
    save_tier,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """vLLM configures handlers for its own loggers only: send ours to the same place, once."""
    ours = logging.getLogger(__name__.partition(".")[0])  # the package root: every daybreak logger
    if not ours.handlers:
        theirs = logging.getLogger("vllm")
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


@dataclass
class DaybreakConnectorMetadata(KVConnectorMetadata):
    """One step's work, scheduler -> worker: blocks to load before the forward pass and to save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def _kv_cache_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """The KVCacheLayout name vLLM's engine core resolved (every worker adopts it with the KV cache config)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    if not name:
        raise ConnectorConfigError("vLLM has not resolved a KV cache layout (KVCacheConfig.kv_cache_layout is unset), "
                                   "so the connector cannot tell where a block's bytes are")
    return str(name)


def _engine_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, tp_rank: int) -> EngineLayout:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConnectorConfigError(f"the model has {len(groups)} KV cache groups (hybrid attention); the Daybreak "
                                   "connector supports models with one group of full-attention layers")
    spec = groups[0].kv_cache_spec
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_v != spec.head_size:
        raise ConnectorConfigError(f"K and V head sizes differ ({spec.head_size} vs {head_v}): not supported")
    return EngineLayout(
        platform="cpu" if current_platform.is_cpu() else str(current_platform.device_type),
        block_tokens=int(spec.block_size), num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size),
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_layout=_kv_cache_layout(vllm_config, kv_cache_config),
        head_slots=int(spec.num_heads), content_bytes=int(spec.state_content_size_bytes),
        tp_rank=tp_rank, tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
    )


class DaybreakConnector(KVConnectorBase_V1):
    """vLLM KV connector that loads prompt prefix blocks from, and saves them to, a Daybreak pool."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        transfer = self._kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        self._settings = PoolSettings.resolve(extra)
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self._layout = _engine_layout(vllm_config, kv_cache_config, tp_rank=tp_rank)
        check_layout(self._settings.layout, self._layout)
        self._fingerprint = self._layout.fingerprint()
        self._loads = transfer.kv_role in ("kv_consumer", "kv_both")
        self._saves = transfer.kv_role in ("kv_producer", "kv_both")
        if role == KVConnectorRole.SCHEDULER:
            policy = str(extra.get("on_load_error", "recompute"))
            if policy not in ("recompute", "fail"):
                raise ConnectorConfigError(f"on_load_error must be 'recompute' or 'fail', got {policy!r}")
            # vLLM's default fails the request on a load error; a cache miss must only cost time.
            transfer.kv_load_failure_policy = policy
        self._tier = save_tier(extra.get("tier"))
        # The worker's KV cache is on the accelerator vLLM runs on: device memory moves only through a transfer
        # engine with that platform's runtime. The scheduler only asks which blocks exist: no engine.
        self._pod = (pod_engine(self._settings, platform=self._layout.platform)
                     if role == KVConnectorRole.WORKER else PodEngine())
        try:
            self._client = KVPoolClient(list(self._settings.endpoints), token=self._settings.token,
                                        namespace=self._settings.namespace, tls_ca_file=pool_tls_ca_file(),
                                        transport=self._settings.client_transport,
                                        transports=self._settings.transports or None, engine=self._pod.engine)
        except BaseException:
            self._pod.close()
            raise
        # scheduler side
        self._trackers: dict[str, RequestTracker] = {}
        # request id -> (first block to load, blocks loadable from it, leading blocks in the pool) of the last lookup
        self._lookups: dict[str, tuple[int, int, int]] = {}
        # worker side
        self._kv_tensors: list[torch.Tensor] = []
        self._load_errors: set[int] = set()
        # Layer by layer: the worker's pool I/O runs on the pipeline's one thread, in submission order, and
        # only there (the client is not thread-safe); the forward pass waits per layer.
        self._pipeline: LayerPipeline | None = None
        self._layer_index: dict[str, int] = {}
        self._loaded: list[Moved] = []
        self._waited = 0  # layers of the current loads the forward pass waited for (the rest: after it)
        self._load_started = 0.0
        self._save_started = 0.0
        log.info("event=connector_ready role=%s kv_role=%s namespace=%s layout=%s fingerprint=%s endpoints=%s "
                 "pool_ref=%s transfer_engine=%s", role.name, transfer.kv_role, self._settings.namespace, self._layout,
                 self._fingerprint, ",".join(self._settings.endpoints), self._settings.pool_ref or "-",
                 ",".join(self._pod.engine.transports) if self._pod.engine is not None else
                 (f"none ({self._pod.missing})" if self._pod.missing else "none"))

    # -- scheduler side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose KV the pool holds (leading full prompt blocks).

        One batched exists over every loadable prompt block, also the ones the
        engine's own prefix cache holds: blocks already in the pool are never
        saved again. A producer looks up too (for that) but loads nothing.
        """
        bs = self._layout.block_tokens
        hashes = list(request.block_hashes)
        end = min(loadable_blocks(len(request.prompt_token_ids or ()), bs), len(hashes))
        start = num_computed_tokens // bs
        if end <= 0 or num_computed_tokens % bs:
            return 0, False
        per_block = self._layout.num_layers * self._layout.regions_per_layer
        try:
            found = self._client.batch_exists(block_keys(self._fingerprint, hashes[:end], self._layout.num_layers,
                                                         self._layout.regions_per_layer))
        except (KVPoolError, OSError) as exc:
            log.warning("event=lookup_failed request=%s error=%r action=compute", request.request_id, exc)
            return 0, False
        present = [all(found[i * per_block:(i + 1) * per_block]) for i in range(end)]
        hits = leading_hits(present, start=start) if self._loads else 0
        self._lookups[request.request_id] = (start, hits, leading_hits(present, start=0))
        return hits * bs, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Remember the request's blocks; plan the load of the ``num_external_tokens`` vLLM accepted."""
        tracker = self._tracker(request)
        tracker.block_ids = list(blocks.get_block_ids()[0])
        start, hits, in_pool = self._lookups.pop(request.request_id, (0, 0, 0))
        tracker.in_pool = max(tracker.in_pool, in_pool)
        if num_external_tokens > 0:
            count = min(num_external_tokens // self._layout.block_tokens, hits)
            tracker.plan_load(first_block=start, count=count)
            tracker.in_pool = max(tracker.in_pool, start + count)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (planned at allocation) and the prompt blocks this step completes."""
        meta = DaybreakConnectorMetadata()
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new.req_id)
            if tracker is None:
                continue
            tracker.block_ids = list(new.block_ids[0])
            self._plan(meta, tracker, computed=new.num_computed_tokens + steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: its blocks were freed and reallocated from scratch.
                tracker.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracker.block_ids.extend(new_ids[0])
            self._plan(meta, tracker, computed=cached.num_computed_tokens[i] + steps.get(req_id, 0))
        return meta

    def _plan(self, meta: DaybreakConnectorMetadata, tracker: RequestTracker, *, computed: int) -> None:
        load = tracker.take_load()
        if load is not None:
            meta.loads.append(load)
        if self._saves:
            save = tracker.plan_save(computed_tokens=computed)
            if save is not None:
                meta.saves.append(save)

    def _tracker(self, request: Request) -> RequestTracker:
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            tracker = RequestTracker(request_id=request.request_id,
                                     prompt_tokens=len(request.prompt_token_ids or ()),
                                     block_tokens=self._layout.block_tokens, block_hashes=request.block_hashes)
            self._trackers[request.request_id] = tracker
        return tracker

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves completed in the step that computed the blocks, so free them now."""
        self._trackers.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None

    # -- worker side --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map each layer's paged KV tensor (host or device memory, the backend's layout) to the pieces of its
        blocks; device memory needs the pod's transfer engine with the platform's runtime."""
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ConnectorConfigError(f"KV caches of layers {missing[:3]} were not registered")
        regions = []
        memories = set()
        for name in names:
            tensor = kv_caches[name]
            if not isinstance(tensor, torch.Tensor):
                raise ConnectorConfigError(f"layer {name}: KV cache is a {type(tensor).__name__}, not one tensor")
            memory = KVMemory.parse(str(tensor.device))
            device = require_device_path(name, memory, self._pod.engine, missing=self._pod.missing)
            memories.add(memory)
            regions.append(layer_region(name, address=tensor.data_ptr(), shape=tuple(tensor.shape),
                                        strides=tuple(tensor.stride()), itemsize=tensor.element_size(),
                                        layout=self._layout, num_blocks=self._kv_cache_config.num_blocks,
                                        device=device))
            self._kv_tensors.append(tensor)  # keeps the memory the views point into alive
        if len(memories) != 1:
            raise ConnectorConfigError(f"KV cache layers are spread over {sorted(map(str, memories))}: the "
                                       "connector moves one device's (or host memory's) KV cache per worker")
        views = BlockViews(regions)
        mover = BlockMover(views, fingerprint=self._fingerprint, errors=(KVPoolError, OSError, ValueError),
                           tier=self._tier)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._pipeline = LayerPipeline(mover, self._client, sync=layer_sync(memories.pop()))
        log.info("event=kv_caches_registered layers=%d blocks=%d block_bytes=%d pieces=%d kv_layout=%s memory=%s "
                 "tier=%s", len(regions), regions[0].num_blocks, regions[0].layout.block_bytes,
                 views.pieces_per_layer, self._layout.kv_layout, tensor.device, self._tier)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start loading this step's planned blocks from the pool into the KV tensors, one batch per layer.

        The loads run in layer order on the I/O thread while the forward pass
        starts; ``wait_for_layer_load`` holds each attention layer until its own
        layer has arrived.
        """
        self._finish_loads()  # a layer nobody waited for in the last step
        meta = self._get_connector_metadata()
        if not isinstance(meta, DaybreakConnectorMetadata) or not meta.loads or self._pipeline is None:
            return
        self._load_started = time.perf_counter()
        self._pipeline.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer's pieces of the step's loads are in the KV tensor (or failed)."""
        if self._pipeline is None:
            return
        moved = self._pipeline.wait_load(self._layer_index.get(layer_name, -1))
        if moved is not None:
            self._took(moved)
            self._waited += 1
        if not self._pipeline.loading and self._loaded:
            self._log_loads()

    def _took(self, moved: Moved) -> None:
        if moved.error:
            log.warning("event=load_failed keys=%d error=%s action=recompute", moved.keys, moved.error)
        self._load_errors |= moved.failed
        self._loaded.append(moved)

    def _finish_loads(self) -> None:
        if self._pipeline is not None:
            for moved in self._pipeline.finish_loads():
                self._took(moved)
        if self._loaded:
            self._log_loads()

    def _log_loads(self) -> None:
        failed = set().union(*(m.failed for m in self._loaded))
        log.info("event=loaded blocks=%d failed=%d bytes=%d seconds=%.4f layers_waited=%d/%d", self._loaded[0].blocks,
                 len(failed), sum(m.done for m in self._loaded), time.perf_counter() - self._load_started,
                 self._waited, len(self._loaded))
        self._loaded = []
        self._waited = 0

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving this layer's pieces of the blocks this step completes, as soon as the layer has run."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        layer = self._layer_index.get(layer_name)
        if (not isinstance(meta, DaybreakConnectorMetadata) or not meta.saves or self._pipeline is None
                or layer is None):
            return
        if not self._pipeline.saving:
            self._save_started = time.perf_counter()
        self._pipeline.save_layer(layer, meta.saves)

    def wait_for_save(self) -> None:
        """Wait for this step's saves; layers the forward pass did not report are saved now, in one batch."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, DaybreakConnectorMetadata) or not meta.saves or self._pipeline is None:
            return
        if not self._pipeline.saving:
            self._save_started = time.perf_counter()
        moved = self._pipeline.finish_saves(meta.saves)
        errors = [m.error for m in moved if m.error]
        if errors:
            log.warning("event=save_failed keys=%d error=%s action=none", sum(m.keys for m in moved), errors[0])
        log.info("event=saved blocks=%d stored_keys=%d/%d layers_batches=%d seconds=%.4f", moved[0].blocks,
                 sum(m.done for m in moved), sum(m.keys for m in moved), len(moved),
                 time.perf_counter() - self._save_started)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load missed or failed since the last call; vLLM recomputes them."""
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
        self._client.close()
        self._pod.close()  # the engine and runtime after the client that used them


def prompt_keys(token_ids: list[int], *, fingerprint: str, block_tokens: int, num_layers: int,
                hash_algo: str = "sha256", pieces: int = 1) -> list[str]:
    """The pool keys the connector uses for a plain-text prompt's full blocks (no LoRA, no images, no salt).

    Computed with vLLM's own block hash, as its scheduler does; for inspecting
    or pinning what a prompt left in the pool.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, token_ids[start:start + block_tokens], None)
        hashes.append(bytes(parent))
    return block_keys(fingerprint, hashes, num_layers, pieces)


def main(argv: list[str] | None = None) -> int:
    """``python -m daybreak.connectors.vllm keys ...``: a prompt's pool keys (token ids as JSON on stdin)."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m daybreak.connectors.vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    keys = sub.add_parser("keys", help="print the pool keys of a prompt's full blocks (JSON list)")
    keys.add_argument("--fingerprint", required=True, help="the connector's layout fingerprint (in its log)")
    keys.add_argument("--block-tokens", type=int, required=True)
    keys.add_argument("--layers", type=int, required=True)
    keys.add_argument("--hash-algo", default="sha256", help="vLLM's --prefix-caching-hash-algo")
    keys.add_argument("--pieces", type=int, default=1, help="pieces per block and layer (in the connector's log)")
    args = parser.parse_args(argv)
    tokens = json.load(sys.stdin)
    print(json.dumps(prompt_keys([int(t) for t in tokens], fingerprint=args.fingerprint,
                                 block_tokens=args.block_tokens, num_layers=args.layers, hash_algo=args.hash_algo,
                                 pieces=args.pieces)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
