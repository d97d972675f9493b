# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fair shares of a device's KV memory: the per-engine controller's rules
(cap, reclaim, preemption, hysteresis), and engines kept over-subscribed in
a discrete-time model of the device (``fair_share_sim.py``; a model, since
the policy's dynamics over minutes cannot be run with real engines in a
unit test). The shares themselves: test_shares.py."""

import pytest

from tests.v1.kv_vmm.fair_share_sim import MiB, SimEngine, Simulation, direction_changes
from vllm.v1.kv_vmm.fair_share import (
    EngineDemand,
    FairShareController,
    ReclaimOptions,
)

GiB = 1 << 30
HUGE = 1 << 50  # a demand no device satisfies


# -- the controller -------------------------------------------------------------
PAGE = 1 << 20
CAPACITY = 100 * PAGE


def holder(mapped_pages: int, **kw) -> EngineDemand:
    kw.setdefault("used_bytes", mapped_pages * PAGE)
    kw.setdefault("waiting_bytes", HUGE)
    return EngineDemand("me", mapped_bytes=mapped_pages * PAGE, page_bytes=PAGE, **kw)


def waiter(mapped_pages: int, since: float | None = 0.0, **kw) -> EngineDemand:
    kw.setdefault("used_bytes", mapped_pages * PAGE)
    kw.setdefault("waiting_bytes", 40 * PAGE if since is not None else 0)
    return EngineDemand(
        "other",
        mapped_bytes=mapped_pages * PAGE,
        page_bytes=PAGE,
        waiting_since=since,
        **kw,
    )


def controller(**options) -> FairShareController:
    options.setdefault("bytes_per_s", 1000 * PAGE)
    return FairShareController("me", PAGE, ReclaimOptions(**options))


def test_nobody_waits_so_anyone_may_use_everything():
    ctl = controller()
    idle = waiter(5, since=None, used_bytes=0)
    decision = ctl.step(10.0, CAPACITY, [holder(90), idle], 90, free_pages=30)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (100, 0)
    assert not decision.preempt_allowed
    # A waiter at its share does not take anything either.
    full = waiter(50, since=0.0)
    decision = ctl.step(11.0, CAPACITY, [holder(50), full], 50, free_pages=10)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (100, 0)
    # Its own limit stays in force.
    me = holder(40, limit_bytes=60 * PAGE)
    decision = ctl.step(12.0, CAPACITY, [me, idle], 40, free_pages=0)
    assert decision.effective_limit_pages == 60


def test_a_waiter_below_its_share_caps_the_holder_and_takes_free_pages_first():
    ctl = controller()
    engines = [holder(80), waiter(10)]
    decision = ctl.step(10.0, CAPACITY, engines, 80, free_pages=20)
    assert decision.share_bytes == 50 * PAGE
    assert decision.effective_limit_pages == 50
    assert decision.reclaim_pages == 20  # the free pages, no preemption yet
    assert not decision.preempt_allowed
    # Free pages exhausted: nothing more until the preemption delay is over
    # (the holder's requests finish and free pages meanwhile).
    decision = ctl.step(11.0, CAPACITY, [holder(60), waiter(30)], 60, free_pages=0)
    assert (decision.reclaim_pages, decision.preempt_allowed) == (0, False)
    decision = ctl.step(12.0, CAPACITY, [holder(60), waiter(30)], 60, free_pages=2)
    assert (decision.reclaim_pages, decision.preempt_allowed) == (10, True)


def test_reclaim_is_bounded_by_the_rate():
    ctl = controller(bytes_per_s=4 * PAGE, preempt_delay_s=0.0, dead_band=0.0)
    reclaimed, mapped = [], 90
    for step in range(60):
        engines = [holder(mapped), waiter(100 - mapped)]
        decision = ctl.step(10.0 + step * 0.25, CAPACITY, engines, mapped, 0)
        assert decision.preempt_allowed == bool(decision.reclaim_pages)
        reclaimed.append(decision.reclaim_pages)
        mapped -= decision.reclaim_pages
    # A burst of one second's worth, then 4 pages a second (one per step),
    # down to within a page of the share.
    assert reclaimed[:3] == [4, 1, 1]
    assert reclaimed[:36] == [4] + [1] * 35 and not any(reclaimed[36:])
    assert mapped == 51
    # A rate of 0 never gives back, it only caps.
    ctl = controller(bytes_per_s=0, preempt_delay_s=0.0)
    decision = ctl.step(10.0, CAPACITY, [holder(90), waiter(10)], 90, free_pages=40)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (50, 0)


def test_a_dead_band_around_the_share_spares_running_requests():
    ctl = controller(dead_band=0.05)
    # 2 pages above a share of 50: within 5% (2.5 pages). Its free pages
    # above the share go to the waiter, but nothing is preempted, also
    # after the preemption delay; the cap holds it where it is.
    decision = ctl.step(10.0, CAPACITY, [holder(52), waiter(10)], 52, free_pages=1)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (50, 1)
    assert not decision.preempt_allowed
    decision = ctl.step(13.0, CAPACITY, [holder(51), waiter(10)], 51, free_pages=0)
    assert (decision.reclaim_pages, decision.preempt_allowed) == (0, False)
    decision = ctl.step(13.0, CAPACITY, [holder(53), waiter(10)], 53, free_pages=0)
    assert (decision.reclaim_pages, decision.preempt_allowed) == (3, True)
    # A waiter within the band of its own share is not pressure.
    ctl = controller(dead_band=0.05)
    decision = ctl.step(10.0, CAPACITY, [holder(60), waiter(48)], 60, free_pages=5)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (100, 0)
    # Without a band, one page still is: a page is the least one preempts for.
    ctl = controller(dead_band=0.0)
    decision = ctl.step(13.0, CAPACITY, [holder(51), waiter(10)], 51, free_pages=0)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (50, 0)


def test_holders_within_their_bands_keep_no_waiter_short_of_its_share():
    """Two holders each a band above their shares would keep a waiter short
    by both bands, where its next request may not fit: their free pages
    above their shares go to it."""
    shares = []
    for me in ("a", "b"):
        ctl = FairShareController(me, PAGE, ReclaimOptions(dead_band=0.05))
        engines = [
            EngineDemand(
                name,
                mapped_bytes=35 * PAGE,
                used_bytes=33 * PAGE,
                waiting_bytes=HUGE,
                page_bytes=PAGE,
            )
            for name in ("a", "b")
        ] + [waiter(30, waiting_bytes=HUGE)]
        decision = ctl.step(10.0, 102 * PAGE, engines, 35, free_pages=2)
        shares.append((decision.share_bytes // PAGE, decision.reclaim_pages))
    assert shares == [(34, 1), (34, 1)]


def test_a_holder_whose_requests_outlive_the_delay_preempts_at_once():
    """Waiting out the preemption delay helps only where the holder's
    running requests free the pages meanwhile: where they free too few
    within it, it preempts for them at once (else the waiter waits for
    nothing, and more decoded tokens are lost to recompute)."""
    engines = [holder(80), waiter(10)]
    # 30 pages above its share, none free, 5 freed within the delay.
    decision = controller().step(10.0, CAPACITY, engines, 80, 0, freeing_pages=5)
    assert (decision.reclaim_pages, decision.preempt_allowed) == (30, True)
    # Its requests free them within the delay: it waits, as without knowing.
    for freeing in (30, None):
        ctl = controller()
        decision = ctl.step(10.0, CAPACITY, engines, 80, 0, freeing_pages=freeing)
        assert (decision.reclaim_pages, decision.preempt_allowed) == (0, False)
        decision = ctl.step(12.0, CAPACITY, engines, 80, 0, freeing_pages=freeing)
        assert (decision.reclaim_pages, decision.preempt_allowed) == (30, True)


def test_a_momentary_wait_is_no_pressure():
    ctl = controller(min_wait_s=0.5)
    decision = ctl.step(10.0, CAPACITY, [holder(80), waiter(10, 9.7)], 80, 30)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (100, 0)
    decision = ctl.step(10.2, CAPACITY, [holder(80), waiter(10, 9.7)], 80, 30)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (50, 30)


def test_the_cap_holds_after_the_waiter_stops_waiting():
    ctl = controller(hold_s=2.0)
    decision = ctl.step(10.0, CAPACITY, [holder(70), waiter(10)], 70, free_pages=20)
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (50, 20)
    # The waiter admitted what it waited for (its share is now what it
    # uses): the holder does not grow back into the room before the hold is
    # over, so the waiter's next requests find it.
    satisfied = waiter(30, since=None)
    for now in (10.5, 11.9):
        decision = ctl.step(now, CAPACITY, [holder(50), satisfied], 50, 0)
        assert decision.share_bytes == 70 * PAGE
        assert (decision.effective_limit_pages, decision.reclaim_pages) == (50, 0)
    decision = ctl.step(12.0, CAPACITY, [holder(50), satisfied], 50, 0)
    assert decision.effective_limit_pages == 100
    # Pressure again starts the hold again.
    ctl.step(13.0, CAPACITY, [holder(60), waiter(10, since=12.0)], 60, free_pages=0)
    decision = ctl.step(14.0, CAPACITY, [holder(60), satisfied], 60, 0)
    assert decision.effective_limit_pages == 50


def test_the_floor_is_never_reclaimed():
    ctl = controller()
    me = holder(70, floor_bytes=70 * PAGE)
    decision = ctl.step(10.0, CAPACITY, [me, waiter(10)], 70, free_pages=30)
    assert decision.share_bytes == 70 * PAGE
    assert (decision.effective_limit_pages, decision.reclaim_pages) == (70, 0)


def test_shares_are_bytes_and_each_engine_rounds_down_to_its_pages():
    # A holder with 3 MiB pages and a waiter with 1 MiB pages: the share is
    # 50 MiB, the holder's target 16 of its pages (48 MiB), so the waiter's
    # share is free once the holder is there.
    ctl = FairShareController("me", 3 * PAGE, ReclaimOptions(bytes_per_s=0))
    me = EngineDemand("me", mapped_bytes=30 * 3 * PAGE, waiting_bytes=HUGE)
    decision = ctl.step(10.0, CAPACITY, [me, waiter(10)], 30, free_pages=0)
    assert decision.share_bytes == 50 * PAGE
    assert decision.effective_limit_pages == 16


def test_an_engine_missing_from_the_ledger_is_left_alone():
    ctl = controller()
    decision = ctl.step(10.0, CAPACITY, [waiter(10)], 80, free_pages=30)
    assert (decision.reclaim_pages, decision.preempt_allowed) == (0, False)
    assert decision.effective_limit_pages == 100


# -- engines kept over-subscribed ---------------------------------------------------
STEP_S = 0.05
#: The device of the item "three engines sharing one GPU" (docs/BENCHMARKS.md,
#: seventh runs): the shared capacity the third engine measured.
SHARED = int(21.88 * GiB)
#: Llama-3.1-8B's, Qwen3-8B's and a smaller page: shares are bytes, each
#: engine rounds them to its own pages.
PAGES = (128 * MiB, 144 * MiB, 64 * MiB)
#: An engine is at its share once it is within the dead band (5%) or a
#: page of it, plus a page for rounding to whole pages; it must get there
#: within SETTLE_S of a change of demand or weight.
SETTLE_S = 5.0
WINDOW = 100  # steps (5 s) in which every engine decodes something


def within_share(engine: SimEngine, share: float, start_s: float, end_s: float) -> None:
    bound = max(0.05 * share, engine.page_bytes) + engine.page_bytes
    for i in range(round(start_s / STEP_S), round(end_s / STEP_S)):
        off = engine.mapped_bytes[i] - share
        assert abs(off) <= bound, (engine.id, i * STEP_S, off / GiB)


def starved_windows(engine: SimEngine) -> int:
    first = round(engine.start_s / STEP_S)
    served = engine.served
    return sum(
        1 for i in range(first, len(served) - WINDOW) if not any(served[i : i + WINDOW])
    )


def three_engines(fair: bool, request_steps: tuple[int, int]) -> list[SimEngine]:
    """The peaks of docs/BENCHMARKS.md's sharing item, made permanent: 12
    requests/s per engine, of 160-400 MiB of KV each, engines starting 10 s
    apart; together they want more than twice the device."""
    return [
        SimEngine(
            id=f"e{i}",
            page_bytes=PAGES[i],
            arrivals_per_s=12.0,
            request_bytes=(160 * MiB, 400 * MiB),
            request_steps=request_steps,
            start_s=10.0 * i,
            fair=fair,
        )
        for i in range(3)
    ]


def test_first_come_first_served_starves_the_later_engines():
    """The workload of the tests below without the fair share: the first
    engine keeps the device and the others never run a request."""
    engines = three_engines(fair=False, request_steps=(40, 200))
    Simulation(SHARED, engines, seed=0).run(60)
    assert starved_windows(engines[0]) == 0
    assert sum(engines[1].served) == sum(engines[2].served) == 0
    assert engines[0].mapped_bytes[-1] > 0.95 * SHARED


@pytest.mark.parametrize(
    "request_steps", [(40, 200), (200, 1000)], ids=["short", "long-preempting"]
)
def test_three_engines_over_subscribed_share_by_weight(request_steps):
    engines = three_engines(fair=True, request_steps=request_steps)
    sim = Simulation(SHARED, engines, seed=0)
    sim.run(60)
    engines[0].weight = 2.0
    sim.run(60)
    for e in engines:
        assert e.queue, "the device must stay over-subscribed"
        assert starved_windows(e) == 0, e.id
    # Even thirds once the last engine started, then 2:1:1.
    for e in engines:
        within_share(e, SHARED / 3, 20 + SETTLE_S, 60)
        within_share(e, SHARED * (e.weight / 4), 60 + SETTLE_S, 120)
        # Settled: no page given back and the mapping holds still.
        for start, end in ((35, 60), (75, 120)):
            window = slice(round(start / STEP_S), round(end / STEP_S))
            assert sum(e.reclaimed[window]) == 0, e.id
            assert direction_changes(e.mapped_bytes[window]) <= 1, e.id
    preempted = sum(e.preempted for e in engines)
    if request_steps == (200, 1000):
        # Requests outlive the preemption delay: pages came by preemption.
        assert preempted > 0
    else:
        # Requests finish within it or soon after: finished requests' pages
        # sufficed, but for the late engine's last pages (inside the
        # holders' dead bands), which a few preemptions gave.
        assert preempted <= 5


def test_the_late_engine_gets_its_share_sooner_from_requests_outliving_the_delay():
    """The long requests' case: holders that know their requests' steps left
    preempt as soon as the pressure is felt, not after the delay."""
    at_share = {}
    for knows in (False, True):
        engines = three_engines(fair=True, request_steps=(200, 1000))
        Simulation(SHARED, engines, seed=0, knows_steps_left=knows).run(30)
        late = engines[2]
        bound = max(0.05 * SHARED / 3, late.page_bytes) + late.page_bytes
        at_share[knows] = next(
            i * STEP_S
            for i in range(round(late.start_s / STEP_S), len(late.mapped_bytes))
            if abs(late.mapped_bytes[i] - SHARED / 3) <= bound
        )
    # Its requests arrive from 20 s; pressure counts from 20.25 s (min_wait_s).
    assert at_share[False] >= 20.25 + ReclaimOptions().preempt_delay_s
    assert at_share[True] < 22.0


def test_two_engines_stay_over_subscribed_and_both_progress():
    engines = [
        SimEngine(
            id=f"e{i}",
            page_bytes=128 * MiB,
            arrivals_per_s=6.0,
            request_bytes=(160 * MiB, 400 * MiB),
            request_steps=(40, 400),
            weight=(2.0, 1.0)[i],
        )
        for i in range(2)
    ]
    capacity = 12 * GiB
    Simulation(capacity, engines, seed=1).run(180)
    for e, share in zip(engines, (capacity * 2 / 3, capacity / 3)):
        assert e.queue, "the device must stay over-subscribed"
        assert starved_windows(e) == 0, e.id
        within_share(e, share, 20, 180)
        # Requests finish in every 30 s.
        per_30s = round(30 / STEP_S)
        steps = len(e.finished)
        assert all(sum(e.finished[i : i + per_30s]) for i in range(0, steps, per_30s))
    assert direction_changes(engines[0].mapped_bytes[400:]) <= 2


def run_edge(options: ReclaimOptions) -> list[SimEngine]:
    """Two engines whose demand crosses the device's now and then: waiters
    come and go."""
    engines = [
        SimEngine(
            id=f"e{i}",
            page_bytes=(128 * MiB, 64 * MiB)[i],
            arrivals_per_s=2.0,
            request_bytes=(160 * MiB, 400 * MiB),
            request_steps=(40, 200),
        )
        for i in range(2)
    ]
    Simulation(8 * GiB, engines, seed=1, options=options).run(100)
    return engines


def test_hysteresis_spares_preemptions_and_trades_where_waiters_come_and_go():
    calm = run_edge(ReclaimOptions())
    none = ReclaimOptions(
        dead_band=0.0, hold_s=0.0, min_wait_s=0.0, preempt_delay_s=0.0
    )
    jumpy = run_edge(none)

    def total(engines: list[SimEngine], what) -> int:
        return sum(what(e) for e in engines)

    preempted = total(calm, lambda e: e.preempted), total(jumpy, lambda e: e.preempted)
    assert preempted[0] * 10 <= preempted[1], preempted
    reclaimed = (
        total(calm, lambda e: sum(e.reclaimed)),
        total(jumpy, lambda e: sum(e.reclaimed)),
    )
    assert reclaimed[0] < reclaimed[1], reclaimed
    turns = (
        total(calm, lambda e: direction_changes(e.mapped_bytes)),
        total(jumpy, lambda e: direction_changes(e.mapped_bytes)),
    )
    assert turns[0] <= 0.75 * turns[1], turns
    assert all(starved_windows(e) == 0 for e in calm)
