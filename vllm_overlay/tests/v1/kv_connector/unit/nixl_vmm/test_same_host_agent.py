# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SegmentedXferAgent and StockKVXferAgent with the same-host path: READs of
same-host peers' shared chunks as local copies that notify the producer
through NIXL. Real NIXL agents (UCX over the loopback), real host VMM memory,
real channels."""

import uuid

import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    BLOCK,
    NUM_BLOCKS,
    block_view,
    fill,
    make_table,
    requires_nixl,
    rows,
    run_read,
    table_descs,
    ucx_over_loopback,
    wait_until,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent import (
    StockKVXferAgent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.same_host import (
    SameHostPath,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    same_host_stats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.worker import NixlVmmWorker

LOCAL = "NIXL_INIT_AGENT"


@pytest.fixture(autouse=True)
def _ucx_over_loopback(monkeypatch):
    ucx_over_loopback(monkeypatch)


def _nixl_agent(role):
    from nixl._api import nixl_agent, nixl_agent_config

    name = f"{role}-{uuid.uuid4()}"
    return nixl_agent(name, nixl_agent_config(backends=["UCX"])), name


def _vmm_worker(role):
    """A VMM-backed NixlVmmWorker on a real agent, two pages mapped."""
    backend, table = make_table()
    table.map_pages([0, 1])
    agent, name = _nixl_agent(role)
    worker = NixlVmmWorker(agent, same_host_path=SameHostPath(name))
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
            p_name, d_xfer.get_xfer_descs(table_descs(p_table), "DRAM")
        )
        local = d_xfer.prep_xfer_dlist(
            LOCAL, d_xfer.get_xfer_descs(table_descs(d_table), "DRAM")
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
    reader = NixlVmmWorker(d_agent, same_host_path=SameHostPath(d_name))
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
            p_name, d_xfer.get_xfer_descs(table_descs(p_table), "DRAM")
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
