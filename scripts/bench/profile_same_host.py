#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host time of a same-host KV read on the reader's thread, on a machine without a GPU.

A same-host read (NixlConnector's decode instance reading a prefill instance's VMM-backed KV
on the same host) spends host time before its device copy starts: ``make_prepped_xfer``
(descriptor ids to addresses in the producer's chunks mapped here, the copy runs) and
``transfer`` (the copy kernel's words written into a pinned buffer, a CUDA graph launched).
On a GPU host that time adds to the copy's, so it decides how close a read gets to the link.

This script builds the reader's side the way ``bench_nixl_vmm.py --kind cuda`` does for its
``vmm`` mode, in one process: a producer's host VMM page table (memfd pages) shared through a
real ChunkExporter, a reader with SameHostReads over the same-host channel, the
SegmentedXferAgent with a NixlSegmentRegistry, descriptor lists prepared once, and reads of
random block ids. What stands in for the device: the copy kernel's launcher is the real
RunCopier with its upload slots in host memory and driver calls that return at once, and
the copy stream's events complete at once; nothing is copied (the reader's descriptors name
addresses that are never touched). So each phase is the Python and NumPy work the GPU host
does on the reader's thread, minus the driver calls themselves (in ``transfer``: an event
wait, the graph launch, two event records, the current-context check and an event query;
one event query per poll).

