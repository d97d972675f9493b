# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-host path of NixlConnector over VMM-backed KV memory, with real
host VMM memory (memfd extents), real Unix-domain sockets passing real file
descriptors, and real processes for the peers that die."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from tests.v1.kv_vmm.utils import (
    requires_cuda_vmm,
    requires_nixl,
    ucx_over_loopback,
)
from vllm.v1.kv_vmm import (
    HostVmmBackend,
    KVPageGeometry,
    KVPageTable,
    KVTensorLayout,
    VmmError,
)
from vllm.v1.kv_vmm.nixl_samehost import (
    ChunkExporter,
    ChunkImporter,
    HostChunkMemory,
    SameHostReads,
    SameHostUnavailable,
    channel_address,
    coalesce,
    same_host_stats,
)

BLOCK = 256 * 1024  # 8 blocks per 2 MiB page
NUM_BLOCKS = 64


def _table(backend=None, num_blocks=NUM_BLOCKS, block=BLOCK):
    backend = backend or HostVmmBackend()
    geometry = KVPageGeometry(
        [KVTensorLayout(block_bytes=block, num_regions=1)],
        num_blocks=num_blocks,
        granularity=backend.granularity,
    )
    return backend, KVPageTable(backend, geometry, max_pages=geometry.num_pages)


def _fill(table, block, value, block_bytes=BLOCK):
    flat = table.tensors[0].view(torch.uint8)
    flat[block * block_bytes : (block + 1) * block_bytes].fill_(value)


