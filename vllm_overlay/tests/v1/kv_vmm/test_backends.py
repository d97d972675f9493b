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
    va = backend.reserve(g)
    backend.map(va, g, handle)
    backend.set_access(va, g)
    pattern = torch.arange(g, dtype=torch.int64, device=backend.device) % 251
    backend.tensor(va, g).copy_(pattern.to(torch.uint8))
    backend.synchronize()
    # What a peer does with the fd: import it and map it at its own address.
    # It must be the same physical memory, so it reads what was written above.
    fd, offset = backend.export_chunk(handle)
    try:
        imported = backend.import_chunk(fd, offset, g)
    finally:
        os.close(fd)
    try:
        seen = backend.tensor(imported.addr, g).to(torch.int64)
        assert torch.equal(seen, pattern)
        backend.synchronize()
    finally:
        backend.unmap_import(imported)
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


def test_host_chunks_are_exported_and_imported_read_only():
    """A peer maps an exported extent (here this process itself): it sees
    the owner's bytes; an extent past the file's end or off a page is
    refused with the reason, never mapped to fault later."""
    backend = HostVmmBackend()
    g = backend.granularity
    handle = backend.create(g)
    va = backend.reserve(g)
    backend.map(va, g, handle)
    backend.set_access(va, g)
    backend.tensor(va, g).fill_(7)
    fd, offset = backend.export_chunk(handle)
    try:
        chunk = backend.import_chunk(fd, offset, g)
        assert bool((backend.tensor(chunk.addr, g) == 7).all())
        backend.unmap_import(chunk)
        with pytest.raises(VmmError, match="ends past its file"):
            backend.import_chunk(fd, offset + g, g)
        with pytest.raises(VmmError, match="page-aligned"):
            backend.import_chunk(fd, 1, g)
    finally:
        os.close(fd)
    backend.unmap(va, g)
    backend.free_reservation(va, g)
    backend.release(handle)
    with pytest.raises(VmmError, match="no allocation"):
        backend.export_chunk(handle)
    assert backend.copy_stream() is None
    backend.close()


def _fake_import_driver() -> mock.MagicMock:
    drv = _fake_driver(0)
    for call in ("cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"):
        getattr(drv, call).return_value = (0,)
    drv.cuMemAddressFree.return_value = (0,)
    drv.cuMemImportFromShareableHandle.return_value = (0, "imported")
    drv.cuMemAddressReserve.return_value = (0, 0x7000)
    return drv


def test_cuda_import_binds_the_thread_and_gives_back_what_a_failure_left(
    monkeypatch,
):
    """The driver calls of CudaVmmBackend.import_chunk/unmap_import, on a
    fake driver (no GPU here; the GPU test above maps a real one): the
    primary context is made current on a thread without one, and a failed
    map releases the reservation and the imported handle."""
    from vllm.v1.kv_vmm import cuda
    from vllm.v1.kv_vmm.backend import ImportedChunk

    drv = _fake_import_driver()
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    backend = cuda.CudaVmmBackend("cuda:0")
    drv.cuCtxSetCurrent.reset_mock()
    n = 2 << 20
    chunk = backend.import_chunk(5, 0, n)
    assert chunk == ImportedChunk(0x7000, n, "imported")
    drv.cuCtxSetCurrent.assert_called_once_with("primary")
    drv.cuMemMap.assert_called_once_with(0x7000, n, 0, "imported", 0)
    backend.unmap_import(chunk)
    drv.cuMemUnmap.assert_called_once_with(0x7000, n)
    drv.cuMemRelease.assert_called_once_with("imported")
    drv.cuMemAddressFree.assert_called_once_with(0x7000, n)

    drv.cuMemRelease.reset_mock()
    drv.cuMemAddressFree.reset_mock()
    drv.cuMemMap.return_value = (1,)
    with pytest.raises(VmmError, match="cuMemMap failed"):
        backend.import_chunk(5, 0, n)
    drv.cuMemAddressFree.assert_called_once_with(0x7000, n)
    drv.cuMemRelease.assert_called_once_with("imported")
    backend.close()


def test_cuda_copy_stream_batches_copies_and_polls_events(monkeypatch):
    """CudaVmmBackend.copy_stream on a fake driver: one cuMemcpyBatchAsync per
    call (one cuMemcpyAsync per run with bindings that have no batch), an
    event per record, NOT_READY as "not yet"."""
    import numpy as np

    from vllm.v1.kv_vmm import cuda

    drv = _fake_driver(0)
    drv.cuStreamCreate.return_value = (0, 0x55)
    drv.cuMemcpyBatchAsync.return_value = (0,)
    drv.cuMemcpyAsync.return_value = (0,)
    drv.CUdeviceptr = lambda x: ("ptr", x)
    drv.cuEventCreate.return_value = (0, "event")
    drv.cuEventRecord.return_value = (0,)
    drv.cuEventDestroy.return_value = (0,)
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    backend = cuda.CudaVmmBackend("cuda:0")
    runs = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64)
    stream = backend.copy_stream()
    assert stream.handle == 0x55
    stream.copy(runs)
    args = drv.cuMemcpyBatchAsync.call_args.args
    assert args[:4] == ([("ptr", 1), ("ptr", 4)], [("ptr", 2), ("ptr", 5)], [3, 6], 2)
    assert args[-1] == 0x55
    event = stream.record()
    drv.cuEventRecord.assert_called_once_with("event", 0x55)
    drv.cuEventQuery.return_value = (drv.CUresult.CUDA_ERROR_NOT_READY,)
    assert not stream.query(event)
    drv.cuEventQuery.return_value = (0,)
    assert stream.query(event)
    stream.free(event)
    drv.cuEventDestroy.assert_called_once_with("event")

    del drv.cuMemcpyBatchAsync  # bindings before CUDA 12.8
    backend.copy_stream().copy(runs)
    assert [c.args for c in drv.cuMemcpyAsync.call_args_list] == [
        (1, 2, 3, 0x55),
        (4, 5, 6, 0x55),
    ]
    backend.close()
