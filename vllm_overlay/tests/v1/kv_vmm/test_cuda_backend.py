# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CudaVmmBackend: the page table's tests (test_page_table.py, here with the
``backend`` fixture of this module), an access to an unmapped page and the
export of an allocation, on a real device (GPU hosts only); the driver calls
of the context, import and copy stream on a fake driver (everywhere)."""

import ctypes
import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest
import torch

from tests.v1.kv_vmm import test_page_table
from tests.v1.kv_vmm.cuda_utils import requires_cuda_vmm
from tests.v1.kv_vmm.test_page_table import (  # noqa: F401 (run here on CUDA)
    test_budget_refusal_changes_nothing,
    test_data_survives_other_pages_mapping,
    test_failing_deregistration_keeps_memory_mapped,
    test_map_unmap_idempotent_and_accounting,
    test_segment_callbacks_order,
    test_views_address_same_bytes_as_reference,
)
from vllm.v1.kv_vmm import VmmBackend, VmmError, cuda
from vllm.v1.kv_vmm.backend import ImportedChunk


@pytest.fixture(
    params=[pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda_vmm])]
)
def backend() -> Iterator[VmmBackend]:
    """The page table tests imported above run on device 0's CUDA backend
    (this overrides conftest.py's host backend); the param's marks skip them
    without a GPU."""
    b = cuda.CudaVmmBackend(torch.device("cuda", 0))
    yield b
    b.close()


def test_every_page_table_test_of_a_backend_runs_on_cuda():
    """A test added to test_page_table.py that takes ``backend`` is imported
    here too, so it runs on the CUDA backend as well as on the host's."""
    takes_backend = {
        name
        for name, fn in vars(test_page_table).items()
        if name.startswith("test_")
        and callable(fn)
        and "backend" in inspect.signature(fn).parameters
    }
    assert takes_backend, "test_page_table.py has no test of a backend"
    missing = sorted(takes_backend - set(globals()))
    assert not missing, f"import these from test_page_table.py: {missing}"


@pytest.mark.gpu
@requires_cuda_vmm
def test_cuda_allocations_exportable():
    backend = cuda.CudaVmmBackend(torch.device("cuda", 0))
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
    drv = _fake_driver(0, retain_ok=False)
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    with pytest.raises(VmmError, match="cuDevicePrimaryCtxRetain failed on cuda:0"):
        cuda.CudaVmmBackend("cuda:0")
    drv.cuCtxSetCurrent.assert_not_called()


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
    fake driver (the GPU test above maps a real one): the primary context is
    made current on a thread without one, and a failed map releases the
    reservation and the imported handle."""
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
    call, through ctypes with the address and size columns where the driver
    has it (a fake function reads them here), else one cuMemcpyAsync per run
    (never the bindings' batch); a failed batch names the call; events are
    reused once freed; NOT_READY is "not yet"."""
    drv = _fake_driver(0)
    drv.cuStreamCreate.return_value = (0, 0x55)
    drv.cuMemcpyBatchAsync.return_value = (0,)
    drv.cuMemcpyAsync.return_value = (0,)
    drv.cuEventCreate.return_value = (0, "event")
    drv.cuEventRecord.return_value = (0,)
    drv.cuEventDestroy.return_value = (0,)
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    batches, result = [], [0]

    def batch(dsts, srcs, sizes, count, attrs, attrs_idx, num_attrs, fail, stream):
        def column(addr):
            return list((ctypes.c_uint64 * count).from_address(addr))

        order = cuda._MemcpyAttributes.from_address(attrs).srcAccessOrder
        idx = ctypes.c_size_t.from_address(attrs_idx).value
        batches.append(
            (column(dsts), column(srcs), column(sizes), order, idx, num_attrs, stream)
        )
        return result[0]

    monkeypatch.setattr(cuda, "_batch_copy_fn", lambda: batch)
    backend = cuda.CudaVmmBackend("cuda:0")
    runs = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64)
    stream = backend.copy_stream()
    assert stream.handle == 0x55
    stream.copy(runs)
    assert batches == [([1, 4], [2, 5], [3, 6], 1, 0, 1, 0x55)]
    drv.cuMemcpyBatchAsync.assert_not_called()
    result[0] = 1
    with pytest.raises(VmmError, match="cuMemcpyBatchAsync of 2 copies"):
        stream.copy(runs)

    event = stream.record()
    drv.cuEventRecord.assert_called_once_with("event", 0x55)
    drv.cuEventQuery.return_value = (drv.CUresult.CUDA_ERROR_NOT_READY,)
    assert not stream.query(event)
    drv.cuEventQuery.return_value = (0,)
    assert stream.query(event)
    stream.free(event)
    assert stream.record() == "event"
    drv.cuEventCreate.assert_called_once()
    drv.cuEventDestroy.assert_not_called()

    monkeypatch.setattr(cuda, "_batch_copy_fn", lambda: None)  # before CUDA 12.8
    backend.copy_stream().copy(runs)
    drv.cuMemcpyBatchAsync.assert_not_called()
    assert [c.args for c in drv.cuMemcpyAsync.call_args_list] == [
        (1, 2, 3, 0x55),
        (4, 5, 6, 0x55),
    ]
    backend.close()
