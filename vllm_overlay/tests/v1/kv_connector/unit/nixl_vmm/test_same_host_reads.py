# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-host reads over the channel (SameHostReads): reads copied out of the
chunks a producer shares, a read that waits for chunks sent before it,
channels that cannot open (counted by reason) and those tried again, a
producer that dies mid-read; on a GPU host, CUDA chunks imported and
copied. Real exporter, sockets, processes and host VMM memory."""

import os
import socket
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.channel_utils import (  # noqa: F401 (fixture)
    producer_fixture,
    raw,
)
from tests.v1.kv_connector.unit.nixl_vmm.process_utils import (
    kill,
    readline,
    start_child,
)
from tests.v1.kv_connector.unit.nixl_vmm.same_host_utils import (  # noqa: F401 (fixture)
    AsyncGatedCopier,
    GatedCopier,
    Notifs,
    Reader,
    connect,
    finish,
    make_read,
    reader_fixture,
)
from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    BLOCK,
    fill,
    make_table,
    rows,
    wait_until,
)
from tests.v1.kv_vmm.cuda_utils import requires_cuda_vmm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import (
    exporter as exporter_mod,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
    SameHostUnavailable,
    new_secret,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import copier_for
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
    ChunkExporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.importer import (
    ChunkImporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.same_host import (
    SameHostReads,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    Fallback,
    same_host_stats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import Descs
from vllm.v1.kv_vmm import HostVmmBackend


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


def test_a_read_knows_its_lengths_and_alignment_without_looking(producer, reader):
    """Both known per descriptor list (and the chunks' places here): the
    copies of a read carry them, and they hold for every copy."""
    table = producer.table
    table.map_pages([0, 1])
    importer = connect(reader, producer, 2)
    dst = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    xfer = make_read(
        reader,
        producer.name,
        rows(dst.data_ptr(), range(4)),
        rows(producer.base, [9, 2, 3, 0]),
        b"",
        Notifs(),
    )
    runs = xfer.runs
    assert runs.uniform_nbytes == BLOCK
    assert runs.nbytes.tolist() == [BLOCK] * 4
    alignment = runs.alignment
    assert alignment >= 16 and alignment & (alignment - 1) == 0
    assert alignment <= importer.alignment
    for column in (runs.dst, runs.src, runs.nbytes):
        assert not (column % np.uint64(alignment)).any()
    xfer.release()
    # Lengths that differ between descriptors: read from the lists.
    base = dst.data_ptr()
    local = Descs(np.array([(base, 48, 0), (base + 64, 16, 0)]), "DRAM")
    remote = Descs(
        np.array([(producer.base, 48, 0), (producer.base + 64, 16, 0)]), "DRAM"
    )
    assert local.alignment == 16
    ids = np.arange(2)
    xfer = reader.make_read(producer.name, local, ids, remote, ids, b"", Notifs())
    assert xfer.runs.uniform_nbytes is None
    assert xfer.runs.nbytes.tolist() == [48, 16]
    assert xfer.runs.alignment == 16
    xfer.release()


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


@pytest.mark.parametrize("why", ["pending", "timed_out"])
def test_a_channel_the_producer_closed_in_its_handshake_is_tried_again(
    producer, why, monkeypatch
):
    """A producer that closes the channel before the reader's proof came is
    busy, not refusing: with its handshakes all taken (``MAX_PENDING``), or
    after it gave up waiting for a reader slow to answer (as a worker's
    thread starved at startup). The channel is tried again, and opens."""
    holders = []
    if why == "pending":
        # Connections that say nothing hold every handshake for its timeout.
        holders = [raw(producer.name) for _ in range(exporter_mod.MAX_PENDING)]
        wait_until(lambda: producer.exporter._pending == exporter_mod.MAX_PENDING)
    else:
        # The producer waits 0.2 s for the proof; the reader's first one comes
        # 0.5 s after the challenge.
        monkeypatch.setattr(channel, "IO_TIMEOUT_S", 0.2)
        proof, late = channel.proof, [True]

        def slow_proof(secret, role, *args):
            if role == "reader" and late:
                late.clear()
                time.sleep(0.5)
            return proof(secret, role, *args)

        monkeypatch.setattr(channel, "proof", slow_proof)
    reads = Reader(retry_after_s=0.3, retry_max_s=1.0)
    try:
        before = same_host_stats().get("fallbacks_busy", 0)
        assert not reads.offer(producer.name, producer.secret)
        assert reads.retry_due(producer.name)
        assert same_host_stats()["fallbacks_busy"] == before + 1
        for s in holders:
            s.close()
        wait_until(lambda: reads.has_channel(producer.name))
        assert not reads.retry_due(producer.name)
        assert producer.exporter.num_peers == 1
    finally:
        for s in holders:
            s.close()
        reads.close()


# Real processes started and killed: about 10 s a case.
@pytest.mark.slow_test
@pytest.mark.parametrize("copier_cls", [GatedCopier, AsyncGatedCopier])
def test_a_producer_that_dies_mid_read_fails_the_read(copier_cls):
    """Copies on a thread of the reader (host) or enqueued and polled
    (device): either way the read fails and its chunk stays mapped until the
    copies are over."""
    peer = SimpleNamespace(name=f"p-{os.getpid()}-{time.monotonic_ns()}")
    peer.secret = new_secret()
    name, secret = peer.name, peer.secret
    child = start_child(
        """
    backend = HostVmmBackend()
    geometry = KVPageGeometry([KVTensorLayout(block_bytes=BLOCK, num_regions=1)],
                              num_blocks=64, granularity=backend.granularity)
    table = KVPageTable(backend, geometry, max_pages=geometry.num_pages)
    table.map_pages([0])
    table.tensors[0][:BLOCK].fill_(5)
    exporter = ChunkExporter(NAME, SECRET)
    exporter.attach(table)
    print("BASE", table.tensors[0].data_ptr(), flush=True)
    time.sleep(600)
    """,
        peer,
    )
    copier = copier_cls()
    reads = Reader(copier)
    try:
        base = int(readline(child, "BASE").split()[1])
        assert reads.offer(name, secret)
        importer = reads.importer(name)
        wait_until(lambda: importer.num_mapped == 1)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        notifs = Notifs()
        local = rows(dst.ctypes.data, [0])
        xfer = make_read(reads, name, local, rows(base, [0]), b"req", notifs)
        xfer.post()
        assert copier.copying.wait(10)
        kill(child)
        wait_until(lambda: not importer.alive)
        # The channel is gone; the reader still maps the chunk until the copy
        # that pinned it ends (the mapping keeps the memory: no freed reads).
        assert importer.num_mapped == 1
        copier.gate.set()
        assert finish(xfer) == "ERR"
        assert notifs == []
        xfer.release()
        wait_until(lambda: importer.num_mapped == 0)
        # Later reads from it go through NIXL (whose failure policy applies).
        assert make_read(reads, name, local, rows(base, [0]), b"", notifs) is None
    finally:
        copier.gate.set()
        child.kill()
        reads.close()


@pytest.mark.gpu
@requires_cuda_vmm
@pytest.mark.parametrize("copy", ["kernel", "batch"])
def test_cuda_chunks_are_imported_and_copied(copy):
    """CUDA backend: the exported allocations are imported, mapped with
    access for the reader's device and copied asynchronously, by the copy
    kernel or with one batched copy, a read that a poll completes: blocks in
    another order on each side (runs of one block) and adjacent ones (one
    run)."""
    from vllm.v1.kv_vmm.cuda import CudaVmmBackend

    backend = CudaVmmBackend(torch.device("cuda", 0))
    if not backend.fd_exportable:
        pytest.skip("the device cannot export allocations as POSIX fds")
    _, table = make_table(backend)
    name, secret = f"p-{uuid.uuid4()}", new_secret()
    exporter = ChunkExporter(name, secret)
    exporter.attach(table)
    reader_backend = CudaVmmBackend(torch.device("cuda", 0))
    copier = copier_for(reader_backend, copy_kernel=copy == "kernel")
    # On a GPU host the kernel must be there when asked for.
    assert (copier.kernel is not None) == (copy == "kernel")
    reads = SameHostReads(reader_backend, copier, "reader")
    try:
        table.map_pages([0, 1])
        for block in range(16):
            flat = table.tensors[0].view(torch.uint8)
            flat[block * BLOCK : (block + 1) * BLOCK].fill_(block + 1)
        torch.accelerator.synchronize()
        assert reads.offer(name, secret)
        wait_until(lambda: reads.importer(name).num_mapped == 2)
        dst = torch.zeros(16 * BLOCK, dtype=torch.uint8, device="cuda")
        local = [0, 1, 2, 3, 4, 5, 6, 7]
        remote = [9, 3, 12, 0, 15, 4, 5, 6]  # two pages; 4, 5, 6 adjacent
        xfer = make_read(
            reads,
            name,
            rows(dst.data_ptr(), local),
            rows(table.tensors[0].data_ptr(), remote),
            b"",
            Notifs(),
        )
        assert len(xfer.runs) == len(local)
        assert len(xfer.runs.coalesced()) == 6
        xfer.post()
        assert finish(xfer) == "DONE"
        got = dst.view(16, BLOCK).cpu()
        for i, block in enumerate(remote):
            assert bool((got[i] == block + 1).all()), (i, block)
        assert bool((got[len(local) :] == 0).all())
        xfer.release()
        table.unmap_pages([0, 1])
        assert reads.importer(name).num_mapped == 0
    finally:
        reads.close()
        exporter.close()
        table.close()
        backend.close()
        reader_backend.close()
