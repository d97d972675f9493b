# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A reader's side of one producer's same-host channel: maps the chunks the
producer shares (through the reader's VMM backend), drops them when asked,
and resolves reads against them.

The reader closes each fd once mapped (the mapping or the imported handle
keeps the memory), so a channel holds none in steady state; at most
:data:`~.channel.MAX_FDS_PER_MESSAGE` are in flight per message. A reader
out of descriptors (the kernel drops the fds of the message) detaches from
that producer with an error naming the limit and reads through NIXL/UCX.
"""

import collections
import contextlib
import dataclasses
import os
import socket
import threading
import weakref
from collections.abc import Iterable

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
    Add,
    Drop,
    Dropped,
    Hello,
    Proof,
    SameHostUnavailable,
    Sync,
    Synced,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    STATS,
    Fallback,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    Descs,
    alignment_of,
)
from vllm.logger import init_logger
from vllm.v1.kv_vmm.backend import ImportedChunk, VmmBackend, VmmError

logger = init_logger(__name__)


@dataclasses.dataclass
class _Mapped:
    remote_va: int
    chunk: ImportedChunk
    dropping: bool = False


# A read that misses addresses looks its list up whole (once per chunks
# mapped since it last was) where that costs at most this many times the
# lookup of the addresses it misses, else only those.
_LOOK_AT_ALL = 8


@dataclasses.dataclass
class _LocalAddrs:
    """Each descriptor's address here of one producer list (0: not looked up
    yet, or outside the chunks mapped then); ``complete`` once none is 0, so
    a read need not look for one; ``maps``: the importer's count of chunks
    mapped when the whole list was last looked up (-1: never)."""

    addrs: np.ndarray
    complete: bool = False
    maps: int = -1


class ChunkImporter:
    """Opens the channel to one producer and follows it; raises
    :class:`SameHostUnavailable` (its ``reason`` says why) when the channel
    cannot be opened.

    Args:
        producer: the producer's NIXL agent name.
        secret: the producer's same-host secret, from its NIXL handshake.
        backend: our VMM backend: maps the shared chunks.
        name: our NIXL agent name (part of the proofs; the producer logs it).
        address: where the producer listens (default: from its name).
        identity: our ``(boot id, hostname)`` (tests change it).
        connect_timeout_s: how long the connect and the handshake may take.

    """

    def __init__(
        self,
        producer: str,
        secret: bytes,
        backend: VmmBackend,
        name: str,
        address: str | None = None,
        identity: tuple[str, str] | None = None,
        connect_timeout_s: float = channel.CONNECT_TIMEOUT_S,
    ) -> None:
        self.producer = producer
        self.address = address or channel.channel_address(producer)
        self.backend = backend
        self.kind = backend.device.type
        self.alive = False
        self.error: Exception | None = None
        self._cond = threading.Condition()
        self._mapped: dict[int, _Mapped] = {}
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._maps = 0  # chunks mapped so far
        # A producer's descriptor list -> each descriptor's address here (0:
        # not looked up yet, or outside the chunks mapped then). Kept until a
        # drop: chunks mapped later only add addresses.
        self._local_addrs: weakref.WeakKeyDictionary[Descs, _LocalAddrs] = (
            weakref.WeakKeyDictionary()
        )
        # A power of two that every chunk mapped so far is placed here at a
        # multiple of from where the producer has it: an address here keeps
        # the alignment of the producer's (up to this), so a read's copies
        # are known to be aligned without looking at them. Only ever lowered.
        self.alignment = 1 << 63
        # Reads in flight per generation; a drop starts a new one and waits
        # for the reads of the earlier ones (those may use its chunks).
        self._generation = 0
        self._reads: collections.Counter[int] = collections.Counter()
        self._send_lock = threading.Lock()
        # Syncs asked for and answered (see sync()).
        self._sync_asked = 0
        self._sync_answered = 0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(connect_timeout_s)
        try:
            self._open(sock, secret, name, identity or channel.host_identity())
        except BaseException:
            sock.close()
            raise
        sock.settimeout(channel.IO_TIMEOUT_S)
        self.sock = sock
        self.alive = True
        self._thread = threading.Thread(
            target=self._loop, name="kv-vmm-same-host-reader", daemon=True
        )
        self._thread.start()
        STATS.count(channels=1)

    def _open(
        self,
        sock: socket.socket,
        secret: bytes,
        name: str,
        identity: tuple[str, str],
    ) -> None:
        """Connect and prove to each other that both hold the secret."""
        where = f"no same-host channel at {self.address.lstrip(chr(0))!r}"
        try:
            sock.connect(self.address)
        except (ConnectionRefusedError, FileNotFoundError) as e:
            raise SameHostUnavailable(Fallback.UNREACHABLE, f"{where}: {e}") from e
        except TimeoutError as e:
            raise SameHostUnavailable(Fallback.TIMEOUT, f"{where}: {e}") from e
        except OSError as e:
            raise SameHostUnavailable(Fallback.SETUP, f"{where}: {e}") from e
        try:
            _, uid = channel.peer_credentials(sock)
            if uid != os.getuid():
                raise SameHostUnavailable(
                    Fallback.REFUSED, f"the listener runs as uid {uid}, not ours"
                )
            boot_id, hostname = identity
            nonce = channel.new_nonce()
            channel.send(
                sock, Hello(name=name, boot_id=boot_id, hostname=hostname, nonce=nonce)
            )
            challenge, _ = channel.recv(sock, channel.CHALLENGE)
            if challenge is None:
                raise SameHostUnavailable(
                    Fallback.BUSY,
                    "the producer closed the channel at once (too many handshakes "
                    "at once, or it gave up waiting for us)",
                )
            if (challenge.boot_id, challenge.hostname) != identity:
                raise SameHostUnavailable(
                    Fallback.OTHER_HOST,
                    f"the producer is on {challenge.hostname} (boot id "
                    f"{challenge.boot_id}), not this host",
                )
            if challenge.kind not in ("", self.kind):
                raise SameHostUnavailable(
                    Fallback.KIND,
                    f"the producer shares {challenge.kind} memory, this reader "
                    f"copies into {self.kind} memory",
                )
            mine = channel.proof(
                secret, "producer", (nonce, challenge.nonce), self.producer, name
            )
            if not channel.proof_matches(mine, challenge.proof):
                raise SameHostUnavailable(
                    Fallback.AUTH,
                    f"the listener at {self.address.lstrip(chr(0))!r} could not "
                    f"prove it is the NIXL agent {self.producer}",
                )
            channel.send(
                sock,
                Proof(
                    proof=channel.proof(
                        secret, "reader", (challenge.nonce, nonce), self.producer, name
                    )
                ),
            )
            welcome, _ = channel.recv(sock, channel.WELCOME)
        except TimeoutError as e:
            raise SameHostUnavailable(
                Fallback.TIMEOUT, f"the producer did not answer in time ({e})"
            ) from e
        except ConnectionError as e:
            # It gave up waiting for us (a slow start), or left: not a refusal.
            raise SameHostUnavailable(
                Fallback.BUSY, f"the producer closed the channel in its handshake ({e})"
            ) from e
        except OSError as e:
            raise SameHostUnavailable(Fallback.SETUP, f"{where}: {e}") from e
        if welcome is None:
            raise SameHostUnavailable(
                Fallback.REFUSED, "the producer refused this reader's proof"
            )

    # -- channel --------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._follow()
        except (OSError, VmmError) as e:
            self.error = e
            logger.error(
                "Same-host KV channel of %s: %s; reads go through NIXL/UCX",
                self.producer,
                e,
            )
        finally:
            # The producer is gone, detached us, or the channel broke:
            # nothing may be read through our mappings any more; drop them
            # (after the copies using them), then close so the producer knows.
            with self._cond:
                self.alive = False
                ids = list(self._mapped)
                self._cond.notify_all()  # syncs waiting
            try:
                self._drop(ids)
            finally:
                self.sock.close()

    def _follow(self) -> None:
        """Handle the producer's messages until the channel ends."""
        while True:
            try:
                msg, fds = channel.recv(
                    self.sock, channel.FROM_PRODUCER, channel.MAX_FDS_PER_MESSAGE
                )
            except TimeoutError:
                continue  # idle
            if msg is None:
                return
            match msg:
                case Add(chunks=rows):
                    self._map(rows, fds)
                case Drop(ids=ids):
                    self._drop(ids)
                    with self._send_lock:
                        channel.send(self.sock, Dropped(ids=ids))
                case Synced(seq=seq):
                    with self._cond:
                        self._sync_answered = max(self._sync_answered, seq)
                        self._cond.notify_all()

    def _map(self, rows: list[tuple[int, int, int, int]], fds: list[int]) -> None:
        try:
            for (chunk_id, remote_va, nbytes, offset), fd in zip(rows, fds):
                with self._cond:
                    if chunk_id in self._mapped:
                        raise channel.ChannelProtocolError(
                            f"chunk {chunk_id} shared twice"
                        )
                chunk = self.backend.import_chunk(fd, offset, nbytes)
                with self._cond:
                    self._mapped[chunk_id] = _Mapped(remote_va, chunk)
                    self._index = None
                    self._maps += 1
                    self.alignment = min(
                        self.alignment, alignment_of(remote_va | chunk.addr)
                    )
        finally:
            channel.close_fds(fds)

    def _drop(self, ids: Iterable[int]) -> None:
        with self._cond:
            victims = [self._mapped[i] for i in ids if i in self._mapped]
            for m in victims:
                m.dropping = True
            self._index = None
            self._local_addrs.clear()
            # Reads from now on cannot use the victims; those in flight may:
            # their copies run on this process's threads or device, and end.
            last = self._generation
            self._generation += 1
            while any(g <= last for g in self._reads):
                self._cond.wait()
            for i in ids:
                self._mapped.pop(i, None)
        for m in victims:
            self.backend.unmap_import(m.chunk)

    def sync(self, timeout_s: float = channel.SYNC_TIMEOUT_S) -> bool:
        """Wait until every chunk the producer sent before now is mapped
        (or dropped); False if the channel closed or the producer did not
        answer within ``timeout_s``."""
        with self._cond:
            if not self.alive:
                return False
            self._sync_asked += 1
            seq = self._sync_asked
        try:
            with self._send_lock:
                channel.send(self.sock, Sync(seq=seq))
        except OSError:
            return False
        with self._cond:
            return (
                self._cond.wait_for(
                    lambda: self._sync_answered >= seq or not self.alive, timeout_s
                )
                and self.alive
            )

    @property
    def num_mapped(self) -> int:
        with self._cond:
            return len(self._mapped)

    # -- reads ----------------------------------------------------------
    @property
    def reads_in_flight(self) -> int:
        with self._cond:
            return sum(self._reads.values())

    def pin(self, remote: Descs, indices: np.ndarray) -> tuple[np.ndarray, int] | None:
        """Local addresses of the producer's descriptors ``indices`` of
        ``remote``, and a pin (:meth:`unpin` it) so that no chunk is dropped
        under the read; None unless each descriptor lies inside one chunk
        mapped now."""
        with self._cond:
            if not self.alive:
                return None
            known = self._local_addrs.get(remote)
            if known is None:
                known = _LocalAddrs(np.zeros(len(remote.addrs), dtype=np.uint64))
                self._local_addrs[remote] = known
            addrs = known.addrs.take(indices)
            # No reduction once every descriptor was looked up, else one.
            if not known.complete and len(addrs) and not addrs.min():
                missing = np.flatnonzero(addrs == 0)
                mapped_since = known.maps != self._maps
                if mapped_since and len(known.addrs) <= _LOOK_AT_ALL * len(missing):
                    known = self._local_addrs[remote] = self._look_at(remote)
                    addrs = known.addrs.take(indices)
                    missing = np.flatnonzero(addrs == 0)
                if len(missing):
                    looked_up = self._look_up(remote, indices[missing])
                    if looked_up is None:
                        return None
                    addrs[missing] = looked_up
                    known.addrs[indices[missing]] = looked_up
                    known.complete = bool(known.addrs.min())
            generation = self._generation
            self._reads[generation] += 1
            return addrs, generation

    def _look_at(self, remote: Descs) -> _LocalAddrs:
        """Where every descriptor of ``remote`` is mapped here now (0 where
        none is), for a read that misses addresses in chunks mapped since the
        list was last looked at (lock held). Looked up read by read only,
        the first reads of a list each paid a lookup of their own
        descriptors until every one was seen: with random blocks, dozens of
        reads (each about the vectorized work of one lookup of the whole
        list). Not only at a list's first read: a reader's first reads can
        come before the producer's chunks are all mapped here."""
        local = np.zeros(len(remote.addrs), dtype=np.uint64)
        found = self._locate(remote, np.arange(len(remote.addrs)))
        if found is not None:
            addrs, ok = found
            np.copyto(local, addrs, where=ok)
        complete = bool(len(local)) and bool(local.min())
        return _LocalAddrs(local, complete, self._maps)

    def _look_up(self, remote: Descs, indices: np.ndarray) -> np.ndarray | None:
        """Where descriptors ``indices`` of ``remote`` are mapped here, or
        None unless each lies inside one chunk mapped now (lock held)."""
        found = self._locate(remote, indices)
        if found is None or not found[1].all():
            return None
        return found[0]

    def _locate(
        self, remote: Descs, indices: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Where descriptors ``indices`` of ``remote`` would be mapped here,
        and which of them lie inside one chunk mapped now (the others'
        addresses mean nothing); None while no chunk is (lock held)."""
        if self._index is None:
            live = sorted(
                (m.remote_va, m.chunk.nbytes, m.chunk.addr)
                for m in self._mapped.values()
                if not m.dropping
            )
            self._index = (
                np.array([r[0] for r in live], dtype=np.uint64),
                np.array([r[0] + r[1] for r in live], dtype=np.uint64),
                np.array([r[2] for r in live], dtype=np.uint64),
            )
        starts, ends, chunk_addrs = self._index
        if not len(starts):
            return None
        src = np.take(remote.addrs, indices)
        idx = np.searchsorted(starts, src, side="right").astype(np.int64) - 1
        ok = idx >= 0
        np.maximum(idx, 0, out=idx)
        ok &= src + np.take(remote.lengths, indices) <= ends[idx]
        return src - starts[idx] + chunk_addrs[idx], ok

    def unpin(self, generation: int) -> None:
        """A read pinned in ``generation`` (:meth:`pin`) is over."""
        with self._cond:
            self._reads[generation] -= 1
            if not self._reads[generation]:
                # What a drop waits for (the other waiters are woken by
                # their own events).
                del self._reads[generation]
                self._cond.notify_all()

    def close(self) -> None:
        """Drop everything and close the channel (the producer sees EOF)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=30)
