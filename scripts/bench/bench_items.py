# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark suite, driver side: the A/B machinery and the items (scripts/bench/bench.py).

Each item starts its engines in processes of their own (bench_child.py, `vllm serve` through
bench_server.py, bench_vmm.py, bench_pd.py, bench_nixl_vmm.py), stock and VMM KV interleaved
(ab_order), and keeps within the suite's time Budget. Every such process has a deadline and
runs in a session of its own (bench_proc.run_logged): one that fails or runs past it is
killed with all it started, and the item says "not measured" with how it ended and the last
lines of its log; the Runner keeps the list (bench.py exits non-zero after the report).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# The benchmarks' own modules, and the harness's shared helpers (tiny_model, model_configs).
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from bench_child import REPEAT_SUFFIX  # noqa: E402
from bench_proc import failure, run_logged  # noqa: E402
from bench_report import IDLE_TTFT  # noqa: E402
from bench_server import Server  # noqa: E402

# Item 3 checks that memory falls back after a burst; a short --kv-cache-vmm-shrink-delay
# keeps the run short (the default keeps pages for bursts that follow closely).
ELASTIC_SHRINK_DELAY_S = 1.0

CHILD_SCRIPT = BENCH / "bench_child.py"
PD_SCRIPT = BENCH / "bench_pd.py"
NIXL_SCRIPT = BENCH / "bench_nixl_vmm.py"


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
        #: "name: how it failed" of every benchmark process that failed or ran too long.
        self.failures: list[str] = []
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                        # Worker page figures are read through collective_rpc with a function.
                        VLLM_ALLOW_INSECURE_SERIALIZATION="1", NCCL_NVLS_ENABLE="0")
        if device == "cuda":
            self.env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

    def run(self, name: str, cmd: list[str], log: Path, timeout: float) -> str | None:
        """A benchmark script in its own session (see bench_proc.run_logged); None if it
        succeeded, else how it failed (also printed and kept in ``failures``)."""
        rc = run_logged(cmd, log, timeout, self.env)
        if rc == 0:
            return None
        why = failure(rc, timeout, log)
        self.failures.append(f"{name}: {why}")
        print(f"  {name} failed: {why}", flush=True)
        return why

    def run_json(self, name: str, cmd: list[str], js: Path, log: Path,
                 timeout: float) -> tuple[dict | None, str | None]:
        """A benchmark script that writes its figures to ``js``: (figures, None) if it
        succeeded; (None, how it failed) if not, (None, None) if it succeeded without writing
        them. ``js`` is removed first, so figures an earlier run left there are never taken
        for this run's."""
        js.unlink(missing_ok=True)
        why = self.run(name, cmd, log, timeout)
        if why is not None or not js.exists():
            return None, why
        return json.loads(js.read_text()), None

    def child(self, name: str, spec: dict, timeout: float) -> dict:
        """Run one measurement in its own process; {"error": ...} if it fails."""
        self.count += 1
        log = self.logs / f"{self.count:02d}-{name}.log"
        with tempfile.TemporaryDirectory() as tmp:
            spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
            spec_path.write_text(json.dumps(spec))
            t0 = time.monotonic()
            why = self.run(name, [sys.executable, str(CHILD_SCRIPT), str(spec_path),
                                  str(out_path)], log, timeout)
            wall = time.monotonic() - t0
            if why is None:
                print(f"  {name}: {wall:.0f} s", flush=True)
                if out_path.exists():
                    return {**json.loads(out_path.read_text()), "wall_s": wall}
                why = f"exit status 0 without a result; log {log.name}"
                self.failures.append(f"{name}: {why}")
        return {"error": why}


def summarize(a: list[float], b: list[float]) -> dict:
    """Medians of both sides and the B/A ratio of medians, with per-pair ratio spread."""
    pairs = [y / x for x, y in zip(a, b) if x]
    return {"a": a, "b": b, "a_median": statistics.median(a), "b_median": statistics.median(b),
            "ratio": statistics.median(b) / statistics.median(a),
            "ratio_min": min(pairs), "ratio_max": max(pairs), "n": len(pairs)}


