# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Backend-specific behaviour: physical memory really goes back on release,
and CUDA allocations are exportable for KV transfer where the device allows."""

import os
from unittest import mock

import pytest
import torch

from tests.v1.kv_vmm.utils import requires_cuda_vmm
from vllm.v1.kv_vmm import (
    HostVmmBackend,
    KVPageGeometry,
    KVPageTable,
    KVTensorLayout,
    VmmError,
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
    g = backend.granularity
    assert g % (2 << 20) == 0
    handle = backend.create(g)
    if not backend.fd_exportable:
        backend.release(handle)
        backend.close()
        pytest.skip("the device cannot export allocations as POSIX fds")
    drv = backend._drv
    va = backend.reserve(g)
    backend.map(va, g, handle)
    backend.set_access(va, g)
    pattern = torch.arange(g, dtype=torch.int64, device=backend.device) % 251
    backend.tensor(va, g).copy_(pattern.to(torch.uint8))
    backend.synchronize()
    # What a peer does with the fd: import it and map it at its own address.
    # It must be the same physical memory, so it reads what was written above.
    fd = backend.export_fd(handle)
    try:
        imported = backend._check(
            drv.cuMemImportFromShareableHandle(
                fd,
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ),
            "cuMemImportFromShareableHandle",
        )
    finally:
        os.close(fd)
    va2 = backend.reserve(g)
    try:
        backend.map(va2, g, imported)
        backend.set_access(va2, g)
        seen = backend.tensor(va2, g).to(torch.int64)
        assert torch.equal(seen, pattern)
        backend.synchronize()
        backend.unmap(va2, g)
    finally:
        backend._check(drv.cuMemRelease(imported), "cuMemRelease")
        backend.free_reservation(va2, g)
    backend.close()


def _fake_driver(current_ctx: int, retain_ok: bool = True) -> mock.MagicMock:
    """cuda.bindings.driver as far as CudaVmmBackend's constructor and close()
    use it: every call succeeds (result 0) unless told otherwise."""
    drv = mock.MagicMock()
    drv.CUresult.CUDA_SUCCESS = 0
    drv.cuGetErrorName.return_value = (0, b"CUDA_ERROR_INVALID_DEVICE")
    drv.cuInit.return_value = (0,)
    drv.cuDeviceGet.return_value = (0, "dev0")
    drv.cuDevicePrimaryCtxRetain.return_value = (0, "primary") if retain_ok else (101,)
    drv.cuCtxGetCurrent.return_value = (0, current_ctx)
    drv.cuCtxSetCurrent.return_value = (0,)
    drv.cuDeviceGetAttribute.return_value = (0, 0)
    drv.cuMemGetAllocationGranularity.return_value = (0, 2 << 20)
    drv.cuDevicePrimaryCtxRelease.return_value = (0,)
    return drv


@pytest.mark.parametrize("current_ctx", [0, 0x1234])
def test_cuda_backend_uses_the_primary_context_and_never_makes_one(
    monkeypatch, current_ctx
):
    """The properties the context comment in cuda.py rests on: the device's
    primary context is retained (never a new one created), made current only
    on a thread without a context, and released once on close."""
    from vllm.v1.kv_vmm import cuda

    drv = _fake_driver(current_ctx)
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    backend = cuda.CudaVmmBackend("cuda:0")
    drv.cuDevicePrimaryCtxRetain.assert_called_once_with("dev0")
    assert drv.cuCtxCreate.call_count == 0
    if current_ctx:
        drv.cuCtxSetCurrent.assert_not_called()
    else:
        drv.cuCtxSetCurrent.assert_called_once_with("primary")
    drv.cuDevicePrimaryCtxRelease.assert_not_called()
    backend.close()
    backend.close()
    drv.cuDevicePrimaryCtxRelease.assert_called_once_with("dev0")


def test_cuda_backend_names_the_failing_driver_call(monkeypatch):
    from vllm.v1.kv_vmm import cuda

    drv = _fake_driver(0, retain_ok=False)
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    with pytest.raises(VmmError, match="cuDevicePrimaryCtxRetain failed on cuda:0"):
        cuda.CudaVmmBackend("cuda:0")
    drv.cuCtxSetCurrent.assert_not_called()
