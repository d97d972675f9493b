# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the scheduler and the workers agree on for VMM-backed KV memory.

The engine core fixes one :class:`KVPagePolicy` for every rank and the
scheduler before anything is allocated, so a page id means the same block
ids everywhere. The scheduler sends :class:`KVPageOps` in each step message;
every TP and PP rank applies them to its own shard of the KV memory: the
pages the step itself needs before its forward pass, the pages mapped ahead
of demand right after the forward pass is launched, so the driver calls
overlap the device's work (on the step's thread, or, where the scheduler
waits for every rank's report of them, on a thread of their own). No rank
guesses the world size.
"""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from vllm.v1.kv_cache_compat import kv_tensors_share_one_backing
from vllm.v1.kv_vmm.geometry import KVPageGeometry, KVTensorLayout

if TYPE_CHECKING:
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Granularity of the page arithmetic. 2 MiB is the host backend's default
#: and the CUDA VMM granularity of current data-center GPUs; the worker
#: refuses a backend whose granularity does not divide it.
KV_PAGE_GRANULARITY = 2 << 20

#: Smallest physical allocation per KV tensor region that pages are sized for
#: on CUDA when --kv-cache-vmm-page-bytes is not given: one granule, so a page
#: is the smallest unit every rank can map (128 MiB for Llama-3.1-8B, 144 MiB
#: for Qwen3-8B at 16-token blocks). The driver's cost is per call, not per
#: byte (cuMemCreate + cuMemMap + cuMemSetAccess, about 65 us per 2 MiB
#: allocation on an H100), and it stays off the critical path because pages
#: are mapped ahead of demand behind the forward pass (KVPagePolicy.
#: ahead_blocks); a larger floor trades elasticity (an idle engine keeps the
#: null block's page and the headroom) for fewer calls.
KV_PAGE_MIN_CHUNK_BYTES = KV_PAGE_GRANULARITY

#: ... but automatic sizing keeps at least this many pages in the KV budget,
#: so a small KV cache stays elastic.
KV_PAGE_MIN_COUNT = 16

KVPageShrinkPolicy = Literal["idle", "never"]


@dataclass
class KVPagePolicy:
    """Page size and physical budget shared by the scheduler and all ranks."""

    granularity: int
    blocks_per_page: int
    """Block ids per page, the same on every rank (a multiple of each rank's
    own smallest mappable unit)."""
    max_pages: int
    """Physical limit in pages; may change at runtime."""
    headroom_pages: int = 1
    """Free mapped pages the scheduler keeps ahead of demand."""
    shrink: KVPageShrinkPolicy = "idle"
    shrink_delay_s: float = 10.0
    """With shrink "idle": seconds the pool must stay idle before free pages
    beyond the headroom are given back (0 = at once)."""
    page_bytes: int = 0
    """Physical bytes one page takes, summed over the engine's ranks (for
    the mapped-bytes metric; 0 when unknown)."""
    ahead_blocks: int = 0
    """Free blocks the scheduler keeps mapped while requests run: the most
    one step can allocate, so that a step never waits for a page map in
    steady state (see :func:`kv_step_blocks`). At least the headroom."""

    page_status_path: str | None = None
    """Pages are handed out only once every rank reported them mapped in this
    file (:mod:`vllm.v1.kv_vmm.page_status`; set by the engine core). None,
    or a rank that cannot open it (another host): pages mapped ahead from
    the next step on, as the workers map them in order."""
    num_ranks: int = 1
    """Ranks that report each page (with :attr:`page_status_path`)."""
    ledger: "KVLedgerOptions | None" = None
    """The device ledgers this engine joins (``--kv-cache-vmm-shared``)."""

    @property
    def ahead_pages(self) -> int:
        """Pages that hold :attr:`ahead_blocks` (the headroom at least)."""
        pages = -(-self.ahead_blocks // self.blocks_per_page)
        return max(self.headroom_pages, pages)


@dataclass
class KVLedgerOptions:
    """How an engine shares its devices' KV memory with other engines
    (:mod:`vllm.v1.kv_vmm.ledger`)."""

    devices: dict[str, int]
    """Ledger key (device UUID, or ``host``) -> bytes one page takes there."""
    capacity_bytes: int | None = None
    """KV memory the engines of a device share, if this engine creates its
    ledger; None: this engine's own budget."""
    floor_bytes: int | None = None
    """Memory reserved for this engine on each device; None: its startup
    mapping."""
    limit_bytes: int | None = None
    """Most memory this engine maps on each device; None: its page limit."""
    name: str = ""


