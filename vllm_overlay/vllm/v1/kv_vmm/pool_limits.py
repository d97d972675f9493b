# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a paged block pool gives back, and its page limit.

Free pages go back when the pool has been idle for the shrink delay
(beyond its headroom and, with a device ledger, its floor), while it runs
with a page's worth of free blocks beyond a step's worth for that long
(with a device ledger), and at once when the page limit is lowered. The
page counters the pool reports are here too.
"""

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.kv_vmm.pages import KVPagePolicy, KVPageStats, kv_page_limit_arguments

logger = init_logger(__name__)

#: How often the pool reads the device ledgers (what is free, its limit).
LEDGER_READ_INTERVAL_S = 0.05
#: A ledger nobody wrote since the last read is read again (to drop the
#: entries of engines that died) this often; between, a ``stat`` shows that
#: nothing changed. A full read (lock, parse, a /proc look-up per engine)
#: costs the scheduler about as much as a step's allocations of 30 requests.
LEDGER_FULL_READ_INTERVAL_S = 1.0


class KVPoolShare(Protocol):
    """What a paged block pool asks of its share of its devices' KV memory
    with other engines (``KVPagePolicy.ledger``): the entries it keeps in
    each device's ledger (:class:`vllm.v1.kv_vmm.device_share.DeviceShare`).
    The pool is given a factory of it (``share_factory``) rather than
    importing it: a pool of one engine needs no ledger."""

    devices: dict[str, int]
    """Ledger key -> bytes one page takes on that device."""
    floor_pages: int
    """Pages every device's floor covers: an idle pool keeps them."""
    room_pages: int
    """Pages the ledgers, as last read, show free for this pool."""
    limit_pages: int | None
    """A page limit set in the ledgers from outside (None: none)."""
    problems: dict[str, str]
    """Ledgers that cannot be used now (key -> the problem)."""
    states: dict[str, Any]
    """Each device's ledger as last read (for the page counters)."""
    read_at: float
    """When the pool last read the ledgers (its clock)."""

    def read(self) -> None: ...

    def grow(self, num_pages: int, force: bool) -> int:
        """Record ``num_pages`` more; returns how many the ledgers grant."""
        ...

    def shrink(self, num_pages: int) -> None: ...

    def set_limit(self, num_pages: int) -> None: ...

    def largest_device_floor_bytes(self, device_page_bytes: int) -> int:
        """This engine's floor on the device that holds the most of its KV
        memory, as the ledger last showed it."""
        ...

    def close(self) -> None: ...


#: Builds a pool's :class:`KVPoolShare` from its policy and the number of
#: pages it maps at startup.
KVPoolShareFactory = Callable[[KVPagePolicy, int], KVPoolShare]


