# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's page-aware block pool as its tests build it, on a clock
the tests move."""

from typing import Any

from vllm.v1.kv_vmm.page_status import KVPageStatus, create_page_status
from vllm.v1.kv_vmm.pages import KVLedgerOptions, KVPagePolicy
from vllm.v1.kv_vmm.scheduler import PagedBlockPool

BPP = 4  # blocks per page
PAGE = 1 << 20  # device bytes of a page


class Clock:
    """A clock the tests move by hand: ``now``, in seconds."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_page_policy(
    num_pages: int,
    num_ranks: int,
    ahead_blocks: int = 8,
    headroom: int = 1,
    ledger: KVLedgerOptions | None = None,
) -> tuple[KVPagePolicy, KVPageStatus]:
    """A policy of ``num_pages`` pages of ``BPP`` blocks that gives pages
    back as soon as they are idle, with the page report its ``num_ranks``
    workers write: the ranks are played by the test through the report."""
    status = create_page_status(num_pages, tag="t")
    policy = KVPagePolicy(
        granularity=2 << 20,
        blocks_per_page=BPP,
        max_pages=num_pages,
        headroom_pages=headroom,
        shrink="idle",
        shrink_delay_s=0.0,
        device_page_bytes=PAGE,
        ahead_blocks=ahead_blocks,
        page_status_path=status.path,
        num_ranks=num_ranks,
        ledger=ledger,
    )
    return policy, status


def make_block_pool(
    policy: KVPagePolicy,
    num_blocks: int,
    clock: Clock | None = None,
    pool_class: type[PagedBlockPool] = PagedBlockPool,
    **pool_kwargs: Any,
) -> PagedBlockPool:
    """The block pool (``pool_class``) of ``policy`` with prefix caching, on
    a clock the test moves (a new :class:`Clock` unless ``clock``): backoffs,
    delays and rates then pass only when the test says so. ``pool_kwargs``:
    more arguments of the pool (a policy with a ledger needs its
    ``share_factory``)."""
    pool = pool_class(
        num_gpu_blocks=num_blocks,
        enable_caching=True,
        hash_block_size=16,
        policy=policy,
        **pool_kwargs,
    )
    pool.clock = Clock() if clock is None else clock
    return pool
