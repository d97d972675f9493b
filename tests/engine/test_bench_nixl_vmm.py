# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/bench/bench_nixl_vmm.py (the transfer part of item 5) on CPU: two real NIXL agents
in two processes, KV in host memory, UCX over the loopback. The figures are for GPU hosts; this
checks that every mode runs and reads the way it says it does, with a block table larger
than a pipe holds (one prompt's read shape is 16,000 blocks). Marked slow (eight processes
with NIXL, four of them importing vLLM); the printed figures and ratios are unit-tested in
tests/harness/test_bench_nixl_vmm.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from own_session import run_in_own_session

# Not an engine, but the tier whose environment has NIXL and the patched vLLM.
pytestmark = pytest.mark.engine

pytest.importorskip("nixl", reason="the benchmark needs the nixl package")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_mode_reads_a_table_larger_than_a_pipe(tmp_path: Path):
    out = tmp_path / "nixl.json"
    warmup, iters = 1, 3
    # 32768 blocks of 1 KiB per side, as on a GPU host but smaller: each side's block
    # table is 768 KiB, more than a local socket pair holds.
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "bench_nixl_vmm.py"), "--kind",
           "host", "--block-bytes", "1024", "--num-blocks", "32768", "--blocks-per-read", "16000",
           "--warmup", str(warmup), "--iters", str(iters),
           "--modes", "stock,vmm,vmm_ucx,link", "--json", str(out)]
    env = dict(os.environ, UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo")
    done = run_in_own_session(cmd, env=env, timeout=300, what="bench_nixl_vmm.py")
    assert done.returncode == 0, done.stdout[-4000:]
    results = json.loads(out.read_text())
    for mode in ("stock", "vmm", "vmm_ucx", "link"):
        r = results[mode]
        assert r["gb_per_s"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"], (mode, r)
    # Every read of mode vmm took the same-host path; none of vmm_ucx did.
    assert results["vmm"]["same_host_reads"] == warmup + iters
    assert results["vmm_ucx"]["same_host_reads"] == 0
    assert results["of_link"]["link"] == 1.0
    assert results["vmm_over_stock"] == pytest.approx(
        results["vmm"]["gb_per_s"] / results["stock"]["gb_per_s"])
