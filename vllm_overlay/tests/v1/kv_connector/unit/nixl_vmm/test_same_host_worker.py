# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-host path of NixlVmmWorker (SameHostPath): the connector option
that turns it on, the secret a VMM-backed worker publishes, and the
fallbacks that reach NixlConnector's stats."""

import time
import uuid

import pytest

from tests.v1.kv_connector.unit.nixl_vmm.utils import (  # noqa: F401 (fixture)
    RecordingAgent,
    two_region_table_fixture,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.same_host import (
    SameHostPath,
    same_host_path,
    same_host_reads_enabled,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.worker import NixlVmmWorker


def test_same_host_reads_are_on_unless_the_connector_config_turns_them_off():
    def config(extra: dict) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )

    assert same_host_reads_enabled(config({}))
    assert isinstance(same_host_path(config({}), "worker"), SameHostPath)
    assert same_host_path(config({"vmm_same_host": False}), "worker") is None
    assert same_host_reads_enabled(config({"vmm_same_host": True}))
    assert not same_host_reads_enabled(config({"vmm_same_host": False}))
    assert not same_host_reads_enabled(config({"vmm_same_host": "False"}))
    with pytest.raises(ValueError, match="'vmm_same_host'.* true or false, got 'no'"):
        same_host_reads_enabled(config({"vmm_same_host": "no"}))


def test_a_vmm_worker_publishes_the_secret_that_opens_its_channel(table):
    """A VMM-backed worker with the same-host path on shares its chunks with
    readers holding the secret its handshake metadata carries; a stock
    reader given that secret in the handshake opens the channel."""
    name = f"p-{uuid.uuid4()}"
    producer = NixlVmmWorker(RecordingAgent(), same_host_path=SameHostPath(name))
    producer.page_table = table
    base = table.tensors[0].data_ptr()
    table.map_pages([0])
    producer.register(["DRAM"], False, [(base, base + 4096)], 0)
    reader = NixlVmmWorker(RecordingAgent(), same_host_path=SameHostPath("reader"))
    off = NixlVmmWorker(RecordingAgent())
    try:
        secret = producer.same_host_secret
        assert len(secret) == 32
        assert reader.same_host_secret == b"" and off.same_host_secret == b""
        agent = reader.read_same_host(["DRAM"], False, 0)
        assert type(agent).__name__ == "StockKVXferAgent"
        assert off.read_same_host(["DRAM"], False, 0) is off.agent
        reader.offer_same_host(name.encode(), secret)
        assert reader.same_host.has_channel(name)
        deadline = time.monotonic() + 10
        while reader.same_host.importer(name).num_mapped < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        reader.close()
        producer.close()


def test_fallbacks_reach_the_connector_stats():
    """Reads that went to NIXL/UCX reach NixlConnector's own stats: counted
    by reason in the worker's interval, summed in the log line, kept when
    aggregated into stats that never saw one."""
    nixl_stats = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats",
        reason="the release's NixlConnector has no nixl.stats module",
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
        STATS,
        STATS_KEY,
        Fallback,
        fallbacks_by_reason,
        record_fallbacks,
    )

    stats = nixl_stats.NixlKVConnectorStats()
    record_fallbacks(stats.data)  # what came before this test
    stats = nixl_stats.NixlKVConnectorStats()
    record_fallbacks(stats.data)
    assert stats.is_empty() and STATS_KEY not in stats.data
    for _ in range(2):
        STATS.fallback("peer", Fallback.NOT_SHARED, "outside")
    STATS.fallback("peer", Fallback.CLOSED, "gone")
    record_fallbacks(stats.data)
    assert not stats.is_empty()
    assert fallbacks_by_reason(stats.data) == {"not_shared": 2, "channel_closed": 1}
    assert stats.reduce()["Num same-host fallbacks"] == 3
    total = nixl_stats.NixlKVConnectorStats()
    total.aggregate(stats)
    total.aggregate(stats.clone_and_reset())
    assert total.reduce()["Num same-host fallbacks"] == 6
    assert "Num same-host fallbacks" not in nixl_stats.NixlKVConnectorStats().reduce()
