# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-host reads as transfer handles: posted, polled to their end, their
chunks pinned meanwhile, released in flight; and every read that goes to
NIXL/UCX instead counted with its reason. Real exporter, sockets and host
VMM memory; the asynchronous copier stands in for a device."""

import threading
import time

import numpy as np

from tests.v1.kv_connector.unit.nixl_vmm.channel_utils import (  # noqa: F401 (fixture)
    producer_fixture,
    read_shared_block,
)
from tests.v1.kv_connector.unit.nixl_vmm.same_host_utils import (  # noqa: F401 (fixture)
    AsyncGatedCopier,
    Notifs,
    Reader,
    connect,
    finish,
    make_read,
    read_block,
    reader_fixture,
)
from tests.v1.kv_connector.unit.nixl_vmm.utils import (
    BLOCK,
    fill,
    requires_nixl,
    rows,
    wait_until,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
    CopyJob,
    HostCopier,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    same_host_stats,
)


def test_asynchronous_copies_complete_when_polled_and_hold_their_chunks(producer):
    """Copies enqueued on a device: the read is posted on the caller's thread
    and completes when a poll finds its event done; until then its chunks
    stay pinned (an unmap waits), and a read given up while in flight waits
    for its copies before its chunks go."""
    table = producer.table
    table.map_pages([0])
    fill(table, 3, 7)
    copier = AsyncGatedCopier()
    reads = Reader(copier)
    try:
        importer = connect(reads, producer, 1)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        local, remote = rows(dst.ctypes.data, [0]), rows(producer.base, [3])
        notifs = Notifs()
        xfer = make_read(reads, producer.name, local, remote, b"r", notifs)
        assert xfer.post() == "PROC"
        assert xfer.check() == "PROC"
        # The producer gives the page back: it waits for the read in flight.
        unmapping = threading.Thread(target=table.unmap_pages, args=([0],))
        unmapping.start()
        time.sleep(0.2)
        assert unmapping.is_alive() and importer.num_mapped == 1
        copier.gate.set()
        assert finish(xfer) == "DONE"
        assert notifs == [(producer.name, b"r")] and (dst == 7).all()
        assert copier.freed == 1
        unmapping.join(10)
        assert not unmapping.is_alive() and importer.num_mapped == 0
        xfer.release()

        # Given up in flight: release waits for the copies, then unpins.
        table.map_pages([0])
        wait_until(lambda: importer.num_mapped == 1)
        copier.gate.clear()
        xfer = make_read(reads, producer.name, local, remote, b"", notifs)
        assert xfer.post() == "PROC"
        threading.Timer(0.2, copier.gate.set).start()
        xfer.release()
        assert copier.freed == 2 and xfer.state() == "DONE"
        assert importer.reads_in_flight == 0
        # A read never posted unpins at release.
        xfer = make_read(reads, producer.name, local, remote, b"", notifs)
        xfer.release()
        assert importer.reads_in_flight == 0
    finally:
        copier.gate.set()
        reads.close()


def test_a_drop_waits_for_the_reads_before_it_and_not_for_later_ones(producer):
    """A drop waits for the reads in flight when it began (they may copy out
    of its chunks), not for the reads made while it waits (they cannot use
    its chunks): reads that keep coming never hold a producer's unmap up."""
    table = producer.table
    table.map_pages([0, 1])
    fill(table, 3, 7)
    fill(table, 9, 5)
    copier = AsyncGatedCopier()
    reads = Reader(copier)
    try:
        importer = connect(reads, producer, 2)
        dst = np.zeros(2 * BLOCK, dtype=np.uint8)
        before = read_block(reads, producer, dst[:BLOCK], 3)
        assert before.post() == "PROC"
        unmapping = threading.Thread(target=table.unmap_pages, args=([0],))
        unmapping.start()
        time.sleep(0.2)
        assert unmapping.is_alive()
        # A read of the other page while the drop waits, still in flight
        # when the read before the drop is over.
        later = read_block(reads, producer, dst[BLOCK:], 9)
        assert later.post() == "PROC"
        copier.gate.set()
        assert finish(before) == "DONE"
        unmapping.join(10)
        assert not unmapping.is_alive() and importer.num_mapped == 1
        assert importer.reads_in_flight == 1
        assert finish(later) == "DONE"
        assert (dst[:BLOCK] == 7).all() and (dst[BLOCK:] == 5).all()
        before.release()
        later.release()
        assert importer.reads_in_flight == 0
    finally:
        copier.gate.set()
        reads.close()


