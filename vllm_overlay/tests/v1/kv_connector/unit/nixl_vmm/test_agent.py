# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SegmentedXferAgent and StockKVXferAgent: descriptors resolved per transfer
against the registrations of the moment, and READs of same-host peers' shared
chunks as local copies that notify the producer through NIXL. Real NIXL
agents (UCX over the loopback), real host VMM memory, real channels."""

import uuid

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    BLOCK,
    NUM_BLOCKS,
    block_view,
    fill,
    make_table,
    nixl_side,
    requires_nixl,
    rows,
    run_read,
    ucx_over_loopback,
    wait_until,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent import (
    StockKVXferAgent,
    flat_desc_rows,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    same_host_stats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.worker import NixlVmmWorker
from vllm.v1.kv_vmm import VmmError

LOCAL = "NIXL_INIT_AGENT"


@pytest.fixture(autouse=True)
def _ucx_over_loopback(monkeypatch):
    ucx_over_loopback(monkeypatch)


def _descs(table, num_blocks=NUM_BLOCKS):
    return rows(table.tensors[0].data_ptr(), range(num_blocks)).tolist()


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
            LOCAL, d_xfer.get_xfer_descs(_descs(d_table), "DRAM")
        )
        remote_descs = d_xfer.prep_xfer_dlist(
            remote, d_xfer.get_xfer_descs(_descs(p_table), "DRAM")
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


def _nixl_agent(role):
    from nixl._api import nixl_agent, nixl_agent_config

    name = f"{role}-{uuid.uuid4()}"
    return nixl_agent(name, nixl_agent_config(backends=["UCX"])), name


def _vmm_worker(role):
    """A VMM-backed NixlVmmWorker on a real agent, two pages mapped."""
    backend, table = make_table()
    table.map_pages([0, 1])
    agent, name = _nixl_agent(role)
    worker = NixlVmmWorker(agent, name)
    worker.page_table = table
    base = table.tensors[0].data_ptr()
    xfer = worker.register(["DRAM"], False, [(base, base + 4 * (2 << 20))], 0)
    return worker, backend, table, agent, xfer


def _wait_for_notif(agent, sender, msg):
    """Until ``agent`` got the NIXL notification ``msg`` from ``sender``."""
    notifs: list[bytes] = []

    def arrived() -> bool:
        notifs.extend(agent.get_new_notifs().get(sender, []))
        return msg in notifs

    wait_until(arrived, timeout=30)


def _read_same_host(xfer_agent, *prepped):
    """A READ that must be a same-host copy, polled to its end."""
    handle = xfer_agent.make_prepped_xfer("READ", *prepped, notif_msg=b"d-1")
    assert type(handle).__name__ == "SameHostXfer"
    xfer_agent.transfer(handle)
    wait_until(lambda: xfer_agent.check_xfer_state(handle) == "DONE")
    assert xfer_agent.get_xfer_telemetry(handle).totalBytes == 4 * BLOCK
    xfer_agent.release_xfer_handle(handle)


@requires_nixl
def test_segmented_agent_reads_same_host_chunks_with_nixl_notifications():
    """Two real NIXL agents (UCX over the loopback) with VMM-backed tables:
    the decode agent's READs of shared chunks are local copies whose
    completion notifies the prefill agent through NIXL."""
    prefill = _vmm_worker("prefill")
    decode = _vmm_worker("decode")
    (p_worker, _, p_table, p_agent, _), (d_worker, _, d_table, d_agent, d_xfer) = (
        prefill,
        decode,
    )
    try:
        # The connector names remote agents as add_remote_agent returns them,
        # and hands the handshake's secret over before preparing descriptors.
        p_name = d_xfer.add_remote_agent(p_agent.get_agent_metadata())
        p_agent.add_remote_agent(d_agent.get_agent_metadata())
        d_worker.offer_same_host(p_name, p_worker.same_host_secret)
        assert d_worker.same_host.has_channel(p_name)
        for b in range(16):
            fill(p_table, b, 3 * b + 1)
        remote = d_xfer.prep_xfer_dlist(
            p_name, d_xfer.get_xfer_descs(_descs(p_table), "DRAM")
        )
        local = d_xfer.prep_xfer_dlist(
            LOCAL, d_xfer.get_xfer_descs(_descs(d_table), "DRAM")
        )
        wait_until(lambda: d_worker.same_host.importer(p_name).num_mapped == 2)

        before = same_host_stats()
        _read_same_host(d_xfer, local, [0, 1, 2, 3], remote, [12, 13, 14, 15])
        assert same_host_stats()["reads"] == before["reads"] + 1
        for i, b in enumerate(range(12, 16)):
            assert torch.all(block_view(d_table, i) == 3 * b + 1)
        _wait_for_notif(p_agent, d_agent.name, b"d-1")

        # The decode's own unmap waits for nothing and shares its chunks too.
        p_worker.offer_same_host(d_agent.name, d_worker.same_host_secret)
        wait_until(lambda: p_worker.same_host.importer(d_agent.name).num_mapped == 2)
        d_table.unmap_pages([1])
        wait_until(lambda: p_worker.same_host.importer(d_agent.name).num_mapped == 1)
    finally:
        for worker, backend, table, _, _ in (decode, prefill):
            worker.close()
            table.close()
            backend.close()


@requires_nixl
def test_stock_reader_copies_a_vmm_peers_chunks_and_prepares_stock_peers(caplog):
    """A reader with stock KV tensors (a plain registered buffer) and two real
    NIXL peers: the VMM-backed one offers a channel, so its list stays
    unprepared and READs of it are local copies whose completion notifies it
    through NIXL; the stock one offers none (said at debug level only) and
    its list and READs are NIXL's prepared ones."""

    def stock_buffer(agent, value):
        buf = torch.full((NUM_BLOCKS * BLOCK,), value, dtype=torch.uint8)
        agent.register_memory(
            agent.get_reg_descs([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
        )
        return buf

    producer = _vmm_worker("prefill")
    p_worker, _, p_table, p_agent, _ = producer
    s_agent, _ = _nixl_agent("stock-prefill")
    s_buf = stock_buffer(s_agent, 9)
    d_agent, d_name = _nixl_agent("decode")
    d_buf = stock_buffer(d_agent, 0)
    reader = NixlVmmWorker(d_agent, d_name)
    d_xfer = reader.read_same_host(["DRAM"], False, 0)
    try:
        assert isinstance(d_xfer, StockKVXferAgent)
        p_name = d_xfer.add_remote_agent(p_agent.get_agent_metadata())
        s_name = d_xfer.add_remote_agent(s_agent.get_agent_metadata())
        for peer in (p_agent, s_agent):
            peer.add_remote_agent(d_agent.get_agent_metadata())
        for b in range(16):
            fill(p_table, b, 3 * b + 1)
        local = d_xfer.prep_xfer_dlist(
            LOCAL,
            d_xfer.get_xfer_descs(rows(d_buf.data_ptr(), range(NUM_BLOCKS)), "DRAM"),
        )
        assert type(local).__name__ == "_NixlPrepared"
        # The VMM peer's blocks beyond its two mapped pages are not registered:
        # NIXL could not prepare this list.
        reader.offer_same_host(p_name, p_worker.same_host_secret)
        remote = d_xfer.prep_xfer_dlist(
            p_name, d_xfer.get_xfer_descs(_descs(p_table), "DRAM")
        )
        assert type(remote).__name__ == "_PerTransfer"
        with caplog.at_level("DEBUG"):
            reader.offer_same_host(s_name, b"")
            s_rows = rows(s_buf.data_ptr(), range(NUM_BLOCKS))
            stock_remote = d_xfer.prep_xfer_dlist(
                s_name, d_xfer.get_xfer_descs(s_rows, "DRAM")
            )
        assert type(stock_remote).__name__ == "_NixlPrepared"
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        wait_until(lambda: reader.same_host.importer(p_name).num_mapped == 2)

        before = same_host_stats()
        _read_same_host(d_xfer, local, [0, 1, 2, 3], remote, [12, 13, 14, 15])
        assert same_host_stats()["reads"] == before["reads"] + 1
        for i, b in enumerate(range(12, 16)):
            assert (d_buf[i * BLOCK : (i + 1) * BLOCK] == 3 * b + 1).all()
        _wait_for_notif(p_agent, d_agent.name, b"d-1")

        # The stock peer: NIXL's prepared transfer over UCX.
        assert run_read(d_xfer, local, [4, 5], stock_remote, [0, 1]) == "DONE"
        assert (d_buf[4 * BLOCK : 6 * BLOCK] == 9).all()
        assert same_host_stats()["reads"] == before["reads"] + 1
    finally:
        reader.close()
        p_worker.close()
        p_table.close()
        producer[1].close()
