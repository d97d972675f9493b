# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An access to an unmapped KV page must fault, never read stale memory."""

import faulthandler
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.v1.kv_vmm.utils import requires_cuda_vmm
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


_CUDA_CHILD = textwrap.dedent(
    """
    import sys, torch
    from vllm.v1.kv_vmm import KVPageGeometry, KVPageTable, KVTensorLayout
    from vllm.v1.kv_vmm.cuda import CudaVmmBackend
    backend = CudaVmmBackend(0)
    geometry = KVPageGeometry([KVTensorLayout(block_bytes=1 << 20)], num_blocks=8,
                              granularity=backend.granularity)
    table = KVPageTable(backend, geometry, max_pages=4)
    table.map_pages([0, 1])
    table.unmap_pages([1])
    page = int(sys.argv[1])
    offset = geometry.region_offset(0, 0, page)
    table.tensors[0][offset : offset + 4096].fill_(1)
    torch.accelerator.synchronize()
    print("ACCESS OK")
    """
)


@pytest.mark.gpu
@requires_cuda_vmm
def test_cuda_unmapped_page_faults():
    # A device fault poisons the CUDA context: run each access in its own
    # process.
    def run(page: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _CUDA_CHILD, str(page)],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )

    ok = run(0)
    assert ok.returncode == 0 and "ACCESS OK" in ok.stdout, ok.stderr
    for page in (1, 2):
        bad = run(page)
        assert bad.returncode != 0 and "ACCESS OK" not in bad.stdout
        assert "illegal" in bad.stderr.lower(), bad.stderr
