#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Several engines on one device, each behind its own OpenAI server, under peaks that come
at different times: time to first token and throughput per way of sharing the KV memory.

Modes (``--mode``), the same model and engine settings otherwise:

  static    stock KV allocation, the device split statically: each engine gets
            ``--gpu-memory-utilization share/N`` (CPU: ``kv_cache_memory_bytes`` total/N)
  shared    VMM KV shared through the device ledger: every engine
            ``--kv-cache-memory-backend vmm --kv-cache-vmm-shared`` with the whole share
            (CPU: the whole KV budget as each engine's virtual size and as the ledger's
            capacity)
  kvcached  the external kvcached library on the same vLLM (``ENABLE_KVCACHED=true``,
            ``KVCACHED_AUTOPATCH=1``, its pool sized to the same share); needs kvcached
            importable, else the run stops with the reason

The engines start one after another (each profiles the device with the earlier ones
loaded), then:

  single    only engine 0 is busy: ``single_num`` requests at once, small enough for the
            static split; output tokens/s, after one untimed round, ``--repeats`` times
            (5 at least)
  peaks     every engine gets a light background load all along, and in turn a peak
            (Poisson arrivals at ``--peak-rate`` for ``--peak-s`` seconds, engine i from
            i * ``--stagger-s``); per repetition, the mean and p99 time to first token over
            all requests, and output tokens/s. Arrivals and prompts come from ``--seed`` and
            the repetition number, so every mode replays the same requests.

TTFT is measured at the client: from sending a streamed completion to its first chunk.

  python scripts/bench/bench_sharing.py --mode shared --model <config dir> --json /tmp/shared.json
  python scripts/bench/bench_sharing.py --mode static --device cpu --model <dir> --json /tmp/s.json

scripts/bench/bench.py (item 7, ``sharing``) runs the three modes and compares them.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_items import spread  # noqa: E402
from bench_server import Server  # noqa: E402

MODES = ("static", "shared", "kvcached")
#: Timed rounds of the one-engine-busy phase, at least.
SINGLE_REPEATS = 5

# Sizes per device. "share": the fraction of the device all engines together may use
# (GPU), or their KV memory in bytes (CPU).
PROFILES: dict[str, dict] = {
    "cuda": {
        "share": 0.9,
        "engine": {"max_model_len": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "enforce_eager": True, "no_enable_prefix_caching": True},
        "prompt_len": 1024, "output_len": 256,
        "single_num": 32, "single_prompt_len": 512,
        "background_rate": 0.5, "peak_rate": 12.0, "peak_s": 8.0, "stagger_s": 20.0,
        "shrink_delay_s": 2.0, "timeout_s": 600,
    },
    "cpu": {
        "share": 96 << 20,
        "engine": {"max_model_len": 1024, "max_num_seqs": 16, "enforce_eager": True,
                   "no_enable_prefix_caching": True, "distributed_executor_backend": "uni"},
        "prompt_len": 256, "output_len": 8,
        "single_num": 2, "single_prompt_len": 128,
        "background_rate": 0.0, "peak_rate": 2.0, "peak_s": 3.0, "stagger_s": 6.0,
        "shrink_delay_s": 1.0, "timeout_s": 600,
    },
}


