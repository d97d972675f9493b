# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Regions of a rank's KV tensors as the attention backend lays them out
(how many block ranges one tensor's blocks are split into)."""

import math
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.kv_cache_compat import kv_storage_block_size


def attention_kv_regions(
    attn_backend: Any,
    kv_cache_spec: Any,
    kernel_block_size: int,
    cache_dtype: str,
) -> int:
    """Regions of one layer's KV tensor as the attention backend lays it out:
    the product of the physical dimensions before the block dimension (1 for
    ``(num_blocks, 2, ...)``, 2 for ``(2, num_blocks, ...)``).

    The block dimension is the one that grows with the block count; the
    physical order is the backend's stride order, as in the model runner.
    """
    if not hasattr(kv_cache_spec, "num_kv_heads"):
        raise NotImplementedError(
            f"VMM-backed KV memory (--kv-cache-memory-backend vmm) supports "
            f"attention KV caches only, not {type(kv_cache_spec).__name__}; "
            "use --kv-cache-memory-backend default"
        )
    kernel_blocks = kv_cache_spec.block_size // kernel_block_size
    block_size = kv_storage_block_size(kv_cache_spec)
    if block_size == kv_cache_spec.block_size:
        block_size = kernel_block_size

    def physical_shape(num_blocks: int) -> tuple[int, ...]:
        shape = attn_backend.get_kv_cache_shape(
            num_blocks * kernel_blocks,
            block_size,
            kv_cache_spec.num_kv_heads,
            kv_cache_spec.head_size,
            cache_dtype_str=cache_dtype,
        )
        try:
            order = attn_backend.get_kv_cache_stride_order()
            assert len(order) == len(shape)
        except (AttributeError, NotImplementedError):
            order = tuple(range(len(shape)))
        return tuple(shape[i] for i in order)

    one, two = physical_shape(1), physical_shape(2)
    block_dims = [d for d, (a, b) in enumerate(zip(one, two)) if a != b]
    if len(one) != len(two) or len(block_dims) != 1:
        raise NotImplementedError(
            f"VMM-backed KV memory cannot find the block dimension of "
            f"{attn_backend.get_name()}'s KV cache shape {one}; use "
            "--kv-cache-memory-backend default"
        )
    return math.prod(one[: block_dims[0]])


def kv_tensor_regions(kv_cache_config, layer_regions: dict[str, int]) -> list[int]:
    """Regions of each KVCacheTensor, from those of the layers sharing it."""
    regions = []
    for tensor in kv_cache_config.kv_cache_tensors:
        found = {layer_regions[n] for n in tensor.shared_by if n in layer_regions}
        if len(found) != 1:
            raise NotImplementedError(
                f"VMM-backed KV memory needs one KV layout per tensor; the "
                f"layers {tensor.shared_by} have {sorted(found) or 'none'}; use "
                "--kv-cache-memory-backend default"
            )
        regions.append(found.pop())
    return regions


def attention_layer_regions(
    attn_groups: Iterable[Any], kernel_block_sizes: Sequence[int], cache_dtype: str
) -> dict[str, int]:
    """:func:`attention_kv_regions` of every layer of the model runner's
    attention groups (``backend``, ``kv_cache_spec``, ``layer_names``,
    ``kv_cache_group_id``)."""
    regions: dict[str, int] = {}
    for group in attn_groups:
        if group.kv_cache_group_id >= len(kernel_block_sizes):
            # Layers without KV cache.
            continue
        n = attention_kv_regions(
            group.backend,
            group.kv_cache_spec,
            kernel_block_sizes[group.kv_cache_group_id],
            cache_dtype,
        )
        regions.update(dict.fromkeys(group.layer_names, n))
    return regions
