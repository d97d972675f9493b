# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NIXL agent as NixlConnector sees it over VMM-backed KV memory.

NIXL checks a prepared descriptor list against the registrations when it is
prepared, which fails for blocks on pages not mapped yet (and goes stale
when pages are remapped). :class:`SegmentedXferAgent` keeps the connector's
descriptors instead and resolves the ones a transfer uses when the transfer
is created (``initialize_xfer``), against the registrations of that moment;
a READ that :class:`~.transfers.LocalReads` takes (one whose remote blocks
all lie in memory the peer shares with us on this host: :mod:`.same_host`)
runs as it makes it. Every transfer is an :class:`~.transfers.XferHandle`,
every prepared list a :class:`PreparedList`: the agent calls their methods
and never asks what they are.

:class:`StockKVXferAgent` is the same for a reader with stock KV tensors:
NIXL's prepared lists and transfers as before, except for peers that share
their VMM-backed KV with us on this host.

Both expose, by name, the ``nixl_agent`` methods the connector calls.
"""

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.registry import (
    NixlSegmentRegistry,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    Descs,
    LocalReads,
    NixlXfer,
    XferHandle,
    nixl_not_found,
)
from vllm.v1.kv_vmm.backend import VmmError


@dataclasses.dataclass(frozen=True)
class XferRequest:
    """A ``make_prepped_xfer`` call: what to move where, and the optional
    arguments the caller gave."""

    operation: str
    local: "PreparedList"
    local_indices: Any
    remote_indices: Any
    notif_msg: bytes
    options: dict[str, Any]


class PreparedList(ABC):
    """What ``prep_xfer_dlist`` returns: a peer's (or our) descriptors, and
    how a transfer from or into them is made."""

    descs: Descs
    #: NIXL's prepared list, where NIXL prepared one (else None).
    nixl_handle: Any

    @abstractmethod
    def make_xfer(
        self, agent: "SegmentedXferAgent", request: XferRequest
    ) -> XferHandle:
        """A transfer between ``request.local`` and these (the remote side)."""

    def release(self, agent: Any) -> None:  # noqa: B027 - optional hook
        """Give it up (``release_dlist_handle``)."""


@dataclasses.dataclass(eq=False)
class _PerTransfer(PreparedList):
    """Descriptors resolved when a transfer is made."""

    agent_name: str
    descs: Descs
    nixl_handle: Any = None

    def make_xfer(
        self, agent: "SegmentedXferAgent", request: XferRequest
    ) -> XferHandle:
        return agent.resolved_xfer(request, self)


@dataclasses.dataclass(eq=False)
class _NixlPrepared(PreparedList):
    """A list NIXL prepared (a stock reader's own, or a stock peer's): its
    transfers are NIXL's prepared ones, made from NIXL's handles."""

    nixl_handle: Any
    descs: Descs

    def release(self, agent: Any) -> None:
        agent.release_dlist_handle(self.nixl_handle)

    def make_xfer(
        self, agent: "SegmentedXferAgent", request: XferRequest
    ) -> XferHandle:
        raw = agent.nixl_agent
        handle = raw.make_prepped_xfer(
            request.operation,
            request.local.nixl_handle,
            request.local_indices,
            self.nixl_handle,
            request.remote_indices,
            notif_msg=request.notif_msg,
            **request.options,
        )
        return NixlXfer(raw, handle)


def _given(**options: Any) -> dict[str, Any]:
    """The optional arguments a caller gave (passed on as given: NIXL's and
    the connector's fakes take different ones)."""
    return {k: v for k, v in options.items() if v is not None}


class SegmentedXferAgent:
    """A ``nixl_agent`` whose descriptor lists are resolved per transfer.

    Args:
        agent: the ``nixl_agent``.
        registry: our VMM-backed KV's registrations (None: stock KV tensors).
        refresh_remote: fetches a peer's current agent metadata; True if it
            was updated meanwhile (a transfer naming unknown memory of the
            peer is then made once more).
        same_host: READs it takes (of peers that share their KV memory with
            us on this host) run as it makes them: local copies.

    """

    # prep_xfer_dlist's name for the local agent.
    LOCAL = "NIXL_INIT_AGENT"

    def __init__(
        self,
        agent: Any,
        registry: NixlSegmentRegistry | None,
        refresh_remote: Callable[[str], bool] | None = None,
        same_host: LocalReads | None = None,
    ) -> None:
        self.nixl_agent = agent
        self.registry = registry
        self.refresh_remote = refresh_remote
        self.same_host = same_host

    # -- the nixl_agent methods the connector calls, passed on -----------
    def get_reg_descs(self, *args: Any, **kwargs: Any) -> Any:
        return self.nixl_agent.get_reg_descs(*args, **kwargs)

    def register_memory(self, *args: Any, **kwargs: Any) -> Any:
        return self.nixl_agent.register_memory(*args, **kwargs)

    def deregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        return self.nixl_agent.deregister_memory(*args, **kwargs)

    def get_agent_metadata(self) -> bytes:
        return self.nixl_agent.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        return self.nixl_agent.add_remote_agent(metadata)

    def remove_remote_agent(self, agent_name: str) -> Any:
        return self.nixl_agent.remove_remote_agent(agent_name)

    def check_remote_metadata(self, *args: Any, **kwargs: Any) -> bool:
        return self.nixl_agent.check_remote_metadata(*args, **kwargs)

    def send_notif(self, *args: Any, **kwargs: Any) -> Any:
        return self.nixl_agent.send_notif(*args, **kwargs)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return self.nixl_agent.get_new_notifs()

    # -- descriptor lists -------------------------------------------------
    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Descs:
        kept = Descs(descs, mem_type)
        kept.flatten()
        kept.source = None
        return kept

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: Any,
        mem_type: str | None = None,
        backends: list[str] | None = None,
    ) -> PreparedList:
        return self._prepare(
            agent_name,
            Descs.of(xfer_list, mem_type),
            _given(mem_type=mem_type, backends=backends),
        )

    def _prepare(
        self, agent_name: str, descs: Descs, options: dict[str, Any]
    ) -> PreparedList:
        """``prep_xfer_dlist`` of ``descs`` (``options``: what the caller gave
        besides): kept, resolved per transfer."""
        descs.flatten()
        return _PerTransfer(agent_name, descs)

    def release_dlist_handle(self, handle: PreparedList) -> None:
        handle.release(self.nixl_agent)

    # -- transfers --------------------------------------------------------
    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: PreparedList,
        local_indices: Any,
        remote_xfer_side: PreparedList,
        remote_indices: Any,
        notif_msg: bytes = b"",
        backends: list[str] | None = None,
        skip_desc_merge: bool | None = None,
    ) -> XferHandle:
        request = XferRequest(
            operation,
            local_xfer_side,
            local_indices,
            remote_indices,
            notif_msg,
            _given(backends=backends, skip_desc_merge=skip_desc_merge),
        )
        return remote_xfer_side.make_xfer(self, request)

    def resolved_xfer(
        self, request: XferRequest, remote_side: _PerTransfer
    ) -> XferHandle:
        """A transfer of the descriptors the request's indices name, resolved
        now: a same-host copy, else NIXL's against the current registrations
        (the peer's fetched again once if they do not cover it)."""
        local, remote = request.local.descs, remote_side.descs
        peer = remote_side.agent_name
        local_indices = np.asarray(request.local_indices, dtype=np.int64)
        remote_indices = np.asarray(request.remote_indices, dtype=np.int64)
        handle: XferHandle | None = None
        if self.same_host is not None and request.operation == "READ":
            handle = self.same_host.make_read(
                peer,
                local,
                local_indices,
                remote,
                remote_indices,
                request.notif_msg,
                self._send_notif,
            )
        if handle is None:
            # np.take of whole rows: a fifth of the time of fancy indexing
            # for a prompt's 16,000 rows.
            handle = self._nixl_xfer(
                request.operation,
                (np.take(local.rows, local_indices, axis=0), local.mem_type),
                (np.take(remote.rows, remote_indices, axis=0), remote.mem_type),
                peer,
                request.notif_msg,
                request.options.get("backends", []),
            )
        if self.registry is not None:
            self.registry.track(handle, local, local_indices)
        return handle

    def _nixl_xfer(
        self,
        operation: str,
        local: tuple[np.ndarray, str | None],
        remote: tuple[np.ndarray, str | None],
        peer: str,
        notif_msg: bytes,
        backends: list[str],
    ) -> XferHandle:
        agent = self.nixl_agent
        local_rows, remote_rows = local[0], remote[0]
        args = (
            operation,
            agent.get_xfer_descs(*local),
            agent.get_xfer_descs(*remote),
            peer,
            notif_msg,
            backends,
        )
        try:
            return NixlXfer(agent, agent.initialize_xfer(*args))
        except nixl_not_found() as e:
            registry = self.registry
            if registry is not None and len(
                unregistered := registry.unregistered(local_rows)
            ):
                raise VmmError(
                    f"NIXL {operation} of {len(local_rows)} KV descriptors: "
                    f"{len(unregistered)} local ones are not inside a registered "
                    f"KV segment (first: address {int(unregistered[0, 0]):#x}, "
                    f"{int(unregistered[0, 1])} bytes); registered: "
                    f"{registry.registered_ranges}"
                ) from e
            # The peer may have mapped (and registered) the segment after we
            # took its metadata: fetch it again, once.
            if self.refresh_remote is None or not self.refresh_remote(peer):
                raise
        try:
            return NixlXfer(agent, agent.initialize_xfer(*args))
        except nixl_not_found() as e:
            rows = remote_rows[:, 0].astype(np.uint64)
            raise VmmError(
                f"NIXL {operation} of {len(remote_rows)} KV descriptors: "
                f"memory of {peer} between {int(rows.min()):#x} and "
                f"{int((rows + remote_rows[:, 1]).max()):#x} is not in its "
                "current registrations, even after fetching them again: it "
                "gave those pages back, so it no longer holds the blocks (e.g. "
                "its lease on them expired before this read; see the "
                "NixlConnector's kv_lease_duration)"
            ) from e

    def _send_notif(self, agent_name: str | bytes, notif_msg: bytes) -> None:
        """A same-host read's notification, as NIXL sends it after a READ."""
        self.nixl_agent.send_notif(agent_name, notif_msg=notif_msg)

    def transfer(self, handle: XferHandle, *args: Any, **kwargs: Any) -> str:
        return handle.post(*args, **kwargs)

    def check_xfer_state(self, handle: XferHandle) -> str:
        return handle.check()

    def get_xfer_telemetry(self, handle: XferHandle) -> Any:
        return handle.telemetry()

    def release_xfer_handle(self, handle: XferHandle) -> None:
        if self.registry is not None:
            self.registry.untrack(handle)
        handle.release()


