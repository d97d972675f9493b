# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host backend behaviour: physical memory really goes back on release,
misaligned sizes are refused, and an allocation exported for KV transfer is
imported as the same memory (test_cuda_backend.py has the CUDA backend's)."""

import os

import pytest

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
