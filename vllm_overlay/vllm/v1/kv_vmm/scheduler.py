# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Page-aware block pool: physical KV pages follow the blocks in use.

The free queue holds only blocks of mapped pages, so allocation fills mapped
pages first (in vLLM's usual LRU order) and a new page is mapped only when
they run out. Blocks of unmapped pages still count as free up to the
physical limit, so admission works as with a fully allocated cache. The
decisions are queued as :class:`KVPageOps` and sent to every rank in the
step message.

While requests run, the pool keeps a step's worth of free blocks mapped
(``KVPagePolicy.ahead_blocks``): pages mapped to refill it go in
``KVPageOps.ahead``, which the workers map right after launching the step's
forward pass, and the scheduler hands their blocks out from the next step
on. So in steady state no step waits for the driver; only a step that needs
more than was mapped ahead (the first burst after an idle shrink) maps
pages before its forward pass. A step refills at most as many blocks as it
handed out (a page's worth at least): the maps then take about as long as
the step's own forward pass hides, instead of a whole step's worth landing
behind the short forward pass of the first request after an idle period.

The device may not have the memory (another process took it): a page's
blocks are handed out only once every rank reported it mapped, in the
engine's page report (``KVPagePolicy.page_status_path``, where every rank is
on the engine core's host). Blocks of pages being mapped count as not free:
an allocation that needs them waits for the ranks' reports
(:meth:`PagedBlockPool.ensure_free_blocks`, at most
:data:`PAGE_REPORT_WAIT_S`); what it still lacks is asked for in the step
message, and the request waits until then (vLLM's own scheduling). A page
some rank could not map is unmapped again on the others, and no page is
asked for until a backoff is over: requests wait, or are preempted, as with a
full KV cache, and proceed once the memory is back. No step ever waits for
memory.

Sharing a device (``KVPagePolicy.ledger``, with the ``share_factory`` the
engine gives the pool: :class:`vllm.v1.kv_vmm.device_share.DeviceShare`):
the pool records what it maps in each device's ledger and maps beyond its
floor only what the ledger shows as free; a limit set there (by the ledger
CLI) becomes the page limit. Idle, it keeps its floor mapped (reserved for
it in the ledger anyway), so its next burst does not start by waiting for
the driver. A subclass shares the devices by a policy of its own through
the ``_share_*`` hooks (:mod:`vllm.v1.kv_vmm.pool_share`).
"""

import time
from collections.abc import Callable, Iterable

from vllm.logger import init_logger
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.kv_cache_compat import notify_blocks_reused
from vllm.v1.kv_vmm.page_status import KVPageStatus
from vllm.v1.kv_vmm.pages import KVPageOps, KVPagePolicy, initial_kv_pages
from vllm.v1.kv_vmm.pool_limits import (
    LEDGER_FULL_READ_INTERVAL_S,
    LEDGER_READ_INTERVAL_S,
    KVPoolShare,
    KVPoolShareFactory,
    PageLimitsMixin,
)

__all__ = [
    "LEDGER_FULL_READ_INTERVAL_S",
    "LEDGER_READ_INTERVAL_S",
    "MAP_RETRY_MAX_S",
    "MAP_RETRY_MIN_S",
    "PAGE_REPORT_WAIT_S",
    "PagedBlockPool",
]

logger = init_logger(__name__)

#: Backoff before pages some rank could not map are asked for again.
MAP_RETRY_MIN_S = 0.1
MAP_RETRY_MAX_S = 5.0
#: How long an allocation that needs blocks of pages being mapped waits for
#: every rank's report of them (they are mapped right after the forward pass
#: of the step that asked for them is launched). A rank that has not
#: reported by then leaves them not free for now: the request waits for a
#: later step; nothing waits longer.
PAGE_REPORT_WAIT_S = 1.0


class PagedBlockPool(PageLimitsMixin, BlockPool):
    """:class:`BlockPool` whose blocks live on pages mapped on demand.

    Args:
        policy: page size, limit, headroom and shrink policy (the same
            object every rank received).
        share_factory: builds the pool's entries in its devices' ledgers
            where the policy has them (``policy.ledger``); None: the pool
            has the device to itself.
        *args, **kwargs: as for :class:`BlockPool`.

    """

    def __init__(
        self,
        *args,
        policy: KVPagePolicy,
        share_factory: KVPoolShareFactory | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        bpp = policy.blocks_per_page
        self.num_pages = -(-self.num_gpu_blocks // bpp)
        self._mapped: set[int] = set()
        self._pending = KVPageOps()
        self._checking_idle = False
        self.num_pages_unmapped_total = 0
        # Blocks handed out since the last step message: bounds the refill.
        self._blocks_handed_out = 0
        # Idle shrink waits policy.shrink_delay_s from the moment the pool
        # was first seen idle, so back-to-back bursts reuse their pages
        # instead of mapping them again on their critical path.
        self.clock: Callable[[], float] = time.monotonic
        self._idle_since: float | None = None
        # With a device ledger, free pages beyond a step's worth are given
        # back after the same delay while requests run (_busy_trim_due).
        self._surplus_since: float | None = None
        # Rebuild the free queue from the initially mapped pages only; the
        # null block (block 0) was popped by the base class and its page is
        # one of them, mapped on every rank at startup.
        initial = initial_kv_pages(policy)
        self._mapped.update(initial)
        self.num_pages_mapped_total = len(initial)
        self._num_mapped_blocks = sum(len(self._page_blocks(p)) for p in initial)
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue(
            [b for p in initial for b in self._page_blocks(p) if not b.is_null]
        )
        # Pages asked for and not yet reported mapped by every rank (only
        # with page reports); they count as mapped for the limits.
        self._inflight: set[int] = set()
        # Blocks allocations of this step lacked beyond the free and the
        # coming ones (ensure_free_blocks): asked for in its message.
        self._demand_blocks = 0
        self._status = self._open_page_status(policy)
        self.num_map_failures_total = 0
        self._retry_at = float("-inf")
        self._retry_delay = 0.0
        self._denied_logged = False
        # Pages given back to other engines by a sharing policy (subclasses).
        self.num_share_reclaimed_pages_total = 0
        self._share: KVPoolShare | None = None
        if policy.ledger is not None:
            if share_factory is None:
                raise ValueError(
                    "the KV page policy joins device ledgers "
                    "(--kv-cache-vmm-shared) but the block pool was given no "
                    "share_factory to join them with"
                )
            self._share = share_factory(policy, len(initial))
            self._read_ledger(force=True)

    @staticmethod
    def _open_page_status(policy: KVPagePolicy) -> KVPageStatus | None:
        """The ranks' page report, if every rank reported its startup pages
        there (page 0, the null block's, is one of them and never unmapped):
        otherwise some rank is on another host and cannot report, and pages
        are handed out without reports, as the workers assume then too
        (``KVPageMapper.reporting``)."""
        if policy.page_status_path is None:
            return None
        status = KVPageStatus(policy.page_status_path)
        if status.counts(0)[0] >= policy.num_ranks:
            return status
        status.close()
        logger.warning(
            "Not every rank reported its KV pages (a rank on another host): "
            "pages are handed out without the ranks' reports, and a rank that "
            "cannot map one fails the engine"
        )
        return None

    # -- accounting ---------------------------------------------------------
    @property
    def _page_limit(self) -> int:
        """Pages the pool may hold now (a sharing policy may hold it to
        fewer than the page limit)."""
        return self.policy.max_pages

    @property
    def num_mapped_pages(self) -> int:
        return len(self._mapped)

    @property
    def _num_held(self) -> int:
        """Pages mapped or being mapped: what the limits count."""
        return len(self._mapped) + len(self._inflight)

    def _page_blocks(self, page: int) -> list[KVCacheBlock]:
        bpp = self.policy.blocks_per_page
        return self.blocks[page * bpp : min((page + 1) * bpp, self.num_gpu_blocks)]

    def _growable_blocks(self, admitted: bool = False) -> int:
        # Pages are mapped lowest id first, so only the last page (which may
        # be partial) can be among the growable ones when all are.
        if self._status is not None:
            self._poll()
        num_unmapped = self.num_pages - self._num_held
        pages = min(max(self._page_limit - self._num_held, 0), num_unmapped)
        # admitted: blocks the caller was told were free (get_num_free_blocks);
        # the ledger may have changed since, the limit has not.
        if not admitted and self._retry_at > self.clock():
            # Some rank had no memory for a page: nothing more for now.
            pages = 0
        elif not admitted and self._share is not None:
            self._read_ledger()
            pages = min(pages, self._share.room_pages)
        blocks = pages * self.policy.blocks_per_page
        last = self.num_pages - 1
        if (
            pages
            and pages == num_unmapped
            and last not in self._mapped
            and last not in self._inflight
        ):
            blocks -= self.num_pages * self.policy.blocks_per_page - self.num_gpu_blocks
        return blocks

    @property
    def idle(self) -> bool:
        """No block is in use (cached free blocks do not count)."""
        return self.free_block_queue.num_free_blocks == self._num_mapped_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can have now. With page reports: those of
        pages every rank reported mapped (an allocation that needs more calls
        :meth:`ensure_free_blocks` first); without: also those of unmapped
        pages within the limits, mapped before the step that uses them."""
        if self._checking_idle:
            return self.num_gpu_blocks - 1
        if self._status is not None:
            self._poll()
            return self.free_block_queue.num_free_blocks
        growable = self._growable_blocks()
        return self.free_block_queue.num_free_blocks + growable

    def _inflight_blocks(self) -> int:
        return sum(len(self._page_blocks(p)) for p in self._inflight)

    def get_usage(self) -> float:
        # Blocks beyond the page limit (e.g. of a last page the profiled
        # memory does not cover) are never free: usage is relative to the
        # blocks the limit allows. Blocks of pages being mapped are free.
        growable = self._growable_blocks()  # takes in reported pages first
        coming = self._inflight_blocks()
        capacity = self._num_mapped_blocks - 1 + coming + growable
        if capacity <= 0:
            return 0.0
        free = self.free_block_queue.num_free_blocks + coming + growable
        return 1.0 - free / capacity

    def ensure_free_blocks(self, num_blocks: int) -> None:
        """Before vLLM checks an allocation of ``num_blocks`` against
        :meth:`get_num_free_blocks`: with page reports, wait for the reports
        of pages being mapped if the allocation needs their blocks (at most
        :data:`PAGE_REPORT_WAIT_S`: they are mapped behind the step in
        flight), and note what it still lacks, which the next step message
        asks for. A request that does not fit now waits for a later step."""
        if self._status is None:
            return
        self._poll()
        free = self.free_block_queue.num_free_blocks
        if num_blocks <= free:
            return
        coming = self._inflight_blocks()
        if num_blocks <= free + coming:
            free = self._wait_for_reports(num_blocks)
            coming = self._inflight_blocks()
        if num_blocks > free:
            self._demand_blocks = max(self._demand_blocks, num_blocks - free - coming)

    def _wait_for_reports(self, num_blocks: int) -> int:
        """Poll the ranks' reports until ``num_blocks`` are free, no page is
        being mapped any more, or :data:`PAGE_REPORT_WAIT_S` passed; the free
        blocks then."""
        deadline = time.monotonic() + PAGE_REPORT_WAIT_S
        delay = 0.0002
        while True:
            free = self.free_block_queue.num_free_blocks
            if num_blocks <= free or not self._inflight:
                return free
            if time.monotonic() >= deadline:
                return free
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
            self._poll()

    def reset_prefix_cache(self) -> bool:
        # vLLM's check ("every block but the null block is free") would count
        # the blocks beyond the page limit as used; what it means is that no
        # request holds a block.
        self._checking_idle = self.idle
        try:
            return super().reset_prefix_cache()
        finally:
            self._checking_idle = False

    # -- allocation -----------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        missing = num_blocks - self.free_block_queue.num_free_blocks
        if missing > 0 and self._status is None:
            # Without page reports: pages mapped before this step's forward.
            if missing > self._growable_blocks(admitted=True):
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
            self._grow(missing)
        self._blocks_handed_out += num_blocks
        # With page reports, only blocks of pages every rank has (the base
        # class raises if fewer are free).
        return super().get_new_blocks(num_blocks)

    def _grow(self, num_blocks: int, ahead: bool = False) -> None:
        new_pages: list[int] = []
        for page in range(self.num_pages):
            if num_blocks <= 0:
                break
            if page in self._mapped or page in self._inflight:
                continue
            new_pages.append(page)
            num_blocks -= len(self._page_blocks(page))
        self._map(new_pages, ahead)

    def _map(self, pages: list[int], ahead: bool = False) -> None:
        if self._share is not None and pages:
            # Without page reports, pages a step needs now are recorded even
            # where the ledger is short (another engine grew meanwhile): the
            # driver decides.
            force = not ahead and self._status is None
            granted = self._share.grow(len(pages), force=force)
            pages = pages[:granted]
        if not pages:
            return
        if self._status is not None:
            # Handed out once every rank reported them mapped (_poll).
            self._status.reset(pages)
            self._inflight.update(pages)
            (self._pending.ahead if ahead else self._pending.map).extend(pages)
            return
        self._mapped.update(pages)
        self._num_mapped_blocks += sum(len(self._page_blocks(p)) for p in pages)
        # Blocks of pages mapped ahead are handed out from the next step on,
        # after every rank mapped them behind this step's forward pass.
        (self._pending.ahead if ahead else self._pending.map).extend(pages)
        self.num_pages_mapped_total += len(pages)
        # Fresh blocks go to the back: blocks already mapped, cached ones
        # included, are reused first.
        self.free_block_queue.append_n([b for p in pages for b in self._page_blocks(p)])

    def _unmap(self, pages: Iterable[int]) -> None:
        pages = sorted(pages)
        for page in pages:
            blocks = self._page_blocks(page)
            notify_blocks_reused(self, blocks)
            for block in blocks:
                assert block.ref_cnt == 0 and not block.is_null
                self._maybe_evict_cached_block(block)
                self.free_block_queue.remove(block)
            self._mapped.discard(page)
            self._num_mapped_blocks -= len(blocks)
        self._pending.unmap.extend(pages)
        self.num_pages_unmapped_total += len(pages)
        if self._share is not None and pages:
            self._share.shrink(len(pages))

    def _poll(self) -> None:
        """Take in the pages every rank reported mapped (their blocks become
        free) and give up those some rank could not map."""
        assert self._status is not None
        if not self._inflight:
            return
        confirmed: list[int] = []
        failed: list[int] = []
        for page in sorted(self._inflight):
            ok, bad = self._status.counts(page)
            if ok + bad < self.policy.num_ranks:
                continue
            (failed if bad else confirmed).append(page)
        if confirmed:
            self._inflight.difference_update(confirmed)
            self._mapped.update(confirmed)
            self._num_mapped_blocks += sum(len(self._page_blocks(p)) for p in confirmed)
            self.num_pages_mapped_total += len(confirmed)
            self.free_block_queue.append_n(
                [b for p in confirmed for b in self._page_blocks(p)]
            )
            if not failed and self._retry_delay:
                logger.info("KV cache pages map again: %s", confirmed)
                self._retry_delay = 0.0
        if failed:
            self._inflight.difference_update(failed)
            # Ranks that did map them give the memory back.
            self._pending.unmap.extend(failed)
            self.num_map_failures_total += len(failed)
            if self._share is not None:
                self._share.shrink(len(failed))
            if not self._retry_delay:
                logger.warning(
                    "KV cache pages %s could not be mapped on every rank (the "
                    "device is out of memory); they are not available for now "
                    "(requests wait or are preempted as with a full KV cache), "
                    "asked for again after %.1f s, doubling up to %.0f s",
                    failed,
                    MAP_RETRY_MIN_S,
                    MAP_RETRY_MAX_S,
                )
            self._retry_delay = min(
                max(self._retry_delay * 2, MAP_RETRY_MIN_S), MAP_RETRY_MAX_S
            )
            self._retry_at = self.clock() + self._retry_delay

    def _read_ledger(self, force: bool = False) -> None:
        share = self._share
        assert share is not None
        now = self.clock()
        if not force and 0 <= now - share.read_at < LEDGER_READ_INTERVAL_S:
            return
        share.read_at = now
        share.read()
        limit = share.limit_pages
        if limit is not None and limit != self.policy.max_pages:
            # Set in the ledger from outside (the ledger CLI).
            self.policy.max_pages = limit
            self._shrink_to_limit()
            logger.info("KV page limit set to %d pages from the device ledger", limit)
        self._share_ledger_read(now)

    def _free_pages(self) -> list[int]:
        """Mapped pages none of whose blocks is in use, highest id first."""
        return sorted(
            (
                p
                for p in self._mapped
                if p != 0 and all(b.ref_cnt == 0 for b in self._page_blocks(p))
            ),
            reverse=True,
        )

    # -- per step -----------------------------------------------------------
    def take_page_ops(self) -> KVPageOps | None:
        """Page changes for this step's message, after the headroom and the
        limit are enforced."""
        policy = self.policy
        if self._status is not None:
            self._poll()
        if self._share is not None:
            self._read_ledger()
        self._share_give_back()
        # Requests waiting for blocks keep the pages they wait for.
        shrink_due_in = None if self._demand_blocks else self._idle_shrink_due_in()
        if self._num_held > policy.max_pages:
            self._shrink_to_limit()
        elif shrink_due_in == 0.0:
            # Keep the lowest free pages as headroom: pages stay compact.
            free = self._free_pages()
            self._unmap(free[: self._idle_surplus(len(free))])
        elif self._busy_trim_due():
            self._unmap(self._surplus_pages())
            self._surplus_since = None
        # While requests run or wait for blocks, a step's worth of blocks
        # stays mapped ahead; an idle pool keeps only the headroom (and gives
        # the rest back after the shrink delay).
        busy = not self.idle
        demand, self._demand_blocks = self._demand_blocks, 0
        ahead = policy.headroom_pages * policy.blocks_per_page
        if busy or demand:
            ahead = self._ahead_target()
        coming = self._inflight_blocks()
        short = max(ahead - self.free_block_queue.num_free_blocks - coming, demand)
        # The refill follows demand: what this step handed out or could not
        # hand out, a page's worth at least, so the maps hide behind its
        # forward pass. A step with no block in use launches none: what the
        # waiting requests need, up to a step's worth, is mapped at once.
        refill = max(self._blocks_handed_out + demand, policy.blocks_per_page)
        if not busy and self._status is not None:
            refill = short
        self._blocks_handed_out = 0
        if short > 0 and self._num_held < self._page_limit:
            growable = self._growable_blocks()
            # With page reports, pages of a step without a forward pass are
            # mapped before it (there is nothing to hide behind); without,
            # every refill is mapped ahead (the next step may hand it out).
            self._grow(
                min(short, refill, growable),
                ahead=busy or self._status is None,
            )
            # Not while a ledger cannot be read: nobody knows who holds the
            # memory then, and the ledger's own warning says what happens.
            if (
                self._share is not None
                and not growable
                and self._share.room_pages == 0
                and not self._share.problems
            ):
                if not self._denied_logged:
                    logger.info(
                        "KV memory of %s is held by other engines; this engine "
                        "maps more pages once the device ledger shows it free",
                        ", ".join(self._share.devices),
                    )
                    self._denied_logged = True
            else:
                self._denied_logged = False
        self._share_publish()
        if not self._pending:
            return None
        ops, self._pending = self._pending, KVPageOps()
        # A page unmapped and mapped again in the same step stays mapped
        # (not one that some rank could not map: it is asked for again).
        both = set(ops.unmap) & (set(ops.map) | set(ops.ahead)) - self._inflight
        if both:
            ops = KVPageOps(
                map=[p for p in ops.map if p not in both],
                unmap=[p for p in ops.unmap if p not in both],
                ahead=[p for p in ops.ahead if p not in both],
            )
        return ops

    def wants_page_step(self) -> bool:
        """Whether an otherwise empty step should run to apply page changes
        (e.g. shrink once the pool has been idle for the shrink delay)."""
        return self.page_step_due_in() == 0.0

    def page_step_due_in(self) -> float | None:
        """Seconds until an idle shrink is due (0.0 if it is due now), or
        None if none is pending: the engine may sleep that long without
        missing the step that gives pages back."""
        if self._pending or self._num_held > self.policy.max_pages:
            return 0.0
        if self._inflight:
            # Check the ranks' reports at the next step.
            return 0.0 if self.idle else None
        return self._share_step_due_in(self._idle_shrink_due_in())

    # -- hooks of a sharing policy (vllm.v1.kv_vmm.pool_share) ----------------
    def _share_ledger_read(self, now: float) -> None:
        """The device ledgers were just read."""

    def _share_give_back(self) -> None:
        """At the start of a step's page changes: give pages back to other
        engines."""

    def _share_publish(self) -> None:
        """After a step's page changes: publish what this engine needs."""

    def _share_step_due_in(self, due: float | None) -> float | None:
        """:meth:`page_step_due_in` of an idle shrink due in ``due``."""
        return due

    def close(self) -> None:
        """Leave the device ledgers (also done at exit)."""
        if self._share is not None:
            self._share.close()
        if self._status is not None:
            self._status.close()