def spread(values: list[float]) -> dict:
    """Median, min and max of one side's values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


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
        data, why = runner.run_json(f"pagemap {i + 1}", [
            sys.executable, str(BENCH / "bench_vmm.py"), "--backend", p["backend"], "--pages",
            str(p["pages"]), "--repeats", str(p["repeats"]), "--json", str(js)], js, log, 300)
        stats = (data or {}).get("backends", {}).get(p["backend"])
        if not stats:
            return {"not_measured": f"bench_vmm.py: {why or 'no ' + p['backend'] + ' figures'}"}
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
            "ratios": {k: spread(v) for k, v in ratios.items()}}


def item_pd(runner: Runner, prof: dict, out: Path, gpus: int, budget: Budget) -> dict:
    if gpus < 2:
        return {"not_measured": f"needs 2 GPUs, this host has {gpus}"}
    # Transfer throughput: reads of KV blocks from one GPU into the other, out of stock
    # memory (NIXL) and out of VMM-backed memory as the patched NixlConnector reads it (the
    # same-host path; also through NIXL/UCX alone, the path between hosts), and one copy of
    # the same bytes over the link. Each invocation measures every mode; `repeats`
    # invocations give the spread.
    # With `reader_cpus` the reader (and the link's copy) run on those CPUs, or with "gpu" on
    # the CPUs next to the reader's GPU, as numactl or vLLM's --numa-bind place a decode
    # worker; without, wherever the kernel runs them.
    cpus = prof.get("reader_cpus")
    pinning = ["--cpus", cpus] if cpus else []
    stock: list[float] = []
    vmm: list[float] = []
    extra: dict[str, list[float]] = {"vmm_ucx": [], "link": []}
    affinity: list[int] | None = None
    for i in range(prof["repeats"]):
        js = out / f"nixl_transfer_{i}.json"
        log = runner.logs / f"nixl_transfer_{i}.log"
        print(f"pd: NIXL transfer {i + 1}/{prof['repeats']}", flush=True)
        r, why = runner.run_json(f"pd: NIXL transfer {i + 1}", [
            sys.executable, str(NIXL_SCRIPT), "--kind", "cuda", *pinning, "--json", str(js)],
            js, log, 900)
        if r is None:
            return {"not_measured": f"{NIXL_SCRIPT.name}: {why or 'no results'}"}
        stock.append(r["stock"]["gb_per_s"])
        vmm.append(r["vmm"]["gb_per_s"])
        for mode, values in extra.items():
            values.append(r[mode]["gb_per_s"])
        affinity = r["vmm"].get("affinity", affinity)
    result: dict = {"transfer_gbps": summarize(stock, vmm)}
    if cpus:
        result["reader_cpus"] = {"asked": cpus, "cpus": affinity}
    result["transfer_gbps"] |= {mode: spread(values) for mode, values in extra.items()}
    # Each mode as a fraction of the link, per invocation.
    result["transfer_gbps"]["of_link"] = {
        mode: spread([x / link for x, link in zip(values, extra["link"])])
        for mode, values in (("stock", stock), ("vmm", vmm), ("vmm_ucx", extra["vmm_ucx"]))}
    # scripts/bench/bench_pd.py: a prefill and a decode server on GPUs 0 and 1, median TTFT of
    # requests through both; one run per repetition, pairs while the budget allows.
    model = model_dir(prof["elastic"]["model"], out)
    runs: dict[str, list[float]] = {"default": [], "vmm": []}
    reads: dict[str, list[float]] = {}
    for backend in ab_order(prof["repeats"]):
        if len(runs["default"]) == len(runs["vmm"]) and not budget.allows(
                2 * prof["est_serve_s"]):
            break
        js = out / f"pd_{backend}_{len(runs[backend])}.json"
        log = runner.logs / f"pd_{backend}_{len(runs[backend])}.log"
        print(f"pd: {backend}", flush=True)
        run, why = runner.run_json(f"pd: {backend}", [
            sys.executable, str(PD_SCRIPT), "--backend", backend, "--model", model, "--json",
            str(js), "--logs", str(runner.logs), "--vmm-args",
            json.dumps(prof.get("vmm_args", {}))], js, log, 900)
        if run is None:
            result["ttft_ms"] = {"not_measured": f"{PD_SCRIPT.name}: {why or 'no results'}"}
            return result
        runs[backend].append(run["ttft_ms"])
        if "same_host" in run:
            result.setdefault("vmm_same_host", []).append(run["same_host"])
        # The decode instance's reads as NixlConnector timed them (mean ms per read).
        if "xfer_ms" in (run.get("decode_nixl") or {}):
            reads.setdefault(backend, []).append(run["decode_nixl"]["xfer_ms"])
    n = min(len(runs["default"]), len(runs["vmm"]))
    result["ttft_ms"] = (summarize(runs["default"][:n], runs["vmm"][:n]) if n else
                         {"not_measured": "time budget spent before the first pair"})
    if reads:
        result["decode_read_ms"] = {backend: spread(v) for backend, v in reads.items()}
    return result



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
            runner.failures.append(f"tp{tp}-startup: {backend}: {r['error']}")
            print(f"  tp{tp}-startup {backend} failed: {r['error']}", flush=True)
            return {"not_measured": r["error"]}
        runs[backend].append(r["health_s"])
    n = min(len(runs["default"]), len(runs["vmm"]))
    if n == 0:
        return {"not_measured": "time budget spent before the first pair"}
    return {"model": prof["elastic"]["model"], "tensor_parallel_size": tp, "engine": engine,
            "health_s": summarize(runs["default"][:n], runs["vmm"][:n])}



SHARING_SCRIPT = BENCH / "bench_sharing.py"
#: Item 7's modes: static split, VMM KV shared first come first served and fairly, kvcached
#: (CUDA). "shared" (the engine's default policy, no policy flag) is for builds without one.
SHARING_MODES = ("static", "first-come", "fair", "kvcached")
SHARING_EXTRA_MODES = ("shared",)
SHARING_WORKLOADS = "peak,over1.5,over3"
#: Statistics of a workload, over all requests and per engine.
SHARING_STATS = ("ttft_mean_ms", "ttft_p99_ms", "output_tok_s")


def sharing_modes(text: str | None, device: str) -> list[str]:
    """Item 7's modes in the order given (default: static, first-come, fair, and kvcached on
    CUDA)."""
    cuda = ("kvcached",) if device == "cuda" else ()
    if text is None:
        return [m for m in SHARING_MODES if m != "kvcached"] + list(cuda)
    modes = [m.strip() for m in text.split(",") if m.strip()]
    known = tuple(m for m in SHARING_MODES if m != "kvcached") + SHARING_EXTRA_MODES + cuda
    bad = [m for m in modes if m not in known]
    if bad or not modes or len(set(modes)) != len(modes):
        raise SystemExit(f"--sharing-modes {text!r}: give each of {', '.join(known)} at "
                         f"most once, comma-separated (kvcached needs a CUDA device)")
    return modes


def sharing_order(modes: list[str], rep: int) -> list[str]:
    """The modes of one repetition: as given, then reversed, ... (drift hits each alike)."""
    return list(modes) if rep % 2 == 0 else list(reversed(modes))


def parse_bytes(text: str) -> int:
    """``21474836480``, ``20GiB``, ``512MiB``, ``1.5TiB``: a size in bytes."""
    units = {None: 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]iB)?\s*", text, re.IGNORECASE)
    value = float(m[1]) * units[m[2] and m[2].lower()] if m else 0
    if value < 1:
        raise SystemExit(f"{text!r}: give a size in bytes, e.g. 21474836480 or 20GiB")
    return int(value)


def kvcached_server_env(env: dict, stock_path: str | None, kvcached_env: list[str]) -> dict:
    """The environment item 7's kvcached servers get (bench_sharing.py --python-path, --env)."""
    env = dict(env, **dict(kv.split("=", 1) for kv in kvcached_env if "=" in kv))
    if stock_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [stock_path, env.get("PYTHONPATH")]))
    return env


