# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The block pool when pages may not be available: pages mapped ahead are
handed out once every rank reported them, a page some rank could not map is
given up and asked for again after a backoff, and engines sharing a device
map beyond their floor only what its ledger shows as free."""

import fcntl
import logging
import os
import time

import pytest

from tests.v1.kv_vmm.elastic_utils import (  # noqa: F401 (the fixtures)
    ledger_base_fixture,
    ledger_dir_fixture,
)
from tests.v1.kv_vmm.pool_utils import BPP, PAGE, make_block_pool, make_page_policy
from vllm.v1.kv_vmm.device_share import DeviceShare
from vllm.v1.kv_vmm.ledger import (
    SERVING_LOCK_TIMEOUT_S,
    STAMP_SETTLE_S,
    KVMemoryLedger,
    LedgerError,
    stamp_is_settled,
)
from vllm.v1.kv_vmm.page_status import KVPageStatus
from vllm.v1.kv_vmm.pages import KVLedgerOptions, initial_kv_pages
from vllm.v1.kv_vmm.scheduler import (
    LEDGER_FULL_READ_INTERVAL_S,
    MAP_RETRY_MIN_S,
    PagedBlockPool,
)


def make_pool(
    num_blocks: int = 64,
    num_ranks: int = 2,
    ledger: KVLedgerOptions | None = None,
    ahead_blocks: int = 8,
    reports: bool = True,
) -> tuple[PagedBlockPool, KVPageStatus]:
    policy, status = make_page_policy(
        -(-num_blocks // BPP), num_ranks, ahead_blocks, ledger=ledger
    )
    # Every rank reported its startup pages (the workers do when they start);
    # without reports, pages are handed out without them (a rank on another
    # host).
    for _ in range(num_ranks if reports else 0):
        status.report(initial_kv_pages(policy), [])
    return make_block_pool(policy, num_blocks, share_factory=DeviceShare), status


def test_ahead_pages_are_handed_out_once_every_rank_has_them():
    pool, status = make_pool()
    # Startup: pages 0..2 (null block's, a step's worth of 8 blocks ahead).
    assert pool.num_mapped_pages == 3
    free = pool.free_block_queue.num_free_blocks
    held = pool.get_new_blocks(free)  # the pool is busy now
    ops = pool.take_page_ops()
    assert ops.ahead == [3, 4] and not ops.map
    # Not handed out yet: no rank reported.
    assert pool.free_block_queue.num_free_blocks == 0
    assert pool.make_page_stats().mapped_pages == 5  # counted for the limit
    status.report([3, 4], [])  # rank 0
    assert pool.free_block_queue.num_free_blocks == 0
    assert pool.take_page_ops() is None  # no second request for the same pages
    status.report([3, 4], [])  # rank 1
    assert pool.get_num_free_blocks() >= 8
    assert pool.free_block_queue.num_free_blocks == 8
    assert {b.block_id // BPP for b in pool.get_new_blocks(8)} == {3, 4}
    pool.free_blocks(held)


def test_a_page_some_rank_could_not_map_waits_for_a_retry():
    pool, status = make_pool()
    held = pool.get_new_blocks(pool.free_block_queue.num_free_blocks)
    ops = pool.take_page_ops()
    assert ops.ahead == [3, 4]
    status.report([3, 4], [])
    status.report([3], [4])  # rank 1 had no memory for page 4
    before = pool.get_num_free_blocks()
    assert pool.free_block_queue.num_free_blocks == 4  # page 3 only
    # Page 4 is not available for now: no growth at all during the backoff,
    # so requests wait (allocation sees only what is mapped).
    assert before == 4
    assert pool.make_page_stats().map_failures_total == 1
    ops = pool.take_page_ops()
    assert ops.unmap == [4] and not ops.ahead and not ops.map  # rank 0 gives it back
    assert pool.take_page_ops() is None
    # An allocation that needs more waits: nothing is asked for meanwhile.
    pool.ensure_free_blocks(8)
    assert pool.get_num_free_blocks() == 4
    assert pool.take_page_ops() is None
    # After the backoff the pool asks for it again.
    pool.clock.now += MAP_RETRY_MIN_S
    assert room(pool) > 0
    pool.get_new_blocks(4)  # busy: the ahead target is short again
    ops = pool.take_page_ops()
    assert 4 in ops.ahead
    status.report(ops.ahead, [])
    status.report(ops.ahead, [])
    pool.get_num_free_blocks()
    assert pool.free_block_queue.num_free_blocks >= 4
    pool.free_blocks(held)


def test_two_engines_share_a_device_ledger(ledger_dir):
    options = dict(devices={"host": PAGE}, capacity_bytes=8 * PAGE, name="a")
    a, status_a = make_pool(
        num_blocks=64, num_ranks=1, ledger=KVLedgerOptions(**options)
    )
    b, status_b = make_pool(
        num_blocks=64,
        num_ranks=1,
        ledger=KVLedgerOptions(**{**options, "capacity_bytes": 99 * PAGE, "name": "b"}),
    )
    ledger = KVMemoryLedger("host")
    state = ledger.read()
    assert state.capacity_bytes == 8 * PAGE  # the first engine's
    assert [e.mapped_bytes for e in state.entries] == [3 * PAGE, 3 * PAGE]
    # Each engine's floor is its startup mapping: 6 of 8 pages held, a
    # burst of a gets the 2 free pages and no more.
    held_a = a.get_new_blocks(a.free_block_queue.num_free_blocks)
    a.clock.now += 1
    assert room(a) == 2 * BPP
    ops = a.take_page_ops()
    assert ops.ahead == [3, 4]
    status_a.report(ops.ahead, [])
    held_a += a.get_new_blocks(2 * BPP)
    a.clock.now += 1
    assert a.get_num_free_blocks() == 0 and a.take_page_ops() is None
    assert ledger.read().free_bytes == 0
    # Idle, b keeps its floor mapped (shrink delay 0): the ledger reserves
    # it for b anyway, and b's next burst does not wait for the driver.
    assert b.take_page_ops() is None
    assert find(ledger, "b").mapped_bytes == 3 * PAGE
    a.clock.now += 1
    assert a.get_num_free_blocks() == 0
    # With a lower floor (the ledger CLI), the idle b gives back what is
    # beyond it and its headroom (page 2) within a ledger read: a maps it.
    assert b.page_step_due_in() == LEDGER_FULL_READ_INTERVAL_S
    ledger.update(find_id(ledger, "b"), floor_bytes=PAGE)
    b.clock.now += 1
    assert b.page_step_due_in() == 0.0
    assert b.take_page_ops().unmap == [2]
    assert b.page_step_due_in() is None
    a.clock.now += 1
    assert room(a) == BPP
    ops = a.take_page_ops()
    assert ops.ahead == [5]
    # A limit set in the ledger (the CLI) is a's page limit, applied page
    # by page: free pages go first.
    status_a.report(ops.ahead, [])
    # Requests still hold blocks of pages 1 and 2 (no idle shrink).
    a.free_blocks([blk for blk in held_a if blk.block_id // BPP not in (1, 2)])
    ledger.update(find_id(ledger, "a"), limit_bytes=4 * PAGE)
    a.clock.now += 1
    ops = a.take_page_ops()
    assert a.policy.max_pages == 4 and a.num_mapped_pages == 4
    assert sorted(ops.unmap) == [4, 5]
    assert find(ledger, "a").mapped_bytes == 4 * PAGE
    # Leaving frees the entry; the last one removes the ledger.
    a.close()
    assert [e.name for e in ledger.read().entries] == ["b"]
    b.close()
    assert ledger.read() is None


def room(pool: PagedBlockPool) -> int:
    """Blocks the pool may still map (its limit, the ledger, no backoff)."""
    return pool._growable_blocks()


def find(ledger: KVMemoryLedger, name: str):
    state = ledger.read()
    return next(e for e in state.entries if e.name == name)


def find_id(ledger: KVMemoryLedger, name: str) -> str:
    return find(ledger, name).id


def test_a_busy_engine_gives_its_peak_memory_back_after_the_delay(ledger_dir):
    options = dict(devices={"host": PAGE}, capacity_bytes=12 * PAGE)
    a, status_a = make_pool(
        num_blocks=64, num_ranks=1, ledger=KVLedgerOptions(**options, name="a")
    )
    b, status_b = make_pool(
        num_blocks=64, num_ranks=1, ledger=KVLedgerOptions(**options, name="b")
    )
    a.policy.shrink_delay_s = b.policy.shrink_delay_s = 2.0
    ledger = KVMemoryLedger("host")
    # a's peak takes every page the ledger lets it have.
    held = []
    for _ in range(6):
        held += a.get_new_blocks(a.free_block_queue.num_free_blocks)
        ops = a.take_page_ops()
        if ops is not None:
            status_a.report(ops.ahead, [])
        a.get_num_free_blocks()
    assert find(ledger, "a").mapped_bytes == 9 * PAGE  # 12 less b's floor of 3
    # The peak ends; one request (on pages 1 and 2) keeps the engine busy.
    trickle = [blk for blk in held if blk.block_id // BPP in (1, 2)]
    a.free_blocks([blk for blk in held if blk.block_id // BPP not in (1, 2)])
    assert not a.idle
    b.get_new_blocks(b.free_block_queue.num_free_blocks)
    b.clock.now += 1
    assert b.get_num_free_blocks() == 0  # nothing free on the device
    # Free pages beyond a step's worth (8 blocks: 2 pages) go back only once
    # they stayed free for the shrink delay, although a is not idle.
    assert a.take_page_ops() is None
    a.clock.now += 1.9
    assert a.take_page_ops() is None
    a.clock.now += 0.2
    ops = a.take_page_ops()
    assert sorted(ops.unmap) == [5, 6, 7, 8]
    assert a.num_mapped_pages == 5  # null block's, the trickle's two, two ahead
    assert a.free_block_queue.num_free_blocks >= a.policy.ahead_blocks
    assert find(ledger, "a").mapped_bytes == 5 * PAGE
    # b's peak maps what a gave back.
    b.clock.now += 1
    assert room(b) == 4 * BPP
    a.free_blocks(trickle)
    a.close()
    b.close()


def test_a_ledger_nobody_wrote_is_not_parsed_again_within_the_full_read_interval(
    monkeypatch,
):
    """The pool reads its ledger every few steps; a ``stat`` tells it whether
    anybody wrote it since, and only then (or once a full read interval has
    passed, to drop engines that died) is it locked and parsed again."""
    a, _ = make_pool(
        num_ranks=1,
        ledger=KVLedgerOptions(
            devices={"host": PAGE}, capacity_bytes=8 * PAGE, name="a"
        ),
    )
    share = a._share
    ledger = share.ledgers[0][0]
    reads = []
    real_read = KVMemoryLedger.read

    def counting_read(self):
        reads.append(self.key)
        return real_read(self)

    monkeypatch.setattr(KVMemoryLedger, "read", counting_read)
    now = time.time()
    share.wall_clock = lambda: now

    def backdate() -> None:
        os.utime(ledger.path, (now - 10, now - 10))

    backdate()
    share.read()
    assert len(reads) == 1 and share.room_pages == 5  # 8 - the 3 a maps
    share.read()
    share.read()
    assert len(reads) == 1  # nobody wrote it: not parsed again
    # Another engine joins: its write changes the stamp, seen at once.
    KVMemoryLedger("host").join(
        capacity_bytes=8 * PAGE, name="b", mapped_bytes=2 * PAGE, floor_bytes=2 * PAGE
    )
    share.read()
    assert len(reads) == 2 and share.room_pages == 3
    # That write is within a tick of the file clock of now: a write after
    # the read could leave the same stamp, so the next read parses again.
    share.read()
    assert len(reads) == 3
    backdate()
    share.read()
    share.read()
    assert len(reads) == 4
    # Once the full read interval has passed, it is parsed again anyway.
    now += LEDGER_FULL_READ_INTERVAL_S
    share.read()
    assert len(reads) == 5
    a.close()


def test_a_settled_stamp_is_older_than_a_tick_of_the_file_clock():
    stamp = (1, 100, int(50.0 * 1e9))
    assert stamp_is_settled(stamp, 50.0 + STAMP_SETTLE_S + 0.001)
    assert not stamp_is_settled(stamp, 50.0 + STAMP_SETTLE_S / 2)
    assert not stamp_is_settled(stamp, 49.0)  # written "after" the clock read
    assert not stamp_is_settled(None, 50.0)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def scheduler_log():
    records = _Records()
    # The pool and its device ledgers log under the package's logger.
    logger = logging.getLogger("vllm.v1.kv_vmm")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    yield records.messages
    logger.removeHandler(records)
    logger.setLevel(level)


@pytest.mark.parametrize("reports", [True, False], ids=["reports", "no-reports"])
def test_a_garbage_ledger_never_takes_a_running_pool_down(scheduler_log, reports):
    """Garbage in the ledger while the pool runs (a process that wrote half
    a file, or another tenant): the pool keeps serving with what it has
    mapped, maps no more from the ledger, gives pages back, logs once, and
    goes on once the file is sane again.

    With the ranks' page reports, a page's blocks are handed out only once
    every rank reported it mapped: the room the ledger gives shows as the
    pages the next step message asks for when an allocation lacks blocks,
    and while the ledger cannot be read a request that lacks blocks waits.
    Without reports (a rank on another host), room shows as free blocks of
    unmapped pages, and pages a step needs now are mapped even from a
    broken ledger (the driver decides)."""
    options = KVLedgerOptions(
        devices={"host": PAGE}, capacity_bytes=16 * PAGE, name="a"
    )
    a, status = make_pool(num_blocks=64, num_ranks=1, ledger=options, reports=reports)
    ledger = KVMemoryLedger("host")
    with open(ledger.path, "rb") as f:
        good = f.read()

    def room() -> bool:
        """Whether the ledger lets the pool map a page beyond its free
        blocks now (with reports: the step message asks for one, which
        every rank then reports mapped)."""
        free = a.free_block_queue.num_free_blocks
        if not reports:
            return a.get_num_free_blocks() > free
        a.ensure_free_blocks(free + 1)
        ops = a.take_page_ops()
        if ops is None or not ops.map + ops.ahead:
            return False
        status.report(ops.map + ops.ahead, [])
        return a.get_num_free_blocks() > free  # takes the reported page in

    def take_all() -> list:
        """Every free block, and the step's refill mapped on every rank."""
        blocks = a.get_new_blocks(a.free_block_queue.num_free_blocks)
        status.report(a.take_page_ops().ahead, [])
        a.get_num_free_blocks()  # takes the reported pages in
        return blocks

    held = take_all()
    a.clock.now += 1
    assert room()
    # With reports, the page room() mapped is beyond a step's worth of free
    # blocks and goes back at the next step (the shrink delay is 0).
    a.take_page_ops()
    assert not a.take_page_ops()
    mapped = a.num_mapped_pages
    assert find(ledger, "a").mapped_bytes == mapped * PAGE

    for garbage in (
        good[: len(good) // 2],
        good.replace(b'"mapped_bytes": ', b'"mapped_bytes": -'),
    ):
        with open(ledger.path, "wb") as out:
            out.write(garbage)
        for _ in range(5):  # steps over several seconds
            a.clock.now += 0.6
            # No growth from the ledger: only the mapped free blocks count.
            assert not room()
            assert a.get_num_free_blocks() == a.free_block_queue.num_free_blocks
            assert a.take_page_ops() is None
        assert a.num_mapped_pages == mapped
        problems = [m for m in scheduler_log if ledger.path in m]
        assert len(problems) == 1, scheduler_log
        assert "is not valid" in problems[0] and f"rm {ledger.path}" in problems[0]
        assert "keeps serving" in problems[0]
        # Nothing says other engines hold the memory: nobody knows.
        assert not [m for m in scheduler_log if "held by other engines" in m]
        if not reports:
            # A step that needs pages now still gets them (the driver
            # decides).
            held += a.get_new_blocks(a.free_block_queue.num_free_blocks + BPP)
            ops = a.take_page_ops()
            assert ops.map and a.num_mapped_pages == mapped + 1
        # Blocks are freed and pages given back as usual.
        a.free_blocks(held)
        held = []
        a.clock.now += 1
        ops = a.take_page_ops()
        assert ops.unmap and a.num_mapped_pages < mapped
        # The file is sane again (repaired, or removed: the engines re-create
        # it): the pool records what it maps and has room again.
        if garbage == good[: len(good) // 2]:
            with open(ledger.path, "wb") as out:
                out.write(good)
        else:
            os.unlink(ledger.path)
        a.clock.now += 1
        assert room()
        assert find(ledger, "a").mapped_bytes == a.num_mapped_pages * PAGE
        assert any("can be used again" in m for m in scheduler_log)
        scheduler_log.clear()
        held = take_all()
        mapped = a.num_mapped_pages
    a.free_blocks(held)
    a.close()
    assert ledger.read() is None


def test_a_ledger_lock_held_by_a_stopped_process_costs_no_step(scheduler_log):
    """A process of the user stopped (or hung) while it holds the ledger's
    lock: a serving pool waits for the lock only briefly, once per ledger
    read (not for every ledger call of a step), keeps serving with what it
    has mapped, logs once naming the lock file, and records its mapping once
    the lock is free again."""
    options = KVLedgerOptions(
        devices={"host": PAGE}, capacity_bytes=16 * PAGE, name="a"
    )
    a, _ = make_pool(num_blocks=64, num_ranks=1, ledger=options, reports=False)
    ledger = KVMemoryLedger("host")
    holder = os.open(ledger.lock_path, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: another holder
    try:
        started = time.monotonic()
        for _ in range(4):  # steps over several seconds
            a.clock.now += LEDGER_FULL_READ_INTERVAL_S + 0.1
            blocks = a.get_new_blocks(a.free_block_queue.num_free_blocks + BPP)
            a.take_page_ops()
            a.free_blocks(blocks)
            a.take_page_ops()
        took = time.monotonic() - started
        # Each step waited for the lock at most once, not 5 s per call.
        assert took < 4 * (SERVING_LOCK_TIMEOUT_S + 0.5), took
    finally:
        os.close(holder)
    problems = [m for m in scheduler_log if ledger.lock_path in m]
    assert len(problems) == 1 and "keeps serving" in problems[0], scheduler_log
    time.sleep(LEDGER_FULL_READ_INTERVAL_S)  # the file did not change: the next read
    a.clock.now += LEDGER_FULL_READ_INTERVAL_S + 0.1
    a.take_page_ops()
    assert find(ledger, "a").mapped_bytes == a.num_mapped_pages * PAGE
    assert any("can be used again" in m for m in scheduler_log)
    a.close()


def test_a_starting_pool_refuses_a_garbage_ledger():
    options = KVLedgerOptions(devices={"host": PAGE}, capacity_bytes=8 * PAGE, name="a")
    a, _ = make_pool(num_ranks=1, ledger=options)
    ledger = KVMemoryLedger("host")
    with open(ledger.path, "w") as f:
        f.write('{"format": 1, "key": "host", "capacity_bytes": "lots"')
    with pytest.raises(LedgerError) as e:
        make_pool(num_ranks=1, ledger=KVLedgerOptions(**{**vars(options), "name": "b"}))
    assert str(e.value).startswith(f"KV memory ledger {ledger.path} is not valid: ")
    assert f"remove it (rm {ledger.path})" in str(e.value)
    os.unlink(ledger.path)
    a.close()
