"""VMM-backed KV memory (--kv-cache-memory-backend vmm) on CUDA: the CUDA VMM backend maps
device memory page by page under vLLM's own engine (tiny dummy-weight Llama, greedy)."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MAX_TOKENS = 8


def _series_has_vmm_kv() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    return hasattr(EngineArgs, "kv_cache_memory_backend")


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _prompts() -> list[dict]:
    batch = [[(7 * i + 3 * j) % 4000 + 1 for j in range(300 + 40 * i)] for i in range(8)]
    prefixed = [batch[0][:256] + [(13 * j) % 4000 + 1 for j in range(50)]]
    return [{"prompt_token_ids": p} for p in batch + prefixed]


def _worker_stats(worker) -> dict:
    mapper = worker.model_runner.kv_page_mapper
    return {} if mapper is None else mapper.stats()


def _generate(model: Path, backend: str, **kwargs) -> tuple[list[list[int]], list[dict]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
              gpu_memory_utilization=0.3, enable_prefix_caching=True,
              kv_cache_memory_backend=backend, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
        ids = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts()[:8], params)]
        ids += [list(o.outputs[0].token_ids) for o in llm.generate(_prompts()[8:], params)]
        return ids, llm.collective_rpc(_worker_stats)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture
def gpu_model(tiny_llama: Path) -> Path:
    if not _series_has_vmm_kv():
        pytest.skip("this vLLM tree does not carry the VMM-backed KV cache patch")
    return tiny_llama


def test_vmm_token_ids_match_default_on_gpu(gpu_model: Path):
    ref, ref_stats = _generate(gpu_model, "default")
    ids, stats = _generate(gpu_model, "vmm")
    assert all(len(x) == MAX_TOKENS for x in ids)
    assert ids == ref
    assert ref_stats == [{}]
    assert stats[0]["kv_pages_mapped_total"] >= 2 and stats[0]["kv_mapped_bytes"] > 0


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_vmm_tensor_parallel_2_on_gpu(gpu_model: Path, executor: str):
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    if executor == "ray" and importlib.util.find_spec("ray") is None:
        pytest.skip("needs ray")
    ref, _ = _generate(gpu_model, "default", tensor_parallel_size=2,
                       distributed_executor_backend=executor)
    ids, stats = _generate(gpu_model, "vmm", tensor_parallel_size=2,
                           distributed_executor_backend=executor)
    assert ids == ref
    assert len(stats) == 2
    assert stats[0]["kv_pages_mapped_total"] == stats[1]["kv_pages_mapped_total"] >= 2
