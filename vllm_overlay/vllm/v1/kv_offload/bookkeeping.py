# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bookkeeping of KV offloading that must hold across the workers and nodes
of one engine.

The scheduler keeps one account of the offload buffer for every worker of
the engine. These rules keep that account exact however requests repeat
keys, however workers report, and however the executor places them:

- one CPU chunk, and one load reference, per distinct key of a batch
  (`distinct_keys`);
- each worker's completion report of a transfer job counts once
  (`apply_completion_reports`);
- the host buffer is node-local: a chunk row holds the pages of one node's
  workers (`NodeLayout`);
- transfer time as a system total counts concurrent workers once
  (`concurrent_wall_time`, `BusiestWorkerClock`).

The rules do not depend on the release: each release's offloading manager,
connector scheduler and worker call them with their own records and configs.
"""

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

from vllm.logger import init_logger

logger = init_logger(__name__)

_Key = TypeVar("_Key", bound=Hashable)


def distinct_keys(keys: Iterable[_Key]) -> list[_Key]:
    """The keys of one batch, each once, in the order they first occur.

    An offloading manager accounts per key: a stored key owns one chunk, and
    a load job holds one reference on each key it reads, released once when
    the job completes. A key repeated within one batch must therefore get one
    chunk (a second one would be orphaned when the key's entry is replaced:
    never freed, never evictable) and one reference (a second one would pin
    the chunk forever).
    """
    return list(dict.fromkeys(keys))


# --- Node-local offload buffers ---------------------------------------------


def worker_node_indices(node_ids: Sequence[Hashable]) -> list[int]:
    """The node of each rank as a node index, from the id of the node each
    rank runs on (`node_ids[rank]`); nodes are numbered in order of first
    appearance."""
    index: dict[Hashable, int] = {}
    return [index.setdefault(node_id, len(index)) for node_id in node_ids]


@dataclass(frozen=True)
class NodeLayout:
    """How the workers of one engine are spread over nodes.

    The host buffer of CPU offloading is node-local (a shared region in the
    node's /dev/shm, or one tensor per worker in the node's memory), and only
    that node's workers write to it. A chunk row therefore holds the pages of
    one node's workers, and the offloading budget is per node: rows as wide
    as the world would leave the slots of other nodes' workers empty on every
    node.
    """

    world_size: int
    nnodes: int = 1
    """Nodes the ranks are split over, evenly and node-major (node n runs
    ranks [n * local_world_size, (n + 1) * local_world_size)): the
    multiprocessing executor with --nnodes."""
    worker_nodes: tuple[int, ...] = ()
    """Node index of each rank, where the executor places the workers itself
    (Ray, which leaves nnodes at 1); nodes may hold different numbers of
    workers. Empty: the nnodes split."""

    @property
    def local_world_size(self) -> int:
        """Most workers of the engine on one node: the width of a chunk row,
        which the scheduler and every worker must agree on (a node with fewer
        workers leaves part of its budget unused)."""
        if self.worker_nodes:
            return max(Counter(self.worker_nodes).values())
        return max(self.world_size // self.nnodes, 1)

    def local_rank(self, rank: int) -> int:
        """Index of worker `rank` among the workers of its node: its slot in
        a chunk row of its node's buffer."""
        if self.worker_nodes:
            node = self.worker_nodes[rank]
            return self.worker_nodes[:rank].count(node)
        return rank % self.local_world_size

    def pages_per_row(
        self, *, replicated: bool = False, global_rows: bool = False
    ) -> int:
        """Worker pages in one chunk row of a node's buffer.

        `replicated`: every worker holds the same data (e.g. MLA latents), so
        a row keeps one copy. `global_rows`: pages are addressed in the layout
        of the whole world (the canonical layout), so rows stay world wide.
        """
        if replicated:
            return 1
        if global_rows:
            return self.world_size
        return self.local_world_size

    def row_slot(self, rank: int, *, replicated: bool = False) -> int:
        """The page slot of worker `rank` within a chunk row of its node's
        buffer (one shared slot when the layout is replicated)."""
        return 0 if replicated else self.local_rank(rank)


# --- Completion reports of transfer jobs --------------------------------------


