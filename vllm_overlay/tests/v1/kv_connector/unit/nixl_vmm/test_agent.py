# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SegmentedXferAgent and StockKVXferAgent: descriptors resolved per transfer
against the registrations of the moment (same-host reads:
test_same_host_agent.py). Real NIXL agents (UCX over the loopback), real host
VMM memory."""

import time

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    HeldCompletion,
    block_view,
    registry_side,
    requires_nixl,
    run_read,
    table_descs,
    ucx_over_loopback,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent import (
    SegmentedXferAgent,
    StockKVXferAgent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    flat_desc_rows,
)
from vllm.v1.kv_vmm import VmmError

LOCAL = "NIXL_INIT_AGENT"


@pytest.fixture(autouse=True)
def _ucx_over_loopback(monkeypatch):
    ucx_over_loopback(monkeypatch)


def nixl_side(name):
    """(backend, table, agent, registry, xfer agent): a real NIXL agent over a
    host VMM page table and the wrapper that reads through its registry."""
    backend, table, agent, registry = registry_side(name)
    return backend, table, agent, registry, SegmentedXferAgent(agent, registry)


@requires_nixl
def test_reads_resolve_against_current_registrations():
    from nixl._api import nixlBind

    sides = [nixl_side("prefill"), nixl_side("decode")]
    _, p_table, p_agent, _, _ = sides[0]
    _, d_table, _, _, d_xfer = sides[1]
    try:
        p_table.map_pages([0, 1])
        d_table.map_pages([0])
        for b in range(16):
            block_view(p_table, b).fill_(b + 1)
        remote = d_xfer.add_remote_agent(p_agent.get_agent_metadata())
        # Descriptors of every block, mapped or not: preparing them cannot fail.
        local = d_xfer.prep_xfer_dlist(
            LOCAL, d_xfer.get_xfer_descs(table_descs(d_table), "DRAM")
        )
        remote_descs = d_xfer.prep_xfer_dlist(
            remote, d_xfer.get_xfer_descs(table_descs(p_table), "DRAM")
        )
        assert run_read(d_xfer, local, [1, 2], remote_descs, [3, 9]) == "DONE"
        assert torch.all(block_view(d_table, 1) == 4)
        assert torch.all(block_view(d_table, 2) == 10)

        # A segment the prefill side mapped after the decode side took its
        # metadata is unknown to the decode side: refused, nothing is moved.
        p_table.map_pages([2])
        block_view(p_table, 17).fill_(77)
        with pytest.raises(nixlBind.nixlNotFoundError):
            d_xfer.make_prepped_xfer("READ", local, [3], remote_descs, [17])
        # With a way to fetch the peer's current metadata, the read refreshes
        # it once and goes through with the same prepared descriptors.
        refreshed = []

        def refresh(agent_name: str) -> bool:
            refreshed.append(agent_name)
            d_xfer.add_remote_agent(p_agent.get_agent_metadata())
            return True

        d_xfer.refresh_remote = refresh
        assert run_read(d_xfer, local, [3], remote_descs, [17]) == "DONE"
        assert refreshed == [remote]
        assert torch.all(block_view(d_table, 3) == 77)

        # Out of a peer block its current registrations do not hold either (its
        # page is not mapped): one refresh, then an error naming the peer memory.
        with pytest.raises(VmmError, match="not in its current registrations"):
            d_xfer.make_prepped_xfer("READ", local, [4], remote_descs, [40])
        assert refreshed == [remote, remote]

        # Into a block of an unmapped local page: refused without asking the
        # peer (a refresh cannot help), naming the local memory; never written.
        with pytest.raises(VmmError, match="1 local ones are not inside a registered"):
            d_xfer.make_prepped_xfer("READ", local, [8], remote_descs, [3])
        assert refreshed == [remote, remote]
        d_table.map_pages([1])
        assert run_read(d_xfer, local, [8], remote_descs, [3]) == "DONE"
        assert torch.all(block_view(d_table, 8) == 4)
        d_xfer.remove_remote_agent(remote)
    finally:
        for backend, table, _, registry, _ in reversed(sides):
            table.close()
            registry.close()
            backend.close()


@requires_nixl
def test_a_transfer_keeps_its_pages_mapped_until_it_is_over():
    """The wrapper tells the registry which local bytes each transfer it
    makes reads into: while one is in flight, an unmap of its page that may
    not wait is refused; once it is over and released, the page unmaps.
    (HeldCompletion reports the real transfer in flight until released.)"""
    p_side = registry_side("prefill3")
    d_side = registry_side("decode3", wrap=HeldCompletion)
    _, p_table, p_agent, _ = p_side
    _, d_table, held, d_registry = d_side
    d_xfer = SegmentedXferAgent(held, d_registry)
    try:
        p_table.map_pages([0])
        d_table.map_pages([0])
        block_view(p_table, 2).fill_(9)
        remote = d_xfer.add_remote_agent(p_agent.get_agent_metadata())
        local = d_xfer.prep_xfer_dlist(
            LOCAL, d_xfer.get_xfer_descs(table_descs(d_table), "DRAM")
        )
        remote_descs = d_xfer.prep_xfer_dlist(
            remote, d_xfer.get_xfer_descs(table_descs(p_table), "DRAM")
        )
        handle = d_xfer.make_prepped_xfer("READ", local, [1], remote_descs, [2])
        assert d_xfer.transfer(handle) == "PROC"
        d_registry.unmap_timeout_s = 0.0
        with pytest.raises(VmmError, match="cannot be unmapped"):
            d_table.unmap_pages([0])
        assert d_table.is_mapped(0)

        held.released.set()
        deadline = time.monotonic() + 60
        state = "PROC"
        while state == "PROC" and time.monotonic() < deadline:
            state = d_xfer.check_xfer_state(handle)
        assert state == "DONE"
        assert torch.all(block_view(d_table, 1) == 9)
        d_xfer.release_xfer_handle(handle)
        d_table.unmap_pages([0])
        assert not d_table.is_mapped(0)
        d_xfer.remove_remote_agent(remote)
    finally:
        held.released.set()
        for backend, table, _, registry in (d_side, p_side):
            table.close()
            registry.close()
            backend.close()


def test_strided_descriptors_expand_to_the_units_indices_count():
    """NIXL 1.5's strided (Nx5) descriptor lists, as NixlConnector prepares
    them from vLLM 0.33 on, resolve to one row per block in index order."""
    strided = np.array(
        [[0x1000, 64, 3, 256, 3], [0x9000, 32, 3, 32, 1], [0xA000, 16, 0, 48, 2]],
        dtype=np.uint64,
    )
    assert flat_desc_rows(strided).tolist() == [
        [0x1000, 64, 3],
        [0x1100, 64, 3],
        [0x1200, 64, 3],
        [0x9000, 32, 3],
        [0xA000, 16, 0],
        [0xA030, 16, 0],
    ]
    # The (addr, len, dev) form is kept as it is.
    flat = [(0x1000, 64, 3), (0x2000, 64, 3)]
    assert flat_desc_rows(flat).tolist() == [list(r) for r in flat]


class _FakeLikeNixl:
    """An agent with the narrower signatures of vLLM's own test fake of NIXL
    (no ``backends`` or ``mem_type`` arguments): StockKVXferAgent passes on
    only what the connector gave."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def get_xfer_descs(self, blocks_data, memory_type):
        return ("descs", memory_type)

    def prep_xfer_dlist(self, agent_name, descs):
        self.calls.append(("prep", agent_name, descs))
        return len(self.calls)

    def make_prepped_xfer(self, op, local, lids, remote, rids, notif_msg=None):
        self.calls.append(("xfer", op, local, lids, remote, rids, notif_msg))
        return 99

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def get_xfer_telemetry(self, handle):
        return ("telemetry", handle)

    def release_xfer_handle(self, handle):
        self.calls.append(("release", handle))

    def release_dlist_handle(self, handle):
        self.calls.append(("release_dlist", handle))


def test_a_stock_reader_passes_nixl_calls_on_as_given():
    raw = _FakeLikeNixl()
    agent = StockKVXferAgent(raw)
    local = agent.prep_xfer_dlist(LOCAL, agent.get_xfer_descs([(1, 2, 0)], "DRAM"))
    remote = agent.prep_xfer_dlist("peer", agent.get_xfer_descs([(3, 2, 0)], "DRAM"))
    handle = agent.make_prepped_xfer("READ", local, [0], remote, [0], notif_msg=b"n")
    assert agent.transfer(handle) == "PROC"
    assert agent.check_xfer_state(handle) == "DONE"
    assert agent.get_xfer_telemetry(handle) == ("telemetry", 99)
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(remote)
    assert raw.calls == [
        ("prep", LOCAL, ("descs", "DRAM")),
        ("prep", "peer", ("descs", "DRAM")),
        ("xfer", "READ", 1, [0], 2, [0], b"n"),
        ("release", 99),
        ("release_dlist", 2),
    ]
