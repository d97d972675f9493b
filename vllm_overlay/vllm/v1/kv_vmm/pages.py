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

import copy
import math
import os
from argparse import ArgumentTypeError
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard

from vllm.logger import init_logger
from vllm.v1.kv_cache_compat import kv_tensors_share_one_backing, parse_size
from vllm.v1.kv_vmm.geometry import KVPageGeometry, KVTensorLayout

if TYPE_CHECKING:
    from vllm.config import ModelConfig, SchedulerConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)

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

#: The ledger key of the host backend's memory (every rank of a CPU engine).
HOST_DEVICE_KEY = "host"


class KVVmmOptions(Protocol):
    """What VMM-backed KV memory reads of vLLM's ``CacheConfig``: the options
    the VMM patch adds to it (``--kv-cache-memory-backend``,
    ``--kv-cache-vmm-*``) and ``--gpu-memory-utilization``.

    The patch passes its ``CacheConfig``, which the type checker matches
    field by field against this protocol; these modules are the same on
    every release, including releases that carry them without the patch
    (and whose ``CacheConfig`` has none of these fields).

    Byte sizes are bytes of KV memory per device (see
    :attr:`KVPagePolicy.device_page_bytes`).
    """

    gpu_memory_utilization: float
    kv_cache_memory_backend: Literal["default", "vmm"]
    kv_cache_vmm_headroom_pages: int
    kv_cache_vmm_page_bytes: int | None
    kv_cache_vmm_max_pages: int | None
    kv_cache_vmm_shrink: KVPageShrinkPolicy
    kv_cache_vmm_shrink_delay: float
    kv_cache_vmm_shared: bool
    kv_cache_vmm_shared_bytes: int | None
    kv_cache_vmm_floor_bytes: int | None
    kv_cache_vmm_limit_bytes: int | None
    kv_cache_vmm_shared_group: str | None


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
    device_page_bytes: int = 0
    """Bytes one page takes on the device that holds the most of this
    engine's KV memory (0 when unknown): with one rank per GPU, the largest
    rank's share; where several ranks share a device (the host backend's
    ``host``), the sum of theirs. The unit of every byte figure of VMM-backed
    KV memory (the options, the runtime limit, the page counters, the
    metrics, and each device's ledger): a limit of ``n`` bytes is
    ``n // device_page_bytes`` pages."""
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
    group: str | None = None
    """``--kv-cache-vmm-shared-group``: the ledgers of the engines of this
    group's users; None: this user's own."""


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
    """KV memory mapped now, in bytes per device (the device that holds the
    most of this engine's KV memory)."""
    pages_mapped_total: int
    """Pages mapped since startup (the startup mapping included)."""
    pages_unmapped_total: int
    map_failures_total: int = 0
    """Pages a rank could not map (the device had no memory for them)."""
    floor_bytes: int = 0
    """With a device ledger: this engine's floor, in bytes per device (on
    the device that holds the most of its KV memory)."""
    limit_bytes: int = 0
    """The page limit in bytes per device."""
    ledger: dict[str, Any] | None = None
    """With a device ledger: each device's ledger as the engine last read
    it (``LedgerState.to_json()`` per device key)."""


#: Regions assumed for a per-layer KV tensor whose attention backend the
#: caller does not know (the engine core, before the workers allocate): a K/V
#: split ``(2, num_blocks, ...)``. Whole granules in both halves of a block
#: range are also whole granules in a block-outermost tensor, so pages sized
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


def kv_device_bytes(
    rank_bytes: Sequence[int], device_keys: Sequence[str] | None = None
) -> dict[str, int]:
    """Bytes per device of a per-rank figure: the ranks on one device summed.

    ``device_keys``: each rank's device (a device UUID, ``host`` for the host
    backend); None: every rank on the host device, as with the CPU engine.
    """
    if device_keys is None:
        device_keys = [HOST_DEVICE_KEY] * len(rank_bytes)
    if len(device_keys) != len(rank_bytes):
        raise ValueError(f"{len(device_keys)} device keys for {len(rank_bytes)} ranks")
    devices: dict[str, int] = {}
    for key, nbytes in zip(device_keys, rank_bytes):
        devices[key] = devices.get(key, 0) + nbytes
    return devices


