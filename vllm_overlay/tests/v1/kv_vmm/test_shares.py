# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Weighted max-min fair shares of a device's KV memory, as the device ledger
and its CLI show them: weights, floors, limits and small wants, exact to the
byte, and random cases checked against the definition."""

import random

import pytest

from vllm.v1.kv_vmm.shares import EngineDemand, fair_shares

HUGE = 1 << 50  # a demand no device satisfies


def busy(engine_id: str, weight: float = 1.0, **kw) -> EngineDemand:
    kw.setdefault("mapped_bytes", 0)
    kw.setdefault("waiting_bytes", HUGE)
    return EngineDemand(id=engine_id, weight=weight, **kw)


# -- shares -------------------------------------------------------------------
def test_equal_weights_split_evenly_to_the_byte():
    shares = fair_shares(1000, [busy("a"), busy("b"), busy("c")])
    assert sorted(shares.values()) == [333, 333, 334]
    assert sum(shares.values()) == 1000


def test_weights_set_the_ratio():
    assert fair_shares(300, [busy("a", 2), busy("b", 1)]) == {"a": 200, "b": 100}
    shares = fair_shares(700, [busy("a", 0.5), busy("b", 3)])
    assert shares == {"a": 100, "b": 600}


def test_an_idle_engine_keeps_its_floor_and_leaves_the_rest():
    idle = EngineDemand("idle", mapped_bytes=200, floor_bytes=10)
    shares = fair_shares(300, [idle, busy("a"), busy("b")])
    assert shares == {"idle": 10, "a": 145, "b": 145}


def test_a_small_want_is_met_and_what_is_left_goes_by_weight():
    small = busy("small", used_bytes=20, waiting_bytes=30)
    assert fair_shares(300, [small, busy("big")]) == {"small": 50, "big": 250}
    # Every want met: the rest is spread over the engines with demand.
    a = busy("a", used_bytes=30, waiting_bytes=0)
    b = busy("b", used_bytes=60, waiting_bytes=0)
    idle = EngineDemand("idle", mapped_bytes=0)
    assert fair_shares(300, [a, b, idle]) == {"a": 150, "b": 150, "idle": 0}


def test_floors_are_granted_first():
    shares = fair_shares(300, [busy("a", floor_bytes=200), busy("b")])
    assert shares == {"a": 200, "b": 100}
    # A floor above the limit is capped by the limit, as in the ledger.
    shares = fair_shares(300, [busy("a", floor_bytes=100, limit_bytes=60), busy("b")])
    assert shares == {"a": 60, "b": 240}


def test_limits_cap_shares_and_the_rest_goes_to_the_others():
    shares = fair_shares(300, [busy("a", limit_bytes=50), busy("b"), busy("c")])
    assert shares == {"a": 50, "b": 125, "c": 125}
    # Nobody may use more than the limits allow: the rest is nobody's.
    shares = fair_shares(300, [busy("a", limit_bytes=50), busy("b", limit_bytes=70)])
    assert shares == {"a": 50, "b": 70}


def test_floors_beyond_the_capacity_are_all_granted_and_nothing_more():
    engines = [busy("a", floor_bytes=200), busy("b", floor_bytes=200), busy("c")]
    assert fair_shares(300, engines) == {"a": 200, "b": 200, "c": 0}


def test_bad_input_is_refused_with_the_option_named():
    for weight in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--kv-cache-vmm-share-weight"):
            busy("a", weight)
    with pytest.raises(ValueError, match="unique"):
        fair_shares(10, [busy("a"), busy("a")])
    with pytest.raises(ValueError, match="negative"):
        fair_shares(-1, [busy("a")])
    with pytest.raises(ValueError, match="negative"):
        EngineDemand("a", mapped_bytes=-1)


def test_random_shares_are_weighted_max_min_fair():
    """No engine short of its want could gain from another engine above its
    floor whose share per unit of weight is larger (the definition of
    weighted max-min fairness), and nothing is left unused that an engine
    with demand could take."""
    rng = random.Random(0)
    for _ in range(500):
        capacity = rng.randint(0, 10_000)
        engines = [
            EngineDemand(
                id=str(i),
                mapped_bytes=rng.randint(0, 5000),
                floor_bytes=rng.choice([0, rng.randint(0, 2000)]),
                limit_bytes=rng.choice([None, rng.randint(0, 8000)]),
                used_bytes=rng.randint(0, 3000),
                waiting_bytes=rng.choice([0, rng.randint(0, 6000)]),
                weight=rng.choice([1.0, 2.0, 0.5, rng.uniform(0.1, 5)]),
            )
            for i in range(rng.randint(1, 6))
        ]
        shares = fair_shares(capacity, engines)
        floors, wants, caps = {}, {}, {}
        for e in engines:
            cap = capacity if e.limit_bytes is None else min(e.limit_bytes, capacity)
            floor = (
                e.floor_bytes
                if e.limit_bytes is None
                else min(e.floor_bytes, e.limit_bytes)
            )
            caps[e.id] = max(cap, floor)
            floors[e.id] = floor
            wants[e.id] = min(caps[e.id], max(floor, e.demand_bytes))
        assert all(floors[i] <= s <= caps[i] for i, s in shares.items())
        if sum(floors.values()) >= capacity:
            assert shares == floors
            continue
        assert sum(shares.values()) <= capacity
        by_id = {e.id: e for e in engines}
        for i, si in shares.items():
            if si >= wants[i]:
                continue
            for j, sj in shares.items():
                if sj > floors[j]:
                    wi, wj = by_id[i].weight, by_id[j].weight
                    # Whole bytes: each share may be a byte off its level.
                    assert (si + 1) / wi >= (sj - 1) / wj - 1e-9, (capacity, engines)
        unused = capacity - sum(shares.values())
        growable = [
            i for i, s in shares.items() if by_id[i].demand_bytes and s < caps[i]
        ]
        assert unused == 0 or not growable, (capacity, engines, shares)
