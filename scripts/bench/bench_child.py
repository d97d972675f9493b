# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark suite, child side: one measurement in its own process (scripts/bench/bench.py).

  python scripts/bench/bench_child.py SPEC.json OUT.json

Runs the measurement SPEC.json names (``kind``: throughput, elasticity or probe) in a fresh
process, so every engine starts from a clean device and interpreter, and writes its result to
OUT.json. The driver (bench_items.Runner) starts one such process per A/B repetition.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from bench_proc import fault

#: Key of a workload's second run in the same engine (see child_throughput).
REPEAT_SUFFIX = ", 2nd run"

#: vLLM's default --kv-cache-vmm-shrink-delay, which item 1's engines keep.
DEFAULT_SHRINK_DELAY_S = 10.0


def _worker_page_stats(worker) -> dict:
    """Runs in each worker: the rank's page mapper figures ({} when the option is off)."""
    mapper = getattr(worker.model_runner, "kv_page_mapper", None)
    if mapper is None:
        return {}
    return {**mapper.stats(), "page_bytes": mapper.page_bytes,
            "blocks_per_page": mapper.policy.blocks_per_page,
            "headroom_pages": mapper.policy.headroom_pages,
            "max_pages": mapper.policy.max_pages,
            "block_size": worker.vllm_config.cache_config.block_size}


def _prompts(num: int, length: int, salt: int) -> list[dict]:
    """Distinct token-id prompts (no shared prefix between them, so no prefix-cache hits)."""
    return [{"prompt_token_ids": [(salt * 7919 + i * 104729 + j * 13) % 3000 + 100
                                  for j in range(length)]} for i in range(num)]


def _make_llm(spec: dict):
    from vllm import LLM

    engine = spec["engine"] | (spec.get("vmm_args", {}) if spec["backend"] == "vmm" else {})
    return LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, seed=0,
               kv_cache_memory_backend=spec["backend"], **engine)


def _shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _idle_ttft(llm, spec: dict) -> dict:
    """Time to first token of one request once the engine has been idle for the shrink delay.

    Both sides wait the same time (the delay and 3 s more); the VMM side also waits until the
    idle shrink has given its pages back (mapped KV back to the null block's page and the
    headroom), so the request finds only those mapped and maps what it needs on its critical
    path. Stock waits alike, so GPU clocks that drop when idle weigh on both sides."""
    from vllm import SamplingParams

    delay = spec.get("vmm_args", {}).get("kv_cache_vmm_shrink_delay", DEFAULT_SHRINK_DELAY_S)
    time.sleep(delay + 3.0)
    stats = llm.collective_rpc(_worker_page_stats)[0]
    if stats:
        idle_bytes = (1 + stats["headroom_pages"]) * stats["page_bytes"]
        deadline = time.perf_counter() + 30
        while stats["kv_mapped_bytes"] > idle_bytes and time.perf_counter() < deadline:
            time.sleep(0.2)
            stats = llm.collective_rpc(_worker_page_stats)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    prompt = _prompts(1, spec["idle_ttft_input"], salt=777)
    t0 = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    return {"ttft_s": time.perf_counter() - t0,
            "mapped_bytes_idle": stats["kv_mapped_bytes"] if stats else None}


def child_throughput(spec: dict) -> dict:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm = _make_llm(spec)
    result: dict = {"startup_s": time.perf_counter() - start, "workloads": {}}
    try:
        if spec["workloads"]:
            # Warm-up: first-use costs (allocator, kernels' autotuning) stay out of the timing.
            warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                  detokenize=False)
            llm.generate(_prompts(8, 256, salt=999), warm, use_tqdm=False)
        for i, (name, w) in enumerate(spec["workloads"].items()):
            params = SamplingParams(temperature=0.0, max_tokens=w["output"],
                                    ignore_eos=True, detokenize=False)
            # Each workload runs twice, with different prompts (no prefix-cache hits): the
            # first run of the prefill-heavy one is the first to need most of the KV memory
            # (VMM maps it then); the second finds it mapped (within the shrink delay).
            for run, key in enumerate((name, name + REPEAT_SUFFIX)):
                prompts = _prompts(w["num"], w["input"], salt=i + 50 * run)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                tokens_in = sum(len(o.prompt_token_ids) for o in outs)
                tokens_out = sum(len(o.outputs[0].token_ids) for o in outs)
                result["workloads"][key] = {
                    "seconds": seconds, "input_tokens": tokens_in,
                    "output_tokens": tokens_out,
                    "tokens_per_s": (tokens_in + tokens_out) / seconds}
        if spec["workloads"] and spec.get("idle_ttft_input"):
            result["idle_ttft"] = _idle_ttft(llm, spec)
        if spec["backend"] == "vmm":
            result["page_stats"] = llm.collective_rpc(_worker_page_stats)
    finally:
        _shutdown(llm)
    return result


