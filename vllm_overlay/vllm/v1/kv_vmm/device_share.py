# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A paged block pool's entries in the ledgers of its devices.

With ``--kv-cache-vmm-shared`` the pool records what it maps in each
device's :class:`KVMemoryLedger` and reads there what it may map beyond
its floor and the limit set from outside (the ledger CLI); see
:mod:`vllm.v1.kv_vmm.scheduler`. The fair share
(:mod:`vllm.v1.kv_vmm.pool_share`) writes the engine's demand through
:meth:`DeviceShare.update` and reads the ledgers this object read.
"""

import time
import weakref
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_vmm.ledger import (
    SERVING_LOCK_TIMEOUT_S,
    KVMemoryLedger,
    LedgerError,
    LedgerState,
    stamp_is_settled,
)
from vllm.v1.kv_vmm.pages import KVPagePolicy
from vllm.v1.kv_vmm.pool_limits import LEDGER_FULL_READ_INTERVAL_S

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
    its entry or the file was removed) and goes on. Until then the pool
    leaves the file alone: only that read tries it, waiting for its lock at
    most ``SERVING_LOCK_TIMEOUT_S`` (a process stopped while it holds the
    lock costs a step no more).
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
        # The engine's fair-share weight and share policy as the ledgers
        # show them (the ledger CLI may change both), and whether the states
        # read carry each engine's fair share (set by the fair share, for
        # its metrics).
        self.weight = 1.0
        self.share_policy = "fair"
        self.report_shares = False
        self.parsed: dict[str, LedgerState] = {}
        self.ledgers: list[tuple[KVMemoryLedger, str, int]] = []
        for (key, page_bytes), floor in zip(self.devices.items(), floors):
            # A ledger that cannot be used refuses the start (LedgerError).
            ledger = KVMemoryLedger(key, group=options.group)
            entry_id = self._join(ledger, page_bytes, floor)
            # Serving from now on: a stuck lock must not stall every step.
            ledger.lock_timeout_s = SERVING_LOCK_TIMEOUT_S
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
            share_policy=self.share_policy,
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
                state.report() if self.report_shares else state.to_json()
            )
            self.parsed[ledger.key] = state
            self.weight = entry.weight
            self.share_policy = entry.share_policy
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
            if ledger.key in self._behind:
                # Not used until a read succeeds (which records the pages).
                granted.append(num_pages if force else 0)
                continue
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
        if ledger.key in self._behind:
            return
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
            if ledger.key in self._behind:
                continue
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

    def update(self, fields_of: Callable[[int], dict[str, Any]]) -> None:
        """Write fields of this engine's entry in every ledger:
        ``fields_of(page_bytes)``, those of a device whose page takes
        ``page_bytes``. A ledger that cannot be used is noted as such (see
        the class docstring)."""
        for ledger, entry_id, page_bytes in self.ledgers:
            if ledger.key in self._behind:
                continue
            try:
                ledger.update(entry_id, **fields_of(page_bytes))
            except LedgerError as e:
                self._failed(ledger, e)


def leave_ledgers(ledgers: list[tuple[KVMemoryLedger, str, int]]) -> None:
    for ledger, entry_id, _ in ledgers:
        try:
            ledger.leave(entry_id)
        except LedgerError as e:
            # Nothing to fix at exit: the entry goes with this process's lock.
            logger.warning("%s", e)
