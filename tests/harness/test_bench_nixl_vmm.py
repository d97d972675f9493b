"""scripts/bench/bench_nixl_vmm.py's report without NIXL: each mode measured as GB/s, its
fraction of the link and the VMM/stock ratio (tests/engine/test_bench_nixl_vmm.py runs every
mode on real NIXL agents, marked slow).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts")]

import bench_nixl_vmm  # noqa: E402


def test_the_summary_gives_each_mode_measured_as_a_fraction_of_the_link():
    def r(gbps: float) -> dict:
        return {"gb_per_s": gbps, "median_ms": 1.0, "min_ms": 0.5, "max_ms": 2.0}

    results = {"stock": r(10.0), "vmm": r(40.0), "link": r(50.0)}
    lines = bench_nixl_vmm.summary(results, ["stock", "vmm", "vmm_ucx", "link"])
    assert results["of_link"] == {"stock": 0.2, "vmm": 0.8, "link": 1.0}
    assert results["vmm_over_stock"] == pytest.approx(4.0)
    assert lines[0].startswith("stock  :    10.00 GB/s") and "0.200 of the link" in lines[0]
    assert [line.split(":")[0].strip() for line in lines] == ["stock", "vmm", "link",
                                                              "vmm/stock"]
    # Without the link (or without stock) there is nothing to divide by.
    partial = {"vmm": r(40.0)}
    assert bench_nixl_vmm.summary(partial, ["stock", "vmm"]) == [
        "vmm    :    40.00 GB/s  (median 1.00 ms, min 0.50, max 2.00 per read)"]
    assert "of_link" not in partial and "vmm_over_stock" not in partial
