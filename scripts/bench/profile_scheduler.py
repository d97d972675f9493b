#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the scheduler's time goes with each KV memory backend, on a CPU engine.

An in-process engine (tiny dummy-weight Llama, eager, one process) runs the same batch of
requests a few times, idle for longer than the shrink delay in between (so a VMM engine maps
its pages again every round), and the last round runs under cProfile. Printed: the seconds of
each round, and the profile's rows for the scheduler and the KV memory code, by cumulative
time. The host is not a GPU host: driver calls cost what Linux mmap costs, but what the
scheduler does per step (block allocation, page accounting, device ledger reads) is the
same Python.

  VLLM_TARGET_DEVICE=cpu python scripts/bench/profile_scheduler.py --mode shared
  ... --mode stock | vmm | shared   (shared: --kv-cache-vmm-shared, one engine on the ledger)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

# tiny_model: the harness's shared helper, in scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_model import make_tiny_model  # noqa: E402

KV_BYTES = 96 << 20
SHRINK_DELAY_S = 1.0
PROFILED = r"kv_vmm|block_pool|kv_cache_manager|sched/scheduler\.py"


def engine_args(mode: str, model: Path) -> dict:
    args = {"model": str(model), "load_format": "dummy", "skip_tokenizer_init": True,
            "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 64,
            "enable_prefix_caching": False, "distributed_executor_backend": "uni",
            "kv_cache_memory_bytes": KV_BYTES}
    if mode in ("vmm", "shared"):
        args |= {"kv_cache_memory_backend": "vmm",
                 "kv_cache_vmm_shrink_delay": SHRINK_DELAY_S}
    if mode == "shared":
        args |= {"kv_cache_vmm_shared": True, "kv_cache_vmm_shared_bytes": KV_BYTES}
    return args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--mode", choices=["stock", "vmm", "shared"], required=True)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rows", type=int, default=25, help="profile rows to print")
    args = p.parse_args()
    # One process: the scheduler runs in this interpreter, under the profiler.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(**engine_args(args.mode, make_tiny_model(Path(tmp) / "tiny-llama")))
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
        prompts = [{"prompt_token_ids": [(7 * i + j) % 900 + 5 for j in range(args.prompt_len)]}
                   for i in range(args.requests)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        seconds = []
        profile = cProfile.Profile()
        for round_ in range(args.rounds):
            time.sleep(SHRINK_DELAY_S + 1.5)
            last = round_ == args.rounds - 1
            start = time.perf_counter()
            if last:
                profile.enable()
            llm.generate(prompts, params, use_tqdm=False)
            if last:
                profile.disable()
            seconds.append(time.perf_counter() - start)
        print(f"{args.mode}: rounds of {args.requests} x {args.prompt_len} in / "
              f"{args.output_len} out: {', '.join(f'{s:.3f}' for s in seconds)} s; "
              f"the last one profiled:")
        stats = pstats.Stats(profile)
        stats.sort_stats("cumulative").print_stats(PROFILED, args.rows)


if __name__ == "__main__":
    main()
