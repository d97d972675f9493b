# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-host path of NixlConnector over VMM-backed KV memory.

:class:`SameHostReads` keeps a reader's channels, one per producer agent,
and turns a READ whose remote rows all lie in chunks a producer shares now
into a :class:`SameHostXfer` (a local copy with NIXL's handle, completion
and notification semantics); anything else goes to NIXL/UCX, counted by
reason (:mod:`.stats`). :class:`SameHostPath` is what the connector hands
:class:`~.worker.NixlVmmWorker` to take this path (:func:`same_host_path`):
it shares our chunks with same-host readers (:class:`~.exporter.ChunkExporter`)
and sets the reads up.
"""

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import channel
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
    SameHostUnavailable,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
    Copier,
    CopyJob,
    Runs,
    copier_for,
    repeated,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
    ChunkExporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.importer import (
    ChunkImporter,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
    STATS,
    Fallback,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    IN_FLIGHT,
    Descs,
    LocalReads,
    XferHandle,
    nixl_errors,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.worker import (
    SameHostHook,
)
from vllm.logger import init_logger
from vllm.v1.kv_vmm.backend import VmmBackend, VmmError
from vllm.v1.kv_vmm.host import HostVmmBackend
from vllm.v1.kv_vmm.page_table import KVPageTable

logger = init_logger(__name__)

#: Why a channel did not open that a later try may mend (the producer was
#: busy); any other reason stands until the next NIXL handshake.
_RETRIED = frozenset((Fallback.TIMEOUT, Fallback.BUSY))

# kv_connector_extra_config key: whether reads of a same-host peer's
# VMM-backed KV go through the shared-memory path.
SAME_HOST_KEY = "vmm_same_host"


def same_host_reads_enabled(kv_transfer_config: Any) -> bool:
    """``kv_connector_extra_config["vmm_same_host"]``, true by default: false
    leaves every read of VMM-backed KV to NIXL/UCX (e.g. to compare the two
    paths, or where a host's policy forbids passing memory between
    processes)."""
    value = kv_transfer_config.get_from_extra_config(SAME_HOST_KEY, True)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(
            f"kv_connector_extra_config[{SAME_HOST_KEY!r}] must be true or "
            f"false, got {value!r}"
        )
    return value


def _same_lengths(
    local: Descs,
    local_indices: np.ndarray,
    remote: Descs,
    remote_indices: np.ndarray,
) -> tuple[np.ndarray, int | None]:
    """The bytes of each copy of a read, and the length all have where both
    lists' descriptors have one (else None); raises :class:`VmmError` unless
    both sides' descriptors have the same lengths (compared per descriptor
    only where a list's lengths differ)."""
    length = local.uniform_length
    if length is not None and length == remote.uniform_length:
        return repeated(length, len(local_indices)), length
    local_lengths = np.take(local.lengths, local_indices)
    if not np.array_equal(local_lengths, np.take(remote.lengths, remote_indices)):
        raise VmmError("same-host read: local and remote descriptor sizes differ")
    return local_lengths, None


@dataclasses.dataclass
class XferTelemetry:
    """What NixlConnector's stats read from a finished transfer (the fields
    of NIXL's ``nixlXferTelemetry``, times in microseconds)."""

    startTime: int
    postDuration: int
    xferDuration: int
    totalBytes: int
    descCount: int


