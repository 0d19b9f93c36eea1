"""What the vLLM connector decides and does without vLLM: settings, layouts, block keys, load/save plans, moves.

Kept apart from ``daybreak.connectors.vllm`` so that it imports (and is unit
tested) without vLLM or torch installed. The connector itself is a thin
adapter from vLLM's scheduler and worker hooks onto these pieces.

Layouts. vLLM (0.32) keeps every attention layer's paged KV cache as a view
``[B, H, N, C]`` (blocks, head slots, tokens, content bytes: K and V side by
side) of one allocation whose five dims ``[L, B, H, N, C]`` lie in memory in
the order the resolved ``KVCacheLayout`` names (``LBHNC`` on the CPU backend;
GPU backends register ``LBNHC``, ``LHBNC``, ``BLHNC``, ...). A block of one
layer is then one contiguous piece (B outside H: ``LBHNC``, ``BLNHC``) or one
piece per head slot (H outside B: ``LHBNC``, ``BHLNC``). ``block_regions``
finds the pieces from a tensor's real strides; ``layer_region`` refuses a
tensor that does not hold the layout its keys claim.

Keys. One pool key per (block, layer, piece), so every piece moves zero-copy
(``batch_get_into`` lands in the KV tensor itself and ``batch_put`` reads from
it; all pieces of all blocks of a step go in one batch, no staging copy). A key
is ``vllm-<fingerprint>-<block hash>-<layer>`` for one-piece layouts and
``...-<layer>-<piece>`` for the others: the block hash is vLLM's own chained
prefix hash (stable across processes), and the fingerprint digests the byte
layout the engine really has (platform, KVCacheLayout, page geometry, block
size, dtype, tensor-parallel rank), so engines whose blocks are not
byte-compatible (CPU and GPU, or two layouts) never read each other's bytes even
if they were given the same namespace.

Memory. KV tensors in host memory move as memoryviews of their pieces; KV
tensors in device memory (``cuda:N``, a Sunrise device) as ``DeviceRef``s of the
same pieces, which the pool client moves through its transfer engine (the
device link into an agent's HBM tier, a DMA into its DRAM segment, GPUDirect
rdma), one scatter-gather batch per step and layer, never through a staging copy
on the engine's side. ``pod_engine`` builds that engine in an engine pod and
``require_device_path`` refuses device memory it cannot move. ``LayerPipeline``
runs the moves layer by layer on one I/O thread, ordered against the forward
pass on the device by a ``LayerSync`` (CUDA streams and events through torch).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from daybreak.api.enginepod import EnginePodEnv, EnginePodEnvError
from daybreak.api.kvcompat import KVDtype, KVLayout, KVPlatform
from daybreak.client.datapath import DeviceRef
from daybreak.client.env import read_pool_token
from daybreak.errors import DaybreakError


class ConnectorConfigError(DaybreakError, ValueError):
    """The connector's configuration is missing or contradicts the engine; the message says what to fix."""


# -- pool settings ------------------------------------------------------------------------------------

class Discover(Protocol):
    """``daybreak.client.discovery.discover_pool_endpoints``'s shape: ``NS/NAME`` -> ``host:port`` list."""

    def __call__(self, pool_ref: str, /, *, timeout_seconds: float, kubeconfig: str | None) -> list[str]: ...


# How long an engine waits for its KVPool to publish an agent: the kubelet restarts a pod that gives up.
DISCOVERY_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class PoolSettings:
    """Where the pool is and which namespace this engine's blocks live in."""

    endpoints: tuple[str, ...]
    token: str = field(repr=False)
    namespace: str
    layout: KVLayout | None = None
    """The deployment's declared kvLayout, checked against the engine's real one when given."""
    pool_ref: str = ""
    """The KVPool (``NS/NAME``) whose published endpoints these are; empty when they were given directly."""

    transports: tuple[str, ...] = ()
    """The pool's transports, most preferred first (``DAYBREAK_TRANSPORTS``); empty: all."""

    @property
    def client_transport(self) -> Literal["auto", "tcp"]:
        """``KVPoolClient``'s transport: shared memory with same-node agents only when the pool allows shm."""
        return "auto" if not self.transports or "shm" in self.transports else "tcp"

    @classmethod
    def resolve(cls, extra: Mapping[str, Any], env: Mapping[str, str] | None = None, *,
                discover: Discover | None = None) -> PoolSettings:
        """From ``kv_connector_extra_config`` first, then the operator's engine-pod contract
        (``api.enginepod.EnginePodEnv``, parsed from ``env``, by default ``os.environ``).

        extra: ``endpoints`` (list or comma string), ``pool_ref`` (``NS/NAME``),
        ``discovery_timeout_seconds``, ``token`` or ``token_file``, ``namespace``, ``kv_layout``
        (dict or JSON). Environment: the contract's ``DAYBREAK_POOL_REF``, ``DAYBREAK_POOL_ENDPOINTS``,
        ``DAYBREAK_POOL_TOKEN`` / ``DAYBREAK_POOL_TOKEN_FILE``, ``DAYBREAK_KV_NAMESPACE``, ``DAYBREAK_KV_LAYOUT``,
        ``DAYBREAK_TRANSPORTS``, and ``KUBECONFIG`` for the API. The credential follows every engine's one
        precedence (``client.env.read_pool_token``): a token or token file in ``extra`` replaces the
        environment's, and within one source the file wins.

        Endpoints: ``extra.endpoints`` as given; else the KVPool named by ``pool_ref`` /
        ``DAYBREAK_POOL_REF``, whose ``status.endpoints`` are read through the Kubernetes API
        (``discover``, by default ``daybreak.client.discovery.discover_pool_endpoints``, waiting up to
        ``discovery_timeout_seconds`` for the pool to publish an agent); else
        ``DAYBREAK_POOL_ENDPOINTS`` (the agents' headless Service, which needs cluster DNS). Everything
        else is checked before the pool is looked up, so a bad setting fails at once.
        """
        env = os.environ if env is None else env
        try:
            pod = EnginePodEnv.from_env(env)
        except EnginePodEnvError as exc:
            raise ConnectorConfigError(str(exc)) from None
        token = _token(extra, pod)
        namespace = str(extra.get("namespace") or pod.kv_namespace).strip()
        if not namespace:
            raise ConnectorConfigError("no kvNamespace: set kv_connector_extra_config.namespace "
                                       "or DAYBREAK_KV_NAMESPACE")
        raw_layout = extra.get("kv_layout")
        layout = pod.kv_layout
        if raw_layout:
            try:
                layout = KVLayout.model_validate(json.loads(raw_layout) if isinstance(raw_layout, str)
                                                 else raw_layout)
            except ValueError as exc:
                raise ConnectorConfigError(f"kv_layout is not a valid kvLayout: {exc}") from exc
        endpoints = _endpoints(extra.get("endpoints"))
        pool_ref = ""
        if not endpoints:
            pool_ref = str(extra.get("pool_ref") or pod.pool_ref).strip()
        if pool_ref:
            timeout = _seconds(extra.get("discovery_timeout_seconds", DISCOVERY_TIMEOUT_SECONDS))
            if discover is None:
                from daybreak.client import discovery  # here only: it loads the Kubernetes client

                discover = discovery.discover_pool_endpoints
            endpoints = tuple(discover(pool_ref, timeout_seconds=timeout, kubeconfig=env.get("KUBECONFIG", "")))
        elif not endpoints:
            endpoints = tuple(pod.pool_endpoints)
        if not endpoints:
            raise ConnectorConfigError("no pool endpoints: set kv_connector_extra_config.endpoints "
                                       "(['host:port', ...]), DAYBREAK_POOL_REF (NS/NAME of the KVPool) "
                                       "or DAYBREAK_POOL_ENDPOINTS")
        return cls(endpoints=endpoints, token=token, namespace=namespace, layout=layout, pool_ref=pool_ref,
                   transports=tuple(pod.transports))


