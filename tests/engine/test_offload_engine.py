# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV offloading in a real vLLM engine on the CPU backend (dummy weights).

A prefix-repetition workload whose distinct prefixes exceed both the KV cache
and the CPU offload pool runs once with the OffloadingConnector and once
without it. Greedy token ids must be identical, and the connector's stats
must show stores and loads, the engine must have skipped computing the
loaded tokens (more cached prompt tokens than without offloading), and no
completion report may have been ignored.

Token ids alone are a weak oracle here: with dummy weights the continuation
barely depends on the context (zeroing every page read back from the pool
left all token ids and fp32 top logprobs of this workload unchanged), so
the test also checks that the loaded KV replaced computation.

vLLM refuses to build its CPU offloading copy engine on the CPU platform
(CPUOffloadingSpec.get_worker: "CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"), so the run uses HostCopyOffloadingSpec from
kv_offload_host_spec.py: vLLM's own CPUOffloadingSpec with only the device
copy engine replaced by a host copy (see that module).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
from tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent

BLOCK_TOKENS = 128  # the CPU backend's default KV block size
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2  # layers * (K, V) * kv heads * head dim * bf16
GPU_KV_BLOCKS = 6  # KV cache: two prompts' worth of blocks
CPU_CHUNKS = 8  # offload pool: less than the workload's distinct blocks
PREFIX_TOKENS = 3 * BLOCK_TOKENS
# Six prefixes (18 distinct full blocks), revisited at varying distances so
# some come back from the GPU prefix cache, some from the CPU pool, and some
# are recomputed.
ORDER = "ABCADBEACFBADAEF"


def _prompts() -> list[dict]:
    prompts = []
    for visit, name in enumerate(ORDER):
        p = ord(name) - ord("A")
        prefix = [(p * 131 + i * 7) % 4000 + 1 for i in range(PREFIX_TOKENS)]
        prompts.append({"prompt_token_ids": prefix + [visit + 1, p + 1]})
    return prompts


def _run(model: Path, offload: bool) -> tuple[list[list[int]], int, dict[str, float]]:
    from vllm import LLM, SamplingParams

    kwargs = {}
    if offload:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "HostCopyOffloadingSpec",
                "spec_module_path": "kv_offload_host_spec",
                "cpu_bytes_to_use": CPU_CHUNKS * BLOCK_TOKENS * BYTES_PER_TOKEN,
            },
        }
    llm = LLM(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=2,
        kv_cache_memory_bytes=GPU_KV_BLOCKS * BLOCK_TOKENS * BYTES_PER_TOKEN,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        # One request at a time: each visit finds the state the previous
        # ones left in the KV cache and the offload pool.
        results = [
            llm.generate([prompt], params, use_tqdm=False)[0] for prompt in _prompts()
        ]
        outputs = [list(r.outputs[0].token_ids) for r in results]
        cached_tokens = sum(r.num_cached_tokens or 0 for r in results)
        metrics: dict[str, float] = {}
        for metric in llm.get_metrics():
            value = getattr(metric, "value", None)
            if metric.name.startswith("vllm:kv_offload") and value is not None:
                metrics[metric.name] = metrics.get(metric.name, 0) + value
        # A labelled counter has no sample until its first increment, so
        # get_metrics() omits one that stayed at 0. Its family is registered
        # when the stat logger starts: a registered counter reads 0 here, a
        # missing one stays absent and fails the test.
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name.startswith("vllm:kv_offload"):
                metrics.setdefault(family.name, 0)
        return outputs, cached_tokens, metrics
    finally:
        del llm
        gc.collect()


def test_offloading_keeps_greedy_output_and_moves_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # The engine core and worker processes import the spec module by name.
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = make_tiny_model(tmp_path / "tiny-llama")

    baseline, baseline_cached, _ = _run(model, offload=False)
    offloaded, offloaded_cached, metrics = _run(model, offload=True)

    print("cached prompt tokens:", baseline_cached, offloaded_cached)
    print("offload metrics:", metrics)
    assert all(len(ids) == 6 for ids in baseline)
    # Continuations depend on the prompt, so they depend on the KV read back.
    assert len({tuple(ids) for ids in baseline}) > 1
    assert offloaded == baseline
    assert metrics.get("vllm:kv_offload_store_bytes", 0) > 0, metrics
    assert metrics.get("vllm:kv_offload_load_bytes", 0) > 0, metrics
    assert "vllm:kv_offload_ignored_completions" in metrics, metrics
    assert metrics["vllm:kv_offload_ignored_completions"] == 0, metrics
    # Loaded KV replaced prefill work the run without offloading had to do.
    assert offloaded_cached > baseline_cached
