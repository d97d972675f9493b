# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The page policy of an engine: its page size, limits and device ledgers,
made once by the engine core for the scheduler and every rank.

The types the scheduler and the workers agree on live in
:mod:`vllm.v1.kv_vmm.page_policy`, the KV tensor layout in
:mod:`vllm.v1.kv_vmm.kv_layout`; both are importable from here too.
"""

import math
import os
from argparse import ArgumentTypeError
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.kv_cache_compat import parse_size
from vllm.v1.kv_vmm.geometry import KVPageGeometry
from vllm.v1.kv_vmm.kv_layout import (
    KV_SPLIT_REGIONS,
    KVBackingTensor,
    kv_backing_layout,
    kv_page_geometry,
    kv_tensor_layouts,
    verify_vmm_kv_config,
    virtual_kv_cache_config,
)
from vllm.v1.kv_vmm.page_policy import (
    HOST_DEVICE_KEY,
    KV_PAGE_GRANULARITY,
    KV_PAGE_MIN_CHUNK_BYTES,
    KV_PAGE_MIN_COUNT,
    KVDeviceShareOptions,
    KVLedgerOptions,
    KVPageOps,
    KVPagePolicy,
    KVPageShrinkPolicy,
    KVPageStats,
    KVShareOptions,
    KVSharePolicy,
    KVVmmOptions,
)

if TYPE_CHECKING:
    from vllm.config import SchedulerConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


__all__ = [
    "HOST_DEVICE_KEY",
    "KVBackingTensor",
    "KVDeviceShareOptions",
    "KVLedgerOptions",
    "KVPageOps",
    "KVPagePolicy",
    "KVPageShrinkPolicy",
    "KVPageStats",
    "KVShareOptions",
    "KVSharePolicy",
    "KVVmmOptions",
    "KV_PAGE_GRANULARITY",
    "KV_PAGE_MIN_CHUNK_BYTES",
    "KV_PAGE_MIN_COUNT",
    "KV_SPLIT_REGIONS",
    "initial_kv_pages",
    "kv_backing_layout",
    "kv_device_bytes",
    "kv_ledger_options",
    "kv_page_geometry",
    "kv_page_limit_arguments",
    "kv_page_limit_result",
    "kv_page_multiple",
    "kv_page_policy_for_engine",
    "kv_step_blocks",
    "kv_tensor_layouts",
    "make_kv_page_policy",
    "parse_kv_page_limit",
    "verify_vmm_kv_config",
    "virtual_kv_cache_config",
]


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


#: The largest runtime page limit, in pages or bytes: beyond any device, and
#: within what a request to the engine core can carry.
MAX_PAGE_LIMIT = 1 << 60


def kv_page_limit_arguments(
    max_pages: int | None = None, max_bytes: int | None = None
) -> tuple[int | None, int | None]:
    """Check the arguments of a runtime page limit before they reach the
    engine: exactly one of the two, each a whole number from 1 to 2^60
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
        if value > MAX_PAGE_LIMIT:
            raise ValueError(
                f"{name} must be at most {MAX_PAGE_LIMIT}; got {value} (a "
                "limit beyond the KV cache's capacity is lowered to it)"
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
    share_options: KVDeviceShareOptions | None = None,
) -> KVPagePolicy:
    """One policy for all ranks, budget = the blocks profiling found.

    A page is the smallest unit every rank can map (its tensors' regions in
    whole granules), times a multiple: ``--kv-cache-vmm-page-bytes`` when
    given, otherwise enough for physical allocations of ``min_chunk_bytes``
    per tensor region while the budget holds at least
    :data:`KV_PAGE_MIN_COUNT` pages. ``ahead_blocks``: see
    :attr:`KVPagePolicy.ahead_blocks`. ``device_keys``: each rank's device
    (see :func:`kv_device_bytes`), which byte figures are counted per.
    ``share_options``: the device sharing options, where the engine has them
    (:func:`kv_ledger_options`).
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
        ledger=kv_ledger_options(share_options, devices) if share_options else None,
    )


def kv_ledger_options(
    options: KVDeviceShareOptions, devices: dict[str, int]
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
    share_options: KVDeviceShareOptions | None = None,
) -> KVPagePolicy | None:
    """The policy the engine core gives the scheduler and every rank (the
    caller attaches it to each rank's ``KVCacheConfig`` before the workers
    allocate), None unless VMM is selected.

    With ``scheduler_config``, the scheduler keeps a step's worth of blocks
    mapped ahead of demand (:func:`kv_step_blocks`); without it, only the
    headroom. ``share_options``: the options of engines sharing a device
    (``--kv-cache-vmm-shared``), where the engine has them."""
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
    shared = share_options is not None and share_options.kv_cache_vmm_shared
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
        share_options=share_options,
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
        group=policy.ledger.group if policy.ledger is not None else None,
    )
    policy.page_status_path = status.path
    status.close()
    return policy
