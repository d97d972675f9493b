"""The patched tree runs a real vLLM engine on CPU (dummy weights), deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest

# Slow (CI time): every other engine case runs the build tree's engine (the VMM flags exist
# only there) and compares greedy token ids with a reference run of it; `make setup` smokes it.
pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_patched_tree_serves_greedy_and_reproducibly(tiny_llama: Path):
    import vllm
    from vllm import LLM, SamplingParams

    # The engine must be the build tree's, not a wheel's copy of vLLM.
    assert Path(vllm.__file__).resolve().parent.parent.joinpath(".git").exists()
    llm = LLM(model=str(tiny_llama), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=512, max_num_seqs=4, seed=0, kv_cache_memory_bytes=128 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=6, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(5 + i, 37 + i))} for i in range(4)]
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[::-1], params)][::-1]
    assert all(len(ids) == 6 for ids in first)
    assert first == second  # batch order does not change greedy output
    assert len({tuple(ids) for ids in first}) > 1  # different prompts, different continuations
