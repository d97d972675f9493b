# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chunk export and import on the same-host channel, in one process: real
host VMM memory (memfd extents), real Unix-domain sockets passing real file
descriptors, a real exporter and a bare importer whose reads are pinned
copies out of the chunks it maps (the reads registry over it:
test_same_host_reads.py)."""

import ctypes
import os
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.channel_utils import (  # noqa: F401 (fixture)
    Producer,
    drain,
    producer_fixture,
    prove,
    raw,
    read_shared_block,
    refused,
)
from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    BLOCK,
    NUM_BLOCKS,
    fill,
    rows,
    wait_until,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
    SameHostUnavailable,
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


@pytest.fixture(name="backend")
def backend_fixture() -> Iterator[HostVmmBackend]:
    """The reader's VMM backend (maps the chunks it is sent)."""
    backend = HostVmmBackend()
    yield backend
    backend.close()


@pytest.fixture(name="importer")
def importer_fixture(producer, backend) -> Iterator[ChunkImporter]:
    """A reader's channel to ``producer``."""
    importer = ChunkImporter(producer.name, producer.secret, backend, "reader")
    yield importer
    importer.close()


def copy_block(importer, remote: Descs, index: int, dst: np.ndarray) -> bool:
    """Copy the producer's descriptor ``index`` of ``remote`` into ``dst`` as a
    read does: pinned while it copies; False (no copy) unless it lies in a
    chunk mapped now."""
    pinned = importer.pin(remote, np.array([index]))
    if pinned is None:
        return False
    addrs, generation = pinned
    try:
        ctypes.memmove(dst.ctypes.data, int(addrs[0]), dst.nbytes)
    finally:
        importer.unpin(generation)
    return True


def test_a_listener_without_the_secret_gets_no_proof_from_a_reader():
    """A process squatting on a producer's address cannot prove it is the
    producer: the reader refuses it and never sends its proof."""
    name, secret = f"squatter-{os.getpid()}", channel.new_secret()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(channel.channel_address(name))
    listener.listen(1)
    backend = HostVmmBackend()
    got: list[bytes] = []

    def squat() -> None:
        conn, _ = listener.accept()
        conn.settimeout(10)
        hello, _ = channel.recv(conn, channel.HELLO)
        boot_id, hostname = channel.host_identity()
        channel.send(
            conn,
            channel.Challenge(
                boot_id=boot_id,
                hostname=hostname,
                kind="cpu",
                nonce=os.urandom(32),
                proof=os.urandom(32),
            ),
        )
        got.extend(drain(conn)[0])

    t = threading.Thread(target=squat)
    t.start()
    try:
        with pytest.raises(SameHostUnavailable, match="could not prove") as e:
            ChunkImporter(name, secret, backend, "reader")
        assert e.value.reason == Fallback.AUTH
        t.join(10)
        assert got == []  # no proof was sent to it
    finally:
        listener.close()
        backend.close()


def test_garbage_from_a_proven_reader_detaches_only_that_reader(producer, backend):
    """A reader that proved itself and then breaks the protocol is detached
    (its chunks no longer count as held); other readers keep reading."""
    serving = producer
    serving.table.map_pages([0, 1])
    fill(serving.table, 2, 3)
    before = same_host_stats()
    good = ChunkImporter(serving.name, serving.secret, backend, "good")
    try:
        wait_until(lambda: good.num_mapped == 2)
        s = raw(serving.name)
        prove(s, serving.name, serving.secret, "garbler")
        welcome, _ = channel.recv(s, channel.WELCOME)
        assert welcome is not None
        wait_until(lambda: serving.exporter.num_peers == 2)
        s.sendall(b"\xc1 not msgpack")
        drain(s)
        wait_until(lambda: refused("protocol", before))
        wait_until(lambda: serving.exporter.num_peers == 1)
        # Its chunks are not waited for: the unmap needs only the good reader.
        serving.table.unmap_pages([1])
        assert good.num_mapped == 1
    finally:
        good.close()
    assert (read_shared_block(serving, 2) == 3).all()


class RecordingBackend(HostVmmBackend):
    """Records, at each release, how many chunks the reader still maps."""

    importer: ChunkImporter | None = None
    mapped_at_release: list[int]

    def release(self, handle):
        if self.importer is not None:
            self.mapped_at_release.append(self.importer.num_mapped)
        super().release(handle)


def test_owner_gives_a_chunk_back_only_after_the_reader_dropped_it(backend):
    """fallocate(PUNCH_HOLE) frees pages under a reader's mapping too: the
    reader must have unmapped a chunk before the owner releases it."""
    owner = RecordingBackend()
    owner.mapped_at_release = []
    p = Producer(backend=owner)
    importer = None
    try:
        p.table.map_pages([0, 1])
        importer = ChunkImporter(p.name, p.secret, backend, "reader")
        owner.importer = importer
        wait_until(lambda: importer.num_mapped == 2)
        p.table.unmap_pages([0])
        assert owner.mapped_at_release == [1]
        assert p.exporter.held_by_peers() == 1
        # The dropped chunk is no longer readable through the channel.
        assert importer.pin(Descs(rows(p.base, [3]), "DRAM"), np.array([0])) is None
        # The same extent is reused for a new segment: shared anew.
        p.table.map_pages([2])
        wait_until(lambda: importer.num_mapped == 2)
    finally:
        if importer is not None:
            importer.close()
        p.close()


