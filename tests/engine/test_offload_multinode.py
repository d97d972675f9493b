# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-node CPU offload pool on two nodes (TP4 as 2 nodes x 2 ranks).

vLLM's CPU backend cannot run this: its platform refuses to build the CPU
offloading worker, and the shared /dev/shm region is only used on CUDA/XPU
platforms. So the test exercises the sizing and shared-region logic
directly, with real processes: each node is a process tree in its own mount
namespace with a private tmpfs on /dev/shm (separate hosts' /dev/shm), and
the four ranks share one gloo group over TCP, whose barrier is the region's
creator/joiner barrier as in vLLM's workers.

Checks: both nodes get cpu_bytes_to_use // (page * local_world_size) chunks
(twice the single-node-of-four figure), each node's region is exactly the
per-node budget and holds only its own ranks' slots, every slot is written
by the right rank, and no rank waits on the other node's region file.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench_server import free_port

HERE = Path(__file__).resolve().parent
PAGE = mmap.PAGESIZE
NNODES = 2
LOCAL_WORLD_SIZE = 2
CPU_BYTES = 256 * PAGE


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs mount namespaces (unshare -m)")
def test_two_nodes_size_and_fill_node_local_regions(tmp_path: Path):
    port = free_port()
    env = dict(os.environ)
    nodes = []
    for node in range(NNODES):
        report = tmp_path / f"node{node}.json"
        script = (
            "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "
            f"{sys.executable} {HERE / 'offload_node.py'} --node {node} "
            f"--nnodes {NNODES} --local-world-size {LOCAL_WORLD_SIZE} "
            f"--port {port} --cpu-bytes {CPU_BYTES} --report {report}"
        )
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        nodes.append((proc, report))

    reports = []
    for proc, report in nodes:
        # A rank waiting for a region file on the other node would hang here.
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        reports.append(json.loads(report.read_text()))

    expected_chunks = CPU_BYTES // (PAGE * LOCAL_WORLD_SIZE)
    for node, report in enumerate(reports):
        assert report["num_chunks"] == expected_chunks
        assert report["region_bytes"] == CPU_BYTES
        assert report["page_bytes"] == PAGE
        # Every row holds exactly this node's ranks, each in its own slot.
        first_rank = node * LOCAL_WORLD_SIZE
        assert report["slot_values"] == [
            [first_rank + 1 + i for i in range(LOCAL_WORLD_SIZE)]
        ]
        assert report["uniform_slots"]
        # The region was unlinked after all ranks mapped it: nothing leaks.
        assert not [f for f in report["shm_files"] if f.startswith("vllm_offload")]
