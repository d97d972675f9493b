# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""scripts/bench/bench_nixl_vmm.py (the transfer part of item 5) on CPU: two real NIXL agents
in two processes, KV in host memory, UCX over the loopback. The figures are for GPU hosts.

In CI: a mode whose reader fails after its reads, while the owner (a real NIXL agent) waits
for it, ends the run at once with the earlier mode's figures (on a GPU host the reader of
mode vmm_batch failed its same-host check there, and the run hung until its time limit).
Mode stock: its processes import no vLLM (each process of a VMM mode does, 12.6 s of CPU on
the CI-class VM). Marked slow: every mode with a block table larger than a pipe holds (one
prompt's read shape is 16,000 blocks, eight processes); the printed figures and ratios are
unit-tested in tests/harness/test_bench_nixl_vmm.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from own_session import run_in_own_session

# Not an engine, but the tier whose environment has NIXL and the patched vLLM.
pytestmark = pytest.mark.engine

pytest.importorskip("nixl", reason="the benchmark needs the nixl package")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "bench_nixl_vmm.py"
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}


def test_a_reader_that_fails_after_its_reads_ends_the_run_with_its_error(tmp_path: Path):
    out = tmp_path / "nixl.json"
    cmd = [sys.executable, str(SCRIPT), "--kind", "host", "--block-bytes", "1024",
           "--num-blocks", "256", "--blocks-per-read", "64", "--warmup", "1", "--iters", "2",
           "--modes", "link,stock", "--json", str(out)]
    env = dict(os.environ, **UCX_ENV, KVSERIES_BENCH_FAULT="nixl_vmm:stock:reader:read=raise")
    start = time.monotonic()
    done = run_in_own_session(cmd, env=env, timeout=300, what="bench_nixl_vmm.py")
    took = time.monotonic() - start
    assert done.returncode == 1, done.stdout[-4000:]
    text = done.stdout
    # link was measured and is printed before the error of stock's reader, which had read
    # through NIXL (its log's last lines and the traceback name the point after the reads).
    assert "measured before the failure:" in text
    assert text.index("link   :") < text.index("error: stock: the reader process failed:")
    assert "RuntimeError: fault injected at nixl_vmm:stock:reader:read" in text
    results = json.loads(out.read_text())
    assert results["link"]["gb_per_s"] > 0 and "stock" not in results
    assert results["error"]["mode"] == "stock"
    # Ended when the reader did, not at the deadline (600 s).
    assert took < 240, took


@pytest.mark.slow
def test_every_mode_reads_a_table_larger_than_a_pipe(tmp_path: Path):
    out = tmp_path / "nixl.json"
    warmup, iters = 1, 3
    # 32768 blocks of 1 KiB per side, as on a GPU host but smaller: each side's block
    # table is 768 KiB, more than a local socket pair holds.
    cmd = [sys.executable, str(SCRIPT), "--kind", "host", "--block-bytes", "1024",
           "--num-blocks", "32768", "--blocks-per-read", "16000",
           "--warmup", str(warmup), "--iters", str(iters),
           "--modes", "stock,vmm,vmm_ucx,link", "--json", str(out)]
    done = run_in_own_session(cmd, env=dict(os.environ, **UCX_ENV), timeout=900,
                              what="bench_nixl_vmm.py")
    assert done.returncode == 0, done.stdout[-4000:]
    results = json.loads(out.read_text())
    for mode in ("stock", "vmm", "vmm_ucx", "link"):
        r = results[mode]
        assert r["gb_per_s"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"], (mode, r)
        if mode != "link":  # where a read's time goes on the reader's thread
            assert set(r["phase_median_ms"]) == {"make", "post", "wait"}, (mode, r)
    # Every read of mode vmm took the same-host path; none of vmm_ucx did.
    assert results["vmm"]["same_host_reads"] == warmup + iters
    assert results["vmm_ucx"]["same_host_reads"] == 0
    assert results["of_link"]["link"] == 1.0
    assert results["vmm_over_stock"] == pytest.approx(
        results["vmm"]["gb_per_s"] / results["stock"]["gb_per_s"])


def test_profile_gives_the_readers_rows(tmp_path: Path):
    out = tmp_path / "nixl.json"
    cmd = [sys.executable, str(SCRIPT), "--kind", "host", "--block-bytes", "1024",
           "--num-blocks", "256", "--blocks-per-read", "64", "--warmup", "1", "--iters", "3",
           "--modes", "stock", "--profile", "--json", str(out)]
    done = run_in_own_session(cmd, env=dict(os.environ, **UCX_ENV), timeout=300,
                              what="bench_nixl_vmm.py")
    assert done.returncode == 0, done.stdout[-4000:]
    rows = json.loads(out.read_text())["stock"]["profile"]
    # The reader's NIXL calls of its timed reads, by own time, also printed.
    assert "Ordered by: internal time" in rows and "make_prepped_xfer" in rows, rows
    assert "the reader's reads under cProfile:" in done.stdout
