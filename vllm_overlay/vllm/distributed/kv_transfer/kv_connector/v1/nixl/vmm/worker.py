# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NixlConnector's worker-side state for VMM-backed KV memory.

What the connector keeps beside its stock state when the model runner hands
it the KV page table (``--kv-cache-memory-backend vmm``), independent of the
vLLM release; the connector calls in at its registration, handshake,
publication and read paths (:class:`NixlVmmWorker`):

- with the page table: registers the KV memory per physical chunk of each
  mapped segment (:class:`~.registry.NixlSegmentRegistry`) and wraps the
  NIXL agent so descriptor lists are resolved per transfer
  (:class:`~.agent.SegmentedXferAgent`);
- republishes the handshake payload when the registrations changed;
- with or without it: keeps VMM-backed peers' registrations current: a
  request names the registration epoch its peer had when it finished the
  request, and a reader whose copy of the peer's agent metadata is older
  fetches it again from the peer's side channel *in the background* before
  the read (``catch_up``). The read waits for the fetch like a request waits
  for a handshake; a fetch that fails (or times out) fails the request like
  a failed handshake does.

Reads of same-host peers through shared memory plug in through
:class:`SameHostHook`, which the connector passes in where it takes that path
(:mod:`.same_host`).
"""

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent import (
    SegmentedXferAgent,
    StockKVXferAgent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.registry import (
    NixlSegmentRegistry,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    LocalReads,
)
from vllm.logger import init_logger
from vllm.v1.kv_vmm.page_table import KVPageTable

logger = init_logger(__name__)

# How long a background fetch of a peer's agent metadata waits for the reply
# (the stock handshake's wait), and how many times it is tried before the
# reads waiting for it fail: a busy peer's side channel can answer late, and
# unlike the handshake a peer is fetched again at every registration change.
FETCH_TIMEOUT_S = 5.0
FETCH_ATTEMPTS = 3


class SameHostHook(ABC):
    """Reads of same-host peers' KV through shared memory, and ours shared
    with same-host readers: what :class:`NixlVmmWorker` takes from the
    connector where that path is on (:class:`~.same_host.SameHostPath`)."""

    @abstractmethod
    def share(self, page_table: KVPageTable) -> LocalReads | None:
        """VMM-backed KV: offer the page table's chunks to same-host readers
        (called before the NIXL registry attaches to it) and read same-host
        peers; the reads, or None where the path could not be set up."""

    @abstractmethod
    def read_only(self, mem_type: str, device_id: int) -> LocalReads | None:
        """Stock KV tensors of ``mem_type``: the reads of same-host
        VMM-backed peers, or None (they go through NIXL/UCX)."""

    @property
    @abstractmethod
    def secret(self) -> bytes:
        """What our handshake metadata carries so that same-host readers can
        prove they are our NIXL peers (empty: we share nothing)."""

    @abstractmethod
    def offer(self, agent_name: str, secret: bytes) -> None:
        """A handshake with ``agent_name`` brought its ``secret``."""

    @abstractmethod
    def disconnect(self, agent_name: str) -> None:
        """Forget the peer ``agent_name`` (a new handshake follows)."""

    @abstractmethod
    def close(self) -> None:
        """Stop sharing and reading."""


def fetch_agent_metadata(path: str, request: bytes, timeout_s: float) -> bytes:
    """A peer's current NIXL agent metadata, from its side channel.

    ``request`` is the release's encoded GET_META_MSG for the peer's rank.
    Blocks for up to ``timeout_s``: call it off the transfer path.
    """
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        if path.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(path)
        sock.send(request)
        reply = sock.recv_multipart()[0]
    # NixlHandshakePayload wrapping NixlAgentMetadata (msgpack maps in every
    # release); only the NIXL agent metadata is needed.
    payload = msgspec.msgpack.decode(reply)
    return msgspec.msgpack.decode(payload["agent_metadata_bytes"])["agent_metadata"]


def _failure(fut: "Future[bytes]") -> Exception | None:
    """Why a finished fetch failed, or None."""
    if fut.cancelled():
        return CancelledError("the fetch was cancelled (connector shut down)")
    error = fut.exception()
    if error is None or isinstance(error, Exception):
        return error
    return RuntimeError(f"the fetch ended with {error!r}")


class NixlVmmWorker:
    """Worker-side NixlConnector state for VMM-backed KV memory, ours
    (``page_table``, set when the model runner hands it over) and peers'.

    Args:
        agent: the connector's ``nixl_agent``.
        fetch: ``(path, request, timeout_s) -> agent metadata`` of a peer;
            :func:`fetch_agent_metadata` unless a test replaces it.
        fetch_timeout_s: how long one attempt of a background fetch may take.
        fetch_attempts: attempts of a fetch before the reads waiting for it
            fail.
        same_host_path: shares our chunks with same-host readers and reads
            theirs through shared memory (None: every read goes through
            NIXL/UCX).

    """

    def __init__(
        self,
        agent: Any,
        fetch: Callable[[str, bytes, float], bytes] = fetch_agent_metadata,
        fetch_timeout_s: float = FETCH_TIMEOUT_S,
        fetch_attempts: int = FETCH_ATTEMPTS,
        same_host_path: SameHostHook | None = None,
    ) -> None:
        self.page_table: KVPageTable | None = None
        self.registry: NixlSegmentRegistry | None = None
        # Same-host path, where the connector takes it, and its reads.
        self.same_host_path = same_host_path
        self.same_host: LocalReads | None = None
        # The connector's agent; a SegmentedXferAgent once ours registers.
        self.agent = agent
        self._fetch = fetch
        self.fetch_timeout_s = fetch_timeout_s
        self.fetch_attempts = max(fetch_attempts, 1)
        # Registration generation and agent metadata of the published payload.
        self._published_generation = 0
        self._agent_metadata: Any = None
        # Peer agent name -> (side channel path, encoded GET_META_MSG).
        self._side_channels: dict[str, tuple[str, bytes]] = {}
        # Peer agent name -> the registration epoch our copy of it is at.
        self._epochs: dict[str, int] = {}
        # Peer agent name -> (epoch it was fetched for, the fetch), until
        # what it fetched is loaded.
        self._fetches: dict[str, tuple[int, Future[bytes]]] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    # -- our registrations ------------------------------------------------
    def register(
        self,
        mem_types: Iterable[str],
        use_host_buffer: bool,
        ranges: Iterable[tuple[int, int]],
        device_id: int,
        backends: list[str] | None = None,
    ) -> SegmentedXferAgent:
        """Register the page table's mapped segments (and the segments mapped
        later) instead of the KV tensors' storage; returns the agent the
        connector uses from now on.

        ``ranges`` are the (start, end) byte ranges the connector would have
        registered; they must lie inside the page table's reservations.
        """
        assert self.page_table is not None
        kinds = sorted(set(mem_types))
        if len(kinds) != 1 or use_host_buffer:
            raise NotImplementedError(
                "VMM-backed KV memory with NixlConnector needs the KV cache "
                "registered directly (one memory type, no host transfer "
                f"buffer); got memory types {kinds}, "
                f"use_host_buffer={use_host_buffer}. Use "
                "--kv-cache-memory-backend default for this configuration."
            )
        reservations = self._reservations()
        outside = [
            (start, end)
            for start, end in ranges
            if not any(lo <= start and end <= hi for lo, hi in reservations)
        ]
        if outside:
            raise NotImplementedError(
                "KV cache tensors outside the VMM reservations "
                f"{[(hex(lo), hex(hi)) for lo, hi in reservations]}: {outside}. "
                "Use --kv-cache-memory-backend default for this model."
            )
        mem_type = kinds[0]
        if self.same_host_path is not None:
            self.same_host = self.same_host_path.share(self.page_table)
        self.registry = NixlSegmentRegistry(
            self.agent,
            mem_type,
            0 if mem_type == "DRAM" else device_id,
            backends=backends,
        )
        self.registry.attach(self.page_table)
        self.agent = SegmentedXferAgent(
            self.agent,
            self.registry,
            refresh_remote=self._refresh_in_background,
            same_host=self.same_host,
        )
        logger.info(
            "VMM-backed KV cache: NIXL registers %d physical chunks now and "
            "follows segment maps/unmaps",
            len(self.registry.registered_ranges),
        )
        return self.agent

    def read_same_host(
        self, mem_types: Iterable[str], use_host_buffer: bool, device_id: int
    ) -> Any:
        """Stock KV tensors: reads of a same-host VMM-backed peer's KV become
        local copies out of the chunks it shares (:class:`StockKVXferAgent`);
        returns the agent the connector uses from now on (the same one where
        that cannot be: the reads then go through NIXL/UCX)."""
        kinds = sorted(set(mem_types))
        if self.same_host_path is None or use_host_buffer or len(kinds) != 1:
            return self.agent
        self.same_host = self.same_host_path.read_only(kinds[0], device_id)
        if self.same_host is None:
            return self.agent
        self.agent = StockKVXferAgent(
            self.agent,
            refresh_remote=self._refresh_in_background,
            same_host=self.same_host,
        )
        return self.agent

    @property
    def same_host_secret(self) -> bytes:
        """What our NIXL handshake metadata carries so that its readers can
        prove they are our peers on the same-host channel (empty: we share
        nothing)."""
        if self.same_host_path is None:
            return b""
        return self.same_host_path.secret

    def offer_same_host(self, agent_name: str, secret: bytes) -> None:
        """The handshake with the peer ``agent_name`` brought its same-host
        ``secret`` (empty when it shares nothing): open the channel before
        the connector prepares the peer's descriptors, so a reader with
        stock KV tensors keeps them for same-host reads."""
        if self.same_host_path is not None:
            self.same_host_path.offer(agent_name, secret)

    def _reservations(self) -> list[tuple[int, int]]:
        """The page table's reservations, adjacent ones merged."""
        assert self.page_table is not None
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + nbytes)
            for t, nbytes in zip(
                self.page_table.tensors, self.page_table.geometry.tensor_bytes
            )
        )
        merged: list[tuple[int, int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        return merged

    def published(self, agent_metadata: Any) -> None:
        """The connector built its handshake metadata (``agent_metadata``,
        a ``NixlAgentMetadata``) from the current registrations."""
        self._agent_metadata = agent_metadata
        if self.registry is not None:
            self._published_generation = self.registry.generation

    def registration_update(self, payload: Any) -> tuple[Any, bytes, bytes] | None:
        """When segments were mapped or unmapped since the last publication:
        ``(new payload, encoded old payload, encoded new payload)``, the new
        ``NixlHandshakePayload`` naming the current registrations."""
        registry = self.registry
        if registry is None or registry.generation == self._published_generation:
            return None
        assert self._agent_metadata is not None
        self._published_generation = registry.generation
        self._agent_metadata = dataclasses.replace(
            self._agent_metadata, agent_metadata=self.agent.get_agent_metadata()
        )
        new_payload = type(payload)(
            compatibility_hash=payload.compatibility_hash,
            agent_metadata_bytes=msgspec.msgpack.encode(self._agent_metadata),
        )
        return (
            new_payload,
            msgspec.msgpack.encode(payload),
            msgspec.msgpack.encode(new_payload),
        )

    # -- peers' registrations -------------------------------------------
    def add_peer(self, agent_name: str, path: str, request: bytes) -> None:
        """Where to fetch a peer's registrations again: its side channel
        ``path`` and the encoded GET_META_MSG naming its rank."""
        with self._lock:
            self._side_channels[agent_name] = (path, request)

    def remove_peer(self, agent_name: str) -> None:
        """A new handshake with the peer records it again."""
        with self._lock:
            self._side_channels.pop(agent_name, None)
            self._epochs.pop(agent_name, None)
            self._fetches.pop(agent_name, None)
        if self.same_host_path is not None:
            self.same_host_path.disconnect(agent_name)

    def catch_up(
        self,
        agent_names: Iterable[str],
        epoch: int,
        ready: Callable[[], None],
        failed: Callable[[Exception], None],
    ) -> bool:
        """Whether our copies of the peers' registrations are at ``epoch``
        (the peers' kv_transfer_params say so) and a read may go ahead.

        Otherwise the stale ones are fetched in the background and False is
        returned: after the peer unmapped and remapped a segment our copy
        would still name the old memory, and a read would not fail but use
        it. Once every fetch is done, ``ready()`` runs (call ``catch_up``
        again, on the transfer thread: it loads what was fetched) or, if one
        failed or timed out, ``failed(error)``; both on the fetching thread.
        """
        with self._lock:
            fetches = []
            for name in dict.fromkeys(agent_names):
                if name not in self._side_channels:
                    continue
                self._load_fetched_locked(name)
                if epoch > self._epochs.get(name, 0):
                    fetches.append(self._fetch_locked(name, epoch))
            if not fetches:
                return True
        remaining = [len(fetches)]
        errors: list[Exception] = []
        counter = threading.Lock()

        def done(fut: Future[bytes]) -> None:
            error = _failure(fut)
            with counter:
                if error is not None:
                    errors.append(error)
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                if errors:
                    failed(errors[0])
                else:
                    ready()

        for fut in fetches:
            fut.add_done_callback(done)
        return False

    def _refresh_in_background(self, agent_name: str) -> bool:
        """``SegmentedXferAgent``'s refresh: a transfer named peer memory our
        copy does not know. True if a fetch done meanwhile was loaded now (the
        transfer is retried); else one is started for later transfers and
        this one fails without waiting (the connector's failure policy)."""
        with self._lock:
            if agent_name not in self._side_channels:
                return False
            if self._load_fetched_locked(agent_name):
                return True
            self._fetch_locked(agent_name, self._epochs.get(agent_name, 0))
        return False

    def _fetch_locked(self, agent_name: str, epoch: int) -> "Future[bytes]":
        """A fetch of the peer's registrations that began after its epoch
        reached ``epoch``: the one in flight if it was asked for that epoch,
        else a new one."""
        current = self._fetches.get(agent_name)
        if current is not None and current[0] >= epoch and not current[1].done():
            return current[1]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="nixl-vmm-registrations"
            )
        path, request = self._side_channels[agent_name]
        fut = self._executor.submit(self._fetch_with_retries, agent_name, path, request)
        self._fetches[agent_name] = (epoch, fut)
        return fut

    def _fetch_with_retries(self, agent_name: str, path: str, request: bytes) -> bytes:
        """The peer's agent metadata; on the fetching thread."""
        for attempt in range(1, self.fetch_attempts):
            try:
                return self._fetch(path, request, self.fetch_timeout_s)
            except (OSError, zmq.ZMQError, msgspec.MsgspecError) as e:
                logger.warning(
                    "Fetching the NIXL registrations of %s from %s failed "
                    "(%s: %s; attempt %d of %d), trying again",
                    agent_name,
                    path,
                    type(e).__name__,
                    e,
                    attempt,
                    self.fetch_attempts,
                )
        return self._fetch(path, request, self.fetch_timeout_s)

    def _load_fetched_locked(self, agent_name: str) -> bool:
        """Load the peer's metadata a finished fetch brought, on the calling
        (transfer) thread. True if there was one."""
        fetched = self._fetches.get(agent_name)
        if fetched is None or not fetched[1].done():
            return False
        del self._fetches[agent_name]
        epoch, fut = fetched
        if _failure(fut) is not None:
            return False  # reported to the reads that waited for it
        # Loading the metadata of a known agent again updates its memory.
        self.agent.add_remote_agent(fut.result())
        self._epochs[agent_name] = max(self._epochs.get(agent_name, 0), epoch)
        logger.debug("Refreshed NIXL registrations of %s", agent_name)
        return True

    def close(self) -> None:
        """Stop fetching and deregister everything (the table stays mapped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self.same_host_path is not None:
            self.same_host_path.close()
        if self.registry is not None:
            self.registry.close()