@dataclasses.dataclass(eq=False)
class SameHostXfer(XferHandle):
    """A read done as a local copy out of a producer's shared chunks. The
    chunks stay pinned (a drop waits) until the copies are over; once they
    are, a poll sends the request's notification to the producer through
    NIXL (``notify``, on the polling thread, as NIXL would after a READ)."""

    importer: ChunkImporter
    copier: Copier
    #: The copies, one per descriptor of the read.
    runs: Runs
    #: The importer's pin of the chunks the copies read from.
    pinned: int
    #: The producer as NIXL names it (the notification goes through NIXL).
    remote_agent: str | bytes
    notif_msg: bytes
    notify: Callable[[str | bytes, bytes], Any]
    desc_count: int

    def __post_init__(self) -> None:
        self.total_bytes = self.runs.total_bytes
        self.job: CopyJob | None = None
        self.error: Exception | None = None
        self._finished = self._notified = self._reported = self._released = False
        # perf_counter() when it was made, posted and over (telemetry).
        self._created, self._posted, self._done = time.perf_counter(), 0.0, 0.0

    def post(self, *args: Any, **kwargs: Any) -> str:
        """Start the copies (the notification was given at creation). A read
        whose copies are over at once (host copies, or a device that was
        quick) is done as NIXL's would be: notified and counted now, since a
        caller told "DONE" need not poll it again."""
        self._posted = time.perf_counter()
        try:
            self.job = self.copier.submit(self.runs)
        except VmmError as e:
            self.error = e
            self._finish()
        return self.check()

    def _finish(self) -> None:
        """The copies are over: unpin the chunks; the read failed if the
        producer went away (or detached us) meanwhile."""
        if self._finished:
            return
        self._finished = True
        self._done = time.perf_counter()
        try:
            if self.job is not None:
                self.job.free()
        finally:
            self.importer.unpin(self.pinned)
        if self.error is None and not self.importer.alive:
            self.error = VmmError(
                f"same-host read from {self.importer.producer}: the producer's "
                "channel closed before the copy finished"
            )

    def state(self) -> str:
        if self.job is None:
            return "ERR" if self.error is not None else IN_FLIGHT
        if not self._finished:
            try:
                if not self.job.done():
                    return IN_FLIGHT
            except VmmError as e:
                self.error = e
            self._finish()
        return "ERR" if self.error is not None else "DONE"

    def check(self) -> str:
        state = self.state()
        if state == "DONE" and not self._notified:
            self._notified = True
            if self.notif_msg:
                try:
                    self.notify(self.remote_agent, self.notif_msg)
                except nixl_errors() as e:
                    self.error = e
                    state = "ERR"
            if state == "DONE":
                STATS.count(reads=1, bytes=self.total_bytes)
        if state == "ERR" and not self._reported:
            self._reported = True
            logger.warning(
                "Same-host KV read from %s failed: %s",
                self.importer.producer,
                self.error,
            )
        return state

    def telemetry(self) -> XferTelemetry:
        return XferTelemetry(
            startTime=int(self._created * 1e6),
            postDuration=int(max(0.0, self._posted - self._created) * 1e6),
            xferDuration=int(max(0.0, self._done - self._posted) * 1e6),
            totalBytes=self.total_bytes,
            descCount=self.desc_count,
        )

    def release(self) -> None:
        """The chunks stay pinned until the copies are over (a read given up
        in flight waits for them)."""
        if self._released:
            return
        self._released = True
        if self.job is not None and not self._finished:
            try:
                self.job.wait()
            except VmmError as e:
                self.error = self.error or e
        self._finish()
        if self.error is not None:
            STATS.count(failed=1)


