"""VMM-backed KV memory (--kv-cache-memory-backend vmm) in a real vLLM engine on CPU.

The host VMM backend maps real Linux memory (memfd extents behind an mmap reservation) page by
page; the engine, scheduler and worker are vLLM's own, with dummy weights.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

# Workers run in their own process (vLLM's default); the test reads their page tables through
# collective_rpc with a function, which vLLM ships only when this is allowed.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MAX_TOKENS = 8


def _prompts() -> list[list[list[int]]]:
    """Batches: 8 long prompts (several KV pages at once), 5 of mixed length, and a prompt
    that shares a long cached prefix with the first batch."""
    first = [[(7 * i + 3 * j) % 4000 + 1 for j in range(600)] for i in range(8)]
    second = [[(11 * i + 5 * j) % 4000 + 1 for j in range(40 + 150 * i)] for i in range(5)]
    prefixed = [first[0][:512] + [(13 * j) % 4000 + 1 for j in range(70)]]
    return [first, second, prefixed]


def _worker_stats(worker) -> dict:
    mapper = worker.model_runner.kv_page_mapper
    return {} if mapper is None else {**mapper.stats(), "page_bytes": mapper.page_bytes,
                                      "ahead_pages": mapper.policy.ahead_pages,
                                      "idle_pages": 1 + mapper.policy.headroom_pages}


def _run(model: Path, backend: str, page_limit: int | None = None,
         **kwargs) -> tuple[list[list[int]], list[dict]]:
    """Token ids of every batch, and the workers' page stats at startup and after each batch.
    With ``page_limit``, the first batch runs again after the limit is lowered to it."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=8192,
              enable_prefix_caching=True, kv_cache_memory_backend=backend, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
        ids: list[list[int]] = []
        stats = [llm.collective_rpc(_worker_stats)]
        # The startup mapping (a step's worth of pages) goes back once the engine is idle
        # for the shrink delay: every batch below starts from the idle mapping.
        stats.append(_wait_idle_stats(llm))
        for batch in _prompts():
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
            ids += [list(o.outputs[0].token_ids) for o in outs]
            stats.append(_wait_idle_stats(llm))
        if page_limit is not None:
            pages = llm.set_kv_cache_page_limit(page_limit)
            assert pages["kv_pages_mapped"] <= page_limit
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()[0]], params)
            ids += [list(o.outputs[0].token_ids) for o in outs]
            stats.append(llm.collective_rpc(_worker_stats))
            # The limit in bytes: 3 pages' worth plus less than a page, rounded down.
            page_bytes = pages["kv_page_bytes"]
            raised = llm.set_kv_cache_page_limit(
                max_bytes=3 * page_bytes + page_bytes // 2)
            assert raised["kv_limit_bytes"] == 3 * page_bytes
            # 64 pages' worth is beyond the KV cache: the limit is its capacity.
            stats.append([raised, llm.set_kv_cache_page_limit(max_bytes=64 * page_bytes)])
        return ids, stats
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _wait_idle_stats(llm) -> list[dict]:
    """Worker stats once the engine has applied the idle shrink that follows the last step
    (one empty step once the engine has been idle for the shrink delay; it runs in the engine
    process, asynchronously to the caller): back to the null block's page + the headroom.
    Every batch leaves pages to give back: while requests run, the scheduler keeps a step's
    worth mapped ahead."""
    import time

    def shrunk(rank: dict) -> bool:
        return not rank or rank["kv_mapped_bytes"] <= rank["idle_pages"] * rank["page_bytes"]

    deadline = time.monotonic() + 20
    stats = llm.collective_rpc(_worker_stats)
    while time.monotonic() < deadline and not all(map(shrunk, stats)):
        time.sleep(0.2)
        stats = llm.collective_rpc(_worker_stats)
    return stats


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory) -> Path:
    from tiny_model import make_tiny_model

    # 4 KV heads: a 2 MiB page holds 16 blocks of 128 tokens per layer, so the first batch
    # needs several pages and the test sees memory follow the load.
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", num_key_value_heads=4)