def mode_settings(mode: str, device: str, prof: dict, engines: int) -> tuple[str | None, dict,
                                                                            dict]:
    """(--kv-cache-memory-backend or None, engine arguments, environment) of one engine."""
    share = prof["share"]
    if mode == "static":
        if device == "cuda":
            return None, {"gpu_memory_utilization": round(share / engines, 4)}, {}
        return None, {"kv_cache_memory_bytes": share // engines}, {}
    if mode == "shared":
        args = {"kv_cache_vmm_shared": True, "kv_cache_vmm_shrink_delay": prof["shrink_delay_s"]}
        if device == "cuda":
            return "vmm", args | {"gpu_memory_utilization": share}, {}
        return "vmm", args | {"kv_cache_memory_bytes": share, "kv_cache_vmm_shared_bytes": share}, {}
    if mode == "kvcached":
        if device != "cuda":
            raise SystemExit("--mode kvcached needs a CUDA device")
        if importlib.util.find_spec("kvcached") is None:
            raise SystemExit("--mode kvcached: the kvcached package is not importable "
                             "(install it into this Python first)")
        env = {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1",
               "KVCACHED_GPU_UTILIZATION": str(share)}
        return None, {"gpu_memory_utilization": share}, env
    raise SystemExit(f"unknown mode {mode!r}")


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def schedule(prof: dict, engines: int, seed: int, rep: int,
             vocab: int) -> list[tuple[float, int, list[int]]]:
    """(send time in seconds, engine, prompt) of one repetition of the peaks, sorted."""
    rng = random.Random(seed * 1000 + rep)
    horizon = (engines - 1) * prof["stagger_s"] + prof["peak_s"]
    plan = []
    for engine in range(engines):
        windows = [(0.0, horizon, prof["background_rate"]),
                   (engine * prof["stagger_s"], engine * prof["stagger_s"] + prof["peak_s"],
                    prof["peak_rate"])]
        for start, end, rate in windows:
            t = start
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                plan.append((t, engine, prompt(rng, prof["prompt_len"], vocab)))
    return sorted(plan, key=lambda x: x[0])


def stream_completion(port: int, model: str, tokens: list[int], max_tokens: int,
                      timeout: float) -> dict:
    """One streamed completion: seconds to the first chunk and in all, tokens generated."""
    body = json.dumps({"model": model, "prompt": tokens, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
        ttft = None
        completion_tokens = None
        data = b""
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"error": f"the server answered {chunk['error']}"}
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
        if ttft is None or completion_tokens is None:
            return {"error": f"the stream ended without a token or without usage: {data[:300]!r}"}
        return {"ttft_s": ttft, "total_s": time.perf_counter() - t0,
                "tokens": completion_tokens}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()


def run_plan(servers: list[Server], model: str, plan: list[tuple[float, int, list[int]]],
             max_tokens: int, timeout: float) -> list[dict]:
    """Send each request at its time (threads: requests overlap), wait for all."""
    results: list[dict] = [{} for _ in plan]
    start = time.perf_counter()

    def one(i: int, engine: int, tokens: list[int]) -> None:
        r = stream_completion(servers[engine].port, model, tokens, max_tokens, timeout)
        r["engine"] = engine
        r["sent_s"] = time.perf_counter() - start
        r["done_s"] = r["sent_s"] + r.get("total_s", 0.0)
        results[i] = r

    with ThreadPoolExecutor(max_workers=max(1, len(plan))) as pool:
        for i, (at, engine, tokens) in enumerate(plan):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i, engine, tokens)
    return results


def summarize_run(results: list[dict]) -> dict:
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"{len(errors)} of {len(results)} requests failed, first: {errors[0]}")
    ttfts = sorted(r["ttft_s"] * 1000 for r in results)
    p99 = ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)]
    first_sent = min(r["sent_s"] for r in results)
    last_done = max(r["done_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    per_engine = {}
    for engine in sorted({r["engine"] for r in results}):
        mine = [r["ttft_s"] * 1000 for r in results if r["engine"] == engine]
        per_engine[str(engine)] = {"requests": len(mine), "ttft_mean_ms": statistics.mean(mine)}
    return {"requests": len(results), "ttft_mean_ms": statistics.mean(ttfts),
            "ttft_p99_ms": p99, "output_tok_s": tokens / (last_done - first_sent),
            "wall_s": last_done - first_sent, "per_engine": per_engine}


def scrape(server: Server, prefixes: tuple[str, ...]) -> list[str]:
    """Lines of the server's /metrics that start with one of ``prefixes``."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    except OSError as e:
        return [f"# /metrics: {e}"]
    return [line for line in text.splitlines() if line.startswith(prefixes)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--model", required=True, help="model config directory (dummy weights)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, default=None, help="server logs (default: beside --json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile value (JSON value), e.g. --set peak_rate=8")
    p.add_argument("--python-path", metavar="PATH",
                   help="put PATH first on the servers' PYTHONPATH (e.g. a stock vLLM for "
                   "--mode static or kvcached, beside a patched one)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the servers (repeatable)")
    args = p.parse_args()

    prof = json.loads(json.dumps(PROFILES[args.device]))
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in prof:
            raise SystemExit(f"--set {key}: not a profile value ({', '.join(sorted(prof))})")
        prof[key] = json.loads(value)
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = min(30000, config.get("vocab_size", 30000))
    backend, mode_args, mode_env = mode_settings(args.mode, args.device, prof, args.engines)
    engine = prof["engine"] | mode_args
    logs = args.logs or args.json.parent
    logs.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    if args.python_path:
        base_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [args.python_path, os.environ.get("PYTHONPATH")]))
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--env {item!r}: KEY=VALUE expected")
        mode_env[key] = value
    if args.device == "cpu":
        base_env["VLLM_TARGET_DEVICE"] = "cpu"
    else:
        base_env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    result: dict = {"mode": args.mode, "engines": args.engines, "device": args.device,
                    "profile": prof, "engine": engine, "backend": backend or "default",
                    "env": mode_env, "python_path": args.python_path, "seed": args.seed,
                    "health_s": []}
    servers: list[Server] = []
    try:
        for i in range(args.engines):
            env = dict(mode_env)
            if args.mode == "kvcached":
                env["KVCACHED_IPC_NAME"] = f"bench_sharing_{os.getpid()}_{i}"
            server = Server(args.model, backend, engine, logs / f"sharing-{args.mode}-{i}.log",
                            base_env, env=env)
            servers.append(server)
            health = server.wait_healthy(prof["timeout_s"])
            if "error" in health:
                raise SystemExit(f"{args.mode} engine {i}: {health['error']}")
            result["health_s"].append(round(health["health_s"], 1))
            print(f"{args.mode}: engine {i} up in {health['health_s']:.0f} s", flush=True)
        warm = [(0.0, i, prompt(random.Random(i), 16, vocab)) for i in range(args.engines)]
        summarize_run(run_plan(servers, args.model, warm, 2, prof["timeout_s"]))

        result["single"] = []
        # One untimed round first (the first batch of a size pays for its kernels), then
        # at least five timed ones: a round takes a few seconds and spreads widely.
        for rep in range(-1, max(args.repeats, SINGLE_REPEATS)):
            rng = random.Random(args.seed * 1000 + 500 + rep)
            plan = [(0.0, 0, prompt(rng, prof["single_prompt_len"], vocab))
                    for _ in range(prof["single_num"])]
            run = summarize_run(run_plan(servers, args.model, plan, prof["output_len"],
                                         prof["timeout_s"]))
            if rep >= 0:
                result["single"].append(run)
            print(f"{args.mode}: single {rep}: {run['output_tok_s']:.0f} tok/s", flush=True)
            time.sleep(prof["shrink_delay_s"] + 1)

        result["peaks"] = []
        for rep in range(args.repeats):
            plan = schedule(prof, args.engines, args.seed, rep, vocab)
            run = summarize_run(run_plan(servers, args.model, plan, prof["output_len"],
                                         prof["timeout_s"]))
            result["peaks"].append(run)
            print(f"{args.mode}: peaks {rep}: {run['requests']} requests, TTFT mean "
                  f"{run['ttft_mean_ms']:.0f} ms, p99 {run['ttft_p99_ms']:.0f} ms, "
                  f"{run['output_tok_s']:.0f} tok/s", flush=True)
            time.sleep(prof["shrink_delay_s"] + 2)
        if args.mode == "shared":
            result["ledger_metrics"] = scrape(servers[0], ("vllm:kv_cache_vmm_ledger_bytes",))
    finally:
        for server in servers:
            server.stop()
    for key in ("single", "peaks"):
        runs = result[key]
        for stat in ("ttft_mean_ms", "ttft_p99_ms", "output_tok_s"):
            result[f"{key}_{stat}"] = spread([r[stat] for r in runs])
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k]["median"] for k in
                      ("peaks_ttft_mean_ms", "peaks_ttft_p99_ms", "single_output_tok_s")}))


if __name__ == "__main__":
    main()
