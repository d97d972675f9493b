# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks that a release's offloading manager and connector scheduler follow
the bookkeeping rules (vllm/v1/kv_offload/bookkeeping.py).

The rules are tested in test_bookkeeping.py; these checks drive the real
manager and scheduler that a release's tests build (each release its own
way) through the cases where the rules matter. They need the offloading
connector package (vllm/distributed/kv_transfer/kv_connector/v1/offloading/)
and import it where they use it.
"""

from collections.abc import Callable
from typing import Any

from vllm.v1.outputs import KVConnectorOutput


def check_one_chunk_per_distinct_key(manager: Any, ctx: Any) -> None:
    """A key repeated in a store gets one chunk, and one repeated in a load
    takes one reference, released once (`manager`: two chunks)."""
    from vllm.v1.kv_offload.base import make_offload_key

    A, B, C, D = (make_offload_key(str(i).encode(), 0) for i in range(4))
    output = manager.prepare_store([A, B, A, A], ctx)
    assert output is not None and output.keys_to_store == [A, B]
    manager.complete_store([A, B], ctx)
    # The spec stays positional: both destinations read the same chunk.
    block_ids = manager.prepare_load([A, A], ctx).block_ids
    assert len(block_ids) == 2 and len(set(block_ids.tolist())) == 1
    manager.complete_load([A, A], ctx)
    # Nothing leaked or stayed pinned: a full-size store evicts both chunks.
    output = manager.prepare_store([C, D], ctx)
    assert output is not None and set(output.evicted_keys) == {A, B}


def check_each_report_applied_once(
    scheduler: Any, report: Callable[[int, int], Any]
) -> None:
    """The connector scheduler applies each worker's completion report of a
    job once (`report(job_id, rank)`: the worker metadata of worker `rank`
    once it finished job `job_id`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        TransferJobStatus,
    )

    job_id = scheduler._generate_job_id()
    scheduler._jobs[job_id] = TransferJobStatus("r", 2, keys=set(), is_store=True)
    # Worker 0 reports twice in one step, then worker 1 an unknown job.
    repeated = report(job_id, 0).aggregate(report(job_id, 0))
    for meta in [repeated, report(job_id + 9, 1)]:
        scheduler.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=meta)
        )
    # The job still waits for worker 1; the repeat and the unknown are counted.
    assert scheduler._jobs[job_id].pending_count == 1
    assert scheduler.num_ignored_completions == 2
