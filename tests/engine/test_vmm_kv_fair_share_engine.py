"""Two engines over-subscribing one device's KV memory share it fairly (CPU, host VMM backend).

Two real vLLM 0.32.0 engines join the host's KV memory ledger, whose capacity (set with the
ledger CLI) is 10 pages while each engine keeps asking for more than that: 4 requests of 700
prompt tokens running (max_num_seqs) and 4 more waiting, a new one as soon as one finishes
(each engine driven by a thread of its own); each engine's floor is one page. With the fair
share (--kv-cache-vmm-share-policy fair, the default), at equal weights each engine's share is
half of the capacity. After `ledger_cli set ENGINE --weight 3` engine a's weighted part is 3/4
(7.5 pages), about what its requests want (4 running of about 6 pages, and the next one
waiting for a slot): max-min gives it what it wants, up to 7.5 pages, and engine b the rest.

Bound (asserted): from 4 s after the shares were set (both engines busy, or the weight
changed) to the end of that phase (10 s), each engine's share (fair_shares of the ledger, in
whole pages, median of the samples taken after each of its steps) is 5 pages at 1:1, and at
3:1 at least 6 pages for engine a and at most 4 for engine b (the weight moved them); the
median of each engine's mapped pages is within 2 pages of its share (the controller's dead
band is 5% of the share and at least a page, plus the page in flight of a step's grow or
give-back).
No engine starves: from 4 s into each phase, each produces tokens in every 3 s. Every request completes,
and its token ids equal those of an engine that does not share (greedy decoding; requests
preempted for pages are recomputed).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import pytest
from test_vmm_kv_shared_engine import _entries, _llm, _page_bytes, _shutdown
from test_vmm_kv_shared_engine import ledger_dir  # noqa: F401 (the fixture)

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 700
MAX_TOKENS = 24
OUTSTANDING = 8  # per engine: 4 running (max_num_seqs), 4 waiting
CAPACITY_PAGES = 10
PHASE_S = 10.0
SETTLE_S = 4.0
BOUND_PAGES = 2
STARVE_S = 3.0
OPTIONS = dict(kv_cache_vmm_shared=True, kv_cache_vmm_shrink_delay=0.5,
               kv_cache_vmm_reclaim_preempt_delay=0.5, max_num_seqs=4,
               max_num_batched_tokens=1024)


def _prompt(engine: int, n: int) -> list[int]:
    return [(31 * engine + 7 * n + 3 * j) % 4000 + 1 for j in range(PROMPT_TOKENS)]


def _reference(model: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    from vllm import SamplingParams

    llm = _llm(model, backend="default", max_num_seqs=4, max_num_batched_tokens=1024)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False,
                                ignore_eos=True)
        ids = list(prompts)
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in ids], params)
        return {i: list(o.outputs[0].token_ids) for i, o in zip(ids, outs)}
    finally:
        _shutdown(llm)


class Driver:
    """Keeps OUTSTANDING requests in each engine and steps them in turn."""

    def __init__(self, llms: dict[str, object], engine_ids: dict[str, str],
                 ledger_dir: Path, page: int) -> None:
        from vllm import SamplingParams

        self.engines = {name: llm.llm_engine for name, llm in llms.items()}
        self.engine_ids = engine_ids
        self.ledger_dir, self.page = ledger_dir, page
        self.params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                     detokenize=False, ignore_eos=True)
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.open: dict[str, set[str]] = {name: set() for name in llms}
        self.finished: set[str] = set()
        self.produced: dict[str, list[float]] = {name: [] for name in llms}
        self.samples: dict[str, list[tuple[float, int, int]]] = {name: [] for name in llms}
        self.adding = True

    def _add(self, name: str) -> None:
        index = len([r for r in self.prompts if r.startswith(name)])
        request_id = f"{name}-{index}"
        self.prompts[request_id] = _prompt(ord(name), index)
        self.open[name].add(request_id)
        self.engines[name].add_request(
            request_id, {"prompt_token_ids": self.prompts[request_id]}, self.params)

    def _step_engine(self, name: str) -> None:
        """Top up ``name``'s requests, take one step's outputs and sample its ledger entry."""
        from vllm.v1.kv_vmm.ledger import KVMemoryLedger

        engine = self.engines[name]
        while self.adding and len(self.open[name]) < OUTSTANDING:
            self._add(name)
        if not self.open[name]:
            return
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                self.produced[name].append(now)
            if out.finished:
                self.tokens[out.request_id] = list(out.outputs[0].token_ids)
                self.finished.add(out.request_id)
                self.open[name].discard(out.request_id)
        state = KVMemoryLedger("host", str(self.ledger_dir)).read()
        entry = next(e for e in state.entries if e.id == self.engine_ids[name])
        share = state.shares()[entry.id]
        self.samples[name].append((now, entry.mapped_bytes // self.page, share // self.page))

    def step(self) -> None:
        for name in self.engines:
            self._step_engine(name)

    def run(self, seconds: float) -> tuple[float, float]:
        """Each engine driven by a thread of its own for ``seconds``: an engine's step
        returns one batch of its outputs, so a driver that stepped the engines in turn
        would read a faster engine's outputs late and let its queue run dry."""
        start = time.monotonic()
        errors: list[BaseException] = []

        def drive(name: str) -> None:
            try:
                while time.monotonic() - start < seconds and not errors:
                    self._step_engine(name)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(name,)) for name in self.engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return start, time.monotonic()

    def check_phase(self, start: float, end: float,
                    shares: dict[str, tuple[int, int]]) -> None:
        for name, (low, high) in shares.items():
            window = [(mapped, share) for t, mapped, share in self.samples[name]
                      if start + SETTLE_S <= t <= end]
            assert window, f"{name}: no step between {SETTLE_S} s and the end of the phase"
            share = statistics.median(s for _, s in window)
            assert low <= share <= high, (name, share, window[-5:])
            median = statistics.median(m for m, _ in window)
            assert abs(median - share) <= BOUND_PAGES, (
                f"{name} mapped a median {median} pages, its share is {share}: "
                f"{[m for m, _ in window]}")
            settled = start + SETTLE_S
            times = [t for t in self.produced[name] if settled <= t <= end]
            gaps = [b - a for a, b in zip([settled, *times], [*times, end])]
            print(f"{name}: share {share} pages, median mapped {median}, "
                  f"longest wait for a token {max(gaps):.1f} s")
            assert max(gaps) <= STARVE_S, f"{name} produced no token for {max(gaps):.1f} s"


