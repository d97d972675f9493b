# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The bookkeeping rules of KV offloading (vllm/v1/kv_offload/bookkeeping.py).

Each release's offloading manager, connector scheduler, worker and CPU spec
call these rules; the tests that come with those calls check the wiring.

The completion rules are also driven by a hypothesis state machine: a
scheduler's job table over a fixed pool of CPU chunks, with random stores
(with repeated keys), loads, completion reports from up to four workers
(late, repeated, batched, unknown) and cache resets. After every step the
job table, the ignored-report count and the chunk accounting must equal a
reference model that knows which worker is still transferring, and no chunk
may be written by one job while another still reads it.
"""

import mmap
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vllm.v1.kv_offload.bookkeeping import (
    BusiestWorkerClock,
    NodeLayout,
    apply_completion_reports,
    concurrent_wall_time,
    distinct_keys,
    merge_completed_ranks,
    worker_node_indices,
    worker_transfer_times,
)

# Pure bookkeeping tests: no device or distributed state to clean up.
pytestmark = pytest.mark.skip_global_cleanup

# --- One chunk and one reference per distinct key -----------------------------


def test_distinct_keys_keep_first_occurrence_order():
    assert distinct_keys(["a", "b", "a", "a", "c", "b"]) == ["a", "b", "c"]
    assert distinct_keys(iter([3, 3])) == [3]
    assert distinct_keys([]) == []


# --- Node-local offload buffers ----------------------------------------------

PAGE = mmap.PAGESIZE
CPU_BYTES = 64 * PAGE


def _sizing(layout: NodeLayout, rank: int) -> tuple[int, int]:
    """(chunks, row slot) of one rank: a row of one page per worker of the
    node, as many rows as the per-node budget holds."""
    return CPU_BYTES // (PAGE * layout.pages_per_row()), layout.row_slot(rank)


def test_local_world_size_and_rank():
    assert NodeLayout(world_size=8, nnodes=2).local_world_size == 4
    assert NodeLayout(world_size=8, nnodes=2).local_rank(5) == 1
    assert NodeLayout(world_size=8, nnodes=1).local_rank(5) == 5


@pytest.mark.parametrize("world_size,nnodes", [(2, 1), (4, 2), (8, 2), (8, 4)])
def test_rows_hold_the_pages_of_one_node(world_size: int, nnodes: int):
    local_world_size = world_size // nnodes
    layout = NodeLayout(world_size, nnodes)
    sizing = [_sizing(layout, rank) for rank in range(world_size)]
    # The scheduler and every worker agree on the number of chunks.
    assert {chunks for chunks, _ in sizing} == {CPU_BYTES // (PAGE * local_world_size)}
    # A row holds the pages of this node's workers only, so one node's
    # buffer is exactly the budget.
    assert layout.pages_per_row() == local_world_size
    assert sizing[0][0] * PAGE * layout.pages_per_row() == CPU_BYTES
    slots = [slot for _, slot in sizing]
    assert slots == [rank % local_world_size for rank in range(world_size)]
    # The last rank of each node writes the last page of each row.
    assert max(slots) == layout.pages_per_row() - 1


def test_two_nodes_get_twice_the_chunks_of_one_node_per_budget():
    one_node, _ = _sizing(NodeLayout(world_size=4, nnodes=1), 0)
    two_nodes, _ = _sizing(NodeLayout(world_size=4, nnodes=2), 0)
    assert two_nodes == 2 * one_node


def test_replicated_and_global_rows():
    layout = NodeLayout(world_size=8, nnodes=2)
    # One copy of replicated data, in one slot shared by every worker.
    assert layout.pages_per_row(replicated=True) == 1
    assert {layout.row_slot(r, replicated=True) for r in range(8)} == {0}
    # Pages addressed in the global layout keep rows as wide as the world.
    assert layout.pages_per_row(global_rows=True) == 8


def _assert_sized_per_node(worker_nodes: list[int], sizing: list[tuple[int, int]]):
    """sizing[rank] = (chunks, row slot) computed by that rank."""
    fullest = max(Counter(worker_nodes).values())
    scheduler = NodeLayout(len(worker_nodes), worker_nodes=tuple(worker_nodes))
    # The scheduler and every worker agree; the fullest node's buffer is
    # exactly the budget (a global row would cost every node all the ranks).
    assert {chunks for chunks, _ in sizing} == {_sizing(scheduler, 0)[0]}
    assert _sizing(scheduler, 0)[0] == CPU_BYTES // (PAGE * fullest)
    for node in set(worker_nodes):
        slots = [slot for (_, slot), n in zip(sizing, worker_nodes) if n == node]
        # Each worker of a node owns its own slot of that node's rows.
        assert sorted(slots) == list(range(len(slots)))


@pytest.mark.parametrize(
    "node_ids",
    [
        ["a", "a", "b", "b"],
        # Ray's v1 executor puts the driver node first, then nodes with
        # fewer workers: nodes need not hold the same number of ranks.
        ["a", "b", "b", "b"],
        # Bundle indices (VLLM_RAY_BUNDLE_INDICES) need not be node-major.
        ["a", "b", "a", "b"],
    ],
)
def test_executor_placed_workers_are_sized_per_node(node_ids: list[str]):
    worker_nodes = worker_node_indices(node_ids)
    assert worker_nodes[0] == 0 and len(set(worker_nodes)) == len(set(node_ids))
    # Where the executor places the workers, nnodes stays 1.
    layout = NodeLayout(len(node_ids), nnodes=1, worker_nodes=tuple(worker_nodes))
    sizing = [_sizing(layout, rank) for rank in range(len(node_ids))]
    _assert_sized_per_node(worker_nodes, sizing)


def test_ray_placement_on_two_nodes():
    """Two Ray nodes on one host (ray.cluster_utils.Cluster) and a placement
    group of four worker bundles, three on one node and one on the other.
    One actor per bundle reports the node Ray runs it on; the ranks' node ids
    are recorded as the Ray executors record them, and each actor sizes its
    offload buffer in its own process.

    vLLM's CPU platform declares no Ray device, so the Ray executor itself
    (and the CUDA copy engine) cannot run on a CPU-only host; the placement,
    the node ids and the per-process sizing are Ray's and vLLM's own."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"node_a": 3},
            "include_dashboard": False,
        },
    )
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 1})
        ray.init(address=cluster.address)
        bundles = [{"CPU": 0.25, "node_a": 1}] * 3 + [{"CPU": 0.25, "node_b": 1}]
        pg = placement_group(bundles, strategy="PACK")
        ray.get(pg.ready(), timeout=120)

        @ray.remote(num_cpus=0.25)
        class Worker:
            def node_id(self) -> str:
                return ray.get_runtime_context().get_node_id()

            def row(self, rank: int, worker_nodes: list[int]) -> tuple[int, int]:
                layout = NodeLayout(len(worker_nodes), worker_nodes=tuple(worker_nodes))
                return layout.pages_per_row(), layout.row_slot(rank)

        workers = [
            Worker.options(  # type: ignore[attr-defined]
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                )
            ).remote()
            for index in range(len(bundles))
        ]
        node_ids = ray.get([w.node_id.remote() for w in workers])
        # Ray put the bundles on two nodes, three and one.
        assert sorted(Counter(node_ids).values()) == [1, 3]

        worker_nodes = worker_node_indices(node_ids)
        rows = ray.get(
            [w.row.remote(rank, worker_nodes) for rank, w in enumerate(workers)],
            timeout=300,
        )
        sizing = [(CPU_BYTES // (PAGE * pages), slot) for pages, slot in rows]
        _assert_sized_per_node(worker_nodes, sizing)
        # Per node, not per world: 4 ranks on two nodes cost a row of 3.
        assert sizing[0][0] == CPU_BYTES // (PAGE * 3)
        remove_placement_group(pg)
    finally:
        ray.shutdown()
        cluster.shutdown()


# --- Completion reports of transfer jobs ------------------------------------


@dataclass
class Job:
    """A scheduler's record of one transfer job."""

    is_store: bool
    keys: frozenset[int]
    # key -> chunk id at creation; must not change while the job is active
    chunk_ids: dict[int, int]
    pending_count: int
    completed_ranks: set[int] = field(default_factory=set)


def _report(job: Job | None, job_id: int, ranks: list[int], next_job_id: int = 8):
    return apply_completion_reports(
        job, job_id, len(ranks), set(ranks), next_job_id=next_job_id
    )


def test_repeated_report_from_one_worker_does_not_finish_job():
    # Worker 0 reports a load twice; worker 1 still reads.
    job = Job(False, frozenset({0}), {0: 0}, pending_count=2)
    assert _report(job, 7, [0]) == (False, 0)
    assert _report(job, 7, [0]) == (False, 1)
    assert job.pending_count == 1 and job.completed_ranks == {0}
    assert _report(job, 7, [1]) == (True, 0)
    # Once finished, the scheduler drops the job: a late report is ignored.
    assert _report(None, 7, [1]) == (False, 1)


def test_reports_of_one_step_are_merged_per_rank():
    step = merge_completed_ranks({7: {0}, 8: {1}}, {7: {1}})
    assert step == {7: {0, 1}, 8: {1}}
    step = merge_completed_ranks(step, {7: {0}})
    assert step[7] == {0, 1}
    # A batch holding a repeat applies each rank once.
    job = Job(True, frozenset(), {}, pending_count=3)
    assert apply_completion_reports(job, 7, 3, step[7], next_job_id=9) == (False, 1)
    assert job.pending_count == 1


def test_reports_without_ranks_count_and_clamp():
    job = Job(True, frozenset(), {}, pending_count=2)
    assert apply_completion_reports(job, 0, 1, None, next_job_id=1) == (False, 0)
    # More reports than the job still waits for: finished, the excess ignored.
    assert apply_completion_reports(job, 0, 3, None, next_job_id=1) == (True, 2)
    assert job.pending_count == 0


@pytest.mark.parametrize("job_id", [3, 100], ids=["finished", "unknown"])
def test_reports_of_jobs_the_scheduler_does_not_have_are_ignored(job_id: int):
    assert _report(None, job_id, [0, 1], next_job_id=8) == (False, 2)


NUM_CHUNKS = 6
NUM_KEYS = 10


@dataclass
class ModelJob:
    is_store: bool
    keys: frozenset[int]
    # Ranks still transferring: they have not reported the job yet.
    pending_ranks: set[int]


class OffloadBookkeepingMachine(RuleBasedStateMachine):
    """The system: a scheduler's job table that applies worker reports with
    `apply_completion_reports` (one step's reports merged per job, as the
    workers' metadata is aggregated), over a pool of CPU chunks in which a
    stored key becomes readable when its store job finishes and a chunk read
    by an unfinished load is never evicted.

    The reference model: a key is absent, being written, or ready; a ready
    key holds one reference per load job that still reads it; a job is done
    when every worker rank has reported it once; everything else reported is
    ignored (and counted)."""

    @initialize(num_workers=st.integers(min_value=1, max_value=4))
    def setup(self, num_workers: int) -> None:
        self.num_workers = num_workers
        # the system
        self.sched_jobs: dict[int, Job] = {}
        self.num_ignored = 0
        self.next_job_id = 0
        self.chunk_of: dict[int, int] = {}
        self.ready: set[int] = set()
        self.readers: dict[int, int] = {}
        self.free_chunks = list(range(NUM_CHUNKS))
        # reference model
        self.state: dict[int, str] = {}  # key -> "writing" | "ready"
        self.refs: dict[int, int] = {}
        self.jobs: dict[int, ModelJob] = {}
        self.finished_job_ids: list[int] = []
        self.ignored = 0

    # --- the system ---

    def _new_job(self, keys: list[int], is_store: bool) -> int:
        job_id = self.next_job_id
        self.next_job_id += 1
        self.sched_jobs[job_id] = Job(
            is_store,
            frozenset(keys),
            {k: self.chunk_of[k] for k in keys},
            pending_count=self.num_workers,
        )
        self.jobs[job_id] = ModelJob(
            is_store, frozenset(keys), set(range(self.num_workers))
        )
        return job_id

    def _prepare_store(self, keys: list[int]) -> tuple[list[int], list[int]] | None:
        """(keys to store, evicted keys), or None when the pool is full."""
        keys = distinct_keys(keys)
        new_keys = [k for k in keys if k not in self.chunk_of]
        need = len(new_keys) - len(self.free_chunks)
        evictable = sorted(
            k
            for k in self.ready
            if not self.readers.get(k) and k not in keys and k in self.chunk_of
        )
        if need > len(evictable):
            return None
        evicted = evictable[: max(need, 0)]
        for k in evicted:
            self.free_chunks.append(self.chunk_of.pop(k))
            self.ready.discard(k)
        for k in new_keys:
            self.chunk_of[k] = self.free_chunks.pop()
        return new_keys, evicted

    def _deliver(self, reports: list[tuple[int, int]]) -> None:
        """One engine step's reports, (job_id, rank) each, merged as the
        workers' metadata is and applied job by job."""
        counts: Counter[int] = Counter()
        ranks: dict[int, set[int]] = {}
        for job_id, rank in reports:
            counts[job_id] += 1
            ranks = merge_completed_ranks(ranks, {job_id: {rank}})
        for job_id, count in counts.items():
            job = self.sched_jobs.get(job_id)
            finished, num_ignored = apply_completion_reports(
                job,
                job_id,
                count,
                ranks[job_id],
                next_job_id=self.next_job_id,
            )
            self.num_ignored += num_ignored
            if not finished:
                continue
            assert job is not None
            for k in job.keys:
                if job.is_store:
                    self.ready.add(k)
                else:
                    self.readers[k] -= 1
            del self.sched_jobs[job_id]

    # --- rules ---

    def _report(self, reports: list[tuple[int, int]]) -> None:
        self._deliver(reports)
        # model: apply each distinct (job, rank) once, in order
        seen: set[tuple[int, int]] = set()
        for job_id, rank in reports:
            job = self.jobs.get(job_id)
            if job is None or (job_id, rank) in seen or rank not in job.pending_ranks:
                self.ignored += 1
                continue
            seen.add((job_id, rank))
            job.pending_ranks.discard(rank)
        for job_id, job in list(self.jobs.items()):
            if job.pending_ranks:
                continue
            for k in job.keys:
                if job.is_store:
                    self.state[k] = "ready"
                else:
                    self.refs[k] -= 1
            del self.jobs[job_id]
            self.finished_job_ids.append(job_id)

    @rule(
        keys=st.lists(
            st.integers(min_value=0, max_value=NUM_KEYS - 1), min_size=1, max_size=5
        )
    )
    def store(self, keys: list[int]) -> None:
        output = self._prepare_store(keys)

        distinct = list(dict.fromkeys(keys))
        new_keys = [k for k in distinct if k not in self.state]
        num_free = NUM_CHUNKS - len(self.state)
        need = len(new_keys) - num_free
        evictable = sum(
            1
            for k, s in self.state.items()
            if s == "ready" and self.refs.get(k, 0) == 0 and k not in distinct
        )
        if need > 0 and evictable < need:
            assert output is None
            return
        assert output is not None
        keys_to_store, evicted = output
        assert keys_to_store == new_keys
        for k in evicted:
            assert self.state.get(k) == "ready" and self.refs.get(k, 0) == 0
            assert k not in distinct
            del self.state[k]
            self.refs.pop(k, None)
        assert len(evicted) == max(need, 0)
        if not new_keys:
            return
        chunk_ids = [self.chunk_of[k] for k in new_keys]
        assert len(chunk_ids) == len(set(chunk_ids))
        for k in new_keys:
            self.state[k] = "writing"
        self._new_job(new_keys, is_store=True)

    @precondition(lambda self: any(s == "ready" for s in self.state.values()))
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        ready = sorted(k for k, s in self.state.items() if s == "ready")
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4))
        assert all(k in self.ready for k in keys)
        # One reference per distinct key: the job is finished once.
        for k in distinct_keys(keys):
            self.readers[k] = self.readers.get(k, 0) + 1
            self.refs[k] = self.refs.get(k, 0) + 1
        self._new_job(distinct_keys(keys), is_store=False)

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        """Reports from several workers in one step, possibly repeated."""
        job_ids = sorted(self.jobs)
        reports = data.draw(
            st.lists(
                st.tuples(
                    st.sampled_from(job_ids),
                    st.integers(min_value=0, max_value=self.num_workers - 1),
                ),
                min_size=1,
                max_size=6,
            )
        )
        self._report(reports)

    @precondition(lambda self: bool(self.finished_job_ids))
    @rule(data=st.data())
    def late_completion(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(self.finished_job_ids))
        rank = data.draw(st.integers(min_value=0, max_value=self.num_workers - 1))
        self._report([(job_id, rank)])

    @rule(offset=st.integers(min_value=0, max_value=100))
    def unknown_completion(self, offset: int) -> None:
        self._report([(self.next_job_id + offset, 0)])

    @rule()
    def reset(self) -> None:
        """A cache reset drops every job and chunk; reports of the dropped
        jobs arrive late."""
        self.sched_jobs.clear()
        self.chunk_of.clear()
        self.ready.clear()
        self.readers.clear()
        self.free_chunks = list(range(NUM_CHUNKS))
        self.finished_job_ids.extend(self.jobs)
        self.jobs.clear()
        self.state.clear()
        self.refs.clear()

    # --- invariants ---

    @invariant()
    def accounting_matches_model(self) -> None:
        if not hasattr(self, "num_workers"):
            return
        assert len(self.free_chunks) == NUM_CHUNKS - len(self.state)
        assert set(self.chunk_of) == set(self.state)
        assert self.ready == {k for k, s in self.state.items() if s == "ready"}
        for k in self.ready:
            assert self.readers.get(k, 0) == self.refs.get(k, 0)
        # no chunk is handed out twice, none is both held and free
        held = list(self.chunk_of.values())
        assert len(held) == len(set(held))
        assert not set(held) & set(self.free_chunks)
        assert len(self.free_chunks) == len(set(self.free_chunks))
        assert all(0 <= c < NUM_CHUNKS for c in held + self.free_chunks)
        # an active job's chunks never move to another key
        for job in self.sched_jobs.values():
            for k, chunk_id in job.chunk_ids.items():
                assert self.chunk_of[k] == chunk_id
        assert set(self.sched_jobs) == set(self.jobs)
        assert self.num_ignored == self.ignored

    @invariant()
    def saves_are_ordered_before_loads(self) -> None:
        """No chunk is written by a worker of a store job while a worker of a
        load job reads it: a key becomes loadable only once every worker
        reported its store, and a chunk that loads still read is never
        evicted for a new store."""
        if not hasattr(self, "num_workers"):
            return
        writing = {
            self.sched_jobs[job_id].chunk_ids[k]
            for job_id, job in self.jobs.items()
            if job.is_store and job.pending_ranks
            for k in job.keys
        }
        reading = {
            self.sched_jobs[job_id].chunk_ids[k]
            for job_id, job in self.jobs.items()
            if not job.is_store and job.pending_ranks
            for k in job.keys
        }
        assert not writing & reading