@dataclasses.dataclass(eq=False)
class SameHostReads(LocalReads):
    """A reader's same-host channels, one per producer agent, and the reads
    that run over them.

    Args:
        backend: our VMM backend: maps the chunks producers share.
        copier: copies out of them into our KV memory
            (:func:`~.copies.copier_for` our backend).
        name: our agent name (part of the proofs; producers log it).
        address_of: the channel address of a producer agent (tests).
        identity: our ``(boot id, hostname)`` (tests).
        connect_timeout_s: how long opening a channel may take.
        retry_after_s: a channel that timed out or that the producer closed
            in its handshake (a busy producer, on either side) is tried again
            in the background this long after, then after twice as long each
            time it fails so again, up to ``retry_max_s``, until it opens or
            the peer is disconnected; one refused for good (no listener,
            another host or user, a failed proof) is not.
        retry_max_s: the longest wait between two tries of a channel.
        quiet_if_absent: a peer with no channel at all (it offers none, or
            is on another host) is logged at debug level only: a reader
            with stock KV tensors asks every peer.

    """

    backend: VmmBackend
    copier: Copier
    name: str
    address_of: Callable[[str], str] = channel.channel_address
    identity: tuple[str, str] | None = None
    connect_timeout_s: float = channel.CONNECT_TIMEOUT_S
    retry_after_s: float = 1.0
    retry_max_s: float = 30.0
    quiet_if_absent: bool = False

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._secrets: dict[str, bytes] = {}
        self._importers: dict[str, ChunkImporter] = {}
        # Peer -> why its channel is not open.
        self._unavailable: dict[str, SameHostUnavailable] = {}
        # Peer -> the wait before its next retry (doubles per timeout), and
        # the timer of the retry due.
        self._retry_delay: dict[str, float] = {}
        self._timers: dict[str, threading.Timer] = {}
        self._closed = False

    def offer(self, agent_name: str | bytes, secret: bytes) -> bool:
        """A NIXL handshake with ``agent_name`` brought its same-host
        ``secret`` (empty: it offers no channel): open the channel. False,
        counted and logged once per reason, if it cannot be. (NIXL names
        remote agents in bytes, its own in str: both are the same peer.)"""
        agent_name = os.fsdecode(agent_name)
        with self._lock:
            self._secrets[agent_name] = secret
        return self._connect(agent_name)

    def _connect(self, agent_name: str) -> bool:
        with self._lock:
            current = self._importers.get(agent_name)
            if current is not None and current.alive:
                return True
            secret = self._secrets.get(agent_name, b"")
        try:
            if not secret:
                raise SameHostUnavailable(
                    Fallback.UNSHARED,
                    "no same-host channel: the peer shares no KV memory on this "
                    "host (stock KV tensors, or its same-host path is off)",
                )
            importer = ChunkImporter(
                agent_name,
                secret,
                self.backend,
                self.name,
                address=self.address_of(agent_name),
                identity=self.identity,
                connect_timeout_s=self.connect_timeout_s,
            )
        except SameHostUnavailable as e:
            # Never fails the handshake: NIXL/UCX reads work without it.
            self._unavailable_now(agent_name, e)
            return False
        with self._lock:
            closed = self._closed
            # A handshake's offer and a retry may both have connected.
            current = self._importers.get(agent_name)
            spare = closed or (current is not None and current.alive)
            if not spare:
                self._importers[agent_name] = importer
                self._unavailable.pop(agent_name, None)
                self._retry_delay.pop(agent_name, None)
        if spare:
            importer.close()
            return not closed
        logger.info("KV reads from %s use the same-host path", agent_name)
        return True

    def _unavailable_now(self, agent_name: str, error: SameHostUnavailable) -> None:
        with self._lock:
            self._unavailable[agent_name] = error
            if error.reason in _RETRIED and not self._closed:
                delay = self._retry_delay.get(agent_name, self.retry_after_s)
                self._retry_delay[agent_name] = min(2 * delay, self.retry_max_s)
                previous = self._timers.get(agent_name)
                if previous is not None:
                    previous.cancel()
                timer = threading.Timer(delay, self._retry)
                timer.args = (agent_name, timer)
                timer.name, timer.daemon = "kv-vmm-same-host-retry", True
                self._timers[agent_name] = timer
                timer.start()
        STATS.fallback(agent_name, error.reason, error, quiet=self._quiet(error.reason))

    def has_channel(self, agent_name: str | bytes) -> bool:
        """Whether reads from ``agent_name`` may use the same-host path."""
        importer = self.importer(agent_name)
        return importer is not None and importer.alive

    def _retry(self, agent_name: str, timer: threading.Timer) -> None:
        """A busy producer's channel tried again, in its timer's thread (nothing if the
        peer was disconnected, another timer replaced this one, or we closed
        meanwhile)."""
        with self._lock:
            if self._closed or self._timers.get(agent_name) is not timer:
                return
            del self._timers[agent_name]
        self._connect(agent_name)

    def retry_due(self, agent_name: str | bytes) -> bool:
        """Whether a channel a busy producer did not open will be tried
        again."""
        with self._lock:
            return os.fsdecode(agent_name) in self._timers

    def importer(self, agent_name: str | bytes) -> ChunkImporter | None:
        with self._lock:
            return self._importers.get(os.fsdecode(agent_name))

    def disconnect(self, agent_name: str | bytes) -> None:
        agent_name = os.fsdecode(agent_name)
        with self._lock:
            importer = self._importers.pop(agent_name, None)
            self._secrets.pop(agent_name, None)
            self._unavailable.pop(agent_name, None)
            self._retry_delay.pop(agent_name, None)
            timer = self._timers.pop(agent_name, None)
        if timer is not None:
            timer.cancel()
        if importer is not None:
            importer.close()

    def make_read(
        self,
        agent_name: str | bytes,
        local: Descs,
        local_indices: np.ndarray,
        remote: Descs,
        remote_indices: np.ndarray,
        notif_msg: bytes,
        notify: Callable[[str | bytes, bytes], Any],
    ) -> SameHostXfer | None:
        """A read of the producer's descriptors ``remote_indices`` of
        ``remote`` into our ``local_indices`` of ``local`` as a local copy,
        or None (go through NIXL, counted) unless every remote descriptor
        lies in a chunk the producer shares with us now. ``notify`` sends
        the read's notification to the producer (by ``agent_name``)."""
        importer = self.importer(agent_name)
        if importer is None or not importer.alive:
            self._fell_back(os.fsdecode(agent_name), importer)
            return None
        if len(local_indices) != len(remote_indices):
            raise VmmError(
                f"same-host read of {len(remote_indices)} descriptors into "
                f"{len(local_indices)}: the two sides must list as many"
            )
        pinned = importer.pin(remote, remote_indices)
        if pinned is None and importer.sync():
            pinned = importer.pin(remote, remote_indices)
        if pinned is None:
            STATS.fallback(
                importer.producer,
                Fallback.NOT_SHARED,
                f"a read of {len(remote_indices)} blocks lies outside the chunks "
                "the producer shares now",
            )
            return None
        src, generation = pinned
        try:
            lengths, length = _same_lengths(
                local, local_indices, remote, remote_indices
            )
        except VmmError:
            importer.unpin(generation)
            raise
        # Both lists' alignments are known once per list, and the chunks'
        # places here keep the producer's: the copies' is known per read
        # without looking at them.
        runs = Runs(
            local.addrs.take(local_indices),
            src,
            lengths,
            uniform_nbytes=length,
            alignment=min(local.alignment, remote.alignment, importer.alignment),
        )
        return SameHostXfer(
            importer,
            self.copier,
            runs,
            generation,
            agent_name,
            notif_msg,
            notify,
            len(local_indices),
        )

    def _fell_back(self, agent_name: str, importer: ChunkImporter | None) -> None:
        """A read from a peer without an open channel: counted with the
        reason the channel is not open."""
        if importer is not None:
            reason = Fallback.CLOSED
            detail: object = importer.error or "the producer closed the channel"
        else:
            with self._lock:
                failed = self._unavailable.get(agent_name)
            if failed is None:
                reason, detail = Fallback.UNSHARED, "no NIXL handshake offered one"
            else:
                reason, detail = failed.reason, failed
        STATS.fallback(agent_name, reason, detail, quiet=self._quiet(reason))

    def _quiet(self, reason: Fallback) -> bool:
        """Whether a fallback is only worth a debug line (see quiet_if_absent)."""
        return self.quiet_if_absent and reason in (
            Fallback.UNSHARED,
            Fallback.UNREACHABLE,
        )

    def close(self) -> None:
        self.copier.close()
        with self._lock:
            self._closed = True
            importers = list(self._importers.values())
            self._importers.clear()
            timers = list(self._timers.values())
            self._timers.clear()
        for timer in timers:
            timer.cancel()
        for importer in importers:
            importer.close()


