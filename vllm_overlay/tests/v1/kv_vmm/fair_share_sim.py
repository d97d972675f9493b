# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A discrete-time model of engines sharing a device through its ledger,
for the fair-share policy's tests.

Each engine is a queue and a batch, reduced to what the policy sees: a
request needs a fixed number of whole pages while it runs (the real pool
packs blocks of several requests into a page, and requests grow as they
decode) and decodes one token per step. Engines act one after the other in
an order drawn anew every step, each on the ledger as the previous ones left
it, so who asks first gets the free memory, as with the real ledger. The
rules follow :class:`PagedBlockPool` and vLLM's scheduler: free pages are
reused for waiting requests first, new pages are mapped only within the
ledger's room, a waiting request is admitted only within the effective
limit, preemption takes the newest running request first and puts it back
at the head of the queue with its progress lost (vLLM recomputes it), and an
engine with nothing waiting keeps one free page mapped.
"""

import math
import random
from collections import deque
from dataclasses import dataclass, field

from vllm.v1.kv_vmm.fair_share import (
    EngineDemand,
    FairShareController,
    ReclaimOptions,
    ShareDecision,
)

MiB = 1 << 20


@dataclass
class SimRequest:
    pages: int
    work: int
    """Steps it decodes once admitted."""
    left: int = 0


@dataclass
class SimEngine:
    id: str
    page_bytes: int
    arrivals_per_s: float
    request_bytes: tuple[int, int]
    """Smallest and largest KV size of a request (its pages: rounded up)."""
    request_steps: tuple[int, int]
    weight: float = 1.0
    floor_pages: int = 1
    start_s: float = 0.0
    """Requests arrive from then on."""
    fair: bool = True
    """False: first come, first served (no controller)."""
    shrink_delay_s: float = 2.0
    """With nothing waiting, free pages beyond one are given back once the
    engine has had them for this long."""
    mapped: int = 1
    used: int = 0
    queue: deque[SimRequest] = field(default_factory=deque)
    queued_pages: int = 0
    running: list[SimRequest] = field(default_factory=list)
    waiting_since: float | None = None
    served: list[int] = field(default_factory=list)
    """Tokens decoded per step."""
    finished: list[int] = field(default_factory=list)
    """Requests finished per step."""
    mapped_bytes: list[int] = field(default_factory=list)
    """Mapped bytes after each step."""
    reclaimed: list[int] = field(default_factory=list)
    """Pages given back to the fair share per step."""
    preempted: int = 0
    surplus_since: float | None = None
    controller: FairShareController | None = None

    def demand(self) -> EngineDemand:
        pb = self.page_bytes
        return EngineDemand(
            id=self.id,
            mapped_bytes=self.mapped * pb,
            floor_bytes=self.floor_pages * pb,
            used_bytes=self.used * pb,
            waiting_bytes=self.queued_pages * pb,
            waiting_since=self.waiting_since,
            weight=self.weight,
            page_bytes=pb,
        )


class Simulation:
    """Engines on one device of ``capacity_bytes``; ``step_s`` per step."""

    def __init__(
        self,
        capacity_bytes: int,
        engines: list[SimEngine],
        seed: int,
        step_s: float = 0.05,
        options: ReclaimOptions | None = None,
        knows_steps_left: bool = True,
    ) -> None:
        self.capacity = capacity_bytes
        # Whether engines tell their controllers the pages their running
        # requests free within the preemption delay (each one's steps left
        # are known, as a pool knows its requests' tokens to come).
        self.knows_steps_left = knows_steps_left
        self.engines = engines
        self.rng = random.Random(seed)
        self.step_s = step_s
        self.now = 0.0
        self.steps = 0
        for e in engines:
            if e.fair:
                e.controller = FairShareController(e.id, e.page_bytes, options)

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / self.step_s)):
            self.step()

    def step(self) -> None:
        self.now = self.steps * self.step_s
        order = list(self.engines)
        self.rng.shuffle(order)
        for engine in order:
            self._arrive(engine)
            self._decode(engine)
            decision = self._decide(engine)
            self._reclaim(engine, decision)
            self._admit(engine, decision.effective_limit_pages)
            if engine.queue and engine.waiting_since is None:
                engine.waiting_since = self.now
            elif not engine.queue:
                engine.waiting_since = None
            self._trim(engine)
        for engine in self.engines:
            engine.mapped_bytes.append(engine.mapped * engine.page_bytes)
        self.steps += 1

    def room_pages(self, engine: SimEngine) -> int:
        """The ledger's room of ``engine``, in its pages."""
        others = sum(
            max(o.mapped, o.floor_pages) * o.page_bytes
            for o in self.engines
            if o is not engine
        )
        pb = engine.page_bytes
        room = self.capacity - others - engine.mapped * pb
        room = max(room, (engine.floor_pages - engine.mapped) * pb, 0)
        return room // pb

    def _arrive(self, engine: SimEngine) -> None:
        if self.now < engine.start_s:
            return
        for _ in range(self._poisson(engine.arrivals_per_s * self.step_s)):
            nbytes = self.rng.randint(*engine.request_bytes)
            pages = math.ceil(nbytes / engine.page_bytes)
            request = SimRequest(pages, self.rng.randint(*engine.request_steps))
            engine.queue.append(request)
            engine.queued_pages += pages

    def _poisson(self, mean: float) -> int:
        # Knuth's method: fine for the small means of one step.
        limit, n, p = math.exp(-mean), 0, self.rng.random()
        while p > limit:
            n += 1
            p *= self.rng.random()
        return n

    def _decode(self, engine: SimEngine) -> None:
        engine.served.append(len(engine.running))
        for request in engine.running:
            request.left -= 1
        done = [r for r in engine.running if r.left <= 0]
        engine.running = [r for r in engine.running if r.left > 0]
        engine.used -= sum(r.pages for r in done)
        engine.finished.append(len(done))

    def _decide(self, engine: SimEngine) -> ShareDecision:
        if engine.controller is None:
            limit = self.capacity // engine.page_bytes
            return ShareDecision(limit, 0, False, self.capacity)
        delay_steps = engine.controller.options.preempt_delay_s / self.step_s
        freeing = sum(r.pages for r in engine.running if r.left <= delay_steps)
        return engine.controller.step(
            self.now,
            self.capacity,
            [e.demand() for e in self.engines],
            mapped_pages=engine.mapped,
            free_pages=engine.mapped - engine.used,
            freeing_pages=freeing if self.knows_steps_left else None,
        )

    def _trim(self, engine: SimEngine) -> None:
        keep = max(engine.used + 1, engine.floor_pages)
        if engine.queue or engine.mapped <= keep:
            engine.surplus_since = None
        elif engine.surplus_since is None:
            engine.surplus_since = self.now
        elif self.now - engine.surplus_since >= engine.shrink_delay_s:
            engine.mapped = keep
            engine.surplus_since = None

    def _reclaim(self, engine: SimEngine, decision: ShareDecision) -> None:
        pages = decision.reclaim_pages
        engine.reclaimed.append(pages)
        free = min(pages, engine.mapped - engine.used)
        engine.mapped -= free
        short = pages - free
        if not decision.preempt_allowed:
            assert short == 0, "reclaim beyond the free pages without preemption"
            return
        freed = 0
        while freed < short and engine.running:
            request = engine.running.pop()  # the newest first, as vLLM does
            engine.used -= request.pages
            freed += request.pages
            request.left = 0
            engine.queue.appendleft(request)
            engine.queued_pages += request.pages
            engine.preempted += 1
        engine.mapped -= min(short, freed)

    def _admit(self, engine: SimEngine, limit_pages: int) -> None:
        while engine.queue:
            request = engine.queue[0]
            if engine.used + request.pages > limit_pages:
                break
            to_map = max(request.pages - (engine.mapped - engine.used), 0)
            if to_map > self.room_pages(engine):
                break
            engine.mapped += to_map
            engine.used += request.pages
            request.left = request.work
            engine.running.append(engine.queue.popleft())
            engine.queued_pages -= request.pages


def direction_changes(series: list[int]) -> int:
    """How often a series turns from rising to falling or back."""
    changes, last = 0, 0
    for a, b in zip(series, series[1:]):
        sign = (b > a) - (b < a)
        if sign and last and sign != last:
            changes += 1
        last = sign or last
    return changes
