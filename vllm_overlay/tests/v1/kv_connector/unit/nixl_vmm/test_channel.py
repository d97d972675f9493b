# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-host channel beside other processes of the same user: only a
reader that proves it holds the producer's handshake secret gets file
descriptors; forged, garbled, truncated, oversized and stalled clients get
nothing, are counted, and leave the producer serving real readers. Real
sockets, real host VMM memory, a real exporter; the clients are raw sockets
speaking (or not) the protocol."""

import os
import socket
import time

import msgspec
import numpy as np
import pytest

from tests.v1.kv_connector.unit.nixl_vmm.channel_utils import (  # noqa: F401 (fixture)
    drain,
    hello,
    producer_fixture,
    raw,
    read_shared_block,
    refused,
)
from tests.v1.kv_connector.unit.nixl_vmm.utils import fill, wait_until
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel, exporter
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
    Challenge,
    ChannelProtocolError,
    Proof,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    FALLBACK_REASONS,
    Fallback,
    same_host_stats,
)


@pytest.fixture(autouse=True)
def _short_timeouts(monkeypatch):
    # A stalled client is given up on after this long.
    monkeypatch.setattr(channel, "IO_TIMEOUT_S", 0.5)


def _serves_a_real_reader(producer) -> None:
    """The producer shares its chunks with a reader that proves itself, and
    the reader reads a block out of them."""
    assert (read_shared_block(producer, 2) == 3).all()


@pytest.fixture
def serving(producer):
    producer.table.map_pages([0, 1])
    fill(producer.table, 2, 3)
    return producer


def test_a_hello_without_a_proof_gets_no_file_descriptors(serving):
    before = same_host_stats()
    s = raw(serving.name)
    channel.send(s, hello())
    challenge, fds = channel.recv(s, channel.CHALLENGE)
    assert isinstance(challenge, Challenge) and fds == []
    # No proof: the producer gives up after its timeout, nothing more comes.
    messages, nfds = drain(s)
    assert messages == [] and nfds == 0
    wait_until(lambda: refused("timeout", before))
    assert serving.exporter.num_peers == 0
    _serves_a_real_reader(serving)


@pytest.mark.parametrize("key", ["wrong", "replayed"])
def test_a_wrong_proof_gets_no_file_descriptors_and_one_try(serving, key):
    """A forged proof (another key, or the producer's own proof sent back) is
    refused once: the socket closes and the failure is counted."""
    before = same_host_stats()
    s = raw(serving.name)
    greeting = hello()
    channel.send(s, greeting)
    challenge, _ = channel.recv(s, channel.CHALLENGE)
    if key == "wrong":
        forged = channel.proof(
            os.urandom(32),
            "reader",
            (challenge.nonce, greeting.nonce),
            serving.name,
            greeting.name,
        )
    else:
        forged = challenge.proof
    channel.send(s, Proof(proof=forged))
    messages, nfds = drain(s)
    assert messages == [] and nfds == 0
    wait_until(lambda: refused("auth", before))
    assert serving.exporter.num_peers == 0
    _serves_a_real_reader(serving)


def _fuzz_cases(rng: np.random.Generator) -> list[tuple[str, bytes, list[int]]]:
    """(what, message, fds) a client sends first."""
    encoded = msgspec.msgpack.encode(hello())
    cases = [
        ("empty-ish", b"\x00", []),
        ("truncated hello", encoded[: len(encoded) // 2], []),
        ("oversized", b"\x91" + b"\x00" * (channel.MAX_MESSAGE_BYTES + 100), []),
        ("not a map", msgspec.msgpack.encode([1, 2, 3]), []),
        ("unknown op", msgspec.msgpack.encode({"op": "gimme"}), []),
        ("a proof first", msgspec.msgpack.encode(Proof(proof=b"x" * 32)), []),
        (
            "wrong types",
            msgspec.msgpack.encode(
                {"op": "hello", "name": 7, "boot_id": [], "hostname": 0, "nonce": 1}
            ),
            [],
        ),
        (
            "short nonce",
            msgspec.msgpack.encode(
                {
                    "op": "hello",
                    "name": "x",
                    "boot_id": "",
                    "hostname": "",
                    "nonce": b"1",
                }
            ),
            [],
        ),
        (
            "extra field",
            msgspec.msgpack.encode(
                {**msgspec.structs.asdict(hello()), "op": "hello", "fds": 9}
            ),
            [],
        ),
        ("hello with fds", encoded, [os.open(os.devnull, os.O_RDONLY)]),
        ("json", b'{"op": "hello"}', []),
    ]
    for i in range(12):
        n = int(rng.integers(1, 400))
        cases.append((f"random {i}", rng.bytes(n), []))
    return cases


def test_garbage_before_the_proof_is_a_clear_error_for_that_client(
    serving, monkeypatch
):
    """Random, truncated, oversized, mistyped messages and stray file
    descriptors as a client's first message: each client is refused on its
    own (counted as a protocol error), none gets anything, the producer stays
    up and serves a real reader afterwards."""
    monkeypatch.setattr(channel, "MAX_MESSAGE_BYTES", 4096)
    rng = np.random.default_rng(7)
    before = same_host_stats()
    cases = _fuzz_cases(rng)
    for what, data, fds in cases:
        s = raw(serving.name)
        try:
            if fds:
                socket.send_fds(s, [data], fds)
            else:
                s.sendall(data)
        finally:
            channel.close_fds(fds)
        assert drain(s) == ([], 0), what
    wait_until(
        lambda: same_host_stats().get("refused_protocol", 0)
        >= before.get("refused_protocol", 0) + len(cases)
    )
    assert serving.exporter.num_peers == 0
    _serves_a_real_reader(serving)


def test_stalled_clients_cannot_hold_the_channel(serving, monkeypatch):
    """Connections that never say hello take the handshake slots only until
    their timeout; one more is closed at once; then a real reader gets in."""
    monkeypatch.setattr(exporter, "MAX_PENDING", 2)
    monkeypatch.setattr(channel, "IO_TIMEOUT_S", 2.0)
    before = same_host_stats()
    stalled = [raw(serving.name) for _ in range(2)]
    extra = raw(serving.name)
    assert drain(extra) == ([], 0)
    wait_until(lambda: refused("busy", before))
    for s in stalled:
        assert drain(s) == ([], 0)  # closed after the timeout
    wait_until(lambda: refused("timeout", before))
    _serves_a_real_reader(serving)


def test_protocol_errors_name_the_problem(monkeypatch):
    monkeypatch.setattr(channel, "MAX_MESSAGE_BYTES", 4096)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stray = os.open(os.devnull, os.O_RDONLY)
    try:
        a.sendall(msgspec.msgpack.encode({"op": "add", "chunks": [[1, 2, 0, 0]]}))
        with pytest.raises(ChannelProtocolError, match="invalid message"):
            channel.recv(b, channel.FROM_PRODUCER, channel.MAX_FDS_PER_MESSAGE)
        # An Add whose fds did not come.
        a.sendall(msgspec.msgpack.encode({"op": "add", "chunks": [[1, 2, 4096, 0]]}))
        with pytest.raises(ChannelProtocolError, match="has 1 .got 0"):
            channel.recv(b, channel.FROM_PRODUCER, channel.MAX_FDS_PER_MESSAGE)
        # File descriptors where none belong: refused, and none kept.
        open_fds = len(os.listdir("/proc/self/fd"))
        socket.send_fds(a, [msgspec.msgpack.encode(channel.Sync(seq=1))], [stray])
        with pytest.raises(ChannelProtocolError, match="has 0"):
            channel.recv(b, channel.FROM_READER)
        assert len(os.listdir("/proc/self/fd")) == open_fds
        a.sendall(b"\x91" + b"\x00" * 5000)
        with pytest.raises(ChannelProtocolError, match="longer than 4096 bytes"):
            channel.recv(b, channel.FROM_READER)
        a.sendall(b"")
        assert channel.recv(b, channel.FROM_READER) == (None, [])
    finally:
        os.close(stray)
        a.close()
        b.close()


def test_a_refusal_is_logged_once_per_peer_and_reason(caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
        SameHostStats,
    )

    stats = SameHostStats()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            stats.refused("pid 1", Fallback.AUTH, "no proof")
        stats.refused("pid 1", Fallback.PROTOCOL, "garbage")
        stats.refused("pid 2", Fallback.AUTH, "no proof")
        stats.fallback("peer", Fallback.NOT_SHARED, "outside")
        stats.fallback("peer", Fallback.NOT_SHARED, "outside")
    assert caplog.text.count("refused (auth)") == 2
    assert caplog.text.count("refused (protocol)") == 1
    assert caplog.text.count("(not_shared)") == 1
    counts = stats.snapshot()
    assert counts["refused"] == 5 and counts["refused_auth"] == 4
    assert counts["fallbacks"] == 2 and counts["fallbacks_not_shared"] == 2
    # What the connector's stats add up: counts per reason, taken once.
    taken = stats.take_fallback_counts()
    assert taken[FALLBACK_REASONS.index(Fallback.NOT_SHARED)] == 2
    assert sum(taken) == 2 and not any(stats.take_fallback_counts())


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as nobody")
def test_a_process_of_another_user_gets_no_chunks(serving):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user asks for the chunks
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(10)
            s.connect(channel.channel_address(serving.name))
            s.send(msgspec.msgpack.encode(hello("nobody")))
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
    # Closed on it: not even the producer's challenge came.
    assert result == "GOT 0 0", result
    assert serving.exporter.num_peers == 0
    time.sleep(0.1)
