# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""When the device has no memory for a KV page: the ranks report, the
scheduler hands out only pages every rank mapped, requests wait (or are
preempted, by vLLM's own scheduler: test_scheduler_wiring.py) and proceed
once the memory is back; nothing waits for memory without an end, and an
engine that cannot map its startup pages fails at once with what holds the
memory."""

import threading
import time

import pytest
import torch

from tests.v1.kv_vmm.elastic_utils import (  # noqa: F401 (the fixtures)
    ledger_base_fixture,
    map_failures_fixture,
)
from tests.v1.kv_vmm.pool_utils import BPP, make_block_pool, make_page_policy
from vllm.v1.kv_vmm import scheduler as scheduler_module
from vllm.v1.kv_vmm import worker as worker_module
from vllm.v1.kv_vmm.backend import VmmOutOfMemoryError
from vllm.v1.kv_vmm.geometry import KVPageGeometry, KVTensorLayout
from vllm.v1.kv_vmm.page_status import KVPageStatus
from vllm.v1.kv_vmm.pages import KVPageOps, KVPagePolicy, initial_kv_pages
from vllm.v1.kv_vmm.scheduler import MAP_RETRY_MIN_S, PagedBlockPool
from vllm.v1.kv_vmm.worker import KVPageMapper


class Ranks:
    """The workers of an engine as the scheduler sees them through the page
    report: each applies the step's page ops to its set of mapped pages and
    reports; ``failing`` ranks have no memory for new pages."""

    def __init__(self, policy: KVPagePolicy, status: KVPageStatus) -> None:
        self.status = status
        initial = initial_kv_pages(policy)
        self.mapped = [set(initial) for _ in range(policy.num_ranks)]
        self.failing: set[int] = set()
        for _ in self.mapped:  # what each worker reports when it starts
            status.report(initial, [])

    def apply(self, ops: KVPageOps | None) -> None:
        if ops is None:
            return
        for rank, mapped in enumerate(self.mapped):
            mapped.difference_update(ops.unmap)
            pages = [*ops.map, *ops.ahead]
            if rank in self.failing:
                failed = [p for p in pages if p not in mapped]
                self.status.report([p for p in pages if p in mapped], failed)
            else:
                mapped.update(pages)
                self.status.report(pages, [])

    def on_every_rank(self) -> set[int]:
        return set.intersection(*self.mapped)


def make_pool(
    num_blocks: int = 64, num_ranks: int = 2, ahead_blocks: int = 8
) -> tuple[PagedBlockPool, Ranks]:
    policy, status = make_page_policy(-(-num_blocks // BPP), num_ranks, ahead_blocks)
    ranks = Ranks(policy, status)
    return make_block_pool(policy, num_blocks), ranks


def test_a_page_one_rank_of_two_could_not_map_is_never_handed_out():
    pool, ranks = make_pool()
    held = pool.get_new_blocks(pool.free_block_queue.num_free_blocks)
    ranks.failing = {1}
    ops = pool.take_page_ops()
    assert ops.ahead == [3, 4]  # behind the forward pass of a busy step
    ranks.apply(ops)
    assert ranks.mapped[0] >= {3, 4} and not ranks.mapped[1] & {3, 4}
    # Neither page is free: an allocation that needs them does not get them.
    pool.ensure_free_blocks(4)
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError, match="Cannot get 4 free blocks"):
        pool.get_new_blocks(4)
    assert pool.make_page_stats().map_failures_total == 2
    # Rank 0 gives them back at the next step; nothing is asked for during
    # the backoff.
    ops = pool.take_page_ops()
    assert sorted(ops.unmap) == [3, 4] and not ops.map and not ops.ahead
    ranks.apply(ops)
    assert not ranks.mapped[0] & {3, 4}
    assert pool.take_page_ops() is None
    # The memory is back after the backoff: asked for again, handed out once
    # both ranks report.
    ranks.failing = set()
    pool.clock.now += MAP_RETRY_MIN_S
    pool.ensure_free_blocks(8)  # a request that needs both pages
    ops = pool.take_page_ops()
    assert ops.ahead == [3, 4]
    ranks.apply(ops)
    got = pool.get_new_blocks(8)
    assert {b.block_id // BPP for b in got} == {3, 4} <= ranks.on_every_rank()
    pool.free_blocks(held + got)


def test_an_allocation_waits_for_pages_being_mapped_then_for_no_longer(
    monkeypatch,
):
    pool, ranks = make_pool(num_ranks=1)
    held = pool.get_new_blocks(pool.free_block_queue.num_free_blocks)
    ops = pool.take_page_ops()
    assert ops.ahead == [3, 4]
    # The rank reports while the scheduler waits (as a worker does right
    # after launching the forward pass of the step in flight).
    threading.Timer(0.05, ranks.apply, (ops,)).start()
    start = time.monotonic()
    pool.ensure_free_blocks(8)
    assert time.monotonic() - start < scheduler_module.PAGE_REPORT_WAIT_S
    assert pool.get_num_free_blocks() == 8
    held += pool.get_new_blocks(8)
    # A rank that does not report: the wait has an end, the pages stay
    # coming, the request waits for a later step, and nothing more is
    # asked for them.
    monkeypatch.setattr(scheduler_module, "PAGE_REPORT_WAIT_S", 0.2)
    ops = pool.take_page_ops()
    assert ops.ahead == [5, 6]
    start = time.monotonic()
    pool.ensure_free_blocks(8)
    assert 0.2 <= time.monotonic() - start < 2.0
    assert pool.get_num_free_blocks() == 0
    assert pool.take_page_ops() is None
    # An allocation that pages being mapped cannot cover does not wait.
    start = time.monotonic()
    pool.ensure_free_blocks(20)
    assert time.monotonic() - start < 0.1
    ranks.apply(ops)
    assert pool.get_num_free_blocks() == 8
    pool.free_blocks(held)


def test_requests_that_do_not_fit_ask_for_their_pages_in_the_next_message():
    pool, ranks = make_pool(ahead_blocks=8)
    # Idle after the shrink: the null block's page and one headroom page.
    ranks.apply(pool.take_page_ops())
    assert pool.num_mapped_pages == 2 and pool.get_num_free_blocks() == 7
    # A request of 10 blocks does not fit: nothing is handed out, and the
    # next message maps what it lacks (a step's worth at least; no forward
    # pass to hide the maps behind, so before the step).
    pool.ensure_free_blocks(10)
    assert pool.get_num_free_blocks() == 7
    ops = pool.take_page_ops()
    assert ops.map == [2] and not ops.ahead and not ops.unmap
    ranks.apply(ops)
    pool.ensure_free_blocks(10)
    assert pool.get_num_free_blocks() == 11
    blocks = pool.get_new_blocks(10)
    assert {b.block_id // BPP for b in blocks} <= ranks.on_every_rank()
    pool.free_blocks(blocks)


# -- vLLM's scheduler over the pool ---------------------------------------


# -- the worker --------------------------------------------------------------


def make_mapper(monkeypatch, policy: KVPagePolicy, num_blocks: int = 64):
    """A rank's mapper over real host memory: two 2 MiB regions per page of
    4 blocks (the geometry the engine core would derive from a KV cache
    config, given directly)."""
    geometry = KVPageGeometry(
        [KVTensorLayout(block_bytes=1 << 20, num_regions=2)], num_blocks, 2 << 20
    )
    assert geometry.blocks_per_page == BPP
    monkeypatch.setattr(worker_module, "kv_page_geometry", lambda *args: geometry)
    monkeypatch.setattr(
        worker_module, "virtual_kv_cache_config", lambda config, geometry: config
    )
    return KVPageMapper(object(), policy, torch.device("cpu"))


def test_a_page_the_device_has_no_memory_for_is_reported_not_waited_for(
    monkeypatch, map_failures
):
    policy, status = make_page_policy(16, num_ranks=1, ahead_blocks=0)
    mapper = make_mapper(monkeypatch, policy)
    try:
        assert mapper.reporting and status.counts(0) == (1, 0)
        map_failures.rate = 1.0
        status.reset([2, 3])
        start = time.monotonic()
        mapper.apply(KVPageOps(map=[2]))
        mapper.apply(KVPageOps(ahead=[3]))
        mapper.apply_ahead(KVPageOps(ahead=[3]))
        assert time.monotonic() - start < 1.0  # tried once each, not retried
        assert status.counts(2) == status.counts(3) == (0, 1)
        assert not mapper.table.is_mapped(2) and not mapper.table.is_mapped(3)
        assert mapper.stats()["kv_map_failures_total"] == 2
        # Asked for again once the memory is back.
        map_failures.rate = 0.0
        status.reset([2])
        mapper.apply(KVPageOps(map=[2]))
        assert status.counts(2) == (1, 0) and mapper.table.is_mapped(2)
    finally:
        mapper.close()


def test_ahead_pages_of_a_step_without_a_forward_pass_are_mapped_at_the_next(
    monkeypatch,
):
    policy, status = make_page_policy(16, num_ranks=1, ahead_blocks=0)
    mapper = make_mapper(monkeypatch, policy)
    try:
        status.reset([2])
        mapper.apply(KVPageOps(ahead=[2]))  # no forward pass: no apply_ahead
        assert status.counts(2) == (0, 0)
        mapper.apply(KVPageOps())
        assert status.counts(2) == (1, 0) and mapper.table.is_mapped(2)
    finally:
        mapper.close()


def startup_failure(monkeypatch, map_failures) -> str:
    """The error of a rank that cannot map its startup pages, checked for
    what it names; its message."""
    monkeypatch.setattr(worker_module, "STARTUP_MAP_TIMEOUT_S", 0.3)
    policy, status = make_page_policy(16, num_ranks=1, ahead_blocks=8)
    map_failures.rate = 1.0
    start = time.monotonic()
    with pytest.raises(VmmOutOfMemoryError) as info:
        make_mapper(monkeypatch, policy)
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert "3 of the 3 KV cache pages mapped at startup" in message
    assert "CUDA_ERROR_OUT_OF_MEMORY" in message  # the backend's own error
    assert "host memory:" in message and "KV memfd" in message
    assert "--max-num-batched-tokens" in message
    assert status.counts(0) == (0, 0)  # nothing reported: the rank failed
    return message


def test_startup_that_cannot_map_fails_at_once_naming_the_memory(
    monkeypatch, map_failures
):
    startup_failure(monkeypatch, map_failures)


def test_startup_maps_through_failures_that_retries_get_past(monkeypatch, map_failures):
    policy, status = make_page_policy(16, num_ranks=1, ahead_blocks=8)
    map_failures.rate = 0.5
    mapper = make_mapper(monkeypatch, policy)
    try:
        assert map_failures.count > 0
        assert mapper.table.mapped_pages() == [0, 1, 2]
        assert status.counts(0) == status.counts(2) == (1, 0)
    finally:
        mapper.close()


def test_without_page_reports_a_page_the_step_needs_fails_after_the_bound(
    monkeypatch, map_failures
):
    # A rank on another host than the engine core: no page report.
    monkeypatch.setattr(worker_module, "NEEDED_MAP_TIMEOUT_S", 0.3)
    policy = KVPagePolicy(
        granularity=2 << 20, blocks_per_page=BPP, max_pages=16, ahead_blocks=0
    )
    mapper = make_mapper(monkeypatch, policy)
    try:
        assert not mapper.reporting
        map_failures.rate = 1.0
        start = time.monotonic()
        with pytest.raises(VmmOutOfMemoryError, match=r"pages \[2\] that this step"):
            mapper.apply(KVPageOps(map=[2]))
        assert time.monotonic() - start < 2.0
    finally:
        map_failures.rate = 0.0
        mapper.close()
