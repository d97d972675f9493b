# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NixlSegmentRegistry with real NIXL agents (UCX over the loopback) and real
host VMM memory: one registration per mapped chunk, following maps and
unmaps, and unmaps that wait for the transfers using their segment. The
reads go through NIXL's own agent; the transfers an unmap waits for are the
ones the test hands the registry (``track``), as the agent wrapper does."""

import threading
import time

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    HeldCompletion,
    RecordingAgent,
    block_view,
    make_table,
    registry_side,
    requires_nixl,
    run_read,
    ucx_over_loopback,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.registry import (
    NixlSegmentRegistry,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    Descs,
    NixlXfer,
    XferHandle,
)
from vllm.v1.kv_vmm import VmmError


@pytest.fixture(autouse=True)
def _ucx_over_loopback(monkeypatch):
    ucx_over_loopback(monkeypatch)


def _close(*sides):
    for backend, table, _, registry in reversed(sides):
        table.close()
        registry.close()
        backend.close()


@requires_nixl
def test_registrations_follow_segments():
    side = registry_side("prefill")
    _, table, _, registry = side
    try:
        table.map_pages([0, 2])
        chunks = sorted((c.va, c.nbytes) for s in table.segments() for c in s.chunks)
        assert registry.registered_ranges == chunks and len(chunks) == 2
        generation = registry.generation
        table.unmap_pages([0])
        assert registry.registered_ranges == chunks[1:]
        assert registry.generation == generation + 1
        table.map_pages([1])
        assert len(registry.registered_ranges) == 2
        assert registry.generation == generation + 2

        # Which transfer rows a registration covers: one chunk must hold a row
        # whole; a row across two adjacent chunks is covered by neither.
        page = 2 << 20
        base = table.tensors[0].data_ptr()
        rows = np.array(
            [
                (base + page, 4096, 0),  # page 1, mapped
                (base + 3 * page - 4096, 4096, 0),  # end of page 2, mapped
                (base + 2 * page - 2048, 4096, 0),  # across pages 1 and 2
                (base, 4096, 0),  # page 0, unmapped
            ],
            dtype=np.uint64,
        )
        assert registry.unregistered(rows).tolist() == rows[2:].tolist()
    finally:
        _close(side)


@requires_nixl
def test_a_page_remapped_at_its_address_is_registered_again():
    """A page unmapped and mapped again comes back at the same virtual address
    but on new physical memory. An RDMA registration of the old memory would
    not follow it (NIXL issue 1126: reads after an unmap/remap at the same
    address fail unless registered again), so the registry drops the chunk's
    registration before the unmap and registers the new chunk after the map,
    and a reader of the owner's new bytes gets them through NIXL."""
    block = 2 << 20  # one block per page
    p_side = registry_side("prefill3", block_bytes=block, num_blocks=2)
    d_side = registry_side("decode3", block_bytes=block, num_blocks=2)
    try:
        _, p_table, p_agent, p_registry = p_side
        _, d_table, d_agent, _ = d_side
        p_table.map_pages([0])
        d_table.map_pages([0])
        first = list(p_registry.registered_ranges)
        generation = p_registry.generation
        remote = d_agent.add_remote_agent(p_agent.get_agent_metadata())

        def descs(table):
            return [(table.tensors[0].data_ptr(), block, 0)]

        local = d_agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", d_agent.get_xfer_descs(descs(d_table), "DRAM")
        )
        for value in (3, 9):
            if value == 9:
                p_table.unmap_pages([0])
                assert p_registry.registered_ranges == []
                p_table.map_pages([0])
                # Same address, registered anew (two generations later).
                assert p_registry.registered_ranges == first
                assert p_registry.generation == generation + 2
                # The reader loads the owner's refreshed metadata, as
                # NixlConnector does on a newer registration epoch.
                d_agent.remove_remote_agent(remote)
                remote = d_agent.add_remote_agent(p_agent.get_agent_metadata())
            block_view(p_table, 0, block).fill_(value)
            remote_descs = d_agent.prep_xfer_dlist(
                remote, d_agent.get_xfer_descs(descs(p_table), "DRAM")
            )
            assert run_read(d_agent, local, [0], remote_descs, [0]) == "DONE"
            d_agent.release_dlist_handle(remote_descs)
            assert torch.all(block_view(d_table, 0, block) == value)
    finally:
        _close(d_side, p_side)


