"""What the vLLM connector decides without vLLM: pool settings, layout checks, block keys, load/save plans, block views.

Kept apart from ``daybreak.connectors.vllm`` so that it imports (and is unit
tested) without vLLM or torch installed. The connector itself is a thin
adapter from vLLM's scheduler and worker hooks onto these pieces.

Keys. One pool key per (block, layer): vLLM's CPU backend keeps one tensor
per layer (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``), so a
block's bytes are one contiguous region per layer and each region moves
zero-copy (``batch_get_into`` lands in the KV tensor itself). A key is
``vllm-<fingerprint>-<block hash>-<layer>``: the block hash is vLLM's own
chained prefix hash (stable across processes), and the fingerprint digests
the byte layout the engine really has (platform, block size, dtype, shape,
tensor-parallel rank), so engines whose blocks are not byte-compatible never
read each other's bytes even if they were given the same namespace.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from daybreak.api.kvcompat import KVDtype, KVLayout, KVPlatform
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

    @classmethod
    def resolve(cls, extra: Mapping[str, Any], env: Mapping[str, str] | None = None, *,
                discover: Discover | None = None) -> PoolSettings:
        """From ``kv_connector_extra_config`` first, then the operator's ``DAYBREAK_*`` environment.

        extra: ``endpoints`` (list or comma string), ``pool_ref`` (``NS/NAME``),
        ``discovery_timeout_seconds``, ``token`` or ``token_file``, ``namespace``, ``kv_layout``
        (dict or JSON). Environment: ``DAYBREAK_POOL_REF``, ``DAYBREAK_POOL_ENDPOINTS``,
        ``DAYBREAK_POOL_TOKEN`` (or ``DAYBREAK_POOL_TOKEN_FILE``), ``DAYBREAK_KV_NAMESPACE``,
        ``DAYBREAK_KV_LAYOUT``, and ``KUBECONFIG`` for the API.

        Endpoints: ``extra.endpoints`` as given; else the KVPool named by ``pool_ref`` /
        ``DAYBREAK_POOL_REF``, whose ``status.endpoints`` are read through the Kubernetes API
        (``discover``, by default ``daybreak.client.discovery.discover_pool_endpoints``, waiting up to
        ``discovery_timeout_seconds`` for the pool to publish an agent); else
        ``DAYBREAK_POOL_ENDPOINTS`` (the agents' headless Service, which needs cluster DNS). Everything
        else is checked before the pool is looked up, so a bad setting fails at once.
        """
        env = os.environ if env is None else env
        token = _token(extra, env)
        namespace = str(extra.get("namespace") or env.get("DAYBREAK_KV_NAMESPACE", "")).strip()
        if not namespace:
            raise ConnectorConfigError("no kvNamespace: set kv_connector_extra_config.namespace "
                                       "or DAYBREAK_KV_NAMESPACE")
        raw_layout = extra.get("kv_layout") or env.get("DAYBREAK_KV_LAYOUT")
        layout = None
        if raw_layout:
            try:
                layout = KVLayout.model_validate(json.loads(raw_layout) if isinstance(raw_layout, str)
                                                 else raw_layout)
            except ValueError as exc:
                raise ConnectorConfigError(f"kv_layout / DAYBREAK_KV_LAYOUT is not a valid kvLayout: {exc}") from exc
        endpoints = _endpoints(extra.get("endpoints"))
        pool_ref = ""
        if not endpoints:
            pool_ref = str(extra.get("pool_ref") or env.get("DAYBREAK_POOL_REF", "")).strip()
        if pool_ref:
            timeout = _seconds(extra.get("discovery_timeout_seconds", DISCOVERY_TIMEOUT_SECONDS))
            if discover is None:
                from daybreak.client import discovery  # here only: it loads the Kubernetes client

                discover = discovery.discover_pool_endpoints
            endpoints = tuple(discover(pool_ref, timeout_seconds=timeout, kubeconfig=env.get("KUBECONFIG", "")))
        elif not endpoints:
            endpoints = _endpoints(env.get("DAYBREAK_POOL_ENDPOINTS", ""))
        if not endpoints:
            raise ConnectorConfigError("no pool endpoints: set kv_connector_extra_config.endpoints "
                                       "(['host:port', ...]), DAYBREAK_POOL_REF (NS/NAME of the KVPool) "
                                       "or DAYBREAK_POOL_ENDPOINTS")
        return cls(endpoints=endpoints, token=token, namespace=namespace, layout=layout, pool_ref=pool_ref)


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


def _token(extra: Mapping[str, Any], env: Mapping[str, str]) -> str:
    if extra.get("token"):
        return str(extra["token"]).strip()
    file = extra.get("token_file") or (None if env.get("DAYBREAK_POOL_TOKEN") else env.get("DAYBREAK_POOL_TOKEN_FILE"))
    if file:
        try:
            token = Path(str(file)).read_text().strip()
        except OSError as exc:
            raise ConnectorConfigError(f"token_file {file}: cannot read the pool token ({exc.strerror})") from exc
        if not token:
            raise ConnectorConfigError(f"token_file {file} is empty")
        return token
    token = env.get("DAYBREAK_POOL_TOKEN", "").strip()
    if not token:
        raise ConnectorConfigError("no pool token: set kv_connector_extra_config.token_file (or token) "
                                   "or DAYBREAK_POOL_TOKEN")
    return token


# -- layout -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineLayout:
    """The KV layout a running engine really has (read from its config and KV tensors)."""

    platform: str
    """``cpu`` or the accelerator platform's name (``cuda``, ...)."""
    block_tokens: int
    num_layers: int
    num_kv_heads: int
    """KV heads held by this rank's tensors."""
    head_dim: int
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``bfloat16``)."""
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block in one layer's tensor: K and V of every head for block_tokens tokens."""
        return 2 * self.num_kv_heads * self.block_tokens * self.head_dim * _DTYPE_BYTES[self.dtype]

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
    if actual.dtype not in _DTYPE_BYTES:
        raise ConnectorConfigError(f"KV cache dtype {actual.dtype} is not supported by the Daybreak connector")
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


