# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fair shares of a device's KV memory among the engines that share it.

First come, first served (the device ledger's policy) lets one engine keep
the memory of its peak while the peak of another engine queues behind it.
This module decides, from the ledger alone, what each engine's fair share
is and what one engine does about it; it does no I/O and imports nothing
from vLLM, so the policy is tested on its own and kept out of the per-release
glue.

* :func:`~vllm.v1.kv_vmm.shares.fair_shares` (the ledger's arithmetic):
  weighted max-min fairness (water-filling) of the device's capacity over
  the engines' demands, in bytes of that device (the ledger's unit; engines
  round to their own pages).
* :class:`FairShareController`: per engine and device, fed once per step;
  while another engine below its share waits for memory, it caps this
  engine at its share and says how many pages to give back now, and
  whether running requests may be preempted for them. While nobody below
  its share waits, it changes nothing (after a short hold): any engine may
  use everything.

docs/KV_VMM.md ("Fair shares") states the policy, its knobs and bounds.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from vllm.v1.kv_vmm.shares import EngineDemand, fair_shares

__all__ = [
    "EngineDemand",
    "FairShareController",
    "ReclaimOptions",
    "ShareDecision",
    "fair_shares",
]

GiB = 1 << 30

#: The reclaim rate's burst: an engine may give back this many seconds'
#: worth of its rate at once when pressure starts after a quiet period.
RECLAIM_BURST_S = 1.0


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
    (until then the holder's requests finish and free them). An engine
    whose running requests will free too few of them within the delay
    preempts at once: waiting would only keep the waiter waiting, and lose
    more decoded tokens to recompute."""
    min_wait_s: float = 0.25
    """A waiter counts only once it has waited this long (a momentary
    blip causes no reclaim)."""
    hold_s: float = 2.0
    """After the last step with pressure, the cap of that step stays this
    long: a waiter that just got its pages and waits again soon (its next
    requests) finds them still free instead of taking them back again."""
    dead_band: float = 0.05
    """Within this fraction of its share (and at least one page) an engine
    is left alone, as holder and as waiter: a holder within it preempts
    nothing. Its free pages above its share still go to a waiter below its
    own (they cost no recompute), else holders within their bands could
    keep a waiter short by all their bands together."""

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
        freeing_pages: int | None = None,
    ) -> ShareDecision:
        """Decide this step's limit and reclaim.

        ``engines`` is the ledger's snapshot (this engine's entry replaced by
        ``mapped_pages``, the pool's own count); ``free_pages`` are pages the
        pool can give back without preempting (free pages beyond the step's
        worth of blocks it keeps for its running requests, cached ones
        included); ``freeing_pages``, where the pool can tell, the pages its
        running requests free by finishing within the preemption delay
        (None: not known; the delay is waited out). ``now`` is the host's
        monotonic clock.
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
            reclaim, preempt = self._reclaim(
                now, me, share, target, free_pages, freeing_pages
            )
            return ShareDecision(target, reclaim, preempt, share)
        if self._holding(now):
            return ShareDecision(min(self._held_target, own_limit), 0, False, share)
        return ShareDecision(own_limit, 0, False, share)

    def _reclaim(
        self,
        now: float,
        me: EngineDemand,
        share: int,
        target: int,
        free_pages: int,
        freeing_pages: int | None,
    ) -> tuple[int, bool]:
        """Pages to give back now under pressure, and whether preempting
        for them is allowed: down to the target within the rate, free pages
        first; beyond them (never within the dead band) once the pressure
        has lasted ``preempt_delay_s``, or at once where the running
        requests free too few within it (``freeing_pages``)."""
        page = self.page_bytes
        want = me.mapped_bytes // page - target
        if want <= 0:
            return 0, False
        assert self._pressure_since is not None
        waited = now - self._pressure_since
        too_few = freeing_pages is not None and free_pages + freeing_pages < want
        in_band = me.held_bytes - share <= max(self.options.dead_band * share, page)
        preempt = not in_band and (waited >= self.options.preempt_delay_s or too_few)
        budget = int(self._tokens // page)
        reclaim = max(min(want, budget, want if preempt else free_pages), 0)
        self._tokens -= reclaim * page
        return reclaim, reclaim > free_pages

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