@dataclass
class KVPageOps:
    """Page changes of one step, in the order every rank applies them.

    ``unmap`` then ``map`` before the forward pass (``map``: pages holding
    blocks this step uses); ``ahead`` right after the forward pass is
    launched (pages whose blocks the scheduler hands out from the next step
    on, so their driver calls overlap the device's work).
    """

    map: list[int] = field(default_factory=list)
    unmap: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.map or self.unmap or self.ahead)


@dataclass
class KVPageStats:
    """The scheduler's page counters, reported with the scheduler stats."""

    mapped_pages: int
    page_limit: int
    mapped_bytes: int
    """Physical KV memory mapped now, summed over the engine's ranks."""
    pages_mapped_total: int
    """Pages mapped since startup (the startup mapping included)."""
    pages_unmapped_total: int
    map_failures_total: int = 0
    """Pages a rank could not map (the device had no memory for them)."""
    floor_bytes: int = 0
    """With a device ledger: this engine's floor, summed over devices."""
    ledger: dict[str, Any] | None = None
    """With a device ledger: each device's ledger as the engine last read
    it (``LedgerState.to_json()`` per device key)."""


#: Regions assumed for a per-layer KV tensor whose attention backend the
#: caller does not know (the engine core, before the workers allocate): a K/V
#: split ``(2, num_blocks, ...)``. Whole granules in both halves of a block
#: range are also whole granules in a block-outermost tensor, so pages sized
#: for it fit either layout.
KV_SPLIT_REGIONS = 2


def _backing_tensors(kv_cache_config: "KVCacheConfig") -> list[Any]:
    # The fields of a shared backing (offset, layers, layer_stride,
    # block_stride, host_resident) exist only on releases that have one; this
    # module is the same for every release, so they are read untyped.
    return list(kv_cache_config.kv_cache_tensors)


def _vmm_options(cache_config: "CacheConfig") -> Any:
    # The --kv-cache-vmm-* options come with the patch that adds the VMM
    # backend; releases that carry only these modules have no such fields.
    return cache_config


def verify_vmm_kv_config(vllm_config: "VllmConfig") -> None:
    """Refuse, at config time, what VMM-backed KV memory cannot honour.

    Sleep mode frees the KV cache by allocating it inside the cumem
    allocator's ``kv_cache`` pool (``kv_cache_allocation_context``) and
    discarding that pool on sleep. VMM KV memory is reserved and mapped by
    the KV page table, outside any allocator pool, so a sleeping engine would
    keep all of its mapped KV pages: sleep would silently free nothing.
    """
    if _vmm_options(vllm_config.cache_config).kv_cache_memory_backend != "vmm":
        return
    model_config = vllm_config.model_config
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

    tensors = [
        replace(
            t,
            size=geometry.tensor_bytes[0],
            offset=rescale(t.offset),
            layer_stride=rescale(t.layer_stride),
        )
        for t in _backing_tensors(kv_cache_config)
    ]
    return replace(
        kv_cache_config, num_blocks=geometry.num_blocks, kv_cache_tensors=tensors
    )


