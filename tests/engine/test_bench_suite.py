"""The benchmark suite (scripts/bench/bench.py) end to end on CPU: real vLLM engines (stock and
VMM KV) on a tiny dummy-weight Llama, each in its own process, then the doc generator on the
results.

No timing is asserted (2 shared CPU cores); the test checks that every item either has numbers
or says why it was not measured, and that the elasticity check used the engine's own figures.
Marked slow (a dozen engine processes): CI runs the suite's logic in
tests/harness/test_bench_suite.py (A/B pairs into figures, the report and the doc section,
failing and stalled processes) and the engines' elasticity in test_vmm_kv_engine.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


VMM_ARGS = {"kv_cache_vmm_headroom_pages": 1}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_quick_cpu(tmp_path: Path):
    out = tmp_path / "bench"
    # Item 7 (several servers) has a test of its own: test_bench_sharing.py.
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"),
                           "--quick", "--device", "cpu", "--out", str(out), "--items",
                           "1,2,3,4,5,6",
                           # The default headroom, given explicitly: the VMM side's own
                           # engine arguments reach its engines and the results.
                           "--vmm-args", json.dumps(VMM_ARGS)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    items = results["items"]
    assert set(items) == {"throughput", "startup", "elasticity", "pagemap", "pd", "tp2-startup"}
    assert results["host"]["vllm"] and results["host"]["device"] == "cpu"

    for name in ("throughput", "startup", "elasticity", "pagemap"):
        assert "not_measured" not in items[name], (name, items[name])
    model = items["throughput"]["models"]["tiny-llama"]
    # Each workload ran twice per engine, the second time with its KV memory mapped.
    for workload in ("prefill", "decode", "prefill, 2nd run", "decode, 2nd run"):
        s = model[workload]
        assert s["n"] == 1 and _finite(s["a_median"]) and _finite(s["b_median"])
        assert s["ratio"] == pytest.approx(s["b_median"] / s["a_median"])
    assert items["throughput"]["vmm_args"] == VMM_ARGS
    # The VMM side really ran with mapped pages.
    assert model["vmm_page_stats"][0]["kv_pages_mapped_total"] >= 2
    # The first request after the engine went idle: timed on both sides, and the VMM engine
    # had given back everything beyond the null block's page and the headroom before it.
    idle = model["first request after idle, TTFT (s)"]
    assert idle["n"] == 1 and _finite(idle["a_median"]) and _finite(idle["b_median"])
    page_bytes = model["vmm_page_stats"][0]["page_bytes"]
    assert idle["vmm_idle_mapped_bytes"] == [(1 + VMM_ARGS["kv_cache_vmm_headroom_pages"])
                                             * page_bytes]
    assert _finite(items["startup"]["models"]["tiny-llama"]["startup_s"]["ratio"])

    el = items["elasticity"]
    page = el["page_bytes"]
    assert len(el["bursts"]) == 2 and el["ok"]
    first = el["bursts"][0]
    # 8 x 604 tokens need 40 blocks of 128 tokens, more than the startup mapping holds: the
    # burst mapped more pages, and the idle engine gave them back to within the bound.
    assert first["peak_mapped_bytes"] >= 3 * page
    assert first["mapped_bytes_after"] <= first["bound_bytes"] == (1 + el["headroom_pages"]) * page
    peak = max(b["peak_mapped_bytes"] for b in el["bursts"])
    assert max(row[1] for row in el["timeline"]) == peak
    assert (out / "elasticity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    pm = items["pagemap"]
    assert pm["backend"] == "host"
    assert all(_finite(v) for v in pm["us_per_page"].values())
    assert _finite(pm["ratios"]["map per page / raw map"]["median"])
    for name in ("pd", "tp2-startup"):
        assert "needs 2 GPUs" in items[name]["not_measured"]
        assert f"{name}: not measured: needs 2 GPUs" in proc.stdout
    # The whole run's wall time is kept with every item it measured.
    assert _finite(items["pagemap"]["run"]["suite_s"])

    md = (out / "results.md").read_text()
    assert "not measured: needs 2 GPUs" in md and "| 3 | burst 1" in md
    assert "prefill, 2nd run (8 x 128 in / 2 out)" in md and "whole run" in md
    assert '`{"kv_cache_vmm_headroom_pages": 1}`' in md

    # The doc generator replaces only its own section and keeps the rest of the doc.
    doc = tmp_path / "docs" / "BENCHMARKS.md"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\n## Page map (kept)\n\ntext\n")
    for _ in range(2):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_report.py"),
                        str(out / "results.json"), "--doc", str(doc)], check=True, timeout=60)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Page map (kept)\n\ntext\n")
    assert text.count("## VMM KV vs stock KV allocation") == 1
    assert "docs/bench/e2e/elasticity.png" in text
    assert (tmp_path / "docs" / "bench" / "e2e" / "results.json").exists()
