"""The benchmark suite's functional checks on a GPU: memory elasticity of VMM KV with the CUDA
backend (Llama-3.1-8B config, dummy weights: mapped KV bytes follow a burst and come back to
within one headroom once it is over) and the page-map item on the CUDA driver. Timings are
recorded, not asserted (docs/BENCHMARKS.md is written from `make bench` runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_bench_elasticity_and_pagemap_on_gpu(tmp_path: Path):
    from vllm.engine.arg_utils import EngineArgs

    if not hasattr(EngineArgs, "kv_cache_memory_backend"):
        pytest.skip("this vLLM tree does not carry the VMM-backed KV cache patch")
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"),
                           "--quick", "--items", "elasticity,pagemap", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    items = json.loads((out / "results.json").read_text())["items"]

    el = items["elasticity"]
    assert "not_measured" not in el, el
    assert el["run"]["device"] == "cuda" and el["run"]["gpu"]
    first = el["bursts"][0]
    # The first burst needs pages beyond the startup mapping; afterwards the engine gives
    # them back to within the bound (null block's page + headroom).
    assert first["peak_mapped_bytes"] > el["startup_mapped_bytes"]
    assert el["ok"], el["bursts"]
    assert (out / "elasticity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    pm = items["pagemap"]
    assert "not_measured" not in pm, pm
    assert pm["backend"] == "cuda" and all(v > 0 for v in pm["us_per_page"].values())
    # GPU work timed alone and while the host maps pages, the maps inside the work.
    overlap = pm["overlap_runs"][0]
    assert overlap["host_map_within_gpu_work"], overlap
    assert pm["ratios"]["GPU work while mapping / alone"]["median"] > 0
