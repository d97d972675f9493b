# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The copies of same-host reads: runs merged, host copies by system call,
device copies dispatched to the copy kernel or the copy engines (CUDA
chunks imported and copied for real: test_same_host_reads.py)."""

import ctypes
import errno

import numpy as np
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
    DeviceCopier,
    HostCopier,
    Runs,
    coalesce,
    copier_for,
)
from vllm.v1.kv_vmm import HostVmmBackend, VmmError
from vllm.v1.kv_vmm.backend import DeviceCopyStream


def test_coalesce_merges_rows_adjacent_on_both_sides_in_read_order():
    dst = np.array([0, 100, 200, 1000, 1100, 1200], dtype=np.uint64)
    src = np.array([50, 150, 400, 250, 350, 700], dtype=np.uint64)
    n = np.array([100, 100, 100, 100, 100, 50], dtype=np.uint64)
    runs = coalesce(dst, src, n)
    # 0<-50 and 100<-150 merge; 200<-400 stands alone; 1000<-250 follows
    # 100<-150 in the source but not in the destination, and starts a run
    # that 1100<-350 extends; 1200<-700 does not follow it in the source.
    assert runs.tolist() == [
        [0, 50, 200],
        [200, 400, 100],
        [1000, 250, 200],
        [1200, 700, 50],
    ]
    assert runs.dtype == np.uint64
    assert coalesce(*(np.zeros(0, dtype=np.uint64),) * 3).shape == (0, 3)


def test_coalesce_keeps_each_region_of_a_prompt_one_run():
    """A read as NixlConnector lists it (region by region, blocks in the
    request's order) of blocks both sides hold in the same order is one run
    per region; blocks in another order on one side stay separate rows."""
    block, num_blocks, regions = 4096, 64, 3
    ids = np.arange(10, 26, dtype=np.uint64)

    def rows(base: int, block_ids: np.ndarray) -> np.ndarray:
        region = np.arange(regions, dtype=np.uint64)[:, None]
        return (base + (region * num_blocks + block_ids[None, :]) * block).ravel()

    lengths = np.full(regions * len(ids), block, dtype=np.uint64)
    runs = coalesce(rows(1 << 30, ids), rows(1 << 31, ids + 7), lengths)
    assert runs[:, 2].tolist() == [len(ids) * block] * regions
    shuffled = np.random.default_rng(0).permutation(ids)
    runs = coalesce(rows(1 << 30, ids), rows(1 << 31, shuffled), lengths)
    assert int(runs[:, 2].sum()) == int(lengths.sum())
    assert len(runs) > regions


def test_host_copies_take_one_system_call_per_1024_runs_or_fall_back_to_memmove():
    """Scattered rows (more than one process_vm_readv call holds) land where
    they belong, neighbours merged; a kernel that refuses the call (EPERM
    under a seccomp profile) leaves memmove doing the copies, from then on."""
    rng = np.random.default_rng(0)
    src = np.arange(3000 * 64, dtype=np.uint8) % 251
    for refuse in (False, True):
        copier = HostCopier()
        calls: list[int] = []
        real = copier._readv
        assert real is not None

        def readv(*args, real=real, refuse=refuse, calls=calls):
            calls.append(args[2])
            if refuse:
                ctypes.set_errno(errno.EPERM)
                return -1
            return real(*args)

        copier._readv = readv
        dst = np.zeros_like(src)
        order = rng.permutation(3000)
        runs = np.array(
            [
                (dst.ctypes.data + 64 * i, src.ctypes.data + 64 * j, 64)
                for i, j in enumerate(order)
            ],
            dtype=np.uint64,
        )
        job = copier.submit(Runs.of(runs))
        job.wait()
        assert job.done()
        copier.close()
        assert (dst.reshape(3000, 64) == src.reshape(3000, 64)[order]).all()
        # Rows that follow each other on both sides went as one iovec.
        merged = len(coalesce(runs[:, 0], runs[:, 1], runs[:, 2]))
        assert 2048 < merged <= 3000
        assert calls == ([1024] if refuse else [1024, 1024, merged - 2048])
        assert (copier._readv is None) == refuse


def test_a_host_copy_that_fails_part_way_fails_its_job():
    """A copy out of memory that is gone (process_vm_readv: EFAULT) is an
    error of that read, not of the copier: the next copy goes through."""
    copier = HostCopier()
    try:
        dst = np.zeros(64, dtype=np.uint8)
        copier.submit(Runs.of(np.array([[dst.ctypes.data, dst.ctypes.data, 8]]))).wait()
        if copier._readv is None:
            pytest.skip("process_vm_readv is refused here (memmove would fault)")
        bad = np.array([[dst.ctypes.data, 8, 64]], dtype=np.uint64)  # address 8
        job = copier.submit(Runs.of(bad))
        with pytest.raises(VmmError, match="failed part-way"):
            job.wait()
        src = np.full(64, 9, dtype=np.uint8)
        copier.submit(
            Runs.of(np.array([[dst.ctypes.data, src.ctypes.data, 64]]))
        ).wait()
        assert (dst == 9).all()
    finally:
        copier.close()


class _FakeStream(DeviceCopyStream):
    """A device stream stand-in (CPU hosts have none): copies with memmove
    when enqueued, events complete when ``ready``. Only the dispatch is
    under test here; tests/v1/kv_vmm/test_cuda_backend.py drives the CUDA
    stream's driver calls and the GPU test below the real device."""

    def __init__(self):
        self.copied: list[list[int]] = []
        self.events: list[dict] = []
        self.ready = True

    @property
    def handle(self) -> int:
        return 1234

    def copy(self, runs):
        for dst, src, n in np.asarray(runs).tolist():
            ctypes.memmove(dst, src, n)
            self.copied.append([dst, src, n])

    def record(self):
        event = {"freed": False}
        self.events.append(event)
        return event

    def query(self, event):
        return self.ready

    def wait(self, event):
        assert self.ready

    def free(self, event):
        event["freed"] = True


class _Kernel:
    def __init__(self, accept: bool):
        self.accept = accept
        self.launched: list[tuple[list, int]] = []

    def accepts(self, runs):
        return self.accept

    def launch(self, runs, stream):
        self.launched.append((runs.coalesced().tolist(), stream))


@pytest.mark.parametrize("kernel", [None, "accepts", "refuses"])
def test_device_copies_go_to_the_kernel_where_it_accepts_them(kernel):
    stream = _FakeStream()
    k = None if kernel is None else _Kernel(kernel == "accepts")
    copier = DeviceCopier(stream, k)
    src = np.full(64, 5, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    runs = np.array([[dst.ctypes.data, src.ctypes.data, 64]], dtype=np.uint64)
    stream.ready = False
    job = copier.submit(Runs.of(runs))
    assert not job.done()
    stream.ready = True
    assert job.done()
    job.free()
    assert stream.events == [{"freed": True}]
    if k is not None and k.accept:
        assert k.launched == [(runs.tolist(), 1234)] and stream.copied == []
    else:
        assert stream.copied == runs.tolist() and (dst == 5).all()


def test_host_memory_is_copied_by_the_cpu():
    backend = HostVmmBackend()
    try:
        assert backend.copy_stream() is None
        assert type(copier_for(backend)) is HostCopier
    finally:
        backend.close()
