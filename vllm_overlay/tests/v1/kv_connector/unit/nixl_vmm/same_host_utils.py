# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the same-host path's tests: same-host readers (and their
fixture), and copiers that hold a read in flight (producers:
channel_utils.py)."""

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.v1.kv_connector.unit.nixl_vmm.utils import rows, wait_until
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
    CopyJob,
    HostCopier,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.same_host import (
    SameHostReads,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import Descs
from vllm.v1.kv_vmm import HostVmmBackend


def finish(xfer, timeout=10.0):
    """Poll a transfer to its end; its final state."""
    deadline = time.monotonic() + timeout
    while (state := xfer.check()) == "PROC":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return state


def connect(reads, producer, chunks: int):
    """Open ``reads``' channel to ``producer``; its importer, once it maps
    ``chunks`` chunks."""
    assert reads.offer(producer.name, producer.secret)
    importer = reads.importer(producer.name)
    wait_until(lambda: importer.num_mapped == chunks)
    return importer


def make_read(reads, name, local_rows, remote_rows, notif_msg, notify):
    """``reads.make_read`` of every one of ``local_rows`` and
    ``remote_rows`` (``(addr, len, dev)`` descriptors) in order."""
    local, remote = Descs(local_rows, "DRAM"), Descs(remote_rows, "DRAM")
    return reads.make_read(
        name,
        local,
        np.arange(len(local.rows)),
        remote,
        np.arange(len(remote.rows)),
        notif_msg,
        notify,
    )


def read_block(reads, producer, dst, block, notif_msg=b"", notify=None):
    """A read of the producer's ``block`` into ``dst`` (one block's bytes),
    or None where it goes through NIXL."""
    return make_read(
        reads,
        producer.name,
        rows(dst.ctypes.data, [0]),
        rows(producer.base, [block]),
        notif_msg,
        notify or Notifs(),
    )


class Notifs(list):
    """Collects the notifications of same-host reads: ``(agent, msg)``."""

    def __call__(self, agent: str, msg: bytes) -> None:
        self.append((agent, msg))


class Reader(SameHostReads):
    """Same-host reads into host memory with a backend of their own."""

    def __init__(self, copier=None, name="reader", backend=None, **kwargs):
        super().__init__(
            backend or HostVmmBackend(), copier or HostCopier(), name, **kwargs
        )

    def close(self):
        super().close()
        self.backend.close()


class GatedCopier(HostCopier):
    """Host copies that wait for ``gate`` (a read in flight)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.copying = threading.Event()

    def copy(self, runs):
        self.copying.set()
        assert self.gate.wait(30)
        super().copy(runs)


class _GatedJob(CopyJob):
    def __init__(self, copier, runs):
        self.copier = copier
        self.runs = runs
        self.copied = False

    def done(self):
        if self.copier.gate.is_set() and not self.copied:
            HostCopier.copy(self.copier, self.runs)
            self.copied = True
        return self.copied

    def wait(self):
        assert self.copier.gate.wait(30)
        self.done()

    def free(self):
        self.copier.freed += 1


class AsyncGatedCopier(HostCopier):
    """Copies enqueued and completed by polling, as on a device (the
    :class:`~...copies.DeviceCopier` interface): a copy completes once
    ``gate`` is set. Stands in for the device on CPU."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.copying = threading.Event()
        self.freed = 0

    def submit(self, runs):
        self.copying.set()
        return _GatedJob(self, runs)


@pytest.fixture(name="reader")
def reader_fixture() -> Iterator[Reader]:
    r = Reader()
    yield r
    r.close()