def _rows(base, blocks, block_bytes=BLOCK):
    return np.array(
        [(base + b * block_bytes, block_bytes, 0) for b in blocks], dtype=np.uint64
    )


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _run_read(agent, *prepped, notif_msg=b"", timeout=30.0):
    """One READ of prepared lists through a (wrapped) NIXL agent, polled to
    its end: (handle, final state); the caller releases the handle."""
    handle = agent.make_prepped_xfer("READ", *prepped, notif_msg=notif_msg)
    agent.transfer(handle)
    deadline = time.monotonic() + timeout
    while (state := agent.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline
    return handle, state


def _wait_for_notif(agent, sender, msg, timeout=30.0):
    """Until ``agent`` got the NIXL notification ``msg`` from ``sender``."""
    deadline = time.monotonic() + timeout
    notifs: list[bytes] = []
    while msg not in notifs:
        assert time.monotonic() < deadline, notifs
        notifs += agent.get_new_notifs().get(sender, [])


def _finish(reads, xfer, notifs, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (state := reads.check(xfer, lambda a, m: notifs.append((a, m)))) == "PROC":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return state


class GatedMemory(HostChunkMemory):
    """Host chunk memory whose copies wait for ``gate`` (a read in flight)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.copying = threading.Event()

    def copy(self, runs):
        self.copying.set()
        assert self.gate.wait(30)
        super().copy(runs)


class AsyncGatedMemory(HostChunkMemory):
    """Host chunk memory with the asynchronous interface of CudaChunkMemory
    (copies enqueued, an event polled): a copy completes once ``gate`` is
    set, as a device would finish it. Stands in for the device on CPU."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.copying = threading.Event()
        self.freed = 0

    def copy_async(self, runs):
        self.copying.set()
        return {"runs": runs, "copied": False}

    def done(self, event):
        if self.gate.is_set() and not event["copied"]:
            self.copy(event["runs"])
            event["copied"] = True
        return event["copied"]

    def wait(self, event):
        assert self.gate.wait(30)
        self.done(event)

    def free(self, event):
        self.freed += 1


@pytest.fixture
def producer():
    name = f"p-{uuid.uuid4()}"
    backend, table = _table()
    exporter = ChunkExporter(channel_address(name), drop_timeout_s=5.0)
    exporter.attach(table)
    yield name, backend, table, exporter
    exporter.close()
    table.close()
    backend.close()


def test_coalesce_merges_adjacent_rows_on_both_sides():
    dst = np.array([0, 100, 200, 1000], dtype=np.uint64)
    src = np.array([50, 150, 400, 250], dtype=np.uint64)
    n = np.full(4, 100, dtype=np.uint64)
    runs = coalesce(dst, src, n)
    # 0<-50 and 100<-150 merge; 1000<-250 follows 100<-150 in the source
    # but not in the destination; 200<-400 stands alone.
    assert sorted(map(tuple, runs.tolist())) == [
        (0, 50, 200),
        (200, 400, 100),
        (1000, 250, 100),
    ]


def test_host_copies_take_one_system_call_per_1024_runs_or_fall_back_to_memmove():
    """Scattered runs (more than one process_vm_readv call holds) land where
    they belong; a kernel that refuses the call (EPERM under a seccomp
    profile) leaves memmove doing the copies, from then on."""
    import ctypes
    import errno

    rng = np.random.default_rng(0)
    src = np.arange(3000 * 64, dtype=np.uint8) % 251
    for refuse in (False, True):
        memory = HostChunkMemory()
        calls: list[int] = []
        real = memory._readv
        assert real is not None

        def readv(*args, real=real, refuse=refuse, calls=calls):
            calls.append(args[2])
            if refuse:
                ctypes.set_errno(errno.EPERM)
                return -1
            return real(*args)

        memory._readv = readv
        dst = np.zeros_like(src)
        order = rng.permutation(3000)
        runs = np.array(
            [
                (dst.ctypes.data + 64 * i, src.ctypes.data + 64 * j, 64)
                for i, j in enumerate(order)
            ],
            dtype=np.uint64,
        )
        memory.copy(runs)
        assert (dst.reshape(3000, 64) == src.reshape(3000, 64)[order]).all()
        assert calls == ([1024] if refuse else [1024, 1024, 952])
        assert (memory._readv is None) == refuse


def test_reader_maps_shared_chunks_and_copies_them(producer):
    name, _, table, exporter = producer
    table.map_pages([0, 2])
    for b in [*range(8), *range(16, 24)]:
        _fill(table, b, b + 1)
    reads = SameHostReads(HostChunkMemory(), "reader")
    try:
        assert reads.connect(name)
        importer = reads.importer(name)
        _wait(lambda: importer.num_mapped == 2)
        assert exporter.num_peers == 1
        # Mapped after the reader connected: shared as well.
        table.map_pages([1])
        _fill(table, 9, 99)
        _wait(lambda: importer.num_mapped == 3)

        dst = np.zeros(5 * BLOCK, dtype=np.uint8)
        base = table.tensors[0].data_ptr()
        blocks = [16, 17, 18, 9, 2]
        xfer = reads.make_read(
            name, _rows(dst.ctypes.data, range(5)), _rows(base, blocks), b"req-1"
        )
        # 16, 17, 18 are adjacent on both sides: one copy.
        assert len(xfer.runs) == 3
        before = same_host_stats()
        assert reads.transfer(xfer) in ("PROC", "DONE")
        notifs: list[tuple[str, bytes]] = []
        assert _finish(reads, xfer, notifs) == "DONE"
        assert notifs == [(name, b"req-1")]
        for i, b in enumerate(blocks):
            want = 99 if b == 9 else b + 1
            assert (dst[i * BLOCK : (i + 1) * BLOCK] == want).all()
        assert xfer.telemetry().totalBytes == 5 * BLOCK
        after = same_host_stats()
        assert after["reads"] == before["reads"] + 1
        assert after["bytes"] == before["bytes"] + 5 * BLOCK
        reads.release(xfer)
        # A block on a page not mapped: not shared, the read goes to NIXL.
        assert (
            reads.make_read(name, _rows(dst.ctypes.data, [0]), _rows(base, [40]), b"")
            is None
        )
    finally:
        reads.close()
    _wait(lambda: exporter.num_peers == 0)


def test_asynchronous_copies_complete_when_polled_and_hold_their_chunks(producer):
    """Memory that enqueues copies (the CUDA path): the read is posted on the
    caller's thread and completes when a poll finds its event done; until
    then its chunks stay pinned (an unmap waits), and a read given up while
    in flight waits for its copies before its chunks go."""
    name, _, table, exporter = producer
    table.map_pages([0])
    _fill(table, 3, 7)
    memory = AsyncGatedMemory()
    reads = SameHostReads(memory, "reader")
    try:
        assert reads.connect(name)
        importer = reads.importer(name)
        _wait(lambda: importer.num_mapped == 1)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        base = table.tensors[0].data_ptr()
        xfer = reads.make_read(
            name, _rows(dst.ctypes.data, [0]), _rows(base, [3]), b"r"
        )
        assert reads.transfer(xfer) == "PROC"
        assert reads.check(xfer, lambda a, m: None) == "PROC"
        # The producer gives the page back: it waits for the read in flight.
        unmapping = threading.Thread(target=table.unmap_pages, args=([0],))
        unmapping.start()
        time.sleep(0.2)
        assert unmapping.is_alive() and importer.num_mapped == 1
        memory.gate.set()
        notifs: list[tuple[str, bytes]] = []
        assert _finish(reads, xfer, notifs) == "DONE"
        assert notifs == [(name, b"r")] and (dst == 7).all() and memory.freed == 1
        unmapping.join(10)
        assert not unmapping.is_alive() and importer.num_mapped == 0
        reads.release(xfer)

        # Given up in flight: release waits for the copies, then unpins.
        table.map_pages([0])
        _wait(lambda: importer.num_mapped == 1)
        memory.gate.clear()
        xfer = reads.make_read(name, _rows(dst.ctypes.data, [0]), _rows(base, [3]), b"")
        assert reads.transfer(xfer) == "PROC"
        threading.Timer(0.2, memory.gate.set).start()
        reads.release(xfer)
        assert memory.freed == 2 and xfer.state() == "DONE"
        assert all(m.pins == 0 for m in importer._mapped.values())
    finally:
        reads.close()


class SlowMapMemory(HostChunkMemory):
    """Host chunk memory whose maps take a while (a reader on a busy host)."""

    def map(self, fd, offset, nbytes):
        time.sleep(0.5)
        return super().map(fd, offset, nbytes)


def test_a_read_waits_for_chunks_sent_before_it_instead_of_leaving_the_path(producer):
    """The producer sends a chunk when it maps it, before any reader can be told
    of blocks in it; a reader that has not mapped it yet syncs with the
    producer, then reads it here instead of through NIXL/UCX."""
    name, _, table, _ = producer
    table.map_pages([0])
    reads = SameHostReads(SlowMapMemory(), "reader")
    try:
        assert reads.connect(name)
        importer = reads.importer(name)
        _wait(lambda: importer.num_mapped == 1)
        table.map_pages([3])
        _fill(table, 24, 7)
        # Sent already, still being mapped by the channel thread.
        assert importer.num_mapped == 1
        before = same_host_stats()
        dst = np.zeros(BLOCK, dtype=np.uint8)
        base = table.tensors[0].data_ptr()
        xfer = reads.make_read(
            name, _rows(dst.ctypes.data, [0]), _rows(base, [24]), b""
        )
        assert xfer is not None and importer.num_mapped == 2
        reads.transfer(xfer)
        assert _finish(reads, xfer, []) == "DONE"
        assert (dst == 7).all()
        reads.release(xfer)
        # Rows the producer never shared: one sync, then NIXL/UCX.
        assert (
            reads.make_read(name, _rows(dst.ctypes.data, [0]), _rows(base, [40]), b"")
            is None
        )
        after = same_host_stats()
        assert after["fallbacks"] == before["fallbacks"] + 1
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


def test_owner_gives_a_chunk_back_only_after_the_reader_dropped_it():
    """fallocate(PUNCH_HOLE) frees pages under a reader's mapping too: the
    reader must have unmapped a chunk before the owner releases it."""
    backend = RecordingBackend()
    backend.mapped_at_release = []
    _, table = _table(backend)
    name = f"p-{uuid.uuid4()}"
    exporter = ChunkExporter(channel_address(name), drop_timeout_s=5.0)
    exporter.attach(table)
    reads = SameHostReads(HostChunkMemory())
    try:
        table.map_pages([0, 1])
        assert reads.connect(name)
        importer = reads.importer(name)
        backend.importer = importer
        _wait(lambda: importer.num_mapped == 2)
        table.unmap_pages([0])
        assert backend.mapped_at_release == [1]
        assert exporter.held_by_peers() == 1
        # The dropped chunk is no longer readable through the channel.
        base = table.tensors[0].data_ptr()
        dst = np.zeros(BLOCK, dtype=np.uint8)
        assert (
            reads.make_read(name, _rows(dst.ctypes.data, [0]), _rows(base, [3]), b"")
            is None
        )
        # The same extent is reused for a new segment: shared anew.
        table.map_pages([2])
        _wait(lambda: importer.num_mapped == 2)
    finally:
        reads.close()
        exporter.close()
        table.close()
        backend.close()


def test_a_reader_that_leaves_while_asked_to_drop_is_no_fault(
    producer, monkeypatch, caplog
):
    """The reader disconnects between the unmap choosing to ask it and the
    ask: the send fails on the closed channel, which is the end the unmap
    waits for, so nothing is logged as a fault."""
    from vllm.v1.kv_vmm import nixl_samehost

    name, _, table, exporter = producer
    table.map_pages([0, 1])
    reads = SameHostReads(HostChunkMemory())
    assert reads.connect(name)
    _wait(lambda: reads.importer(name).num_mapped == 2)
    send = nixl_samehost._send
    asked = []

    def leave_then_send(sock, msg, fds=()):
        if msg.get("op") == "drop":
            asked.append(msg["ids"])
            reads.disconnect(name)
            _wait(lambda: exporter.num_peers == 0)
        return send(sock, msg, fds)

    monkeypatch.setattr(nixl_samehost, "_send", leave_then_send)
    with caplog.at_level("INFO", logger="vllm.v1.kv_vmm.nixl_samehost"):
        table.unmap_pages([0])
    assert asked and table.mapped_pages() == [1]
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


def test_unmap_waits_for_a_read_in_flight_and_is_refused_after_the_timeout(producer):
    name, _, table, exporter = producer
    exporter.drop_timeout_s = 0.5
    table.map_pages([0])
    _fill(table, 1, 42)
    memory = GatedMemory()
    reads = SameHostReads(memory)
    try:
        assert reads.connect(name)
        _wait(lambda: reads.importer(name).num_mapped == 1)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        xfer = reads.make_read(
            name,
            _rows(dst.ctypes.data, [0]),
            _rows(table.tensors[0].data_ptr(), [1]),
            b"",
        )
        reads.transfer(xfer)
        assert memory.copying.wait(10)
        with pytest.raises(VmmError, match="still map"):
            table.unmap_pages([0])
        assert table.is_mapped(0)
        memory.gate.set()
        assert _finish(reads, xfer, []) == "DONE"
        assert (dst == 42).all()
        reads.release(xfer)
        exporter.drop_timeout_s = 5.0
        table.unmap_pages([0])
        assert not table.is_mapped(0) and exporter.held_by_peers() == 0
    finally:
        memory.gate.set()
        reads.close()


def test_channel_that_cannot_open_falls_back_with_the_reason(producer, caplog):
    name, _, table, _ = producer
    table.map_pages([0])
    reads = SameHostReads(HostChunkMemory())
    with caplog.at_level("WARNING"):
        assert not reads.connect(f"absent-{uuid.uuid4()}")
    assert "go through NIXL/UCX" in caplog.text
    assert "Connection refused" in caplog.text
    assert (
        reads.make_read(
            "absent", np.zeros((1, 3), np.uint64), np.zeros((1, 3), np.uint64), b""
        )
        is None
    )
    # Another host (another boot id): refused by both sides.
    with pytest.raises(SameHostUnavailable, match="not this host"):
        ChunkImporter(
            channel_address(name),
            HostChunkMemory(),
            identity=("another-boot-id", "elsewhere"),
        )


def test_a_channel_that_timed_out_is_opened_again_later(caplog):
    """A producer too busy to answer in time: reads go through NIXL, and the
    first read after ``retry_after_s`` opens the channel in the background."""
    name = f"p-{uuid.uuid4()}"
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    busy.bind(channel_address(name))
    busy.listen(1)  # never accepts: the connect succeeds, the hello never comes
    reads = SameHostReads(HostChunkMemory(), connect_timeout_s=0.3, retry_after_s=0.5)
    backend, table = _table()
    table.map_pages([0])
    dst = np.zeros(BLOCK, dtype=np.uint8)
    local = _rows(dst.ctypes.data, [0])
    remote = _rows(table.tensors[0].data_ptr(), [0])
    exporter = None
    try:
        with caplog.at_level("WARNING"):
            assert not reads.connect(name)
        assert "timed out" in caplog.text
        busy.close()
        exporter = ChunkExporter(channel_address(name))
        exporter.attach(table)
        # Not due yet: no retry.
        assert reads.make_read(name, local, remote, b"") is None
        time.sleep(0.2)
        assert reads.importer(name) is None
        time.sleep(0.5)
        assert reads.make_read(name, local, remote, b"") is None  # starts it
        _wait(lambda: reads.importer(name) is not None)
        _wait(lambda: reads.importer(name).num_mapped == 1)
        xfer = reads.make_read(name, local, remote, b"")
        assert xfer is not None
        reads.release(xfer)
        # A peer without a listener is not retried.
        assert not reads.connect(f"absent-{uuid.uuid4()}")
    finally:
        busy.close()
        reads.close()
        if exporter is not None:
            exporter.close()
        table.close()
        backend.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as nobody")
def test_a_process_of_another_user_gets_no_chunks(producer):
    name, _, table, exporter = producer
    table.map_pages([0])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user asks for the chunks
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(channel_address(name))
            s.send(b'{"op": "hello", "boot_id": "", "hostname": ""}')
            data, fds, _, _ = socket.recv_fds(s, 4096, 8)
            os.write(write_end, f"GOT {len(data)} {len(fds)}".encode())
        except ConnectionError:  # reset or broken pipe: the producer closed
            os.write(write_end, b"GOT 0 0")
        except BaseException as e:
            os.write(write_end, repr(e).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as f:
        result = f.read()
    # Closed on it: not even the producer's hello came.
    assert result == "GOT 0 0", result
    assert exporter.num_peers == 0


_PYTHON_PRELUDE = textwrap.dedent("""
    import os, sys, time, signal, uuid
    import numpy as np, torch
    from vllm.v1.kv_vmm import (
        HostVmmBackend, KVPageGeometry, KVPageTable, KVTensorLayout,
    )
    from vllm.v1.kv_vmm.nixl_samehost import *
    BLOCK = 256 * 1024
""")


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _PYTHON_PRELUDE + textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )


def _readline(proc: subprocess.Popen, want: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    lines = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(want):
            return line
    raise AssertionError(f"child never printed {want!r}:\n{''.join(lines)}")


def test_a_reader_that_dies_counts_as_having_dropped(producer):
    name, _, table, exporter = producer
    table.map_pages([0, 1, 2])
    child = _child(
        """
        reads = SameHostReads(HostChunkMemory(), "doomed")
        assert reads.connect(sys.argv[1])
        while reads.importer(sys.argv[1]).num_mapped < 3:
            time.sleep(0.01)
        print("MAPPED", flush=True)
        time.sleep(600)
    """,
        name,
    )
    try:
        _readline(child, "MAPPED")
        assert exporter.held_by_peers() == 3
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        start = time.monotonic()
        table.unmap_pages([0, 1, 2])
        assert time.monotonic() - start < exporter.drop_timeout_s
        assert exporter.num_peers == 0
    finally:
        child.kill()


def test_a_reader_that_dies_before_importing_holds_nothing_up(producer):
    """The reader connects and says hello, but dies before it reads the
    chunks sent to it: they count as held until its socket closes."""
    name, _, table, exporter = producer
    table.map_pages([0, 1])
    child = _child(
        """
        import json, socket
        from vllm.v1.kv_vmm.nixl_samehost import _send, host_identity
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(channel_address(sys.argv[1]))
        boot_id, hostname = host_identity()
        _send(s, {"op": "hello", "boot_id": boot_id, "hostname": hostname,
                  "name": "silent"})
        print("CONNECTED", flush=True)
        time.sleep(600)
    """,
        name,
    )
    try:
        _readline(child, "CONNECTED")
        _wait(lambda: exporter.held_by_peers() == 2)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        table.unmap_pages([0, 1])
        assert exporter.num_peers == 0
    finally:
        child.kill()


@pytest.mark.parametrize("memory_cls", [GatedMemory, AsyncGatedMemory])
def test_a_producer_that_dies_mid_read_fails_the_read(memory_cls):
    """Copies on a thread of the reader (host) or enqueued and polled
    (CUDA): either way the read fails and its chunk stays mapped until the
    copies are over."""
    name = f"p-{uuid.uuid4()}"
    child = _child(
        """
        backend = HostVmmBackend()
        geometry = KVPageGeometry([KVTensorLayout(block_bytes=BLOCK, num_regions=1)],
                                  num_blocks=64, granularity=backend.granularity)
        table = KVPageTable(backend, geometry, max_pages=geometry.num_pages)
        table.map_pages([0])
        table.tensors[0][:BLOCK].fill_(5)
        exporter = ChunkExporter(channel_address(sys.argv[1]))
        exporter.attach(table)
        print("BASE", table.tensors[0].data_ptr(), flush=True)
        time.sleep(600)
    """,
        name,
    )
    memory = memory_cls()
    reads = SameHostReads(memory)
    try:
        base = int(_readline(child, "BASE").split()[1])
        assert reads.connect(name)
        importer = reads.importer(name)
        _wait(lambda: importer.num_mapped == 1)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        xfer = reads.make_read(
            name, _rows(dst.ctypes.data, [0]), _rows(base, [0]), b"req"
        )
        reads.transfer(xfer)
        assert memory.copying.wait(10)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        _wait(lambda: not importer.alive)
        # The channel is gone; the reader still maps the chunk until the copy
        # that pinned it ends (the mapping keeps the memory: no freed reads).
        assert importer.num_mapped == 1
        memory.gate.set()
        notifs: list[tuple[str, bytes]] = []
        assert _finish(reads, xfer, notifs) == "ERR"
        assert notifs == []
        reads.release(xfer)
        _wait(lambda: importer.num_mapped == 0)
        # Later reads from it go through NIXL (whose failure policy applies).
        assert (
            reads.make_read(name, _rows(dst.ctypes.data, [0]), _rows(base, [0]), b"")
            is None
        )
    finally:
        memory.gate.set()
        child.kill()
        reads.close()


def test_a_reader_out_of_file_descriptors_detaches_with_a_clear_error(producer):
    name, _, table, exporter = producer
    table.map_pages(range(8))  # 8 chunks in one message
    child = _child(
        """
        import resource
        # Room for the socket and two more: not for the eight chunks' fds.
        n = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (n + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        reads = SameHostReads(HostChunkMemory(), "starved")
        assert reads.connect(sys.argv[1])
        importer = reads.importer(sys.argv[1])
        while importer.alive:
            time.sleep(0.01)
        print("DETACHED", importer.num_mapped, repr(importer.error), flush=True)
    """,
        name,
    )
    try:
        line = _readline(child, "DETACHED")
        assert "DETACHED 0 SameHostFdLimitError" in line, line
        assert "RLIMIT_NOFILE" in line
        _wait(lambda: exporter.num_peers == 0)
        table.unmap_pages(range(8))
    finally:
        child.kill()


@requires_nixl
def test_segmented_agent_reads_same_host_chunks_with_nixl_notifications(monkeypatch):
    """Two real NIXL agents (UCX over the loopback) with VMM-backed tables:
    the decode agent's READs of shared chunks are local copies whose
    completion notifies the prefill agent through NIXL; blocks outside
    shared chunks still go through NIXL/UCX."""
    ucx_over_loopback(monkeypatch)
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm.v1.kv_vmm.nixl_connector import NixlVmmWorker

    workers, sides = [], []
    for role in ("prefill", "decode"):
        backend, table = _table()
        table.map_pages([0, 1])
        agent = nixl_agent(
            f"{role}-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"])
        )
        worker = NixlVmmWorker(agent)
        worker.page_table = table
        base = table.tensors[0].data_ptr()
        xfer = worker.register(["DRAM"], False, [(base, base + 4 * (2 << 20))], 0)
        workers.append(worker)
        sides.append((backend, table, agent, xfer))
    (_, p_table, p_agent, p_xfer), (_, d_table, d_agent, d_xfer) = sides
    try:
        # The connector names remote agents as add_remote_agent returns them.
        p_name = d_agent.add_remote_agent(p_agent.get_agent_metadata())
        p_agent.add_remote_agent(d_agent.get_agent_metadata())
        workers[1].add_peer(p_name, "tcp://127.0.0.1:1", b"")
        assert workers[1].same_host.importer(p_name).alive
        for b in range(16):
            _fill(p_table, b, 3 * b + 1)
        p_base, d_base = p_table.tensors[0].data_ptr(), d_table.tensors[0].data_ptr()
        remote = d_xfer.prep_xfer_dlist(p_name, _rows(p_base, range(NUM_BLOCKS)))
        local = d_xfer.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _rows(d_base, range(NUM_BLOCKS))
        )
        _wait(lambda: workers[1].same_host.importer(p_agent.name).num_mapped == 2)

        before = same_host_stats()
        handle, state = _run_read(
            d_xfer, local, [0, 1, 2, 3], remote, [12, 13, 14, 15], notif_msg=b"done-1"
        )
        assert type(handle).__name__ == "SameHostXfer"
        assert state == "DONE"
        assert d_xfer.get_xfer_telemetry(handle).totalBytes == 4 * BLOCK
        d_xfer.release_xfer_handle(handle)
        assert same_host_stats()["reads"] == before["reads"] + 1
        flat = d_table.tensors[0].view(torch.uint8)
        for i, b in enumerate(range(12, 16)):
            assert (flat[i * BLOCK : (i + 1) * BLOCK] == 3 * b + 1).all()
        _wait_for_notif(p_agent, d_agent.name, b"done-1")

        # The decode's own unmap waits for nothing and shares its chunks too.
        assert workers[0].same_host.connect(d_agent.name)
        _wait(lambda: workers[0].same_host.importer(d_agent.name).num_mapped == 2)
        d_table.unmap_pages([1])
        _wait(lambda: workers[0].same_host.importer(d_agent.name).num_mapped == 1)
    finally:
        for worker, (backend, table, _, _) in zip(reversed(workers), reversed(sides)):
            worker.close()
            table.close()
            backend.close()