def save_tier(raw: Any) -> Literal["dram", "hbm"]:
    """``kv_connector_extra_config.tier``: where saved blocks live, ``dram`` (default) or ``hbm`` (agents'
    device-memory tier; blocks from device KV caches reach it over the device link)."""
    value = str(raw or "dram").strip().lower()
    if value == "dram":
        return "dram"
    if value == "hbm":
        return "hbm"
    raise ConnectorConfigError(f"tier must be 'dram' or 'hbm', got {raw!r}")


def _endpoints(raw: Any) -> tuple[str, ...]:
    if not raw:
        return ()
    if isinstance(raw, str):
        raw = raw.split(",")
    if not isinstance(raw, Sequence):
        raise ConnectorConfigError(f"endpoints must be a list of host:port strings, got {raw!r}")
    return tuple(str(e).strip() for e in raw if str(e).strip())


def _seconds(raw: Any) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0:
        raise ConnectorConfigError(f"discovery_timeout_seconds must be a positive number of seconds, got {raw!r}")
    return value


def _token(extra: Mapping[str, Any], pod: EnginePodEnv) -> str:
    """The one precedence (``client.env.read_pool_token``): extra's pair if it gives one, else the env's."""
    if extra.get("token") or extra.get("token_file"):
        token, file, source = str(extra.get("token") or ""), str(extra.get("token_file") or ""), "token_file"
    else:
        token, file, source = pod.pool_token, pod.pool_token_file, "$DAYBREAK_POOL_TOKEN_FILE"
    try:
        value = read_pool_token(token=token, token_file=file, source=source)
    except EnginePodEnvError as exc:
        raise ConnectorConfigError(str(exc)) from None
    if not value:
        raise ConnectorConfigError("no pool token: set kv_connector_extra_config.token_file (or token) "
                                   "or DAYBREAK_POOL_TOKEN")
    return value


# -- layout -------------------------------------------------------------------------------------------

# vLLM's KV cache dims (RFC #42082): [L, B, H, N, C] = layers, blocks, head slots, tokens, content bytes.
# A KVCacheLayout's name spells them in memory order, outermost first (LBHNC, LBNHC, LHBNC, BLHNC, ...).
KV_DIMS = "LBHNC"
_LAYER = 0
# Blocks in the layout used to work out one block's pieces (more than one: see EngineLayout.regions).
_SAMPLE_BLOCKS = 7
# A block scattered over more pieces than this per layer is refused: each piece is a key and a request.
MAX_REGIONS = 64


def layout_order(name: str) -> tuple[int, ...]:
    """A vLLM ``KVCacheLayout`` name as its stride order: the logical ``[L, B, H, N, C]`` dims in memory order."""
    if len(name) != len(KV_DIMS) or sorted(name) != sorted(KV_DIMS) or not name.endswith("C"):
        raise ConnectorConfigError(f"KV cache layout {name!r} is not a vLLM KVCacheLayout name (a permutation of "
                                   f"{KV_DIMS} ending in C, such as LBHNC or BLNHC)")
    return tuple(KV_DIMS.index(dim) for dim in name)


@dataclass(frozen=True)
class BlockRegions:
    """Where one block's bytes are in one layer's tensor: ``(offset, length)`` pieces from block 0's address."""

    regions: tuple[tuple[int, int], ...]
    """In memory order; block ``i``'s pieces are at ``address + i * block_stride + offset``."""
    block_stride: int
    """Bytes from one block to the next."""

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(length for _, length in self.regions)

    @property
    def block_bytes(self) -> int:
        return sum(self.lengths)

    def extent(self, num_blocks: int) -> int:
        """Bytes from the tensor's address to the end of its last block's last piece."""
        if num_blocks <= 0:
            return 0
        return (num_blocks - 1) * self.block_stride + max(off + length for off, length in self.regions)


