"""KV cache layout and the KV compatibility key (``kvNamespace``): which cached bytes an engine may reuse.

Two engines may share cached KV blocks only when every byte means the same
thing to both: same weights (model name and revision), same tensor layout
(layers, KV heads, head size, dtype, tokens per block) and the same engine
kind (each engine lays out and hashes blocks its own way). ``kv_namespace``
turns exactly those inputs into a short, label-safe key. Keys prefix every
block the store holds, so a change to any input starts a fresh namespace and
stale bytes can never be read as if they were valid.

STABILITY: the key must not change between Daybreak releases for the same
inputs, or every upgrade would silently drop the whole cache. It is therefore
computed from an explicit, versioned, canonical serialisation below, never
from ``model_dump`` (adding a field to a model must not change old keys).
Changing the serialisation means bumping ``KV_NAMESPACE_VERSION``. New
inputs enter the payload only when set (``KVLayout.platform``), so every key
computed before they existed stays the same.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum

from pydantic import Field

from daybreak.api.base import ApiModel

KV_NAMESPACE_VERSION = 1
_DOMAIN = f"daybreak.dev/kv-namespace/v{KV_NAMESPACE_VERSION}"
# 24 hex digits = 96 bits: collisions between distinct layouts are not a
# practical concern, and "kv1-" + 24 fits a label value (<= 63 characters).
_DIGEST_HEX = 24


class KVDtype(StrEnum):
    """Element type of the cached K and V tensors."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"

    @property
    def size(self) -> int:
        """Bytes per element."""
        return _DTYPE_BYTES[self]


_DTYPE_BYTES = {
    KVDtype.FLOAT32: 4, KVDtype.FLOAT16: 2, KVDtype.BFLOAT16: 2,
    KVDtype.FP8_E4M3: 1, KVDtype.FP8_E5M2: 1, KVDtype.INT8: 1,
}


class KVPlatform(StrEnum):
    """An engine platform whose KV block bytes differ from the same engine's accelerator (CUDA) layout."""

    CPU = "cpu"
    """vLLM's CPU backend: per block and head, K is stored transposed ([headDim, blockTokens]), then V."""


class EngineKind(StrEnum):
    """The inference engine running prefill and decode."""

    VLLM = "vllm"
    SGLANG = "sglang"
    SIM = "sim"


class KVLayout(ApiModel):
    """Shape of the KV cache the engine produces; fixes the bytes per token and per block.

    bytes per token = 2 (K and V) x numLayers x numKVHeads x headDim x dtype bytes;
    bytes per block = bytes per token x blockTokens.
    """

    num_layers: int = Field(ge=1, le=1024)
    """Transformer layers that keep a KV cache."""
    num_kv_heads: int = Field(ge=1, le=1024)
    """KV heads per layer (after grouped-query sharing, per full model, not per tensor-parallel shard)."""
    head_dim: int = Field(ge=1, le=16384)
    """Size of one attention head."""
    dtype: KVDtype = KVDtype.BFLOAT16
    """Element type of the cached tensors."""
    block_tokens: int = Field(default=16, ge=1, le=65536)
    """Tokens per cache block: the unit the store keeps, moves and evicts."""
    platform: KVPlatform | None = None
    """Set only where the engine's block bytes differ from its accelerator layout: cpu for vLLM on CPU
    (not byte-compatible with CUDA blocks of the same shape). Unset: the accelerator layout. Part of
    kvNamespace only when set, so keys of existing deployments do not change."""

    @property
    def bytes_per_token(self) -> int:
        """2 x numLayers x numKVHeads x headDim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size

    @property
    def bytes_per_block(self) -> int:
        """bytes_per_token x blockTokens."""
        return self.bytes_per_token * self.block_tokens


def kv_namespace_payload(*, model_name: str, model_revision: str, layout: KVLayout, engine: EngineKind | str) -> bytes:
    """The exact bytes hashed into the key (exposed so tests and other languages can reproduce it)."""
    fields = {
        "blockTokens": int(layout.block_tokens),
        "dtype": str(KVDtype(layout.dtype).value),
        "engine": str(EngineKind(engine).value),
        "headDim": int(layout.head_dim),
        "model": model_name,
        "numKVHeads": int(layout.num_kv_heads),
        "numLayers": int(layout.num_layers),
        "revision": model_revision,
    }
    if layout.platform is not None:
        # Added after v1 keys were in use: present only when set, so older keys are unchanged.
        fields["platform"] = str(KVPlatform(layout.platform).value)
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{_DOMAIN}\n{body}".encode("ascii")


def kv_namespace(*, model_name: str, model_revision: str, layout: KVLayout, engine: EngineKind | str) -> str:
    """The KV compatibility key: ``kv1-`` + the first 24 hex digits of sha256 over the canonical payload."""
    payload = kv_namespace_payload(model_name=model_name, model_revision=model_revision, layout=layout, engine=engine)
    return f"kv{KV_NAMESPACE_VERSION}-{hashlib.sha256(payload).hexdigest()[:_DIGEST_HEX]}"