@requires_nixl
def test_stock_reader_copies_a_vmm_peers_chunks_and_prepares_stock_peers(
    monkeypatch, caplog
):
    """A reader with stock KV tensors (a plain registered buffer) and two real
    NIXL peers: the VMM-backed one opens a channel, so its list stays
    unprepared and READs of it are local copies whose completion notifies it
    through NIXL; the stock one has no channel (said at debug level only)
    and its list and READs are NIXL's prepared ones."""
    ucx_over_loopback(monkeypatch)
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm.v1.kv_vmm.nixl_connector import NixlVmmWorker
    from vllm.v1.kv_vmm.nixl_segments import StockKVXferAgent

    def agent(role):
        return nixl_agent(f"{role}-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))

    def stock_buffer(agent, value):
        buf = torch.full((NUM_BLOCKS * BLOCK,), value, dtype=torch.uint8)
        agent.register_memory(
            agent.get_reg_descs([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
        )
        return buf

    backend, p_table = _table()
    p_table.map_pages([0, 1])
    p_agent = agent("prefill")
    producer = NixlVmmWorker(p_agent)
    producer.page_table = p_table
    p_base = p_table.tensors[0].data_ptr()
    producer.register(["DRAM"], False, [(p_base, p_base + 4 * (2 << 20))], 0)
    s_agent = agent("stock-prefill")
    s_buf = stock_buffer(s_agent, 9)
    d_agent = agent("decode")
    d_buf = stock_buffer(d_agent, 0)
    reader = NixlVmmWorker(d_agent)
    d_xfer = reader.read_same_host(["DRAM"], False, 0)
    try:
        assert isinstance(d_xfer, StockKVXferAgent)
        p_name = d_xfer.add_remote_agent(p_agent.get_agent_metadata())
        s_name = d_xfer.add_remote_agent(s_agent.get_agent_metadata())
        for peer in (p_agent, s_agent):
            peer.add_remote_agent(d_agent.get_agent_metadata())
        for b in range(16):
            _fill(p_table, b, 3 * b + 1)
        d_base = d_buf.data_ptr()
        local = d_xfer.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            d_xfer.get_xfer_descs(_rows(d_base, range(NUM_BLOCKS)), "DRAM"),
        )
        assert type(local).__name__ != "_PreparedDescs"  # NIXL's own
        # The VMM peer's blocks beyond its two mapped pages are not registered:
        # NIXL could not prepare this list.
        remote = d_xfer.prep_xfer_dlist(
            p_name, d_xfer.get_xfer_descs(_rows(p_base, range(NUM_BLOCKS)), "DRAM")
        )
        assert type(remote).__name__ == "_PreparedDescs"
        with caplog.at_level("DEBUG"):
            s_rows = _rows(s_buf.data_ptr(), range(NUM_BLOCKS))
            stock_remote = d_xfer.prep_xfer_dlist(
                s_name, d_xfer.get_xfer_descs(s_rows, "DRAM")
            )
        assert type(stock_remote).__name__ != "_PreparedDescs"
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        _wait(lambda: reader.same_host.importer(p_name).num_mapped == 2)

        before = same_host_stats()
        handle, state = _run_read(
            d_xfer, local, [0, 1, 2, 3], remote, [12, 13, 14, 15], notif_msg=b"done-1"
        )
        assert type(handle).__name__ == "SameHostXfer"
        assert state == "DONE"
        d_xfer.release_xfer_handle(handle)
        assert same_host_stats()["reads"] == before["reads"] + 1
        for i, b in enumerate(range(12, 16)):
            assert (d_buf[i * BLOCK : (i + 1) * BLOCK] == 3 * b + 1).all()
        _wait_for_notif(p_agent, d_agent.name, b"done-1")

        # The stock peer: NIXL's prepared transfer over UCX.
        handle, state = _run_read(d_xfer, local, [4, 5], stock_remote, [0, 1])
        assert type(handle).__name__ != "SameHostXfer"
        assert state == "DONE"
        d_xfer.release_xfer_handle(handle)
        assert (d_buf[4 * BLOCK : 6 * BLOCK] == 9).all()
        assert same_host_stats()["reads"] == before["reads"] + 1
    finally:
        reader.close()
        producer.close()
        p_table.close()
        backend.close()


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
    from vllm.v1.kv_vmm.nixl_samehost import chunk_memory_for

    backend = CudaVmmBackend(torch.device("cuda", 0))
    if not backend.fd_exportable:
        pytest.skip("the device cannot export allocations as POSIX fds")
    _, table = _table(backend)
    name = f"p-{uuid.uuid4()}"
    exporter = ChunkExporter(channel_address(name))
    exporter.attach(table)
    memory = chunk_memory_for(backend, copy_kernel=copy == "kernel")
    # On a GPU host the kernel must be there when asked for.
    assert (memory._copier is not None) == (copy == "kernel")
    reads = SameHostReads(memory)
    try:
        table.map_pages([0, 1])
        for block in range(16):
            _fill(table, block, block + 1)
        torch.accelerator.synchronize()
        assert reads.connect(name)
        _wait(lambda: reads.importer(name).num_mapped == 2)
        dst = torch.zeros(16 * BLOCK, dtype=torch.uint8, device="cuda")
        local = [0, 1, 2, 3, 4, 5, 6, 7]
        remote = [9, 3, 12, 0, 15, 4, 5, 6]  # two pages; 4, 5, 6 adjacent
        xfer = reads.make_read(
            name,
            _rows(dst.data_ptr(), local),
            _rows(table.tensors[0].data_ptr(), remote),
            b"",
        )
        assert len(xfer.runs) == 6
        reads.transfer(xfer)
        assert _finish(reads, xfer, []) == "DONE"
        got = dst.view(16, BLOCK).cpu()
        for i, block in enumerate(remote):
            assert bool((got[i] == block + 1).all()), (i, block)
        assert bool((got[len(local) :] == 0).all())
        reads.release(xfer)
        table.unmap_pages([0, 1])
        assert reads.importer(name).num_mapped == 0
    finally:
        reads.close()
        exporter.close()
        table.close()
        backend.close()
