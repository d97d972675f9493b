# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the NixlConnector-over-VMM tests: host VMM page tables, block
rows, same-host readers, and copiers that hold a read in flight."""

import importlib.util
import os
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import new_secret
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
    CopyJob,
    HostCopier,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
    ChunkExporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    SameHostReads,
)
from vllm.v1.kv_vmm import (
    HostVmmBackend,
    KVPageGeometry,
    KVPageTable,
    KVTensorLayout,
)

BLOCK = 256 * 1024  # 8 blocks per 2 MiB page
NUM_BLOCKS = 64

requires_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="needs nixl"
)


def ucx_over_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL agents of one process exchanging host memory: UCX on TCP/shared
    memory over the loopback unless the environment chooses. Left to itself
    on a host with GPUs or RDMA devices, UCX may pick a transport these reads
    never complete on; and where GPUs are present, NIXL refuses a UCX without
    a CUDA transport, so cuda_copy is named there too."""
    if "UCX_TLS" not in os.environ:
        tls = "tcp,self,sm" + (",cuda_copy" if torch.cuda.is_available() else "")
        monkeypatch.setenv("UCX_TLS", tls)
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def make_table(backend=None, num_blocks=NUM_BLOCKS, block=BLOCK):
    """(backend, page table) of one region of ``num_blocks`` blocks."""
    backend = backend or HostVmmBackend()
    geometry = KVPageGeometry(
        [KVTensorLayout(block_bytes=block, num_regions=1)],
        num_blocks=num_blocks,
        granularity=backend.granularity,
    )
    return backend, KVPageTable(backend, geometry, max_pages=geometry.num_pages)


def fill(table, block, value, block_bytes=BLOCK):
    flat = table.tensors[0].view(torch.uint8)
    flat[block * block_bytes : (block + 1) * block_bytes].fill_(value)


def rows(base, blocks, block_bytes=BLOCK):
    """``(addr, len, dev)`` descriptor rows of ``blocks`` from ``base``."""
    return np.array(
        [(base + b * block_bytes, block_bytes, 0) for b in blocks], dtype=np.uint64
    )


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


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


def read_block(reads, producer, dst, block, notif_msg=b"", notify=None):
    """A read of the producer's ``block`` into ``dst`` (one block's bytes),
    or None where it goes through NIXL."""
    return reads.make_read(
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


class RecordingAgent:
    """A NIXL agent stand-in that records registrations (for the order of
    checks and calls; transfers are real in the tests that need them)."""

    def __init__(self) -> None:
        self.registered: list = []

    def get_reg_descs(self, descs, mem_type):
        return list(descs)

    def register_memory(self, descs, backends=None):
        self.registered.append(descs)

    def deregister_memory(self, descs, backends=None):
        self.registered.remove(descs)


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


def nixl_side(name, block_bytes=BLOCK, num_blocks=NUM_BLOCKS, wrap=None):
    """(backend, table, agent, registry, xfer agent) of a real NIXL agent
    over a host VMM page table (``wrap`` wraps the raw agent)."""
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent import (
        SegmentedXferAgent,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.registry import (
        NixlSegmentRegistry,
    )

    backend, table = make_table(num_blocks=num_blocks, block=block_bytes)
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if wrap is not None:
        agent = wrap(agent)
    registry = NixlSegmentRegistry(agent, "DRAM", 0)
    registry.attach(table)
    return backend, table, agent, registry, SegmentedXferAgent(agent, registry)


def block_view(table, block, block_bytes=BLOCK) -> torch.Tensor:
    flat = table.tensors[0].view(torch.uint8)
    return flat[block * block_bytes : (block + 1) * block_bytes]


def run_read(xfer_agent, local, local_ids, remote, remote_ids, notif_msg=b""):
    """One READ through the agent, polled to its end and released: its
    final state."""
    handle = xfer_agent.make_prepped_xfer(
        "READ", local, local_ids, remote, remote_ids, notif_msg=notif_msg
    )
    state = xfer_agent.transfer(handle)
    deadline = time.monotonic() + 60
    while state == "PROC" and time.monotonic() < deadline:
        state = xfer_agent.check_xfer_state(handle)
    xfer_agent.release_xfer_handle(handle)
    return state
