# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache configs as VMM-backed KV memory lays them out: each tensor's
regions and block strides, the page geometry, and the virtual config the
workers allocate over a reservation of whole pages."""

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, TypeGuard

from vllm.logger import init_logger
from vllm.v1.kv_cache_compat import kv_tensors_share_one_backing
from vllm.v1.kv_vmm.geometry import KVPageGeometry, KVTensorLayout
from vllm.v1.kv_vmm.page_policy import KVVmmOptions

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


#: for it fit either layout.
KV_SPLIT_REGIONS = 2


class KVBackingTensor(Protocol):
    """A ``KVCacheTensor`` of releases that place all KV tensors of a rank in
    one backing allocation (vLLM 0.32 and later): where its layers lie in
    that allocation. Releases before have only ``size`` and ``shared_by``."""

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int
    host_resident: bool


def _is_backing(tensors: Sequence[object]) -> TypeGuard[Sequence[KVBackingTensor]]:
    return all(
        hasattr(t, name)
        for t in tensors
        for name in ("offset", "layers", "layer_stride", "block_stride")
    )


def _backing_tensors(
    kv_cache_config: "KVCacheConfig",
) -> Sequence[KVBackingTensor]:
    tensors = kv_cache_config.kv_cache_tensors
    if not _is_backing(tensors):
        raise _unsupported(kv_cache_config)
    return tensors


def verify_vmm_kv_config(
    options: KVVmmOptions, model_config: "ModelConfig | None"
) -> None:
    """Refuse, at config time, what VMM-backed KV memory cannot honour.

    Sleep mode frees the KV cache by allocating it inside the cumem
    allocator's ``kv_cache`` pool (``kv_cache_allocation_context``) and
    discarding that pool on sleep. VMM KV memory is reserved and mapped by
    the KV page table, outside any allocator pool, so a sleeping engine would
    keep all of its mapped KV pages: sleep would silently free nothing.
    """
    if options.kv_cache_memory_backend != "vmm":
        return
    if model_config is not None and model_config.enable_sleep_mode:
        raise ValueError(
            "--kv-cache-memory-backend vmm cannot be combined with "
            "--enable-sleep-mode: sleep mode frees the KV cache through the "
            "cumem allocator's pool, and VMM-backed KV pages are mapped "
            "outside it, so a sleeping engine would keep its KV memory. "
            "Either drop --enable-sleep-mode (with --kv-cache-vmm-shrink "
            "idle, an idle VMM engine already unmaps its free KV pages), or "
            "use --kv-cache-memory-backend default to sleep."
        )


def _unsupported(kv_cache_config: "KVCacheConfig") -> NotImplementedError:
    return NotImplementedError(
        f"VMM-backed KV memory (--kv-cache-memory-backend vmm) does not "
        f"support this KV cache layout ({kv_cache_config.kv_cache_tensors}); "
        "use --kv-cache-memory-backend default"
    )


def kv_backing_layout(kv_cache_config: "KVCacheConfig") -> KVTensorLayout:
    """Layout of the one backing allocation all KV tensors of a rank share.

    Block ``b`` of layer ``l`` lives at ``offset + l * layer_stride + b *
    block_stride``. Block-outermost layouts are one region (all layers of a
    block are adjacent); layer-outermost layouts are one region per layer
    slot, each holding every block.
    """
    tensors = _backing_tensors(kv_cache_config)
    num_blocks = kv_cache_config.num_blocks
    block_strides = {t.block_stride for t in tensors}
    if len(block_strides) != 1 or any(t.host_resident for t in tensors):
        raise _unsupported(kv_cache_config)
    block_stride = block_strides.pop()
    region_bytes = num_blocks * block_stride
    size = tensors[0].size
    if size % region_bytes:
        raise _unsupported(kv_cache_config)
    num_regions = size // region_bytes
    if num_regions > 1 and any(
        t.offset % region_bytes or (len(t.layers) > 1 and t.layer_stride % region_bytes)
        for t in tensors
    ):
        raise _unsupported(kv_cache_config)
    return KVTensorLayout(
        block_bytes=num_regions * block_stride, num_regions=num_regions
    )


def kv_tensor_layouts(
    kv_cache_config: "KVCacheConfig", num_regions: Sequence[int] | None = None
) -> list[KVTensorLayout]:
    """Layouts of the KV memory a rank allocates, one per allocation.

    With one backing allocation per rank, the layout follows from the
    config. With one tensor per KVCacheTensor, the attention backend decides
    how many regions each has: ``num_regions`` (one per tensor, from the
    worker), or :data:`KV_SPLIT_REGIONS` when unknown.
    """
    if kv_tensors_share_one_backing(kv_cache_config):
        return [kv_backing_layout(kv_cache_config)]
    tensors = kv_cache_config.kv_cache_tensors
    num_blocks = kv_cache_config.num_blocks
    if num_regions is None:
        num_regions = [KV_SPLIT_REGIONS] * len(tensors)
    if len(num_regions) != len(tensors) or any(
        t.size % num_blocks or (t.size // num_blocks) % r
        for t, r in zip(tensors, num_regions)
    ):
        raise _unsupported(kv_cache_config)
    return [
        KVTensorLayout(block_bytes=t.size // num_blocks, num_regions=r)
        for t, r in zip(tensors, num_regions)
    ]


def kv_page_geometry(
    kv_cache_config: "KVCacheConfig",
    granularity: int,
    blocks_per_page: int | None = None,
    num_regions: Sequence[int] | None = None,
) -> KVPageGeometry:
    """The page geometry of one rank; ``blocks_per_page`` (the policy's)
    must be a multiple of the rank's own smallest mappable unit."""
    layouts = kv_tensor_layouts(kv_cache_config, num_regions)
    unit = KVPageGeometry(layouts, 1, granularity).blocks_per_page
    if blocks_per_page is None:
        blocks_per_page = unit
    if blocks_per_page % unit:
        raise ValueError(
            f"{blocks_per_page} blocks per page is not a multiple of this "
            f"rank's mappable unit of {unit} blocks"
        )
    return KVPageGeometry(
        layouts,
        kv_cache_config.num_blocks,
        granularity,
        pages_per_segment=blocks_per_page // unit,
    )


def virtual_kv_cache_config(
    kv_cache_config: "KVCacheConfig", geometry: KVPageGeometry
) -> "KVCacheConfig":
    """``kv_cache_config`` addressing ``geometry.num_blocks`` blocks.

    Block ids past the pool's are never handed out; they only round the
    regions up to whole pages so that a page is whole granules everywhere.
    """
    if not kv_tensors_share_one_backing(kv_cache_config):
        sizes = geometry.tensor_bytes
        tensors = [
            replace(t, size=nbytes)
            for t, nbytes in zip(kv_cache_config.kv_cache_tensors, sizes)
        ]
        return replace(
            kv_cache_config, num_blocks=geometry.num_blocks, kv_cache_tensors=tensors
        )
    layout = geometry.layouts[0]
    block_stride = layout.region_block_bytes
    old_region = kv_cache_config.num_blocks * block_stride
    new_region = geometry.num_blocks * block_stride

    def rescale(nbytes: int) -> int:
        if layout.num_regions == 1:
            return nbytes
        return (nbytes // old_region) * new_region + nbytes % old_region

    config = replace(
        kv_cache_config,
        num_blocks=geometry.num_blocks,
        kv_cache_tensors=[copy.copy(t) for t in kv_cache_config.kv_cache_tensors],
    )
    for t in _backing_tensors(config):  # the copies
        t.size = geometry.tensor_bytes[0]
        t.offset = rescale(t.offset)
        t.layer_stride = rescale(t.layer_stride)
    return config
