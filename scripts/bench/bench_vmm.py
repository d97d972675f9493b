#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Microbenchmark of the KV page table's map/unmap path.

For each backend it measures, in the same run:

* raw calls, one page at a time: Linux ``mmap(MAP_FIXED)`` of a memfd extent
  + ``mprotect`` (host) or ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``
  (CUDA), and the reverse for unmap;
* ``KVPageTable.map_pages([p])`` / ``unmap_pages([p])`` one page at a time;
* ``map_pages(all)`` / ``unmap_pages(all)`` in one call (batched);
* set-access per page versus one call over the whole run of pages;
* CUDA only: the GPU time of a fixed chain of matmuls alone, and while the
  host maps pages through the page table (does the driver's map path take
  time from running kernels, or can it hide behind them?).

Numbers are microseconds per page: the median over ``--repeats`` runs, with
min and max. Run it with the patched vLLM tree on PYTHONPATH, or, where vLLM
is not installed, from a checkout of this repository (it then imports the
package from ``vllm_overlay/``)::

    python scripts/bench/bench_vmm.py --backend host --json host.json
    python scripts/bench/bench_vmm.py --backend cuda --json cuda.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

try:
    import vllm.v1.kv_vmm  # noqa: F401
except ModuleNotFoundError:
    if "vllm" in sys.modules:
        raise SystemExit(
            "the installed vLLM has no vllm.v1.kv_vmm: put the patched tree on "
            "PYTHONPATH, or run where vLLM is not installed"
        ) from None
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vllm_overlay"))

import torch

from vllm.v1.kv_vmm import (
    HostVmmBackend,
    KVPageGeometry,
    KVPageTable,
    KVTensorLayout,
    VmmBackend,
)
from vllm.v1.kv_vmm import host as host_mod


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


class RawHost:
    """The OS calls the host backend makes, without the backend around them."""

    def __init__(self, granularity: int, num_pages: int) -> None:
        self.g = granularity
        self.fd = os.memfd_create("bench-raw", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, granularity * num_pages)
        self.va = host_mod._mmap(
            None,
            granularity * num_pages,
            host_mod._PROT_NONE,
            host_mod._MAP_PRIVATE | host_mod._MAP_ANONYMOUS | host_mod._MAP_NORESERVE,
            -1,
            0,
        )

    def map_only(self, i: int) -> None:
        host_mod._mmap(
            self.va + i * self.g, self.g, host_mod._PROT_NONE,
            host_mod._MAP_SHARED | host_mod._MAP_FIXED, self.fd, i * self.g,
        )  # fmt: skip

    def grant(self, i: int, num_pages: int) -> None:
        host_mod._mprotect(self.va + i * self.g, self.g * num_pages, host_mod._PROT_RW)

    def map_page(self, i: int) -> None:
        self.map_only(i)
        self.grant(i, 1)

    def unmap_page(self, i: int) -> None:
        va = self.va + i * self.g
        host_mod._mmap(
            va, self.g, host_mod._PROT_NONE,
            host_mod._MAP_PRIVATE | host_mod._MAP_ANONYMOUS | host_mod._MAP_FIXED
            | host_mod._MAP_NORESERVE, -1, 0,
        )  # fmt: skip
        host_mod._fallocate(
            self.fd,
            host_mod._FALLOC_FL_PUNCH_HOLE | host_mod._FALLOC_FL_KEEP_SIZE,
            i * self.g,
            self.g,
        )

    def close(self, num_pages: int) -> None:
        host_mod._munmap(self.va, self.g * num_pages)
        os.close(self.fd)


