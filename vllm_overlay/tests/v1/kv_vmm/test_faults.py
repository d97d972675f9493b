# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An access to an unmapped KV page must fault, never read stale memory (on
the host backend; test_cuda_backend.py has the CUDA case)."""

import faulthandler
import os
import signal

from vllm.v1.kv_vmm import HostVmmBackend, KVPageGeometry, KVPageTable, KVTensorLayout


def _read_in_forked_child(table: KVPageTable, page: int) -> int:
    """Read one byte of ``page`` in a forked child; return how it ended."""
    offset = table.geometry.region_offset(0, 0, page)
    pid = os.fork()
    if pid == 0:  # child: read, then exit without running pytest's teardown
        faulthandler.disable()  # the fault is expected: no traceback dump
        int(table.tensors[0][offset])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return status


def test_host_unmapped_page_faults():
    backend = HostVmmBackend()
    geometry = KVPageGeometry(
        [KVTensorLayout(block_bytes=1 << 20)],
        num_blocks=8,
        granularity=backend.granularity,
    )
    table = KVPageTable(backend, geometry, max_pages=4)
    table.map_pages([0, 1])
    table.unmap_pages([1])

    status = _read_in_forked_child(table, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    for page in (1, 2):  # unmapped, and never mapped
        status = _read_in_forked_child(table, page)
        assert os.WIFSIGNALED(status), f"page {page}: status {status}"
        assert os.WTERMSIG(status) == signal.SIGSEGV
    table.close()
    backend.close()
