# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fair share in the block pool: two engines' pools on one host ledger
(real files, one clock): demand published, the holder capped at its share
while the other waits, free pages given back first, preemption only after
the delay, first come first served kept as an option, a weight and a
share policy changed through the ledger CLI at runtime, and the ledger's
new fields checked like the others."""

import json
from dataclasses import dataclass

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
)
from tests.v1.kv_vmm.pool_utils import Clock, make_block_pool
from vllm.v1.kv_vmm.device_share import DeviceShare
from vllm.v1.kv_vmm.ledger import KVMemoryLedger, LedgerError
from vllm.v1.kv_vmm.ledger_cli import main as ledger_cli
from vllm.v1.kv_vmm.pages import KVLedgerOptions, KVPagePolicy
from vllm.v1.kv_vmm.pool_share import FairSharePagedBlockPool

BPP = 4  # blocks per page
PAGE = 1 << 20
NUM_BLOCKS = 64  # 16 pages: the device's capacity


@dataclass
class ShareOptions:
    kv_cache_vmm_share_policy: str = "fair"
    kv_cache_vmm_share_weight: float = 1.0
    kv_cache_vmm_reclaim_bytes_per_s: int = 64 * PAGE
    kv_cache_vmm_reclaim_preempt_delay: float = 2.0


@dataclass
class Waiting:
    num_tokens: int


@dataclass
class Running:
    num_tokens: int
    max_tokens: int
    num_output_tokens: int


def make_pool(name: str, clock: Clock, **share) -> FairSharePagedBlockPool:
    """An engine's pool without page reports (blocks of new pages are handed
    out at once), a long shrink delay (pages stay mapped unless the share
    takes them), on the host ledger of 16 pages."""
    policy = KVPagePolicy(
        granularity=2 << 20,
        blocks_per_page=BPP,
        max_pages=NUM_BLOCKS // BPP,
        headroom_pages=1,
        shrink="idle",
        shrink_delay_s=1000.0,
        device_page_bytes=PAGE,
        ahead_blocks=BPP,
        ledger=KVLedgerOptions(
            devices={"host": PAGE}, capacity_bytes=16 * PAGE, floor_bytes=0, name=name
        ),
    )
    pool = make_block_pool(
        policy,
        NUM_BLOCKS,
        clock,
        pool_class=FairSharePagedBlockPool,
        share_factory=DeviceShare,
    )
    assert isinstance(pool, FairSharePagedBlockPool)
    pool.set_share_options(ShareOptions(**share))
    return pool


def step(pool: FairSharePagedBlockPool, clock: Clock, seconds: float = 0.1):
    clock.now += seconds
    return pool.take_page_ops()


def entry(name: str):
    state = KVMemoryLedger("host").read()
    return next(e for e in state.entries if e.name == name)


def wait_for(pool: FairSharePagedBlockPool, blocks: int) -> None:
    """Requests of ``blocks`` blocks (16 tokens each) wait in ``pool``."""
    pool.note_waiting([Waiting(16 * blocks)], 8, 16)


def hold(pool: FairSharePagedBlockPool, num_blocks: int) -> list:
    return pool.get_new_blocks(num_blocks)


def test_demand_and_weight_are_published(ledger_base):
    clock = Clock()
    a = make_pool("a", clock, kv_cache_vmm_share_weight=2.0)
    held = hold(a, 10)
    wait_for(a, 100)
    step(a, clock)
    e = entry("a")
    assert e.weight == 2.0 and e.page_bytes == PAGE
    assert e.used_bytes == 3 * PAGE  # 10 blocks in use: 3 pages
    assert e.waiting_bytes > 0 and e.waiting_since == clock.now - 0.1
    a.free_blocks(held)
    wait_for(a, 0)
    step(a, clock)
    e = entry("a")
    assert e.waiting_bytes == 0 and e.waiting_since is None
    a.close()


def test_requests_waiting_for_free_blocks_keep_the_want(ledger_base):
    """An engine whose requests just finished holds free blocks that its
    next requests will fill: its want (used + waiting) counts them, without
    it waiting for memory, so its share does not drop at every turnover of
    its requests."""
    clock = Clock()
    a = make_pool("a", clock)
    held = hold(a, 3 * BPP)
    step(a, clock)
    a.free_blocks(held)
    # Two requests of 4 blocks each wait for a running slot; they fit in the
    # free blocks.
    assert a.get_num_free_blocks() >= 2 * BPP
    a.note_waiting([Waiting(16 * BPP)] * 3, 2, 16)
    step(a, clock)
    e = entry("a")
    assert e.used_bytes == 0
    assert e.waiting_bytes == 2 * PAGE and e.waiting_since is None
    assert e.demand().demand_bytes == 2 * PAGE
    # More than the free blocks: it waits for memory.
    wait_for(a, a.get_num_free_blocks() + 1)
    step(a, clock)
    assert entry("a").waiting_since is not None
    a.close()


def test_a_prompt_prefilled_in_chunks_wants_its_whole_prompt(ledger_base):
    """A running request that holds the blocks of its first chunk only
    wants the rest of its prompt's blocks too: its want does not drop while
    its prefill goes on in chunks."""
    clock = Clock()
    a = make_pool("a", clock)
    held = hold(a, BPP)  # the first chunk of a prompt of 3 pages
    a.note_waiting([], 0, 16, running=[Waiting(16 * 3 * BPP)])
    step(a, clock)
    e = entry("a")
    assert e.used_bytes == PAGE and e.waiting_bytes == 2 * PAGE
    assert e.demand().demand_bytes == 3 * PAGE
    a.free_blocks(held)
    a.close()


def start_waiting_engine(clock: Clock) -> FairSharePagedBlockPool:
    """Engine B joins the ledger with requests of 10 pages' worth waiting,
    and publishes its demand at its first step."""
    b = make_pool("b", clock)
    wait_for(b, 10 * BPP)
    step(b, clock)
    return b


def wait_until_it_counts(
    a: FairSharePagedBlockPool, b: FairSharePagedBlockPool, clock: Clock
) -> None:
    """B keeps waiting past the 0.25 s after which a waiter counts (a
    momentary wait takes nothing from A); A's next step caps A at its share."""
    clock.now += 0.3
    b.take_page_ops()
    step(a, clock)


