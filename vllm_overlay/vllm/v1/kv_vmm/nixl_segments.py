# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL registrations that follow a VMM-backed KV page table.

A registration made once over the whole KV reservation is wrong for VMM
memory twice over: unmapped address ranges cannot be registered (CUDA), and
one registration spanning several physical allocations silently transfers
wrong bytes on some UCX versions (cuda_ipc exports only the first one). So:

- ``NixlSegmentRegistry`` registers every physical chunk of a segment with
  the NIXL agent when the segment is mapped and deregisters it before the
  segment is unmapped. An unmap first waits for the transfers that touch the
  segment, before the page table takes its lock (readers of the mapped state
  are not held up); if they do not finish in time it raises, and the page
  table keeps everything mapped. Under the lock, the deregistration checks
  once more and refuses (nothing is unmapped) if a transfer still uses the
  segment: a chunk is never given back while a transfer may use it.
- ``SegmentedXferAgent`` wraps the NIXL agent for a connector written
  against prepared descriptor lists. NIXL checks a prepared list against the
  registrations when it is prepared, which would fail for blocks on pages
  not mapped yet (and would go stale when pages are remapped); the wrapper
  keeps the descriptors and resolves the ones a transfer uses when the
  transfer is created (``initialize_xfer``), against the registrations of
  that moment.

