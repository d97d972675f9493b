# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-host readers that die or run out of file descriptors: real processes
(killed with SIGKILL), real host VMM memory and real sockets (a producer
that dies mid-read: test_same_host_reads.py)."""

import time

import pytest

from tests.v1.kv_connector.unit.nixl_vmm.channel_utils import (  # noqa: F401 (fixture)
    producer_fixture,
)
from tests.v1.kv_connector.unit.nixl_vmm.process_utils import (
    kill,
    readline,
    start_child,
)
from tests.v1.kv_connector.unit.nixl_vmm.utils import wait_until

# Real processes started and killed: about 10 s a case.
pytestmark = pytest.mark.slow_test

_READER = """
    importer = ChunkImporter(NAME, SECRET, HostVmmBackend(), "doomed")
"""


def test_a_reader_that_dies_counts_as_having_dropped(producer):
    table, exporter = producer.table, producer.exporter
    table.map_pages([0, 1, 2])
    child = start_child(
        _READER
        + """
    while importer.num_mapped < 3:
        time.sleep(0.01)
    print("MAPPED", flush=True)
    time.sleep(600)
    """,
        producer,
    )
    try:
        readline(child, "MAPPED")
        assert exporter.held_by_peers() == 3
        kill(child)
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
    child = start_child(
        """
    import socket
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
    from tests.v1.kv_connector.unit.nixl_vmm.channel_utils import prove
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(channel.channel_address(NAME))
    prove(s, NAME, SECRET, "silent")
    print("CONNECTED", flush=True)
    time.sleep(600)
    """,
        producer,
    )
    try:
        readline(child, "CONNECTED")
        wait_until(lambda: exporter.held_by_peers() == 2)
        kill(child)
        table.unmap_pages([0, 1])
        assert exporter.num_peers == 0
    finally:
        child.kill()


def test_a_reader_out_of_file_descriptors_detaches_with_a_clear_error(producer):
    table, exporter = producer.table, producer.exporter
    table.map_pages(range(8))  # 8 chunks in one message
    child = start_child(
        """
    import resource
    backend = HostVmmBackend()
    # Room for the socket and two more: not for the eight chunks' fds.
    n = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (n + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    importer = ChunkImporter(NAME, SECRET, backend, "starved")
    while importer.alive:
        time.sleep(0.01)
    print("DETACHED", importer.num_mapped, repr(importer.error), flush=True)
    """,
        producer,
    )
    try:
        line = readline(child, "DETACHED")
        assert "DETACHED 0 SameHostFdLimitError" in line, line
        assert "RLIMIT_NOFILE" in line
        wait_until(lambda: exporter.num_peers == 0)
        table.unmap_pages(range(8))
    finally:
        child.kill()