def test_offload_bookkeeping_state_machine():
    run = OffloadBookkeepingMachine.TestCase()
    run.settings = settings(
        max_examples=150,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    run.runTest()


# --- Transfer time as a system total ------------------------------------------


def test_wall_time_counts_concurrent_workers_once():
    # Two TP workers each move half of a job's bytes in the same step.
    times = worker_transfer_times([(0, 1.0), (1, 1.5)])
    wall_time = concurrent_wall_time(*times.values())
    assert sum(times.values()) == 2.5  # per-worker detail
    assert wall_time == 1.5  # the slowest worker
    # The system moved 2000 bytes in 1.5 s, not in 2.5 s.
    assert 2000 / wall_time > 2000 / sum(times.values())
    assert concurrent_wall_time() == 0.0


def test_logging_interval_adds_steps_per_worker():
    # Steps are sequential: a worker's times add up over the interval, and
    # the interval's wall time is the busiest worker's total.
    steps = [[(0, 0.25), (1, 0.5)], [(0, 0.5), (1, 0.125)], [(0, 0.25)]]
    times = worker_transfer_times(op for step in steps for op in step)
    assert sum(times.values()) == 1.625
    assert concurrent_wall_time(*times.values()) == 1.0  # worker 0
    assert len(times) == 2


def test_wall_time_counter_follows_the_busiest_worker():
    clock = BusiestWorkerClock()
    assert clock.advance({0: 1.0, 1: 1.5}) == 1.5
    # Worker 0 catches up and overtakes: the wall time follows the busiest
    # worker's running total (1.5 -> 1.0 + 1.0 = 2.0), never decreasing.
    assert clock.advance({0: 1.0}) == 0.5
    assert clock.advance({1: 0.25}) == 0.0
    assert clock.wall_time == 2.0
