"""Item 7's workloads and figures without vLLM: the peaks and the over-subscribed workloads
are replayed from the seed and ask for the KV demand they name, the static split divides the
share, p99, throughput, failures and preemptions come from the requests and the engines'
metrics, the repetitions of each mode are interleaved and aggregated with their spread, and
the report puts the modes side by side (tests/engine/test_bench_sharing.py runs the item on
real CPU engines). The suite's item runs here against a stand-in for its processes
(bench_sharing.py needs vLLM servers)."""

from __future__ import annotations

import json
import os
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
    kv = PROF["kv_bytes"]
    assert kv == 18 << 30
    backend, args, env = bs.mode_settings("static", "cuda", PROF, 3)
    assert backend is None and env == {}
    assert args == {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": kv // 3}
    loose = PROF | {"kv_bytes": None}  # --set kv_bytes=null: what the share leaves
    assert bs.mode_settings("static", "cuda", loose, 3)[1] == {"gpu_memory_utilization": 0.3}
    for mode, policy in (("first-come", "first-come"), ("fair", "fair"), ("shared", None)):
        backend, args, _ = bs.mode_settings(mode, "cuda", PROF, 3)
        assert backend == "vmm" and args["kv_cache_vmm_shared"]
        assert args.get("kv_cache_vmm_share_policy") == policy
        assert args["gpu_memory_utilization"] == PROF["share"]
        assert args["kv_cache_vmm_shared_bytes"] == kv  # the same KV memory as the split
        _, args, _ = bs.mode_settings(mode, "cuda", PROF, 3, shared_kv_bytes=5 << 30)
        assert args["kv_cache_vmm_shared_bytes"] == 5 << 30
        _, args, _ = bs.mode_settings(mode, "cuda", loose, 3)
        assert "kv_cache_vmm_shared_bytes" not in args  # measured by the engines
    cpu = bs.PROFILES["cpu"]
    _, args, _ = bs.mode_settings("static", "cpu", cpu, 2)
    assert args == {"kv_cache_memory_bytes": cpu["share"] // 2}
    _, args, _ = bs.mode_settings("fair", "cpu", cpu, 2)
    assert args["kv_cache_memory_bytes"] == args["kv_cache_vmm_shared_bytes"] == cpu["share"]
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bs.mode_settings("kvcached", "cpu", cpu, 2)


def test_the_flags_reach_the_server_command_line(tmp_path):
    """The engine arguments of a fair engine with a weight become exactly the flags
    ``--kv-cache-vmm-shared --kv-cache-vmm-share-policy fair --kv-cache-vmm-share-weight 2``
    (the command is written to the log before the server starts)."""
    from bench_server import Server

    _, args, _ = bs.mode_settings("fair", "cpu", bs.PROFILES["cpu"], 2)
    log = tmp_path / "s.log"
    server = Server("/nonexistent", "vmm", args | {"kv_cache_vmm_share_weight": 2.0}, log,
                    {"PATH": os.environ["PATH"]}, env={"PYTHONPATH": str(tmp_path)})
    server.stop()
    cmd = log.read_text().splitlines()[0]
    assert ("--kv-cache-memory-backend vmm" in cmd and " --kv-cache-vmm-shared " in cmd
            and "--kv-cache-vmm-share-policy fair" in cmd
            and "--kv-cache-vmm-share-weight 2.0" in cmd)


def test_summary_of_one_run():
    rng = random.Random(0)
    results = [{"engine": i % 2, "ttft_s": (i + 1) / 100, "tokens": 10, "sent_s": i * 0.1,
                "done_s": i * 0.1 + 1.0, "total_s": 1.0} for i in range(100)]
    rng.shuffle(results)
    s = bs.summarize_run(results)
    assert s["requests"] == 100 and s["failed"] == 0 and s["first_error"] is None
    assert s["ttft_mean_ms"] == pytest.approx(505.0)
    assert s["ttft_p99_ms"] == pytest.approx(990.0)
    assert s["output_tok_s"] == pytest.approx(1000 / (9.9 + 1.0))
    odd = s["per_engine"]["1"]
    assert odd["requests"] == 50 and odd["ttft_mean_ms"] == pytest.approx(510.0)
    assert odd["ttft_p99_ms"] == pytest.approx(1000.0)
    assert odd["output_tok_s"] == pytest.approx(500 / (9.9 - 0.1 + 1.0))


def test_failed_requests_are_counted_per_engine_with_the_first_error():
    ok = {"engine": 0, "ttft_s": 0.2, "tokens": 4, "sent_s": 0.0, "done_s": 1.0}
    failed = [{"engine": 1, "error": "HTTP 500: b'Cannot get 96 free blocks'", "sent_s": 0.5,
               "done_s": 0.6},
              {"engine": 1, "error": "ConnectionRefusedError", "sent_s": 0.7, "done_s": 0.7},
              {"engine": 0, "error": "later", "sent_s": 2.0, "done_s": 2.0}]
    s = bs.summarize_run([ok, *failed])
    assert s["requests"] == 4 and s["failed"] == 3
    assert s["first_error"] == "HTTP 500: b'Cannot get 96 free blocks'"
    assert s["ttft_mean_ms"] == pytest.approx(200.0) and s["output_tok_s"] == 4.0
    e1 = s["per_engine"]["1"]
    # An engine none of whose requests completed: no figures, but its failures.
    assert e1["failed"] == 2 and e1["ttft_mean_ms"] is e1["output_tok_s"] is None
    assert e1["first_error"].startswith("HTTP 500")
    assert s["per_engine"]["0"]["failed"] == 1


def test_kv_bytes_per_token_from_the_model_config():
    llama = json.loads((ROOT / "ci/hf-models/meta-llama/Llama-3.1-8B-Instruct/config.json")
                       .read_text())
    # 32 layers x (K + V) x 8 KV heads x 128 x 2 bytes (bfloat16).
    assert bs.kv_bytes_per_token(llama) == 32 * 2 * 8 * 128 * 2 == 128 << 10
    assert bs.kv_bytes_per_token(llama, "fp8") == 64 << 10
    tiny = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 2, "torch_dtype": "float32"}
    assert bs.kv_bytes_per_token(tiny) == 2 * 2 * 2 * 64 * 4
    mla = {"num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "num_attention_heads": 16, "hidden_size": 2048, "torch_dtype": "bfloat16"}
    assert bs.kv_bytes_per_token(mla) == 3 * 576 * 2
    with pytest.raises(SystemExit, match="kv_bytes_per_token"):
        bs.kv_bytes_per_token({**tiny, "torch_dtype": "int3"})


def test_workload_names():
    peak, over, custom = bs.parse_workloads("peak, over1.5,over3@1/0.5/0")
    assert peak == {"name": "peak", "kind": "peak"}
    assert over == {"name": "over1.5", "kind": "over", "ratio": 1.5,
                    "overlaps": list(bs.DEFAULT_OVERLAPS)}
    assert custom["ratio"] == 3.0 and custom["overlaps"] == [1.0, 0.5, 0.0]
    for bad in ("", "over", "over0", "over2@1.5", "over2@", "burst", "peak,peak", "over-1"):
        with pytest.raises(SystemExit, match="workload"):
            bs.parse_workloads(bad)


OVER = {**bs.PROFILES["cuda"], "over_prompt_len": 1000, "over_output_len": 24,
        "over_peak_s": 4.0, "over_background_rate": 0.5}


@pytest.mark.parametrize("ratio", [1.5, 3.0])
@pytest.mark.parametrize("engines,capacity", [(3, 20 << 30), (2, 5 << 30), (4, 123456789)])
def test_over_subscribed_workloads_ask_for_their_ratio_of_the_capacity(ratio, engines,
                                                                         capacity):
    bpt = 128 << 10 if capacity > 1 << 30 else 2048
    w = bs.parse_workloads(f"over{ratio}")[0]
    plan, info = bs.over_schedule(OVER, engines, 7, 2, 1000, w, capacity, bpt)
    request = (OVER["over_prompt_len"] + OVER["over_output_len"]) * bpt
    peak = sum(info["peak_requests"])
    # The peaks' KV demand is the ratio of the capacity to within half a request.
    assert info["demand_bytes"] == peak * request
    assert abs(info["demand_bytes"] - ratio * capacity) <= request / 2
    assert info["demand_ratio"] == pytest.approx(ratio, abs=request / 2 / capacity)
    # Split evenly, and the plan holds exactly the peaks and the background.
    assert max(info["peak_requests"]) - min(info["peak_requests"]) <= 1
    assert len(plan) == peak + info["background_requests"]
    assert [t for t, _, _ in plan] == sorted(t for t, _, _ in plan)
    assert all(len(p) == OVER["over_prompt_len"] and all(100 <= x < 1000 for x in p)
               for _, _, p in plan)
    # Replayed from the seed and the repetition; another repetition or seed differs.
    assert (plan, info) == bs.over_schedule(OVER, engines, 7, 2, 1000, w, capacity, bpt)
    assert plan != bs.over_schedule(OVER, engines, 7, 3, 1000, w, capacity, bpt)[0]
    assert plan != bs.over_schedule(OVER, engines, 8, 2, 1000, w, capacity, bpt)[0]


def test_over_subscribed_peaks_overlap_by_the_given_fractions():
    w = bs.parse_workloads("over3@1/0.5/0")[0]
    plan, info = bs.over_schedule({**OVER, "over_background_rate": 0.0}, 5, 0, 0, 1000, w,
                                  20 << 30, 128 << 10)
    window = OVER["over_peak_s"]
    starts = info["peak_starts_s"]
    assert info["overlaps"] == [1.0, 0.5, 0.0, 1.0] and info["background_requests"] == 0
    for i, overlap in enumerate(info["overlaps"]):
        shared = max(0.0, starts[i] + window - starts[i + 1])
        assert shared == pytest.approx(overlap * window)
    for engine in range(5):
        times = [t for t, e, _ in plan if e == engine]
        assert len(times) == info["peak_requests"][engine]
        assert all(starts[engine] <= t < starts[engine] + window for t in times)
    # The default: 3/4 between engines 0 and 1, 1/4 between 1 and 2.
    _, info = bs.over_schedule(OVER, 3, 0, 0, 1000, bs.parse_workloads("over1.5")[0],
                               20 << 30, 128 << 10)
    assert info["peak_starts_s"] == [0.0, 0.25 * window, 0.25 * window + 0.75 * window]


def test_over_subscribed_workloads_refuse_what_cannot_be_sized():
    w = bs.parse_workloads("over1.5")[0]
    with pytest.raises(SystemExit, match="fewer than one per engine"):
        bs.over_schedule(OVER, 3, 0, 0, 1000, w, 1 << 20, 128 << 10)
    with pytest.raises(SystemExit, match="max_model_len"):
        bs.over_schedule({**OVER, "over_prompt_len": 5000}, 3, 0, 0, 1000, w, 20 << 30, 1)
    with pytest.raises(SystemExit, match="must be positive"):
        bs.over_schedule(OVER, 3, 0, 0, 1000, w, 0, 1)


METRICS = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="1000",prefix="a \\"quoted\\" one"} 1.0
vllm:kv_cache_vmm_ledger_bytes{device="0",engine="0",ledger_engine="",quantity="capacity"} 2.5e+10
vllm:kv_cache_vmm_ledger_bytes{device="0",engine="0",ledger_engine="e1 (pid 9)",quantity="mapped"} 1e+09
"""


def test_preemptions_and_the_kv_capacity_come_from_the_engines_metrics():
    assert bs.preemptions(METRICS) == 7.0
    assert bs.preemptions("vllm:other 1\n") is None and bs.preemptions(None) is None
    cap, how = bs.capacity_from_metrics("static", [METRICS, METRICS.replace('"1000"', '"500"')],
                                        100)
    assert cap == (1000 + 500) * 16 * 100 and "1500" not in how and "24000 tokens" in how
    other = METRICS.replace("2.5e+10", "2.0e+10")
    for mode in ("fair", "first-come", "shared"):
        assert bs.capacity_from_metrics(mode, [METRICS, other], 100)[0] == 20_000_000_000
    with pytest.raises(SystemExit, match="--kv-capacity-bytes"):
        bs.capacity_from_metrics("kvcached", [METRICS], 100)
    with pytest.raises(SystemExit, match="did not answer"):
        bs.capacity_from_metrics("static", [METRICS, None], 100)
    with pytest.raises(SystemExit, match="no ledger capacity"):
        bs.capacity_from_metrics("fair", ["vllm:x 1"], 100)


def _mode(mean: float, p99: float, tok_s: float, single: float, path=None) -> dict:
    """A mode as results from before the workloads recorded it (peaks_*)."""
    def spread(x: float) -> dict:
        return {"median": x, "min": x * 0.9, "max": x * 1.1, "runs": [x * 0.9, x, x * 1.1]}

    return {"peaks_ttft_mean_ms": spread(mean), "peaks_ttft_p99_ms": spread(p99),
            "peaks_output_tok_s": spread(tok_s), "single_output_tok_s": spread(single),
            "health_s": [50.0], "engine": {}, "env": {}, "python_path": path}


RUN = {"date": "d", "vllm": "0.21.0", "torch": "t", "python": "3.12", "cpu_count": 16,
       "command": "python3 scripts/bench/bench.py --items sharing", "gpu": "GPU",
       "device": "cuda"}


def _row(md: str, *words: str) -> str:
    return next(line for line in md.splitlines()
                if line.startswith("| 7 ") and all(w in line for w in words))


def test_results_from_before_the_workloads_still_render():
    data = {"model": "Llama-3.1-8B-Instruct", "engines": 3, "run": RUN,
            "workload": {**PROF, "single_num": 32, "single_prompt_len": 512},
            "modes": {"static": _mode(2000.0, 8000.0, 1000.0, 1500.0, "/stock"),
                      "shared": _mode(400.0, 1500.0, 1200.0, 1470.0),
                      "kvcached": _mode(500.0, 2000.0, 1100.0, 1400.0, "/stock")}}
    md = render_results({"items": {"sharing": data}})
    assert "| 0.200 | <= 0.5 | pass |" in _row(md, "peak: TTFT mean", "shared VMM / static")
    assert "| 0.980 | >= 0.97 | pass |" in _row(md, "one engine busy: output")
    assert "| 0.800 | <= 1.0 | pass |" in _row(md, "shared VMM / kvcached")
    assert "shared VMM / kvcached 0.800" in md and "stock vLLM from `--stock-path`" in md
    data["modes"]["kvcached"] = {"not_measured": "exit 1: no kvcached"}
    md = render_results({"items": {"sharing": data}})
    assert "kvcached not measured: exit 1: no kvcached" in md


def test_the_one_engine_busy_ttft_row_needs_it_in_every_measured_mode():
    modes = {"static": _mode(2000.0, 8000.0, 1000.0, 1500.0, "/stock"),
             "shared": _mode(400.0, 1500.0, 1200.0, 1470.0)}
    for m, ttft in zip(modes.values(), (300.0, 450.0)):
        m["single_ttft_mean_ms"] = {"median": ttft, "min": ttft, "max": ttft, "runs": [ttft]}
    data = {"model": "Llama-3.1-8B-Instruct", "engines": 3, "run": RUN, "modes": modes}
    md = render_results({"items": {"sharing": data}})
    row = _row(md, "one engine busy: TTFT mean")
    assert "| 300.0 [300.0..300.0] | 450.0 [450.0..450.0] | 1.500 |" in row
    # Results from before the statistic was recorded: no row, no error.
    del modes["static"]["single_ttft_mean_ms"]
    md = render_results({"items": {"sharing": data}})
    assert "one engine busy: TTFT mean" not in md and "one engine busy: output" in md


def test_sharing_modes_run_in_the_order_given_then_reversed():
    from bench_items import sharing_modes, sharing_order

    assert sharing_modes(None, "cuda") == ["static", "first-come", "fair", "kvcached"]
    assert sharing_modes(None, "cpu") == ["static", "first-come", "fair"]
    assert sharing_modes("fair, kvcached,static", "cuda") == ["fair", "kvcached", "static"]
    assert sharing_modes("shared", "cpu") == ["shared"]
    for bad in ("fair,fair", "kvcached", "", "static,bogus"):
        with pytest.raises(SystemExit, match="--sharing-modes"):
            sharing_modes(bad, "cpu")
    modes = ["static", "first-come", "fair"]
    assert [sharing_order(modes, r) for r in range(3)] == [modes, modes[::-1], modes]


def _invocation(mode: str, rep: int, ttft: float, failed: int = 0, capacity=None) -> dict:
    """bench_sharing.py's JSON of one repetition: two workloads, two engines."""
    def run(scale: float, preempted: int) -> dict:
        engines = {str(e): {"requests": 10, "failed": failed if e == 1 else 0,
                            "first_error": "HTTP 500: boom" if failed and e == 1 else None,
                            "ttft_mean_ms": ttft * scale * (e + 1),
                            "ttft_p99_ms": 3 * ttft * scale * (e + 1),
                            "output_tok_s": 100.0, "preemptions": preempted + e}
                   for e in range(2)}
        return {"requests": 20, "failed": failed, "first_error": "HTTP 500: boom" if failed
                else None, "ttft_mean_ms": ttft * scale, "ttft_p99_ms": 4 * ttft * scale,
                "output_tok_s": 200.0 + rep, "preemptions": 2 * preempted + 1,
                "per_engine": engines,
                "plan": {"ratio": 3.0, "overlaps": [0.75], "peak_requests": [5, 5],
                         "prompt_len": 1000, "output_len": 24, "demand_ratio": 3.01}
                if scale > 1 else {}}

    return {"mode": mode, "first_rep": rep, "health_s": [10.0, 11.0],
            "runs": [{"rep": rep, "workloads": {"peak": run(1, 0), "over3": run(2, rep)}}],
            "single": [{"output_tok_s": 1000.0 + rep, "ttft_mean_ms": 50.0, "failed": 0},
                       {"output_tok_s": 1100.0 + rep, "ttft_mean_ms": 60.0, "failed": 0}],
            "engine_deaths": {"1": "engine 1 died (exit status 1); log x: ValueError"}
            if failed else {},
            "engine": {"kv_cache_vmm_shared": mode != "static"}, "env": {},
            "python_path": None, "profile": {**bs.PROFILES["cuda"]}, "kv_bytes_per_token": 4,
            "kv_capacity_bytes": capacity, "capacity_source": "measured" if capacity else None}


def test_a_modes_repetitions_are_aggregated_with_their_raw_figures():
    from bench_items import aggregate_sharing

    m = aggregate_sharing([_invocation("fair", r, 100.0 * (r + 1), failed=r) for r in range(3)])
    assert m["repetitions"] == [0, 1, 2]
    over = m["workloads"]["over3"]
    assert over["reps"] == [0, 1, 2]
    assert over["ttft_mean_ms"] == {"median": 400.0, "min": 200.0, "max": 600.0,
                                    "runs": [200.0, 400.0, 600.0]}
    assert over["ttft_p99_ms"]["median"] == 1600.0
    assert over["output_tok_s_runs"] == [200.0, 201.0, 202.0]
    assert over["failed_runs"] == [0, 1, 2] and over["failed_total"] == 3
    assert over["first_error"] == "repetition 1: HTTP 500: boom"
    assert over["preemptions_runs"] == [1, 3, 5] and over["plan"][0]["ratio"] == 3.0
    e1 = over["per_engine"]["1"]
    assert e1["ttft_mean_ms"]["runs"] == [400.0, 800.0, 1200.0]
    assert e1["preemptions_runs"] == [1, 2, 3] and e1["failed_total"] == 3
    assert m["single_output_tok_s"]["runs"] == [1000.0, 1100.0, 1001.0, 1101.0, 1002.0, 1102.0]
    assert m["health_s"] == [10.0, 11.0] * 3
    assert len(m["engine_deaths"]) == 2 and m["engine_deaths"][0].startswith("repetition 1")
    # A workload none of whose requests completed in a repetition: None there, no error.
    inv = _invocation("fair", 0, 100.0)
    inv["runs"][0]["workloads"]["peak"].update(ttft_mean_ms=None, ttft_p99_ms=None,
                                               output_tok_s=None)
    m = aggregate_sharing([inv, _invocation("fair", 1, 300.0)])
    assert m["workloads"]["peak"]["ttft_mean_ms"]["runs"] == [300.0]


def _measured(ttft: float, failed: int = 0, path=None) -> dict:
    from bench_items import aggregate_sharing

    m = aggregate_sharing([_invocation("x", r, ttft * (1 + r / 10), failed=failed)
                           for r in range(3)])
    return m | {"python_path": path}


def test_report_compares_fair_and_first_come_with_the_static_split_per_workload():
    modes = {"static": _measured(1000.0, path="/stock"), "first-come": _measured(400.0),
             "fair": _measured(300.0), "kvcached": {"not_installed": "kvcached is not "
                                                     "importable by the servers' Python"}}
    data = {"model": "Llama-3.1-8B-Instruct", "engines": 2, "run": RUN, "modes": modes,
            "workload": {**bs.PROFILES["cuda"]}, "seed": 5, "order": ["static 1", "fair 1"],
            "kv_capacity": {"bytes": 20 << 30, "source": "measured by the static engines"},
            "kv_bytes_per_token": 131072}
    md = render_results({"items": {"sharing": data}})
    # fair / static, the spread over the paired repetitions (equal here).
    row = _row(md, "over3 (peaks 3.01x the KV capacity", "TTFT mean", "fair shared / static")
    assert "| 0.300 [0.300..0.300], n=3 | <= 0.5 | pass |" in row
    assert "| <= 0.5 | pass |" in _row(md, "over3", "TTFT p99", "fair shared / static")
    assert "| 0.400 [0.400..0.400], n=3 |" in _row(md, "over3", "TTFT mean",
                                                    "first-come shared / static")
    assert "| 0.750 [0.750..0.750], n=3 | < 1.0 | pass |" in _row(
        md, "over3", "fair / first-come")
    # On the peak workload the p99 has no target (the mean has), and no fair/first-come row.
    assert "|  |  |" in _row(md, "peak:", "TTFT p99", "fair shared / static")
    assert not any("peak: TTFT p99 (ms), fair / first-come" in line for line in md.splitlines())
    assert "| 0 | 0 |  | <= 0 | pass |" in _row(md, "over3", "requests failed, fair shared")
    assert "| >= 0.97 |" in _row(md, "one engine busy: output tokens/s")
    assert "not installed: kvcached is not importable" in _row(md, "kvcached")
    assert "KV capacity 20.00 GiB (measured by the static engines" in md
    # The engines' KV memory, fixed on a GPU whatever the card, in the setup line.
    assert ("split statically (`--gpu-memory-utilization` 0.9/N, `--kv-cache-memory-bytes` "
            "18 GiB/N); shared = every engine `--kv-cache-vmm-shared` with the whole share "
            "and a ledger of 18 GiB (`--kv-cache-vmm-shared-bytes`)") in md
    assert "seed 5, modes in the order static 1, fair 1" in md
    # Per repetition: failed requests and preemptions of every mode, per engine TTFT.
    detail = next(line for line in md.splitlines() if line.startswith("- 7") and "over3, per "
                  "repetition" in line)
    assert "fair shared: failed 0/0/0 of 20/20/20 requests, preemptions 1/3/5" in detail
    # kvcached beside them: against the static split on every workload, and fair against
    # it on the peaks (no worse).
    modes["kvcached"] = _measured(500.0)
    md = render_results({"items": {"sharing": data}})
    assert "| 0.500 [0.500..0.500], n=3 |" in _row(md, "over3", "TTFT p99", "kvcached / static")
    assert "| 0.600 [0.600..0.600], n=3 | <= 1.0 | pass |" in _row(
        md, "peak: TTFT mean", "fair shared / kvcached")
    # Fair with failed requests (and a dead engine) fails its row, with the error shown.
    modes["fair"] = _measured(300.0, failed=2)
    md = render_results({"items": {"sharing": data}})
    assert "| 0 | 6 |  | <= 0 | FAIL |" in _row(md, "over3", "requests failed, fair shared")
    assert "first error, repetition 0: HTTP 500: boom" in md
    assert "fair shared: an engine died, repetition 0: engine 1 died" in md
    # Fair no better than first-come at p99: FAIL.
    modes["first-come"] = _measured(300.0)
    md = render_results({"items": {"sharing": data}})
    assert "| 1.000 [1.000..1.000], n=3 | < 1.0 | FAIL |" in _row(md, "over3",
                                                                  "fair / first-come")


class StandInSharing:
    """Runner for item 7 without servers: each bench_sharing.py command writes the JSON that
    the mode's figures make (fair 300 ms, first-come 400, static 1000); the static engines
    measure the KV capacity. Records the commands; a mode in ``fail`` fails."""

    def __init__(self, tmp_path: Path, fail: str = "") -> None:
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.env = {"PATH": os.environ["PATH"]}
        self.failures: list[str] = []
        self.cmds: list[list[str]] = []
        self.fail = fail

    def run(self, name: str, cmd: list[str], log: Path, timeout: float) -> str | None:
        self.cmds.append(cmd)
        arg = {cmd[i]: cmd[i + 1] for i in range(2, len(cmd) - 1) if cmd[i].startswith("--")}
        mode, rep = arg["--mode"], int(arg["--first-rep"])
        if mode == self.fail:
            self.failures.append(f"{name}: exit status 1")
            return "exit status 1; log x: RuntimeError: boom"
        ttft = {"static": 1000.0, "first-come": 400.0, "fair": 300.0, "kvcached": 500.0}
        measured = 20 << 30 if "--kv-capacity-bytes" not in arg else None
        policies = arg.get("--policies", "").split(",") if "--policies" in arg else [None]
        result = _invocation(mode, rep, ttft[mode], capacity=measured)
        if mode == "static":  # what nvidia-smi said once its engines were up
            result["device_memory"] = {"used_bytes": 72 << 30, "total_bytes": 80 << 30}
        result["runs"] = [
            run | ({"policy": policy} if policy else {})
            for r in range(rep, rep + int(arg["--repeats"])) for policy in policies
            for run in _invocation(mode, r, ttft[policy or mode])["runs"]]
        Path(arg["--json"]).write_text(json.dumps(result))
        return None

    def run_json(self, name: str, cmd: list[str], js: Path, log: Path,
                 timeout: float) -> tuple[dict | None, str | None]:
        """The suite runner's own, over :meth:`run`."""
        from bench_items import Runner

        return Runner.run_json(self, name, cmd, js, log, timeout)  # type: ignore[arg-type]


def _sharing_prof(repeats: int = 3) -> dict:
    return {"sharing": {"model": "tiny-llama", "engines": 2, "repeats": repeats,
                        "timeout_s": 60}}


def test_the_item_interleaves_the_modes_and_passes_the_measured_capacity_on(tmp_path,
                                                                            monkeypatch):
    import bench_items

    monkeypatch.setattr(bs, "kvcached_missing", lambda env: "not importable")
    runner = StandInSharing(tmp_path)
    r = bench_items.item_sharing(runner, _sharing_prof(), tmp_path, "cuda", None, [], None,
                                 {"seed": 4, "weights": "1,2"})
    order = [(c[c.index("--mode") + 1], c[c.index("--first-rep") + 1]) for c in runner.cmds]
    assert order == [("static", "0"), ("first-come", "0"), ("fair", "0"),
                     ("fair", "1"), ("first-come", "1"), ("static", "1"),
                     ("static", "2"), ("first-come", "2"), ("fair", "2")]
    # The first process measured the capacity; every later one replays it.
    assert all("--kv-capacity-bytes" not in c for c in runner.cmds[:1])
    assert all(c[c.index("--kv-capacity-bytes") + 1] == str(20 << 30) for c in runner.cmds[1:])
    # The shared engines get the static split's KV memory as their ledger's capacity.
    shared = [c for c in runner.cmds[1:] if c[c.index("--mode") + 1] != "static"]
    assert len(shared) == 6
    assert all(c[c.index("--shared-kv-bytes") + 1] == str(20 << 30) for c in shared)
    assert all("--shared-kv-bytes" not in c for c in runner.cmds if "static" in c)
    assert all(c[c.index("--workloads") + 1] == "peak,over1.5,over3"
               and c[c.index("--seed") + 1] == "4" and c[c.index("--weights") + 1] == "1,2"
               and c[c.index("--single-rounds") + 1] == "2" for c in runner.cmds)
    assert r["kv_capacity"]["bytes"] == 20 << 30 and "static" in r["kv_capacity"]["source"]
    # A missing kvcached that nobody named: recorded, not a failure of the run.
    assert r["modes"]["kvcached"] == {"not_installed": "not importable"}
    assert runner.failures == []
    assert r["modes"]["fair"]["workloads"]["over3"]["reps"] == [0, 1, 2]
    md = render_results({"items": {"sharing": r | {"run": RUN}}})
    assert "| 0.300 [0.300..0.300], n=3 | <= 0.5 | pass |" in _row(md, "over3", "TTFT mean",
                                                                   "fair shared / static")


def test_one_start_per_mode_switches_first_come_and_fair_on_the_same_engines(tmp_path,
                                                                              monkeypatch):
    """--sharing-starts once: one process per mode for every repetition, first-come and
    fair in one process that switches the policy per repetition; each policy's
    repetitions are its own figures, the one-engine-busy rounds the process's mode's."""
    import bench_items
    from bench_sharing import SINGLE_REPEATS

    monkeypatch.setattr(bs, "kvcached_missing", lambda env: "not importable")
    runner = StandInSharing(tmp_path)
    r = bench_items.item_sharing(runner, _sharing_prof(), tmp_path, "cuda", None, [], None,
                                 {"starts": "once"})
    args = [{c[i]: c[i + 1] for i in range(2, len(c) - 1) if c[i].startswith("--")}
            for c in runner.cmds]
    assert [(a["--mode"], a["--first-rep"], a["--repeats"], a.get("--policies"))
            for a in args] == [("static", "0", "3", None), ("fair", "0", "3", "first-come,fair")]
    # As many one-engine-busy rounds per start as the interleaved runs have per mode.
    assert all(a["--single-rounds"] == str(-(-SINGLE_REPEATS // 3) * 3) for a in args)
    assert "--kv-capacity-bytes" not in args[0]
    assert args[1]["--kv-capacity-bytes"] == args[1]["--shared-kv-bytes"] == str(20 << 30)
    assert r["order"] == ["static 1-3", "first-come+fair 1-3"]
    for mode, ttft in (("first-come", 400.0), ("fair", 300.0)):
        over = r["modes"][mode]["workloads"]["over3"]
        assert over["reps"] == [0, 1, 2], mode
        assert over["ttft_mean_ms"]["median"] == 2 * ttft, mode
    assert r["modes"]["fair"]["single_output_tok_s"] is not None
    assert r["modes"]["first-come"]["single_output_tok_s"] is None
    md = render_results({"items": {"sharing": r | {"run": RUN}}})
    assert "| 0.750 [0.750..0.750], n=3 | < 1.0 | pass |" in _row(md, "over3",
                                                                  "fair / first-come")
    # Both policies' process failed: neither is measured, nothing else is lost.
    (tmp_path / "again").mkdir()
    runner = StandInSharing(tmp_path / "again", fail="fair")
    r = bench_items.item_sharing(runner, _sharing_prof(), tmp_path, "cuda", None, [],
                                 "fair,static,first-come", {"starts": "once"})
    assert [c[c.index("--mode") + 1] for c in runner.cmds] == ["fair", "static"]
    assert runner.failures == ["sharing: fair+first-come 1-3: exit status 1"]
    for mode in ("fair", "first-come"):
        assert r["modes"][mode]["not_measured"].startswith("repetition 1-3: exit status 1")
    assert r["modes"]["static"]["repetitions"] == [0, 1, 2]


def test_the_item_records_a_named_missing_kvcached_and_a_failed_mode(tmp_path, monkeypatch):
    import bench_items

    monkeypatch.setattr(bs, "kvcached_missing", lambda env: "not importable")
    runner = StandInSharing(tmp_path, fail="first-come")
    r = bench_items.item_sharing(runner, _sharing_prof(2), tmp_path, "cuda", None, [],
                                 "static,first-come,fair,kvcached", {})
    assert r["modes"]["kvcached"] == {"not_installed": "not importable"}
    assert runner.failures == ["sharing: kvcached: not installed: not importable",
                               "sharing: first-come 1: exit status 1"]
    # The failed mode ran no more; the others ran every repetition.
    assert r["modes"]["first-come"]["not_measured"].startswith("repetition 1: exit status 1")
    assert len([c for c in runner.cmds if "first-come" in c]) == 1
    assert r["modes"]["fair"]["repetitions"] == [0, 1]


def test_kvcached_is_held_to_the_memory_the_static_split_used(tmp_path, monkeypatch):
    """kvcached maps while the device has more than (1 - utilization) free: its servers
    get the fraction of the device the static engines used (KV memory included), in every
    repetition once a static run has measured it (here the second repetition's kvcached
    runs first), before the user's own --kvcached-env (which wins where it names it)."""
    import bench_items

    monkeypatch.setattr(bs, "kvcached_missing", lambda env: None)
    runner = StandInSharing(tmp_path)
    r = bench_items.item_sharing(runner, _sharing_prof(2), tmp_path, "cuda", None,
                                 ["LD_PRELOAD=x.so"], "static,kvcached", {})
    kvc = [c for c in runner.cmds if c[c.index("--mode") + 1] == "kvcached"]
    assert len(kvc) == 2
    for cmd in kvc:
        envs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--env"]
        assert envs == ["KVCACHED_GPU_UTILIZATION=0.9", "LD_PRELOAD=x.so"]
    assert r["kvcached_utilization"] == {
        "value": 0.9, "source": "the static split's engines used 72.00 of 80.00 GiB"}
    md = render_results({"items": {"sharing": r | {"run": RUN}}})
    assert ("kvcached `KVCACHED_GPU_UTILIZATION=0.9` (the static split's engines used 72.00 "
            "of 80.00 GiB)") in md
    # Not without the static engines' fixed KV memory, their use, or a static run.
    static = {"mode": "static", "profile": {"kv_bytes": 18 << 30},
              "device_memory": {"used_bytes": 1000, "total_bytes": 3000}}
    assert bs.kvcached_utilization(static)[0] == 0.3334  # rounded up
    assert bs.kvcached_utilization(static | {"profile": {"kv_bytes": None}}) is None
    assert bs.kvcached_utilization(static | {"device_memory": None}) is None
    assert bs.kvcached_utilization(static | {"mode": "fair"}) is None
    assert bs.kvcached_utilization(
        static | {"device_memory": {"used_bytes": 0, "total_bytes": 3000}}) is None


def test_the_device_memory_comes_from_nvidia_smi_of_the_servers_gpu(tmp_path, monkeypatch):
    """nvidia-smi cannot run here: a stand-in on PATH answers as it does (MiB, CSV) and
    records its arguments; its failure or garbage gives None, not an error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    args_file, answer, status = tmp_path / "args", tmp_path / "answer", tmp_path / "status"
    smi.write_text(f'#!/bin/sh\necho "$@" > {args_file}\ncat {answer}\nexit $(cat {status})\n')
    smi.chmod(0o755)
    answer.write_text("73728, 81559\n")
    status.write_text("0")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    got = bs.device_memory({"CUDA_VISIBLE_DEVICES": "GPU-abc,1"})
    assert got == {"used_bytes": 73728 << 20, "total_bytes": 81559 << 20}
    assert args_file.read_text().split()[-2:] == ["-i", "GPU-abc"]
    assert bs.device_memory({}) is not None
    assert args_file.read_text().split()[-2:] == ["-i", "0"]
    answer.write_text("[N/A], [N/A]\n")
    assert bs.device_memory({}) is None
    answer.write_text("1, 2\n")
    status.write_text("9")
    assert bs.device_memory({}) is None


def test_bench_checks_the_sharing_options_before_anything_runs(monkeypatch):
    import argparse

    import bench

    monkeypatch.setattr(bs, "kvcached_missing", lambda env: "kvcached is not importable")

    def args(**kw) -> argparse.Namespace:
        base = {"sharing_modes": None, "sharing_workloads": None, "sharing_kv_capacity": None,
                "sharing_repeats": None, "sharing_seed": 0, "sharing_weights": None,
                "sharing_starts": "each", "quick": False, "kvcached_env": [], "stock_path": None}
        return argparse.Namespace(**(base | kw))

    opts = bench.sharing_arguments(args(), "cuda", {})
    assert opts["workloads"] == "peak,over1.5,over3" and opts["kv_capacity_bytes"] is None
    assert bench.sharing_arguments(args(sharing_kv_capacity="20GiB"), "cpu",
                                   {})["kv_capacity_bytes"] == 20 << 30
    seen: list[dict] = []
    monkeypatch.setattr(bs, "kvcached_missing",
                        lambda env: seen.append(env) or "kvcached is not importable")
    with pytest.raises(SystemExit, match="names kvcached, but kvcached is not importable"):
        bench.sharing_arguments(args(sharing_modes="static,kvcached", stock_path="/stock",
                                     kvcached_env=["LD_PRELOAD=/x.so"]), "cuda",
                                {"PYTHONPATH": "/site"})
    # Looked for with the servers' PYTHONPATH and environment.
    assert seen == [{"PYTHONPATH": os.pathsep.join(["/stock", "/site"]),
                     "LD_PRELOAD": "/x.so"}]
    with pytest.raises(SystemExit, match="kvcached cannot measure"):
        bench.sharing_arguments(args(sharing_modes="kvcached,static"), "cuda", {})
    # Given a capacity, kvcached may go first (found installed here).
    monkeypatch.setattr(bs, "kvcached_missing", lambda env: None)
    bench.sharing_arguments(args(sharing_modes="kvcached,static", sharing_kv_capacity="1GiB"),
                            "cuda", {})
    for bad in ({"sharing_workloads": "over"}, {"sharing_kv_capacity": "lots"},
                {"sharing_weights": "1,2,3,4"}, {"sharing_repeats": 0}):
        with pytest.raises(SystemExit):
            bench.sharing_arguments(args(**bad), "cuda", {})


def test_kvcached_is_looked_for_on_the_servers_python_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    why = bs.kvcached_missing(env)
    assert why is not None and "not importable" in why and "--stock-path" in why
    # A package of that name on the servers' PYTHONPATH (not imported: only found).
    (tmp_path / "kvcached").mkdir()
    (tmp_path / "kvcached" / "__init__.py").write_text("raise SystemExit('imported')\n")
    assert bs.kvcached_missing(env | {"PYTHONPATH": str(tmp_path)}) is None


@pytest.mark.parametrize("bad,message", [
    (["--repeats", "0"], "--repeats 0: give 1 or more"),
    (["--engines", "0"], "--engines 0: give 1 or more"),
    (["--first-rep", "-1"], "--first-rep -1: give 0 or more"),
    (["--kv-capacity-bytes", "0"], "--kv-capacity-bytes 0: give a positive size"),
    (["--workloads", "over"], "workload 'over'"),
    (["--weights", "1,0,1"], "--weights '1,0,1': give 3 positive numbers"),
    (["--set", "bogus=1"], "--set bogus: not a profile value"),
    (["--set", "kv_bytes=1.5"], "--set kv_bytes=1.5: give the engines' KV memory"),
    (["--set", "kv_bytes=0"], "--set kv_bytes=0: give the engines' KV memory"),
    (["--policies", "fair,fifo"], "--policies 'fair,fifo': give each of first-come, fair"),
    (["--policies", "fair,fair"], "--policies 'fair,fair'"),
    (["--shared-kv-bytes", "0"], "--shared-kv-bytes 0: give a positive size"),
])
def test_bench_sharing_refuses_bad_arguments_before_starting_a_server(tmp_path, bad, message):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
         "vocab_size": 4096, "torch_dtype": "bfloat16"}))
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench/bench_sharing.py"),
                           "--mode", "fair", "--model", str(tmp_path), "--json",
                           str(tmp_path / "out.json"), *bad],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out.json").exists() and not list(tmp_path.glob("sharing-*.log"))


def test_the_capacity_is_asked_for_again_until_the_engines_publish_it():
    """A real HTTP /metrics that lacks the ledger's capacity twice, then shows it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    answers = ["vllm:other 1\n", "vllm:other 1\n", METRICS]

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = (answers.pop(0) if len(answers) > 1 else answers[0]).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = SimpleNamespace(port=httpd.server_address[1])
        assert bs.measure_capacity("fair", [server], 100, wait_s=10)[0] == 25_000_000_000
        assert answers == [METRICS]
        # Never published: the error after the wait.
        answers[:] = ["vllm:other 1\n"]
        with pytest.raises(SystemExit, match="no ledger capacity"):
            bs.measure_capacity("fair", [server], 100, wait_s=1.5)
    finally:
        httpd.shutdown()


def test_policies_need_shared_engines_and_alternate_per_repetition():
    assert bs.parse_policies(None, "static") is None
    assert bs.parse_policies("first-come, fair", "fair") == ["first-come", "fair"]
    with pytest.raises(SystemExit, match="needs --mode fair or first-come"):
        bs.parse_policies("fair", "static")
    assert bs.sharing_order(["first-come", "fair"], 0) == ["first-come", "fair"]
    assert bs.sharing_order(["first-come", "fair"], 1) == ["fair", "first-come"]


def fake_proc(tmp_path: Path, tree: dict[int, int]) -> Path:
    """A /proc of processes ``{pid: parent}`` (names with spaces and parentheses)."""
    proc = tmp_path / "proc"
    for pid, ppid in tree.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (vllm (core) x) S {ppid} 1 1 0\n")
    (proc / "self").mkdir()
    return proc


def test_descendants_follow_the_parents_down():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        proc = fake_proc(Path(d), {1: 0, 10: 1, 11: 10, 12: 11, 20: 1, 21: 20, 30: 12})
        assert bs.descendants({10}, proc) == {10, 11, 12, 30}
        assert bs.descendants({20, 99}, proc) == {20, 21, 99}


def test_the_share_policy_is_switched_for_this_runs_engines_only(tmp_path, monkeypatch):
    """The ledger CLI lists two ledgers; the entries of engine cores below this run's servers
    are switched, another engine's on the same device is left alone; no entry of ours is
    an error that names the pids."""
    proc = fake_proc(tmp_path, {100: 1, 101: 100, 200: 1, 201: 200, 300: 1})
    real = bs.descendants
    monkeypatch.setattr(bs, "descendants", lambda pids: real(pids, proc))
    listing = [{"key": "GPU-a", "owner": "user root", "path": "/dev/shm/x/a.json",
                "entries": [{"id": "aaa", "pid": 101}, {"id": "ccc", "pid": 300}]},
               {"key": "GPU-b", "owner": "user root", "path": "/dev/shm/x/b.json",
                "entries": [{"id": "bbb", "pid": 201}]}]
    calls = []

    def cli(argv, env, timeout=60):
        calls.append(argv)
        return json.dumps(listing) if argv[0] == "list" else ""

    monkeypatch.setattr(bs, "run_ledger_cli", cli)
    assert bs.set_share_policy("first-come", {100, 200}, {}) == 2
    assert calls[1:] == [["set", "aaa", "--key", "GPU-a", "--share-policy", "first-come"],
                         ["set", "bbb", "--key", "GPU-b", "--share-policy", "first-come"]]
    with pytest.raises(SystemExit, match=r"no ledger entry of this run's engines.*\[400\]"):
        bs.set_share_policy("fair", {400}, {})


def test_a_failing_ledger_cli_ends_the_run_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "fake_ledger_cli.py").write_text(
        "import sys\nprint('no such engine', file=sys.stderr)\nsys.exit(1)\n")
    monkeypatch.setattr(bs, "LEDGER_CLI", "fake_ledger_cli")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    with pytest.raises(SystemExit, match="exit status 1: no such engine"):
        bs.run_ledger_cli(["list", "--json"], env)
