# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fair share of a device, as a paged block pool acts on it.

With ``--kv-cache-vmm-shared`` and ``--kv-cache-vmm-share-policy fair``
(the default), the pool publishes in each device ledger what its waiting
requests need and steps a :class:`~vllm.v1.kv_vmm.fair_share.FairShareController`
per device where it reads the ledgers. While another engine below its share
waits, the decision caps this engine at its share (an effective limit of its
own: the operator's page limit stays as it is): it maps no page beyond it,
admits no new request into the free blocks beyond it, gives free pages back
(cached prefix blocks on them evicted) within the reclaim rate and, once
the pressure lasted the preemption delay, has the scheduler preempt its
newest running requests for the rest (vLLM's own preemption: they are
recomputed later); at once where its running requests, by their tokens
still to come at its recent step time, free too few pages within the
delay. The last running request is never preempted.

With ``--kv-cache-vmm-share-policy first-come`` the pool publishes its
demand all the same (fair engines on the device yield to it) but keeps what
it maps. The policy is the entry's in the ledger, which the ledger CLI may
change (``set ENGINE --share-policy``): the pool follows it from its next
ledger read on, so an operator switches policies without a restart.

The engine picks :class:`FairSharePagedBlockPool` for VMM-backed KV memory;
without a device ledger it acts as
:class:`~vllm.v1.kv_vmm.scheduler.PagedBlockPool`.
"""

import itertools
from collections.abc import Iterable
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_vmm.device_share import DeviceShare
from vllm.v1.kv_vmm.fair_share import (
    FairShareController,
    ReclaimOptions,
    ShareDecision,
)
from vllm.v1.kv_vmm.page_policy import KVSharePolicy
from vllm.v1.kv_vmm.pages import KVShareOptions
from vllm.v1.kv_vmm.pool_limits import (
    LEDGER_FULL_READ_INTERVAL_S,
    LEDGER_READ_INTERVAL_S,
)
from vllm.v1.kv_vmm.scheduler import PagedBlockPool

logger = init_logger(__name__)

# A gap between two scheduler steps this long or longer is idle time, not a
# step's (the step time estimates when running requests finish).
STEP_GAP_S = 1.0


class DeviceFairShare:
    """The fair share of a pool's devices: one :class:`FairShareController`
    per device ledger of its :class:`DeviceShare`, what the pool last
    published there and the last decision. It acts only while the share
    policy in the ledger is ``fair``."""

    def __init__(
        self,
        share: DeviceShare,
        weight: float,
        reclaim: ReclaimOptions,
        policy: KVSharePolicy = "fair",
    ) -> None:
        self.share = share
        self.reclaim = reclaim
        share.weight = weight
        share.share_policy = policy
        share.update(lambda page_bytes: {"weight": weight, "share_policy": policy})
        # The states the pool reads carry each engine's share (the metrics).
        share.report_shares = True
        self.policy: str = policy
        self.controllers = self._controllers()
        self.published: tuple[int, int, bool] | None = None
        self.published_at = float("-inf")
        self.decision: ShareDecision | None = None

    def _controllers(self) -> list[FairShareController]:
        return [
            FairShareController(entry_id, page_bytes, self.reclaim)
            for _, entry_id, page_bytes in self.share.ledgers
        ]

    def follow_policy(self) -> bool:
        """Take the share policy the ledgers last showed; whether it is
        ``fair``. A change is logged, and a policy turned back to ``fair``
        starts afresh (no pressure or hold carried over from before)."""
        policy = self.share.share_policy
        if policy != self.policy:
            logger.info(
                "KV memory of %s: share policy %s (set in the device ledger; "
                "it was %s)",
                ", ".join(self.share.devices),
                policy,
                self.policy,
            )
            self.policy = policy
            self.controllers = self._controllers()
        return policy == "fair"

    def decide(
        self, now: float, free_pages: int, freeing_pages: int | None = None
    ) -> ShareDecision | None:
        """Step every device's controller on the ledgers as last read
        (``freeing_pages``: what the running requests free within the
        preemption delay, if known): the smallest effective limit, the
        largest reclaim, preemption where any device allows it; the share on
        the device of the largest page. None without a ledger read yet, or
        while the policy is not ``fair``."""
        share = self.share
        if not self.follow_policy():
            self.decision = None
            return None
        decisions: list[tuple[int, ShareDecision]] = []
        for (ledger, entry_id, page_bytes), controller in zip(
            share.ledgers, self.controllers
        ):
            state = share.parsed.get(ledger.key)
            if state is None or ledger.key in share.problems:
                continue
            controller.entry_id = entry_id  # joined again meanwhile
            engines = [e.demand() for e in state.entries]
            decision = controller.step(
                now,
                state.capacity_bytes,
                engines,
                share.mapped_pages,
                free_pages,
                freeing_pages,
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
        self.share.update(
            lambda page_bytes: {
                "used_bytes": used_pages * page_bytes,
                "waiting_bytes": waiting_pages * page_bytes,
                "waiting_since": waiting_since,
            }
        )


def _blocks_of(request: Any, block_size: int, num_groups: int) -> int:
    """The blocks a request's tokens take in each of ``num_groups`` KV cache
    groups of ``block_size`` tokens."""
    return -(-request.num_tokens // block_size) * num_groups


class FairSharePagedBlockPool(PagedBlockPool):
    """:class:`~vllm.v1.kv_vmm.scheduler.PagedBlockPool` that shares its
    devices fairly with the other engines of their ledgers while the share
    policy (:meth:`set_share_options`, then the ledger) is ``fair``."""

    def __init__(self, *args, **kwargs) -> None:
        # The base class reads the ledgers (the _share_* hooks) on its way.
        self._init_fair_share()
        super().__init__(*args, **kwargs)

    def _init_fair_share(self) -> None:
        # The fair share of the devices, once set_share_options started it
        # (with a device ledger, whatever the policy: the demand is
        # published either way).
        self._fair: DeviceFairShare | None = None
        # The last decision: the effective limit (None: the page limit),
        # pages still to give back, whether preempting for them is allowed.
        self._share_limit: int | None = None
        self._share_reclaim = 0
        self._share_preempt = False
        # What the requests need beyond the blocks in use (in blocks: the
        # running ones' still to come, the waiting ones that could start),
        # and since when that has been more than the free blocks (the host's
        # monotonic clock).
        self._waiting_blocks = 0
        self._waiting_since: float | None = None
        # When note_waiting last looked at the requests.
        self._waiting_noted_at = float("-inf")
        # Pages the running requests free by finishing within the preemption
        # delay (None: not known), from the steps' time: the mean time
        # between consecutive steps (a gap of STEP_GAP_S or more is idle)
        # since the requests were last looked at.
        self._freeing_pages: int | None = None
        self._step_s: float | None = None
        self._step_at: float | None = None
        self._step_time = 0.0
        self._steps = 0

    @property
    def _page_limit(self) -> int:
        """Pages the pool may hold now: the page limit, or the effective
        limit of the fair share where that is lower."""
        limit = self.policy.max_pages
        if self._share_limit is not None:
            limit = min(limit, self._share_limit)
        return limit

    def set_share_options(self, options: KVShareOptions) -> None:
        """The scheduler's call at startup: with a device ledger, publish
        this engine's demand from now on, and share the devices fairly while
        the policy is ``fair`` (first come, first served before and
        otherwise)."""
        share = self._share
        if not isinstance(share, DeviceShare):
            return
        reclaim = ReclaimOptions(
            bytes_per_s=options.kv_cache_vmm_reclaim_bytes_per_s,
            preempt_delay_s=options.kv_cache_vmm_reclaim_preempt_delay,
        )
        policy = options.kv_cache_vmm_share_policy
        self._fair = DeviceFairShare(
            share, options.kv_cache_vmm_share_weight, reclaim, policy
        )
        logger.info(
            "KV memory of %s is shared %s (weight %g, reclaim up to %d bytes "
            "per second, preemption after %.1f s of pressure; the ledger CLI "
            "may change the policy and the weight)",
            ", ".join(share.devices),
            "fairly" if policy == "fair" else "first come, first served",
            options.kv_cache_vmm_share_weight,
            reclaim.bytes_per_s,
            reclaim.preempt_delay_s,
        )

    @property
    def _blocks_in_use(self) -> int:
        """Blocks that requests hold (the null block not counted)."""
        return self._num_mapped_blocks - 1 - self.free_block_queue.num_free_blocks

    def _share_surplus(self) -> list[int]:
        """Free pages the fair share can take back: beyond a step's worth of
        free blocks, or, below that, beyond what the effective limit leaves
        beside the blocks in use (an engine capped at a share smaller than
        a step's worth keeps no more), and beyond the floor."""
        keep = self._ahead_target()
        if self._share_limit is not None:
            bpp = self.policy.blocks_per_page
            free = self.free_block_queue.num_free_blocks
            in_use = self._num_mapped_blocks - free  # the null block's included
            keep = min(keep, max(self._share_limit * bpp - in_use, 0))
        return self._surplus_pages(keep)

    def _share_ledger_read(self, now: float) -> None:
        """Step the controllers on the ledgers just read."""
        if self._fair is None:
            return
        decision = self._fair.decide(
            now, len(self._share_surplus()), self._freeing_pages
        )
        if decision is None:
            self._share_limit, self._share_reclaim = None, 0
            self._share_preempt = False
            return
        limit = decision.effective_limit_pages
        self._share_limit = limit if limit < self.policy.max_pages else None
        self._share_reclaim = decision.reclaim_pages
        self._share_preempt = decision.preempt_allowed

    def _share_give_back(self) -> None:
        """Unmap free pages the decision asked for (highest first, beyond a
        step's worth of free blocks and the floor, cached prefix blocks on
        them evicted)."""
        if self._share_reclaim <= 0:
            return
        pages = self._share_surplus()[: self._share_reclaim]
        if pages:
            self._unmap(pages)
            self._share_reclaim -= len(pages)
            self.num_share_reclaimed_pages_total += len(pages)

    def _share_publish(self) -> None:
        if self._fair is None:
            return
        bpp = self.policy.blocks_per_page
        used = self._blocks_in_use
        self._fair.publish(
            self.clock(),
            -(-max(used, 0) // bpp),
            -(-self._waiting_blocks // bpp),
            self._waiting_since,
        )

    def note_waiting(
        self,
        requests: Iterable[Any],
        max_requests: int,
        block_size: int,
        num_groups: int = 1,
        running: Iterable[Any] = (),
    ) -> None:
        """The scheduler's call after it admitted what it could: what this
        engine wants beside the blocks in use is the blocks its requests
        need to run unhindered (their tokens in blocks of ``block_size`` in
        each of the ``num_groups`` KV cache groups): the ``running`` ones'
        beyond the blocks in use (a prompt prefilled in chunks holds the
        blocks of its first chunks only) and the first ``max_requests``
        waiting ``requests`` (the running ones' free slots). It waits for
        memory while that is more than its free blocks. A cheap estimate:
        prefix cache hits are not looked up.

        All of it counts, not only what the free blocks lack: an engine
        whose requests just finished holds free blocks that its next
        requests will fill, and a want of what is in use alone would
        shrink its share at every turnover of its requests.

        The requests are looked at once per :data:`LEDGER_READ_INTERVAL_S`
        at most (the want is published no more often), not at every step:
        the running ones are a pass over every running request. The same
        look counts the pages of those that finish within the preemption
        delay, for the fair share's decision to preempt.
        """
        if self._fair is None:
            return
        now = self.clock()
        self._note_step(now)
        if 0 <= now - self._waiting_noted_at < LEDGER_READ_INTERVAL_S:
            return
        self._waiting_noted_at = now
        self._take_step_time()
        in_blocks, self._freeing_pages = self._running_blocks(
            running, block_size, num_groups, self._fair.reclaim.preempt_delay_s
        )
        to_come = max(in_blocks - self._blocks_in_use, 0)
        need = to_come + sum(
            _blocks_of(r, block_size, num_groups)
            for r in itertools.islice(requests, max(max_requests, 0))
        )
        free = self.free_block_queue.num_free_blocks + self._inflight_blocks()
        self._waiting_blocks = need
        if need <= free:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = now

    def _note_step(self, now: float) -> None:
        """A scheduler step began (its call of note_waiting)."""
        if self._step_at is not None and 0 <= now - self._step_at < STEP_GAP_S:
            self._step_time += now - self._step_at
            self._steps += 1
        self._step_at = now

    def _take_step_time(self) -> None:
        """The steps' mean time since the last look becomes the step time
        (kept as it was where no step was timed since)."""
        if self._steps:
            self._step_s = self._step_time / self._steps
            self._step_time, self._steps = 0.0, 0

    def _running_blocks(
        self, running: Iterable[Any], block_size: int, num_groups: int, delay_s: float
    ) -> tuple[int, int | None]:
        """One pass over the ``running`` requests: the blocks their tokens
        take, and the pages of those that finish within ``delay_s`` (the
        preemption delay): whose tokens still to come (up to ``max_tokens``;
        a request may stop sooner) take no longer at the step time, one
        token a step. Their blocks are counted as if they freed whole pages
        (on the side of waiting). None for those pages while no step time is
        known, or if a request does not say its ``max_tokens``."""
        horizon = None if self._step_s is None else delay_s / max(self._step_s, 1e-6)
        total, finishing = 0, 0
        for r in running:
            n = _blocks_of(r, block_size, num_groups)
            total += n
            if horizon is None:
                continue
            max_tokens = getattr(r, "max_tokens", None)
            if max_tokens is None:
                horizon = None
            elif max_tokens - r.num_output_tokens <= horizon:
                finishing += n
        if horizon is None:
            return total, None
        return total, finishing // self.policy.blocks_per_page

    def admission_reserve_blocks(self) -> int:
        """Free blocks a waiting or preempted request may not take: those of
        the pages held beyond the effective limit (running requests keep
        decoding into them)."""
        if self._share_limit is None:
            return 0
        excess = self._num_held - self._share_limit
        if excess <= 0:
            return 0
        bpp = self.policy.blocks_per_page
        return min(self.free_block_queue.num_free_blocks, excess * bpp)

    def share_preempt_pages(self) -> int:
        """Pages still to give back that free pages do not cover, once the
        fair share allows preempting for them (0 otherwise): the scheduler
        preempts its newest running request while this is positive and
        more than one request runs."""
        if not self._share_preempt or self._share_reclaim <= 0:
            return 0
        return self._share_reclaim - len(self._share_surplus())

    def _share_step_due_in(self, due: float | None) -> float | None:
        if self._fair is None or self._fair.policy != "fair" or not self.idle:
            return due
        if self._pages_beyond_floor() <= 0:
            return due
        # An idle engine above its floor gives pages back to a waiting
        # engine below its share at its next ledger read, without waiting
        # for the shrink delay.
        self._read_ledger()
        if self._share_reclaim > 0 and self._share_surplus():
            return 0.0
        return min(
            due if due is not None else float("inf"), LEDGER_FULL_READ_INTERVAL_S
        )