def block_regions(shape: Sequence[int], strides: Sequence[int], *, block_dim: int, itemsize: int) -> BlockRegions:
    """The byte pieces of one block of a strided tensor: its other dims, the innermost contiguous ones merged.

    ``strides`` are in elements (torch's ``stride()``). A layout whose block dim is
    outside the head dim but inside the layer dim (LBHNC) gives one piece per
    block and layer; one with the heads outside the blocks (LHBNC), one piece per
    head slot.
    """
    if len(shape) != len(strides) or not 0 <= block_dim < len(shape):
        raise ValueError(f"shape {tuple(shape)}, strides {tuple(strides)} and block dim {block_dim} do not agree")
    dims = sorted(((shape[d], strides[d]) for d in range(len(shape)) if d != block_dim and shape[d] != 1),
                  key=lambda sd: sd[1], reverse=True)
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    count = 1
    for size, _ in dims:
        count *= size
    if count > MAX_REGIONS:
        raise ConnectorConfigError(f"KV cache strides {tuple(strides)} of shape {tuple(shape)} scatter one block over "
                                   f"{count} pieces of {run * itemsize} bytes (at most {MAX_REGIONS} are moved)")
    offsets = sorted(sum(i * stride for i, (_, stride) in zip(index, dims, strict=True))
                     for index in itertools.product(*(range(size) for size, _ in dims)))
    return BlockRegions(regions=tuple((off * itemsize, run * itemsize) for off in offsets),
                        block_stride=strides[block_dim] * itemsize)


@dataclass(frozen=True)
class EngineLayout:
    """The KV layout a running engine really has (read from its config and checked against its KV tensors)."""

    platform: str
    """``cpu`` or the accelerator platform's name (``cuda``, ...)."""
    block_tokens: int
    num_layers: int
    num_kv_heads: int
    """KV heads held by this rank's tensors."""
    head_dim: int
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``bfloat16``)."""
    kv_layout: str
    """vLLM's resolved ``KVCacheLayout`` name: the ``[L, B, H, N, C]`` dims in memory order (``LBHNC``)."""
    head_slots: int
    """H of a page: the KV heads, unless the attention backend packs them into other slots."""
    content_bytes: int
    """C of a page: bytes per (head slot, token) cell; K and V side by side, ``(head + head_v) * dtype size``."""
    tp_rank: int = 0
    tp_size: int = 1
    kv_split: bool = False
    """K and V in two planes of each layer's own tensor instead of side by side in C: FlashAttention's
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (``layer_region`` takes that shape). A block is then
    its K pieces and its V pieces a plane apart (two pieces per layer in ``LBNHC``); ``kv_layout`` orders each
    plane's ``B, H, N`` dims (its ``L`` is moot: every layer is its own tensor)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ConnectorConfigError(f"KV cache dtype {self.dtype} is not supported by the Daybreak connector")
        layout_order(self.kv_layout)
        if self.kv_split and self.content_bytes % 2:
            raise ConnectorConfigError(f"K/V split layout with {self.content_bytes} content bytes per cell: K and V "
                                       "halves must be the same size")

    @property
    def itemsize(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def layer_view(self, *, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(shape, strides)`` in bytes of one layer's ``[B, H, N, C]`` view, allocated as vLLM allocates it.

        vLLM lays the five dims out contiguous in the layout's order (pages
        unpadded), then views each layer: so with L inside B (BLHNC) a block
        holds every layer's page, and with H outside B (LHBNC) a block's head
        slots lie a whole plane apart. With ``kv_split`` the view is
        ``[2, B, H, N, C/2]``: the K plane, then the V plane, of one layer's tensor.
        """
        if self.kv_split:
            page = (num_blocks, self.head_slots, self.block_tokens, self.content_bytes // 2)
            strides = [0] * 4
            step = 1
            for dim in reversed([d - 1 for d in layout_order(self.kv_layout) if d != _LAYER]):
                strides[dim] = step
                step *= page[dim]
            return (2, *page), (step, *strides)
        shape = (self.num_layers, num_blocks, self.head_slots, self.block_tokens, self.content_bytes)
        strides = [0] * len(shape)
        step = 1
        for dim in reversed(layout_order(self.kv_layout)):
            strides[dim] = step
            step *= shape[dim]
        return shape[1:], tuple(strides[1:])

    @property
    def block_dim(self) -> int:
        """The block dim of ``layer_view`` (1 behind the K/V plane dim of a split layout)."""
        return 1 if self.kv_split else 0

    def regions(self, *, num_blocks: int = _SAMPLE_BLOCKS) -> BlockRegions:
        """One block's pieces in one layer's view of ``num_blocks`` blocks (in bytes).

        More than one block: with a single block, head slots outside the block dim
        would look adjacent and merge into one piece.
        """
        shape, strides = self.layer_view(num_blocks=num_blocks)
        return block_regions(shape, strides, block_dim=self.block_dim, itemsize=1)

    @property
    def regions_per_layer(self) -> int:
        """Pool keys per block and layer: one per piece of the block in the layer's tensor."""
        return len(self.regions().regions)

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block in one layer: every head slot, token and content byte of it."""
        return self.head_slots * self.block_tokens * self.content_bytes

    def fingerprint(self) -> str:
        """12 hex digits over everything that fixes the meaning of a block's bytes."""
        fields = dict(self.__dict__)
        if not fields["kv_split"]:
            del fields["kv_split"]  # added later: unset, it leaves the keys engines already wrote unchanged
        body = json.dumps({"engine": "vllm", **fields}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:12]


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "uint8": 1, "int8": 1}
# kvLayout dtype names -> torch's
_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"}