class _DoneJob(CopyJob):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class SyncCopier(HostCopier):
    """Host copies done before submit() returns (a device that was quick)."""

    def submit(self, runs):
        self.copy(runs)
        return _DoneJob()


def test_a_read_done_when_posted_is_notified_and_counted_once(producer):
    """Copies over before post() returns: the caller is told DONE and may
    never poll, so the producer's notification and the read's count must not
    wait for a poll (NIXL notifies with the transfer itself)."""
    table = producer.table
    table.map_pages([0])
    fill(table, 2, 5)
    reader = Reader(SyncCopier())
    try:
        _read_done_at_post(producer, reader)
    finally:
        reader.close()


def _read_done_at_post(producer, reader):
    assert reader.offer(producer.name, producer.secret)
    wait_until(lambda: reader.importer(producer.name).num_mapped == 1)
    dst = np.zeros(BLOCK, dtype=np.uint8)
    local, remote = rows(dst.ctypes.data, [0]), rows(producer.base, [2])
    notifs = Notifs()
    before = same_host_stats()
    xfer = make_read(reader, producer.name, local, remote, b"d", notifs)
    assert xfer.post() == "DONE"
    assert notifs == [(producer.name, b"d")] and (dst == 5).all()
    assert same_host_stats()["reads"] == before["reads"] + 1
    # Polled anyway: nothing is sent or counted twice.
    assert xfer.check() == "DONE"
    assert notifs == [(producer.name, b"d")]
    assert same_host_stats()["reads"] == before["reads"] + 1
    xfer.release()


def test_reads_that_leave_the_path_are_counted_by_reason(producer, reader):
    table = producer.table
    table.map_pages([0])
    dst = np.zeros(BLOCK, dtype=np.uint8)
    local, remote = rows(dst.ctypes.data, [0]), rows(producer.base, [1])
    before = same_host_stats()
    # Never offered a channel: the reader has nothing for this peer.
    assert make_read(reader, "stranger", local, remote, b"", Notifs()) is None
    assert reader.offer(producer.name, producer.secret)
    wait_until(lambda: reader.importer(producer.name).num_mapped == 1)
    # Outside the shared chunks (page 5 is not mapped).
    assert (
        make_read(reader, producer.name, local, rows(producer.base, [40]), b"", None)
        is None
    )
    # The channel closed (the producer stopped sharing).
    producer.exporter.close()
    wait_until(lambda: not reader.has_channel(producer.name))
    assert make_read(reader, producer.name, local, remote, b"", None) is None
    after = same_host_stats()
    for reason in ("unshared", "not_shared", "channel_closed"):
        key = f"fallbacks_{reason}"
        assert after.get(key, 0) == before.get(key, 0) + 1, reason
    assert after["fallbacks"] == before["fallbacks"] + 3


@requires_nixl
def test_a_notification_that_fails_fails_the_read(producer, reader):
    """NIXL could not tell the producer the read is done (it left): the read
    is an error, counted when released."""
    from nixl._bindings import nixlRemoteDisconnectError

    table = producer.table
    table.map_pages([0])
    fill(table, 0, 1)
    assert reader.offer(producer.name, producer.secret)
    wait_until(lambda: reader.importer(producer.name).num_mapped == 1)
    dst = np.zeros(BLOCK, dtype=np.uint8)

    def notify(agent, msg):
        raise nixlRemoteDisconnectError("the peer is gone")

    before = same_host_stats()
    xfer = make_read(
        reader,
        producer.name,
        rows(dst.ctypes.data, [0]),
        rows(producer.base, [0]),
        b"n",
        notify,
    )
    xfer.post()
    assert finish(xfer) == "ERR"
    xfer.release()
    after = same_host_stats()
    assert after["failed"] == before["failed"] + 1
    assert after["reads"] == before["reads"]


def test_a_reader_with_the_wrong_secret_falls_back_with_the_reason(producer):
    """A reader handshaken with another engine of the same name (or sent a
    stale secret) cannot prove itself: refused, and it reads through NIXL."""
    producer.table.map_pages([0, 1])
    fill(producer.table, 2, 3)
    before = same_host_stats()
    reader = Reader()
    try:
        assert not reader.offer(producer.name, channel.new_secret())
        # The producer's proof did not match our secret: we never sent ours.
        after = same_host_stats()
        assert after["fallbacks_auth"] == before.get("fallbacks_auth", 0) + 1
        assert not reader.has_channel(producer.name)
    finally:
        reader.close()
    assert (read_shared_block(producer, 2) == 3).all()
