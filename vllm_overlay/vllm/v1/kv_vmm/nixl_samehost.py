# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Same-host reads of VMM-backed KV memory for NixlConnector.

Between two engines on one host, NIXL/UCX reads of CUDA VMM memory stage
through host memory. Here the producer (the engine whose KV memory is read)
shares every physical chunk of its mapped segments with readers on the same
host as a file descriptor (``SCM_RIGHTS`` over a Unix-domain socket); a
reader maps each chunk once and runs the reads of blocks that lie in such
memory as local copies, with NIXL's semantics kept: an asynchronous handle,
``check_xfer_state``, telemetry, and the notification to the producer once
the bytes are there.

- Host backend: the chunk's memfd extent (fd, offset, length), mapped
  read-only with ``mmap``; copies are ``memmove``.
- CUDA backend: ``cuMemExportToShareableHandle`` (POSIX fd), imported with
  ``cuMemImportFromShareableHandle`` and mapped into a reservation of the
  reader with access for its device; copies are ``cuMemcpyAsync`` on a
  stream of the reader.

Channel. The producer listens on an abstract Unix socket named after its
NIXL agent (:func:`channel_address`); a reader that handshook with the agent
connects there. Both sides send ``(boot id, hostname)`` first and keep the
channel only when both match (same kernel instance). A reader that cannot
open it (no listener: a stock or remote peer; another network namespace;
another host) logs the reason once and reads through NIXL/UCX as before.

Lifetime rule. Hole-punching a memfd extent frees its pages even while
another process maps them (the reader would then read zeros, or the owner's
next use of the extent); on CUDA an importer's handle keeps the allocation
alive after the owner releases it, so memory the owner counts as given back
would stay in use, holding blocks the owner no longer has. So the owner never
gives a chunk back while a peer maps it:

