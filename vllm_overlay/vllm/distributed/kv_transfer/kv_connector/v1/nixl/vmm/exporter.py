# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The producer's side of the same-host channel: shares each physical chunk
of its mapped KV segments with readers that proved they are its NIXL peers.

Lifetime rule. Hole-punching a memfd extent frees its pages even while
another process maps them (the reader would then read zeros, or the owner's
next use of the extent); on CUDA an importer's handle keeps the allocation
alive after the owner releases it, so memory the owner counts as given back
would stay in use. So the owner never gives a chunk back while a peer maps
it:

1. ``wait_before_unmap`` (outside the page table's lock) sends ``Drop`` for
   the chunks of the segments to every peer that holds them and waits until
   each acknowledged (``Dropped``: it unmapped them, after the local copies
   that used them finished) or its socket closed (a dead peer maps
   nothing); new peers no longer receive those chunks. After
   ``drop_timeout_s`` it raises :class:`VmmError` and nothing is unmapped.
2. ``before_segment_unmapped`` (under the lock) checks without waiting that
   no peer holds a chunk of the segment, else refuses the unmap.

A chunk is sent when it is mapped, before the step that writes it runs, so
before any reader can be told of blocks in it; ``Sync`` is answered after
every chunk sent before it.
"""

import contextlib
import dataclasses
import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
    Add,
    Challenge,
    Drop,
    Dropped,
    SameHostFdLimitError,
    SameHostUnavailable,
    Sync,
    Synced,
    Welcome,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    STATS,
    Fallback,
    SameHostStats,
)
from vllm.logger import init_logger
from vllm.v1.kv_vmm.backend import VmmBackend, VmmError
from vllm.v1.kv_vmm.page_table import KVPageTable, Segment

logger = init_logger(__name__)

#: Connections in their handshake at once; more are closed at once.
MAX_PENDING = 8


def _daemon(name: str, target: Callable[..., None], *args: object) -> None:
    threading.Thread(target=target, args=args, name=name, daemon=True).start()


@dataclasses.dataclass
class _Chunk:
    va: int
    nbytes: int
    handle: object
    backend: VmmBackend
    retiring: bool = False


@dataclasses.dataclass(eq=False)
class _Peer:
    sock: socket.socket
    name: str
    # Chunk ids sent to the peer and not acknowledged as dropped.
    held: set[int] = dataclasses.field(default_factory=set)
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    closed: bool = False


class ChunkExporter:
    """Shares the mapped chunks of page tables with same-host readers.

    Args:
        name: our NIXL agent name: the channel's address
            (:func:`~.channel.channel_address`) and part of every proof.
        secret: the key of the proofs, published only in our NIXL
            handshake metadata.
        drop_timeout_s: how long an unmap waits for peers to drop chunks.
        identity: ``(boot id, hostname)`` sent to peers (tests change it).
        stats: where refusals are counted.

    """

    def __init__(
        self,
        name: str,
        secret: bytes,
        drop_timeout_s: float = 30.0,
        identity: tuple[str, str] | None = None,
        stats: SameHostStats = STATS,
    ) -> None:
        if len(secret) < channel.SECRET_BYTES:
            raise ValueError(f"a same-host secret of {len(secret)} bytes is too short")
        self.name = name
        self.address = channel.channel_address(name)
        self.drop_timeout_s = drop_timeout_s
        self.identity = identity or channel.host_identity()
        self.stats = stats
        self.kind: str | None = None
        self.secret = secret
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._chunks: dict[int, _Chunk] = {}
        self._by_segment: dict[tuple[int, int], list[int]] = {}
        self._next_id = 0
        self._peers: list[_Peer] = []
        self._pending = 0
        self._tables: list[KVPageTable] = []
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self.address)
        self._listener.listen(16)
        _daemon("kv-vmm-same-host-accept", self._accept_loop)

    # -- page table -----------------------------------------------------
    def attach(self, table: KVPageTable) -> None:
        """Share what ``table`` maps now and later (callbacks installed
        before keep running, first)."""
        kind = table.backend.device.type
        if self.kind not in (None, kind):
            raise VmmError(f"page tables of {self.kind} and {kind} memory")
        self.kind = kind
        key = len(self._tables)
        self._tables.append(table)
        previous_mapped = table.on_segment_mapped
        previous_unmapped = table.before_segment_unmapped
        previous_wait = table.wait_before_unmap

        def on_mapped(segment: Segment) -> None:
            if previous_mapped is not None:
                previous_mapped(segment)
            self._add(key, table.backend, segment)

        def before_unmapped(segment: Segment) -> None:
            if previous_unmapped is not None:
                previous_unmapped(segment)
            self._remove(key, segment)

        def wait_before_unmap(segment_ids: list[int]) -> None:
            if previous_wait is not None:
                previous_wait(segment_ids)
            self.drop(key, segment_ids)

        for segment in table.segments():
            self._add(key, table.backend, segment)
        table.on_segment_mapped = on_mapped
        table.before_segment_unmapped = before_unmapped
        table.wait_before_unmap = wait_before_unmap

    def _add(self, key: int, backend: VmmBackend, segment: Segment) -> None:
        with self._lock:
            ids = []
            for c in segment.chunks:
                self._chunks[self._next_id] = _Chunk(c.va, c.nbytes, c.handle, backend)
                ids.append(self._next_id)
                self._next_id += 1
            self._by_segment[(key, segment.segment_id)] = ids
            peers = list(self._peers)
        for peer in peers:
            self._send_chunks(peer, ids)

    def drop(self, key: int, segment_ids: Iterable[int]) -> None:
        """Have every peer drop the chunks of ``segment_ids`` and wait until
        each did (or is gone); :class:`VmmError` after ``drop_timeout_s``."""
        with self._lock:
            ids = {
                i
                for s in segment_ids
                for i in self._by_segment.get((key, s), ())
                if i in self._chunks
            }
            if not ids:
                return
            for i in ids:
                self._chunks[i].retiring = True
            asks = [(p, sorted(p.held & ids)) for p in self._peers if p.held & ids]
        for peer, held in asks:
            try:
                with peer.send_lock:
                    for batch in channel.id_batches(held):
                        channel.send(peer.sock, Drop(ids=batch))
            except OSError as e:
                if self._gone(peer):
                    continue  # it disconnected meanwhile: it maps nothing
                # It still maps them until its socket closes: wait for that.
                logger.warning("Same-host KV peer %s: drop not sent (%s)", peer.name, e)
                self._detach(peer)
        deadline = time.monotonic() + self.drop_timeout_s
        with self._cond:
            while holders := [p for p in self._peers if p.held & ids]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise VmmError(
                        f"{len(holders)} same-host KV reader(s) "
                        f"({', '.join(p.name for p in holders)}) still map "
                        f"{len(ids)} chunk(s) after {self.drop_timeout_s:.0f} s; "
                        "the pages stay mapped (retry the unmap later)"
                    )
                self._cond.wait(left)

    def _remove(self, key: int, segment: Segment) -> None:
        """Under the page table's lock: the segment's chunks are given back
        next; refuse if a peer still maps one (never waits)."""
        with self._lock:
            ids = self._by_segment.get((key, segment.segment_id), [])
            holders = [p.name for p in self._peers if p.held.intersection(ids)]
            if holders:
                raise VmmError(
                    f"KV segment {segment.segment_id} cannot be unmapped: the "
                    f"same-host reader(s) {holders} still map it"
                )
            self._by_segment.pop((key, segment.segment_id), None)
            for i in ids:
                self._chunks.pop(i, None)

    @property
    def num_peers(self) -> int:
        with self._lock:
            return len(self._peers)

    def held_by_peers(self) -> int:
        """Chunks some peer maps."""
        with self._lock:
            return len(set().union(*(p.held for p in self._peers)))

    # -- channel --------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                busy = self._pending >= MAX_PENDING
                if not busy:
                    self._pending += 1
            if busy:
                # Never blocks the listener: a reader that is refused here
                # tries again later.
                self.stats.refused(
                    "(a new connection)",
                    Fallback.BUSY,
                    f"{MAX_PENDING} channels are in their handshake already",
                )
                sock.close()
                continue
            _daemon("kv-vmm-same-host-welcome", self._handshake, sock)

    def _handshake(self, sock: socket.socket) -> None:
        who = "a process"
        owned = False  # by a peer's loop, once welcomed
        try:
            pid, uid = channel.peer_credentials(sock)
            who = f"pid {pid}"
            # The socket is reachable by every process of the network
            # namespace: KV memory goes only to our own user, and then only to
            # a process that proves it is our NIXL peer.
            if uid != os.getuid():
                raise SameHostUnavailable(
                    Fallback.REFUSED, f"uid {uid} is not ours ({os.getuid()})"
                )
            sock.settimeout(channel.IO_TIMEOUT_S)
            peer = self._authenticate(sock, who)
            if peer is not None:
                self._welcome(peer)
                owned = True
        except SameHostUnavailable as e:
            self.stats.refused(who, e.reason, e)
        except TimeoutError as e:
            self.stats.refused(who, Fallback.TIMEOUT, f"no answer ({e})")
        except OSError as e:
            self.stats.refused(who, Fallback.CLOSED, e)
        finally:
            with self._lock:
                self._pending -= 1
            if not owned:
                sock.close()

    def _authenticate(self, sock: socket.socket, who: str) -> _Peer | None:
        """The reader's ``Hello`` and ``Proof``; the peer, or None if it left."""
        hello, _ = channel.recv(sock, channel.HELLO)
        if hello is None:
            return None  # left before saying anything
        nonce = channel.new_nonce()
        boot_id, hostname = self.identity
        channel.send(
            sock,
            Challenge(
                boot_id=boot_id,
                hostname=hostname,
                kind=self.kind or "",
                nonce=nonce,
                proof=channel.proof(
                    self.secret, "producer", (hello.nonce, nonce), self.name, hello.name
                ),
            ),
        )
        if (hello.boot_id, hello.hostname) != self.identity:
            raise SameHostUnavailable(
                Fallback.OTHER_HOST,
                f"{hello.name!r} is on {hello.hostname} (boot id {hello.boot_id})",
            )
        answer, _ = channel.recv(sock, channel.PROOF)
        if answer is None:
            return None  # it gave up (it did not trust our proof)
        expected = channel.proof(
            self.secret, "reader", (nonce, hello.nonce), self.name, hello.name
        )
        if not channel.proof_matches(expected, answer.proof):
            raise SameHostUnavailable(
                Fallback.AUTH,
                f"{who} (calling itself {hello.name!r}) has no proof of our NIXL "
                "handshake",
            )
        return _Peer(sock, hello.name)

    def _welcome(self, peer: _Peer) -> None:
        with self._lock:
            if self._closed:
                raise SameHostUnavailable(Fallback.REFUSED, "the exporter is closed")
            ids = [i for i, c in self._chunks.items() if not c.retiring]
            self._peers.append(peer)
            # Holds the peer's send lock before any later addition is sent.
            peer.send_lock.acquire()
        # From now on the peer's loop owns the socket and takes the peer off
        # the holders when the channel ends.
        _daemon("kv-vmm-same-host-peer", self._peer_loop, peer)
        try:
            channel.send(peer.sock, Welcome())
            self._send_chunks(peer, ids, locked=True)
        except OSError as e:
            self._send_failed(peer, e)
            return
        finally:
            peer.send_lock.release()
        logger.info("Same-host KV reader %s connected (%d chunks)", peer.name, len(ids))

    def _send_chunks(self, peer: _Peer, ids: list[int], locked: bool = False) -> None:
        if not locked:
            with peer.send_lock:
                return self._send_chunks(peer, ids, locked=True)
        for start in range(0, len(ids), channel.MAX_FDS_PER_MESSAGE):
            batch = ids[start : start + channel.MAX_FDS_PER_MESSAGE]
            with self._lock:
                if peer.closed:
                    return
                # Not the ones an unmap is taking back (it may not have
                # asked this peer: it did not hold them yet).
                chunks: list[tuple[int, _Chunk]] = []
                for i in batch:
                    c = self._chunks.get(i)
                    if c is not None and not c.retiring:
                        chunks.append((i, c))
                # Counted before sending: a partial send leaves the peer
                # holding at most these.
                peer.held.update(i for i, _ in chunks)
            rows, fds = [], []
            try:
                for i, c in chunks:
                    fd, offset = c.backend.export_chunk(c.handle)
                    fds.append(fd)
                    rows.append((i, c.va, c.nbytes, offset))
                channel.send(peer.sock, Add(chunks=rows), fds)
            except OSError as e:
                if e.errno == errno.EMFILE:
                    self._send_failed(
                        peer,
                        SameHostFdLimitError(
                            f"exporting {len(chunks)} KV chunks to {peer.name}: "
                            "out of file descriptors "
                            f"(RLIMIT_NOFILE={channel.nofile_limit()})"
                        ),
                    )
                else:
                    self._send_failed(peer, e)
                return
            except VmmError as e:
                self._send_failed(peer, e)
                return
            finally:
                channel.close_fds(fds)

    def _send_failed(self, peer: _Peer, error: Exception) -> None:
        """A send to the peer failed: detach it (no fault if it had left)."""
        if not self._gone(peer):
            logger.warning("Same-host KV peer %s detached: %s", peer.name, error)
            self._detach(peer)

    def _gone(self, peer: _Peer) -> bool:
        """Whether the peer's channel closed (its loop saw the end): a send
        that failed because of that is no fault."""
        with self._lock:
            return peer.closed

    def _detach(self, peer: _Peer) -> None:
        """Tell the peer to drop everything (it closes when it did)."""
        with contextlib.suppress(OSError):
            peer.sock.shutdown(socket.SHUT_WR)

    def _peer_loop(self, peer: _Peer) -> None:
        try:
            self._follow(peer)
        except SameHostUnavailable as e:
            # It proved it is our NIXL peer, yet breaks the protocol: it is
            # told to drop everything and no longer counts as a holder.
            self.stats.refused(peer.name, e.reason, e)
            self._detach(peer)
        except OSError as e:
            logger.warning("Same-host KV peer %s: channel error %s", peer.name, e)
        finally:
            # Closed: the peer unmapped everything (or its process is gone).
            with self._cond:
                peer.closed = True
                peer.held.clear()
                if peer in self._peers:
                    self._peers.remove(peer)
                self._cond.notify_all()
            peer.sock.close()
            logger.info("Same-host KV reader %s disconnected", peer.name)

    def _follow(self, peer: _Peer) -> None:
        """Handle the peer's messages until the channel ends. The socket
        keeps its send timeout (one socket object, shared with the senders):
        an idle peer just times the receive out."""
        while True:
            try:
                msg, _ = channel.recv(peer.sock, channel.FROM_READER)
            except TimeoutError:
                continue
            if msg is None:
                return
            match msg:
                case Dropped(ids=ids):
                    with self._cond:
                        peer.held.difference_update(ids)
                        self._cond.notify_all()
                case Sync(seq=seq):
                    # After every chunk sent before (one send lock).
                    with peer.send_lock:
                        channel.send(peer.sock, Synced(seq=seq))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop sharing: peers drop everything; wait up to ``timeout_s``."""
        with self._lock:
            self._closed = True
            peers = list(self._peers)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for peer in peers:
            self._detach(peer)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._peers and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
