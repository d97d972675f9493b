# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The page-aware block pool: what the scheduler maps, unmaps and admits."""

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_vmm import pool_limits
from vllm.v1.kv_vmm.pages import KVPageOps, KVPagePolicy
from vllm.v1.kv_vmm.scheduler import PagedBlockPool

BPP = 4  # blocks per page


def make_pool(
    num_blocks: int = 32,
    headroom: int = 1,
    max_pages: int | None = None,
    shrink: str = "idle",
    shrink_delay_s: float = 0.0,
    enable_caching: bool = True,
    ahead_blocks: int = 0,
) -> PagedBlockPool:
    policy = KVPagePolicy(
        granularity=2 << 20,
        blocks_per_page=BPP,
        max_pages=max_pages if max_pages is not None else -(-num_blocks // BPP),
        headroom_pages=headroom,
        shrink=shrink,  # type: ignore[arg-type]
        shrink_delay_s=shrink_delay_s,
        ahead_blocks=ahead_blocks,
    )
    return PagedBlockPool(
        num_gpu_blocks=num_blocks,
        enable_caching=enable_caching,
        hash_block_size=16,
        policy=policy,
    )


def pages_of(blocks: list[KVCacheBlock]) -> set[int]:
    return {b.block_id // BPP for b in blocks}


def cache(pool: PagedBlockPool, block: KVCacheBlock, key: int) -> None:
    """Put ``block`` in the prefix cache, as cache_full_blocks does."""
    block_hash = make_block_hash_with_group_id(BlockHash(key.to_bytes(8, "little")), 0)
    if hasattr(pool, "_insert_block_hash"):
        pool._insert_block_hash(block_hash, block, num_tokens=16)
    else:  # block pools that keep one hash per block (vLLM 0.21)
        block.block_hash = block_hash
        pool.cached_block_hash_to_block.insert(block_hash, block)


def test_startup_maps_the_null_block_page_and_headroom():
    pool = make_pool(headroom=2)
    assert pool.null_block.block_id == 0
    assert pool.num_mapped_pages == 3
    # Admission sees the whole pool, as with a fully allocated cache.
    assert pool.get_num_free_blocks() == 31
    # Nothing changed since startup: no page ops in the first step.
    assert pool.take_page_ops() is None


def test_fills_mapped_pages_before_mapping_new_ones():
    pool = make_pool(headroom=1)
    first = pool.get_new_blocks(7)  # pages 0 and 1 hold 7 usable blocks
    assert pages_of(first) == {0, 1}
    assert pool.num_mapped_pages == 2
    ops = pool.take_page_ops()  # headroom: one free page mapped ahead
    assert ops == KVPageOps(ahead=[2])
    more = pool.get_new_blocks(6)
    assert pages_of(more) == {2, 3}
    # Page 3 holds blocks this step uses: mapped before its forward pass.
    assert pool.take_page_ops() == KVPageOps(map=[3], ahead=[4])


def test_reuses_freed_blocks_of_mapped_pages():
    pool = make_pool(headroom=0, shrink="never")
    blocks = pool.get_new_blocks(7)
    pool.take_page_ops()
    pool.free_blocks(blocks)
    again = pool.get_new_blocks(7)
    assert pages_of(again) == {0, 1}
    assert pool.take_page_ops() is None


def test_idle_shrink_returns_to_headroom_and_evicts_cached_blocks():
    pool = make_pool(headroom=1)
    blocks = pool.get_new_blocks(20)
    assert pool.take_page_ops() == KVPageOps(map=[2, 3, 4, 5], ahead=[6])
    for i, block in enumerate(blocks):
        cache(pool, block, i)
    assert not pool.wants_page_step()  # blocks in use: nothing to give back
    pool.free_blocks(blocks)
    assert pool.idle and pool.wants_page_step()
    ops = pool.take_page_ops()
    assert ops is not None and sorted(ops.unmap) == [2, 3, 4, 5, 6] and not ops.map
    assert pool.num_mapped_pages == 2  # the null block's page + one headroom page
    # Cached blocks of unmapped pages are gone from the prefix cache.
    assert all(b.block_hash is None for b in blocks if b.block_id >= 2 * BPP)
    assert len(pool.cached_block_hash_to_block) == sum(
        b.block_id < 2 * BPP for b in blocks
    )
    assert not pool.wants_page_step()
    assert pool.get_num_free_blocks() == 31
    # Memory comes back when needed, lowest pages first.
    assert pages_of(pool.get_new_blocks(12)) == {0, 1, 2, 3}


class FakeClock:
    """Stands in for time.monotonic so that the grace period passes without
    sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_delayed_pool(delay: float, **kwargs) -> tuple[PagedBlockPool, FakeClock]:
    pool = make_pool(headroom=1, shrink_delay_s=delay, **kwargs)
    clock = FakeClock()
    pool.clock = clock
    return pool, clock


def burst(pool: PagedBlockPool, num_blocks: int = 20) -> None:
    """Requests take blocks for a step and finish."""
    blocks = pool.get_new_blocks(num_blocks)
    pool.take_page_ops()
    pool.free_blocks(blocks)


def test_idle_shrink_waits_for_the_grace_period():
    pool, clock = make_delayed_pool(10.0)
    assert pool.page_step_due_in() is None  # nothing beyond the headroom
    blocks = pool.get_new_blocks(20)
    pool.take_page_ops()
    assert pool.page_step_due_in() is None  # in use
    pool.free_blocks(blocks)
    assert not pool.wants_page_step()  # the idle clock starts here
    assert pool.page_step_due_in() == 10.0
    clock.now += 4.0
    assert pool.page_step_due_in() == 6.0
    assert not pool.wants_page_step()
    assert pool.take_page_ops() is None
    assert pool.num_mapped_pages == 7
    clock.now += 6.0
    assert pool.page_step_due_in() == 0.0
    assert pool.wants_page_step()
    ops = pool.take_page_ops()
    assert ops is not None and sorted(ops.unmap) == [2, 3, 4, 5, 6] and not ops.map
    assert pool.num_mapped_pages == 2
    assert pool.page_step_due_in() is None
    assert not pool.wants_page_step()


def test_a_burst_within_the_grace_period_keeps_the_pages_and_restarts_it():
    pool, clock = make_delayed_pool(10.0)
    burst(pool)
    assert pool.num_pages_mapped_total == 7
    assert pool.page_step_due_in() == 10.0
    clock.now += 9.0
    burst(pool)  # the same blocks again: no page is mapped anew
    assert pool.num_pages_mapped_total == 7
    assert pool.num_pages_unmapped_total == 0
    # The clock restarted when the pool was in use again.
    assert pool.page_step_due_in() == 10.0
    clock.now += 9.0
    assert not pool.wants_page_step()
    assert pool.take_page_ops() is None
    clock.now += 1.0
    assert pool.wants_page_step()
    ops = pool.take_page_ops()
    assert ops is not None and len(ops.unmap) == 5
    assert pool.num_pages_unmapped_total == 5


def test_zero_grace_period_shrinks_at_once():
    pool, _ = make_delayed_pool(0.0)
    blocks = pool.get_new_blocks(20)
    pool.take_page_ops()
    assert pool.page_step_due_in() is None
    pool.free_blocks(blocks)
    assert pool.page_step_due_in() == 0.0
    assert pool.wants_page_step()
    ops = pool.take_page_ops()
    assert ops is not None and len(ops.unmap) == 5
    assert pool.num_mapped_pages == 2


def test_never_shrink_has_no_page_step_due():
    pool, clock = make_delayed_pool(1.0, shrink="never")
    burst(pool)
    clock.now += 100.0
    assert pool.page_step_due_in() is None
    assert not pool.wants_page_step()


def test_lowering_the_limit_is_not_delayed():
    pool, _ = make_delayed_pool(10.0)
    burst(pool)
    assert pool.page_step_due_in() == 10.0
    pool.set_max_pages(3)  # unmaps free pages at once
    assert pool.num_mapped_pages == 3
    assert pool.page_step_due_in() == 0.0  # the workers unmap at the next step
    assert pool.wants_page_step()
    ops = pool.take_page_ops()
    assert ops is not None and sorted(ops.unmap) == [3, 4, 5, 6]
    # The rest (one page beyond the headroom) still waits for the grace period.
    assert pool.num_mapped_pages == 3
    assert pool.page_step_due_in() == 10.0


def test_never_shrink_keeps_pages():
    pool = make_pool(headroom=1, shrink="never")
    blocks = pool.get_new_blocks(20)
    pool.take_page_ops()
    pool.free_blocks(blocks)
    assert not pool.wants_page_step()
    assert pool.take_page_ops() is None
    assert pool.num_mapped_pages == 7


def test_physical_limit_bounds_admission_and_mapping():
    pool = make_pool(max_pages=3, headroom=5)
    assert pool.get_num_free_blocks() == 3 * BPP - 1
    # The startup headroom is capped by the limit.
    assert pool.num_mapped_pages == 3
    assert pool.take_page_ops() is None
    pool.get_new_blocks(11)
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        pool.get_new_blocks(1)


def test_lowering_the_limit_unmaps_free_pages_cached_ones_too():
    pool = make_pool(headroom=0, shrink="never")
    used = pool.get_new_blocks(3)  # page 0
    cached = pool.get_new_blocks(12)  # pages 1-3
    for i, block in enumerate(cached):
        cache(pool, block, i)
    pool.free_blocks(cached)
    pool.take_page_ops()
    assert pool.num_mapped_pages == 4
    pool.set_max_pages(2)
    assert pool.get_num_free_blocks() == 2 * BPP - 1 - len(used)
    assert pool.wants_page_step()
    ops = pool.take_page_ops()
    assert ops is not None and sorted(ops.unmap) == [2, 3]
    assert pool.num_mapped_pages == 2
    assert all(b.block_hash is None for b in cached if b.block_id >= 2 * BPP)
    with pytest.raises(ValueError, match="at least 1 page"):
        pool.set_max_pages(0)
    pool.set_max_pages(8)
    assert pool.get_num_free_blocks() == 31 - len(used)


def test_partial_last_page():
    pool = make_pool(num_blocks=30, headroom=0)  # last page holds 2 blocks
    assert pool.num_pages == 8
    assert pool.get_num_free_blocks() == 29
    blocks = pool.get_new_blocks(29)
    assert sorted(b.block_id for b in blocks) == list(range(1, 30))
    assert pool.get_num_free_blocks() == 0


def test_reset_prefix_cache_with_unmapped_pages():
    pool = make_pool(headroom=0, shrink="never")
    blocks = pool.get_new_blocks(10)
    for i, block in enumerate(blocks):
        cache(pool, block, i)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert len(pool.cached_block_hash_to_block) == 0


def test_usage_and_prefix_cache_reset_ignore_blocks_beyond_the_limit():
    # 30 blocks are 8 pages, the last one partial; a limit of 7 pages (the profiled
    # memory rounded down) leaves blocks 28 and 29 unusable.
    pool = make_pool(num_blocks=30, headroom=1, max_pages=7)
    assert pool.get_num_free_blocks() == 27
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(9)
    assert pool.get_usage() == pytest.approx(9 / 27)
    cache(pool, blocks[0], 1)
    assert not pool.reset_prefix_cache()  # blocks in use
    assert blocks[0].block_hash is not None
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache()
    assert blocks[0].block_hash is None
    assert len(pool.cached_block_hash_to_block) == 0
    # Nothing else changed: admission still sees the limit.
    assert pool.get_num_free_blocks() == 27


def test_a_step_of_blocks_stays_mapped_ahead_while_requests_run():
    # A step allocates at most 6 blocks: two pages of 4 stay mapped ahead.
    pool = make_pool(headroom=1, ahead_blocks=6, shrink_delay_s=0.0)
    assert pool.policy.ahead_pages == 2
    assert pool.num_mapped_pages == 3  # the null block's page + a step's worth
    first = pool.get_new_blocks(3)
    assert pool.take_page_ops() is None  # 8 free blocks: more than a step needs
    second = pool.get_new_blocks(5)
    # 3 free blocks left: the next page is mapped ahead, not before a forward.
    assert pool.take_page_ops() == KVPageOps(ahead=[3])
    # A step that needs more than was mapped ahead maps the rest before its
    # forward pass, and the refill behind it goes ahead again.
    third = pool.get_new_blocks(12)
    assert pool.take_page_ops() == KVPageOps(map=[4, 5], ahead=[6])
    assert pool.free_block_queue.num_free_blocks >= 6
    # Idle: no refill beyond the headroom; the shrink keeps only the headroom.
    pool.free_blocks(first + second + third)
    ops = pool.take_page_ops()
    assert ops is not None and not ops.map and not ops.ahead
    assert sorted(ops.unmap) == [2, 3, 4, 5, 6]
    assert pool.num_mapped_pages == 2
    assert pool.take_page_ops() is None


def test_a_step_refills_at_most_what_it_handed_out():
    # The ahead maps run behind the step's own forward pass: a step that
    # handed out few blocks (the first request after an idle period) refills
    # a page's worth, not the whole step's worth the pool is short of.
    pool = make_pool(num_blocks=64, headroom=1, ahead_blocks=16)
    pool.take_page_ops()  # idle: back to the null block's page + headroom
    assert pool.num_mapped_pages == 2
    used = pool.get_new_blocks(2)
    assert pool.take_page_ops() == KVPageOps(ahead=[2])
    # A step that handed out 9 blocks refills 9 (whole pages: 12).
    used += pool.get_new_blocks(9)
    assert pool.take_page_ops() == KVPageOps(ahead=[3, 4, 5])
    # Steps that hand out nothing still refill a page until the target holds.
    assert pool.take_page_ops() == KVPageOps(ahead=[6])
    assert pool.free_block_queue.num_free_blocks == 16
    assert pool.take_page_ops() is None
    pool.free_blocks(used)


def test_the_limit_in_bytes_is_rounded_down_to_whole_pages():
    pool = make_pool(num_blocks=64)
    pool.policy.device_page_bytes = 8 << 20
    stats = pool.set_page_limit(max_bytes=(5 << 23) + (1 << 20))
    assert pool.policy.max_pages == 5
    assert stats == pool.page_stats()
    assert stats["kv_limit_bytes"] == 5 << 23 and stats["kv_page_bytes"] == 8 << 20
    assert stats["kv_mapped_bytes"] == stats["kv_pages_mapped"] * (8 << 20)
    assert stats["kv_page_capacity"] == 16
    assert stats["kv_capacity_bytes"] == 16 * (8 << 20)
    pool.set_page_limit(max_pages=3)
    assert pool.policy.max_pages == 3
    with pytest.raises(ValueError, match="less than one page"):
        pool.set_page_limit(max_bytes=(8 << 20) - 1)
    with pytest.raises(ValueError, match="not both"):
        pool.set_page_limit(max_pages=2, max_bytes=16 << 20)
    with pytest.raises(ValueError, match="not neither"):
        pool.set_page_limit()
    assert pool.policy.max_pages == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_pages": 0}, "max_pages must be at least 1"),
        ({"max_pages": -2}, "max_pages must be at least 1"),
        ({"max_bytes": 0}, "max_bytes must be at least 1"),
        ({"max_bytes": -(8 << 20)}, "max_bytes must be at least 1"),
        ({"max_pages": True}, "max_pages must be a whole number of pages"),
        ({"max_bytes": 1.5}, "max_bytes must be a whole number of bytes per device"),
        ({"max_pages": "4"}, "max_pages must be a whole number of pages"),
    ],
)
def test_bad_limits_are_refused_and_change_nothing(kwargs, message):
    pool = make_pool(num_blocks=64)
    pool.policy.device_page_bytes = 8 << 20
    with pytest.raises(ValueError, match=message):
        pool.set_page_limit(**kwargs)
    assert pool.policy.max_pages == 16


def test_a_limit_beyond_the_capacity_is_lowered_to_it(monkeypatch):
    # 30 blocks: 8 pages, the last one partial; a limit beyond them is the
    # capacity, with a warning (the same for the flag and the runtime limit).
    pool = make_pool(num_blocks=30, max_pages=4)
    pool.policy.device_page_bytes = 8 << 20
    warnings: list[tuple] = []
    monkeypatch.setattr(pool_limits.logger, "warning", lambda *a: warnings.append(a))
    stats = pool.set_page_limit(max_bytes=1 << 40)
    assert pool.policy.max_pages == 8
    assert stats["kv_page_limit"] == stats["kv_page_capacity"] == 8
    assert stats["kv_limit_bytes"] == stats["kv_capacity_bytes"] == 8 * (8 << 20)
    assert len(warnings) == 1 and "capacity" in warnings[0][0]
    pool.set_max_pages(9)
    assert pool.policy.max_pages == 8 and len(warnings) == 2
    # Every block, the last page's included, can be handed out under it.
    assert pool.get_num_free_blocks() == 29
    pool.set_max_pages(8)
    assert len(warnings) == 2


def test_ahead_blocks_of_an_idle_pool_are_not_mapped_back():
    pool = make_pool(headroom=0, ahead_blocks=8)
    assert pool.num_mapped_pages == 3
    pool.take_page_ops()
    assert pool.idle
    ops = pool.take_page_ops() or KVPageOps()
    assert not ops.ahead and not ops.map
    assert pool.num_mapped_pages == 1  # only the null block's page when idle
