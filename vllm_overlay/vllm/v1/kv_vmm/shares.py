# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each engine's fair share of a device's KV memory, from the device ledger.

The ledger records each engine's demand (what it uses, what its waiting
requests need, its floor, limit and weight); :func:`fair_shares` gives
every engine its weighted max-min fair share (water-filling) of the
device's capacity, in bytes of that device (the ledger's unit; engines
round to their own pages). The ledger CLI and the engines' metrics show
these shares; what an engine does about its share is
:mod:`vllm.v1.kv_vmm.fair_share`. No I/O and nothing from vLLM, so the
arithmetic is tested on its own.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EngineDemand", "fair_shares"]


@dataclass(frozen=True)
class EngineDemand:
    """One engine on one device, as the ledger shows it. Sizes are bytes of
    that device."""

    id: str
    mapped_bytes: int
    floor_bytes: int = 0
    limit_bytes: int | None = None
    """None: no cap but the capacity."""
    used_bytes: int = 0
    """Held by its running requests (pages with a block in use)."""
    waiting_bytes: int = 0
    """What its requests need beyond what is in use: the waiting requests
    that could start and the running ones' blocks still to come (an
    estimate: their tokens in blocks)."""
    waiting_since: float | None = None
    """Since when requests of it have waited for KV memory, on the host's
    monotonic clock (``time.monotonic()``, one clock for every process of a
    Linux host); None: none waits for memory."""
    weight: float = 1.0
    """``--kv-cache-vmm-share-weight``: shares are proportional to it."""
    page_bytes: int = 1
    """Its page size on this device: it maps and gives back whole pages."""

    def __post_init__(self) -> None:
        sizes = (self.mapped_bytes, self.floor_bytes, self.used_bytes)
        if min(sizes + (self.waiting_bytes,)) < 0 or (
            self.limit_bytes is not None and self.limit_bytes < 0
        ):
            raise ValueError(f"engine {self.id!r}: byte counts must not be negative")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(
                f"engine {self.id!r}: share weight {self.weight!r} is not a positive "
                "number (--kv-cache-vmm-share-weight)"
            )
        if self.page_bytes < 1:
            raise ValueError(f"engine {self.id!r}: page size must be at least 1 byte")

    @property
    def held_bytes(self) -> int:
        """What it keeps from the others (the ledger's view): its mapping or
        its floor."""
        return max(self.mapped_bytes, self.floor_bytes)

    @property
    def demand_bytes(self) -> int:
        return self.used_bytes + self.waiting_bytes


def _bounds(capacity: int, engine: EngineDemand) -> tuple[int, int, int]:
    """(floor, want, cap) of one engine: the floor is granted whatever the
    others want, the cap is its limit (the ledger caps floors by limits)."""
    if engine.limit_bytes is None:
        cap, floor = capacity, engine.floor_bytes
    else:
        cap = min(engine.limit_bytes, capacity)
        floor = min(engine.floor_bytes, engine.limit_bytes)
    # A floor beyond the capacity is granted all the same (see fair_shares).
    cap = max(cap, floor)
    want = min(cap, max(floor, engine.demand_bytes))
    return floor, want, cap


def _water_fill(
    target: int, lo: list[int], hi: list[int], weights: list[float]
) -> list[int]:
    """``clamp(level * weight, lo, hi)`` per engine, the level chosen so that
    the sum is ``target`` (lo if their sum exceeds it, hi if theirs falls
    short), in whole bytes that sum to ``target``."""
    if sum(lo) >= target:
        return list(lo)
    if sum(hi) <= target:
        return list(hi)
    spans = [(low / w, high / w) for low, high, w in zip(lo, hi, weights)]

    def filled(level: float) -> float:
        return sum(
            min(max(level * w, low), high) for low, high, w in zip(lo, hi, weights)
        )

    # filled() is piecewise linear between the levels where an engine
    # reaches its lo or hi: find the piece where it crosses the target.
    below = 0.0
    for point in sorted({x for span in spans for x in span}):
        if filled(point) >= target:
            break
        below = point
    slope = sum(w for (a, b), w in zip(spans, weights) if a <= below and point <= b)
    level = below + (target - filled(below)) / slope
    exact = [level * w for w in weights]
    shares = [min(max(math.floor(x), low), high) for low, high, x in zip(lo, hi, exact)]
    # Round: the remainder (a byte per engine at most, and float error) goes
    # to the engines the level fills, largest fraction first.
    order = sorted(
        (i for i, x in enumerate(exact) if lo[i] < x < hi[i]),
        key=lambda i: shares[i] - exact[i],
    )
    return _settle(target, shares, lo, hi, order + list(range(len(shares))))


def _settle(
    target: int, shares: list[int], lo: list[int], hi: list[int], order: list[int]
) -> list[int]:
    """Make whole-byte shares sum to ``target``, one byte at a time, to or
    from engines in ``order`` that can take it within their bounds."""
    remainder = target - sum(shares)
    while remainder:
        step = 1 if remainder > 0 else -1
        for i in order if step > 0 else reversed(order):
            if remainder and lo[i] <= shares[i] + step <= hi[i]:
                shares[i] += step
                remainder -= step
    return shares


def fair_shares(capacity_bytes: int, engines: Sequence[EngineDemand]) -> dict[str, int]:
    """Each engine's fair share of ``capacity_bytes``, in bytes.

    Weighted max-min fairness over the engines with demand: every engine
    gets its floor; the rest is filled level by weight up to each engine's
    want (in use plus waiting, within its limit), so an engine that wants
    less than its weighted part leaves the difference to the others; what
    is left when every want is met is filled the same way up to the limits
    of the engines with demand. An engine without demand gets its floor:
    what it holds beyond is free or cached memory that it keeps only while
    nobody below its share waits. Floors that exceed the capacity together
    are all granted (the ledger lets every engine map its floor; the device
    then has no memory for some of them, a map fails and is retried after
    a backoff) and nobody gets more. Shares sum to the capacity unless the
    floors exceed it or the limits and wants leave some of it to nobody.
    """
    if capacity_bytes < 0:
        raise ValueError(f"capacity must not be negative: {capacity_bytes}")
    ids = [e.id for e in engines]
    if len(set(ids)) != len(ids):
        raise ValueError(f"engine ids must be unique: {ids}")
    bounds = [_bounds(capacity_bytes, e) for e in engines]
    floors = [b[0] for b in bounds]
    weights = [e.weight for e in engines]
    first = _water_fill(capacity_bytes, floors, [b[1] for b in bounds], weights)
    caps = [b[2] if e.demand_bytes else s for b, e, s in zip(bounds, engines, first)]
    shares = _water_fill(capacity_bytes, first, caps, weights)
    return dict(zip(ids, shares))