class RawCuda:
    """The driver calls the CUDA backend makes, without the backend around
    them."""

    def __init__(self, backend: VmmBackend, num_pages: int) -> None:
        from cuda.bindings import driver as drv

        self.drv = drv
        self.b = backend
        self.g = backend.granularity
        err, ptr = drv.cuMemAddressReserve(self.g * num_pages, self.g, 0, 0)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        self.va = int(ptr)
        self.handles: dict[int, object] = {}

    def map_only(self, i: int) -> None:
        drv = self.drv
        err, handle = drv.cuMemCreate(self.g, self.b._prop, 0)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        (err,) = drv.cuMemMap(self.va + i * self.g, self.g, 0, handle, 0)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        self.handles[i] = handle

    def grant(self, i: int, num_pages: int) -> None:
        drv = self.drv
        (err,) = drv.cuMemSetAccess(
            self.va + i * self.g, self.g * num_pages, self.b._access, 1
        )
        assert err == drv.CUresult.CUDA_SUCCESS, err

    def map_page(self, i: int) -> None:
        self.map_only(i)
        self.grant(i, 1)

    def unmap_page(self, i: int) -> None:
        drv = self.drv
        (err,) = drv.cuMemUnmap(self.va + i * self.g, self.g)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        (err,) = drv.cuMemRelease(self.handles.pop(i))
        assert err == drv.CUresult.CUDA_SUCCESS, err

    def close(self, num_pages: int) -> None:
        self.drv.cuMemAddressFree(self.va, self.g * num_pages)


def one_region_table(backend: VmmBackend, num_pages: int) -> KVPageTable:
    """A page table over one KV tensor of one region, one granule per page:
    one physical allocation per page."""
    g = backend.granularity
    geometry = KVPageGeometry(
        [KVTensorLayout(block_bytes=g)], num_blocks=num_pages, granularity=g
    )
    return KVPageTable(backend, geometry, max_pages=num_pages)


def bench(backend: VmmBackend, raw_cls: type, num_pages: int, repeats: int) -> dict:
    g = backend.granularity
    table = one_region_table(backend, num_pages)
    raw = RawHost(g, num_pages) if raw_cls is RawHost else RawCuda(backend, num_pages)
    pages = range(num_pages)
    samples: dict[str, list[float]] = {}

    def add(name: str, total_us: float) -> None:
        samples.setdefault(name, []).append(total_us / num_pages)

    # The backend's own calls (validation and handle bookkeeping
    # included), without the page table around them.
    handles: dict[int, object] = {}

    def backend_map(i: int) -> None:
        handles[i] = backend.create(g)
        backend.map(raw.va + i * g, g, handles[i])
        backend.set_access(raw.va + i * g, g)

    def backend_unmap(i: int) -> None:
        backend.unmap(raw.va + i * g, g)
        backend.release(handles.pop(i))

    # One untimed round warms caches, the memfd and the driver's pools.
    for run in range(repeats + 1):
        record = add if run else (lambda name, us: None)
        record(
            "raw map, per page", sum(_timed(lambda i=i: raw.map_page(i)) for i in pages)
        )
        record(
            "raw unmap, per page",
            sum(_timed(lambda i=i: raw.unmap_page(i)) for i in pages),
        )
        record(
            "backend calls map, per page",
            sum(_timed(lambda i=i: backend_map(i)) for i in pages),
        )
        record(
            "backend calls unmap, per page",
            sum(_timed(lambda i=i: backend_unmap(i)) for i in pages),
        )
        record(
            "page table map, per page",
            sum(_timed(lambda i=i: table.map_pages([i])) for i in pages),
        )
        record(
            "page table unmap, per page",
            sum(_timed(lambda i=i: table.unmap_pages([i])) for i in pages),
        )
        record("page table map, batched", _timed(lambda: table.map_pages(pages)))
        record("page table unmap, batched", _timed(lambda: table.unmap_pages(pages)))
        # Access grants on freshly mapped pages (granting it again on pages
        # that already have it is a cheaper, different operation).
        for i in pages:
            raw.map_only(i)
        record(
            "raw set access, per page",
            sum(_timed(lambda i=i: raw.grant(i, 1)) for i in pages),
        )
        for i in pages:
            raw.unmap_page(i)
            raw.map_only(i)
        record("raw set access, batched", _timed(lambda: raw.grant(0, num_pages)))
        for i in pages:
            raw.unmap_page(i)
    raw.close(num_pages)
    table.close()
    return {
        name: {
            "median_us": statistics.median(v),
            "min_us": min(v),
            "max_us": max(v),
            "runs": len(v),
        }
        for name, v in samples.items()
    }


