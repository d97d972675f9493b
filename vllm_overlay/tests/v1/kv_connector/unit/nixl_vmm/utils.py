# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the NixlConnector-over-VMM tests: host VMM page tables, block
rows, NIXL agents over them (same-host readers: same_host_utils.py)."""

import importlib.util
import os
import threading
import time

import numpy as np
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import NixlXfer
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


@pytest.fixture(name="table")
def two_region_table_fixture():
    """A page table of 8 blocks of 1 MiB in two regions (host memory); a test
    module imports it to ask for ``table``."""
    backend = HostVmmBackend(2 << 20)
    geometry = KVPageGeometry(
        [KVTensorLayout(block_bytes=1 << 20, num_regions=2)],
        num_blocks=8,
        granularity=backend.granularity,
    )
    table = KVPageTable(backend, geometry, max_pages=geometry.num_pages)
    yield table
    table.close()
    backend.close()


def table_descs(table, num_blocks=NUM_BLOCKS):
    """Descriptor rows of the first ``num_blocks`` blocks of ``table``."""
    return rows(table.tensors[0].data_ptr(), range(num_blocks)).tolist()


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


def registry_side(name, block_bytes=BLOCK, num_blocks=NUM_BLOCKS, wrap=None):
    """(backend, table, agent, registry) of a real NIXL agent over a host VMM
    page table whose registrations the registry keeps (``wrap`` wraps the raw
    agent)."""
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.registry import (
        NixlSegmentRegistry,
    )

    backend, table = make_table(num_blocks=num_blocks, block=block_bytes)
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if wrap is not None:
        agent = wrap(agent)
    registry = NixlSegmentRegistry(agent, "DRAM", 0)
    registry.attach(table)
    return backend, table, agent, registry


def block_view(table, block, block_bytes=BLOCK) -> torch.Tensor:
    flat = table.tensors[0].view(torch.uint8)
    return flat[block * block_bytes : (block + 1) * block_bytes]


def run_read(xfer_agent, local, local_ids, remote, remote_ids, notif_msg=b""):
    """One READ through the agent (a NIXL agent or a wrapper of one), polled
    to its end and released: its final state."""
    handle = xfer_agent.make_prepped_xfer(
        "READ", local, local_ids, remote, remote_ids, notif_msg=notif_msg
    )
    state = xfer_agent.transfer(handle)
    deadline = time.monotonic() + 60
    while state == "PROC" and time.monotonic() < deadline:
        state = xfer_agent.check_xfer_state(handle)
    xfer_agent.release_xfer_handle(handle)
    return state


class HeldCompletion:
    """A real NIXL agent whose transfers report "PROC" until the test releases them.

    A fake on purpose, and only for ordering: the transfer itself is real (UCX
    moves the bytes between real host VMM pages), but whether it has finished is
    what the unmap has to wait for, and a real transfer may finish inside
    transfer() or at any moment after. Holding back the reported completion
    makes "the unmap runs while the transfer is in flight" happen on every run
    instead of when the transfer loses a race.
    """

    def __init__(self, agent) -> None:
        self._agent = agent
        self.released = threading.Event()
        # Set once a state query was answered "PROC" because of the hold.
        self.held_query = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def real_state(self, xfer: NixlXfer) -> str:
        return self._agent.check_xfer_state(xfer.handle)

    def transfer(self, handle, *args, **kwargs) -> str:
        state = self._agent.transfer(handle, *args, **kwargs)
        return state if self.released.is_set() or state == "ERR" else "PROC"

    def check_xfer_state(self, handle) -> str:
        state = self._agent.check_xfer_state(handle)
        if self.released.is_set() or state == "ERR":
            return state
        self.held_query.set()
        return "PROC"