def rewrite_entry(
    update: dict | None = None, remove: tuple[str, ...] = ()
) -> KVMemoryLedger:
    """Change the host ledger's first entry behind the ledger's back (as an
    older engine, or another user, could leave it): fields set to
    ``update``'s values and ``remove``'s fields dropped."""
    ledger = KVMemoryLedger("host")
    with open(ledger.path) as f:
        doc = json.load(f)
    doc["entries"][0].update(update or {})
    for field in remove:
        del doc["entries"][0][field]
    with open(ledger.path, "w") as out:
        json.dump(doc, out)
    return ledger


def grow_then_idle(a: FairSharePagedBlockPool, clock: Clock) -> int:
    """A maps 14 of the 16 pages for a peak, then its requests finish (the
    pages stay mapped: free, cached)."""
    held = hold(a, 14 * BPP - 1)
    step(a, clock)
    a.free_blocks(held)
    step(a, clock)
    return a.num_mapped_pages


def test_a_waiting_engine_below_its_share_gets_free_pages_back(ledger_base):
    clock = Clock()
    a = make_pool("a", clock)
    peak = grow_then_idle(a, clock)
    assert peak >= 14
    # B's requests need 10 pages; the ledger has no room for them.
    b = start_waiting_engine(clock)
    # A momentary wait changes nothing.
    assert not step(a, clock, 0.1)
    assert a.admission_reserve_blocks() == 0
    # Once B waited 0.25 s, A's effective limit is its share and it gives
    # its free pages back down to it at its next step (within the rate: 64
    # pages a second). A has no demand: its share is its floor (0 here), less
    # than a step's worth, so it keeps only the null block's page.
    clock.now += 0.3
    b.take_page_ops()
    assert a.page_step_due_in() == 0.0  # an idle engine steps for it
    ops = step(a, clock)
    assert ops is not None and ops.unmap
    assert a.num_mapped_pages == 1
    assert a._page_limit == 0 and a.policy.max_pages == 16  # the operator's
    assert a.num_share_reclaimed_pages_total == peak - a.num_mapped_pages
    assert a.make_page_stats().share_reclaimed_pages_total == peak - 1
    # B now has room up to its share.
    ops = step(b, clock)
    assert b.get_num_free_blocks() >= 6 * BPP
    # The stats (metrics) show each engine's share: B, the one that waits,
    # has the capacity but A's floor.
    (ledger,) = b.make_page_stats().ledger.values()
    shares = {e["name"]: e["share_bytes"] for e in ledger["entries"]}
    assert shares == {"a": 0, "b": ledger["capacity_bytes"]}
    a.close()
    b.close()