def test_vmm_token_ids_match_default_memory_follows_load_and_limit(kv_model):
    ref_ids, ref_stats = _run(kv_model, "default")
    ids, stats = _run(kv_model, "vmm", page_limit=2, kv_cache_vmm_headroom_pages=1,
                      kv_cache_vmm_shrink_delay=0)
    assert all(len(x) == MAX_TOKENS for x in ids)
    # The first batch runs again (same ids) under a 2-page (31-block) limit, where its 8
    # requests (40 blocks) cannot all run at once.
    assert ids == ref_ids + ref_ids[:8]
    assert ref_stats[0] == [{}]  # option off: no page table

    start, idle = stats[0][0], stats[1][0]
    page = start["page_bytes"]
    # Startup maps the null block's page and a step's worth ahead: 8192 tokens in blocks of
    # 128 plus one block per request (8) is 72 blocks, 5 pages of 16.
    assert start["ahead_pages"] == 5
    # (Counted, not read from the mapped bytes: with no shrink delay the idle engine may give
    # them back before the first read.)
    assert start["kv_pages_mapped_total"] == 1 + start["ahead_pages"]
    # Idle, the engine keeps the null block's page + 1 headroom page (31 usable blocks).
    assert idle["kv_mapped_bytes"] == 2 * page
    after_first = stats[2][0]
    # 8 x 608 tokens need 40 blocks of 128 tokens, more than the 31 mapped when idle: pages
    # were mapped ahead of demand behind the first steps (how many requests the first step
    # holds depends on how fast they reach the engine; a step that needs more than what is
    # mapped is test_vmm_burst_beyond_the_mapped_pages_in_one_step), and everything beyond
    # the headroom went back afterwards.
    assert after_first["kv_pages_mapped_ahead_total"] >= 1
    assert after_first["kv_ahead_map_seconds"] > 0
    assert after_first["kv_mapped_bytes_peak"] >= 4 * page
    assert after_first["kv_pages_unmapped_total"] > idle["kv_pages_unmapped_total"]
    # Back to the idle mapping once requests are done.
    for batch_stats in stats[2:5]:
        assert batch_stats[0]["kv_mapped_bytes"] <= idle["kv_mapped_bytes"]
    assert stats[4][0]["kv_map_seconds"] > 0
    # Under the lowered limit, the rerun never mapped more than 2 pages.
    assert stats[5][0]["kv_mapped_bytes"] <= 2 * page
    assert stats[5][0]["kv_pages_mapped_total"] == stats[4][0]["kv_pages_mapped_total"]
    assert stats[6][0]["kv_page_limit"] == 3
    capacity = stats[6][1]["kv_page_capacity"]
    assert capacity < 64 and stats[6][1]["kv_page_limit"] == capacity
    assert stats[6][1]["kv_limit_bytes"] == capacity * stats[6][1]["kv_page_bytes"]


# Slow: the step's map-ahead is a unit test (test_scheduler_pages.py); CI's engine case is
# the token-id one.
@pytest.mark.slow
def test_vmm_burst_beyond_the_mapped_pages_in_one_step(kv_model):
    """A request that needs more KV pages than the idle engine has mapped: it waits one step,
    an empty one before which every rank maps what it lacks (a step's worth) and reports it; it
    runs at the next, the scheduler keeps a step's worth mapped ahead (mapped by the worker
    after the forward pass is launched), and the token ids are those of stock vLLM."""
    from vllm import LLM, SamplingParams

    # One prompt of 3000 tokens: 24 blocks of 128 tokens in one step (8192 tokens per step),
    # while the idle engine keeps only the null block's page (15 usable blocks; no headroom).
    prompt = [{"prompt_token_ids": [(17 * j) % 4000 + 1 for j in range(3000)]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    results = {}
    for backend in ("default", "vmm"):
        vmm_args = {"kv_cache_vmm_headroom_pages": 0, "kv_cache_vmm_shrink_delay": 0}
        llm = LLM(model=str(kv_model), load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=True, max_model_len=4096, max_num_seqs=8, seed=0,
                  kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=8192,
                  kv_cache_memory_backend=backend, **(vmm_args if backend == "vmm" else {}))
        try:
            idle = _wait_idle_stats(llm)[0]
            ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompt, params)]
            results[backend] = ids, idle, _wait_idle_stats(llm)[0]
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    assert results["vmm"][0] == results["default"][0]
    _, idle, after = results["vmm"]
    page = idle["page_bytes"]
    assert idle["idle_pages"] == 1 and idle["kv_mapped_bytes"] == page
    startup = idle["kv_pages_mapped_total"]  # the null block's page + a step's worth ahead
    assert startup == 1 + idle["ahead_pages"]
    # The step before the request's mapped a step's worth (72 blocks) less the 15 mapped: 57
    # blocks, 4 pages...
    needed = after["kv_pages_mapped_total"] - after["kv_pages_mapped_ahead_total"] - startup
    assert needed == 4
    # ... and the request's own step (24 blocks) refilled the pool to a step's worth (2 pages)
    # ahead, behind its forward pass, within the 16-page limit.
    assert after["kv_pages_mapped_ahead_total"] >= 1
    assert after["kv_ahead_map_seconds"] > 0
    assert after["kv_mapped_bytes_peak"] >= (1 + needed + 1) * page
    # Idle again: back to the null block's page.
    assert after["kv_mapped_bytes"] == page