def initial_kv_pages(policy: KVPagePolicy) -> list[int]:
    """Pages mapped at startup on every rank, before any step message: the
    null block's page and a step's worth of pages ahead, so the first burst
    does not map on its critical path. An idle engine gives the pages beyond
    the headroom back after the shrink delay."""
    return list(range(min(1 + policy.ahead_pages, max(policy.max_pages, 1))))


def kv_step_blocks(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_sizes: Sequence[int],
) -> int:
    """The most blocks one scheduler step can allocate from the shared pool.

    Each KV cache group allocates its own blocks for the step's tokens: at
    most ``ceil(tokens / block_size)`` plus one per request whose tokens
    start inside a partly filled block, and a step schedules at most
    ``min(max_num_seqs, max_num_batched_tokens)`` requests.
    """
    num_reqs = min(max_num_seqs, max_num_batched_tokens)
    return sum(-(-max_num_batched_tokens // bs) + num_reqs for bs in block_sizes)


def kv_page_multiple(
    cache_config: "CacheConfig",
    unit_geometries: "list[KVPageGeometry]",
    budget_units: int,
    min_chunk_bytes: int,
) -> int:
    """How many smallest mappable units make one page."""
    # One unit per rank: its geometry's pages times pages_per_segment.
    page_bytes = _vmm_options(cache_config).kv_cache_vmm_page_bytes
    if page_bytes is not None:
        # At least the asked size on the rank with the largest share.
        largest = max(g.page_bytes * g.pages_per_segment for g in unit_geometries)
        multiple = max(1, -(-page_bytes // largest))
        if multiple > budget_units:
            raise ValueError(
                f"--kv-cache-vmm-page-bytes {page_bytes} is larger than the KV "
                f"cache ({budget_units * largest} bytes on the largest rank); "
                "give a smaller page size or leave it unset"
            )
        return multiple
    smallest_chunk = min(
        b * g.pages_per_segment for g in unit_geometries for b in g.page_region_bytes
    )
    multiple = -(-min_chunk_bytes // smallest_chunk) if min_chunk_bytes else 1
    return max(1, min(multiple, budget_units // KV_PAGE_MIN_COUNT))


def make_kv_page_policy(
    cache_config: "CacheConfig",
    kv_cache_configs: "list[KVCacheConfig]",
    granularity: int = KV_PAGE_GRANULARITY,
    min_chunk_bytes: int = 0,
    ahead_blocks: int = 0,
    device_keys: Sequence[str] | None = None,
) -> KVPagePolicy:
    """One policy for all ranks, budget = the blocks profiling found.

    A page is the smallest unit every rank can map (its tensors' regions in
    whole granules), times a multiple: ``--kv-cache-vmm-page-bytes`` when
    given, otherwise enough for physical allocations of ``min_chunk_bytes``
    per tensor region while the budget holds at least
    :data:`KV_PAGE_MIN_COUNT` pages. ``ahead_blocks``: see
    :attr:`KVPagePolicy.ahead_blocks`.
    """
    unit = math.lcm(
        *(kv_page_geometry(c, granularity).blocks_per_page for c in kv_cache_configs)
    )
    num_blocks = min(c.num_blocks for c in kv_cache_configs)
    unit_geometries = [kv_page_geometry(c, granularity, unit) for c in kv_cache_configs]
    blocks_per_page = unit * kv_page_multiple(
        cache_config, unit_geometries, num_blocks // unit, min_chunk_bytes
    )
    budget_pages = max(1, num_blocks // blocks_per_page)
    options = _vmm_options(cache_config)
    max_pages = options.kv_cache_vmm_max_pages
    if max_pages is None:
        max_pages = budget_pages
    rank_page_bytes = []
    for config in kv_cache_configs:
        geometry = kv_page_geometry(config, granularity, blocks_per_page)
        rank_page_bytes.append(geometry.page_bytes * geometry.pages_per_segment)
    page_bytes = sum(rank_page_bytes)
    limit_bytes = getattr(options, "kv_cache_vmm_limit_bytes", None)
    if limit_bytes is not None:
        # A limit in bytes, on the rank with the largest share.
        max_pages = min(max_pages, max(1, limit_bytes // max(rank_page_bytes)))
    return KVPagePolicy(
        granularity=granularity,
        blocks_per_page=blocks_per_page,
        max_pages=max_pages,
        headroom_pages=options.kv_cache_vmm_headroom_pages,
        shrink=options.kv_cache_vmm_shrink,
        shrink_delay_s=options.kv_cache_vmm_shrink_delay,
        page_bytes=page_bytes,
        ahead_blocks=ahead_blocks,
        num_ranks=len(kv_cache_configs),
        ledger=kv_ledger_options(options, rank_page_bytes, device_keys),
    )


def kv_ledger_options(
    options: Any, rank_page_bytes: Sequence[int], device_keys: Sequence[str] | None
) -> KVLedgerOptions | None:
    """The ledger part of the policy with ``--kv-cache-vmm-shared``; the
    ranks' devices are ``device_keys`` (one per rank, ``host`` for all when
    None)."""
    if not getattr(options, "kv_cache_vmm_shared", False):
        return None
    if device_keys is None:
        device_keys = ["host"] * len(rank_page_bytes)
    devices: dict[str, int] = {}
    for key, nbytes in zip(device_keys, rank_page_bytes):
        devices[key] = devices.get(key, 0) + nbytes
    return KVLedgerOptions(
        devices=devices,
        capacity_bytes=getattr(options, "kv_cache_vmm_shared_bytes", None),
        floor_bytes=getattr(options, "kv_cache_vmm_floor_bytes", None),
        limit_bytes=getattr(options, "kv_cache_vmm_limit_bytes", None),
        name=f"pid {os.getpid()}",
    )


def set_kv_page_policy(
    cache_config: "CacheConfig",
    kv_cache_configs: "list[KVCacheConfig]",
    scheduler_config: "SchedulerConfig | None" = None,
) -> KVPagePolicy | None:
    """Attach the policy to every KV cache config when VMM is selected.

    With ``scheduler_config``, the scheduler keeps a step's worth of blocks
    mapped ahead of demand (:func:`kv_step_blocks`); without it, only the
    headroom."""
    if _vmm_options(cache_config).kv_cache_memory_backend != "vmm":
        return None
    from vllm.platforms import current_platform

    ahead_blocks = 0
    if scheduler_config is not None:
        ahead_blocks = kv_step_blocks(
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_num_seqs,
            [
                group.kv_cache_spec.block_size
                for group in kv_cache_configs[0].kv_cache_groups
            ],
        )
    device_keys = None
    shared = getattr(cache_config, "kv_cache_vmm_shared", False)
    if shared and current_platform.is_cuda():
        # One rank per visible device, in order (a single host).
        device_keys = [
            current_platform.get_device_uuid(rank)
            for rank in range(len(kv_cache_configs))
        ]
    policy = make_kv_page_policy(
        cache_config,
        kv_cache_configs,
        min_chunk_bytes=KV_PAGE_MIN_CHUNK_BYTES if current_platform.is_cuda() else 0,
        ahead_blocks=ahead_blocks,
        device_keys=device_keys,
    )
    # Pages are handed out once every rank reported them mapped; a page the
    # device has no memory for is then not available for now (the scheduler
    # docstring, vllm/v1/kv_vmm/scheduler.py).
    from vllm.v1.kv_vmm.page_status import create_page_status

    num_blocks = max(c.num_blocks for c in kv_cache_configs)
    num_pages = -(-num_blocks // policy.blocks_per_page)
    status = create_page_status(num_pages, tag=f"{id(policy):x}")
    policy.page_status_path = status.path
    status.close()
    for config in kv_cache_configs:
        # A field of KVCacheConfig on releases with the VMM patch.
        target: Any = config
        target.kv_page_policy = policy
    return policy