def test_first_come_keeps_what_it_mapped(ledger_base):
    clock = Clock()
    a = make_pool("a", clock, kv_cache_vmm_share_policy="first-come")
    peak = grow_then_idle(a, clock)
    b = make_pool("b", clock)
    wait_for(b, 10 * BPP)
    for _ in range(10):
        step(b, clock, 0.2)
        assert not step(a, clock, 0.2)
    assert a.num_mapped_pages == peak
    # It keeps its pages, but its entry says so, and what it wants is
    # published like a fair engine's (fair engines yield to it).
    assert entry("a").share_policy == "first-come"
    assert entry("b").share_policy == "fair"
    wait_for(a, 20)
    step(a, clock)
    assert entry("a").waiting_bytes == 5 * PAGE
    assert not a.share_preempt_pages() and a.admission_reserve_blocks() == 0
    a.close()
    b.close()


def test_a_share_policy_set_through_the_cli_applies_at_runtime(ledger_base, capsys):
    """An engine started first-come keeps its peak's pages while another
    waits; switched to fair through the ledger CLI it gives them back at its
    next ledger read, without a restart; switched back, it keeps them again
    (no pressure carried over)."""
    clock = Clock()
    a = make_pool("a", clock, kv_cache_vmm_share_policy="first-come")
    peak = grow_then_idle(a, clock)
    b = start_waiting_engine(clock)
    clock.now += 0.3
    b.take_page_ops()
    for _ in range(3):
        step(a, clock, 0.3)
    assert a.num_mapped_pages == peak
    assert ledger_cli(["set", "a", "--key", "host", "--share-policy", "fair"]) == 0
    assert ledger_cli(["list"]) == 0
    assert "first-come" not in capsys.readouterr().out
    b.take_page_ops()
    ops = step(a, clock, 1.1)  # past the full ledger read's interval
    assert ops is not None and ops.unmap
    assert a.num_mapped_pages < peak and a._page_limit < 16
    # Back to first-come: the cap goes at once, the pages given back stay
    # given back.
    assert (
        ledger_cli(["set", "a", "--key", "host", "--share-policy", "first-come"]) == 0
    )
    step(a, clock, 1.1)
    assert a._page_limit == 16 and a.admission_reserve_blocks() == 0
    assert ledger_cli(["list"]) == 0
    assert "first-come" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):
        ledger_cli(["set", "a", "--key", "host", "--share-policy", "fifo"])
    assert "invalid choice: 'fifo'" in capsys.readouterr().err
    assert entry("a").share_policy == "first-come"
    a.close()
    b.close()


def test_new_requests_stay_out_of_pages_beyond_the_share(ledger_base):
    clock = Clock()
    a = make_pool("a", clock, kv_cache_vmm_reclaim_bytes_per_s=0)
    held = hold(a, 14 * BPP - 1)  # all in use: nothing to give back
    step(a, clock)
    b = start_waiting_engine(clock)
    wait_until_it_counts(a, b, clock)
    assert a._page_limit == 8
    # Its running requests free blocks: they stay free for them, not for new
    # requests (rate 0: nothing is given back, only growth stops).
    a.free_blocks(held[-2 * BPP :])
    step(a, clock)
    assert a.admission_reserve_blocks() == a.free_block_queue.num_free_blocks > 0
    assert a.share_preempt_pages() == 0
    a.free_blocks(held[: -2 * BPP])
    a.close()
    b.close()


def test_preemption_only_after_the_delay_and_within_the_rate(ledger_base):
    clock = Clock()
    a = make_pool("a", clock, kv_cache_vmm_reclaim_bytes_per_s=2 * PAGE)
    held = hold(a, 14 * BPP - 1)  # every page in use
    step(a, clock)
    b = start_waiting_engine(clock)
    wait_until_it_counts(a, b, clock)
    # Pages owed, none free: requests finish on their own for 2 s ...
    assert a.share_preempt_pages() == 0
    for _ in range(8):
        b.take_page_ops()
        step(a, clock, 0.25)
    # ... then preempting is allowed, for at most a second's worth of the
    # rate (2 pages).
    owed = a.share_preempt_pages()
    assert 0 < owed <= 2
    a.free_blocks(held)
    a.close()
    b.close()