def gpu_overlap(backend: VmmBackend, num_pages: int, repeats: int) -> dict:
    """GPU time of a chain of matmuls alone, and while the host maps
    ``num_pages`` pages through the page table, one call per page, right after
    launching it (as a step's page changes are applied while the previous
    step still runs). A ratio near 1: mapping hides behind the GPU's work;
    above 1: the map calls hold up running kernels."""
    table = one_region_table(backend, num_pages)
    pages = range(num_pages)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )

    def map_all() -> float:
        us = sum(_timed(lambda i=i: table.map_pages([i])) for i in pages)
        return us / 1e3

    def gpu_ms(num_mm: int, mapping: bool) -> tuple[float, float]:
        torch.cuda.synchronize()
        start.record()
        for _ in range(num_mm):
            torch.mm(a, a, out=c)
        end.record()
        host_ms = map_all() if mapping else 0.0
        end.synchronize()
        if mapping:
            table.unmap_pages(pages)
        return start.elapsed_time(end), host_ms

    # Untimed: warm-up, then size the GPU work to five times the host's map
    # time, so that the map calls all fall inside it.
    host_ms = max(gpu_ms(8, True)[1], gpu_ms(8, True)[1])
    per_mm = gpu_ms(50, False)[0] / 50
    num_mm = min(1000, max(50, round(5 * host_ms / per_mm)))
    alone: list[float] = []
    mapping: list[float] = []
    host: list[float] = []
    for _ in range(repeats):
        alone.append(gpu_ms(num_mm, False)[0])
        gpu, h = gpu_ms(num_mm, True)
        mapping.append(gpu)
        host.append(h)
    table.close()
    return {
        "pages": num_pages,
        "matmuls": num_mm,
        "gpu_ms_alone": statistics.median(alone),
        "gpu_ms_while_mapping": statistics.median(mapping),
        "host_map_ms": statistics.median(host),
        "host_map_within_gpu_work": max(host) < min(alone),
        "ratio gpu while mapping/alone (median)": statistics.median(mapping)
        / statistics.median(alone),
        "runs": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["host", "cuda", "all"], default="all")
    parser.add_argument("--pages", type=int, default=64, help="pages per run")
    parser.add_argument("--repeats", type=int, default=11, help="timed runs")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    kinds = ["host", "cuda"] if args.backend == "all" else [args.backend]
    results: dict = {
        "pages": args.pages,
        "repeats": args.repeats,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backends": {},
    }
    for kind in kinds:
        if kind == "host":
            backend: VmmBackend = HostVmmBackend()
            raw_cls: type = RawHost
        else:
            if not torch.cuda.is_available():
                print("no CUDA device: CUDA backend not measured", file=sys.stderr)
                continue
            from vllm.v1.kv_vmm.cuda import CudaVmmBackend

            torch.cuda.init()
            backend = CudaVmmBackend(0)
            raw_cls = RawCuda
            results["gpu"] = torch.cuda.get_device_name(0)
        stats = bench(backend, raw_cls, args.pages, args.repeats)
        if kind == "cuda":
            stats["overlap"] = gpu_overlap(backend, args.pages, args.repeats)
        backend.close()
        stats["ratio map/raw (median)"] = (
            stats["page table map, per page"]["median_us"]
            / stats["raw map, per page"]["median_us"]
        )
        stats["ratio unmap/raw (median)"] = (
            stats["page table unmap, per page"]["median_us"]
            / stats["raw unmap, per page"]["median_us"]
        )
        results["backends"][kind] = {"granularity": backend.granularity, **stats}

    for kind, stats in results["backends"].items():
        print(
            f"\n{kind} backend: {stats['granularity'] >> 20} MiB pages, "
            f"{args.pages} pages a run, {args.repeats} runs"
        )
        print("| operation | median us/page | min | max |")
        print("|---|---:|---:|---:|")
        for name, s in stats.items():
            if isinstance(s, dict) and "median_us" in s:
                print(
                    f"| {name} | {s['median_us']:.2f} | {s['min_us']:.2f} | "
                    f"{s['max_us']:.2f} |"
                )
        for name in ("ratio map/raw (median)", "ratio unmap/raw (median)"):
            print(f"| {name} | {stats[name]:.2f} | | |")
        if "overlap" in stats:
            o = stats["overlap"]
            print(
                f"GPU work ({o['matmuls']} matmuls): {o['gpu_ms_alone']:.2f} ms alone, "
                f"{o['gpu_ms_while_mapping']:.2f} ms while the host maps {o['pages']} "
                f"pages in {o['host_map_ms']:.2f} ms (ratio "
                f"{o['ratio gpu while mapping/alone (median)']:.3f})"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
