# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/bench/bench_pd.py (the end-to-end TTFT of item 5) on CPU: a real prefill server and a
real decode server (`vllm serve`, NixlConnector, KV in host memory, UCX over the loopback),
each request sent the way a disaggregating proxy sends it. The figures are for GPU hosts;
this checks the flow: the decode server must answer from the prefill server's transfer
params (the script fails otherwise), with VMM-backed KV on both. How the script ends when an
instance dies, stalls or fails to start: tests/harness/test_bench_pd.py."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

# Two servers for the script's flow (CI time): the connector path itself, VMM-backed KV on
# both instances included, is in test_nixl_pd_engine.py.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

pytest.importorskip("nixl", reason="NixlConnector needs the nixl package")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_pd_ttft_on_cpu(tmp_path: Path):
    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny-llama", num_key_value_heads=4)
    out = tmp_path / "pd.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_pd.py"),
                           "--device", "cpu", "--backend", "vmm", "--model", str(model),
                           "--json", str(out), "--requests", "2", "--prompt-len", "600",
                           "--timeout", "400"],
                          capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("pd-*.log"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:] + logs
    result = json.loads(out.read_text())
    assert result["backend"] == "vmm" and len(result["ttft_ms_runs"]) == 2
    assert all(ms > 0 for ms in result["ttft_ms_runs"])
    assert result["ttft_ms"] == pytest.approx(statistics.median(result["ttft_ms_runs"]))
    # Each TTFT splits into the prefill instance's part and the decode instance's.
    for total, prefill, decode in zip(result["ttft_ms_runs"], result["prefill_ms_runs"],
                                      result["decode_ms_runs"], strict=True):
        assert 0 < prefill < total and decode == pytest.approx(total - prefill)
    # Both servers ran with the VMM-backed KV cache and NIXL.
    for role in ("prefill", "decode"):
        log = (tmp_path / f"pd-vmm-{role}.log").read_text(errors="replace")
        assert "VMM-backed KV cache" in log and "NixlConnector" in log
