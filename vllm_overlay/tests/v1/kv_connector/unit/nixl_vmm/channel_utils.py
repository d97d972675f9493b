# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the same-host channel's tests: a producer sharing a host VMM
page table through a real exporter, and raw clients of its channel (forged
ones, and one that proves itself and reads a block out of the chunks it is
sent)."""

import mmap
import os
import socket
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tests.v1.kv_connector.unit.nixl_vmm.utils import BLOCK, make_table
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
    ChunkExporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    same_host_stats,
)


class Producer:
    """A producer's page table shared by a real exporter on a fresh name."""

    def __init__(self, drop_timeout_s=5.0, backend=None, **exporter_kwargs):
        self.name = f"p-{uuid.uuid4()}"
        self.secret = channel.new_secret()
        self.backend, self.table = make_table(backend)
        self.exporter = ChunkExporter(
            self.name, self.secret, drop_timeout_s=drop_timeout_s, **exporter_kwargs
        )
        self.exporter.attach(self.table)

    @property
    def base(self) -> int:
        return self.table.tensors[0].data_ptr()

    def close(self):
        self.exporter.close()
        self.table.close()
        self.backend.close()


@pytest.fixture(name="producer")
def producer_fixture() -> Iterator[Producer]:
    p = Producer()
    yield p
    p.close()


def raw(name: str) -> socket.socket:
    """A client socket connected to ``name``'s channel."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(channel.channel_address(name))
    return s


def hello(name: str = "forger") -> channel.Hello:
    boot_id, hostname = channel.host_identity()
    return channel.Hello(
        name=name, boot_id=boot_id, hostname=hostname, nonce=os.urandom(32)
    )


def drain(s: socket.socket) -> tuple[list[bytes], int]:
    """Everything the producer sends until it closes: the messages, and how
    many file descriptors came with them (closed here)."""
    messages, nfds = [], 0
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(s, 1 << 20, 64)
        except ConnectionResetError:
            break
        channel.close_fds(fds)
        nfds += len(fds)
        if not data:
            break
        messages.append(data)
    s.close()
    return messages, nfds


def refused(reason: str, before: dict[str, int]) -> bool:
    """Whether the producers refused a client for ``reason`` since
    ``before`` (a ``same_host_stats()``)."""
    key = f"refused_{reason}"
    return same_host_stats().get(key, 0) > before.get(key, 0)


def prove(sock, producer_name: str, secret: bytes, name: str):
    """The reader's side of the handshake on a raw socket: ``Hello``, the
    producer's ``Challenge``, our ``Proof``."""
    boot_id, hostname = channel.host_identity()
    nonce = channel.new_nonce()
    channel.send(
        sock, channel.Hello(name=name, boot_id=boot_id, hostname=hostname, nonce=nonce)
    )
    challenge, _ = channel.recv(sock, channel.CHALLENGE)
    mine = channel.proof(
        secret, "reader", (challenge.nonce, nonce), producer_name, name
    )
    channel.send(sock, channel.Proof(proof=mine))


def read_shared_block(producer: Producer, block: int, name="raw-reader"):
    """A reader on a raw socket: proves itself, maps (``mmap``) the chunk
    the producer shares that holds ``block`` and returns the block's bytes."""
    addr = producer.base + block * BLOCK
    s = raw(producer.name)
    try:
        prove(s, producer.name, producer.secret, name)
        welcome, _ = channel.recv(s, channel.WELCOME)
        assert welcome is not None
        while True:
            msg, fds = channel.recv(
                s, channel.FROM_PRODUCER, channel.MAX_FDS_PER_MESSAGE
            )
            try:
                assert isinstance(msg, channel.Add), msg
                for (_, va, nbytes, offset), fd in zip(msg.chunks, fds):
                    if va <= addr and addr + BLOCK <= va + nbytes:
                        with mmap.mmap(
                            fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset
                        ) as m:
                            start = addr - va
                            return np.frombuffer(m[start : start + BLOCK], np.uint8)
            finally:
                channel.close_fds(fds)
    finally:
        s.close()
