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
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from daybreak.api.enginepod import EnginePodEnv, EnginePodEnvError
from daybreak.api.kvcompat import KVDtype, KVLayout, KVPlatform
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

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ConnectorConfigError(f"KV cache dtype {self.dtype} is not supported by the Daybreak connector")
        layout_order(self.kv_layout)

    @property
    def itemsize(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def layer_view(self, *, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(shape, strides)`` in bytes of one layer's ``[B, H, N, C]`` view, allocated as vLLM allocates it.

        vLLM lays the five dims out contiguous in the layout's order (pages
        unpadded), then views each layer: so with L inside B (BLHNC) a block
        holds every layer's page, and with H outside B (LHBNC) a block's head
        slots lie a whole plane apart.
        """
        shape = (self.num_layers, num_blocks, self.head_slots, self.block_tokens, self.content_bytes)
        strides = [0] * len(shape)
        step = 1
        for dim in reversed(layout_order(self.kv_layout)):
            strides[dim] = step
            step *= shape[dim]
        return shape[1:], tuple(strides[1:])

    def regions(self, *, num_blocks: int = _SAMPLE_BLOCKS) -> BlockRegions:
        """One block's pieces in one layer's view of ``num_blocks`` blocks (in bytes).

        More than one block: with a single block, head slots outside the block dim
        would look adjacent and merge into one piece.
        """
        shape, strides = self.layer_view(num_blocks=num_blocks)
        return block_regions(shape, strides, block_dim=0, itemsize=1)

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
        body = json.dumps({"engine": "vllm", **self.__dict__}, sort_keys=True, separators=(",", ":"))
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

    @property
    def layout(self) -> BlockRegions:
        return self.pieces or BlockRegions(regions=((0, self.block_bytes),), block_stride=self.block_bytes)


def require_host_memory(name: str, device: str) -> None:
    """Refuse a KV cache outside host memory (``device``: torch's ``tensor.device``, ``cpu`` or ``cuda:0``...)."""
    if device != "cpu":
        raise ConnectorConfigError(
            f"layer {name}: KV cache is in {device} memory; the Daybreak connector moves KV caches in host "
            "memory only for now (device memory needs the client's device-buffer support, which is not built "
            "yet: docs/engines.md)")


def layer_region(name: str, *, address: int, shape: Sequence[int], strides: Sequence[int], itemsize: int,
                 layout: EngineLayout, num_blocks: int | None = None) -> LayerRegion:
    """One layer's registered ``[B, H, N, C]`` KV tensor as pieces of blocks; refused unless it holds ``layout``.

    ``shape`` and ``strides`` (elements of ``itemsize`` bytes) are the tensor's own.
    It must have the layout's page sizes, lay its dims out in memory in the
    layout's order (dims of size 1 aside) and cut a block into the same pieces;
    how far apart blocks are (padding, layers interleaved) is free. ``num_blocks``:
    vLLM's block count, which the tensor's B must equal (kernel blocks that split
    vLLM's blocks are not supported).
    """
    shape, strides = tuple(shape), tuple(strides)
    where = f"layer {name}: KV cache {shape} with strides {strides}"
    if len(shape) != 4 or strides[3] != 1:
        raise ConnectorConfigError(f"{where} is not vLLM's [B, H, N, C] page view with C innermost")
    if itemsize != layout.itemsize:
        raise ConnectorConfigError(f"{where} has {itemsize}-byte elements, not {layout.dtype}")
    want = (layout.head_slots, layout.block_tokens, layout.content_bytes)
    have = (shape[1], shape[2], shape[3] * itemsize)
    if have != want:
        raise ConnectorConfigError(f"{where} has pages of {have[0]} head slots x {have[1]} tokens x {have[2]} bytes, "
                                   f"not {want[0]} x {want[1]} x {want[2]} as the model's KV spec says")
    if num_blocks is not None and shape[0] != num_blocks:
        raise ConnectorConfigError(f"{where} has {shape[0]} blocks, vLLM's block table {num_blocks}: kernel blocks "
                                   f"split vLLM's blocks, which the connector does not support (start vLLM with "
                                   f"--block-size {shape[2]})")
    byte_strides = (*(s * itemsize for s in strides[:3]), 1)
    byte_shape = (*shape[:3], shape[3] * itemsize)
    order = [d - 1 for d in layout_order(layout.kv_layout) if d != _LAYER]  # the view's dims in memory order
    expected = [d for d in order if byte_shape[d] != 1]
    actual = sorted((d for d in range(4) if byte_shape[d] != 1), key=lambda d: byte_strides[d], reverse=True)
    if actual != expected:
        raise ConnectorConfigError(
            f"{where} lays its dims out as {''.join(KV_DIMS[d + 1] for d in actual)} in memory, not as the layout "
            f"{layout.kv_layout} the keys' fingerprint names")
    pieces = block_regions(byte_shape, byte_strides, block_dim=0, itemsize=1)
    if pieces.lengths != layout.regions().lengths:
        raise ConnectorConfigError(f"{where} cuts a block into pieces of {list(pieces.lengths)} bytes, not "
                                   f"{list(layout.regions().lengths)} as {layout.kv_layout} does")
    return LayerRegion(address=address, num_blocks=shape[0], block_bytes=pieces.block_bytes, pieces=pieces)


class BlockViews:
    """Writable memoryviews of the pieces of single blocks inside the registered KV tensors (no copies).

    The tensors must stay alive (vLLM owns them for the engine's lifetime);
    ``register_kv_caches`` checks each one's layout before building this. Every
    layer must split a block into the same pieces (one key each).
    """

    def __init__(self, regions: Sequence[LayerRegion]) -> None:
        if not regions:
            raise ValueError("no KV cache layers registered")
        self.regions = list(regions)
        lengths = {r.layout.lengths for r in self.regions}
        if len(lengths) != 1:
            raise ValueError(f"KV cache layers split a block differently: {sorted(lengths)}")
        self._views = [memoryview((ctypes.c_ubyte * r.layout.extent(r.num_blocks)).from_address(r.address)).cast("B")
                       for r in self.regions]

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    @property
    def pieces_per_layer(self) -> int:
        """Pieces (pool keys) per block and layer."""
        return len(self.regions[0].layout.regions)

    def views(self, block_ids: Sequence[int], *, layers: Sequence[int] | None = None) -> list[memoryview]:
        """Block-major views: every piece of every layer (or of ``layers``) of ``block_ids[0]``, then ``[1]``..."""
        chosen = range(self.num_layers) if layers is None else layers
        out = []
        for block in block_ids:
            for region, view in ((self.regions[i], self._views[i]) for i in chosen):
                if not 0 <= block < region.num_blocks:
                    raise IndexError(f"block id {block} outside the KV cache's {region.num_blocks} blocks")
                layout = region.layout
                base = block * layout.block_stride
                out += [view[base + off:base + off + length] for off, length in layout.regions]
        return out


class BlockClient(Protocol):
    """What the moves need of ``daybreak.client.KVPoolClient``."""

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]: ...

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
    """

    def __init__(self, views: BlockViews, *, fingerprint: str, errors: tuple[type[BaseException], ...]) -> None:
        self.views = views
        self.fingerprint = fingerprint
        self.errors = errors

    def _plan(self, transfers: Sequence[BlockTransfer],
              layers: Sequence[int] | None) -> tuple[list[str], list[int], list[memoryview]]:
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
            copies = client.batch_put(keys, views)
        except self.errors as exc:
            return Moved(blocks=len(blocks), keys=len(keys), done=0, error=repr(exc))
        return Moved(blocks=len(blocks), keys=len(keys), done=sum(1 for c in copies if c))
