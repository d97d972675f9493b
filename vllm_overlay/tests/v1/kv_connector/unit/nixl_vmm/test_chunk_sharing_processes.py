# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-host peers that die or run out of file descriptors: real processes
(killed with SIGKILL), real host VMM memory and real sockets."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests.v1.kv_connector.unit.nixl_vmm.same_host_utils import (  # noqa: F401 (fixtures)
    AsyncGatedCopier,
    GatedCopier,
    Notifs,
    Reader,
    finish,
    make_read,
    producer_fixture,
)
from tests.v1.kv_connector.unit.nixl_vmm.utils import BLOCK, rows, wait_until
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import new_secret

# Real processes started and killed: about 10 s a case.
pytestmark = pytest.mark.slow_test

_PYTHON_PRELUDE = textwrap.dedent("""
    import os, sys, time, signal, uuid
    import numpy as np, torch
    from vllm.v1.kv_vmm import (
        HostVmmBackend, KVPageGeometry, KVPageTable, KVTensorLayout,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
        HostCopier,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
        ChunkExporter,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.same_host import (
        SameHostReads,
    )
    BLOCK = 256 * 1024
    NAME, SECRET = sys.argv[1], bytes.fromhex(sys.argv[2])
""")


def _child(code: str, peer) -> subprocess.Popen:
    """A Python child running ``code`` with NAME and SECRET of ``peer``."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PYTHON_PRELUDE + textwrap.dedent(code),
            peer.name,
            peer.secret.hex(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )


def _kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(30)


def _readline(proc: subprocess.Popen, want: str, timeout: float = 300) -> str:
    """The first line of the child that starts with ``want`` (importing vLLM
    takes a while on a busy host)."""
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


_READER = """
    reads = SameHostReads(HostVmmBackend(), HostCopier(), "doomed")
    assert reads.offer(NAME, SECRET)
"""


def test_a_reader_that_dies_counts_as_having_dropped(producer):
    table, exporter = producer.table, producer.exporter
    table.map_pages([0, 1, 2])
    child = _child(
        _READER
        + """
    while reads.importer(NAME).num_mapped < 3:
        time.sleep(0.01)
    print("MAPPED", flush=True)
    time.sleep(600)
    """,
        producer,
    )
    try:
        _readline(child, "MAPPED")
        assert exporter.held_by_peers() == 3
        _kill(child)
        start = time.monotonic()
        table.unmap_pages([0, 1, 2])
        assert time.monotonic() - start < exporter.drop_timeout_s
        assert exporter.num_peers == 0
    finally:
        child.kill()


def test_a_reader_that_dies_before_importing_holds_nothing_up(producer):
    """The reader proves itself, but dies before it reads the chunks sent to
    it: they count as held until its socket closes."""
    table, exporter = producer.table, producer.exporter
    table.map_pages([0, 1])
    child = _child(
        """
    import socket
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
    from tests.v1.kv_connector.unit.nixl_vmm.same_host_utils import prove
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(channel.channel_address(NAME))
    prove(s, NAME, SECRET, "silent")
    print("CONNECTED", flush=True)
    time.sleep(600)
    """,
        producer,
    )
    try:
        _readline(child, "CONNECTED")
        wait_until(lambda: exporter.held_by_peers() == 2)
        _kill(child)
        table.unmap_pages([0, 1])
        assert exporter.num_peers == 0
    finally:
        child.kill()


@pytest.mark.parametrize("copier_cls", [GatedCopier, AsyncGatedCopier])
def test_a_producer_that_dies_mid_read_fails_the_read(copier_cls):
    """Copies on a thread of the reader (host) or enqueued and polled
    (device): either way the read fails and its chunk stays mapped until the
    copies are over."""
    peer = SimpleNamespace(name=f"p-{os.getpid()}-{time.monotonic_ns()}")
    peer.secret = new_secret()
    name, secret = peer.name, peer.secret
    child = _child(
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
        base = int(_readline(child, "BASE").split()[1])
        assert reads.offer(name, secret)
        importer = reads.importer(name)
        wait_until(lambda: importer.num_mapped == 1)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        notifs = Notifs()
        local = rows(dst.ctypes.data, [0])
        xfer = make_read(reads, name, local, rows(base, [0]), b"req", notifs)
        xfer.post()
        assert copier.copying.wait(10)
        _kill(child)
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


def test_a_reader_out_of_file_descriptors_detaches_with_a_clear_error(producer):
    table, exporter = producer.table, producer.exporter
    table.map_pages(range(8))  # 8 chunks in one message
    child = _child(
        """
    import resource
    reads = SameHostReads(HostVmmBackend(), HostCopier(), "starved")
    # Room for the socket and two more: not for the eight chunks' fds.
    n = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (n + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    assert reads.offer(NAME, SECRET)
    importer = reads.importer(NAME)
    while importer.alive:
        time.sleep(0.01)
    print("DETACHED", importer.num_mapped, repr(importer.error), flush=True)
    """,
        producer,
    )
    try:
        line = _readline(child, "DETACHED")
        assert "DETACHED 0 SameHostFdLimitError" in line, line
        assert "RLIMIT_NOFILE" in line
        wait_until(lambda: exporter.num_peers == 0)
        table.unmap_pages(range(8))
    finally:
        child.kill()