def block_key(fingerprint: str, block_hash: bytes, layer: int) -> str:
    """The pool key of one layer of one block."""
    return f"vllm-{fingerprint}-{block_hash.hex()}-{layer}"


def block_keys(fingerprint: str, block_hashes: Sequence[bytes], num_layers: int) -> list[str]:
    """Keys of every layer of every block, block-major (the order ``BlockViews.views`` yields)."""
    return [block_key(fingerprint, h, layer) for h in block_hashes for layer in range(num_layers)]


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


# -- worker-side views of the KV tensors --------------------------------------------------------------

@dataclass(frozen=True)
class LayerRegion:
    """One layer's paged KV tensor as raw memory: ``num_blocks`` blocks of ``block_bytes`` each."""

    address: int
    num_blocks: int
    block_bytes: int


class BlockViews:
    """Writable memoryviews of single blocks inside the registered KV tensors (no copies).

    The tensors must stay alive (vLLM owns them for the engine's lifetime) and
    each layer's blocks must be contiguous and back to back, which
    ``register_kv_caches`` checks before building this.
    """

    def __init__(self, regions: Sequence[LayerRegion]) -> None:
        if not regions:
            raise ValueError("no KV cache layers registered")
        self.regions = list(regions)
        self._views = [memoryview((ctypes.c_ubyte * (r.num_blocks * r.block_bytes)).from_address(r.address)).cast("B")
                       for r in self.regions]

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    def views(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Block-major views: every layer of ``block_ids[0]``, then of ``block_ids[1]``, ..."""
        out = []
        for block in block_ids:
            for region, view in zip(self.regions, self._views, strict=True):
                if not 0 <= block < region.num_blocks:
                    raise IndexError(f"block id {block} outside the KV cache's {region.num_blocks} blocks")
                out.append(view[block * region.block_bytes:(block + 1) * region.block_bytes])
        return out
