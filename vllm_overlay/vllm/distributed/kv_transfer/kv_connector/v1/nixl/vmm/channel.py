# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-host channel's wire protocol: addresses, messages, proofs.

A producer (the engine whose KV memory is read) listens on an abstract Unix
socket (``SOCK_SEQPACKET``) named after its NIXL agent (:func:`channel_address`).
Any process of the network namespace can connect there, so a reader must
prove that it is the NIXL peer the producer's handshake was made with:

1. reader -> producer ``Hello``: its agent name, ``(boot id, hostname)`` and
   a fresh nonce;
2. producer -> reader ``Challenge``: its ``(boot id, hostname)``, the kind of
   memory it shares, a fresh nonce and its own proof;
3. reader -> producer ``Proof``; the producer answers ``Welcome`` or closes.

A proof is an HMAC-SHA256, keyed with the producer's per-engine secret, of
the role, both nonces and both agent names (:func:`proof`). The producer
publishes the secret only inside its NIXL handshake metadata, so a process
that can compute a proof can fetch that metadata, and with it read the
registered KV memory through NIXL/UCX already. Both ends also require a
process of their own user (``SO_PEERCRED``) and the same kernel (boot id
and hostname).

Then the producer sends ``Add`` (chunks, their file descriptors as
``SCM_RIGHTS``), ``Drop`` and ``Synced``; the reader ``Dropped`` and ``Sync``.
Every message is msgpack, decoded against the one schema its place in the
protocol allows: anything else (garbage, a wrong type, a truncated or
oversized message, file descriptors where none belong) is a
:class:`ChannelProtocolError` for that peer. Every wait has an end: a
receive during the handshake and every send time out after
:data:`IO_TIMEOUT_S`.
"""

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

import msgspec

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import Fallback
from vllm.v1.kv_vmm.backend import VmmError

#: Abstract Unix socket name prefix of a producer's channel.
CHANNEL_PREFIX = "vllm-kv-vmm-same-host/"
#: File descriptors per message (the kernel's limit is 253).
MAX_FDS_PER_MESSAGE = 64
#: Largest message, and most chunk ids in one (a ``Drop`` of more is split):
#: well under the socket's send buffer (about 200 KiB).
MAX_MESSAGE_BYTES = 128 << 10
MAX_IDS_PER_MESSAGE = 8192
#: How long opening a channel may take (connect and handshake).
CONNECT_TIMEOUT_S = 10.0
#: How long a send, or an answer during the handshake, may take.
IO_TIMEOUT_S = 5.0
#: How long a read waits for the producer's answer to a sync.
SYNC_TIMEOUT_S = 2.0
#: Bytes of a producer's secret and of a nonce.
SECRET_BYTES = 32
NONCE_BYTES = 32

_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
_Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
_Size = Annotated[int, msgspec.Meta(gt=0, le=1 << 62)]
_Ids = Annotated[list[_Count], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]


class _Message(
    msgspec.Struct,
    tag_field="op",  # type: ignore[call-arg]
    forbid_unknown_fields=True,  # type: ignore[call-arg]
):  # type: ignore[call-arg]
    def num_fds(self) -> int:
        """File descriptors that come with the message."""
        return 0


class Hello(_Message, tag="hello"):  # type: ignore[call-arg]
    name: _Name
    boot_id: _Name
    hostname: _Name
    nonce: _Nonce


class Challenge(_Message, tag="challenge"):  # type: ignore[call-arg]
    boot_id: _Name
    hostname: _Name
    kind: _Name
    nonce: _Nonce
    proof: _Digest


class Proof(_Message, tag="proof"):  # type: ignore[call-arg]
    proof: _Digest


class Welcome(_Message, tag="welcome"):  # type: ignore[call-arg]
    pass


class Add(_Message, tag="add"):  # type: ignore[call-arg]
    # (chunk id, producer address, bytes, offset in the shared fd), one per fd.
    chunks: Annotated[
        list[tuple[_Count, _Count, _Size, _Count]],
        msgspec.Meta(max_length=MAX_FDS_PER_MESSAGE),
    ]

    def num_fds(self) -> int:
        return len(self.chunks)


class Drop(_Message, tag="drop"):  # type: ignore[call-arg]
    ids: _Ids


class Dropped(_Message, tag="dropped"):  # type: ignore[call-arg]
    ids: _Ids


class Sync(_Message, tag="sync"):  # type: ignore[call-arg]
    seq: _Count


class Synced(_Message, tag="synced"):  # type: ignore[call-arg]
    seq: _Count


M = TypeVar("M")

#: What each end may receive where.
HELLO = msgspec.msgpack.Decoder(Hello)
CHALLENGE = msgspec.msgpack.Decoder(Challenge)
PROOF = msgspec.msgpack.Decoder(Proof)
WELCOME = msgspec.msgpack.Decoder(Welcome)
FROM_READER = msgspec.msgpack.Decoder(Dropped | Sync)
FROM_PRODUCER = msgspec.msgpack.Decoder(Add | Drop | Synced)
_ENCODER = msgspec.msgpack.Encoder()


class SameHostUnavailable(VmmError):
    """The same-host channel to a peer cannot be used; ``reason`` says why
    (the :class:`Fallback` counted)."""

    def __init__(self, reason: Fallback, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ChannelProtocolError(SameHostUnavailable):
    """The other end sent what the protocol does not allow there."""

    def __init__(self, message: str) -> None:
        super().__init__(Fallback.PROTOCOL, message)


class SameHostFdLimitError(SameHostUnavailable):
    """The process ran out of file descriptors while receiving chunks."""

    def __init__(self, message: str) -> None:
        super().__init__(Fallback.FD_LIMIT, message)


def channel_address(agent_name: str | bytes) -> str:
    """The abstract Unix socket a producer's agent listens on (NIXL names
    remote agents in bytes, its own in str: both give the same address)."""
    return "\0" + CHANNEL_PREFIX + os.fsdecode(agent_name)


def host_identity() -> tuple[str, str]:
    """(boot id, hostname): equal only for processes of one running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return boot_id, socket.gethostname()


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", cred)
    return pid, uid


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(
    secret: bytes,
    role: str,
    nonces: tuple[bytes, bytes],
    producer: str,
    reader: str,
) -> bytes:
    """HMAC-SHA256 under ``secret`` of the role ("producer" or "reader"),
    both nonces (the one it answers first) and both agent names, each part
    length-prefixed."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (role.encode(), *nonces, producer.encode(), reader.encode()):
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def proof_matches(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, got)


def send(sock: socket.socket, msg: _Message, fds: Sequence[int] = ()) -> None:
    """One message (with ``fds`` as ``SCM_RIGHTS``)."""
    data = _ENCODER.encode(msg)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(
    sock: socket.socket, decoder: "msgspec.msgpack.Decoder[Any]", max_fds: int = 0
) -> tuple[Any, list[int]]:
    """One message ``decoder`` accepts and the file descriptors it brought;
    ``(None, [])`` at the end of the channel. Raises
    :class:`ChannelProtocolError` for anything else (the fds closed), and
    :class:`SameHostFdLimitError` if the kernel could not pass them all."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, max_fds)
    try:
        if not data:
            close_fds(fds)
            return None, []
        if flags & socket.MSG_TRUNC:
            raise ChannelProtocolError(
                f"a message longer than {MAX_MESSAGE_BYTES} bytes"
            )
        try:
            msg = decoder.decode(data)
        except msgspec.MsgspecError as e:
            raise ChannelProtocolError(f"an invalid message ({e})") from e
        expected = msg.num_fds()
        if flags & socket.MSG_CTRUNC and expected:
            raise SameHostFdLimitError(
                f"received {len(fds)} of {expected} file descriptors of a KV "
                "chunk message (the kernel drops them when the process is at "
                f"its open-file limit, RLIMIT_NOFILE={nofile_limit()}); raise "
                "the limit (ulimit -n)"
            )
        if flags & socket.MSG_CTRUNC or len(fds) != expected:
            raise ChannelProtocolError(
                f"file descriptors with a message that has {expected} (got "
                f"{len(fds)}{', more dropped' if flags & socket.MSG_CTRUNC else ''})"
            )
    except BaseException:
        close_fds(fds)
        raise
    return msg, fds


def id_batches(ids: Sequence[int]) -> list[list[int]]:
    """``ids`` in lists of at most :data:`MAX_IDS_PER_MESSAGE`."""
    return [
        list(ids[i : i + MAX_IDS_PER_MESSAGE])
        for i in range(0, len(ids), MAX_IDS_PER_MESSAGE)
    ]


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def nofile_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
