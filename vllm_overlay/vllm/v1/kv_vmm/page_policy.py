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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from vllm.logger import init_logger

if TYPE_CHECKING:
    pass

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
    kv_cache_vmm_limit_bytes: int | None


class KVDeviceShareOptions(Protocol):
    """What engines sharing a device's KV memory read of vLLM's
    ``CacheConfig`` (``--kv-cache-vmm-shared*``,
    ``--kv-cache-vmm-floor-bytes``; see :mod:`vllm.v1.kv_vmm.ledger`). A
    protocol of its own: the patch that adds these fields comes after the one
    that adds :class:`KVVmmOptions`."""

    kv_cache_vmm_shared: bool
    kv_cache_vmm_shared_bytes: int | None
    kv_cache_vmm_floor_bytes: int | None
    kv_cache_vmm_shared_group: str | None


KVSharePolicy = Literal["fair", "first-come"]


class KVShareOptions(Protocol):
    """What the fair share of a device among engines reads of vLLM's
    ``CacheConfig`` (``--kv-cache-vmm-share-*``, ``--kv-cache-vmm-reclaim-*``;
    see :mod:`vllm.v1.kv_vmm.fair_share`). A protocol of its own: the
    patch that adds these fields comes after the one that adds
    :class:`KVVmmOptions`."""

    kv_cache_vmm_share_policy: KVSharePolicy
    kv_cache_vmm_share_weight: float
    kv_cache_vmm_reclaim_bytes_per_s: int
    kv_cache_vmm_reclaim_preempt_delay: float


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
    share_reclaimed_pages_total: int = 0
    """Pages given back because another engine below its fair share waited
    (``--kv-cache-vmm-share-policy fair``)."""
    ledger: dict[str, Any] | None = None
    """With a device ledger: each device's ledger as the engine last read
    it (``LedgerState.to_json()`` per device key; ``LedgerState.report()``,
    with each engine's fair share, under the fair policy)."""


#: Regions assumed for a per-layer KV tensor whose attention backend the
#: caller does not know (the engine core, before the workers allocate): a K/V
#: split ``(2, num_blocks, ...)``. Whole granules in both halves of a block
#: range are also whole granules in a block-outermost tensor, so pages sized