def kv_page_multiple(
    options: KVVmmOptions,
    unit_geometries: "list[KVPageGeometry]",
    budget_units: int,
    min_chunk_bytes: int,
    device_keys: Sequence[str] | None = None,
) -> int:
    """How many smallest mappable units make one page.

    ``unit_geometries``: one per rank; ``device_keys``: each rank's device
    (see :func:`kv_device_bytes`), for ``--kv-cache-vmm-page-bytes``, which
    is in bytes per device.
    """
    # One unit per rank: its geometry's pages times pages_per_segment.
    page_bytes = options.kv_cache_vmm_page_bytes
    if page_bytes is not None:
        # At least the asked size on the device with the largest share.
        largest = max(
            kv_device_bytes(
                [g.page_bytes * g.pages_per_segment for g in unit_geometries],
                device_keys,
            ).values()
        )
        multiple = max(1, -(-page_bytes // largest))
        if multiple > budget_units:
            raise ValueError(
                f"--kv-cache-vmm-page-bytes {page_bytes} is larger than the KV "
                f"cache ({budget_units * largest} bytes per device); "
                "give a smaller page size or leave it unset"
            )
        return multiple
    smallest_chunk = min(
        b * g.pages_per_segment for g in unit_geometries for b in g.page_region_bytes
    )
    multiple = -(-min_chunk_bytes // smallest_chunk) if min_chunk_bytes else 1
    return max(1, min(multiple, budget_units // KV_PAGE_MIN_COUNT))


def _check_one_of(max_pages: object, max_bytes: object) -> None:
    if (max_pages is None) == (max_bytes is None):
        raise ValueError(
            "give the KV cache limit either in pages (max_pages) or in bytes "
            "per device (max_bytes), not "
            f"{'both' if max_pages is not None else 'neither'}"
        )


def kv_page_limit_arguments(
    max_pages: int | None = None, max_bytes: int | None = None
) -> tuple[int | None, int | None]:
    """Check the arguments of a runtime page limit before they reach the
    engine: exactly one of the two, each a whole number of at least 1
    (``max_bytes`` in bytes per device). Returns them; raises ``ValueError``
    naming the problem and the fix.

    Whether ``max_bytes`` is at least one page, and whether the limit is
    beyond the KV cache's capacity, only the engine knows
    (``PagedBlockPool.set_page_limit``)."""
    _check_one_of(max_pages, max_bytes)
    for name, value, unit in (
        ("max_pages", max_pages, "pages"),
        ("max_bytes", max_bytes, "bytes per device"),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be a whole number of {unit}, not {value!r}")
        if value < 1:
            raise ValueError(
                f"{name} must be at least 1 (the KV cache keeps the null "
                f"block's page mapped); got {value}"
            )
    return max_pages, max_bytes


def parse_kv_page_limit(
    max_pages: str | None = None, max_bytes: str | None = None
) -> tuple[int | None, int | None]:
    """The query of ``POST /kv_cache/page_limit``, checked as
    :func:`kv_page_limit_arguments` checks the Python API's arguments:
    ``max_pages`` a whole number, ``max_bytes`` a size in bytes per device as
    vLLM's own options read it (``8589934592``, ``8G`` = 8 GiB, ``8g`` =
    8 * 10^9 bytes). Raises ``ValueError`` with the message for the client."""
    _check_one_of(max_pages, max_bytes)
    pages = nbytes = None
    if max_pages is not None:
        try:
            pages = int(max_pages)
        except ValueError:
            raise ValueError(
                f"max_pages must be a whole number of pages, not {max_pages!r}"
            ) from None
    if max_bytes is not None:
        try:
            nbytes = parse_size(max_bytes)
        except (ValueError, ArgumentTypeError):
            raise ValueError(
                "max_bytes must be a size in bytes per device (e.g. 8589934592, "
                f"8G = 8 GiB, 8g = 8*10^9 bytes), not {max_bytes!r}"
            ) from None
    return kv_page_limit_arguments(pages, nbytes)


def kv_page_limit_result(result: dict[str, int] | str) -> dict[str, int]:
    """The engine core's answer to a runtime page limit: the page counters,
    or (a str) why it refused the limit, raised here as ``ValueError`` (over
    a process boundary a utility call's exception would reach the client as
    a bare ``Exception``)."""
    if isinstance(result, str):
        raise ValueError(result)
    return result


def _limit_pages(
    max_pages: int | None,
    limit_bytes: int | None,
    device_page_bytes: int,
    capacity_pages: int,
    default_pages: int,
) -> int:
    """The page limit of ``--kv-cache-vmm-max-pages`` and
    ``--kv-cache-vmm-limit-bytes`` (the smaller of the two; the KV budget
    without either). A limit beyond the KV cache's capacity is lowered to it,
    with a warning, as the runtime limit is; one below a page is refused."""
    pages = default_pages if max_pages is None else max_pages
    if limit_bytes is not None:
        if limit_bytes < device_page_bytes:
            raise ValueError(
                f"--kv-cache-vmm-limit-bytes {limit_bytes} is less than one KV "
                f"cache page ({device_page_bytes} bytes per device); give at "
                f"least {device_page_bytes} or leave it unset"
            )
        pages = min(pages, limit_bytes // device_page_bytes)
    if pages > capacity_pages:
        logger.warning(
            "KV page limit of %d pages (--kv-cache-vmm-max-pages / "
            "--kv-cache-vmm-limit-bytes) is beyond the KV cache's capacity "
            "of %d pages (%d bytes per device); the limit is %d pages",
            pages,
            capacity_pages,
            capacity_pages * device_page_bytes,
            capacity_pages,
        )
        pages = capacity_pages
    return pages


def make_kv_page_policy(
    options: KVVmmOptions,
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
    :attr:`KVPagePolicy.ahead_blocks`. ``device_keys``: each rank's device
    (see :func:`kv_device_bytes`), which byte figures are counted per.
    """
    unit = math.lcm(
        *(kv_page_geometry(c, granularity).blocks_per_page for c in kv_cache_configs)
    )
    num_blocks = min(c.num_blocks for c in kv_cache_configs)
    unit_geometries = [kv_page_geometry(c, granularity, unit) for c in kv_cache_configs]
    blocks_per_page = unit * kv_page_multiple(
        options, unit_geometries, num_blocks // unit, min_chunk_bytes, device_keys
    )
    rank_page_bytes = []
    for config in kv_cache_configs:
        geometry = kv_page_geometry(config, granularity, blocks_per_page)
        rank_page_bytes.append(geometry.page_bytes * geometry.pages_per_segment)
    devices = kv_device_bytes(rank_page_bytes, device_keys)
    device_page_bytes = max(devices.values())
    max_pages = _limit_pages(
        options.kv_cache_vmm_max_pages,
        options.kv_cache_vmm_limit_bytes,
        device_page_bytes,
        capacity_pages=-(-num_blocks // blocks_per_page),
        default_pages=max(1, num_blocks // blocks_per_page),
    )
    return KVPagePolicy(
        granularity=granularity,
        blocks_per_page=blocks_per_page,
        max_pages=max_pages,
        headroom_pages=options.kv_cache_vmm_headroom_pages,
        shrink=options.kv_cache_vmm_shrink,
        shrink_delay_s=options.kv_cache_vmm_shrink_delay,
        device_page_bytes=device_page_bytes,
        ahead_blocks=ahead_blocks,
        num_ranks=len(kv_cache_configs),
        ledger=kv_ledger_options(options, devices),
    )


def kv_ledger_options(
    options: KVVmmOptions, devices: dict[str, int]
) -> KVLedgerOptions | None:
    """The ledger part of the policy with ``--kv-cache-vmm-shared``;
    ``devices``: the bytes of one page on each of the engine's devices."""
    if not options.kv_cache_vmm_shared:
        return None
    return KVLedgerOptions(
        devices=dict(devices),
        capacity_bytes=options.kv_cache_vmm_shared_bytes,
        floor_bytes=options.kv_cache_vmm_floor_bytes,
        # The page limit holds --kv-cache-vmm-limit-bytes already; each
        # device's ledger shows it as pages times that device's page bytes.
        limit_bytes=None,
        name=f"pid {os.getpid()}",
        group=options.kv_cache_vmm_shared_group,
    )


def kv_page_policy_for_engine(
    options: KVVmmOptions,
    kv_cache_configs: "list[KVCacheConfig]",
    scheduler_config: "SchedulerConfig | None" = None,
) -> KVPagePolicy | None:
    """The policy the engine core gives the scheduler and every rank (the
    caller attaches it to each rank's ``KVCacheConfig`` before the workers
    allocate), None unless VMM is selected.

    With ``scheduler_config``, the scheduler keeps a step's worth of blocks
    mapped ahead of demand (:func:`kv_step_blocks`); without it, only the
    headroom."""
    if options.kv_cache_memory_backend != "vmm":
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
    shared = options.kv_cache_vmm_shared
    num_ranks = len(kv_cache_configs)
    device_keys = [HOST_DEVICE_KEY] * num_ranks  # the host backend
    if current_platform.is_cuda():
        # One rank per device; with a ledger, one rank per visible device,
        # in order (a single host), named as the ledgers are.
        device_keys = [
            current_platform.get_device_uuid(rank) if shared else f"cuda:{rank}"
            for rank in range(num_ranks)
        ]
    policy = make_kv_page_policy(
        options,
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
    status = create_page_status(
        num_pages,
        tag=f"{id(policy):x}",
        group=options.kv_cache_vmm_shared_group if shared else None,
    )
    policy.page_status_path = status.path
    status.close()
    return policy