class StockKVXferAgent(SegmentedXferAgent):
    """A ``nixl_agent`` over stock KV tensors that reads same-host
    VMM-backed peers through shared memory.

    A VMM-backed producer registers its KV per mapped physical chunk, and
    UCX can only stage such memory through the host; a peer of ours that
    shares its chunks over a same-host channel (so it is VMM-backed and on
    this host) gets its descriptor lists kept and resolved per transfer, as
    :class:`SegmentedXferAgent` does: its READs become local copies out of
    the shared chunks, and the rest go to NIXL against its registrations of
    the moment. Our own lists and every other peer's are NIXL's prepared
    lists and transfers, as without the wrapper; the rows of ours are kept
    to resolve the reads from the former.
    """

    def __init__(
        self,
        agent: Any,
        refresh_remote: Callable[[str], bool] | None = None,
        same_host: LocalReads | None = None,
    ) -> None:
        super().__init__(agent, None, refresh_remote, same_host)
        self._local: list[_NixlPrepared] = []
        self._lock = threading.Lock()

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Descs:
        return Descs(descs, mem_type)  # flattened only if a read needs it

    def _prepare(
        self, agent_name: str, descs: Descs, options: dict[str, Any]
    ) -> PreparedList:
        if (
            agent_name != self.LOCAL
            and self.same_host is not None
            and self.same_host.has_channel(agent_name)
        ):
            with self._lock:
                local = list(self._local)
            for prepared in local:
                prepared.descs.flatten()
            return _PerTransfer(agent_name, descs)
        agent = self.nixl_agent
        handle = agent.prep_xfer_dlist(
            agent_name, agent.get_xfer_descs(descs.source, descs.mem_type), **options
        )
        prepared = _NixlPrepared(handle, descs)
        if agent_name == self.LOCAL:
            with self._lock:
                self._local.append(prepared)
        return prepared

    def release_dlist_handle(self, handle: PreparedList) -> None:
        with self._lock:
            self._local = [p for p in self._local if p is not handle]
        handle.release(self.nixl_agent)
