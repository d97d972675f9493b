# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the same-host path's tests: producers sharing a host VMM page
table, same-host readers (and their fixtures), and copiers that hold a read
in flight."""

import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tests.v1.kv_connector.unit.nixl_vmm.utils import make_table, rows, wait_until
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import new_secret
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
    CopyJob,
    HostCopier,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
    ChunkExporter,
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


def prove(sock, producer_name: str, secret: bytes, name: str):
    """The reader's side of the handshake on a raw socket: ``Hello``, the
    producer's ``Challenge``, our ``Proof``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel

    boot_id, hostname = channel.host_identity()
    nonce = channel.new_nonce()
    channel.send(
        sock, channel.Hello(name=name, boot_id=boot_id, hostname=hostname, nonce=nonce)
    )
    challenge, _ = channel.recv(sock, channel.CHALLENGE)
    mine = channel.proof(
        secret, "reader", (challenge.nonce, nonce), producer_name, name
    )
    channel.send(sock, channel.Proof(proof=mine))


class Notifs(list):
    """Collects the notifications of same-host reads: ``(agent, msg)``."""

    def __call__(self, agent: str, msg: bytes) -> None:
        self.append((agent, msg))


class Producer:
    """A producer's page table shared by a real exporter on a fresh name."""

    def __init__(self, drop_timeout_s=5.0, backend=None, **exporter_kwargs):
        self.name = f"p-{uuid.uuid4()}"
        self.secret = new_secret()
        self.backend, self.table = make_table(backend)
        self.exporter = ChunkExporter(
            self.name, self.secret, drop_timeout_s=drop_timeout_s, **exporter_kwargs
        )
        self.exporter.attach(self.table)

    @property
    def base(self) -> int:
        return self.table.tensors[0].data_ptr()

    def close(self):
        self.exporter.close()
        self.table.close()
        self.backend.close()


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


@pytest.fixture(name="producer")
def producer_fixture() -> Iterator[Producer]:
    p = Producer()
    yield p
    p.close()


@pytest.fixture(name="reader")
def reader_fixture() -> Iterator[Reader]:
    r = Reader()
    yield r
    r.close()