Prints per shape the median [min..max] of each phase in microseconds (make, post, poll
until done, release) over ``--reads`` reads after ``--warmup``, over ``--repeats``
interleaved repetitions (each repetition's median); ``--profile`` adds cProfile's rows
of one repetition's reads by own time.

    python scripts/bench/profile_same_host.py                      # both shapes
    python scripts/bench/profile_same_host.py --shapes prompt --profile

Shapes: ``random``: 512 random blocks of 256 KiB out of 2048 (the default read of
``bench_nixl_vmm.py``); ``prompt``: 16,000 random blocks of 32 KiB out of 32,768 (one
4000-token prompt of a Llama-3.1-8B). Run with the patched vLLM tree importable (its
virtualenv's python).
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nixl_vmm import profile_rows, timed_read  # noqa: E402

SHAPES = {"random": (256 << 10, 2048, 512), "prompt": (32 << 10, 32768, 16000)}
PHASES = ("make", "post", "poll", "release")


class _Driver:
    """CUDA driver calls of the copy kernel's launch, each returning success at once."""

    class CUresult:
        CUDA_SUCCESS = 0

    @staticmethod
    def cuEventSynchronize(event: Any) -> tuple:
        return (0,)

    @staticmethod
    def cuGraphLaunch(graph: Any, stream: int) -> tuple:
        return (0,)

    @staticmethod
    def cuEventRecord(event: Any, stream: int) -> tuple:
        return (0,)

    @staticmethod
    def cuGraphExecDestroy(graph: Any) -> tuple:
        return (0,)

    @staticmethod
    def cuEventDestroy(event: Any) -> tuple:
        return (0,)


class _Stream:
    """A device copy stream whose events complete at their second query (as on a device:
    the poll in ``transfer`` finds the copy in flight, the next one finds it over)."""

    handle = 1

    def copy(self, runs: np.ndarray) -> None:
        raise AssertionError("the copy kernel takes every read of these shapes")

    def record(self) -> object:
        return [0]

    def query(self, event: object) -> bool:
        assert isinstance(event, list)
        event[0] += 1
        return event[0] > 1

    def wait(self, event: object) -> None:
        pass

    def free(self, event: object) -> None:
        pass


def _run_copier() -> Any:
    """The real RunCopier without a device: upload slots in host memory, captured graphs
    stood in for, a driver that returns at once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import cuda_copy

    copier = cuda_copy.RunCopier.__new__(cuda_copy.RunCopier)
    copier._drv = _Driver()
    copier.device = torch.device("cpu")
    copier.graphs = True
    copier._slots = {}
    copier._turns = {}
    copier._streams = {}
    copier._lock = threading.Lock()
    copier._base = torch.zeros(4, dtype=torch.int64)
    copier._base_addr = 1 << 40
    copier._max_programs = 66
    for capacity in (1 << 10, 1 << 14):  # the size classes of both shapes' reads
        copier._slots[(_Stream.handle, capacity)] = [
            cuda_copy._Slot(capacity=capacity,
                            host=torch.empty(1 + 3 * capacity, dtype=torch.int64),
                            device=torch.empty(1 + 3 * capacity, dtype=torch.int64),
                            used=object(), graph=object())
            for _ in range(cuda_copy._UPLOAD_SLOTS)
        ]
    return copier


class _Agent:
    """The NIXL agent's calls the reader's side makes on this path."""

    def get_reg_descs(self, descs: Any, mem_type: str) -> list:
        return list(descs)

    def register_memory(self, descs: Any, backends: Any = None) -> None:
        pass

    def deregister_memory(self, descs: Any, backends: Any = None) -> None:
        pass

    def send_notif(self, agent_name: Any, notif_msg: bytes = b"") -> None:
        pass


class Side:
    """A producer sharing ``num_blocks`` blocks of ``block_bytes`` and a reader of them."""

    def __init__(self, block_bytes: int, num_blocks: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent import (
            SegmentedXferAgent,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import DeviceCopier
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
            ChunkExporter,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.registry import (
            NixlSegmentRegistry,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.same_host import (
            SameHostReads,
        )
        from vllm.v1.kv_vmm import HostVmmBackend, KVPageGeometry, KVPageTable, KVTensorLayout

        nbytes = block_bytes * num_blocks
        self.backend = HostVmmBackend()
        geometry = KVPageGeometry([KVTensorLayout(block_bytes=nbytes, num_regions=1)],
                                  num_blocks=1, granularity=self.backend.granularity)
        self.table = KVPageTable(self.backend, geometry, max_pages=geometry.num_pages)
        self.name = f"producer-{uuid.uuid4()}"
        secret = channel.new_secret()
        self.exporter = ChunkExporter(self.name, secret)
        self.exporter.attach(self.table)
        self.table.map_pages(range(geometry.num_pages))
        self.reader_backend = HostVmmBackend()
        self.reads = SameHostReads(self.reader_backend, DeviceCopier(_Stream(), _run_copier()),
                                   "reader")
        agent = _Agent()
        self.xfer = SegmentedXferAgent(agent, NixlSegmentRegistry(agent, "VRAM", 0),
                                       same_host=self.reads)
        if not self.reads.offer(self.name, secret):
            raise SystemExit("the same-host channel did not open")
        importer = self.reads.importer(self.name)
        deadline = time.monotonic() + 30
        while importer.num_mapped < len(self.exporter_chunks()):
            if time.monotonic() > deadline:
                raise SystemExit("the producer's chunks were not mapped in 30 s")
            time.sleep(0.01)
        base = self.table.tensors[0].data_ptr()
        remote = np.array([(base + b * block_bytes, block_bytes, 0)
                           for b in range(num_blocks)], dtype=np.uint64)
        local_base = 1 << 41  # the reader's KV: addresses only, never touched
        local = np.array([(local_base + b * block_bytes, block_bytes, 0)
                          for b in range(num_blocks)], dtype=np.uint64)
        self.local = self.xfer.prep_xfer_dlist("NIXL_INIT_AGENT",
                                               self.xfer.get_xfer_descs(local, "VRAM"))
        self.remote = self.xfer.prep_xfer_dlist(self.name,
                                                self.xfer.get_xfer_descs(remote, "VRAM"))

    def exporter_chunks(self) -> list:
        return [c for s in self.table.segments() for c in s.chunks]

    def read(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[float, ...]:
        """One read (as bench_nixl_vmm.py times it); the nanoseconds of each phase."""
        handle, state, (t0, t1, t2, t3) = timed_read(
            self.xfer, self.local, local_ids, self.remote, remote_ids, notif_msg=b"req")
        self.xfer.release_xfer_handle(handle)
        t4 = time.perf_counter()
        if state != "DONE":
            raise SystemExit(f"a read ended in state {state}")
        return tuple((b - a) * 1e9 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4)))

    def close(self) -> None:
        self.reads.close()
        self.reader_backend.close()
        self.exporter.close()
        self.table.close()
        self.backend.close()


def _repetition(side: Side, shape: tuple[int, int, int], reads: int, warmup: int,
                seed: int) -> list[float]:
    """Median microseconds of each phase over ``reads`` reads after ``warmup``; each read's
    block ids are drawn just before it (as ``bench_nixl_vmm.py`` does: in the cache, as
    the connector's are), the same ones in every repetition."""
    _, num_blocks, per_read = shape
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(warmup + reads):
        local_ids = rng.choice(num_blocks, per_read, replace=False)
        remote_ids = rng.choice(num_blocks, per_read, replace=False)
        times.append(side.read(local_ids, remote_ids))
    return [statistics.median(t[p] for t in times[warmup:]) / 1e3 for p in range(len(PHASES))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="random,prompt")
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one more repetition per shape")
    parser.add_argument("--sort", default="tottime", help="cProfile's order (tottime, cumtime)")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    sides = {s: Side(*SHAPES[s][:2]) for s in shapes}
    results: dict[str, list[list[float]]] = {s: [] for s in shapes}
    try:
        for _ in range(args.repeats):
            for s in shapes:  # interleaved
                results[s].append(_repetition(sides[s], SHAPES[s], args.reads, args.warmup, 0))
        for s in shapes:
            block_bytes, num_blocks, per_read = SHAPES[s]
            print(f"{s}: {per_read} random blocks of {block_bytes >> 10} KiB out of "
                  f"{num_blocks}, {args.reads} reads x {args.repeats} repetitions (us)")
            for p, phase in enumerate(PHASES):
                meds = [r[p] for r in results[s]]
                print(f"  {phase:8s} {statistics.median(meds):9.1f} "
                      f"[{min(meds):.1f}..{max(meds):.1f}]")
            total = [r[0] + r[1] for r in results[s]]
            print(f"  make+post {statistics.median(total):8.1f} "
                  f"[{min(total):.1f}..{max(total):.1f}]")
        if args.profile:
            for s in shapes:
                prof = cProfile.Profile()
                prof.enable()
                _repetition(sides[s], SHAPES[s], args.reads, args.warmup, 0)
                prof.disable()
                print(f"--- {s}: cProfile, by {args.sort}")
                print(profile_rows(prof, args.sort, rows=25))
    finally:
        for side in sides.values():
            side.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
