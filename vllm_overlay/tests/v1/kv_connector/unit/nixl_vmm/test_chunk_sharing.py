# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chunk export and import on the same-host path, in one process: real host
VMM memory (memfd extents), real Unix-domain sockets passing real file
descriptors, a real exporter and reader."""

import socket
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.same_host_utils import (  # noqa: F401 (fixtures)
    GatedCopier,
    Notifs,
    Producer,
    Reader,
    connect,
    finish,
    make_read,
    producer_fixture,
    read_block,
    reader_fixture,
)
from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    BLOCK,
    NUM_BLOCKS,
    fill,
    make_table,
    rows,
    wait_until,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
    SameHostUnavailable,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
    ChunkExporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.importer import (
    ChunkImporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    Fallback,
    same_host_stats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import Descs
from vllm.v1.kv_vmm import HostVmmBackend, VmmError


def test_reader_maps_shared_chunks_and_copies_them(producer, reader):
    table, exporter = producer.table, producer.exporter
    table.map_pages([0, 2])
    for b in [*range(8), *range(16, 24)]:
        fill(table, b, b + 1)
    assert reader.offer(producer.name, producer.secret)
    importer = reader.importer(producer.name)
    wait_until(lambda: importer.num_mapped == 2)
    assert exporter.num_peers == 1
    # Mapped after the reader connected: shared as well.
    table.map_pages([1])
    fill(table, 9, 99)
    wait_until(lambda: importer.num_mapped == 3)

    dst = np.zeros(5 * BLOCK, dtype=np.uint8)
    blocks = [16, 17, 18, 9, 2]
    notifs = Notifs()
    xfer = make_read(
        reader,
        producer.name,
        rows(dst.ctypes.data, range(5)),
        rows(producer.base, blocks),
        b"req-1",
        notifs,
    )
    # One row per block; 16, 17, 18 are adjacent on both sides: one copy
    # where the copier merges rows.
    assert len(xfer.runs) == 5
    assert len(xfer.runs.coalesced()) == 3
    before = same_host_stats()
    assert xfer.post() in ("PROC", "DONE")
    assert finish(xfer) == "DONE"
    assert notifs == [(producer.name, b"req-1")]
    for i, b in enumerate(blocks):
        want = 99 if b == 9 else b + 1
        assert (dst[i * BLOCK : (i + 1) * BLOCK] == want).all()
    assert xfer.telemetry().totalBytes == 5 * BLOCK
    after = same_host_stats()
    assert after["reads"] == before["reads"] + 1
    assert after["bytes"] == before["bytes"] + 5 * BLOCK
    xfer.release()
    # A block on a page not mapped: not shared, the read goes to NIXL.
    assert (
        make_read(
            reader,
            producer.name,
            rows(dst.ctypes.data, [0]),
            rows(producer.base, [40]),
            b"",
            notifs,
        )
        is None
    )
    reader.disconnect(producer.name)
    wait_until(lambda: exporter.num_peers == 0)


class SlowImportBackend(HostVmmBackend):
    """Imports that take a while (a reader on a busy host)."""

    def import_chunk(self, fd, offset, nbytes):
        time.sleep(0.5)
        return super().import_chunk(fd, offset, nbytes)


def test_a_read_waits_for_chunks_sent_before_it_instead_of_leaving_the_path(
    producer,
):
    """The producer sends a chunk when it maps it, before any reader can be told
    of blocks in it; a reader that has not mapped it yet syncs with the
    producer, then reads it here instead of through NIXL/UCX."""
    table = producer.table
    table.map_pages([0])
    reads = Reader(backend=SlowImportBackend())
    try:
        assert reads.offer(producer.name, producer.secret)
        importer = reads.importer(producer.name)
        wait_until(lambda: importer.num_mapped == 1)
        table.map_pages([3])
        fill(table, 24, 7)
        # Sent already, still being mapped by the channel thread.
        assert importer.num_mapped == 1
        before = same_host_stats()
        dst = np.zeros(BLOCK, dtype=np.uint8)
        local = rows(dst.ctypes.data, [0])
        xfer = make_read(
            reads, producer.name, local, rows(producer.base, [24]), b"", Notifs()
        )
        assert xfer is not None and importer.num_mapped == 2
        xfer.post()
        assert finish(xfer) == "DONE"
        assert (dst == 7).all()
        xfer.release()
        # Rows the producer never shared: one sync, then NIXL/UCX.
        assert (
            make_read(
                reads, producer.name, local, rows(producer.base, [40]), b"", Notifs()
            )
            is None
        )
        after = same_host_stats()
        assert after["fallbacks"] == before["fallbacks"] + 1
        assert (
            after["fallbacks_not_shared"] == before.get("fallbacks_not_shared", 0) + 1
        )
    finally:
        reads.close()


class RecordingBackend(HostVmmBackend):
    """Records, at each release, how many chunks the reader still maps."""

    importer: ChunkImporter | None = None
    mapped_at_release: list[int]

    def release(self, handle):
        if self.importer is not None:
            self.mapped_at_release.append(self.importer.num_mapped)
        super().release(handle)


def test_owner_gives_a_chunk_back_only_after_the_reader_dropped_it(reader):
    """fallocate(PUNCH_HOLE) frees pages under a reader's mapping too: the
    reader must have unmapped a chunk before the owner releases it."""
    backend = RecordingBackend()
    backend.mapped_at_release = []
    p = Producer(backend=backend)
    try:
        p.table.map_pages([0, 1])
        assert reader.offer(p.name, p.secret)
        importer = reader.importer(p.name)
        backend.importer = importer
        wait_until(lambda: importer.num_mapped == 2)
        p.table.unmap_pages([0])
        assert backend.mapped_at_release == [1]
        assert p.exporter.held_by_peers() == 1
        # The dropped chunk is no longer readable through the channel.
        dst = np.zeros(BLOCK, dtype=np.uint8)
        local = rows(dst.ctypes.data, [0])
        assert (
            make_read(reader, p.name, local, rows(p.base, [3]), b"", Notifs()) is None
        )
        # The same extent is reused for a new segment: shared anew.
        p.table.map_pages([2])
        wait_until(lambda: importer.num_mapped == 2)
    finally:
        reader.disconnect(p.name)
        p.close()


def test_reads_of_one_list_follow_the_chunks_mapped_at_each_read(producer, reader):
    """A reader keeps where a producer's descriptors lie in its chunks, per
    descriptor list, for the reads that follow; a drop forgets it. After the
    producer gave a page back, a read of the same list goes to NIXL; after
    it mapped the page again (a new chunk), the read copies the new bytes."""
    table = producer.table
    table.map_pages([0])
    fill(table, 3, 7)
    importer = connect(reader, producer, 1)
    dst = np.zeros(BLOCK, dtype=np.uint8)
    local = Descs(rows(dst.ctypes.data, [0]), "DRAM")
    remote = Descs(rows(producer.base, range(NUM_BLOCKS)), "DRAM")

    def read(block):
        xfer = reader.make_read(
            producer.name, local, np.array([0]), remote, np.array([block]), b"", None
        )
        if xfer is None:
            return None
        xfer.post()
        assert finish(xfer) == "DONE"
        xfer.release()
        return int(dst[0])

    assert read(3) == 7
    table.unmap_pages([0])
    wait_until(lambda: importer.num_mapped == 0)
    assert read(3) is None
    table.map_pages([0])
    fill(table, 3, 9)
    wait_until(lambda: importer.num_mapped == 1)
    assert read(3) == 9


def test_a_reader_that_leaves_while_asked_to_drop_is_no_fault(
    producer, reader, monkeypatch, caplog
):
    """The reader disconnects between the unmap choosing to ask it and the
    ask: the send fails on the closed channel, which is the end the unmap
    waits for, so nothing is logged as a fault."""
    table, exporter = producer.table, producer.exporter
    table.map_pages([0, 1])
    assert reader.offer(producer.name, producer.secret)
    wait_until(lambda: reader.importer(producer.name).num_mapped == 2)
    send = channel.send
    asked = []

    def leave_then_send(sock, msg, fds=()):
        if isinstance(msg, channel.Drop):
            asked.append(msg.ids)
            reader.disconnect(producer.name)
            wait_until(lambda: exporter.num_peers == 0)
        return send(sock, msg, fds)

    monkeypatch.setattr(channel, "send", leave_then_send)
    with caplog.at_level("INFO"):
        table.unmap_pages([0])
    assert asked and table.mapped_pages() == [1]
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


def test_unmap_waits_for_a_read_in_flight_and_is_refused_after_the_timeout(producer):
    table, exporter = producer.table, producer.exporter
    exporter.drop_timeout_s = 0.5
    table.map_pages([0])
    fill(table, 1, 42)
    copier = GatedCopier()
    reads = Reader(copier)
    try:
        connect(reads, producer, 1)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        xfer = read_block(reads, producer, dst, 1)
        xfer.post()
        assert copier.copying.wait(10)
        with pytest.raises(VmmError, match="still map"):
            table.unmap_pages([0])
        assert table.is_mapped(0)
        copier.gate.set()
        assert finish(xfer) == "DONE"
        assert (dst == 42).all()
        xfer.release()
        exporter.drop_timeout_s = 5.0
        table.unmap_pages([0])
        assert not table.is_mapped(0) and exporter.held_by_peers() == 0
    finally:
        copier.gate.set()
        reads.close()


def test_a_channel_that_cannot_open_falls_back_with_the_reason(
    producer, reader, caplog
):
    producer.table.map_pages([0])
    before = same_host_stats()
    absent = f"absent-{uuid.uuid4()}"
    with caplog.at_level("WARNING"):
        assert not reader.offer(absent, channel.new_secret())
        # A peer whose handshake offered no channel (stock KV tensors).
        assert not reader.offer(f"stock-{uuid.uuid4()}", b"")
    assert "go through NIXL/UCX (unreachable)" in caplog.text
    assert "Connection refused" in caplog.text
    assert "go through NIXL/UCX (unshared): no same-host channel" in caplog.text
    after = same_host_stats()
    for reason in ("unreachable", "unshared"):
        key = f"fallbacks_{reason}"
        assert after[key] == before.get(key, 0) + 1, reason
    # Reads from it go through NIXL, counted under the channel's reason,
    # logged once.
    assert (
        make_read(
            reader,
            absent,
            np.zeros((1, 3), np.uint64),
            np.zeros((1, 3), np.uint64),
            b"",
            None,
        )
        is None
    )
    assert (
        same_host_stats()["fallbacks_unreachable"] == after["fallbacks_unreachable"] + 1
    )
    assert caplog.text.count("(unreachable)") == 1
    # Another host (another boot id): refused by both sides.
    with pytest.raises(SameHostUnavailable, match="not this host") as e:
        ChunkImporter(
            producer.name,
            producer.secret,
            HostVmmBackend(),
            "elsewhere",
            identity=("another-boot-id", "elsewhere"),
        )
    assert e.value.reason == Fallback.OTHER_HOST
    wait_until(
        lambda: same_host_stats().get("refused_other_host", 0)
        > before.get("refused_other_host", 0)
    )
    assert producer.exporter.num_peers == 0


def test_a_new_handshake_with_a_busy_producer_keeps_one_retry():
    """A second offer that times out too replaces the pending retry (the
    first timer is cancelled), and its wait has doubled."""
    name, secret = f"p-{uuid.uuid4()}", channel.new_secret()
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    busy.bind(channel.channel_address(name))
    busy.listen(4)  # never accepts: the connect succeeds, no answer comes
    reads = Reader(connect_timeout_s=0.2, retry_after_s=5.0, retry_max_s=30.0)
    try:
        assert not reads.offer(name, secret)
        first = reads._timers[name]
        assert not reads.offer(name, secret)
        second = reads._timers[name]
        assert second is not first and first.finished.is_set()
        assert first.interval == 5.0 and second.interval == 10.0
        assert reads.retry_due(name)
        reads.disconnect(name)
        assert not reads.retry_due(name) and second.finished.is_set()
    finally:
        busy.close()
        reads.close()


def test_a_channel_that_timed_out_is_opened_again_later(caplog):
    """A producer too busy to answer in time: reads go through NIXL, and the
    channel is tried again in the background ``retry_after_s`` later, then
    after twice as long per further timeout (up to ``retry_max_s``)."""
    name, secret = f"p-{uuid.uuid4()}", channel.new_secret()
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    busy.bind(channel.channel_address(name))
    busy.listen(4)  # never accepts: the connect succeeds, no answer comes
    reads = Reader(connect_timeout_s=0.3, retry_after_s=0.4, retry_max_s=1.0)
    backend, table = make_table()
    table.map_pages([0])
    dst = np.zeros(BLOCK, dtype=np.uint8)
    local = rows(dst.ctypes.data, [0])
    remote = rows(table.tensors[0].data_ptr(), [0])
    exporter = None
    try:
        with caplog.at_level("WARNING"):
            assert not reads.offer(name, secret)
        assert "(timeout)" in caplog.text
        assert make_read(reads, name, local, remote, b"", Notifs()) is None
        # Tried again 0.4 s later (timing out at 0.7 s), then 0.8 s after that.
        start = time.monotonic()
        wait_until(lambda: not reads.retry_due(name))  # the retry runs
        wait_until(lambda: reads.retry_due(name))  # it timed out again
        busy.close()
        exporter = ChunkExporter(name, secret)
        exporter.attach(table)
        time.sleep(max(0.0, start + 1.2 - time.monotonic()))
        assert reads.importer(name) is None  # not due yet
        wait_until(lambda: reads.importer(name) is not None)
        assert time.monotonic() - start >= 1.4
        wait_until(lambda: reads.importer(name).num_mapped == 1)
        xfer = make_read(reads, name, local, remote, b"", Notifs())
        assert xfer is not None
        xfer.release()
        # A peer without a listener is not retried.
        assert not reads.offer(f"absent-{uuid.uuid4()}", secret)
        assert not reads.retry_due(f"absent-{uuid.uuid4()}")
    finally:
        busy.close()
        reads.close()
        if exporter is not None:
            exporter.close()
        table.close()
        backend.close()


def test_a_reader_of_device_memory_is_refused_host_memory(producer):
    """The producer shares host memory; a reader whose KV is a device's
    cannot copy out of it: refused with the reason, nothing mapped."""

    class DeviceLike(HostVmmBackend):
        def __init__(self):
            super().__init__()
            self.device = torch.device("meta")

    producer.table.map_pages([0])
    backend = DeviceLike()
    try:
        with pytest.raises(SameHostUnavailable, match="shares cpu memory") as e:
            ChunkImporter(producer.name, producer.secret, backend, "reader")
        assert e.value.reason == Fallback.KIND
    finally:
        backend.close()


def test_closing_the_exporter_makes_readers_drop_everything(producer, reader):
    producer.table.map_pages([0, 1])
    assert reader.offer(producer.name, producer.secret)
    importer = reader.importer(producer.name)
    wait_until(lambda: importer.num_mapped == 2)
    closing = threading.Thread(target=producer.exporter.close)
    closing.start()
    closing.join(10)
    assert not closing.is_alive()
    wait_until(lambda: not importer.alive and importer.num_mapped == 0)
    assert not reader.has_channel(producer.name)
