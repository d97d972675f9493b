#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Several engines on one device, each behind its own OpenAI server, under peaks that come
at different times: time to first token, throughput, failed requests and preemptions per way
of sharing the KV memory.

Modes (``--mode``), the same model and engine settings otherwise:

  static      stock KV allocation, the device split statically: each engine gets
              ``--gpu-memory-utilization share/N`` and ``--kv-cache-memory-bytes
              kv_bytes/N`` (CPU: ``kv_cache_memory_bytes`` total/N)
  first-come  VMM KV shared through the device ledger, first come first served: every
              engine ``--kv-cache-memory-backend vmm --kv-cache-vmm-shared
              --kv-cache-vmm-share-policy first-come`` with the whole share and a ledger of
              ``kv_bytes`` (CPU: the whole KV budget as each engine's virtual size and as
              the ledger's capacity)
  fair        the same with ``--kv-cache-vmm-share-policy fair``
  shared      the same without a policy flag (the engine's default; for a build without it)
  kvcached    the external kvcached library on the same vLLM (``ENABLE_KVCACHED=true``,
              ``KVCACHED_AUTOPATCH=1``, its pool sized to the same share); needs kvcached
              importable by the servers' Python, else the run stops with the reason

``--weights W0,W1,...`` gives the shared engines ``--kv-cache-vmm-share-weight``.

On a GPU the engines hold ``kv_bytes`` of KV memory together (the profile's value, 18 GiB:
a little less than three 8B engines' static split gets of an 80 GB card at 0.9), whatever
the card: on a larger card the share would leave more KV memory, an over-subscribed
workload sized by it would then ask for more requests in the same peak windows, and the
peaks would over-subscribe the device's compute rather than its KV memory (an H200's 77.5
GiB made over1.5 744 peak requests of 1,280 tokens, and every mode's mean TTFT 8-10 s).
``--set kv_bytes=null``: what the share leaves (measured, below). kvcached has no such
setting (it maps pages while the device has more than (1 - KVCACHED_GPU_UTILIZATION) of its
memory free): bench.py gives its servers ``--env KVCACHED_GPU_UTILIZATION=U``, U what the
static split's engines used of the device (their KV memory, weights, activations and
contexts: ``device_memory`` in the static run's JSON), so that it maps about the same KV
memory; without a static run before it, it gets the share.

``--shared-kv-bytes N`` (CUDA, shared modes) gives the shared engines' ledger that capacity
(``--kv-cache-vmm-shared-bytes``) instead of ``kv_bytes`` or measuring it: give the KV memory
a static split's engines got together (what ``--mode static`` measures), so both modes hold
the same KV memory. Measured by the shared engines themselves, the capacity is smaller
than a static split's on the same share: it counts every engine's CUDA context and what the
driver holds, which each static engine's own profile leaves out. (On CPU the shared
engines' capacity is the static split's total already.)

``--policies first-come,fair`` (with ``--mode fair`` or ``first-come``): the shared engines
start once and every workload runs once per share policy in each repetition, the policies
in the order given in even repetitions and reversed in odd ones; before each run the
engines' entries in the device ledger are switched to that policy through the ledger CLI
(``python -m vllm.v1.kv_vmm.ledger_cli set ENGINE --share-policy P``, the engines of this
run's servers only). The policies then compare in interleaved pairs on the same engines,
without the start-ups between them.

The engines start one after another (each profiles the device with the earlier ones
loaded), then:

  single    only engine 0 is busy: ``single_num`` requests at once, small enough for the
            static split; output tokens/s, after one untimed round, ``--single-rounds``
            timed rounds
  workloads ``--workloads``, each ``--repeats`` times (repetitions ``--first-rep`` on):
    peak        every engine gets a light background load all along, and in turn a peak
                (Poisson arrivals at ``peak_rate`` for ``peak_s`` seconds, engine i from
                i * ``stagger_s``)
    over<R>     over-subscribed: the engines' peaks together need R times the device's KV
                capacity (prompt + output tokens of every peak request, times the model's
                KV bytes per token), split evenly; engine i's ``over_prompt_len`` /
                ``over_output_len`` requests arrive uniformly within ``over_peak_s``
                seconds, and consecutive engines' peaks overlap by the given fractions
                of that window, in turn (``over3@1/0.5/0``; default 0.75/0.25: engines 0
                and 1 overlap by 3/4, engines 1 and 2 by 1/4); a background load of
                ``over_background_rate`` per engine all along
            The capacity is ``--kv-capacity-bytes``, or measured once the engines are up:
            static: the KV blocks the engines got (``vllm:cache_config_info``), shared
            modes: the device ledger's capacity (``vllm:kv_cache_vmm_ledger_bytes``).

Per workload and repetition, over all requests and per engine: TTFT mean and p99, output
tokens/s, requests failed (with the first error's text) and preemptions (each engine's
``vllm:num_preemptions`` counter, read before and after). A failed request or an engine that
dies is recorded, not fatal; an engine that does not start, or a warm-up that fails, stops
the run with the reason. Arrivals and prompts come from ``--seed``, the workload and the
repetition, so every mode replays the same requests.

TTFT is measured at the client: from sending a streamed completion to its first chunk.

  python scripts/bench/bench_sharing.py --mode fair --model <config dir> --json /tmp/fair.json
  python scripts/bench/bench_sharing.py --mode static --device cpu --model <dir> \
      --json /tmp/s.json --workloads peak,over1.5,over3

scripts/bench/bench.py (item 7, ``sharing``) runs the modes interleaved per repetition and
compares them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_items import sharing_order  # noqa: E402
from bench_server import Server, fetch_metrics, metric_samples  # noqa: E402

#: Share policy (--kv-cache-vmm-share-policy) of each mode on shared VMM KV; None: the flag
#: is left out (the engine's default).
SHARED_MODES: dict[str, str | None] = {"first-come": "first-come", "fair": "fair",
                                       "shared": None}
MODES = ("static", *SHARED_MODES, "kvcached")
#: Share policies a run of shared engines may switch between (--policies).
POLICIES = ("first-come", "fair")
LEDGER_CLI = "vllm.v1.kv_vmm.ledger_cli"
#: Timed rounds of the one-engine-busy phase, at least (over all repetitions of a mode).
SINGLE_REPEATS = 5
#: Overlap of consecutive engines' peaks in an over-subscribed workload, in turn.
DEFAULT_OVERLAPS = (0.75, 0.25)
WORKLOAD_RE = re.compile(r"over(\d+(?:\.\d+)?)(?:@(\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)*))?")

# Sizes per device. "share": the fraction of the device all engines together may use
# (GPU), or their KV memory in bytes (CPU).
# "kv_bytes" (GPU): the KV memory all engines hold together (None: what the share leaves).
PROFILES: dict[str, dict] = {
    "cuda": {
        "share": 0.9, "kv_bytes": 18 << 30,
        "engine": {"max_model_len": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "enforce_eager": True, "no_enable_prefix_caching": True},
        "prompt_len": 1024, "output_len": 256,
        "single_num": 32, "single_prompt_len": 512,
        "background_rate": 0.5, "peak_rate": 12.0, "peak_s": 8.0, "stagger_s": 20.0,
        "over_prompt_len": 1024, "over_output_len": 256, "over_peak_s": 6.0,
        "over_background_rate": 0.5,
        "shrink_delay_s": 2.0, "timeout_s": 600,
    },
    "cpu": {
        "share": 96 << 20,
        "engine": {"max_model_len": 1024, "max_num_seqs": 16, "enforce_eager": True,
                   "no_enable_prefix_caching": True, "distributed_executor_backend": "uni"},
        "prompt_len": 256, "output_len": 8,
        "single_num": 2, "single_prompt_len": 128,
        "background_rate": 0.0, "peak_rate": 2.0, "peak_s": 3.0, "stagger_s": 6.0,
        "over_prompt_len": 504, "over_output_len": 8, "over_peak_s": 3.0,
        "over_background_rate": 0.0,
        "shrink_delay_s": 1.0, "timeout_s": 600,
    },
}

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_bytes_per_token(config: dict, kv_dtype: str | None = None) -> int:
    """KV cache bytes one token takes in all layers, from a model's config.json: keys and
    values of every KV head (MLA: the latent and the rope part), in the cache's data type
    (``kv_dtype``, default the model's)."""
    text = config.get("text_config") or config
    dtype = kv_dtype or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"
    if dtype not in _DTYPE_BYTES:
        raise SystemExit(f"KV bytes per token: unknown data type {dtype!r} (give "
                         "--set kv_bytes_per_token=N)")
    layers = text["num_hidden_layers"]
    if text.get("kv_lora_rank"):
        per_layer = text["kv_lora_rank"] + text.get("qk_rope_head_dim", 0)
    else:
        heads = text.get("num_attention_heads")
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        per_layer = 2 * text.get("num_key_value_heads", heads) * head_dim
    return layers * per_layer * _DTYPE_BYTES[dtype]


def parse_workloads(text: str) -> list[dict]:
    """``peak,over1.5,over3@1/0``: the workloads, in order, each once."""
    names = [w.strip() for w in text.split(",") if w.strip()]
    workloads = []
    for name in names:
        if name == "peak":
            workloads.append({"name": name, "kind": "peak"})
            continue
        m = WORKLOAD_RE.fullmatch(name)
        ratio = float(m[1]) if m else 0.0
        overlaps = [float(x) for x in m[2].split("/")] if m and m[2] else list(DEFAULT_OVERLAPS)
        if not m or ratio <= 0 or not all(0 <= o <= 1 for o in overlaps):
            raise SystemExit(
                f"workload {name!r}: give peak, or over<R>[@<overlap>/<overlap>...] with R the "
                "engines' total peak KV demand as a multiple of the device's KV capacity and "
                "each overlap of consecutive engines' peaks a fraction in [0, 1] "
                "(e.g. over1.5, over3@1/0.5/0)")
        workloads.append({"name": name, "kind": "over", "ratio": ratio, "overlaps": overlaps})
    if not workloads or len(set(names)) != len(names):
        raise SystemExit(f"workloads {text!r}: give each workload once, comma-separated "
                         "(e.g. peak,over1.5,over3)")
    return workloads


def mode_settings(mode: str, device: str, prof: dict, engines: int,
                  shared_kv_bytes: int | None = None) -> tuple[str | None, dict, dict]:
    """(--kv-cache-memory-backend or None, engine arguments, environment) of one engine;
    ``shared_kv_bytes``: the shared modes' ledger capacity on CUDA (None: the profile's
    ``kv_bytes``, or measured by the engines where that is None too)."""
    share = prof["share"]
    kv_bytes = prof.get("kv_bytes")
    if mode == "static":
        if device == "cuda":
            # The share still bounds each engine (vLLM's start-up check of free memory).
            args = {"gpu_memory_utilization": round(share / engines, 4)}
            return None, args | ({"kv_cache_memory_bytes": kv_bytes // engines}
                                 if kv_bytes else {}), {}
        return None, {"kv_cache_memory_bytes": share // engines}, {}
    if mode in SHARED_MODES:
        args = {"kv_cache_vmm_shared": True, "kv_cache_vmm_shrink_delay": prof["shrink_delay_s"]}
        if SHARED_MODES[mode] is not None:
            args["kv_cache_vmm_share_policy"] = SHARED_MODES[mode]
        if device == "cuda":
            ledger = shared_kv_bytes if shared_kv_bytes is not None else kv_bytes
            if ledger:
                args["kv_cache_vmm_shared_bytes"] = ledger
            return "vmm", args | {"gpu_memory_utilization": share}, {}
        return "vmm", args | {"kv_cache_memory_bytes": share,
                              "kv_cache_vmm_shared_bytes": share}, {}
    if mode == "kvcached":
        if device != "cuda":
            raise SystemExit("--mode kvcached needs a CUDA device")
        env = {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1",
               "KVCACHED_GPU_UTILIZATION": str(share)}
        return None, {"gpu_memory_utilization": share}, env
    raise SystemExit(f"unknown mode {mode!r}")


def kvcached_missing(env: dict, timeout: float = 120) -> str | None:
    """Why the servers' Python (``env``: its PYTHONPATH) cannot import kvcached, or None."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import importlib.util, sys; "
             "sys.exit(importlib.util.find_spec('kvcached') is None)"],
            env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"looking for the kvcached package took over {timeout:g} s"
    if proc.returncode == 0:
        return None
    return ("the kvcached package is not importable by the servers' Python"
            + (f" ({proc.stderr.strip().splitlines()[-1]})" if proc.stderr.strip() else "")
            + ": install it (or put it on PYTHONPATH, e.g. with --stock-path)")


def device_memory(env: dict, timeout: float = 30) -> dict | None:
    """Memory used and total of the servers' GPU in bytes (nvidia-smi; the first device of
    ``env``'s CUDA_VISIBLE_DEVICES, else device 0), or None where nvidia-smi does not
    answer. No CUDA context of ours: the figure is the engines' alone."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    cmd = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
           "-i", visible or "0"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
        used, total = (int(v) << 20 for v in out.stdout.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return {"used_bytes": used, "total_bytes": total}


def kvcached_utilization(static: dict) -> tuple[float, str] | None:
    """``KVCACHED_GPU_UTILIZATION`` that holds kvcached's engines to the KV memory a static
    split's engines held (``static``: a static run's result with ``kv_bytes`` in its
    profile), and why; None without such a run. kvcached maps pages while the device's free
    memory stays above (1 - utilization) of it, so the static engines' whole use (weights,
    activations and contexts, about the same in kvcached's engines, plus their KV) leaves it
    about their KV memory."""
    mem = static.get("device_memory")
    if static.get("mode") != "static" or not (static.get("profile") or {}).get("kv_bytes") \
            or not mem or not 0 < mem["used_bytes"] < mem["total_bytes"]:
        return None
    util = math.ceil(mem["used_bytes"] / mem["total_bytes"] * 1e4) / 1e4
    return util, (f"the static split's engines used {mem['used_bytes'] / 2**30:.2f} of "
                  f"{mem['total_bytes'] / 2**30:.2f} GiB")


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


def over_schedule(prof: dict, engines: int, seed: int, rep: int, vocab: int, workload: dict,
                  capacity_bytes: int, bytes_per_token: int
                  ) -> tuple[list[tuple[float, int, list[int]]], dict]:
    """One repetition of an over-subscribed workload: the plan (send time, engine, prompt),
    sorted, and what it asks for. The peaks' requests together hold ``ratio`` x
    ``capacity_bytes`` of KV memory once all are in flight (to within half a request), split
    evenly over the engines; engine i+1's peak starts when engine i's is the overlap's
    complement through its window."""
    p_len, o_len = prof["over_prompt_len"], prof["over_output_len"]
    max_len = prof["engine"].get("max_model_len")
    if max_len and p_len + o_len > max_len:
        raise SystemExit(f"over_prompt_len + over_output_len = {p_len + o_len} exceeds the "
                         f"engines' max_model_len {max_len}")
    if capacity_bytes <= 0 or bytes_per_token <= 0:
        raise SystemExit(f"{workload['name']}: the KV capacity ({capacity_bytes} bytes) and "
                         f"bytes per token ({bytes_per_token}) must be positive")
    request_bytes = (p_len + o_len) * bytes_per_token
    total = round(workload["ratio"] * capacity_bytes / request_bytes)
    if total < engines:
        raise SystemExit(f"{workload['name']}: {workload['ratio']} x {capacity_bytes} bytes of "
                         f"KV is {total} request(s) of {p_len + o_len} tokens, fewer than one "
                         f"per engine ({engines}): lower over_prompt_len or raise the ratio")
    counts = [total // engines + (i < total % engines) for i in range(engines)]
    window = prof["over_peak_s"]
    overlaps = [workload["overlaps"][i % len(workload["overlaps"])] for i in range(engines - 1)]
    starts = [0.0]
    for overlap in overlaps:
        starts.append(starts[-1] + (1 - overlap) * window)
    rng = random.Random(f"{seed}/{workload['name']}/{rep}")
    plan = []
    for engine, (start, n) in enumerate(zip(starts, counts)):
        times = sorted(start + rng.random() * window for _ in range(n))
        plan += [(t, engine, prompt(rng, p_len, vocab)) for t in times]
    horizon = starts[-1] + window
    rate = prof["over_background_rate"]
    background = 0
    for engine in range(engines):
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= horizon:
                break
            plan.append((t, engine, prompt(rng, p_len, vocab)))
            background += 1
    info = {"ratio": workload["ratio"], "overlaps": overlaps, "peak_starts_s": starts,
            "peak_window_s": window, "peak_requests": counts, "background_requests": background,
            "prompt_len": p_len, "output_len": o_len, "bytes_per_token": bytes_per_token,
            "capacity_bytes": capacity_bytes, "demand_bytes": total * request_bytes,
            "demand_ratio": total * request_bytes / capacity_bytes}
    return sorted(plan, key=lambda x: x[0]), info


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
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()


def run_plan(servers: list[Server], model: str, plan: list[tuple[float, int, list[int]]],
             max_tokens: int, timeout: float) -> list[dict]:
    """Send each request at its time (threads: requests overlap), wait for all."""
    results: list[dict] = [{} for _ in plan]
    start = time.perf_counter()

    def one(i: int, engine: int, tokens: list[int]) -> None:
        sent = time.perf_counter() - start
        try:
            r = stream_completion(servers[engine].port, model, tokens, max_tokens, timeout)
        except Exception as e:  # noqa: BLE001 - a request's failure is a result, not lost
            r = {"error": f"{type(e).__name__}: {e}"}
        r["engine"] = engine
        r["sent_s"] = sent
        r["done_s"] = time.perf_counter() - start
        results[i] = r

    with ThreadPoolExecutor(max_workers=max(1, len(plan))) as pool:
        for i, (at, engine, tokens) in enumerate(plan):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i, engine, tokens)
    return results


def _stats(results: list[dict]) -> dict:
    """Requests, failures (with the first error) and, over the requests that completed, TTFT
    mean and p99 (ms) and output tokens/s (first send to last completion); None where none
    completed."""
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    out: dict = {"requests": len(results), "failed": len(errors),
                 "first_error": errors[0] if errors else None, "ttft_mean_ms": None,
                 "ttft_p99_ms": None, "output_tok_s": None, "wall_s": None}
    if ok:
        ttfts = sorted(r["ttft_s"] * 1000 for r in ok)
        wall = max(r["done_s"] for r in ok) - min(r["sent_s"] for r in ok)
        out |= {"ttft_mean_ms": statistics.mean(ttfts),
                "ttft_p99_ms": ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)],
                "output_tok_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else None,
                "wall_s": wall}
    return out


def summarize_run(results: list[dict]) -> dict:
    """All requests of one run together, and per engine ("per_engine", by engine index)."""
    per_engine = {str(e): _stats([r for r in results if r["engine"] == e])
                  for e in sorted({r["engine"] for r in results})}
    return _stats(results) | {"per_engine": per_engine}


def preemptions(text: str | None) -> float | None:
    """The engine's vllm:num_preemptions counter (all its series), None without /metrics."""
    if text is None:
        return None
    samples = metric_samples(text, ("vllm:num_preemptions_total", "vllm:num_preemptions"))
    return sum(v for _, v in samples) if samples else None


def capacity_from_metrics(mode: str, texts: list[str | None],
                          bytes_per_token: int) -> tuple[int, str]:
    """The device's KV capacity in bytes, and how it was found, from the engines' /metrics:
    static, the KV blocks every engine got (vllm:cache_config_info) together; shared VMM KV,
    the device ledger's capacity (the smallest any engine reports)."""
    if any(t is None for t in texts):
        raise SystemExit("measuring the device's KV capacity: an engine's /metrics did not "
                         "answer (give --kv-capacity-bytes)")
    if mode == "static":
        tokens = 0
        for text in texts:
            info = metric_samples(text, ("vllm:cache_config_info",))
            if not info or not info[0][0].get("num_gpu_blocks", "").isdigit():
                raise SystemExit("measuring the device's KV capacity: no num_gpu_blocks in "
                                 "vllm:cache_config_info (give --kv-capacity-bytes)")
            tokens += int(info[0][0]["num_gpu_blocks"]) * int(info[0][0]["block_size"])
        return tokens * bytes_per_token, (f"the static split's KV blocks, {tokens} tokens in "
                                          f"all (vllm:cache_config_info)")
    if mode in SHARED_MODES:
        caps = [v for text in texts for labels, v in
                metric_samples(text, ("vllm:kv_cache_vmm_ledger_bytes",))
                if labels.get("quantity") == "capacity"]
        if not caps:
            raise SystemExit("measuring the device's KV capacity: no ledger capacity in "
                             "vllm:kv_cache_vmm_ledger_bytes (give --kv-capacity-bytes)")
        return int(min(caps)), "the device ledger's capacity (vllm:kv_cache_vmm_ledger_bytes)"
    raise SystemExit(f"--mode {mode} cannot measure the device's KV capacity: give "
                     "--kv-capacity-bytes (e.g. what a static run measured)")


def measure_capacity(mode: str, servers: list[Server], bytes_per_token: int,
                     wait_s: float = 15.0) -> tuple[int, str]:
    """capacity_from_metrics of the servers, asked again for up to ``wait_s`` seconds while
    their metrics lack it (the engines publish their figures with their step statistics)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return capacity_from_metrics(mode, [fetch_metrics(s) for s in servers],
                                         bytes_per_token)
        except SystemExit:
            if time.monotonic() >= deadline or mode not in ("static", *SHARED_MODES):
                raise
            time.sleep(1.0)


def run_workload(servers: list[Server], model: str, plan: list, max_tokens: int,
                 timeout: float) -> dict:
    """One repetition of a workload: its summary, with each engine's preemptions during it."""
    before = [preemptions(fetch_metrics(s)) for s in servers]
    run = summarize_run(run_plan(servers, model, plan, max_tokens, timeout))
    after = [preemptions(fetch_metrics(s)) for s in servers]
    for i, (b, a) in enumerate(zip(before, after)):
        count = a - b if a is not None and b is not None else None
        run["per_engine"].setdefault(str(i), _stats([]))["preemptions"] = count
    counts = [e["preemptions"] for e in run["per_engine"].values()]
    run["preemptions"] = None if None in counts else sum(counts)
    return run


def parse_policies(text: str | None, mode: str) -> list[str] | None:
    """``--policies``: share policies to switch between, each once, shared modes only."""
    if text is None:
        return None
    policies = [x.strip() for x in text.split(",") if x.strip()]
    if mode not in ("fair", "first-come"):
        raise SystemExit(f"--policies needs --mode fair or first-come (not {mode}): the "
                         "engines must be shared through the device ledger")
    if not policies or len(set(policies)) != len(policies) or not set(policies) <= set(
            POLICIES):
        raise SystemExit(f"--policies {text!r}: give each of {', '.join(POLICIES)} at most "
                         "once, comma-separated")
    return policies


def descendants(pids: set[int], proc: Path = Path("/proc")) -> set[int]:
    """``pids`` and every process below them (from each process's parent in /proc)."""
    parents: dict[int, int] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # gone meanwhile
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1].isdigit():
            parents[int(stat.parent.name)] = int(fields[1])
    found = set(pids)
    while True:
        more = {pid for pid, ppid in parents.items() if ppid in found and pid not in found}
        if not more:
            return found
        found |= more


def run_ledger_cli(argv: list[str], env: dict, timeout: float = 60) -> str:
    """The ledger CLI's output; its error ends the run."""
    try:
        proc = subprocess.run([sys.executable, "-m", LEDGER_CLI, *argv], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{LEDGER_CLI} {' '.join(argv)}: no answer in {timeout:g} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{LEDGER_CLI} {' '.join(argv)}: exit status {proc.returncode}: "
                         f"{proc.stderr.strip()[-500:]}")
    return proc.stdout


def set_share_policy(policy: str, server_pids: set[int], env: dict) -> int:
    """Switch every ledger entry of the engines under ``server_pids`` to ``policy``;
    returns how many entries were switched (an error if none)."""
    ours = descendants(server_pids)
    switched = 0
    for doc in json.loads(run_ledger_cli(["list", "--json"], env)):
        for entry in doc["entries"]:
            if entry["pid"] not in ours:
                continue
            argv = ["set", entry["id"], "--key", doc["key"], "--share-policy", policy]
            if "group" in doc["owner"]:
                raise SystemExit(f"--policies: the ledger {doc['path']} is a group's; this "
                                 "benchmark switches the ledgers of its own user only")
            run_ledger_cli(argv, env)
            switched += 1
    if not switched:
        raise SystemExit(f"--policies: no ledger entry of this run's engines found (pids "
                         f"{sorted(ours)}) to switch to {policy}")
    return switched


def parse_weights(text: str | None, engines: int) -> list[float] | None:
    if text is None:
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) != engines or not all(w > 0 for w in weights):
        raise SystemExit(f"--weights {text!r}: give {engines} positive numbers, one per engine, "
                         "comma-separated")
    return weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--model", required=True, help="model config directory (dummy weights)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--workloads", default="peak", help="comma-separated: peak, over<R>[@...]")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every workload")
    p.add_argument("--first-rep", type=int, default=0,
                   help="index of the first repetition (its arrivals and prompts)")
    p.add_argument("--single-rounds", type=int, default=SINGLE_REPEATS,
                   help="timed rounds with one engine busy (after an untimed one; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-capacity-bytes", type=int, default=None,
                   help="the device's KV capacity for the over-subscribed workloads "
                   "(default: measured, see above)")
    p.add_argument("--weights", help="shared modes: --kv-cache-vmm-share-weight per engine, "
                   "comma-separated")
    p.add_argument("--shared-kv-bytes", type=int, default=None,
                   help="CUDA, shared modes: the ledger's capacity in bytes (default: measured "
                   "by the engines; see above)")
    p.add_argument("--policies", help="shared modes: share policies to run every workload "
                   "with on the same engines, switched at runtime (e.g. first-come,fair)")
    p.add_argument("--logs", type=Path, default=None, help="server logs (default: beside --json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile value (JSON value), e.g. --set peak_rate=8")
    p.add_argument("--python-path", metavar="PATH",
                   help="put PATH first on the servers' PYTHONPATH (e.g. a stock vLLM for "
                   "--mode static or kvcached, beside a patched one)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the servers (repeatable)")
    args = p.parse_args()

    for flag, value, least in (("--engines", args.engines, 1), ("--repeats", args.repeats, 1),
                               ("--first-rep", args.first_rep, 0),
                               ("--single-rounds", args.single_rounds, 0)):
        if value < least:
            raise SystemExit(f"{flag} {value}: give {least} or more")
    if args.kv_capacity_bytes is not None and args.kv_capacity_bytes < 1:
        raise SystemExit(f"--kv-capacity-bytes {args.kv_capacity_bytes}: give a positive size")
    if args.shared_kv_bytes is not None and (args.shared_kv_bytes < 1 or args.device != "cuda"
                                             or args.mode not in SHARED_MODES):
        raise SystemExit(f"--shared-kv-bytes {args.shared_kv_bytes}: give a positive size, "
                         "with --device cuda and a shared mode")
    prof = json.loads(json.dumps(PROFILES[args.device]))
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in prof and key != "kv_bytes_per_token":
            raise SystemExit(f"--set {key}: not a profile value ({', '.join(sorted(prof))}, "
                             "kv_bytes_per_token)")
        prof[key] = json.loads(value)
    kv_bytes = prof.get("kv_bytes")
    if kv_bytes is not None and (not isinstance(kv_bytes, int) or isinstance(kv_bytes, bool)
                                 or kv_bytes < args.engines):
        raise SystemExit(f"--set kv_bytes={json.dumps(kv_bytes)}: give the engines' KV memory "
                         "together in bytes (an integer), or null for what the share leaves")
    workloads = parse_workloads(args.workloads)
    weights = parse_weights(args.weights, args.engines)
    policies = parse_policies(args.policies, args.mode)
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = min(30000, config.get("vocab_size", 30000))
    bytes_per_token = prof.get("kv_bytes_per_token") or kv_bytes_per_token(config)
    backend, mode_args, mode_env = mode_settings(args.mode, args.device, prof, args.engines,
                                                 args.shared_kv_bytes)
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
    if args.mode == "kvcached":
        why = kvcached_missing({**base_env, **mode_env})
        if why:
            raise SystemExit(f"--mode kvcached: {why}")
    if args.device == "cpu":
        base_env["VLLM_TARGET_DEVICE"] = "cpu"
    else:
        base_env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    engines_args = [engine | ({"kv_cache_vmm_share_weight": weights[i]}
                              if weights and args.mode in SHARED_MODES else {})
                    for i in range(args.engines)]
    result: dict = {"mode": args.mode, "engines": args.engines, "device": args.device,
                    "profile": prof, "engine": engine, "engine_args": engines_args,
                    "backend": backend or "default", "env": mode_env,
                    "python_path": args.python_path, "seed": args.seed,
                    "weights": weights, "policies": policies,
                    "first_rep": args.first_rep, "repeats": args.repeats,
                    "workloads": workloads, "kv_bytes_per_token": bytes_per_token,
                    "kv_capacity_bytes": args.kv_capacity_bytes,
                    "capacity_source": "given (--kv-capacity-bytes)"
                    if args.kv_capacity_bytes else None,
                    "health_s": [], "single": [], "runs": [], "engine_deaths": {}}
    servers: list[Server] = []

    def note_deaths() -> None:
        for i, server in enumerate(servers):
            if server.proc.poll() is not None and str(i) not in result["engine_deaths"]:
                result["engine_deaths"][str(i)] = server.failure(f"engine {i} died")
                print(f"{args.mode}: {result['engine_deaths'][str(i)]}", flush=True)

    try:
        for i in range(args.engines):
            env = dict(mode_env)
            if args.mode == "kvcached":
                env["KVCACHED_IPC_NAME"] = f"bench_sharing_{os.getpid()}_{i}"
            server = Server(args.model, backend, engines_args[i],
                            logs / f"sharing-{args.mode}-{args.first_rep}-{i}.log",
                            base_env, env=env)
            servers.append(server)
            health = server.wait_healthy(prof["timeout_s"])
            if "error" in health:
                raise SystemExit(f"{args.mode} engine {i}: {health['error']}")
            result["health_s"].append(round(health["health_s"], 1))
            print(f"{args.mode}: engine {i} up in {health['health_s']:.0f} s", flush=True)
        warm = [(0.0, i, prompt(random.Random(i), 16, vocab)) for i in range(args.engines)]
        failed = summarize_run(run_plan(servers, args.model, warm, 2, prof["timeout_s"]))
        if failed["failed"]:
            raise SystemExit(f"{args.mode}: warm-up: {failed['failed']} of {failed['requests']} "
                             f"requests failed, first: {failed['first_error']}")
        if args.device == "cuda":
            result["device_memory"] = device_memory({**base_env, **mode_env})
        if result["kv_capacity_bytes"] is None and any(w["kind"] == "over" for w in workloads):
            result["kv_capacity_bytes"], result["capacity_source"] = measure_capacity(
                args.mode, servers, bytes_per_token)
            print(f"{args.mode}: KV capacity {result['kv_capacity_bytes'] / 2**30:.2f} GiB: "
                  f"{result['capacity_source']}", flush=True)
        elif args.mode in ("static", *SHARED_MODES):
            # Given: what this mode's engines got is recorded beside it (a static split and
            # the shared engines may hold different KV memory on the same share).
            try:
                got, source = measure_capacity(args.mode, servers, bytes_per_token)
                result["kv_capacity_measured"] = {"bytes": got, "source": source}
                print(f"{args.mode}: KV capacity given {result['kv_capacity_bytes'] / 2**30:.2f}"
                      f" GiB, this mode's engines have {got / 2**30:.2f} GiB: {source}",
                      flush=True)
            except SystemExit as e:
                result["kv_capacity_measured"] = {"error": str(e)}

        # One untimed round first (the first batch of a size pays for its kernels), then
        # the timed ones: a round takes a few seconds and spreads widely.
        for rnd in range(-1, args.single_rounds if args.single_rounds > 0 else -1):
            rng = random.Random(args.seed * 1000 + 500 + args.first_rep * 100 + rnd)
            plan = [(0.0, 0, prompt(rng, prof["single_prompt_len"], vocab))
                    for _ in range(prof["single_num"])]
            run = summarize_run(run_plan(servers, args.model, plan, prof["output_len"],
                                         prof["timeout_s"]))
            if rnd >= 0:
                result["single"].append(run)
            print(f"{args.mode}: single {rnd}: {run['output_tok_s'] or 0:.0f} tok/s, "
                  f"{run['failed']} failed", flush=True)
            time.sleep(prof["shrink_delay_s"] + 1)

        cli_env = {**base_env, **mode_env}
        for rep in range(args.first_rep, args.first_rep + args.repeats):
            for policy in sharing_order(policies, rep) if policies else [None]:
                if policy is not None:
                    count = set_share_policy(policy, {s.proc.pid for s in servers}, cli_env)
                    print(f"{args.mode}: repetition {rep}: {count} ledger entries switched to "
                          f"{policy}", flush=True)
                runs: dict = {}
                for w in workloads:
                    if w["kind"] == "peak":
                        plan, info = schedule(prof, args.engines, args.seed, rep, vocab), {}
                        max_tokens = prof["output_len"]
                    else:
                        plan, info = over_schedule(prof, args.engines, args.seed, rep, vocab,
                                                   w, result["kv_capacity_bytes"],
                                                   bytes_per_token)
                        max_tokens = prof["over_output_len"]
                    run = run_workload(servers, args.model, plan, max_tokens,
                                       prof["timeout_s"])
                    runs[w["name"]] = run | {"plan": info}
                    note_deaths()
                    print(f"{policy or args.mode}: {w['name']} {rep}: {run['requests']} "
                          f"requests, {run['failed']} failed, TTFT mean "
                          f"{run['ttft_mean_ms'] or 0:.0f} ms, p99 {run['ttft_p99_ms'] or 0:.0f}"
                          f" ms, {run['output_tok_s'] or 0:.0f} tok/s, {run['preemptions']} "
                          "preemptions", flush=True)
                    time.sleep(prof["shrink_delay_s"] + 2)
                result["runs"].append({"rep": rep, "workloads": runs}
                                      | ({"policy": policy} if policy else {}))
        if args.mode in SHARED_MODES:
            text = fetch_metrics(servers[0]) or ""
            result["ledger_metrics"] = [line for line in text.splitlines()
                                        if line.startswith("vllm:kv_cache_vmm_ledger_bytes")]
    finally:
        for server in servers:
            server.stop()
    args.json.write_text(json.dumps(result, indent=1))
    for run in result["runs"]:
        print(json.dumps({name: {k: w[k] for k in ("ttft_mean_ms", "ttft_p99_ms", "failed")}
                          for name, w in run["workloads"].items()}
                         | ({"policy": run["policy"]} if "policy" in run else {})))


if __name__ == "__main__":
    main()