class PageLimitsMixin:
    """Shrink and limit rules of :class:`~vllm.v1.kv_vmm.scheduler.PagedBlockPool`."""

    policy: KVPagePolicy
    num_pages: int
    free_block_queue: FreeKVCacheBlockQueue
    clock: Callable[[], float]
    _share: KVPoolShare | None
    _idle_since: float | None
    _surplus_since: float | None
    num_pages_mapped_total: int
    num_pages_unmapped_total: int
    num_map_failures_total: int
    num_share_reclaimed_pages_total: int

    if TYPE_CHECKING:

        @property
        def idle(self) -> bool: ...

        @property
        def _num_held(self) -> int: ...

        def _page_blocks(self, page: int) -> list[KVCacheBlock]: ...

        def _free_pages(self) -> list[int]: ...

        def _unmap(self, pages: Iterable[int]) -> None: ...

        def _read_ledger(self, force: bool = False) -> None: ...

    def _idle_shrink_due_in(self) -> float | None:
        """Seconds until free pages beyond the headroom are given back (0.0
        if now), None if the pool is in use, never shrinks when idle, or
        has nothing beyond the headroom. Starts and resets the idle clock."""
        if not self.idle:
            self._idle_since = None
            return None
        now = self.clock()
        if self._idle_since is None:
            self._idle_since = now
        if self.policy.shrink != "idle":
            return None
        if self._share is not None:
            self._read_ledger()  # the floor (a stat when nobody wrote it)
        num_free = len(self._free_pages())
        if self._idle_surplus(num_free) <= 0:
            if self._share is not None and num_free > self.policy.headroom_pages:
                # Its floor keeps them: look at the ledger again in a while
                # (an operator may lower the floor or the limit).
                return LEDGER_FULL_READ_INTERVAL_S
            return None
        return max(self.policy.shrink_delay_s - (now - self._idle_since), 0.0)

    def _idle_surplus(self, num_free: int) -> int:
        """How many of ``num_free`` free pages an idle pool gives back: those
        beyond the headroom and, with a device ledger, beyond its floor.

        The ledger keeps an engine's floor from the other engines whether
        it maps it or not, so an idle engine keeps its floor mapped (by
        default its startup mapping: a step's worth) and its first burst
        after an idle period does not wait for the driver.
        """
        surplus = num_free - self.policy.headroom_pages
        return max(min(surplus, self._pages_beyond_floor()), 0)

    def _pages_beyond_floor(self) -> int:
        """Pages held beyond the device ledger's floor (all without one)."""
        if self._share is None:
            return self._num_held
        return self._num_held - self._share.floor_pages

    def _ahead_target(self) -> int:
        """Free blocks kept mapped while requests run: a step's worth."""
        policy = self.policy
        return max(policy.headroom_pages * policy.blocks_per_page, policy.ahead_blocks)

    def _busy_trim_due(self) -> bool:
        """With a device ledger, while requests run: whether the pool has
        had at least a page's worth of free blocks beyond a step's worth
        ahead for the shrink delay (then every whole free page beyond a
        step's worth goes back at once).

        An engine that stays busy (a trickle of requests after its peak)
        would otherwise keep its peak's memory until it goes idle, and the
        other engines on the device could not use it. The check is cheap
        (free block count); the pages are looked for only once it is due.
        """
        policy = self.policy
        if self._share is None or policy.shrink != "idle" or self.idle:
            self._surplus_since = None
            return False
        spare = self.free_block_queue.num_free_blocks - self._ahead_target()
        if spare < policy.blocks_per_page:
            self._surplus_since = None
            return False
        now = self.clock()
        if self._surplus_since is None:
            self._surplus_since = now
        return now - self._surplus_since >= policy.shrink_delay_s

    def _surplus_pages(self, keep_blocks: int | None = None) -> list[int]:
        """Free pages (highest first) whose blocks the pool can spare while
        keeping ``keep_blocks`` free blocks mapped (a step's worth by
        default)."""
        if keep_blocks is None:
            keep_blocks = self._ahead_target()
        spare = self.free_block_queue.num_free_blocks - keep_blocks
        # Never below the floor (the ledger keeps it for this engine anyway).
        beyond_floor = self._pages_beyond_floor()
        pages: list[int] = []
        for page in self._free_pages():
            num_blocks = len(self._page_blocks(page))
            if spare < num_blocks or len(pages) >= beyond_floor:
                break
            pages.append(page)
            spare -= num_blocks
        return pages

    def _shrink_to_limit(self) -> None:
        # Give back free pages, cached prefix blocks on them included; pages
        # still in use go at a later step, once their requests free them.
        excess = self._num_held - self.policy.max_pages
        if excess > 0:
            self._unmap(self._free_pages()[:excess])

    def set_page_limit(
        self, max_pages: int | None = None, max_bytes: int | None = None
    ) -> dict[str, int]:
        """Change the physical limit, in pages or in bytes per device
        (:attr:`KVPagePolicy.device_page_bytes`; rounded down to whole
        pages): exactly one of the two. See :meth:`set_max_pages`. Returns
        the page counters (:meth:`page_stats`)."""
        kv_page_limit_arguments(max_pages, max_bytes)
        if max_bytes is not None:
            page_bytes = self.policy.device_page_bytes
            if page_bytes <= 0:
                raise ValueError(
                    "this KV cache does not know its page size in bytes; give "
                    "the limit in pages (max_pages)"
                )
            max_pages = max_bytes // page_bytes
            if max_pages < 1:
                raise ValueError(
                    f"a KV cache limit of {max_bytes} bytes is less than one page "
                    f"({page_bytes} bytes per device); give at least {page_bytes}"
                )
        assert max_pages is not None
        self.set_max_pages(max_pages)
        return self.page_stats()

    def set_max_pages(self, max_pages: int) -> None:
        """Change the physical limit. Lowering it unmaps free pages at once
        (evicting the cached prefix blocks on them; the workers apply it at
        the next step) and stops admitting requests beyond it. A limit beyond
        the KV cache's capacity (every page of its reservation) is lowered to
        the capacity, with a warning."""
        if max_pages < 1:
            raise ValueError(
                f"the KV page limit must be at least 1 page (the null block's); "
                f"got {max_pages}"
            )
        if max_pages > self.num_pages:
            logger.warning(
                "KV page limit of %d pages is beyond the KV cache's capacity of "
                "%d pages (%d bytes per device); the limit is %d pages",
                max_pages,
                self.num_pages,
                self.num_pages * self.policy.device_page_bytes,
                self.num_pages,
            )
            max_pages = self.num_pages
        self.policy.max_pages = max_pages
        self._shrink_to_limit()
        if self._share is not None:
            self._share.set_limit(max_pages)
        logger.info("KV page limit set to %d pages", max_pages)

    def make_page_stats(self) -> KVPageStats:
        share = self._share
        page_bytes = self.policy.device_page_bytes
        return KVPageStats(
            mapped_pages=self._num_held,
            page_limit=self.policy.max_pages,
            mapped_bytes=self._num_held * page_bytes,
            pages_mapped_total=self.num_pages_mapped_total,
            pages_unmapped_total=self.num_pages_unmapped_total,
            map_failures_total=self.num_map_failures_total,
            floor_bytes=self._device_floor_bytes(),
            limit_bytes=self.policy.max_pages * page_bytes,
            share_reclaimed_pages_total=self.num_share_reclaimed_pages_total,
            ledger=dict(share.states) if share is not None else None,
        )

    def _device_floor_bytes(self) -> int:
        """With a device ledger, this engine's floor on the device that holds
        the most of its KV memory, as the ledger last showed it (0 without)."""
        if self._share is None:
            return 0
        return self._share.largest_device_floor_bytes(self.policy.device_page_bytes)

    def page_stats(self) -> dict[str, int]:
        """The page counters :meth:`set_page_limit` returns; byte figures in
        bytes per device (:attr:`KVPagePolicy.device_page_bytes`)."""
        page_bytes = self.policy.device_page_bytes
        return {
            "kv_pages_mapped": self._num_held,
            "kv_pages_mapped_total": self.num_pages_mapped_total,
            "kv_pages_unmapped_total": self.num_pages_unmapped_total,
            "kv_page_limit": self.policy.max_pages,
            "kv_page_capacity": self.num_pages,
            "kv_page_map_failures_total": self.num_map_failures_total,
            "kv_page_bytes": page_bytes,
            "kv_mapped_bytes": self._num_held * page_bytes,
            "kv_limit_bytes": self.policy.max_pages * page_bytes,
            "kv_capacity_bytes": self.num_pages * page_bytes,
        }