def check_sharing(modes: list[str], workloads: list[dict], capacity: int | None) -> None:
    """Stop before anything runs where the over-subscribed workloads would have no KV
    capacity: the first mode measures it, and kvcached cannot."""
    if capacity is None and modes[0] == "kvcached" and any(w["kind"] == "over"
                                                          for w in workloads):
        raise SystemExit("--sharing-modes: kvcached cannot measure the device's KV capacity "
                         "that the over-subscribed workloads are sized by: put another mode "
                         "first or give --sharing-kv-capacity")


def _spread_of(values: list) -> dict | None:
    """spread() of the values that were measured (None: not measured), None if none was."""
    measured = [v for v in values if v is not None]
    return spread(measured) if measured else None


def aggregate_sharing(runs: list[dict]) -> dict:
    """One mode's figures from its bench_sharing.py results (one per repetition, or one with
    several): per workload, over the repetitions, the median [min..max] of TTFT mean and p99
    and output tokens/s, and per repetition the raw figures (requests, failed, preemptions),
    over all engines and per engine; the one-engine-busy rounds of all repetitions."""
    reps = [(rep["rep"], name, w) for r in runs for rep in r["runs"]
            for name, w in rep["workloads"].items()]
    workloads: dict = {}
    for rep, name, w in reps:
        agg = workloads.setdefault(name, {"reps": [], "per_engine": {}, "plan": []})
        agg["reps"].append(rep)
        agg["plan"].append(w.get("plan") or {})
        for key in (*SHARING_STATS, "requests", "failed", "preemptions"):
            agg.setdefault(f"{key}_runs", []).append(w.get(key))
        if w.get("first_error") and not agg.get("first_error"):
            agg["first_error"] = f"repetition {rep}: {w['first_error']}"
        for engine, e in w.get("per_engine", {}).items():
            pe = agg["per_engine"].setdefault(engine, {})
            for key in (*SHARING_STATS, "requests", "failed", "preemptions"):
                pe.setdefault(f"{key}_runs", []).append(e.get(key))
            if e.get("first_error") and not pe.get("first_error"):
                pe["first_error"] = f"repetition {rep}: {e['first_error']}"
    for agg in workloads.values():
        for target in (agg, *agg["per_engine"].values()):
            for key in SHARING_STATS:
                target[key] = _spread_of(target[f"{key}_runs"])
            target["failed_total"] = sum(x or 0 for x in target["failed_runs"])
    single = [s for r in runs for s in r.get("single", [])]
    out = {"repetitions": sorted({rep for rep, _, _ in reps}), "workloads": workloads,
           "single_output_tok_s": _spread_of([s.get("output_tok_s") for s in single]),
           "single_ttft_mean_ms": _spread_of([s.get("ttft_mean_ms") for s in single]),
           "single_failed": sum(s.get("failed", 0) for s in single),
           "engine_deaths": [f"repetition {r['first_rep']}: {why}" for r in runs
                             for why in r.get("engine_deaths", {}).values()],
           "health_s": [h for r in runs for h in r["health_s"]]}
    last = runs[-1]
    return out | {k: last.get(k) for k in ("engine", "engine_args", "env", "python_path",
                                           "weights", "backend")}