@pytest.mark.parametrize("tokens_left, at_once", [(1000, True), (5, False)])
def test_preemption_at_once_where_running_requests_outlive_the_delay(
    ledger_base, tokens_left, at_once
):
    """A holder whose running requests have more tokens to come than its
    steps (0.1 s each here) make within the preemption delay (2 s: 20
    steps) preempts for a waiter as soon as the waiter counts; where they
    finish within it, the holder waits it out."""
    clock = Clock()
    a = make_pool("a", clock)
    held = hold(a, 14 * BPP - 1)  # every page in use
    running = [Running(16 * len(held), tokens_left + 10, num_output_tokens=10)]
    for _ in range(3):
        a.note_waiting([], 0, 16, running=running)
        step(a, clock)
    b = start_waiting_engine(clock)
    a.note_waiting([], 0, 16, running=running)
    wait_until_it_counts(a, b, clock)
    assert (a.share_preempt_pages() > 0) == at_once
    a.free_blocks(held)
    a.close()
    b.close()


def test_a_weight_set_through_the_cli_moves_the_shares(ledger_base, capsys):
    clock = Clock()
    a = make_pool("a", clock)
    b = make_pool("b", clock)
    held_a, held_b = hold(a, 7 * BPP), hold(b, 7 * BPP)
    wait_for(a, 40)
    wait_for(b, 40)
    step(a, clock)
    step(b, clock)
    assert a._fair.decision.share_bytes == b._fair.decision.share_bytes == 8 * PAGE
    assert ledger_cli(["set", "a", "--key", "host", "--weight", "3"]) == 0
    step(a, clock)
    step(b, clock)
    assert a._fair.decision.share_bytes == 12 * PAGE
    assert b._fair.decision.share_bytes == 4 * PAGE
    assert ledger_cli(["list", "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    shares = {e["name"]: (e["weight"], e["share_bytes"]) for e in doc["entries"]}
    assert shares == {"a": (3.0, 12 * PAGE), "b": (1.0, 4 * PAGE)}
    assert ledger_cli(["list"]) == 0
    text = capsys.readouterr().out
    assert "demand" in text and "share" in text and "weight" in text
    assert ledger_cli(["set", "a", "--key", "host", "--weight", "0"]) == 2
    assert "not a positive number" in capsys.readouterr().err
    a.free_blocks(held_a)
    b.free_blocks(held_b)
    a.close()
    b.close()


@pytest.mark.parametrize(
    "field, value",
    [
        ("weight", 0),
        ("weight", "2"),
        ("weight", 1e9),
        ("waiting_bytes", -1),
        ("waiting_since", "yesterday"),
        ("used_bytes", 1.5),
        ("page_bytes", 0),
        ("share_policy", "fifo"),
        ("share_policy", 1),
    ],
)
def test_the_share_fields_of_a_ledger_are_checked(ledger_base, field, value):
    clock = Clock()
    a = make_pool("a", clock)
    ledger = rewrite_entry(update={field: value})
    with pytest.raises(LedgerError, match=field):
        ledger.read()
    a.close()


def test_an_entry_without_the_share_fields_reads_as_an_older_engine(ledger_base):
    clock = Clock()
    a = make_pool("a", clock)
    ledger = rewrite_entry(
        remove=(
            "used_bytes",
            "waiting_bytes",
            "waiting_since",
            "weight",
            "share_policy",
        )
    )
    assert ledger.read().entries[0].share_policy == "fair"
    demand = ledger.read().entries[0].demand()
    assert demand.weight == 1.0 and demand.waiting_bytes == 0
    assert demand.used_bytes == demand.mapped_bytes
    a.close()


def test_the_requests_are_looked_at_once_per_publish_interval(ledger_base):
    """The scheduler calls note_waiting at every step; the pool looks at the
    requests (a pass over the running ones) no more often than it may
    publish what they want."""
    clock = Clock()
    a = make_pool("a", clock)
    wait_for(a, 0)
    assert a._waiting_blocks == 0 and a._waiting_since is None
    clock.now += 0.01
    wait_for(a, 40)  # within the interval: not looked at
    assert a._waiting_blocks == 0 and a._waiting_since is None
    clock.now += 0.05
    wait_for(a, 40)
    assert a._waiting_blocks == 40 and a._waiting_since == clock.now
    a.close()