def test_reads_of_one_list_follow_the_chunks_mapped_at_each_read(producer, importer):
    """A reader keeps where a producer's descriptors lie in its chunks, per
    descriptor list, for the reads that follow; a drop forgets it. After the
    producer gave a page back, a read of the same list is not resolved (it
    goes to NIXL); after it mapped the page again (a new chunk), the read
    copies the new bytes."""
    table = producer.table
    table.map_pages([0])
    fill(table, 3, 7)
    wait_until(lambda: importer.num_mapped == 1)
    dst = np.zeros(BLOCK, dtype=np.uint8)
    remote = Descs(rows(producer.base, range(NUM_BLOCKS)), "DRAM")

    def read(block):
        return int(dst[0]) if copy_block(importer, remote, block, dst) else None

    assert read(3) == 7
    table.unmap_pages([0])
    wait_until(lambda: importer.num_mapped == 0)
    assert read(3) is None
    table.map_pages([0])
    fill(table, 3, 9)
    wait_until(lambda: importer.num_mapped == 1)
    assert read(3) == 9


def test_a_read_that_misses_addresses_looks_its_list_up_whole(
    producer, importer, monkeypatch
):
    """A read that misses addresses in chunks mapped since its list was
    last looked at finds where every descriptor of the list lies (one
    lookup), so reads of other blocks in those chunks look nothing up; read
    by read, each of a list's first reads paid a lookup of its own. Also
    after chunks come later (a reader's first reads can come before every
    chunk is mapped here). A read that misses too little of a large list
    for that looks up its own blocks alone."""
    table = producer.table
    dst = np.zeros(BLOCK, dtype=np.uint8)
    remote = Descs(rows(producer.base, range(NUM_BLOCKS)), "DRAM")

    def map_page(page):
        table.map_pages([page])
        for block in range(8 * page, 8 * page + 8):
            fill(table, block, block + 1)
        wait_until(lambda: importer.num_mapped == page + 1)

    def read(block):
        return copy_block(importer, remote, block, dst) and dst[0] == block + 1

    def read_all(blocks):
        pinned = importer.pin(remote, np.array(blocks))
        assert pinned is not None
        importer.unpin(pinned[1])

    looked_up = []
    look_up = importer._look_up

    def counted_look_up(*args):
        looked_up.append(args)
        return look_up(*args)

    monkeypatch.setattr(importer, "_look_up", counted_look_up)
    map_page(0)
    map_page(1)
    read_all(range(8))  # 8 of 64 blocks missed: the whole list
    assert all(read(block) for block in range(16))
    map_page(2)
    map_page(3)
    read_all(range(16, 24))  # again, for the chunks mapped since
    assert all(read(block) for block in range(32))
    assert not looked_up
    map_page(4)
    assert read(33)  # 1 of 64 missed: this block alone
    assert len(looked_up) == 1
    assert not copy_block(importer, remote, 50, dst)


def test_a_reader_that_leaves_while_asked_to_drop_is_no_fault(
    producer, backend, monkeypatch, caplog
):
    """The reader disconnects between the unmap choosing to ask it and the
    ask: the send fails on the closed channel, which is the end the unmap
    waits for, so nothing is logged as a fault."""
    table, exporter = producer.table, producer.exporter
    table.map_pages([0, 1])
    importer = ChunkImporter(producer.name, producer.secret, backend, "reader")
    wait_until(lambda: importer.num_mapped == 2)
    send = channel.send
    asked = []

    def leave_then_send(sock, msg, fds=()):
        if isinstance(msg, channel.Drop):
            asked.append(msg.ids)
            importer.close()
            wait_until(lambda: exporter.num_peers == 0)
        return send(sock, msg, fds)

    monkeypatch.setattr(channel, "send", leave_then_send)
    with caplog.at_level("INFO"):
        table.unmap_pages([0])
    assert asked and table.mapped_pages() == [1]
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


def test_unmap_waits_for_a_read_in_flight_and_is_refused_after_the_timeout(
    producer, importer
):
    """A read pins the chunks it copies from until its copies are over: an
    unmap meanwhile waits for it, and is refused after the timeout."""
    table, exporter = producer.table, producer.exporter
    exporter.drop_timeout_s = 0.5
    table.map_pages([0])
    fill(table, 1, 42)
    wait_until(lambda: importer.num_mapped == 1)
    remote = Descs(rows(producer.base, [1]), "DRAM")
    pinned = importer.pin(remote, np.array([0]))
    assert pinned is not None
    addrs, generation = pinned
    try:
        with pytest.raises(VmmError, match="still map"):
            table.unmap_pages([0])
        assert table.is_mapped(0)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        ctypes.memmove(dst.ctypes.data, int(addrs[0]), BLOCK)
        assert (dst == 42).all()
    finally:
        importer.unpin(generation)
    assert importer.reads_in_flight == 0
    exporter.drop_timeout_s = 5.0
    table.unmap_pages([0])
    assert not table.is_mapped(0) and exporter.held_by_peers() == 0


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


def test_closing_the_exporter_makes_readers_drop_everything(producer, importer):
    producer.table.map_pages([0, 1])
    wait_until(lambda: importer.num_mapped == 2)
    closing = threading.Thread(target=producer.exporter.close)
    closing.start()
    closing.join(10)
    assert not closing.is_alive()
    wait_until(lambda: not importer.alive and importer.num_mapped == 0)
    assert importer.pin(Descs(rows(producer.base, [0]), "DRAM"), np.array([0])) is None