def test_two_over_subscribed_engines_share_by_weight(tmp_path, ledger_dir):
    from tiny_model import make_tiny_model

    from vllm.v1.kv_vmm.ledger_cli import main as ledger_cli

    # 4 KiB of KV per token and layer: a page holds 512 tokens (4 blocks of 128).
    model = make_tiny_model(tmp_path / "tiny-llama", num_attention_heads=8,
                            num_key_value_heads=8, head_dim=128)
    started = time.monotonic()
    llms: dict[str, object] = {}
    try:
        llms["a"] = _llm(model, **OPTIONS)
        (page,) = set(llms["a"].collective_rpc(_page_bytes))
        run = ["--key", "host"]
        assert ledger_cli(["capacity", str(CAPACITY_PAGES * page), *run], str(ledger_dir)) == 0
        llms["b"] = _llm(model, half=1, **OPTIONS)
        # Entries in the order the engines joined (their names are their pids). A floor of
        # one page each (the null block's), so that shares follow the weights.
        entries = list(_entries(ledger_dir).values())
        engine_ids = {"a": entries[0]["id"], "b": entries[1]["id"]}
        for entry_id in engine_ids.values():
            args = ["set", entry_id, "--floor-bytes", str(page), *run]
            assert ledger_cli(args, str(ledger_dir)) == 0
        driver = Driver(llms, engine_ids, ledger_dir, page)

        half = CAPACITY_PAGES // 2
        start, end = driver.run(PHASE_S)
        driver.check_phase(start, end, {"a": (half, half), "b": (half, half)})

        args = ["set", engine_ids["a"], "--weight", "3", *run]
        assert ledger_cli(args, str(ledger_dir)) == 0
        start, end = driver.run(PHASE_S)
        driver.check_phase(start, end, {"a": (6, CAPACITY_PAGES - 1), "b": (1, 4)})

        driver.adding = False
        deadline = time.monotonic() + 120
        while any(driver.open.values()):
            assert time.monotonic() < deadline, driver.open
            driver.step()
    finally:
        for llm in llms.values():
            _shutdown(llm)
    assert set(driver.tokens) == set(driver.prompts)
    assert driver.tokens == _reference(model, driver.prompts)
    print(f"requests {len(driver.prompts)}, wall {time.monotonic() - started:.0f} s")