class JobCompletion(Protocol):
    """What the scheduler records of the completion reports of one transfer
    job."""

    pending_count: int
    """Worker reports the job still waits for (starts at the world size)."""
    completed_ranks: set[int]
    """Ranks whose report was applied."""


class CompletionResult(NamedTuple):
    finished: bool
    """Every worker has now reported the job: the scheduler must finish it
    (mark its chunks stored, or release their load references)."""
    num_ignored: int
    """Reports that changed nothing: late, repeated, or for an unknown job."""


def merge_completed_ranks(
    ranks: Mapping[int, set[int]], other: Mapping[int, set[int]]
) -> dict[int, set[int]]:
    """The ranks that reported each job (job id -> ranks), from the reports
    of two sets of workers; neither input is changed."""
    merged = {job_id: set(job_ranks) for job_id, job_ranks in ranks.items()}
    for job_id, job_ranks in other.items():
        merged.setdefault(job_id, set()).update(job_ranks)
    return merged


def apply_completion_reports(
    job: JobCompletion | None,
    job_id: int,
    count: int,
    ranks: set[int] | None,
    *,
    next_job_id: int,
) -> CompletionResult:
    """Apply `count` worker reports of transfer job `job_id`, made by `ranks`
    (None: workers that do not give their rank), to the job's record (None:
    the scheduler has no such job).

    A job is complete when each worker reported it once. A count alone cannot
    tell a repeated report of one worker from the report of another, and a
    duplicate that finished a load job would release its chunks while another
    worker still reads them (the chunk could then be evicted and rewritten
    under that read). So each rank is applied once per job, and whatever
    changes nothing is ignored and logged: reports of a job that is finished
    (or was dropped) or unknown (ids from `next_job_id` on), repeats of a
    rank, and counts beyond what the job still waits for. Reports without
    ranks keep the count-based accounting, clamped at zero.
    """
    if job is None:
        logger.warning(
            "Ignoring %d completion report(s) of KV offload job %d: the job is %s.",
            count,
            job_id,
            "already finished" if job_id < next_job_id else "unknown to the scheduler",
        )
        return CompletionResult(finished=False, num_ignored=count)

    if ranks is not None:
        new_ranks = ranks - job.completed_ranks
        job.completed_ranks.update(new_ranks)
        num_new = len(new_ranks)
    else:
        num_new = count
    num_ignored = max(count - num_new, 0) + max(num_new - job.pending_count, 0)
    if num_ignored:
        logger.warning(
            "Ignoring %d duplicate completion report(s) of KV offload job %d "
            "(ranks reported: %s).",
            num_ignored,
            job_id,
            sorted(ranks) if ranks is not None else "not given",
        )
    job.pending_count = max(job.pending_count - num_new, 0)
    return CompletionResult(job.pending_count == 0, num_ignored)


# --- Transfer time as a system total ----------------------------------------


def concurrent_wall_time(*worker_times: float) -> float:
    """Wall time of transfers that workers ran side by side: as long as the
    slowest worker's. (One worker's own transfers run one after another, so
    its times add up.) Bytes over this time is the throughput of the whole
    system; bytes over the sum of all workers' times is that of one worker.
    """
    return max(worker_times, default=0.0)


def worker_transfer_times(ops: Iterable[tuple[int, float]]) -> dict[int, float]:
    """Transfer time of each worker, from (rank, seconds) per transfer."""
    times: dict[int, float] = {}
    for rank, seconds in ops:
        times[rank] = times.get(rank, 0.0) + seconds
    return times


class BusiestWorkerClock:
    """The wall time of concurrent workers' transfers as a running total: the
    busiest worker's running total of transfer time, which never decreases.
    A counter that is advanced by `advance` follows it."""

    def __init__(self) -> None:
        self._totals: dict[int, float] = {}

    @property
    def wall_time(self) -> float:
        return max(self._totals.values(), default=0.0)

    def advance(self, worker_times: Mapping[int, float]) -> float:
        """Add each worker's new transfer time (rank -> seconds); returns how
        far the wall time moved."""
        before = self.wall_time
        for rank, seconds in worker_times.items():
            self._totals[rank] = self._totals.get(rank, 0.0) + seconds
        return self.wall_time - before