A peer reading our memory (NixlConnector's pull mode) is covered by the
lease on the request's blocks: they stay allocated, so their pages stay
mapped and registered, until the reader reports the read done or the lease
expires. A read after that finds no registration and fails (the reader's
load-failure policy applies) instead of reading reused blocks, as it would
with stock KV tensors.
"""

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm.v1.kv_vmm.backend import VmmError
from vllm.v1.kv_vmm.nixl_samehost import SameHostReads, SameHostXfer
from vllm.v1.kv_vmm.page_table import KVPageTable, Segment

# check_xfer_state() of a transfer still moving data.
_IN_FLIGHT = "PROC"


class NixlSegmentRegistry:
    """Registers the mapped segments of one page table with one NIXL agent.

    Args:
        agent: the ``nixl_agent``.
        mem_type: NIXL memory type of the KV memory ("DRAM" or "VRAM").
        device_id: device id of the registrations (0 for host memory).
        backends: NIXL backends to register with (all when empty).
        unmap_timeout_s: how long an unmap waits for transfers that touch
            the segment.

    """

    def __init__(
        self,
        agent: Any,
        mem_type: str,
        device_id: int,
        backends: list[str] | None = None,
        unmap_timeout_s: float = 30.0,
    ) -> None:
        self.agent = agent
        self.mem_type = mem_type
        self.device_id = device_id
        self.backends = list(backends or [])
        self.unmap_timeout_s = unmap_timeout_s
        # Bumped on every registration change; peers holding our agent
        # metadata of an older generation may miss segments.
        self.generation = 0
        self._lock = threading.Lock()
        self._registrations: dict[tuple[int, int], Any] = {}
        self._ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
        # Transfer handle -> (starts, ends) of the local byte ranges it uses.
        self._in_flight: dict[Any, tuple[np.ndarray, np.ndarray]] = {}
        self._tables: list[KVPageTable] = []
        # State of a transfer handle without side effects (the agent's
        # check_xfer_state unless the XferAgent runs transfers of its own).
        self.xfer_state: Callable[[Any], str] | None = None

    def attach(self, table: KVPageTable) -> None:
        """Register what ``table`` has mapped and follow its later changes.

        Callbacks already installed on the table keep running (first).
        """
        previous_mapped = table.on_segment_mapped
        previous_unmapped = table.before_segment_unmapped
        key = len(self._tables)
        self._tables.append(table)

        def on_mapped(segment: Segment) -> None:
            if previous_mapped is not None:
                previous_mapped(segment)
            self._register(key, segment)

        def before_unmapped(segment: Segment) -> None:
            if previous_unmapped is not None:
                previous_unmapped(segment)
            self._deregister(key, segment)

        previous_wait = table.wait_before_unmap

        def wait_before_unmap(segment_ids: list[int]) -> None:
            # The table runs before_segment_unmapped under its lock: wait
            # for the transfers here, before it takes it.
            if previous_wait is not None:
                previous_wait(segment_ids)
            self._wait_for_transfers(key, set(segment_ids))

        for segment in table.segments():
            self._register(key, segment)
        table.on_segment_mapped = on_mapped
        table.before_segment_unmapped = before_unmapped
        table.wait_before_unmap = wait_before_unmap

    @property
    def registered_ranges(self) -> list[tuple[int, int]]:
        """(address, nbytes) of every registration, in address order."""
        with self._lock:
            return sorted(r for ranges in self._ranges.values() for r in ranges)

    def _register(self, table_key: int, segment: Segment) -> None:
        ranges = [(c.va, c.nbytes) for c in segment.chunks]
        # One registration per chunk: a chunk is exactly one physical
        # allocation, so none spans two of them.
        descs = self.agent.get_reg_descs(
            [(va, nbytes, self.device_id, "") for va, nbytes in ranges],
            self.mem_type,
        )
        self.agent.register_memory(descs, backends=self.backends)
        with self._lock:
            self._registrations[(table_key, segment.segment_id)] = descs
            self._ranges[(table_key, segment.segment_id)] = ranges
            self.generation += 1

    def _deregister(self, table_key: int, segment: Segment) -> None:
        key = (table_key, segment.segment_id)
        with self._lock:
            ranges = self._ranges.get(key)
        if ranges is None:
            return
        # Under the page table's lock: check, never wait (the wait ran before).
        busy = self._busy(ranges)
        if busy:
            raise self._busy_error(segment.segment_id, len(busy))
        with self._lock:
            descs = self._registrations.pop(key)
            del self._ranges[key]
            self.generation += 1
        self.agent.deregister_memory(descs, backends=self.backends)

    # -- transfers --------------------------------------------------------
    def track(self, handle: Any, local_descs: np.ndarray) -> None:
        """Remember the local bytes (``(addr, len, dev)`` rows) of a transfer
        until it is released."""
        starts = local_descs[:, 0].astype(np.uint64)
        ends = starts + local_descs[:, 1].astype(np.uint64)
        with self._lock:
            self._in_flight[handle] = (starts, ends)

    def untrack(self, handle: Any) -> None:
        with self._lock:
            self._in_flight.pop(handle, None)

    def unregistered(self, rows: np.ndarray) -> np.ndarray:
        """The ``(addr, len, dev)`` rows not inside one registered chunk."""
        with self._lock:
            ranges = sorted(r for rs in self._ranges.values() for r in rs)
        if not ranges:
            return rows
        starts = np.array([va for va, _ in ranges], dtype=np.uint64)
        ends = starts + np.array([n for _, n in ranges], dtype=np.uint64)
        addrs = rows[:, 0].astype(np.uint64)
        # The registration starting at or before each row's first byte.
        idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
        covered = (idx >= 0) & (
            addrs + rows[:, 1].astype(np.uint64) <= ends[np.maximum(idx, 0)]
        )
        return rows[~covered]

    def _touching(self, ranges: list[tuple[int, int]]) -> list[Any]:
        with self._lock:
            items = list(self._in_flight.items())
        hits = []
        for handle, (starts, ends) in items:
            for va, nbytes in ranges:
                if np.any((starts < va + nbytes) & (ends > va)):
                    hits.append(handle)
                    break
        return hits

    def _busy(self, ranges: list[tuple[int, int]]) -> list[Any]:
        """Transfers in flight that touch ``ranges``."""
        state = self.xfer_state or self.agent.check_xfer_state
        return [h for h in self._touching(ranges) if state(h) == _IN_FLIGHT]

    def _busy_error(self, segment_id: int, num_busy: int) -> VmmError:
        return VmmError(
            f"KV segment {segment_id} cannot be unmapped: {num_busy} NIXL "
            f"transfer(s) still use it after {self.unmap_timeout_s:.0f} s. "
            "Its pages stay mapped; retry the unmap once the transfers "
            "have finished."
        )

    def _wait_for_transfers(self, table_key: int, segment_ids: set[int]) -> None:
        """Wait until no transfer in flight touches the registered chunks
        of ``segment_ids``; raise after ``unmap_timeout_s``."""
        with self._lock:
            ranges = {
                s: self._ranges[(table_key, s)]
                for s in sorted(segment_ids)
                if (table_key, s) in self._ranges
            }
        deadline = time.monotonic() + self.unmap_timeout_s
        delay = 0.0005
        for segment_id, segment_ranges in ranges.items():
            while busy := self._busy(segment_ranges):
                if time.monotonic() >= deadline:
                    raise self._busy_error(segment_id, len(busy))
                time.sleep(delay)
                delay = min(2 * delay, 0.02)

    def close(self) -> None:
        """Deregister everything (the tables stay mapped)."""
        with self._lock:
            registrations = list(self._registrations.values())
            self._registrations.clear()
            self._ranges.clear()
        for descs in registrations:
            self.agent.deregister_memory(descs, backends=self.backends)


def flat_desc_rows(descs: Any) -> np.ndarray:
    """Transfer descriptors as ``(addr, len, dev)`` rows, one per unit a
    transfer's indices count.

    NIXL's strided form (``(addr, len, dev, stride, count)`` rows, NIXL 1.5)
    names ``count`` units ``stride`` bytes apart; indices into a prepared
    strided list count those units, so they are expanded in order.
    """
    rows = np.asarray(descs, dtype=np.uint64)
    if rows.ndim != 2 or rows.shape[1] != 5:
        return rows.reshape(-1, 3)
    counts = rows[:, 4].astype(np.int64)
    unit = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    addrs = np.repeat(rows[:, 0], counts) + unit.astype(np.uint64) * np.repeat(
        rows[:, 3], counts
    )
    return np.stack(
        [addrs, np.repeat(rows[:, 1], counts), np.repeat(rows[:, 2], counts)], axis=1
    )


class _Descs:
    """Transfer descriptors as the connector gave them (``source``), as
    ``(addr, len, dev)`` rows once first asked for."""

    __slots__ = ("source", "mem_type", "_rows")

    def __init__(self, source: Any, mem_type: str | None) -> None:
        self.source = source
        self.mem_type = mem_type
        self._rows: np.ndarray | None = None

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = flat_desc_rows(self.source)
        return self._rows

    def flatten(self) -> None:
        """Make the rows now (off the transfer path)."""
        self._rows = self.rows


class _PreparedDescs:
    """What ``prep_xfer_dlist`` returns: descriptors of one agent, resolved
    at transfer time."""

    __slots__ = ("agent_name", "descs")

    def __init__(self, agent_name: str, descs: _Descs) -> None:
        self.agent_name = agent_name
        self.descs = descs


class SegmentedXferAgent:
    """A ``nixl_agent`` whose descriptor lists are resolved per transfer.

    With ``same_host``, a READ whose remote blocks all lie in memory the
    peer shares with us on this host runs as a local copy
    (:class:`~vllm.v1.kv_vmm.nixl_samehost.SameHostXfer`, driven through the
    same ``transfer``/``check_xfer_state``/``release_xfer_handle`` calls).
    Everything not overridden goes to the wrapped agent.
    """

    # prep_xfer_dlist's name for the local agent.
    LOCAL = "NIXL_INIT_AGENT"

    def __init__(
        self,
        agent: Any,
        registry: NixlSegmentRegistry | None,
        refresh_remote: Callable[[str], bool] | None = None,
        same_host: SameHostReads | None = None,
    ) -> None:
        self._agent = agent
        # Our VMM-backed KV's registrations (None: stock KV tensors).
        self.registry = registry
        # Fetches a peer's current agent metadata; True if it was updated.
        self.refresh_remote = refresh_remote
        self.same_host = same_host
        if registry is not None:
            registry.xfer_state = self._xfer_state

    def _xfer_state(self, handle: Any) -> str:
        if isinstance(handle, SameHostXfer):
            return handle.state()
        return self._agent.check_xfer_state(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> _Descs:
        kept = _Descs(descs, mem_type)
        kept.flatten()
        kept.source = None
        return kept

    def _kept(self, xfer_list: Any, mem_type: str | None) -> _Descs:
        """``xfer_list`` (ours or the connector's) with ``mem_type`` if given."""
        if not isinstance(xfer_list, _Descs):
            return self.get_xfer_descs(xfer_list, mem_type)
        if mem_type is None:
            return xfer_list
        kept = _Descs(xfer_list.source, mem_type)
        kept._rows = xfer_list._rows
        return kept

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: _Descs,
        mem_type: str | None = None,
        backends: list[str] | None = None,
    ) -> _PreparedDescs:
        return _PreparedDescs(agent_name, self._kept(xfer_list, mem_type))

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: Any,
        local_indices: Any,
        remote_xfer_side: Any,
        remote_indices: Any,
        notif_msg: bytes = b"",
        backends: list[str] | None = None,
        skip_desc_merge: bool = False,
    ) -> Any:
        if not isinstance(remote_xfer_side, _PreparedDescs):
            # A list NIXL prepared (a stock peer of StockKVXferAgent).
            return self._agent.make_prepped_xfer(
                operation,
                local_xfer_side,
                local_indices,
                remote_xfer_side,
                remote_indices,
                notif_msg,
                backends or [],
                skip_desc_merge,
            )
        return self._resolved_xfer(
            operation,
            self._local_descs(local_xfer_side),
            local_indices,
            remote_xfer_side,
            remote_indices,
            notif_msg,
            backends,
        )

    def _local_descs(self, local_xfer_side: Any) -> _Descs:
        """The descriptors of one of our prepared lists."""
        return local_xfer_side.descs

    def _resolved_xfer(
        self,
        operation: str,
        local: _Descs,
        local_indices: Any,
        remote_xfer_side: _PreparedDescs,
        remote_indices: Any,
        notif_msg: bytes,
        backends: list[str] | None,
    ) -> Any:
        """A transfer of the descriptors ``local_indices`` and
        ``remote_indices`` name, resolved now: a same-host copy, else NIXL's
        against the current registrations (the peer's fetched again once if
        they do not cover it)."""
        remote = remote_xfer_side.descs
        local_rows = local.rows[np.asarray(local_indices, dtype=np.int64)]
        remote_rows = remote.rows[np.asarray(remote_indices, dtype=np.int64)]
        if self.same_host is not None and operation == "READ":
            xfer = self.same_host.make_read(
                remote_xfer_side.agent_name, local_rows, remote_rows, notif_msg
            )
            if xfer is not None:
                if self.registry is not None:
                    self.registry.track(xfer, local_rows)
                return xfer
        args = (
            operation,
            self._agent.get_xfer_descs(local_rows, local.mem_type),
            self._agent.get_xfer_descs(remote_rows, remote.mem_type),
            remote_xfer_side.agent_name,
            notif_msg,
            backends or [],
        )
        try:
            handle = self._agent.initialize_xfer(*args)
        except Exception as e:
            if type(e).__name__ != "nixlNotFoundError":
                raise
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
            if self.refresh_remote is None or not self.refresh_remote(
                remote_xfer_side.agent_name
            ):
                raise
            try:
                handle = self._agent.initialize_xfer(*args)
            except Exception as e2:
                rows = remote_rows[:, 0].astype(np.uint64)
                raise VmmError(
                    f"NIXL {operation} of {len(remote_rows)} KV descriptors: "
                    f"memory of {remote_xfer_side.agent_name} between "
                    f"{int(rows.min()):#x} and "
                    f"{int((rows + remote_rows[:, 1]).max()):#x} is not in its "
                    "current registrations, even after fetching them again "
                    f"({type(e2).__name__}): it gave those pages back, so it no "
                    "longer holds the blocks (e.g. its lease on them expired "
                    "before this read; see the NixlConnector's kv_lease_duration)"
                ) from e2
        if self.registry is not None:
            self.registry.track(handle, local_rows)
        return handle

    def transfer(self, handle: Any, notif_msg: bytes = b"") -> str:
        if isinstance(handle, SameHostXfer):
            assert self.same_host is not None
            return self.same_host.transfer(handle)
        return self._agent.transfer(handle, notif_msg)

    def check_xfer_state(self, handle: Any) -> str:
        if isinstance(handle, SameHostXfer):
            assert self.same_host is not None
            return self.same_host.check(
                handle,
                lambda name, msg: self._agent.send_notif(name, notif_msg=msg),
            )
        return self._agent.check_xfer_state(handle)

    def get_xfer_telemetry(self, handle: Any) -> Any:
        if isinstance(handle, SameHostXfer):
            return handle.telemetry()
        return self._agent.get_xfer_telemetry(handle)

    def release_xfer_handle(self, handle: Any) -> None:
        if self.registry is not None:
            self.registry.untrack(handle)
        if isinstance(handle, SameHostXfer):
            assert self.same_host is not None
            self.same_host.release(handle)
            return
        self._agent.release_xfer_handle(handle)

    def release_dlist_handle(self, handle: Any) -> None:
        if not isinstance(handle, _PreparedDescs):
            self._agent.release_dlist_handle(handle)


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
        same_host: SameHostReads | None = None,
    ) -> None:
        super().__init__(agent, None, refresh_remote, same_host)
        # Our prepared lists (NIXL handles) -> their descriptors.
        self._local: dict[Any, _Descs] = {}
        self._lock = threading.Lock()

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> _Descs:
        return _Descs(descs, mem_type)  # flattened only if a read needs it

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: _Descs,
        mem_type: str | None = None,
        backends: list[str] | None = None,
    ) -> Any:
        kept = self._kept(xfer_list, mem_type)
        if (
            agent_name != self.LOCAL
            and self.same_host is not None
            and self.same_host.connect(agent_name)
        ):
            with self._lock:
                local = list(self._local.values())
            for descs in local:
                descs.flatten()
            return _PreparedDescs(agent_name, kept)
        handle = self._agent.prep_xfer_dlist(
            agent_name,
            self._agent.get_xfer_descs(kept.source, kept.mem_type),
            mem_type,
            backends or [],
        )
        if agent_name == self.LOCAL:
            with self._lock:
                self._local[handle] = kept
        return handle

    def _local_descs(self, local_xfer_side: Any) -> _Descs:
        with self._lock:
            return self._local[local_xfer_side]

    def release_dlist_handle(self, handle: Any) -> None:
        if isinstance(handle, _PreparedDescs):
            return
        with self._lock:
            self._local.pop(handle, None)
        self._agent.release_dlist_handle(handle)