def check_layout(declared: KVLayout | None, actual: EngineLayout) -> None:
    """Refuse to run when the deployment's kvLayout does not describe the engine's real KV blocks.

    A mismatch means every block would be stored under a kvNamespace that
    promises bytes it does not hold; the error names both values and the fix.
    """
    if declared is None:
        return
    if declared.block_tokens != actual.block_tokens:
        raise ConnectorConfigError(
            f"vLLM's block size is {actual.block_tokens} tokens but the deployment's kvLayout.blockTokens is "
            f"{declared.block_tokens}: start vLLM with --block-size {declared.block_tokens} or set "
            f"kvLayout.blockTokens: {actual.block_tokens}")
    checks = [
        ("numLayers", declared.num_layers, actual.num_layers),
        ("numKVHeads", declared.num_kv_heads, actual.num_kv_heads * actual.tp_size),
        ("headDim", declared.head_dim, actual.head_dim),
        ("dtype", _DTYPE_NAMES[KVDtype(declared.dtype).value], actual.dtype),
    ]
    for name, want, have in checks:
        if want != have:
            raise ConnectorConfigError(f"the deployment's kvLayout.{name} is {want} but the engine's KV cache has "
                                       f"{have}: fix kvLayout.{name} (it is part of kvNamespace)")
    want_platform = KVPlatform(declared.platform).value if declared.platform else None
    have_platform = KVPlatform.CPU.value if actual.platform == "cpu" else None
    if want_platform != have_platform:
        raise ConnectorConfigError(
            f"the engine runs on {actual.platform} but the deployment's kvLayout.platform is "
            f"{want_platform or 'unset (the accelerator layout)'}: "
            + ("set kvLayout.platform: cpu (CPU blocks are not byte-compatible with CUDA blocks)"
               if have_platform else "remove kvLayout.platform"))


def block_key(fingerprint: str, block_hash: bytes, layer: int, region: int | None = None) -> str:
    """The pool key of one layer of one block (of one of its pieces, for layouts that split a block)."""
    key = f"vllm-{fingerprint}-{block_hash.hex()}-{layer}"
    return key if region is None else f"{key}-{region}"


def block_keys(fingerprint: str, block_hashes: Sequence[bytes], num_layers: int, regions: int = 1, *,
               layers: Sequence[int] | None = None) -> list[str]:
    """Keys of every piece of every layer (or of ``layers``) of every block, block-major (``BlockViews.views``' order)."""
    pieces: list[int | None] = [None] if regions == 1 else list(range(regions))
    chosen = range(num_layers) if layers is None else layers
    return [block_key(fingerprint, h, layer, r) for h in block_hashes for layer in chosen for r in pieces]


# -- scheduler-side planning --------------------------------------------------------------------------

def loadable_blocks(num_prompt_tokens: int, block_tokens: int) -> int:
    """Full blocks of a prompt that may come from the pool: the last prompt token is always computed
    (the engine needs its logits), so a prompt of exactly k blocks may load at most k - 1."""
    return max(0, num_prompt_tokens - 1) // block_tokens


def leading_hits(present: Sequence[bool], *, start: int) -> int:
    """How many blocks from index ``start`` on are all present, stopping at the first miss."""
    count = 0
    for hit in present[start:]:
        if not hit:
            break
        count += 1
    return count


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move between the pool and the engine's KV cache (same length lists)."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass
class RequestTracker:
    """Scheduler-side state of one request: its KV block ids and which prompt blocks are saved."""

    request_id: str
    prompt_tokens: int
    block_tokens: int
    block_hashes: Sequence[bytes]
    """vLLM's hashes of the request's full blocks (the request's own list, which grows as it runs)."""
    block_ids: list[int] = field(default_factory=list)
    in_pool: int = 0
    """Leading prompt blocks known to be in the pool (loaded or found): never saved again."""
    saved: int = 0
    """Leading prompt blocks saved or planned for saving."""
    load: BlockTransfer | None = None

    def plan_load(self, *, first_block: int, count: int) -> None:
        """Load ``count`` blocks from ``first_block`` on (called once the engine allocated blocks)."""
        end = first_block + count
        if count <= 0:
            return
        if end > len(self.block_ids) or end > len(self.block_hashes):
            raise ValueError(f"request {self.request_id}: load of blocks {first_block}..{end} past the "
                             f"{len(self.block_ids)} allocated / {len(self.block_hashes)} hashed blocks")
        self.load = BlockTransfer(self.request_id, tuple(self.block_hashes[first_block:end]),
                                  tuple(self.block_ids[first_block:end]))

    def take_load(self) -> BlockTransfer | None:
        """The planned load, once (it goes into exactly one step's metadata)."""
        load, self.load = self.load, None
        return load

    def plan_save(self, *, computed_tokens: int) -> BlockTransfer | None:
        """Prompt blocks full once ``computed_tokens`` are in the cache and not yet saved or in the pool."""
        full = min(computed_tokens, self.prompt_tokens) // self.block_tokens
        full = min(full, len(self.block_hashes), len(self.block_ids))
        start = max(self.saved, self.in_pool)
        if full <= start:
            return None
        self.saved = full
        return BlockTransfer(self.request_id, tuple(self.block_hashes[start:full]),
                             tuple(self.block_ids[start:full]))


# -- worker-side views of the KV tensors and the moves ------------------------------------------------