@dataclasses.dataclass(frozen=True)
class SharingInvocation:
    """One bench_sharing.py process of item 7: ``mode``'s engines started once for
    ``repeats`` repetitions from ``first_rep``; with ``policies``, the shared engines switch
    between those share policies in each repetition, each policy one of ``modes``."""

    mode: str
    first_rep: int
    repeats: int
    policies: tuple[str, ...] = ()

    @property
    def modes(self) -> tuple[str, ...]:
        return self.policies or (self.mode,)

    @property
    def name(self) -> str:
        """Of its JSON and log files."""
        return f"{'+'.join(self.modes)}_{self.first_rep}"

    @property
    def reps(self) -> str:
        """Its repetitions, counted from 1: ``1`` or ``1-3``."""
        last = self.first_rep + self.repeats
        return str(last) if self.repeats == 1 else f"{self.first_rep + 1}-{last}"

    @property
    def tag(self) -> str:
        """Its modes and repetitions, e.g. ``fair 2`` or ``first-come+fair 1-3``."""
        return f"{'+'.join(self.modes)} {self.reps}"


def sharing_invocations(modes: list[str], repeats: int, starts: str) -> list[SharingInvocation]:
    """Item 7's processes. ``each``: one per mode and repetition, the modes interleaved (as
    given, reversed, ...), so drift hits each mode alike, at one start of N engines per
    process. ``once``: one start per mode for all repetitions, first-come and fair on the
    same engines (switched per repetition: interleaved pairs, bench_sharing.py --policies),
    the modes in the order given: the device time of a few starts, for drift between the
    modes' starts."""
    if starts == "each":
        return [SharingInvocation(mode, rep, 1)
                for rep in range(repeats) for mode in sharing_order(modes, rep)]
    pair = tuple(m for m in modes if m in ("first-come", "fair"))
    out: list[SharingInvocation] = []
    for mode in modes:
        if len(pair) == 2 and mode in pair:
            if mode == pair[0]:
                out.append(SharingInvocation("fair", 0, repeats, pair))
        else:
            out.append(SharingInvocation(mode, 0, repeats))
    return out


