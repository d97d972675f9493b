"""Native KV offloading on a GPU with the series: same greedy tokens, and offloaded KV is
loaded back (more cached prompt tokens than without offloading)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PREFIX = 256  # tokens per distinct prefix; 8 prefixes overflow a 64-block (1024-token) cache


def _generate(model: str, offload: bool, queue) -> None:
    from vllm import LLM, SamplingParams

    kwargs = dict(kv_offloading_size=1.0, kv_offloading_backend="native") if offload else {}
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=1024,
              max_num_seqs=4, seed=0, gpu_memory_utilization=0.3, enforce_eager=True,
              block_size=16, num_gpu_blocks_override=64, enable_prefix_caching=True, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=6, detokenize=False)
    prefixes = [[(p * 997 + t) % 4000 + 10 for t in range(PREFIX)] for p in range(8)]
    tokens, cached = [], 0
    for round_ in range(2):
        prompts = [{"prompt_token_ids": pre + [round_ + 1] * 8} for pre in prefixes]
        for out in llm.generate(prompts, params):
            tokens.append(list(out.outputs[0].token_ids))
            if round_ == 1:
                cached += out.num_cached_tokens or 0
    queue.put((tokens, cached))


def _run(model: Path, offload: bool):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_generate, args=(str(model), offload, queue))
    proc.start()
    import queue as queue_mod
    import time

    deadline = time.monotonic() + 600
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queue_mod.Empty:
            if not proc.is_alive():
                pytest.fail(f"the engine process died (exit code {proc.exitcode}); see its log")
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the engine process gave no result in 600 s")
    proc.join(timeout=120)
    return result


def test_native_offloading_keeps_tokens_and_loads_kv_back(tiny_llama: Path):
    plain_tokens, plain_cached = _run(tiny_llama, offload=False)
    off_tokens, off_cached = _run(tiny_llama, offload=True)
    assert off_tokens == plain_tokens
    assert off_cached > plain_cached, (off_cached, plain_cached)
