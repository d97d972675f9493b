# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's scheduler with VMM-backed KV memory: the page decisions travel in the
step message, an empty step gives pages back once the grace period is over, and
the stats carry the counters."""

from pathlib import Path

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
    requires_vmm_kv_wiring,
    write_tiny_llama_config,
)
from tests.v1.kv_vmm.pool_utils import Clock, make_page_policy
from tests.v1.kv_vmm.test_map_failures import Ranks
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_vmm.pages import KVPageOps, KVPagePolicy
from vllm.v1.kv_vmm.scheduler import PagedBlockPool
from vllm.v1.request import RequestStatus

pytestmark = requires_vmm_kv_wiring

# vLLM's own scheduler test helpers (absent where only this directory's tests are
# laid over an installed vLLM).
core_utils = pytest.importorskip(
    "tests.v1.core.utils", reason="needs vLLM's tests/v1/core/utils.py"
)
create_requests = core_utils.create_requests

BPP = 4  # blocks per page
NUM_BLOCKS = 64


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    """A local model config (no download, no tokenizer)."""
    return write_tiny_llama_config(tmp_path)


def make_scheduler(model_dir: str, monkeypatch, policy: KVPagePolicy | None):
    if policy is not None:
        # The engine core attaches the policy to the scheduler's KV cache config.
        monkeypatch.setattr(
            core_utils,
            "KVCacheConfig",
            lambda **kwargs: KVCacheConfig(**kwargs, kv_page_policy=policy),
        )
    return core_utils.create_scheduler(
        model=model_dir,
        num_blocks=NUM_BLOCKS,
        block_size=16,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
    )


def _paged_scheduler(model_dir, monkeypatch, shrink_delay_s: float, start: float):
    """A scheduler over a PagedBlockPool whose clock the test moves (``now[0]``)."""
    policy = KVPagePolicy(
        granularity=2 << 20,
        blocks_per_page=BPP,
        max_pages=NUM_BLOCKS // BPP,
        shrink_delay_s=shrink_delay_s,
    )
    scheduler = make_scheduler(model_dir, monkeypatch, policy)
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, PagedBlockPool)
    now = [start]
    pool.clock = lambda: now[0]
    return scheduler, pool, now


def test_the_default_block_pool_has_no_pages():
    # The scheduler and engine core call these hooks on every block pool
    # (no isinstance checks): the default pool answers "nothing to do".
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    assert pool.take_page_ops() is None
    assert pool.page_step_due_in() is None


def test_page_ops_in_the_step_message_and_shrink_step(model_dir, monkeypatch):
    scheduler, pool, now = _paged_scheduler(model_dir, monkeypatch, 5.0, 100.0)
    mapped = {0, 1}  # the null block's page and one headroom page

    # 4 requests of 100 tokens: 7 blocks each, more than the startup pages hold.
    requests = create_requests(num_requests=4, num_tokens=100, block_size=16)
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    ops = output.kv_page_ops
    assert ops is not None and not ops.unmap and ops.map
    # The headroom refill behind this step's blocks goes ahead (after the
    # forward pass on the workers); the blocks this step uses are never on it.
    assert ops.ahead and not set(ops.ahead) & set(ops.map)
    ahead = set(ops.ahead)
    mapped |= set(ops.map)
    block_ids = [
        block_id
        for new_req in output.scheduled_new_reqs
        for group in new_req.block_ids
        for block_id in group
    ]
    assert len(block_ids) == 4 * 7
    # Every block handed out lies on a page the workers map before the forward.
    assert {b // BPP for b in block_ids} <= mapped
    mapped |= ahead
    assert pool.num_mapped_pages == len(mapped)

    assert scheduler.kv_page_step_due_in() is None  # blocks in use

    scheduler.finish_requests(
        [r.request_id for r in requests], RequestStatus.FINISHED_ABORTED
    )
    # The finished requests are reported in one more step; the pages stay
    # mapped for the grace period and the engine core learns when to wake up.
    assert scheduler.has_requests()
    output = scheduler.schedule()
    assert output.kv_page_ops is None
    assert not scheduler.has_requests()
    assert scheduler.kv_page_step_due_in() == 5.0
    now[0] += 5.0
    assert scheduler.kv_page_step_due_in() == 0.0
    assert scheduler.has_requests()
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens == 0
    ops = output.kv_page_ops
    assert ops is not None and not ops.map
    assert set(ops.unmap) == mapped - {0, 1}
    # Given back: no further step is needed.
    assert not scheduler.has_requests()
    assert scheduler.kv_page_step_due_in() is None
    page_stats = pool.make_page_stats()
    assert page_stats.mapped_pages == 2
    assert page_stats.pages_unmapped_total == len(mapped) - 2


def test_idle_scheduler_says_when_the_shrink_step_is_due(model_dir, monkeypatch):
    """What the engine core's idle wait is bounded by: the time left of the shrink
    delay, then a step (has_requests) that gives the pages back; nothing once given
    back."""
    scheduler, pool, now = _paged_scheduler(model_dir, monkeypatch, 3.0, 50.0)
    assert scheduler.kv_page_step_due_in() is None  # only the startup pages
    requests = create_requests(num_requests=4, num_tokens=100, block_size=16)
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    assert scheduler.kv_page_step_due_in() is None  # blocks in use
    scheduler.finish_requests(
        [r.request_id for r in requests], RequestStatus.FINISHED_ABORTED
    )
    scheduler.schedule()
    assert not scheduler.has_requests()
    assert scheduler.kv_page_step_due_in() == 3.0
    now[0] += 1.0
    assert scheduler.kv_page_step_due_in() == 2.0
    assert not scheduler.has_requests()
    now[0] += 2.0
    assert scheduler.kv_page_step_due_in() == 0.0
    assert scheduler.has_requests()
    ops = scheduler.schedule().kv_page_ops
    assert ops is not None and ops.unmap and not ops.map
    assert pool.num_mapped_pages == 2
    assert scheduler.kv_page_step_due_in() is None
    assert not scheduler.has_requests()


def test_default_memory_backend_is_unchanged(model_dir, monkeypatch):
    scheduler = make_scheduler(model_dir, monkeypatch, policy=None)
    assert type(scheduler.kv_cache_manager.block_pool) is BlockPool
    for request in create_requests(num_requests=2, num_tokens=100, block_size=16):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.kv_page_ops is None


def _step_with_ranks(scheduler, ranks: Ranks, clock: Clock, check) -> list[str]:
    """One engine step: schedule, check what the step uses, the ranks apply
    the page ops, one token per scheduled request; the finished ids."""
    from vllm.v1.outputs import ModelRunnerOutput

    output = scheduler.schedule()
    check(output)
    ranks.apply(output.kv_page_ops)
    req_ids = list(output.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
    )
    engine_outputs = scheduler.update_from_output(output, runner_output)
    clock.now += 0.05
    return [
        out.request_id
        for client in engine_outputs.values()
        for out in client.outputs
        if out.finish_reason is not None
    ]


def test_requests_wait_and_are_preempted_while_no_page_maps_then_proceed(
    model_dir, monkeypatch
):
    """When a rank has no memory for a KV page (test_map_failures.py), the
    scheduler hands out only pages every rank mapped: requests wait or are
    preempted by vLLM's own scheduler, and proceed once the memory is back."""
    policy, status = make_page_policy(NUM_BLOCKS // BPP, num_ranks=2, ahead_blocks=0)
    ranks = Ranks(policy, status)
    scheduler = make_scheduler(model_dir, monkeypatch, policy)
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, PagedBlockPool)
    clock = Clock()
    pool.clock = clock
    # Only the startup pages (the null block's and the headroom: 7 blocks)
    # map; rank 1 has no memory for any other page.
    ranks.failing = {1}
    # 3 requests of 30 tokens (2 blocks each) that generate 100: each needs
    # more blocks while it decodes, 9 in the end.
    requests = create_requests(
        num_requests=3, num_tokens=30, max_tokens=100, ignore_eos=True, block_size=16
    )
    for request in requests:
        scheduler.add_request(request)

    def check(output) -> None:
        # Every block a scheduled request holds lies on a page both ranks
        # have mapped before the step runs.
        ops = output.kv_page_ops or KVPageOps()
        on_both = ranks.on_every_rank() - set(ops.unmap)
        for req_id in output.num_scheduled_tokens:
            (blocks,) = scheduler.kv_cache_manager.get_block_ids(req_id)
            assert {b // BPP for b in blocks} <= on_both, (req_id, blocks)

    finished: list[str] = []
    preempted = 0
    for _ in range(60):
        finished += _step_with_ranks(scheduler, ranks, clock, check)
        preempted += sum(r.status == RequestStatus.PREEMPTED for r in requests)
    # Nothing finished (each needs 9 blocks in the end, only 7 exist), the
    # engine kept stepping, requests were preempted by vLLM's scheduler, and
    # the failed maps were counted.
    assert not finished
    assert preempted > 0
    assert pool.make_page_stats().map_failures_total > 0
    assert pool.num_mapped_pages == 2
    # The memory is back: every request completes.
    ranks.failing = set()
    for _ in range(400):
        finished += _step_with_ranks(scheduler, ranks, clock, check)
        if len(finished) == len(requests):
            break
    assert sorted(finished) == sorted(r.request_id for r in requests)
    assert all(len(r.output_token_ids) == 100 for r in requests)
