# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fair shares of a device's KV memory among the engines that share it.

First come, first served (the device ledger's policy) lets one engine keep
the memory of its peak while the peak of another engine queues behind it.
This module decides, from the ledger alone, what each engine's fair share
is and what one engine does about it; it does no I/O and imports nothing
from vLLM, so the policy is tested on its own and kept out of the per-release
glue.

* :func:`fair_shares`: weighted max-min fairness (water-filling) of the
  device's capacity over the engines' demands, in bytes of that device (the
  ledger's unit; engines round to their own pages).
* :class:`FairShareController`: per engine and device, fed once per step;
  while another engine below its share waits for memory, it caps this
  engine at its share and says how many pages to give back now, and
  whether running requests may be preempted for them. While nobody below
  its share waits, it changes nothing (after a short hold): any engine may
  use everything.

docs/KV_VMM.md ("Fair shares") states the policy, its knobs and bounds.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

GiB = 1 << 30

#: The reclaim rate's burst: an engine may give back this many seconds'
#: worth of its rate at once when pressure starts after a quiet period.
RECLAIM_BURST_S = 1.0


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
    """What its waiting requests need to be admitted, beyond its free
    memory (an estimate: their tokens in blocks)."""
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


@dataclass(frozen=True)
class ReclaimOptions:
    """How fast and how eagerly an engine gives memory back to waiters."""

    bytes_per_s: int = 8 * GiB
    """``--kv-cache-vmm-reclaim-bytes-per-s``: most memory given back per
    second (bursts of :data:`RECLAIM_BURST_S` of it); 0: never give back,
    only stop growing beyond the share."""
    preempt_delay_s: float = 2.0
    """``--kv-cache-vmm-reclaim-preempt-delay``: seconds of pressure before
    running requests are preempted for pages that free pages do not cover
    (until then the holder's requests finish and free them)."""
    min_wait_s: float = 0.25
    """A waiter counts only once it has waited this long (a momentary
    blip causes no reclaim)."""
    hold_s: float = 2.0
    """After the last step with pressure, the cap of that step stays this
    long: a waiter that just got its pages and waits again soon (its next
    requests) finds them still free instead of taking them back again."""
    dead_band: float = 0.05
    """Within this fraction of its share (and at least one page) an engine
    is left alone, as holder and as waiter."""

    def __post_init__(self) -> None:
        if self.bytes_per_s < 0:
            raise ValueError("--kv-cache-vmm-reclaim-bytes-per-s must not be negative")
        if min(self.preempt_delay_s, self.min_wait_s, self.hold_s) < 0:
            raise ValueError("reclaim delays must not be negative")
        if not 0 <= self.dead_band < 1:
            raise ValueError(f"dead band must be in [0, 1): {self.dead_band}")


@dataclass(frozen=True)
class ShareDecision:
    """What the engine's block pool does this step."""

    effective_limit_pages: int
    """Pages the engine may hold: it maps no page and admits no new request
    beyond it (running requests keep the blocks they have)."""
    reclaim_pages: int
    """Pages to give back now: free pages first (cached prefix blocks on
    them evicted), the rest by preemption."""
    preempt_allowed: bool
    """Whether ``reclaim_pages`` exceeds the free pages, so the newest
    running requests are preempted (recomputed later) to free the rest."""
    share_bytes: int
    """Its fair share now (for metrics and the ledger CLI)."""


class FairShareController:
    """One engine's side of the fair share on one device.

    Args:
        entry_id: the engine's entry in the device ledger.
        page_bytes: bytes one of its pages takes on that device.
        options: reclaim rate, delays and dead band.

    """

    def __init__(
        self, entry_id: str, page_bytes: int, options: ReclaimOptions | None = None
    ) -> None:
        if page_bytes < 1:
            raise ValueError("page size must be at least 1 byte")
        self.entry_id = entry_id
        self.page_bytes = page_bytes
        self.options = options or ReclaimOptions()
        self._tokens = 0.0
        self._tokens_at: float | None = None
        self._pressure_since: float | None = None
        self._pressure_at: float | None = None
        self._held_target = 0

    def step(
        self,
        now: float,
        capacity_bytes: int,
        engines: Sequence[EngineDemand],
        mapped_pages: int,
        free_pages: int,
    ) -> ShareDecision:
        """Decide this step's limit and reclaim.

        ``engines`` is the ledger's snapshot (this engine's entry replaced by
        ``mapped_pages``, the pool's own count); ``free_pages`` are pages the
        pool can give back without preempting (free pages beyond the step's
        worth of blocks it keeps for its running requests, cached ones
        included). ``now`` is the host's monotonic clock.
        """
        page = self.page_bytes
        me = next((e for e in engines if e.id == self.entry_id), None)
        if me is None:
            # Not in the ledger (yet, or any more): nothing to share.
            limit = max(capacity_bytes // page, 1)
            return ShareDecision(limit, 0, False, capacity_bytes)
        me = replace(me, mapped_bytes=mapped_pages * page)
        engines = [me if e.id == me.id else e for e in engines]
        shares = fair_shares(capacity_bytes, engines)
        share = shares[me.id]
        own_limit = self._own_limit_pages(me, capacity_bytes)
        floor_pages = min(me.floor_bytes // page, own_limit)
        target = min(max(share // page, floor_pages), own_limit)
        self._refill(now)
        if self._note_pressure(now, engines, shares):
            self._held_target = target
            reclaim, preempt = self._reclaim(now, me, share, target, free_pages)
            return ShareDecision(target, reclaim, preempt, share)
        if self._holding(now):
            return ShareDecision(min(self._held_target, own_limit), 0, False, share)
        return ShareDecision(own_limit, 0, False, share)

    def _reclaim(
        self, now: float, me: EngineDemand, share: int, target: int, free_pages: int
    ) -> tuple[int, bool]:
        """Pages to give back now under pressure, and whether preempting
        for them is allowed: nothing within the dead band; down to the
        target within the rate; beyond the free pages only once the pressure
        has lasted ``preempt_delay_s``."""
        page = self.page_bytes
        if me.held_bytes - share <= max(self.options.dead_band * share, page):
            return 0, False
        want = me.mapped_bytes // page - target
        budget = int(self._tokens // page)
        assert self._pressure_since is not None
        waited = now - self._pressure_since
        preempt = free_pages < want and waited >= self.options.preempt_delay_s
        reclaim = max(min(want, budget if preempt else min(budget, free_pages)), 0)
        self._tokens -= reclaim * page
        return reclaim, preempt and reclaim > free_pages

    def _own_limit_pages(self, me: EngineDemand, capacity_bytes: int) -> int:
        limit = capacity_bytes if me.limit_bytes is None else me.limit_bytes
        return max(limit // self.page_bytes, 1)

    def _refill(self, now: float) -> None:
        """Token bucket of the reclaim rate (full at the first step)."""
        rate = self.options.bytes_per_s
        cap = max(rate * RECLAIM_BURST_S, self.page_bytes) if rate else 0.0
        elapsed = cap if self._tokens_at is None else (now - self._tokens_at) * rate
        self._tokens = min(self._tokens + max(elapsed, 0.0), cap)
        self._tokens_at = now

    def _below_share(self, engine: EngineDemand, share: int) -> bool:
        """Whether ``engine`` is short of its share by at least the dead
        band and one of its pages."""
        band = max(self.options.dead_band * share, engine.page_bytes)
        return share - engine.held_bytes >= band

    def _note_pressure(
        self, now: float, engines: Sequence[EngineDemand], shares: dict[str, int]
    ) -> bool:
        """Whether another engine below its share has waited for memory for
        at least ``min_wait_s``; keeps when the pressure started and was
        last seen."""
        pressured = any(
            e.id != self.entry_id
            and e.waiting_since is not None
            and now - e.waiting_since >= self.options.min_wait_s
            and self._below_share(e, shares[e.id])
            for e in engines
        )
        if not pressured:
            self._pressure_since = None
            return False
        if self._pressure_since is None:
            self._pressure_since = now
        self._pressure_at = now
        return True

    def _holding(self, now: float) -> bool:
        """Whether the cap of the last step with pressure still holds."""
        at = self._pressure_at
        return at is not None and now - at < self.options.hold_s
