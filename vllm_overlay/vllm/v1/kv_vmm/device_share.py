# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A paged block pool's entries in the ledgers of its devices.

With ``--kv-cache-vmm-shared`` the pool records what it maps in each
device's :class:`KVMemoryLedger` and reads there what it may map beyond
its floor and the limit set from outside (the ledger CLI); see
:mod:`vllm.v1.kv_vmm.scheduler`. With the fair share
(``--kv-cache-vmm-share-policy fair``) it also publishes its demand and
steps a :class:`FairShareController` per device on what it read.
"""

import time
import weakref
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_vmm.fair_share import (
    FairShareController,
    ReclaimOptions,
    ShareDecision,
)
from vllm.v1.kv_vmm.ledger import (
    KVMemoryLedger,
    LedgerError,
    LedgerState,
    stamp_is_settled,
)
from vllm.v1.kv_vmm.pages import KVPagePolicy
from vllm.v1.kv_vmm.pool_limits import (
    LEDGER_FULL_READ_INTERVAL_S,
    LEDGER_READ_INTERVAL_S,
)

logger = init_logger(__name__)


class DeviceShare:
    """The pool's entries in the ledgers of its devices.

    A ledger that cannot be used while the engine runs (garbage in the
    file, an unsafe file, a lock held too long: :class:`LedgerError`) never
    takes the engine down: it is logged once, with the file and the fix;
    meanwhile the pool grows nothing from that ledger (its room counts as
    none) and maps what it has, pages a step needs now included, and gives
    pages back as usual. The ledger is read again at the usual interval;
    once it can be, the pool records what it maps in it (or joins again if
    its entry or the file was removed) and goes on.
    """

    def __init__(self, policy: KVPagePolicy, initial_pages: int) -> None:
        options = policy.ledger
        assert options is not None
        self.options = options
        self.devices = options.devices
        self.max_pages = policy.max_pages
        floors = [
            initial_pages * b if options.floor_bytes is None else options.floor_bytes
            for b in self.devices.values()
        ]
        self.floor_bytes = sum(floors)
        # Pages every device's floor covers: an idle engine keeps them.
        self.floor_pages = min(
            (f // b for f, b in zip(floors, self.devices.values())), default=0
        )
        # Pages this pool maps (its record in every ledger).
        self.mapped_pages = initial_pages
        self.room_pages = 0
        self.limit_pages: int | None = None
        # The fair share: weight, one controller per device (none: first
        # come, first served), what was last published, the last decision.
        self.weight = 1.0
        self.controllers: list[FairShareController] = []
        self.published: tuple[int, int, bool] | None = None
        self.published_at = float("-inf")
        self.decision: ShareDecision | None = None
        self.parsed: dict[str, LedgerState] = {}
        self.ledgers: list[tuple[KVMemoryLedger, str, int]] = []
        for (key, page_bytes), floor in zip(self.devices.items(), floors):
            # A ledger that cannot be used refuses the start (LedgerError).
            ledger = KVMemoryLedger(key, group=options.group)
            entry_id = self._join(ledger, page_bytes, floor)
            self.ledgers.append((ledger, entry_id, page_bytes))
        self.states: dict[str, Any] = {}
        self.read_at = float("-inf")
        # Per ledger: the file's stamp before the last full read, when that was
        # (by the clock of file times).
        self._seen: dict[str, tuple[tuple[int, int, int], float]] = {}
        # Ledgers that cannot be used now (key -> the problem, logged once per
        # outage), and those whose record of this pool fell behind meanwhile.
        self.problems: dict[str, str] = {}
        self._behind: set[str] = set()
        self.wall_clock: Callable[[], float] = time.time
        # Also at interpreter exit (the list itself: an entry joined again
        # replaces its item); a killed engine's entries are dropped once the
        # kernel released its liveness lock.
        self._finalizer = weakref.finalize(self, leave_ledgers, self.ledgers)

    def _join(self, ledger: KVMemoryLedger, page_bytes: int, floor_bytes: int) -> str:
        options = self.options
        if self.limit_pages is not None:
            limit = self.limit_pages * page_bytes
        elif options.limit_bytes is not None:
            limit = options.limit_bytes
        else:
            limit = self.max_pages * page_bytes
        return ledger.join(
            capacity_bytes=(
                self.max_pages * page_bytes
                if options.capacity_bytes is None
                else options.capacity_bytes
            ),
            name=options.name,
            mapped_bytes=self.mapped_pages * page_bytes,
            floor_bytes=floor_bytes,
            limit_bytes=limit,
            fixed=options.capacity_bytes is not None,
            weight=self.weight,
            page_bytes=page_bytes,
        )

    def _failed(self, ledger: KVMemoryLedger, error: LedgerError) -> None:
        """Note a ledger that cannot be used (logged once per outage)."""
        self._behind.add(ledger.key)
        if ledger.key not in self.problems:
            logger.warning(
                "%s. This engine keeps serving with the KV memory it has "
                "mapped and maps no more from that ledger until it can be "
                "read again (tried every %.0f s and whenever the file changes)",
                str(error).rstrip("."),
                LEDGER_FULL_READ_INTERVAL_S,
            )
        self.problems[ledger.key] = str(error)

    def _catch_up(self, index: int, state: LedgerState | None) -> LedgerState | None:
        """Record what the pool maps in a ledger that could not be used for
        a while, or join it again where its entry or the file went (an
        operator removed a broken ledger); returns the ledger now."""
        ledger, entry_id, page_bytes = self.ledgers[index]
        if state is None or state.entry(entry_id) is None:
            entry_id = self._join(ledger, page_bytes, self.floor_pages * page_bytes)
            self.ledgers[index] = (ledger, entry_id, page_bytes)
            logger.info(
                "KV memory ledger %s: this engine's entry was gone; joined "
                "again with the %d pages it maps",
                ledger.path,
                self.mapped_pages,
            )
        else:
            ledger.set_mapped(entry_id, self.mapped_pages * page_bytes)
            if self.limit_pages is not None:
                ledger.update(entry_id, limit_bytes=self.limit_pages * page_bytes)
        self._behind.discard(ledger.key)
        if self.problems.pop(ledger.key, None) is not None:
            logger.info("KV memory ledger %s can be used again", ledger.path)
        return ledger.read()

    def _unchanged(self, ledger: KVMemoryLedger, now: float) -> bool:
        """Whether nobody wrote ``ledger`` since its last full read (which
        was recent enough); otherwise note its stamp for the read to come."""
        stamp = ledger.file_stamp()
        seen = self._seen.get(ledger.key)
        if (
            seen is not None
            and stamp == seen[0]
            and now - seen[1] < LEDGER_FULL_READ_INTERVAL_S
        ):
            return True
        # Taken before the read: a write after it changes the stamp, unless
        # it lands in the same tick of the file clock (then read it again).
        if stamp_is_settled(stamp, now):
            assert stamp is not None
            self._seen[ledger.key] = (stamp, now)
        else:
            self._seen.pop(ledger.key, None)
        return False

    def read(self) -> None:
        """Refresh the free room and the limit (in pages) from the ledgers
        (those nobody wrote since the last read are skipped)."""
        now = self.wall_clock()
        # A list, not a generator: every ledger's stamp is taken before the read.
        if all([self._unchanged(ledger, now) for ledger, _, _ in self.ledgers]):
            return
        room, limit, floor = None, None, None
        read_any = False
        for index, (ledger, _, page_bytes) in enumerate(self.ledgers):
            try:
                state = ledger.read()
                entry_id = self.ledgers[index][1]
                if (
                    state is None
                    or state.entry(entry_id) is None
                    or ledger.key in self._behind
                ):
                    state = self._catch_up(index, state)
                    entry_id = self.ledgers[index][1]
            except LedgerError as e:
                self._failed(ledger, e)
                room = 0  # nothing more from it until it can be used
                continue
            entry = state.entry(entry_id) if state is not None else None
            if state is None or entry is None:
                room = 0
                continue
            read_any = True
            # With the fair policy, each engine's share too (the metrics).
            self.states[ledger.key] = (
                state.report() if self.controllers else state.to_json()
            )
            self.parsed[ledger.key] = state
            self.weight = entry.weight
            pages = state.room(entry_id) // page_bytes
            room = pages if room is None else min(room, pages)
            pages = entry.floor_bytes // page_bytes
            floor = pages if floor is None else min(floor, pages)
            if entry.limit_bytes is not None:
                pages = max(1, entry.limit_bytes // page_bytes)
                limit = pages if limit is None else min(limit, pages)
        self.room_pages = room if room is not None else 0
        if read_any:
            self.limit_pages = limit
        if floor is not None:
            self.floor_pages = floor

    def grow(self, num_pages: int, force: bool) -> int:
        """Record up to ``num_pages`` more on every device; the pages all of
        them granted (all of them with ``force``: pages a step needs now,
        also where a ledger cannot be used; none from such a ledger
        otherwise)."""
        granted = []
        for ledger, entry_id, page_bytes in self.ledgers:
            try:
                nbytes = ledger.grow(
                    entry_id, num_pages * page_bytes, page_bytes, force
                )
            except LedgerError as e:
                self._failed(ledger, e)
                nbytes = num_pages * page_bytes if force else 0
            granted.append(nbytes // page_bytes)
        pages = min(granted, default=num_pages)
        for (ledger, entry_id, page_bytes), got in zip(self.ledgers, granted):
            if got > pages:
                self._shrink_one(ledger, entry_id, (got - pages) * page_bytes)
        self.room_pages = max(self.room_pages - pages, 0)
        self.mapped_pages += pages
        return pages

    def _shrink_one(self, ledger: KVMemoryLedger, entry_id: str, nbytes: int) -> None:
        try:
            ledger.shrink(entry_id, nbytes)
        except LedgerError as e:
            self._failed(ledger, e)

    def shrink(self, num_pages: int) -> None:
        self.mapped_pages = max(self.mapped_pages - num_pages, 0)
        for ledger, entry_id, page_bytes in self.ledgers:
            self._shrink_one(ledger, entry_id, num_pages * page_bytes)

    def set_limit(self, num_pages: int) -> None:
        for ledger, entry_id, page_bytes in self.ledgers:
            try:
                ledger.update(entry_id, limit_bytes=num_pages * page_bytes)
            except LedgerError as e:
                self._failed(ledger, e)
        self.limit_pages = num_pages

    def largest_device_floor_bytes(self, device_page_bytes: int) -> int:
        """This engine's floor on the device that holds the most of its KV
        memory, as the ledger last showed it (the floor it joined with
        before the first read)."""
        largest = max(self.devices, key=self.devices.__getitem__)
        ids = {entry_id for _, entry_id, _ in self.ledgers}
        for entry in self.states.get(largest, {}).get("entries", []):
            if entry["id"] in ids:
                return entry["floor_bytes"]
        return self.floor_pages * device_page_bytes

    def close(self) -> None:
        self._finalizer()

    # -- the fair share ------------------------------------------------------
    def start_fair_share(self, weight: float, reclaim: ReclaimOptions) -> None:
        """Share the devices fairly (weighted max-min) from now on."""
        self.weight = weight
        self._update_all(weight=weight)
        self.controllers = [
            FairShareController(entry_id, page_bytes, reclaim)
            for _, entry_id, page_bytes in self.ledgers
        ]

    def _update_all(self, **fields: Any) -> None:
        for ledger, entry_id, _ in self.ledgers:
            try:
                ledger.update(entry_id, **fields)
            except LedgerError as e:
                self._failed(ledger, e)

    def decide(self, now: float, free_pages: int) -> ShareDecision | None:
        """Step every device's controller on the ledgers as last read: the
        smallest effective limit, the largest reclaim, preemption where any
        device allows it; the share on the device of the largest page.
        None without the fair share or a ledger read yet."""
        decisions: list[tuple[int, ShareDecision]] = []
        for (ledger, entry_id, page_bytes), controller in zip(
            self.ledgers, self.controllers
        ):
            state = self.parsed.get(ledger.key)
            if state is None or ledger.key in self.problems:
                continue
            controller.entry_id = entry_id  # joined again meanwhile
            engines = [e.demand() for e in state.entries]
            decision = controller.step(
                now, state.capacity_bytes, engines, self.mapped_pages, free_pages
            )
            decisions.append((page_bytes, decision))
        if not decisions:
            self.decision = None
            return None
        self.decision = ShareDecision(
            effective_limit_pages=min(d.effective_limit_pages for _, d in decisions),
            reclaim_pages=max(d.reclaim_pages for _, d in decisions),
            preempt_allowed=any(d.preempt_allowed for _, d in decisions),
            share_bytes=max(decisions, key=lambda d: d[0])[1].share_bytes,
        )
        return self.decision

    def publish(
        self,
        now: float,
        used_pages: int,
        waiting_pages: int,
        waiting_since: float | None,
    ) -> None:
        """Write the engine's demand to its ledgers when it changed by a
        page or its wait began or ended, at most every
        :data:`LEDGER_READ_INTERVAL_S` (each write makes every other engine
        read the file in full)."""
        current = (used_pages, waiting_pages, waiting_since is not None)
        if current == self.published:
            return
        if 0 <= now - self.published_at < LEDGER_READ_INTERVAL_S:
            return
        self.published, self.published_at = current, now
        for ledger, entry_id, page_bytes in self.ledgers:
            try:
                ledger.update(
                    entry_id,
                    used_bytes=used_pages * page_bytes,
                    waiting_bytes=waiting_pages * page_bytes,
                    waiting_since=waiting_since,
                )
            except LedgerError as e:
                self._failed(ledger, e)


def leave_ledgers(ledgers: list[tuple[KVMemoryLedger, str, int]]) -> None:
    for ledger, entry_id, _ in ledgers:
        try:
            ledger.leave(entry_id)
        except LedgerError as e:
            # Nothing to fix at exit: the entry goes with this process's lock.
            logger.warning("%s", e)