@dataclass(frozen=True)
class LayerRegion:
    """One layer's paged KV tensor as raw memory: ``num_blocks`` blocks, each in the pieces of ``pieces``.

    Without ``pieces`` the blocks are contiguous and back to back, ``block_bytes`` each.
    """

    address: int
    num_blocks: int
    block_bytes: int
    pieces: BlockRegions | None = None
    device: int | None = None
    """The accelerator (its runtime's ordinal) whose memory ``address`` is in; None: host memory."""

    @property
    def layout(self) -> BlockRegions:
        return self.pieces or BlockRegions(regions=((0, self.block_bytes),), block_stride=self.block_bytes)


# -- where the KV cache lives, and what moves device memory -------------------------------------------

RUNTIME_FOR_DEVICE = {"cuda": "nvidia", "sunrise": "sunrise"}
"""torch's device type -> the ``daybreak.agent.runtime`` runtime that copies, exports and registers its memory."""


@dataclass(frozen=True)
class KVMemory:
    """Where a layer's KV tensor lives: host memory, or device ``index`` of an accelerator platform."""

    platform: str
    """torch's device type: ``cpu``, ``cuda``, ``sunrise``..."""
    index: int | None = None

    @classmethod
    def parse(cls, device: str) -> KVMemory:
        """From torch's ``str(tensor.device)``: ``cpu``, ``cuda:0``..."""
        kind, _, index = device.partition(":")
        if kind == "cpu":
            return cls("cpu")
        if not index.isdigit():
            raise ConnectorConfigError(f"KV cache device {device!r} names no device index (expected TYPE:N)")
        return cls(kind, int(index))

    @property
    def on_device(self) -> bool:
        return self.platform != "cpu"

    def __str__(self) -> str:
        return self.platform if self.index is None else f"{self.platform}:{self.index}"


def require_device_path(name: str, memory: KVMemory, engine: Any, *, missing: str = "") -> int | None:
    """The device ordinal a layer's KV moves from, or None for host memory; refused when nothing can move it.

    Device memory moves only through a transfer engine (``KVPoolClient(engine=...)``) that holds
    the runtime of the tensor's platform (``RUNTIME_FOR_DEVICE``) and sees its device. ``missing``:
    why the caller has no such engine (a runtime that did not load), put into the error.
    """
    if not memory.on_device:
        return None
    wanted = RUNTIME_FOR_DEVICE.get(memory.platform)
    where = f"layer {name}: KV cache is in {memory} memory"
    if wanted is None:
        raise ConnectorConfigError(f"{where}, which no Daybreak runtime drives (device types with one: "
                                   f"{', '.join(f'{k} ({v})' for k, v in RUNTIME_FOR_DEVICE.items())})")
    runtime = getattr(engine, "runtime", None) if engine is not None else None
    if engine is None or runtime is None or getattr(runtime, "name", "") != wanted:
        have = ("the pool client has no transfer engine" if engine is None else
                f"the pool client's transfer engine has {'no' if runtime is None else 'the ' + runtime.name} "
                "runtime")
        raise ConnectorConfigError(
            f"{where}, which moves only through a transfer engine with the {wanted} runtime, and {have}"
            + (f" ({missing})" if missing else "")
            + f": run on a node where the {wanted} runtime loads (daybreak selfcheck names what it lacks), "
            "or pass KVPoolClient(engine=engine_for_pod(..., runtime=...))")
    devices = {d.index for d in runtime.devices()}
    if memory.index not in devices:
        raise ConnectorConfigError(f"{where}, but the {wanted} runtime sees devices {sorted(devices)} only "
                                   "(CUDA_VISIBLE_DEVICES differs between the engine and its runtime?)")
    return memory.index


# Dim names of a layer's view for the errors: [B, H, N, C], or [K/V, B, H, N, C] for a split layout.
_VIEW_DIMS = "BHNC"
_SPLIT_DIMS = "KBHNC"