def _runs_of(result: dict, mode: str, inv: SharingInvocation) -> dict:
    """A bench_sharing.py result as ``mode``'s: of a process that switched policies, the
    repetitions of that policy, and the one-engine-busy rounds (run at the start, under
    the process's own mode) for that mode only."""
    if not inv.policies:
        return result
    return result | {"mode": mode,
                     "runs": [r for r in result["runs"] if r.get("policy") == mode],
                     "single": result.get("single", []) if mode == inv.mode else []}


def item_sharing(runner: Runner, prof: dict, out: Path, device: str, stock_path: str | None,
                 kvcached_env: list[str], modes_text: str | None = None,
                 options: dict | None = None) -> dict:
    """scripts/bench/bench_sharing.py per :func:`sharing_invocations` (once per mode and
    repetition, the modes interleaved, or one start per mode): N engines on one device
    behind their own servers; static split (stock), shared VMM KV (this series: first come
    first served and fair) and kvcached where it is installed. ``options``: workloads,
    repeats, seed, kv_capacity_bytes, weights, starts (bench.py's --sharing-* options)."""
    from bench_sharing import (SINGLE_REPEATS, kvcached_missing, kvcached_utilization,
                               parse_workloads)

    opts = options or {}
    modes = sharing_modes(modes_text, device)
    sharing = prof["sharing"]
    workloads_text = opts.get("workloads") or sharing.get("workloads", SHARING_WORKLOADS)
    workloads = parse_workloads(workloads_text)
    repeats = opts.get("repeats") or sharing["repeats"]
    seed = opts.get("seed", 0)
    capacity = opts.get("kv_capacity_bytes")
    model = model_dir(sharing["model"], out)
    result: dict = {"model": sharing["model"], "engines": sharing["engines"], "modes": {},
                    "workloads": [w["name"] for w in workloads], "seed": seed,
                    "repeats": repeats, "weights": opts.get("weights"), "order": []}
    if capacity:
        result["kv_capacity"] = {"bytes": capacity, "source": "given (--sharing-kv-capacity)"}
    if "kvcached" in modes:
        why = kvcached_missing(kvcached_server_env(runner.env, stock_path, kvcached_env))
        if why:
            modes.remove("kvcached")
            result["modes"]["kvcached"] = {"not_installed": why}
            print(f"sharing: kvcached not installed: {why}", flush=True)
            if modes_text is not None:  # asked for by name: the run fails
                runner.failures.append(f"sharing: kvcached: not installed: {why}")
    if not modes:
        return result | {"not_measured": "no mode to run (kvcached not installed)"}
    check_sharing(modes, workloads, capacity)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    static: dict | None = None  # the latest static run's result
    for inv in sharing_invocations(modes, repeats, opts.get("starts", "each")):
        if any(m in failed for m in inv.modes):
            continue
        if inv.mode == "kvcached" and capacity is None and any(w["kind"] == "over"
                                                               for w in workloads):
            failed[inv.mode] = ("no KV capacity measured before it (the modes before it "
                                "failed): give --sharing-kv-capacity")
            runner.failures.append(f"sharing: kvcached: {failed[inv.mode]}")
            continue
        js = out / f"sharing_{inv.name}.json"
        log = runner.logs / f"sharing_{inv.name}.log"
        # Each start gets its share of the one-engine-busy rounds.
        single_rounds = -(-SINGLE_REPEATS // repeats) * inv.repeats
        cmd = [sys.executable, str(SHARING_SCRIPT), "--mode", inv.mode, "--model", model,
               "--engines", str(sharing["engines"]), "--device", device,
               "--repeats", str(inv.repeats), "--first-rep", str(inv.first_rep),
               "--single-rounds", str(single_rounds), "--workloads", workloads_text,
               "--seed", str(seed), "--json", str(js), "--logs", str(runner.logs)]
        if inv.policies:
            cmd += ["--policies", ",".join(inv.policies)]
        if capacity:
            cmd += ["--kv-capacity-bytes", str(capacity)]
            if device == "cuda" and inv.mode not in ("static", "kvcached"):
                # The same KV memory as the static split, not what the shared
                # engines would measure (bench_sharing.py: --shared-kv-bytes).
                cmd += ["--shared-kv-bytes", str(capacity)]
        if opts.get("weights"):
            cmd += ["--weights", opts["weights"]]
        if stock_path and inv.mode in ("static", "kvcached"):
            cmd += ["--python-path", stock_path]
        if inv.mode == "kvcached":
            # Held to the static split's KV memory where a static run measured its use
            # (an --kvcached-env of the same key, after it, wins).
            util = kvcached_utilization(static) if static else None
            if util:
                cmd += ["--env", f"KVCACHED_GPU_UTILIZATION={util[0]}"]
                result["kvcached_utilization"] = {"value": util[0], "source": util[1]}
            cmd += [a for kv in kvcached_env for a in ("--env", kv)]
        for key, value in sharing.get("set", {}).items():
            cmd += ["--set", f"{key}={json.dumps(value)}"]
        print(f"sharing: {'+'.join(inv.modes)}, repetition {inv.reps}/{repeats}, "
              f"{sharing['engines']} engines", flush=True)
        r, why = runner.run_json(f"sharing: {inv.tag}", cmd, js, log, sharing["timeout_s"])
        if r is None:
            for m in inv.modes:
                failed[m] = f"repetition {inv.reps}: {(why or 'no results')[:300]}"
            continue
        for m in inv.modes:
            runs[m].append(_runs_of(r, m, inv))
        if inv.mode == "static":
            static = r
        result["order"].append(inv.tag)
        result["workload"] = r["profile"]
        if capacity is None and r.get("kv_capacity_bytes"):
            capacity = r["kv_capacity_bytes"]
            result["kv_capacity"] = {"bytes": capacity, "source": f"measured by the "
                                     f"{inv.mode} engines: {r['capacity_source']}"}
        if r.get("kv_bytes_per_token"):
            result["kv_bytes_per_token"] = r["kv_bytes_per_token"]
    for mode in modes:
        if runs[mode]:
            result["modes"][mode] = aggregate_sharing(runs[mode])
            if mode in failed:
                result["modes"][mode]["stopped"] = failed[mode]
        else:
            result["modes"][mode] = {"not_measured": failed.get(mode, "not run")}
    return result
