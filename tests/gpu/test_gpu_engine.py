"""The patched vLLM serves on a CUDA GPU: tiny dummy-weight Llama, greedy, reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_patched_engine_on_gpu_is_deterministic(tiny_llama: Path):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=512, max_num_seqs=8, seed=0, gpu_memory_utilization=0.3,
              enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(5 + i, 69 + i))} for i in range(6)]
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[::-1], params)][::-1]
    assert all(len(ids) == 8 for ids in first)
    assert first == second
