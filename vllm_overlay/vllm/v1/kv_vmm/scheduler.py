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
"""

import time
from collections.abc import Callable, Iterable

from vllm.logger import init_logger
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.kv_vmm.pages import (
    KVPageOps,
    KVPagePolicy,
    KVPageStats,
    initial_kv_pages,
)

logger = init_logger(__name__)


class PagedBlockPool(BlockPool):
    """:class:`BlockPool` whose blocks live on pages mapped on demand.

    Args:
        policy: page size, limit, headroom and shrink policy (the same
            object every rank received).
        *args, **kwargs: as for :class:`BlockPool`.

    """

    def __init__(self, *args, policy: KVPagePolicy, **kwargs) -> None:
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

    # -- accounting ---------------------------------------------------------
    @property
    def num_mapped_pages(self) -> int:
        return len(self._mapped)

    def _page_blocks(self, page: int) -> list[KVCacheBlock]:
        bpp = self.policy.blocks_per_page
        return self.blocks[page * bpp : min((page + 1) * bpp, self.num_gpu_blocks)]

    def _growable_blocks(self) -> int:
        # Pages are mapped lowest id first, so only the last page (which may
        # be partial) can be among the growable ones when all are.
        num_unmapped = self.num_pages - len(self._mapped)
        pages = min(max(self.policy.max_pages - len(self._mapped), 0), num_unmapped)
        blocks = pages * self.policy.blocks_per_page
        if pages and pages == num_unmapped and (self.num_pages - 1) not in self._mapped:
            blocks -= self.num_pages * self.policy.blocks_per_page - self.num_gpu_blocks
        return blocks

    @property
    def idle(self) -> bool:
        """No block is in use (cached free blocks do not count)."""
        return self.free_block_queue.num_free_blocks == self._num_mapped_blocks - 1

    def get_num_free_blocks(self) -> int:
        if self._checking_idle:
            return self.num_gpu_blocks - 1
        return self.free_block_queue.num_free_blocks + self._growable_blocks()

    def get_usage(self) -> float:
        # Blocks beyond the page limit (e.g. of a last page the profiled
        # memory does not cover) are never free: usage is relative to the
        # blocks the limit allows.
        capacity = self._num_mapped_blocks - 1 + self._growable_blocks()
        if capacity <= 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / capacity

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
        if missing > 0:
            if missing > self._growable_blocks():
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
            self._grow(missing)
        self._blocks_handed_out += num_blocks
        return super().get_new_blocks(num_blocks)

    def _grow(self, num_blocks: int, ahead: bool = False) -> None:
        new_pages: list[int] = []
        for page in range(self.num_pages):
            if num_blocks <= 0:
                break
            if page in self._mapped:
                continue
            new_pages.append(page)
            num_blocks -= len(self._page_blocks(page))
        self._map(new_pages, ahead)

    def _map(self, pages: list[int], ahead: bool = False) -> None:
        if not pages:
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
            # Readers of blocks released with unpin_blocks learn that the
            # blocks are gone (block pools without that API have no readers).
            notify = getattr(self, "_notify_reuse", None)
            if notify is not None and getattr(self, "_reuse_watchers", None):
                notify(blocks)
            for block in blocks:
                assert block.ref_cnt == 0 and not block.is_null
                self._maybe_evict_cached_block(block)
                self.free_block_queue.remove(block)
            self._mapped.discard(page)
            self._num_mapped_blocks -= len(blocks)
        self._pending.unmap.extend(pages)
        self.num_pages_unmapped_total += len(pages)

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
        shrink_due_in = self._idle_shrink_due_in()
        if len(self._mapped) > policy.max_pages:
            self._shrink_to_limit()
        elif shrink_due_in == 0.0:
            # Keep the lowest free pages as headroom: pages stay compact.
            free = self._free_pages()
            self._unmap(free[: max(len(free) - policy.headroom_pages, 0)])
        # While requests run, a step's worth of blocks stays mapped ahead; an
        # idle pool keeps only the headroom (and gives the rest back after
        # the shrink delay).
        ahead = policy.headroom_pages * policy.blocks_per_page
        if not self.idle:
            ahead = max(ahead, policy.ahead_blocks)
        short = ahead - self.free_block_queue.num_free_blocks
        # The refill follows demand: what this step handed out, a page's
        # worth at least, so the maps hide behind its forward pass.
        refill = max(self._blocks_handed_out, policy.blocks_per_page)
        self._blocks_handed_out = 0
        if short > 0 and len(self._mapped) < policy.max_pages:
            self._grow(min(short, refill, self._growable_blocks()), ahead=True)
        if not self._pending:
            return None
        ops, self._pending = self._pending, KVPageOps()
        # A page unmapped and mapped again in the same step stays mapped.
        both = set(ops.unmap) & (set(ops.map) | set(ops.ahead))
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
        if self._pending or len(self._mapped) > self.policy.max_pages:
            return 0.0
        return self._idle_shrink_due_in()

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
        if (
            self.policy.shrink != "idle"
            or len(self._free_pages()) <= self.policy.headroom_pages
        ):
            return None
        return max(self.policy.shrink_delay_s - (now - self._idle_since), 0.0)

    def _shrink_to_limit(self) -> None:
        # Give back free pages, cached prefix blocks on them included; pages
        # still in use go at a later step, once their requests free them.
        excess = len(self._mapped) - self.policy.max_pages
        if excess > 0:
            self._unmap(self._free_pages()[:excess])

    def set_max_pages(self, max_pages: int) -> None:
        """Change the physical limit. Lowering it unmaps free pages at once
        (evicting the cached prefix blocks on them; the workers apply it at
        the next step) and stops admitting requests beyond it."""
        if max_pages < 1:
            raise ValueError(
                f"the KV page limit must be at least 1 page (the null block's); "
                f"got {max_pages}"
            )
        self.policy.max_pages = max_pages
        self._shrink_to_limit()
        logger.info("KV page limit set to %d pages", max_pages)

    def make_page_stats(self) -> KVPageStats:
        return KVPageStats(
            mapped_pages=len(self._mapped),
            page_limit=self.policy.max_pages,
            mapped_bytes=len(self._mapped) * self.policy.page_bytes,
            pages_mapped_total=self.num_pages_mapped_total,
            pages_unmapped_total=self.num_pages_unmapped_total,
        )

    def page_stats(self) -> dict[str, int]:
        return {
            "kv_pages_mapped": len(self._mapped),
            "kv_pages_mapped_total": self.num_pages_mapped_total,
            "kv_pages_unmapped_total": self.num_pages_unmapped_total,
            "kv_page_limit": self.policy.max_pages,
        }
