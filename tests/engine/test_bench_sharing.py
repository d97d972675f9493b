"""Item 7 of the benchmark suite end to end on CPU: two real vLLM servers on one host, first
with a static split of the KV memory (default backend), then sharing it through the host's
KV memory ledger (--kv-cache-vmm-shared), the same replayed workload against both.

No timing is asserted (2 shared CPU cores); the test checks that both modes measured every
figure from the same requests, that the shared engines really were on one ledger (read back
from a server's /metrics), and that the report shows the item.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

# Four server starts: out of CI's time budget (slow); CI runs its harness side
# (tests/harness/test_bench_sharing.py) and the shared-ledger engine tests.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sharing_cpu(tmp_path: Path, monkeypatch):
    # The shared engines' ledger in a directory of their own.
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", str(tmp_path / "ledger"))
    (tmp_path / "ledger").mkdir()
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"), "--items",
                           "sharing", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    item = json.loads((out / "results.json").read_text())["items"]["sharing"]
    assert item["engines"] == 2 and set(item["modes"]) == {"static", "shared"}
    for mode in ("static", "shared"):
        m = item["modes"][mode]
        assert "not_measured" not in m, (mode, m)
        for key in ("peaks_ttft_mean_ms", "peaks_ttft_p99_ms", "peaks_output_tok_s",
                    "single_output_tok_s"):
            assert all(math.isfinite(x) and x > 0 for x in m[key]["runs"]), (mode, key)
        assert len(m["health_s"]) == 2
    static = json.loads((out / "sharing_static.json").read_text())
    shared = json.loads((out / "sharing_shared.json").read_text())
    # The same requests in both modes (replayed from the seed).
    assert [r["requests"] for r in static["peaks"]] == [r["requests"] for r in shared["peaks"]]
    assert static["engine"]["kv_cache_memory_bytes"] * 2 == shared["profile"]["share"]
    assert shared["backend"] == "vmm" and shared["engine"]["kv_cache_vmm_shared"]
    # Both shared engines were in the ledger that the first one's /metrics showed.
    mapped = [line for line in shared["ledger_metrics"] if 'quantity="mapped"' in line]
    assert len(mapped) == 2, shared["ledger_metrics"]
    md = (out / "results.md").read_text()
    assert "| 7 | Engines sharing one device" in md and "n/a on CPU" in md