def layer_region(name: str, *, address: int, shape: Sequence[int], strides: Sequence[int], itemsize: int,
                 layout: EngineLayout, num_blocks: int | None = None, device: int | None = None) -> LayerRegion:
    """One layer's registered KV tensor as pieces of blocks; refused unless it holds ``layout``.

    ``shape`` and ``strides`` (elements of ``itemsize`` bytes) are the tensor's own:
    vLLM's ``[B, H, N, C]`` page view, or for a ``kv_split`` layout FlashAttention's
    ``[2, B, N, H, D]`` (K plane, V plane). It must have the layout's page sizes, lay
    its dims out in memory in the layout's order (dims of size 1 aside; the K/V
    plane outermost) and cut a block into the same pieces; how far apart blocks
    are (padding, layers interleaved) is free. ``num_blocks``: vLLM's block count,
    which the tensor's B must equal (kernel blocks that split vLLM's blocks are not
    supported). ``device``: the accelerator ordinal when the tensor is in device
    memory (``require_device_path``).
    """
    shape, strides = tuple(shape), tuple(strides)
    where = f"layer {name}: KV cache {shape} with strides {strides}"
    lead = 1 if layout.kv_split else 0
    if layout.kv_split:
        if len(shape) != 5 or shape[0] != 2 or strides[4] != 1:
            raise ConnectorConfigError(f"{where} is not FlashAttention's [2, B, N, H, D] K/V tensor with D innermost "
                                       f"(the layout {layout.kv_layout} with K and V split)")
        # FlashAttention's [2, B, N, H, D] as the [2, B, H, N, C] view the layout's order speaks of
        shape = (shape[0], shape[1], shape[3], shape[2], shape[4])
        strides = (strides[0], strides[1], strides[3], strides[2], strides[4])
    elif len(shape) != 4 or strides[3] != 1:
        raise ConnectorConfigError(f"{where} is not vLLM's [B, H, N, C] page view with C innermost")
    if itemsize != layout.itemsize:
        raise ConnectorConfigError(f"{where} has {itemsize}-byte elements, not {layout.dtype}")
    content = layout.content_bytes // (2 if layout.kv_split else 1)
    want = (layout.head_slots, layout.block_tokens, content)
    have = (shape[lead + 1], shape[lead + 2], shape[lead + 3] * itemsize)
    if have != want:
        raise ConnectorConfigError(f"{where} has pages of {have[0]} head slots x {have[1]} tokens x {have[2]} bytes, "
                                   f"not {want[0]} x {want[1]} x {want[2]} as the model's KV spec says")
    if num_blocks is not None and shape[lead] != num_blocks:
        raise ConnectorConfigError(f"{where} has {shape[lead]} blocks, vLLM's block table {num_blocks}: kernel "
                                   f"blocks split vLLM's blocks, which the connector does not support (start vLLM "
                                   f"with --block-size {shape[lead + 2]})")
    byte_strides = (*(s * itemsize for s in strides[:-1]), 1)
    byte_shape = (*shape[:-1], shape[-1] * itemsize)
    # the view's dims in memory order: the K/V plane first, then the layout's order without L
    order = [0] * lead + [d - 1 + lead for d in layout_order(layout.kv_layout) if d != _LAYER]
    expected = [d for d in order if byte_shape[d] != 1]
    actual = sorted((d for d in range(len(shape)) if byte_shape[d] != 1), key=lambda d: byte_strides[d], reverse=True)
    if actual != expected:
        names = _SPLIT_DIMS if layout.kv_split else _VIEW_DIMS
        raise ConnectorConfigError(
            f"{where} lays its dims out as {''.join(names[d] for d in actual)} in memory, not as the layout "
            f"{layout.kv_layout}{' with K and V split' if layout.kv_split else ''} the keys' fingerprint names")
    pieces = block_regions(byte_shape, byte_strides, block_dim=lead, itemsize=1)
    if pieces.lengths != layout.regions().lengths:
        raise ConnectorConfigError(f"{where} cuts a block into pieces of {list(pieces.lengths)} bytes, not "
                                   f"{list(layout.regions().lengths)} as {layout.kv_layout} does")
    return LayerRegion(address=address, num_blocks=shape[lead], block_bytes=pieces.block_bytes, pieces=pieces,
                       device=device)


class BlockViews:
    """The pieces of single blocks inside the registered KV tensors, as buffers the pool client moves (no copies).

    Host memory: writable memoryviews. Device memory: ``DeviceRef(device, address, length)`` of
    each piece, which the client moves through its transfer engine (link, GPUDirect rdma, DMA into
    the agent's segment), never through a staging copy here. The tensors must stay alive (vLLM owns
    them for the engine's lifetime); ``register_kv_caches`` checks each one's layout before building
    this. Every layer must split a block into the same pieces (one key each).
    """

    def __init__(self, regions: Sequence[LayerRegion]) -> None:
        if not regions:
            raise ValueError("no KV cache layers registered")
        self.regions = list(regions)
        lengths = {r.layout.lengths for r in self.regions}
        if len(lengths) != 1:
            raise ValueError(f"KV cache layers split a block differently: {sorted(lengths)}")
        self._views = [None if r.device is not None else
                       memoryview((ctypes.c_ubyte * r.layout.extent(r.num_blocks)).from_address(r.address)).cast("B")
                       for r in self.regions]

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    @property
    def pieces_per_layer(self) -> int:
        """Pieces (pool keys) per block and layer."""
        return len(self.regions[0].layout.regions)

    @property
    def on_device(self) -> bool:
        """Whether the KV tensors are in device memory (the views are DeviceRefs)."""
        return any(r.device is not None for r in self.regions)

    def views(self, block_ids: Sequence[int], *,
              layers: Sequence[int] | None = None) -> list[memoryview | DeviceRef]:
        """Block-major pieces: every piece of every layer (or of ``layers``) of ``block_ids[0]``, then ``[1]``..."""
        chosen = range(self.num_layers) if layers is None else layers
        out: list[memoryview | DeviceRef] = []
        for block in block_ids:
            for region, view in ((self.regions[i], self._views[i]) for i in chosen):
                if not 0 <= block < region.num_blocks:
                    raise IndexError(f"block id {block} outside the KV cache's {region.num_blocks} blocks")
                layout = region.layout
                base = block * layout.block_stride
                if view is None:
                    assert region.device is not None
                    out += [DeviceRef(region.device, region.address + base + off, length)
                            for off, length in layout.regions]
                else:
                    out += [view[base + off:base + off + length] for off, length in layout.regions]
        return out


class BlockClient(Protocol):
    """What the moves need of ``daybreak.client.KVPoolClient``."""

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any], *,
                  tier: Literal["dram", "hbm"] = "dram") -> list[int]: ...

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]: ...


@dataclass(frozen=True)
class Moved:
    """What one batch did: blocks asked for, keys, bytes that arrived or copies written, blocks that failed."""

    blocks: int
    keys: int
    done: int
    """Loads: bytes of whole pieces that arrived. Saves: keys stored at least once."""
    failed: frozenset[int] = frozenset()
    """Loads: block ids not every piece of which arrived whole (vLLM recomputes them)."""
    error: str = ""
    """The client's error when the whole batch failed."""