def child_elasticity(spec: dict) -> dict:
    """Bursts of requests through LLMEngine.step(), sampling rank 0's mapped KV bytes after
    every step; after each burst, waits for the idle shrink and checks the bound."""
    from vllm import SamplingParams

    llm = _make_llm(spec)
    engine = llm.llm_engine
    t0 = time.perf_counter()
    timeline: list[list[float]] = []
    bursts: list[dict] = []
    try:
        info = llm.collective_rpc(_worker_page_stats)[0]
        if not info:
            raise RuntimeError("the engine has no KV page mapper: is the VMM KV patch applied?")
        page, bpp, block = info["page_bytes"], info["blocks_per_page"], info["block_size"]
        headroom = info["headroom_pages"]
        bytes_per_block = page / bpp

        def live_blocks(live: dict[str, int]) -> int:
            return sum(math.ceil(n / block) for n in live.values())

        def sample(live: dict[str, int]) -> dict:
            stats = llm.collective_rpc(_worker_page_stats)[0]
            timeline.append([time.perf_counter() - t0, stats["kv_mapped_bytes"],
                             live_blocks(live) * bytes_per_block])
            return stats

        def idle(seconds: float) -> dict:
            # The shrink is applied by the engine's own loop once it has been idle for the
            # shrink delay; wait for it (mapped bytes stop falling), then keep sampling the
            # idle engine.
            end = time.perf_counter() + seconds
            stats = sample({})
            while time.perf_counter() < end:
                time.sleep(0.1)
                stats = sample({})
            return stats

        idle(1.0)
        for b, (num, length, out) in enumerate(spec["bursts"]):
            params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True,
                                    detokenize=False)
            for i, p in enumerate(_prompts(num, length, salt=100 + b)):
                engine.add_request(f"burst{b}-{i}", p, params)
            live: dict[str, int] = {}
            peak = 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        live.pop(o.request_id, None)
                    else:
                        live[o.request_id] = len(o.prompt_token_ids) + len(
                            o.outputs[0].token_ids)
                peak = max(peak, sample(live)["kv_mapped_bytes"])
            deadline = time.perf_counter() + 20
            stats = sample({})
            while time.perf_counter() < deadline and stats["kv_mapped_bytes"] > page * (
                    1 + headroom):
                time.sleep(0.1)
                stats = sample({})
            stats = idle(1.0)
            # Load has dropped: no live tokens. Allowed: the pages of the live blocks plus
            # the null block (always mapped), plus the headroom.
            bound_pages = math.ceil((live_blocks({}) + 1) / bpp) + headroom
            bursts.append({"requests": num, "input": length, "output": out,
                           "peak_mapped_bytes": peak, "live_tokens_after": 0,
                           "mapped_bytes_after": stats["kv_mapped_bytes"],
                           "bound_bytes": bound_pages * page,
                           "ok": stats["kv_mapped_bytes"] <= bound_pages * page})
        final = llm.collective_rpc(_worker_page_stats)[0]
    finally:
        _shutdown(llm)
    return {"page_bytes": page, "blocks_per_page": bpp, "block_size": block,
            "headroom_pages": headroom, "max_pages": info["max_pages"],
            "startup_mapped_bytes": info["kv_mapped_bytes"], "bursts": bursts,
            "timeline": timeline, "final_stats": final}


def child_probe(spec: dict) -> dict:
    import torch

    out = {"torch": torch.__version__, "vllm": None, "has_vmm_kv": False,
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if out["gpus"]:
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import vllm
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as e:
        # The page-map item needs no vLLM engine; the others report this.
        out["vllm_error"] = f"cannot import vLLM: {e}"
        return out
    out["vllm"] = vllm.__version__
    out["has_vmm_kv"] = hasattr(EngineArgs, "kv_cache_memory_backend")
    return out


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    fault(f"child:{spec['kind']}")
    result = {"throughput": child_throughput, "elasticity": child_elasticity,
              "probe": child_probe}[spec["kind"]](spec)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