1. ``wait_before_unmap`` (outside the page table's lock) sends ``drop`` for
   the chunks of the segments to every peer that holds them and waits until
   each acknowledged (``dropped``: it unmapped them, after the local copies
   that used them finished) or its socket closed (a dead peer maps
   nothing); new peers no longer receive those chunks. After
   ``drop_timeout_s`` it raises :class:`VmmError` and nothing is unmapped.
2. ``before_segment_unmapped`` (under the lock) checks without waiting that
   no peer holds a chunk of the segment, else refuses the unmap.

A reader resolves a read against the chunks it maps at that moment and pins
them until the copy is done; a drop waits for the pins. The producer sends a
chunk when it maps it, before the step that writes the chunk runs, so before
any reader can be told of blocks in it; but the reader's channel thread may
not have mapped it yet (a busy host). So a read with rows outside the mapped
chunks first asks the producer to ``sync``: the answer (``synced``) comes
after every chunk sent before it, and the channel thread maps in order. Rows
still outside (not shared, or dropped) make the whole read go through
NIXL/UCX, whose registrations decide (a chunk given back is no longer
registered there either: the read fails, never reads freed memory).

File descriptors: the reader closes each fd once mapped (the mapping or the
imported handle keeps the memory), so a channel holds none in steady state;
at most :data:`MAX_FDS_PER_MESSAGE` are in flight per message. A reader out
of descriptors (``EMFILE``: the kernel drops the fds of the message) detaches
from that producer with an error naming the limit and reads through NIXL/UCX.
"""

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from vllm.logger import init_logger
from vllm.v1.kv_vmm.backend import VmmBackend, VmmError
from vllm.v1.kv_vmm.host import map_shared_extent, unmap_shared_extent
from vllm.v1.kv_vmm.page_table import KVPageTable, Segment

logger = init_logger(__name__)

#: Abstract Unix socket name prefix of a producer's channel.
CHANNEL_PREFIX = "vllm-kv-vmm-same-host/"
#: File descriptors per message (the kernel's limit is 253).
MAX_FDS_PER_MESSAGE = 64
_MAX_MESSAGE = 1 << 20
_CONNECT_TIMEOUT_S = 10.0
_SEND_TIMEOUT_S = 5.0
# How long a read waits for the producer's answer to a sync before it goes
# through NIXL/UCX.
_SYNC_TIMEOUT_S = 2.0


# What this process has done on the same-host path (read back by tests and
# benchmarks through the worker: ``same_host_stats()``).
_stats_lock = threading.Lock()
_stats = {"reads": 0, "bytes": 0, "failed": 0, "fallbacks": 0, "channels": 0}


def same_host_stats() -> dict[str, int]:
    """Counters of this process: same-host reads done, bytes copied, reads
    that failed, reads that went to NIXL/UCX although a channel was open
    (rows outside the shared chunks), channels opened."""
    with _stats_lock:
        return dict(_stats)


def _count(**deltas: int) -> None:
    with _stats_lock:
        for key, value in deltas.items():
            _stats[key] += value


def host_identity() -> tuple[str, str]:
    """(boot id, hostname): equal only for processes of one running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return boot_id, socket.gethostname()


def channel_address(agent_name: str | bytes) -> str:
    """The abstract Unix socket a producer's agent listens on (NIXL names
    remote agents in bytes, its own in str: both give the same address)."""
    if isinstance(agent_name, bytes):
        agent_name = agent_name.decode()
    return "\0" + CHANNEL_PREFIX + agent_name


class SameHostUnavailable(VmmError):
    """The same-host channel to a peer cannot be used (the reason says why)."""


class SameHostFdLimitError(VmmError):
    """The process ran out of file descriptors while receiving chunks."""


def _send(sock: socket.socket, msg: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and its fds; (None, []) at EOF. Raises
    :class:`SameHostFdLimitError` if the kernel could not pass every fd."""
    data, fds, flags, _ = socket.recv_fds(sock, _MAX_MESSAGE, MAX_FDS_PER_MESSAGE)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    msg = json.loads(data)
    if flags & socket.MSG_CTRUNC or len(fds) != msg.get("nfds", 0):
        for fd in fds:
            os.close(fd)
        raise SameHostFdLimitError(
            f"received {len(fds)} of {msg.get('nfds', 0)} file descriptors of a "
            "KV chunk message (the kernel drops them when the process is at its "
            "open-file limit, RLIMIT_NOFILE="
            f"{_nofile_limit()}); raise the limit (ulimit -n)"
        )
    return msg, fds


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", cred)[1]


def _nofile_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- producer -----------------------------------------------------------------


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


def export_chunk(backend: VmmBackend, handle: object) -> tuple[int, int]:
    """A new file descriptor of a physical allocation and the offset of the
    allocation in it (the caller closes the fd)."""
    export_extent = getattr(backend, "export_extent", None)
    if export_extent is not None:
        return export_extent(handle)
    export_fd = getattr(backend, "export_fd", None)
    if export_fd is None:
        raise VmmError(f"{type(backend).__name__} cannot share its memory")
    return export_fd(handle), 0


def backend_kind(backend: VmmBackend) -> str:
    return "host" if getattr(backend, "export_extent", None) is not None else "cuda"


class ChunkExporter:
    """Shares the mapped chunks of page tables with same-host readers.

    Args:
        address: the Unix socket to listen on (:func:`channel_address`).
        drop_timeout_s: how long an unmap waits for peers to drop chunks.
        identity: ``(boot id, hostname)`` sent to peers (tests change it).

    """

    def __init__(
        self,
        address: str,
        drop_timeout_s: float = 30.0,
        identity: tuple[str, str] | None = None,
    ) -> None:
        self.address = address
        self.drop_timeout_s = drop_timeout_s
        self.identity = identity or host_identity()
        self.kind: str | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._chunks: dict[int, _Chunk] = {}
        self._by_segment: dict[tuple[int, int], list[int]] = {}
        self._next_id = 0
        self._peers: list[_Peer] = []
        self._tables: list[KVPageTable] = []
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(address)
        self._listener.listen(16)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="kv-vmm-same-host-accept", daemon=True
        )
        self._accept_thread.start()

    # -- page table -----------------------------------------------------
    def attach(self, table: KVPageTable) -> None:
        """Share what ``table`` maps now and later (callbacks installed
        before keep running, first)."""
        kind = backend_kind(table.backend)
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
                    _send(peer.sock, {"op": "drop", "ids": held})
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
            try:
                self._welcome(sock)
            except Exception as e:
                logger.warning("Same-host KV channel refused: %s", e)
                sock.close()

    def _welcome(self, sock: socket.socket) -> None:
        # The socket is reachable by every process of the network namespace:
        # KV memory goes only to processes of our own user.
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise SameHostUnavailable(f"a process of uid {uid} is not ours")
        sock.settimeout(_SEND_TIMEOUT_S)
        hello, fds = _recv(sock)
        if hello is None or hello.get("op") != "hello":
            raise SameHostUnavailable("the peer closed before its hello")
        boot_id, hostname = self.identity
        _send(
            sock,
            {
                "op": "hello",
                "boot_id": boot_id,
                "hostname": hostname,
                "kind": self.kind,
            },
        )
        if (hello["boot_id"], hello["hostname"]) != self.identity:
            raise SameHostUnavailable(
                f"peer {hello.get('name')} is on {hello['hostname']} (boot id "
                f"{hello['boot_id']}), not here"
            )
        peer = _Peer(sock, str(hello.get("name")))
        with self._lock:
            if self._closed:
                raise SameHostUnavailable("the exporter is closed")
            ids = [i for i, c in self._chunks.items() if not c.retiring]
            self._peers.append(peer)
            # Holds the peer's send lock before any later addition is sent.
            peer.send_lock.acquire()
        try:
            self._send_chunks(peer, ids, locked=True)
        finally:
            peer.send_lock.release()
        threading.Thread(
            target=self._peer_loop,
            args=(peer,),
            name="kv-vmm-same-host-peer",
            daemon=True,
        ).start()
        logger.info("Same-host KV reader %s connected (%d chunks)", peer.name, len(ids))

    def _send_chunks(self, peer: _Peer, ids: list[int], locked: bool = False) -> None:
        if not locked:
            with peer.send_lock:
                return self._send_chunks(peer, ids, locked=True)
        for start in range(0, len(ids), MAX_FDS_PER_MESSAGE):
            batch = ids[start : start + MAX_FDS_PER_MESSAGE]
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
                    fd, offset = export_chunk(c.backend, c.handle)
                    fds.append(fd)
                    rows.append([i, c.va, c.nbytes, offset])
                _send(peer.sock, {"op": "add", "chunks": rows, "nfds": len(fds)}, fds)
            except (OSError, VmmError) as e:
                if self._gone(peer):
                    return  # it disconnected meanwhile
                if isinstance(e, OSError) and e.errno == errno.EMFILE:
                    e = SameHostFdLimitError(
                        f"exporting {len(chunks)} KV chunks to {peer.name}: out of "
                        f"file descriptors (RLIMIT_NOFILE={_nofile_limit()})"
                    )
                logger.warning("Same-host KV peer %s detached: %s", peer.name, e)
                self._detach(peer)
                return
            finally:
                for fd in fds:
                    os.close(fd)

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
        # The socket keeps its send timeout (one socket object, shared with
        # the senders): an idle peer just times the receive out.
        try:
            while True:
                try:
                    msg, _ = _recv(peer.sock)
                except TimeoutError:
                    continue
                if msg is None:
                    break
                if msg.get("op") == "dropped":
                    with self._cond:
                        peer.held.difference_update(msg["ids"])
                        self._cond.notify_all()
                elif msg.get("op") == "sync":
                    # After every chunk sent before (one send lock).
                    with peer.send_lock:
                        _send(peer.sock, {"op": "synced", "seq": msg["seq"]})
        except (OSError, ValueError, VmmError) as e:
            logger.warning("Same-host KV peer %s: channel error %s", peer.name, e)
        # Closed: the peer unmapped everything (or its process is gone).
        with self._cond:
            peer.closed = True
            peer.held.clear()
            if peer in self._peers:
                self._peers.remove(peer)
            self._cond.notify_all()
        peer.sock.close()
        logger.info("Same-host KV reader %s disconnected", peer.name)

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


# -- reader -------------------------------------------------------------------


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


# iovecs per process_vm_readv call (the kernel's UIO_MAXIOV).
_IOV_MAX = 1024


def _process_vm_readv() -> Any:
    """The C library's ``process_vm_readv``, or None where it has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (AttributeError, OSError):
        return None
    iov, count = ctypes.POINTER(_IoVec), ctypes.c_ulong
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, iov, count, iov, count, ctypes.c_ulong]
    return fn


class HostChunkMemory:
    """Maps shared memfd extents read-only; copies a read's runs with
    ``process_vm_readv`` on this very process, up to 1024 runs per system
    call: the copying thread gives the GIL up once per call. One memmove
    per run gave it up and waited for it again at every run while the
    engine's thread ran Python (on two CPUs: 0.8-1.2 GB/s, against 3.0-3.4
    through UCX). Where the call is refused (a seccomp profile), memmove.
    """

    def __init__(self) -> None:
        self._readv = _process_vm_readv()

    def map(self, fd: int, offset: int, nbytes: int) -> tuple[int, Any]:
        return map_shared_extent(fd, offset, nbytes), None

    def unmap(self, addr: int, nbytes: int, state: Any) -> None:
        unmap_shared_extent(addr, nbytes)

    def copy(self, runs: np.ndarray) -> None:
        """Copy the ``(dst, src, n)`` runs."""
        if self._readv is not None and self._copy_readv(runs):
            return
        for dst, src, n in runs.tolist():
            ctypes.memmove(dst, src, n)

    def _copy_readv(self, runs: np.ndarray) -> bool:
        """False (nothing copied, memmove from now on) if the kernel refuses
        the call; raises if a copy failed part-way."""
        pid = os.getpid()
        iov = ctypes.POINTER(_IoVec)
        runs = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
        for start in range(0, len(runs), _IOV_MAX):
            batch = runs[start : start + _IOV_MAX]
            # struct iovec {void *base; size_t len;}: two 64-bit words.
            local = np.ascontiguousarray(batch[:, [0, 2]])
            remote = np.ascontiguousarray(batch[:, [1, 2]])
            total = int(batch[:, 2].sum())
            n = len(batch)
            got = self._readv(
                pid, local.ctypes.data_as(iov), n, remote.ctypes.data_as(iov), n, 0
            )
            if got == -1 and start == 0:
                err = ctypes.get_errno()
                if err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                    logger.info(
                        "Same-host KV copies use memmove (process_vm_readv: %s)",
                        os.strerror(err),
                    )
                    self._readv = None
                    return False
            if got != total:
                why = os.strerror(ctypes.get_errno()) if got == -1 else f"{got} bytes"
                raise VmmError(
                    f"same-host KV copy of {total} bytes failed part-way "
                    f"(process_vm_readv: {why})"
                )
        return True


class CudaChunkMemory:
    """Imports exported CUDA allocations into reservations of this process
    with access for the backend's device; copies on a stream of its own.

    A read's copies are enqueued on the caller's thread, as one kernel
    (:mod:`vllm.v1.kv_vmm.cuda_copy`) or, where that cannot run, one driver
    call (``cuMemcpyBatchAsync``), and completed through an event the caller
    polls, like a NIXL transfer: no thread of ours waits on the device. A
    thread issuing one driver call per copy would give the GIL up and wait
    for it again at every call, up to the interpreter's switch interval
    (5 ms) each while the engine's thread runs Python: 2.6 s for a read of
    512 blocks on a GPU host, against 3.8 ms through NIXL.
    ``copy_kernel=False`` keeps to ``cuMemcpyBatchAsync`` (to compare them).
    """

    def __init__(self, backend: Any, copy_kernel: bool = True) -> None:
        self.backend = backend
        self._drv = backend._drv
        self._stream: Any = None
        self._attrs: list[Any] | None = None
        self._copier: Any = None
        if not copy_kernel:
            return
        try:
            from vllm.v1.kv_vmm.cuda_copy import RunCopier

            self._current()
            copier = RunCopier(backend.device)
            copier.warm_up(int(self._stream_handle()))
            self._copier = copier
        except Exception as e:
            logger.info(
                "Same-host KV reads copy with cuMemcpyBatchAsync: the copy "
                "kernel cannot run here (%s)",
                e,
            )

    def _stream_handle(self) -> Any:
        """Our stream, created on first use."""
        if self._stream is None:
            drv = self._drv
            self._stream = self.backend._check(
                drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
                "cuStreamCreate",
            )
        return self._stream

    def _current(self) -> None:
        drv = self._drv
        if int(self.backend._check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
            self.backend._check(
                drv.cuCtxSetCurrent(self.backend._primary_ctx), "cuCtxSetCurrent"
            )

    def map(self, fd: int, offset: int, nbytes: int) -> tuple[int, Any]:
        drv, check = self._drv, self.backend._check
        self._current()
        handle = check(
            drv.cuMemImportFromShareableHandle(
                fd,
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ),
            "cuMemImportFromShareableHandle",
        )
        va = int(check(drv.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve"))
        try:
            check(drv.cuMemMap(va, nbytes, offset, handle, 0), "cuMemMap")
            try:
                check(
                    drv.cuMemSetAccess(va, nbytes, self.backend._access, 1),
                    "cuMemSetAccess",
                )
            except BaseException:
                drv.cuMemUnmap(va, nbytes)
                raise
        except BaseException:
            drv.cuMemAddressFree(va, nbytes)
            drv.cuMemRelease(handle)
            raise
        return va, handle

    def unmap(self, addr: int, nbytes: int, state: Any) -> None:
        drv, check = self._drv, self.backend._check
        self._current()
        check(drv.cuMemUnmap(addr, nbytes), "cuMemUnmap")
        check(drv.cuMemRelease(state), "cuMemRelease")
        check(drv.cuMemAddressFree(addr, nbytes), "cuMemAddressFree")

    def copy_async(self, runs: np.ndarray) -> Any:
        """Enqueue the ``(dst, src, n)`` copies; returns the event that
        completes with them (:meth:`done`, :meth:`wait`, :meth:`free`)."""
        drv, check = self._drv, self.backend._check
        self._current()
        stream = self._stream_handle()
        if self._copier is not None and self._copier.accepts(runs):
            self._copier.launch(runs, int(stream))
        else:
            self._copy_engine_copies(runs.tolist(), stream)
        event = check(
            drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
            "cuEventCreate",
        )
        check(drv.cuEventRecord(event, stream), "cuEventRecord")
        return event

    def _copy_engine_copies(self, rows: list[list[int]], stream: Any) -> None:
        """The copies as one ``cuMemcpyBatchAsync`` (one ``cuMemcpyAsync``
        each with drivers before CUDA 12.8)."""
        drv, check = self._drv, self.backend._check
        batch = getattr(drv, "cuMemcpyBatchAsync", None)
        if rows and batch is not None:
            if self._attrs is None:
                attrs = drv.CUmemcpyAttributes()
                attrs.srcAccessOrder = (
                    drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                )
                self._attrs = [attrs]
            check(
                batch(
                    [drv.CUdeviceptr(r[0]) for r in rows],
                    [drv.CUdeviceptr(r[1]) for r in rows],
                    [r[2] for r in rows],
                    len(rows),
                    self._attrs,
                    [0],
                    1,
                    stream,
                ),
                "cuMemcpyBatchAsync",
            )
        else:
            for dst, src, n in rows:
                check(drv.cuMemcpyAsync(dst, src, n, stream), "cuMemcpyAsync")

    def done(self, event: Any) -> bool:
        """Whether the copies of ``event`` finished (raises if they failed)."""
        drv = self._drv
        err = drv.cuEventQuery(event)[0]
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        self.backend._check((err,), "cuEventQuery")
        return True

    def wait(self, event: Any) -> None:
        self.backend._check(self._drv.cuEventSynchronize(event), "cuEventSynchronize")

    def free(self, event: Any) -> None:
        self.backend._check(self._drv.cuEventDestroy(event), "cuEventDestroy")


def chunk_memory_for(backend: VmmBackend, copy_kernel: bool = True) -> Any:
    """How a reader whose own KV memory is ``backend``'s maps shared chunks
    (``copy_kernel``: see :class:`CudaChunkMemory`)."""
    if backend_kind(backend) == "host":
        return HostChunkMemory()
    return CudaChunkMemory(backend, copy_kernel)


@dataclasses.dataclass
class _Mapped:
    remote_va: int
    nbytes: int
    addr: int
    state: Any
    pins: int = 0
    dropping: bool = False


class ChunkImporter:
    """A reader's side of one producer's channel: maps the chunks it shares,
    drops them when asked, resolves reads against them."""

    def __init__(
        self,
        address: str,
        memory: Any,
        name: str = "",
        identity: tuple[str, str] | None = None,
        connect_timeout_s: float = _CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.memory = memory
        self.kind = "host" if isinstance(memory, HostChunkMemory) else "cuda"
        self.alive = False
        self.error: Exception | None = None
        self._cond = threading.Condition()
        self._mapped: dict[int, _Mapped] = {}
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None = None
        self._send_lock = threading.Lock()
        # Syncs asked for and answered (see sync()).
        self._sync_asked = 0
        self._sync_answered = 0
        boot_id, hostname = identity or host_identity()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(connect_timeout_s)
        try:
            sock.connect(address)
            if (uid := peer_uid(sock)) != os.getuid():
                raise OSError(f"the listener runs as uid {uid}, not ours")
            _send(
                sock,
                {"op": "hello", "boot_id": boot_id, "hostname": hostname, "name": name},
            )
            hello, _ = _recv(sock)
        except (OSError, ValueError) as e:
            sock.close()
            raise SameHostUnavailable(
                f"no same-host channel at {address.lstrip(chr(0))!r}: {e}"
            ) from e
        if hello is None or (hello["boot_id"], hello["hostname"]) != (
            boot_id,
            hostname,
        ):
            sock.close()
            where = (
                "gone"
                if hello is None
                else (f"{hello['hostname']} (boot id {hello['boot_id']})")
            )
            raise SameHostUnavailable(f"the producer is on {where}, not this host")
        if hello.get("kind") not in (None, self.kind):
            sock.close()
            raise SameHostUnavailable(
                f"the producer shares {hello['kind']} memory, this reader "
                f"copies into {self.kind} memory"
            )
        sock.settimeout(None)
        self.sock = sock
        self.alive = True
        self._thread = threading.Thread(
            target=self._loop, name="kv-vmm-same-host-reader", daemon=True
        )
        self._thread.start()
        _count(channels=1)

    # -- channel --------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                msg, fds = _recv(self.sock)
                if msg is None:
                    break
                if msg["op"] == "add":
                    self._map(msg["chunks"], fds)
                elif msg["op"] == "drop":
                    self._drop(msg["ids"])
                    with self._send_lock:
                        _send(self.sock, {"op": "dropped", "ids": msg["ids"]})
                elif msg["op"] == "synced":
                    with self._cond:
                        self._sync_answered = max(self._sync_answered, msg["seq"])
                        self._cond.notify_all()
        except Exception as e:
            self.error = e
            logger.error(
                "Same-host KV channel %r: %s; reads go through NIXL/UCX",
                self.address.lstrip("\0"),
                e,
            )
        # The producer is gone, detached us, or the channel broke: nothing
        # may be read through our mappings any more; drop them (after the
        # copies using them), then close so the producer knows.
        with self._cond:
            self.alive = False
            ids = list(self._mapped)
            self._cond.notify_all()  # syncs waiting
        self._drop(ids)
        self.sock.close()

    def _map(self, rows: list[list[int]], fds: list[int]) -> None:
        try:
            for (chunk_id, remote_va, nbytes, offset), fd in zip(rows, fds):
                addr, state = self.memory.map(fd, offset, nbytes)
                with self._cond:
                    self._mapped[chunk_id] = _Mapped(remote_va, nbytes, addr, state)
                    self._index = None
        finally:
            for fd in fds:
                os.close(fd)

    def _drop(self, ids: Iterable[int]) -> None:
        with self._cond:
            victims = [self._mapped[i] for i in ids if i in self._mapped]
            for m in victims:
                m.dropping = True
            self._index = None
            while any(m.pins for m in victims):
                self._cond.wait()
            for i in ids:
                self._mapped.pop(i, None)
        for m in victims:
            self.memory.unmap(m.addr, m.nbytes, m.state)

    def sync(self, timeout_s: float = _SYNC_TIMEOUT_S) -> bool:
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
                _send(self.sock, {"op": "sync", "seq": seq})
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
    def pin(self, remote_rows: np.ndarray) -> tuple[np.ndarray, list[int]] | None:
        """Local addresses of ``(addr, len, ...)`` rows of the producer's
        memory and the chunks they lie in, pinned (:meth:`unpin`) so a drop
        waits; None unless every row lies inside one mapped chunk."""
        with self._cond:
            if not self.alive:
                return None
            if self._index is None:
                live = sorted(
                    (m.remote_va, m.nbytes, m.addr, i)
                    for i, m in self._mapped.items()
                    if not m.dropping
                )
                self._index = (
                    np.array([r[0] for r in live], dtype=np.uint64),
                    np.array([r[0] + r[1] for r in live], dtype=np.uint64),
                    np.array([r[2] for r in live], dtype=np.uint64),
                    [r[3] for r in live],
                )
            starts, ends, addrs, ids = self._index
            if not len(starts):
                return None
            src = remote_rows[:, 0].astype(np.uint64)
            idx = np.searchsorted(starts, src, side="right").astype(np.int64) - 1
            ok = (idx >= 0) & (
                src + remote_rows[:, 1].astype(np.uint64) <= ends[np.maximum(idx, 0)]
            )
            if not ok.all():
                return None
            used = [ids[i] for i in np.unique(idx).tolist()]
            for i in used:
                self._mapped[i].pins += 1
            return src - starts[idx] + addrs[idx], used

    def unpin(self, ids: list[int]) -> None:
        with self._cond:
            for i in ids:
                self._mapped[i].pins -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Drop everything and close the channel (the producer sees EOF)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=30)


def coalesce(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``(dst, src, n)`` copy runs: rows adjacent on both sides merged."""
    order = np.lexsort((dst, src))
    dst, src, lengths = dst[order], src[order], lengths[order]
    if len(dst) == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    ends_d = dst + lengths
    ends_s = src + lengths
    new_run = np.ones(len(dst), dtype=bool)
    new_run[1:] = (dst[1:] != ends_d[:-1]) | (src[1:] != ends_s[:-1])
    starts = np.flatnonzero(new_run)
    run_len = np.add.reduceat(lengths, starts)
    return np.stack([dst[starts], src[starts], run_len], axis=1).astype(np.uint64)


@dataclasses.dataclass
class XferTelemetry:
    """What NixlConnector's stats read from a finished transfer (the fields
    of NIXL's ``nixlXferTelemetry``, times in microseconds)."""

    startTime: int
    postDuration: int
    xferDuration: int
    totalBytes: int
    descCount: int


class SameHostXfer:
    """A read done as a local copy; a transfer handle of the connector."""

    def __init__(
        self,
        importer: ChunkImporter,
        runs: np.ndarray,
        pinned: list[int],
        remote_agent: str,
        notif_msg: bytes,
        desc_count: int,
    ) -> None:
        self.importer = importer
        self.runs = runs
        self.pinned = pinned
        self.remote_agent = remote_agent
        self.notif_msg = notif_msg
        self.desc_count = desc_count
        self.total_bytes = int(runs[:, 2].sum()) if len(runs) else 0
        self.future: Future[None] | None = None
        # Memory that copies asynchronously (CudaChunkMemory): the copies'
        # event, until they finished and the chunks were unpinned.
        self.event: Any = None
        self._finished = False
        self.error: Exception | None = None
        self.notified = False
        self.reported = False
        self.released = False
        self._created = time.perf_counter()
        self._posted = 0.0
        self._done = 0.0

    def run(self) -> None:
        """Copy on this thread (memory without ``copy_async``); raises what
        the read failed with."""
        self._posted = time.perf_counter()
        try:
            self.importer.memory.copy(self.runs)
        finally:
            self._finish()
        if self.error is not None:
            raise self.error

    def start(self) -> None:
        """Enqueue the copies (memory with ``copy_async``); :meth:`state`
        completes them."""
        self._posted = time.perf_counter()
        try:
            self.event = self.importer.memory.copy_async(self.runs)
        except Exception as e:
            self.error = e
            self._finish()

    def _finish(self) -> None:
        """The copies are over: free the event, unpin the chunks; the read
        failed if the producer went away (or detached us) meanwhile."""
        if self._finished:
            return
        self._finished = True
        self._done = time.perf_counter()
        try:
            if self.event is not None:
                self.importer.memory.free(self.event)
        finally:
            self.importer.unpin(self.pinned)
        if self.error is None and not self.importer.alive:
            self.error = VmmError(
                f"same-host read from {self.remote_agent}: the producer's "
                "channel closed before the copy finished"
            )

    def wait(self) -> None:
        """Block until enqueued copies are over (before giving up the read)."""
        if self.event is not None and not self._finished:
            try:
                self.importer.memory.wait(self.event)
            except Exception as e:
                self.error = self.error or e
            self._finish()

    def state(self) -> str:
        """NIXL's state names, without notifying."""
        if self.error is not None:
            return "ERR"
        if self.event is not None:
            if not self._finished:
                try:
                    if not self.importer.memory.done(self.event):
                        return "PROC"
                except Exception as e:
                    self.error = e
                self._finish()
            return "ERR" if self.error is not None else "DONE"
        if self.future is None or not self.future.done():
            return "PROC"
        return "ERR" if self.future.exception() is not None else "DONE"

    def telemetry(self) -> XferTelemetry:
        return XferTelemetry(
            startTime=int(self._created * 1e6),
            postDuration=int(max(0.0, self._posted - self._created) * 1e6),
            xferDuration=int(max(0.0, self._done - self._posted) * 1e6),
            totalBytes=self.total_bytes,
            descCount=self.desc_count,
        )


def _key(agent_name: str | bytes) -> str:
    return agent_name.decode() if isinstance(agent_name, bytes) else agent_name


class SameHostReads:
    """A reader's same-host channels, one per producer agent, and the reads
    that run over them.

    Args:
        memory: how shared chunks are mapped and copied into our memory
            (:func:`chunk_memory_for` of our backend).
        name: our agent name (the producers log it).
        address_of: the channel address of a producer agent.
        connect_timeout_s: how long opening a channel may take.
        retry_after_s: a channel that timed out (a busy producer) is tried
            again, in the background, by the first read from the peer this
            long after; one refused for good (no listener, another host or
            user) is not.
        quiet_if_absent: a peer with no channel at all (not VMM-backed, or
            on another host) is logged at debug level only: a reader with
            stock KV tensors asks every peer.

    """

    def __init__(
        self,
        memory: Any,
        name: str = "",
        address_of: Callable[[str], str] = channel_address,
        identity: tuple[str, str] | None = None,
        connect_timeout_s: float = _CONNECT_TIMEOUT_S,
        retry_after_s: float = 30.0,
        quiet_if_absent: bool = False,
    ) -> None:
        self.memory = memory
        self.name = name
        self.address_of = address_of
        self.identity = identity
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self.quiet_if_absent = quiet_if_absent
        self._lock = threading.Lock()
        self._importers: dict[str, ChunkImporter] = {}
        # Peer -> (why its channel is not open, when a retry is due or None).
        self._unavailable: dict[str, tuple[str, float | None]] = {}
        self._retrying: set[str] = set()
        self._executor: ThreadPoolExecutor | None = None

    def connect(self, agent_name: str) -> bool:
        """Open the channel to a producer agent (after a handshake with it);
        False, with a warning naming the reason once, if it cannot be."""
        with self._lock:
            current = self._importers.get(_key(agent_name))
            if current is not None and current.alive:
                return True
        try:
            importer = ChunkImporter(
                self.address_of(agent_name),
                self.memory,
                self.name,
                self.identity,
                self.connect_timeout_s,
            )
        except Exception as e:
            # Never fails the handshake: NIXL/UCX reads work without it.
            timed_out = isinstance(e.__cause__, TimeoutError)
            retry = time.monotonic() + self.retry_after_s if timed_out else None
            with self._lock:
                previous = self._unavailable.get(_key(agent_name))
                first = previous is None or previous[0] != str(e)
                self._unavailable[_key(agent_name)] = (str(e), retry)
            absent = isinstance(
                e.__cause__, (ConnectionRefusedError, FileNotFoundError)
            )
            if first and absent and self.quiet_if_absent:
                logger.debug("KV reads from %s go through NIXL/UCX: %s", agent_name, e)
            elif first:
                logger.warning(
                    "KV reads from %s go through NIXL/UCX: %s", agent_name, e
                )
            return False
        with self._lock:
            self._importers[_key(agent_name)] = importer
            self._unavailable.pop(_key(agent_name), None)
        logger.info("KV reads from %s use the same-host path", agent_name)
        return True

    def _retry_if_due(self, agent_name: str) -> None:
        """Open a channel that timed out again, in the background."""
        key = _key(agent_name)
        with self._lock:
            failed = self._unavailable.get(key)
            if (
                failed is None
                or failed[1] is None
                or time.monotonic() < failed[1]
                or key in self._retrying
            ):
                return
            self._retrying.add(key)

        def retry() -> None:
            try:
                self.connect(agent_name)
            finally:
                with self._lock:
                    self._retrying.discard(key)

        threading.Thread(
            target=retry, name="kv-vmm-same-host-retry", daemon=True
        ).start()

    def importer(self, agent_name: str) -> ChunkImporter | None:
        with self._lock:
            return self._importers.get(_key(agent_name))

    def disconnect(self, agent_name: str) -> None:
        with self._lock:
            importer = self._importers.pop(_key(agent_name), None)
        if importer is not None:
            importer.close()

    def make_read(
        self,
        agent_name: str,
        local_rows: np.ndarray,
        remote_rows: np.ndarray,
        notif_msg: bytes,
    ) -> SameHostXfer | None:
        """A read of ``remote_rows`` of the producer into ``local_rows`` as a
        local copy, or None (go through NIXL) unless every remote row lies in
        a chunk the producer shares with us now."""
        importer = self.importer(agent_name)
        if importer is None or not importer.alive:
            self._retry_if_due(agent_name)
            return None
        pinned = importer.pin(remote_rows)
        if pinned is None and importer.sync():
            pinned = importer.pin(remote_rows)
        if pinned is None:
            _count(fallbacks=1)
            return None
        src, ids = pinned
        lengths = local_rows[:, 1].astype(np.uint64)
        if not np.array_equal(lengths, remote_rows[:, 1].astype(np.uint64)):
            importer.unpin(ids)
            raise VmmError("same-host read: local and remote descriptor sizes differ")
        runs = coalesce(local_rows[:, 0].astype(np.uint64), src, lengths)
        return SameHostXfer(importer, runs, ids, agent_name, notif_msg, len(local_rows))

    def transfer(self, xfer: SameHostXfer) -> str:
        if hasattr(xfer.importer.memory, "copy_async"):
            xfer.start()
            return xfer.state()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kv-vmm-same-host-copy"
            )
        xfer.future = self._executor.submit(xfer.run)
        return xfer.state()

    def check(self, xfer: SameHostXfer, send_notif: Callable[[str, bytes], Any]) -> str:
        """The transfer's state; once the copy is done, the producer is
        notified (on the caller's thread, like NIXL's own calls)."""
        state = xfer.state()
        if state == "DONE" and not xfer.notified:
            xfer.notified = True
            if xfer.notif_msg:
                try:
                    send_notif(xfer.remote_agent, xfer.notif_msg)
                except Exception as e:
                    xfer.error = e
                    state = "ERR"
            if state == "DONE":
                _count(reads=1, bytes=xfer.total_bytes)
        if state == "ERR" and not xfer.reported:
            xfer.reported = True
            error = xfer.error or (xfer.future.exception() if xfer.future else None)
            logger.warning(
                "Same-host KV read from %s failed: %s", xfer.remote_agent, error
            )
        return state

    def release(self, xfer: SameHostXfer) -> None:
        if xfer.event is not None:
            xfer.wait()  # the chunks stay pinned until the copies are over
        elif xfer.future is None and not xfer._finished and not xfer.released:
            xfer.importer.unpin(xfer.pinned)  # never started
        if xfer.state() == "ERR" and not xfer.released:
            _count(failed=1)
        xfer.released = True

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:
            importers = list(self._importers.values())
            self._importers.clear()
        for importer in importers:
            importer.close()
