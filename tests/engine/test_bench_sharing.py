"""Item 7 of the benchmark suite end to end on CPU: two real vLLM servers on one host, with a
static split of the KV memory (default backend), then sharing it through the host's KV memory
ledger first come first served and fairly (--kv-cache-vmm-share-policy), the same replayed
workloads against every mode: today's peaks and peaks that together need 1.5 and 3 times
the KV capacity the static engines measured.

No timing is asserted (2 shared CPU cores); the test checks that every mode measured every
figure from the same requests, none failed, the preemption counters were read, the capacity
came from the static engines and sized the over-subscribed workloads, the shared engines
really were on one ledger (read back from a server's /metrics), and that the report shows
the item.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

# Six server starts and three workloads per mode: out of CI's time budget (slow); CI runs
# its harness side (tests/harness/test_bench_sharing.py) and the shared-ledger engine tests.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODES = ("static", "first-come", "fair")
WORKLOADS = ("peak", "over1.5", "over3")


def test_bench_sharing_cpu(tmp_path: Path, monkeypatch):
    # The shared engines' ledger in a directory of their own.
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", str(tmp_path / "ledger"))
    (tmp_path / "ledger").mkdir()
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"), "--items",
                           "sharing", "--device", "cpu", "--out", str(out), "--sharing-seed",
                           "3"], capture_output=True, text=True, timeout=4800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    item = json.loads((out / "results.json").read_text())["items"]["sharing"]
    assert item["engines"] == 2 and set(item["modes"]) == set(MODES)
    assert item["workloads"] == list(WORKLOADS) and item["seed"] == 3
    assert item["order"] == ["static 1", "first-come 1", "fair 1"]
    share = json.loads((out / "sharing_static_0.json").read_text())["profile"]["share"]
    # The static engines' KV blocks together: the CPU KV budget, less what rounds to a block.
    assert 0.9 * share <= item["kv_capacity"]["bytes"] <= share
    assert "static" in item["kv_capacity"]["source"]
    runs = {m: json.loads((out / f"sharing_{m}_0.json").read_text()) for m in MODES}
    for mode, m in item["modes"].items():
        assert "not_measured" not in m, (mode, m)
        for name in WORKLOADS:
            w = m["workloads"][name]
            assert w["failed_total"] == 0, (mode, name, w.get("first_error"))
            for key in ("ttft_mean_ms", "ttft_p99_ms", "output_tok_s"):
                assert all(math.isfinite(x) and x > 0 for x in w[key]["runs"]), (mode, key)
            assert all(x is not None and x >= 0 for x in w["preemptions_runs"]), (mode, name)
            assert set(w["per_engine"]) == {"0", "1"}
        assert all(math.isfinite(x) and x > 0 for x in m["single_output_tok_s"]["runs"])
        assert len(m["health_s"]) == 2 and m["engine_deaths"] == []
        assert runs[mode]["kv_capacity_bytes"] == item["kv_capacity"]["bytes"]
    # The same requests in every mode (replayed from the seed), the over-subscribed ones
    # asking for their ratio of the capacity.
    for name in WORKLOADS:
        assert len({runs[m]["runs"][0]["workloads"][name]["requests"] for m in MODES}) == 1
    for name, ratio in (("over1.5", 1.5), ("over3", 3.0)):
        plan = runs["fair"]["runs"][0]["workloads"][name]["plan"]
        assert plan["demand_ratio"] == pytest.approx(ratio, rel=0.01)
    assert runs["fair"]["engine"]["kv_cache_vmm_share_policy"] == "fair"
    assert runs["first-come"]["engine"]["kv_cache_vmm_share_policy"] == "first-come"
    # Both shared engines were in the ledger that the first one's /metrics showed.
    mapped = [line for line in runs["fair"]["ledger_metrics"] if 'quantity="mapped"' in line]
    assert len(mapped) == 2, runs["fair"]["ledger_metrics"]
    md = (out / "results.md").read_text()
    assert "| 7 | Engines sharing one device" in md and "n/a on CPU" in md
    assert "over3 (peaks 3.00x the KV capacity" in md