@requires_nixl
def test_unmap_waits_for_transfers_that_touch_the_segment():
    block = 2 << 20  # one block per page
    p_side = registry_side("prefill2", block_bytes=block, num_blocks=4)
    d_side = registry_side(
        "decode2", block_bytes=block, num_blocks=4, wrap=HeldCompletion
    )
    try:
        _, p_table, p_agent, _ = p_side
        _, d_table, held, d_registry = d_side
        p_table.map_pages([0])
        d_table.map_pages([0, 1])
        block_view(p_table, 0, block).fill_(5)
        remote = held.add_remote_agent(p_agent.get_agent_metadata())

        def descs(table, num_blocks):
            base = table.tensors[0].data_ptr()
            return [(base + b * block, block, 0) for b in range(num_blocks)]

        # NIXL prepares mapped (registered) blocks only: the local list has
        # the blocks of both mapped pages, the read uses the first.
        local_rows = descs(d_table, 2)
        local = held.prep_xfer_dlist(
            "NIXL_INIT_AGENT", held.get_xfer_descs(local_rows, "DRAM")
        )
        remote_descs = held.prep_xfer_dlist(
            remote, held.get_xfer_descs(descs(p_table, 1), "DRAM")
        )
        handle = NixlXfer(
            held, held.make_prepped_xfer("READ", local, [0], remote_descs, [0])
        )
        # As the agent wrapper does with every transfer it makes: the registry
        # knows the local bytes it uses (descriptor 0 of the list) until it is
        # released.
        d_registry.track(handle, Descs(local_rows, "DRAM"), np.arange(1))
        assert handle.post() == "PROC"

        # In flight: an unmap that may not wait is refused and the page stays mapped.
        d_registry.unmap_timeout_s = 0.0
        with pytest.raises(VmmError, match="cannot be unmapped"):
            d_table.unmap_pages([0])
        assert d_table.is_mapped(0)
        # Page 1 holds no block of the transfer: it unmaps at once.
        d_table.unmap_pages([1])
        assert not d_table.is_mapped(1)

        # The bytes really arrive (the real transfer finishes on its own).
        deadline = time.monotonic() + 60
        while held.real_state(handle) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert held.real_state(handle) == "DONE"
        assert torch.all(block_view(d_table, 0, block) == 5)

        # An unmap allowed to wait blocks while the transfer is reported in flight...
        d_registry.unmap_timeout_s = 60.0
        held.held_query.clear()
        errors: list[BaseException] = []

        def unmap() -> None:
            try:
                d_table.unmap_pages([0])
            except BaseException as e:  # reported by the test thread below
                errors.append(e)

        unmapping = threading.Thread(target=unmap)
        unmapping.start()
        assert held.held_query.wait(60), "the unmap never asked for the state"
        assert unmapping.is_alive()
        assert d_table.is_mapped(0)
        # The wait does not hold the page table's lock: its mapped state can
        # be read meanwhile (segments() takes the lock).
        reader = threading.Thread(target=d_table.segments)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the unmap waits under the page table lock"
        assert unmapping.is_alive() and d_table.is_mapped(0)
        # ... and goes ahead once the transfer completes.
        held.released.set()
        unmapping.join(60)
        assert not unmapping.is_alive()
        assert errors == []
        assert not d_table.is_mapped(0)
        assert d_registry.registered_ranges == []
        d_registry.untrack(handle)
        handle.release()
        held.remove_remote_agent(remote)
    finally:
        # A failed check must not leave an unmap waiting on the hold.
        d_side[2].released.set()
        _close(p_side, d_side)


class _ScriptedXfer(XferHandle):
    """A transfer whose states come from a script: the test is about the
    order of checks, not about moving bytes."""

    def __init__(self, states: list[str]) -> None:
        self.states = states

    def post(self, *args, **kwargs) -> str:
        return self.state()

    def state(self) -> str:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def telemetry(self):
        return None

    def release(self) -> None:
        pass


def test_unmap_refuses_under_the_lock_if_a_transfer_started_after_the_wait():
    """The wait runs before the page table's lock is taken; the deregistration
    under the lock checks again without waiting, so a transfer in flight by
    then still keeps its chunk mapped."""
    backend, table = make_table(num_blocks=2, block=2 << 20)
    agent = RecordingAgent()
    registry = NixlSegmentRegistry(agent, "DRAM", 0, unmap_timeout_s=60.0)
    # First query (the wait, outside the lock): done; second (under it): in flight.
    xfer = _ScriptedXfer(["DONE", "PROC"])
    try:
        registry.attach(table)
        table.map_pages([0, 1])
        base = table.tensors[0].data_ptr()
        registry.track(xfer, Descs([(base, 4096, 0)], "VRAM"), np.arange(1))
        with pytest.raises(VmmError, match="segment 0 cannot be unmapped"):
            table.unmap_pages([0])
        assert table.is_mapped(0) and len(agent.registered) == 2
        # Once it is done, the unmap deregisters and gives the chunk back.
        xfer.states = ["DONE"]
        assert table.unmap_pages([0]) == [0]
        assert not table.is_mapped(0) and len(agent.registered) == 1
    finally:
        xfer.states = ["DONE"]
        table.close()
        registry.close()
        backend.close()
