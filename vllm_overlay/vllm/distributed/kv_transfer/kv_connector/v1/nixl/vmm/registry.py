# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL registrations that follow a VMM-backed KV page table.

A registration made once over the whole KV reservation is wrong for VMM
memory twice over: unmapped address ranges cannot be registered (CUDA), and
one registration spanning several physical allocations silently transfers
wrong bytes on some UCX versions (cuda_ipc exports only the first one). So
:class:`NixlSegmentRegistry` registers every physical chunk of a segment
with the NIXL agent when the segment is mapped and deregisters it before
the segment is unmapped. An unmap first waits for the transfers that touch
the segment, before the page table takes its lock (readers of the mapped
state are not held up); if they do not finish in time it raises, and the
page table keeps everything mapped. Under the lock, the deregistration
checks once more and refuses (nothing is unmapped) if a transfer still uses
the segment: a chunk is never given back while a transfer may use it.

A peer reading our memory (NixlConnector's pull mode) is covered by the
lease on the request's blocks: they stay allocated, so their pages stay
mapped and registered, until the reader reports the read done or the lease
expires. A read after that finds no registration and fails (the reader's
load-failure policy applies) instead of reading reused blocks, as it would
with stock KV tensors.
"""

import threading
import time
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
    IN_FLIGHT,
    Descs,
    XferHandle,
)
from vllm.v1.kv_vmm.backend import VmmError
from vllm.v1.kv_vmm.page_table import KVPageTable, Segment


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
        # Transfer -> (starts, ends) of the local byte ranges it uses.
        self._in_flight: dict[XferHandle, tuple[Descs, np.ndarray]] = {}
        self._tables: list[KVPageTable] = []

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
    def track(self, handle: XferHandle, local: Descs, indices: np.ndarray) -> None:
        """Remember the local bytes of a transfer (descriptors ``indices`` of
        ``local``) until it is released; their addresses are looked up only
        when an unmap asks which transfers touch it."""
        with self._lock:
            self._in_flight[handle] = (local, indices)

    def untrack(self, handle: XferHandle) -> None:
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

    def _touching(self, ranges: list[tuple[int, int]]) -> list[XferHandle]:
        with self._lock:
            items = list(self._in_flight.items())
        hits = []
        for handle, (local, indices) in items:
            starts = np.take(local.addrs, indices)
            ends = starts + np.take(local.lengths, indices)
            for va, nbytes in ranges:
                if np.any((starts < va + nbytes) & (ends > va)):
                    hits.append(handle)
                    break
        return hits

    def _busy(self, ranges: list[tuple[int, int]]) -> list[XferHandle]:
        """Transfers in flight that touch ``ranges``."""
        return [h for h in self._touching(ranges) if h.state() == IN_FLIGHT]

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