class SameHostPath(SameHostHook):
    """The same-host path of one connector worker (agent ``agent_name``):
    our chunks shared with same-host readers, and the reads of same-host
    peers' chunks."""

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.exporter: ChunkExporter | None = None
        self.reads: SameHostReads | None = None
        # A backend of our own to map peers' chunks (stock KV tensors).
        self._reader_backend: VmmBackend | None = None

    def share(self, page_table: KVPageTable) -> SameHostReads | None:
        """Offer our chunks to same-host readers (attached before the NIXL
        registry, so its checks run first under the page table's lock) and
        get ready to read same-host peers' chunks."""
        backend = page_table.backend
        try:
            self.exporter = ChunkExporter(self.agent_name, channel.new_secret())
            self.exporter.attach(page_table)
            self.reads = SameHostReads(backend, copier_for(backend), self.agent_name)
        except (OSError, VmmError) as e:
            STATS.fallback("every peer", Fallback.SETUP, f"no same-host path ({e})")
            if self.exporter is not None:
                self.exporter.close()
                self.exporter = None
        return self.reads

    def read_only(self, mem_type: str, device_id: int) -> SameHostReads | None:
        """Stock KV tensors: reads of same-host VMM-backed peers' chunks,
        mapped by a backend of our own (None: they go through NIXL/UCX)."""
        backend: VmmBackend
        try:
            if mem_type == "DRAM":
                backend = HostVmmBackend()
            else:
                from vllm.v1.kv_vmm.cuda import CudaVmmBackend

                backend = CudaVmmBackend(device_id)
            self.reads = SameHostReads(
                backend, copier_for(backend), self.agent_name, quiet_if_absent=True
            )
        except (ImportError, OSError, ValueError, VmmError) as e:
            STATS.fallback(
                "every peer", Fallback.SETUP, f"stock KV cache, no reader ({e})", True
            )
            return None
        self._reader_backend = backend
        return self.reads

    @property
    def secret(self) -> bytes:
        return self.exporter.secret if self.exporter is not None else b""

    def offer(self, agent_name: str, secret: bytes) -> None:
        if self.reads is not None:
            self.reads.offer(agent_name, secret)

    def disconnect(self, agent_name: str) -> None:
        if self.reads is not None:
            self.reads.disconnect(agent_name)

    def close(self) -> None:
        if self.reads is not None:
            self.reads.close()
        if self.exporter is not None:
            self.exporter.close()
        if self._reader_backend is not None:
            self._reader_backend.close()


def same_host_path(kv_transfer_config: Any, agent_name: str) -> SameHostPath | None:
    """The same-host path of the connector worker whose agent is
    ``agent_name``, unless the connector's config turns it off
    (:func:`same_host_reads_enabled`)."""
    if not same_host_reads_enabled(kv_transfer_config):
        return None
    return SameHostPath(agent_name)
