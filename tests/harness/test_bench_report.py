"""The benchmark suite's report side without vLLM: A/B summary, merging runs, the doc section
generator and the standard-library PNG writer (tests/engine/test_bench_suite.py runs the
suite itself on a real engine)."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts")]

RUN1 = {"date": "d1", "vllm": "0.21.0", "torch": "t", "python": "3.12", "cpu_count": 16,
        "command": "python3 scripts/bench/bench.py", "gpu": "NVIDIA H100", "driver": "1.0",
        "device": "cuda"}
RUN2 = {**RUN1, "date": "d2", "command": "python3 scripts/bench/bench.py --items 5,6"}


def _ab(a: list[float], b: list[float]) -> dict:
    from bench_items import summarize

    return summarize(a, b)


def test_ab_order_interleaves_and_summary_pairs_ratios():
    from bench_items import ab_order

    assert ab_order(3) == ["default", "vmm", "vmm", "default", "default", "vmm"]
    s = _ab([10.0, 20.0, 30.0], [11.0, 18.0, 30.0])
    assert s["a_median"] == 20.0 and s["b_median"] == 18.0
    assert s["ratio"] == pytest.approx(0.9)
    assert (s["ratio_min"], s["ratio_max"]) == pytest.approx((0.9, 1.1))
    assert s["n"] == 3


def test_merge_keeps_models_and_items_of_other_runs(tmp_path: Path):
    from bench_report import merge_results, render_results

    one = {"items": {
        "throughput": {"run": RUN1, "models": {"Qwen3-8B": {
            "run": RUN1, "decode": {**_ab([100.0], [98.0]), "num": 1, "input": 2, "output": 3}}}},
        "tp2-startup": {"run": RUN1, "not_measured": "needs 2 GPUs, this host has 1"}}}
    two = {"items": {
        "throughput": {"run": RUN2, "models": {"Llama-3.1-8B-Instruct": {
            "run": RUN2, "decode": {**_ab([50.0], [50.0]), "num": 1, "input": 2, "output": 3}}}},
        "tp2-startup": {"run": RUN2, "model": "m", "tensor_parallel_size": 2,
                        "health_s": _ab([40.0, 42.0], [41.0, 50.0])}}}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "results.json").write_text(json.dumps(one))
    (tmp_path / "b" / "results.json").write_text(json.dumps(two))
    merged, _ = merge_results([tmp_path / "a" / "results.json", tmp_path / "b" / "results.json"])
    assert set(merged["items"]["throughput"]["models"]) == {"Qwen3-8B", "Llama-3.1-8B-Instruct"}
    # A later run that could not measure an item keeps the earlier figure.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "results.json").write_text(json.dumps({"items": {"tp2-startup": {
        "run": RUN1, "not_measured": "needs 2 GPUs, this host has 1"}}}))
    again, _ = merge_results([tmp_path / d / "results.json" for d in "abc"])
    assert again["items"]["tp2-startup"] == merged["items"]["tp2-startup"]
    md = render_results(merged)
    assert "| 0.980 [0.980..0.980], n=1 | >= 0.99 | FAIL | 1 |" in md
    assert "| 1.000 [1.000..1.000], n=1 | >= 0.99 | pass | 2 |" in md
    # TP=2 start: median 41.0 vs 45.5 -> 1.110, over the 1.1 target.
    assert "TP=2 | 41.0 [40.0..42.0] | 45.5 [41.0..50.0] | 1.110 [1.025..1.190], n=2" in md
    assert "not measured: not run" in md  # items neither run measured
    assert "1. d1: NVIDIA H100, driver 1.0, vLLM 0.21.0" in md
    assert "2. d2: NVIDIA H100" in md


def test_pagemap_rows_include_gpu_work_while_mapping_where_measured():
    from bench_report import render_results

    us = {"raw map, per page": 33.0, "page table map, per page": 38.0}
    pagemap = {"run": RUN1, "backend": "cuda", "pages": 64, "repeats": 11, "invocations": 2,
               "us_per_page": us,
               "ratios": {"map per page / raw map": {"median": 1.15, "min": 1.1, "max": 1.2},
                          "GPU work while mapping / alone": {"median": 1.014, "min": 1.01,
                                                             "max": 1.02}},
               "overlap_runs": [{"pages": 64, "matmuls": 118, "gpu_ms_alone": a,
                                 "gpu_ms_while_mapping": b, "host_map_ms": h}
                                for a, b, h in ((21.0, 21.3, 4.0), (22.0, 22.5, 5.0))]}
    md = render_results({"items": {"pagemap": pagemap}})
    assert "cuda: map per page / raw map |  |  | 1.150 [1.100..1.200], n=2 | <= 1.5 | pass" in md
    assert "cuda: GPU work while mapping / alone |  |  | 1.014 [1.010..1.020], n=2 |  |" in md
    assert ("GPU work while mapping: 118 matmuls took 21.50 ms alone and 21.90 ms while the "
            "host mapped 64 pages (one page table call each, 4.50 ms on the host)") in md
    # The host backend (no GPU work) has neither.
    del pagemap["overlap_runs"], pagemap["ratios"]["GPU work while mapping / alone"]
    assert "GPU work" not in render_results({"items": {"pagemap": pagemap}})


def test_pd_transfer_shows_each_path_as_a_fraction_of_the_link():
    from bench_items import spread
    from bench_report import render_results

    transfer = {**_ab([27.0, 28.0, 29.0], [300.0, 310.0, 320.0]),
                "vmm_ucx": spread([0.4, 0.5, 0.6]), "link": spread([380.0, 390.0, 400.0])}
    transfer["of_link"] = {
        mode: spread([x / link for x, link in zip(values, transfer["link"]["runs"])])
        for mode, values in (("stock", transfer["a"]), ("vmm", transfer["b"]),
                             ("vmm_ucx", transfer["vmm_ucx"]["runs"]))}
    pd = {"run": RUN1, "transfer_gbps": transfer,
          "ttft_ms": {"not_measured": "time budget spent before the first pair"}}
    md = render_results({"items": {"pd": pd}})
    assert ("P/D over NIXL: transfer GB/s | 28.0 [27.0..29.0] | 310.0 [300.0..320.0] | "
            "11.071 [11.034..11.111], n=3 | >= 0.9 | pass") in md
    assert ("one copy of a read's bytes over the link 390.0 [380.0..400.0] GB/s; fraction of "
            "it: stock (NIXL) 0.072 [0.071..0.072], VMM (same-host path) 0.795 "
            "[0.789..0.800], VMM through NIXL/UCX alone 0.001 [0.001..0.002]") in md
    # The TTFT pairs: judged against <= 1.1, and whether the VMM runs took the same-host path.
    pd["ttft_ms"] = _ab([130.0, 134.0, 136.0], [128.0, 140.0, 150.0])
    pd["vmm_same_host"] = [True, True, False]
    md = render_results({"items": {"pd": pd}})
    assert "P/D over NIXL: end-to-end TTFT (ms) | 134.0 [130.0..136.0] | 140.0" in md
    assert "| <= 1.1 | pass |" in md.split("end-to-end TTFT")[1].splitlines()[0]
    assert "read over the same-host path in 2 of 3 TTFT runs" in md
    # Where the decode instance's part went: its reads as the connector timed them.
    pd["decode_read_ms"] = {"default": spread([1.3, 1.4, 1.5]),
                            "vmm": spread([1.9, 2.1, 2.2])}
    md = render_results({"items": {"pd": pd}})
    assert ("the decode instance's reads as NixlConnector timed them (posted to done, mean ms "
            "per read, per TTFT run): stock 1.4 [1.3..1.5], VMM 2.1 [1.9..2.2].") in md
    # Runs before the link was measured render as they did.
    for key in ("vmm_ucx", "link", "of_link"):
        del transfer[key]
    assert "over the link" not in render_results({"items": {"pd": pd}})


def test_doc_section_replaced_in_place(tmp_path: Path):
    from bench_report import BEGIN, END, update_doc

    doc = tmp_path / "docs" / "BENCHMARKS.md"
    doc.parent.mkdir()
    doc.write_text("# B\n\n## Page map\n\nkept\n\n## After\n")
    update_doc(doc, [], tmp_path / "docs" / "bench" / "e2e", pending="no run yet")
    first = doc.read_text()
    assert first.count(BEGIN) == 1 and "not measured: no run yet" in first
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"items": {"pd": {"run": RUN1, "not_measured": "why"}}}))
    update_doc(doc, [results], tmp_path / "docs" / "bench" / "e2e")
    text = doc.read_text()
    assert text.startswith("# B\n\n## Page map\n\nkept\n\n## After\n")
    assert text.count(BEGIN) == text.count(END) == 1
    assert "not measured: why" in text and "no run yet" not in text
    assert json.loads((tmp_path / "docs" / "bench" / "e2e" / "results.json").read_text())


def test_stdlib_png_is_a_valid_image_with_both_lines(tmp_path: Path, monkeypatch):
    import bench_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the fallback path
    path = tmp_path / "t.png"
    renderer = bench_plot.write_timeline_png(path, [[0, 1, 0], [1, 4, 3], [2, 2, 0]])
    assert renderer == "stdlib"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    # Decode the IDAT (filter byte 0 per row) and look for both line colours.
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    assert len(raw) == height * (1 + 3 * width)
    assert bytes(bench_plot.MAPPED) in raw and bytes(bench_plot.LIVE) in raw