# Slow: CI runs TP=2 CPU engines in test_vmm_kv_map_failures.py.
@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU needs 2 cores")
def test_vmm_tensor_parallel_2(kv_model, monkeypatch):
    """TP=2 (the CPU backend's two workers, one core each) starts and serves with the option
    on: both ranks map their own shard of the same pages, and token ids match option off."""
    from vllm import LLM, SamplingParams

    # The CPU workers bind their OpenMP threads to NUMA nodes; with one node, bind by hand.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[0]]
    results = {}
    for backend in ("default", "vmm"):
        llm = LLM(model=str(kv_model), load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
                  kv_cache_memory_bytes=64 << 20, tensor_parallel_size=2,
                  kv_cache_memory_backend=backend,
                  **({"kv_cache_vmm_shrink_delay": 0} if backend == "vmm" else {}))
        try:
            ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            results[backend] = ids, _wait_idle_stats(llm)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    assert results["vmm"][0] == results["default"][0]
    rank0, rank1 = results["vmm"][1]
    assert rank0["kv_pages_mapped_total"] == rank1["kv_pages_mapped_total"] >= 3
    assert rank0["kv_mapped_bytes_peak"] == rank1["kv_mapped_bytes_peak"] > rank0["kv_mapped_bytes"]


def _kv_page_metrics(llm) -> dict[str, float]:
    """The VMM KV page metrics of engine 0, as vLLM's Prometheus stat logger recorded them."""
    names = {"vllm:kv_cache_vmm_mapped_bytes", "vllm:kv_cache_vmm_mapped_pages",
             "vllm:kv_cache_vmm_page_limit", "vllm:kv_cache_vmm_page_maps",
             "vllm:kv_cache_vmm_page_unmaps"}
    return {m.name: m.value for m in llm.get_metrics()
            if m.name in names and m.labels.get("engine") == "0"}


