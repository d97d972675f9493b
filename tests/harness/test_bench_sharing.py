"""Item 7's workload and summary without vLLM: the peaks are replayed from the seed, each
engine's peak comes in its own window, the static split divides the share, p99 and
throughput come from the requests, and the report puts the three modes side by side
(tests/engine/test_bench_sharing.py runs the item on real CPU engines)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts")]

import bench_sharing as bs  # noqa: E402
from bench_report import render_results  # noqa: E402

PROF = {**bs.PROFILES["cuda"], "background_rate": 0.5, "peak_rate": 10.0, "peak_s": 4.0,
        "stagger_s": 10.0, "prompt_len": 8}


def test_the_peaks_replay_from_the_seed_and_come_in_turn():
    plan = bs.schedule(PROF, 3, seed=0, rep=1, vocab=1000)
    assert plan == bs.schedule(PROF, 3, seed=0, rep=1, vocab=1000)
    assert plan != bs.schedule(PROF, 3, seed=0, rep=2, vocab=1000)
    assert [t for t, _, _ in plan] == sorted(t for t, _, _ in plan)
    assert all(100 <= tok < 1000 and len(p) == 8 for _, _, p in plan for tok in p)
    for engine in range(3):
        start = engine * PROF["stagger_s"]
        inside = [t for t, e, _ in plan if e == engine and start <= t < start + PROF["peak_s"]]
        outside = [t for t, e, _ in plan if e == engine and not start <= t < start + 4.0]
        # About 40 arrivals in the peak's 4 s, about 0.5/s outside it.
        assert 20 <= len(inside) <= 65, (engine, len(inside))
        assert len(outside) <= 0.5 * 24 * 3, (engine, len(outside))
    horizon = 2 * PROF["stagger_s"] + PROF["peak_s"]
    assert max(t for t, _, _ in plan) < horizon


def test_modes_split_or_share_the_device():
    backend, args, env = bs.mode_settings("static", "cuda", PROF, 3)
    assert backend is None and args == {"gpu_memory_utilization": 0.3} and env == {}
    backend, args, _ = bs.mode_settings("shared", "cuda", PROF, 3)
    assert backend == "vmm" and args["kv_cache_vmm_shared"]
    assert args["gpu_memory_utilization"] == PROF["share"]
    cpu = bs.PROFILES["cpu"]
    _, args, _ = bs.mode_settings("static", "cpu", cpu, 2)
    assert args == {"kv_cache_memory_bytes": cpu["share"] // 2}
    _, args, _ = bs.mode_settings("shared", "cpu", cpu, 2)
    assert args["kv_cache_memory_bytes"] == args["kv_cache_vmm_shared_bytes"] == cpu["share"]
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bs.mode_settings("kvcached", "cpu", cpu, 2)


def test_summary_of_one_run():
    rng = random.Random(0)
    results = [{"engine": i % 2, "ttft_s": (i + 1) / 100, "tokens": 10, "sent_s": i * 0.1,
                "done_s": i * 0.1 + 1.0, "total_s": 1.0} for i in range(100)]
    rng.shuffle(results)
    s = bs.summarize_run(results)
    assert s["requests"] == 100
    assert s["ttft_mean_ms"] == pytest.approx(505.0)
    assert s["ttft_p99_ms"] == pytest.approx(990.0)
    assert s["output_tok_s"] == pytest.approx(1000 / (9.9 + 1.0))
    assert s["per_engine"]["1"]["requests"] == 50
    with pytest.raises(SystemExit, match="1 of 2 requests failed"):
        bs.summarize_run([results[0], {"error": "HTTP 500"}])


def _mode(mean: float, p99: float, tok_s: float, single: float, path=None) -> dict:
    def spread(x: float) -> dict:
        return {"median": x, "min": x * 0.9, "max": x * 1.1, "runs": [x * 0.9, x, x * 1.1]}

    return {"peaks_ttft_mean_ms": spread(mean), "peaks_ttft_p99_ms": spread(p99),
            "peaks_output_tok_s": spread(tok_s), "single_output_tok_s": spread(single),
            "health_s": [50.0], "engine": {}, "env": {}, "python_path": path}


def test_report_puts_the_modes_side_by_side():
    run = {"date": "d", "vllm": "0.21.0", "torch": "t", "python": "3.12", "cpu_count": 16,
           "command": "python3 scripts/bench/bench.py --items sharing", "gpu": "GPU",
           "device": "cuda"}
    data = {"model": "Llama-3.1-8B-Instruct", "engines": 3, "run": run,
            "workload": {**PROF, "single_num": 32, "single_prompt_len": 512},
            "modes": {"static": _mode(2000.0, 8000.0, 1000.0, 1500.0, "/stock"),
                      "shared": _mode(400.0, 1500.0, 1200.0, 1470.0),
                      "kvcached": _mode(500.0, 2000.0, 1100.0, 1400.0, "/stock")}}
    md = render_results({"items": {"sharing": data}})
    row = next(line for line in md.splitlines() if "peaks: TTFT mean" in line)
    assert "| 0.200 | <= 0.5 | pass |" in row
    single = next(line for line in md.splitlines() if "one engine busy" in line)
    assert "| 0.980 | >= 0.97 | pass |" in single
    assert "shared VMM / kvcached 0.800" in md and "stock vLLM from `--stock-path`" in md
    data["modes"]["kvcached"] = {"not_measured": "exit 1: no kvcached"}
    md = render_results({"items": {"sharing": data}})
    assert "kvcached not measured: exit 1: no kvcached" in md


def test_the_one_engine_busy_ttft_row_needs_it_in_every_measured_mode():
    run = {"date": "d", "vllm": "0.21.0", "torch": "t", "python": "3.12", "cpu_count": 16,
           "command": "python3 scripts/bench/bench.py --items sharing", "gpu": "GPU",
           "device": "cuda"}
    modes = {"static": _mode(2000.0, 8000.0, 1000.0, 1500.0, "/stock"),
             "shared": _mode(400.0, 1500.0, 1200.0, 1470.0)}
    for m, ttft in zip(modes.values(), (300.0, 450.0)):
        m["single_ttft_mean_ms"] = {"median": ttft, "min": ttft, "max": ttft, "runs": [ttft]}
    data = {"model": "Llama-3.1-8B-Instruct", "engines": 3, "run": run, "modes": modes}
    md = render_results({"items": {"sharing": data}})
    row = next(line for line in md.splitlines() if "one engine busy: TTFT mean" in line)
    assert "| 300.0 [300.0..300.0] | 450.0 [450.0..450.0] | 1.500 |" in row
    # Results from before the statistic was recorded: no row, no error.
    del modes["static"]["single_ttft_mean_ms"]
    md = render_results({"items": {"sharing": data}})
    assert "one engine busy: TTFT mean" not in md and "one engine busy: output" in md


def test_sharing_modes_run_in_the_order_given():
    from bench_items import sharing_modes

    assert sharing_modes(None, "cuda") == ["static", "shared", "kvcached"]
    assert sharing_modes(None, "cpu") == ["static", "shared"]
    assert sharing_modes("shared, kvcached,static", "cuda") == ["shared", "kvcached", "static"]
    assert sharing_modes("shared", "cpu") == ["shared"]
    for bad in ("shared,shared", "kvcached", "", "static,bogus"):
        with pytest.raises(SystemExit, match="--sharing-modes"):
            sharing_modes(bad, "cpu")
