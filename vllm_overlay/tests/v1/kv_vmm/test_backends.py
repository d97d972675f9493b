# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Backend-specific behaviour: physical memory really goes back on release,
and CUDA allocations are exportable for KV transfer where the device allows."""

import os

import pytest
import torch

from tests.v1.kv_vmm.utils import requires_cuda_vmm
from vllm.v1.kv_vmm import (
    HostVmmBackend,
    KVPageGeometry,
    KVPageTable,
    KVTensorLayout,
)


def test_host_unmap_returns_memory_to_the_kernel():
    backend = HostVmmBackend()
    g = backend.granularity
    geometry = KVPageGeometry([KVTensorLayout(g)], num_blocks=4, granularity=g)
    table = KVPageTable(backend, geometry, max_pages=4)

    def resident_bytes() -> int:
        return os.fstat(backend._fd).st_blocks * 512

    table.map_pages([0, 1, 2])
    table.tensors[0][: 3 * g].fill_(7)  # touch: memory is allocated on use
    assert resident_bytes() >= 3 * g
    table.unmap_pages([0, 2])
    assert resident_bytes() == g
    # A released extent is reused and reads as zeros.
    table.map_pages([3])
    page3 = table.tensors[0][3 * g : 4 * g]
    assert not page3.any()
    assert bool((table.tensors[0][g : 2 * g] == 7).all())
    table.close()
    assert resident_bytes() == 0
    backend.close()


def test_host_rejects_misaligned_sizes():
    backend = HostVmmBackend(granularity=64 * 1024)
    with pytest.raises(ValueError, match="granularity"):
        backend.reserve(1000)
    with pytest.raises(ValueError, match="OS page size"):
        HostVmmBackend(granularity=1000)
    backend.close()


@pytest.mark.gpu
@requires_cuda_vmm
def test_cuda_allocations_exportable():
    from vllm.v1.kv_vmm.cuda import CudaVmmBackend

    backend = CudaVmmBackend(torch.device("cuda", 0))
    assert backend.granularity % (2 << 20) == 0
    handle = backend.create(backend.granularity)
    if backend.fd_exportable:
        fd = backend.export_fd(handle)
        try:
            assert os.fstat(fd) is not None
        finally:
            os.close(fd)
    backend.release(handle)
    backend.close()