# Slow: the page counters and metrics are unit tests (test_metrics.py).
@pytest.mark.slow
def test_vmm_metrics_follow_load(kv_model):
    """Mapped KV bytes and the pages mapped/unmapped counters reach vLLM's stat loggers
    (LLM.get_metrics() reads the Prometheus logger): they rise with a batch that needs more
    pages and the mapped bytes fall back within one headroom page once it is done."""
    from vllm import LLM, SamplingParams

    # 1024 tokens per step: a step allocates at most 16 blocks (8 + one per request), one
    # page, so what stays mapped ahead of demand is the headroom page and the counts below
    # are those of the headroom alone.
    llm = LLM(model=str(kv_model), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True,
              max_num_batched_tokens=1024,
              kv_cache_memory_backend="vmm", kv_cache_vmm_headroom_pages=1,
              kv_cache_vmm_shrink_delay=0, disable_log_stats=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
        small = [{"prompt_token_ids": [(5 * j) % 4000 + 1 for j in range(20)]}]
        # The stats of a step are recorded when its outputs arrive: one small request
        # shows the startup mapping.
        llm.generate(small, params)
        idle = _kv_page_metrics(llm)
        page = llm.collective_rpc(_worker_stats)[0]["page_bytes"]
        assert idle["vllm:kv_cache_vmm_mapped_pages"] == 2  # null block's page + headroom
        assert idle["vllm:kv_cache_vmm_mapped_bytes"] == 2 * page
        assert idle["vllm:kv_cache_vmm_page_limit"] >= 4
        assert idle["vllm:kv_cache_vmm_page_maps"] == 2
        assert idle["vllm:kv_cache_vmm_page_unmaps"] == 0

        # 8 x 600 tokens: 40 blocks of 128 tokens, more than the 31 of the startup pages.
        llm.generate([{"prompt_token_ids": p} for p in _prompts()[0]], params)
        loaded = _kv_page_metrics(llm)
        assert loaded["vllm:kv_cache_vmm_mapped_pages"] >= 4
        assert loaded["vllm:kv_cache_vmm_mapped_bytes"] == (
            loaded["vllm:kv_cache_vmm_mapped_pages"] * page)
        assert loaded["vllm:kv_cache_vmm_page_maps"] >= 4

        # The idle shrink ran after the batch; the next request's stats show it.
        _wait_idle_stats(llm)
        llm.generate(small, params)
        after = _kv_page_metrics(llm)
        assert after["vllm:kv_cache_vmm_page_unmaps"] >= 2
        assert after["vllm:kv_cache_vmm_mapped_bytes"] <= idle["vllm:kv_cache_vmm_mapped_bytes"] + page
        # The scheduler's account is the workers' memory (one rank here).
        assert after["vllm:kv_cache_vmm_mapped_bytes"] == (
            llm.collective_rpc(_worker_stats)[0]["kv_mapped_bytes"])
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _kv_memfd(worker) -> tuple[int, int]:
    """The worker's pid and the fd of the memfd behind its KV pages."""
    return os.getpid(), worker.model_runner.kv_page_mapper.table.backend._fd


# Slow: the shrink delay is a unit test (test_scheduler_pages.py); this waits it out.
@pytest.mark.slow
def test_vmm_shrink_delay_keeps_pages_between_bursts_then_wakes_up(kv_model):
    """--kv-cache-vmm-shrink-delay: a burst right after another (within the delay) maps no
    new page, and once the engine has stayed idle for the delay it gives the pages back by
    itself.

    The exact delay arithmetic (due time, restart on a new burst, 0 and "never") is covered
    with an injected clock in tests/v1/kv_vmm/test_scheduler_pages.py and
    test_scheduler_wiring.py. The engine core runs in its own process on the real clock, so
    this test bounds its waits by events instead of by sleeps: it watches the worker's KV
    memory (the memfd's allocated blocks, which an unmap punches out) from outside, without
    sending the engine anything that could make it step, and fails only past a generous
    deadline."""
    import time

    from vllm import LLM, SamplingParams

    # Long enough that submitting the second burst can never race the shrink: the idle
    # clock starts no earlier than the first burst's submission.
    delay = 8.0
    # 1024 tokens per step: a step allocates at most one page of blocks, so the headroom page
    # is all that stays mapped ahead and the startup mapping is the idle one.
    llm = LLM(model=str(kv_model), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True,
              max_num_batched_tokens=1024,
              kv_cache_memory_backend="vmm", kv_cache_vmm_headroom_pages=1,
              kv_cache_vmm_shrink_delay=delay)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
        start = llm.collective_rpc(_worker_stats)[0]
        pid, fd = llm.collective_rpc(_kv_memfd)[0]

        def resident_bytes() -> int:
            return os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512

        # Two bursts of the same shape (8 x 600 tokens: 40 blocks, more than the 31 of the
        # startup pages) with different tokens, so the second reuses no cached block.
        first = _prompts()[0]
        second = [[(11 * i + 5 * j) % 4000 + 1 for j in range(600)] for i in range(8)]
        first_submitted = time.monotonic()
        llm.generate([{"prompt_token_ids": p} for p in first], params)
        after_first = llm.collective_rpc(_worker_stats)[0]
        second_submitted = time.monotonic()
        # The precondition of the reuse check, not a timing assertion on the engine: if the
        # first burst alone took longer than the delay, the pages may rightly have been
        # given back in between and the check below would say nothing.
        assert second_submitted - first_submitted < delay / 2, (
            f"the first burst took {second_submitted - first_submitted:.1f} s; "
            f"the test needs it well within the {delay} s shrink delay")
        llm.generate([{"prompt_token_ids": p} for p in second], params)
        after_second = llm.collective_rpc(_worker_stats)[0]
        assert after_first["kv_pages_mapped_total"] > start["kv_pages_mapped_total"]
        assert after_first["kv_mapped_bytes"] > start["kv_mapped_bytes"]
        # Within the delay: the pages of the first burst served the second one.
        assert after_second["kv_pages_mapped_total"] == after_first["kv_pages_mapped_total"]
        assert after_second["kv_pages_unmapped_total"] == 0
        assert after_second["kv_mapped_bytes"] == after_first["kv_mapped_bytes"]

        # Wait for the shrink by watching memory only: nothing reaches the engine core
        # until the pages are gone, so the step that gave them back is one it woke up for
        # by itself.
        busy = resident_bytes()
        deadline = second_submitted + delay + 120
        while resident_bytes() >= busy and time.monotonic() < deadline:
            time.sleep(0.1)
        shrunk_at = time.monotonic()
        assert resident_bytes() < busy, "the idle engine never gave its KV pages back"
        # The pool went idle after the second burst was submitted, so the shrink cannot
        # have come earlier than the delay after that.
        assert shrunk_at - second_submitted >= delay
        idle = llm.collective_rpc(_worker_stats)[0]
        assert idle["kv_pages_unmapped_total"] > 0
        # Back to the startup mapping: the null block's page and one headroom page.
        assert idle["kv_mapped_bytes"] == start["kv_mapped_bytes"]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_vmm_refuses_sleep_mode_when_the_config_is_made(kv_model, monkeypatch):
    """Sleep mode would keep VMM KV pages (they are not in the pool it frees): the engine
    arguments are refused before anything starts, naming both options."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    # The CPU platform has no sleep mode; pretend it has, as a CUDA host does.
    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
    args = dict(model=str(kv_model), load_format="dummy", skip_tokenizer_init=True,
                enforce_eager=True, max_model_len=1024, enable_sleep_mode=True)
    EngineArgs(**args).create_engine_config()  # the default KV memory may sleep
    with pytest.raises(ValueError, match=r"--kv-cache-memory-backend vmm.*--enable-sleep-mode"):
        EngineArgs(**args, kv_cache_memory_backend="vmm").create_engine_config()
