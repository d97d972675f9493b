"""Engines sharing a GPU's KV memory (--kv-cache-vmm-shared) when the device runs out: another
process fills the GPU while an engine runs, the engine's page maps fail, and it neither dies nor
changes its token ids; once the memory is back, it maps pages again."""

from __future__ import annotations

import gc
import multiprocessing
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MAX_TOKENS = 8


def _prompts() -> list[dict]:
    # ~30,000 tokens (about 1,900 blocks of 16): several pages whatever the attention
    # backend's layout makes of a page (256 blocks for the tiny model with one region per
    # block, 512 with K and V apart), so the burst after the idle shrink must map pages.
    batch = [[(7 * i + 3 * j) % 4000 + 1 for j in range(1800 + 10 * i)] for i in range(16)]
    return [{"prompt_token_ids": p} for p in batch]


def _llm(model: Path, **kwargs):
    from vllm import LLM

    return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
               enforce_eager=True, max_model_len=2048, max_num_seqs=16, seed=0,
               gpu_memory_utilization=0.3, enable_prefix_caching=True, **kwargs)


def _generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params)]


def _generate_one(llm) -> None:
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                 SamplingParams(temperature=0.0, max_tokens=2, detokenize=False))


def _stats(worker) -> dict:
    return worker.model_runner.kv_page_mapper.stats()


def _fill_device(ready, release) -> None:
    """Hold (nearly) all free memory of GPU 0 until told to let go."""
    import torch

    held = []
    chunk = 256 << 20
    while True:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda:0"))
        except torch.OutOfMemoryError:
            if chunk <= 2 << 20:
                break
            chunk //= 2
    torch.cuda.synchronize()
    ready.set()
    release.wait(600)


@pytest.fixture
def gpu_model(tiny_llama: Path) -> Path:
    from vllm.engine.arg_utils import EngineArgs

    if not hasattr(EngineArgs, "kv_cache_vmm_shared"):
        pytest.skip("this vLLM tree does not carry the shared VMM KV cache options")
    return tiny_llama


def test_engine_survives_a_full_device_and_keeps_its_tokens(gpu_model: Path, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", str(tmp_path))
    ref = _llm(gpu_model)
    try:
        reference = _generate(ref)
    finally:
        ref.llm_engine.engine_core.shutdown()
        del ref
        gc.collect()

    # Floor 0: idle, the engine keeps only the null block's page (with a floor it would keep
    # that mapped, and the burst below would find its pages there).
    llm = _llm(gpu_model, kv_cache_memory_backend="vmm", kv_cache_vmm_shared=True,
               kv_cache_vmm_shrink_delay=0, kv_cache_vmm_headroom_pages=0,
               kv_cache_vmm_floor_bytes=0)
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    filler = ctx.Process(target=_fill_device, args=(ready, release))
    try:
        assert _generate(llm) == reference
        # Pages are given back at a step: the last one of the burst above ends with its
        # pages mapped. One short request more (it fits in the null block's page) gives the
        # engine the steps that give them back, so the burst below must map them again.
        _generate_one(llm)
        stats = llm.collective_rpc(_stats)[0]
        assert stats["kv_mapped_bytes"] < stats["kv_mapped_bytes_peak"], stats
        # The engine is idle (the null block's page mapped); the device fills up.
        filler.start()
        assert ready.wait(300)
        release_later = ctx.Process(target=_release_after, args=(release, 5.0))
        release_later.start()
        # Pages this burst needs beyond what is mapped fail until the memory comes back; the
        # requests wait for them (or run in what is mapped) and the engine stays up.
        assert _generate(llm) == reference
        release_later.join(60)
        stats = llm.collective_rpc(_stats)[0]
        assert stats["kv_map_failures_total"] > 0
        assert _generate(llm) == reference  # memory is back: pages map again
    finally:
        release.set()
        filler.join(60)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _release_after(release, seconds: float) -> None:
    import time

    time.sleep(seconds)
    release.set()