class BlockMover:
    """Moves blocks between the registered KV tensors and the pool: every piece of every block in one batch.

    ``batch_get_into`` writes straight into the KV tensors' pieces and
    ``batch_put`` reads straight from them: no staging copy on the engine side.
    A load error or miss of any piece fails its whole block; a save error only
    costs a future miss. ``errors`` are the exceptions a pool problem raises.
    ``tier``: where saves ask the agents to keep the blocks (``hbm``: an agent's
    device-memory tier, reached over the device link from device KV caches).
    """

    def __init__(self, views: BlockViews, *, fingerprint: str, errors: tuple[type[BaseException], ...],
                 tier: Literal["dram", "hbm"] = "dram") -> None:
        self.views = views
        self.fingerprint = fingerprint
        self.errors = errors
        self.tier: Literal["dram", "hbm"] = tier

    def _plan(self, transfers: Sequence[BlockTransfer],
              layers: Sequence[int] | None) -> tuple[list[str], list[int], list[memoryview | DeviceRef]]:
        keys: list[str] = []
        blocks: list[int] = []
        for t in transfers:
            keys += block_keys(self.fingerprint, t.block_hashes, self.views.num_layers, self.views.pieces_per_layer,
                               layers=layers)
            blocks += t.block_ids
        return keys, blocks, self.views.views(blocks, layers=layers)

    def load(self, client: BlockClient, transfers: Sequence[BlockTransfer], *,
             layers: Sequence[int] | None = None) -> Moved:
        """Read the transfers' blocks (every layer, or ``layers``) from the pool into their KV memory.

        ``failed`` names the blocks not every piece of which arrived whole.
        """
        keys, blocks, views = self._plan(transfers, layers)
        per_block = len(keys) // len(blocks) if blocks else 1
        error = ""
        try:
            sizes = client.batch_get_into(keys, views)
        except self.errors as exc:
            sizes, error = [None] * len(keys), repr(exc)
        failed = frozenset(blocks[i // per_block] for i, (size, view) in enumerate(zip(sizes, views, strict=True))
                           if size != len(view))
        return Moved(blocks=len(blocks), keys=len(keys), done=sum(size or 0 for size in sizes), failed=failed,
                     error=error)

    def save(self, client: BlockClient, transfers: Sequence[BlockTransfer], *,
             layers: Sequence[int] | None = None) -> Moved:
        """Write the transfers' blocks (every layer, or ``layers``) from their KV memory into the pool."""
        keys, blocks, views = self._plan(transfers, layers)
        try:
            copies = client.batch_put(keys, views, tier=self.tier)
        except self.errors as exc:
            return Moved(blocks=len(blocks), keys=len(keys), done=0, error=repr(exc))
        return Moved(blocks=len(blocks), keys=len(keys), done=sum(1 for c in copies if c))


# -- layer by layer: the I/O thread, and the device streams it is ordered against ---------------------

class LayerSync(Protocol):
    """How the pool I/O of one layer is ordered against the forward pass on the KV cache's device.

    The forward pass queues each layer's kernels and goes on; the I/O thread moves
    a layer's blocks meanwhile. A save must not read a layer before its kernels
    wrote it, and the forward pass must not read a loaded layer before its bytes
    landed. Markers are opaque (device events); ``HostSync`` is the CPU's (no-op),
    ``TorchStreamSync`` an accelerator's through torch's stream API.
    """

    def compute_done(self) -> Any:
        """Forward thread, after a layer has run: a marker of the compute queued so far."""

    def wait_compute(self, marker: Any) -> None:
        """I/O thread, before a save reads a layer: wait until that compute has completed."""

    def io_done(self) -> Any:
        """I/O thread, after a layer's moves: a marker of the device work they queued."""

    def wait_io(self, marker: Any) -> None:
        """Forward thread, before a layer reads its loaded blocks: order the compute after that work."""

    def io_scope(self) -> AbstractContextManager[Any]:
        """Around the I/O thread's work: its own stream on an accelerator."""


class HostSync:
    """Host memory: a layer's bytes are there when the forward thread returns from it, and the moves are
    synchronous, so the I/O thread needs no ordering beyond its futures."""

    def compute_done(self) -> None:
        return None

    def wait_compute(self, marker: Any) -> None:
        return None

    def io_done(self) -> None:
        return None

    def wait_io(self, marker: Any) -> None:
        return None

    def io_scope(self) -> AbstractContextManager[Any]:
        return nullcontext()


class TorchStreamSync:
    """An accelerator's ordering through torch (``torch.cuda``, or a backend with the same stream API).

    Saves: ``compute_done`` records an event on the forward pass's current stream
    after the layer; the I/O thread waits for it on the host (``Event.synchronize``),
    which holds only the I/O thread, not the GPU. Loads run with the I/O thread's
    own stream current (``torch.cuda.Stream``), and an event recorded on it after
    each layer's moves is what the forward pass's stream waits on (``wait_event``:
    no host wait). The runtimes' copies complete before they return
    (``AcceleratorRuntime``), so that event orders any device work the I/O thread
    queued on its stream. torch is imported here, not with this module.
    """

    def __init__(self, platform: str, index: int) -> None:
        import torch

        backend = getattr(torch, platform, None)
        if backend is None or not all(hasattr(backend, n) for n in ("Stream", "Event", "current_stream", "stream")):
            raise ConnectorConfigError(f"torch has no stream API for {platform} (torch.{platform}.Stream, Event, "
                                       "current_stream, stream): the connector orders its layer-by-layer moves "
                                       "with it")
        self._backend = backend
        self.device = torch.device(platform, index)
        self.stream = backend.Stream(device=self.device)

    def compute_done(self) -> Any:
        event = self._backend.Event()
        event.record(self._backend.current_stream(self.device))
        return event

    def wait_compute(self, marker: Any) -> None:
        marker.synchronize()

    def io_done(self) -> Any:
        event = self._backend.Event()
        event.record(self.stream)
        return event

    def wait_io(self, marker: Any) -> None:
        self._backend.current_stream(self.device).wait_event(marker)

    def io_scope(self) -> AbstractContextManager[Any]:
        scope: AbstractContextManager[Any] = self._backend.stream(self.stream)
        return scope


def layer_sync(memory: KVMemory) -> LayerSync:
    """The ordering for KV caches in ``memory``: none on host memory, the device's streams otherwise."""
    if not memory.on_device:
        return HostSync()
    assert memory.index is not None
    return TorchStreamSync(memory.platform, memory.index)


class LayerPipeline:
    """Layer-by-layer moves on one I/O thread, overlapping the forward pass (issue 20 item 5).

    Loads: ``start_loads`` queues one batch per layer, in layer order;
    ``wait_load(layer)`` holds the forward pass until that layer's blocks are in.
    Saves: ``save_layer`` queues a layer's batch as soon as the forward pass has
    run the layer (after its compute, through ``sync``); ``finish_saves`` saves
    the layers nobody reported, in one batch, and waits for them all. The pool
    client is used on the I/O thread only (IT IS NOT THREAD-SAFE), in submission
    order.
    """

    def __init__(self, mover: BlockMover, client: BlockClient, *, sync: LayerSync | None = None,
                 thread_name: str = "daybreak-kv-io") -> None:
        self.mover = mover
        self.client = client
        self.sync: LayerSync = sync or HostSync()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._loading: dict[int, Future[tuple[Moved, Any]]] = {}
        self._saving: dict[int, Future[Moved]] = {}

    @property
    def num_layers(self) -> int:
        return self.mover.views.num_layers

    @property
    def loading(self) -> bool:
        """Loads queued and not yet waited for."""
        return bool(self._loading)

    @property
    def saving(self) -> bool:
        """Saves queued and not yet finished."""
        return bool(self._saving)

    def start_loads(self, transfers: Sequence[BlockTransfer]) -> None:
        for layer in range(self.num_layers):
            self._loading[layer] = self._io.submit(self._load, transfers, layer)

    def _load(self, transfers: Sequence[BlockTransfer], layer: int) -> tuple[Moved, Any]:
        with self.sync.io_scope():
            moved = self.mover.load(self.client, transfers, layers=(layer,))
            return moved, self.sync.io_done()

    def wait_load(self, layer: int) -> Moved | None:
        """This layer's load once its blocks are in (or failed); None when none is queued for it."""
        future = self._loading.pop(layer, None)
        if future is None:
            return None
        moved, marker = future.result()
        self.sync.wait_io(marker)
        return moved

    def finish_loads(self) -> list[Moved]:
        """Wait for the loads of the layers nobody waited for, in layer order."""
        return [moved for layer in sorted(self._loading) if (moved := self.wait_load(layer)) is not None]

    def save_layer(self, layer: int, transfers: Sequence[BlockTransfer]) -> bool:
        """Queue this layer's save behind its compute; False when it is already queued."""
        if layer in self._saving:
            return False
        self._saving[layer] = self._io.submit(self._save, transfers, (layer,), self.sync.compute_done())
        return True

    def _save(self, transfers: Sequence[BlockTransfer], layers: Sequence[int], marker: Any) -> Moved:
        self.sync.wait_compute(marker)
        with self.sync.io_scope():
            return self.mover.save(self.client, transfers, layers=layers)

    def finish_saves(self, transfers: Sequence[BlockTransfer]) -> list[Moved]:
        """Save the layers not yet queued (one batch), then wait for every save of the step, in layer order."""
        rest = [layer for layer in range(self.num_layers) if layer not in self._saving]
        if rest:
            self._saving[rest[0]] = self._io.submit(self._save, transfers, rest, self.sync.compute_done())
        return [self._saving.pop(layer).result() for layer in sorted(self._saving)]

    def close(self) -> None:
        self._io.shutdown(wait=True)


# -- an engine pod's transfer engine --------------------------------------------------------------------

@dataclass
class PodEngine:
    """The transfer engine an engine pod moves device KV through, and the runtime under it.

    Both None for host KV caches (the client's own paths, as before) or when the
    platform's runtime did not load; ``missing`` then says why, for the error
    ``require_device_path`` raises once the KV cache is known to be on a device.
    """

    engine: Any = None
    runtime: Any = None
    missing: str = ""

    def close(self) -> None:
        """Close the engine, then the runtime (after the client that used them)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None


def pod_engine(settings: PoolSettings, *, platform: str, env: Mapping[str, str] | None = None) -> PodEngine:
    """An engine pod's transfer engine for KV caches on ``platform`` (torch's device type): the platform's
    runtime (``daybreak.agent.runtime.load_runtime``) and the engine built from the pod's contract
    (``client.datapath.engine_for_pod``: its transports and TLS, ``settings.token``, ``$NODE_NAME``).

    ``cpu``: none (host KV caches keep the client's own paths). A runtime that does not load is no
    error here: the reason goes into ``missing`` for ``require_device_path``.
    """
    if platform == "cpu":
        return PodEngine()
    wanted = RUNTIME_FOR_DEVICE.get(platform)
    if wanted is None:
        return PodEngine(missing=f"no Daybreak runtime for {platform}")
    from daybreak.agent.runtime import load_runtime
    from daybreak.client.datapath import engine_for_pod
    from daybreak.client.env import engine_pod_env

    loaded = load_runtime(wanted)
    if loaded.name != wanted:
        return PodEngine(missing=f"the {wanted} runtime did not load: {loaded.skipped.get(wanted, 'unknown')}")
    try:
        engine = engine_for_pod(engine_pod_env(env), token=settings.token, runtime=loaded.runtime)
    except BaseException:
        loaded.runtime.close()
        raise
    return PodEngine(engine=engine, runtime=loaded.runtime)
