# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Page table over a group of KV tensors that share block ids.

One :class:`KVPageTable` owns one virtual reservation per KV tensor of the
group, sized for the geometry's full block capacity, and maps physical
memory behind it segment by segment. ``map_pages``/``unmap_pages`` apply a
decision (made by whoever owns the block pool) to every tensor of the group
in one call.
"""

import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from vllm.v1.kv_vmm.backend import VmmBackend, VmmError
from vllm.v1.kv_vmm.geometry import KVPageGeometry


class KVPageBudgetError(VmmError):
    """Mapping the requested pages would exceed the physical budget."""


class SegmentChunk(NamedTuple):
    """One physical allocation of a segment, as mapped in one tensor region."""

    tensor_index: int
    region: int
    va: int
    nbytes: int
    handle: object


# NamedTuples, not frozen dataclasses: they are built on the map path, and a
# frozen dataclass's constructor is about three times slower.
class Segment(NamedTuple):
    """Pages that share one physical allocation per tensor region.

    A KV connector registers each chunk separately: a chunk is exactly one
    allocation, so no registration ever spans two of them.
    """

    segment_id: int
    pages: range
    blocks: range
    chunks: tuple[SegmentChunk, ...]


SegmentCallback = Callable[[Segment], None]

# Builds a NamedTuple from a ready tuple at C speed: the generated
# ``__new__`` costs ~0.2 us more per call, which the per-page map path
# notices (two of them per page).
_make_tuple = tuple.__new__


class KVPageTable:
    """Maps and unmaps pages of a group of KV tensors.

    Args:
        backend: where the memory comes from.
        geometry: page arithmetic of the group (same numbers as the
            scheduler's).
        max_pages: physical budget, in pages; mapping beyond it raises
            :class:`KVPageBudgetError` and changes nothing.
        on_segment_mapped: called for each segment after it is mapped and
            accessible, in ascending segment order (e.g. register it).
        before_segment_unmapped: called for each segment before its memory
            is unmapped, in ascending segment order (e.g. deregister it).
            Runs under the table's lock: it must not wait.
        wait_before_unmap: called with the ids of the segments about to be
            unmapped before the table takes its lock; it may wait (e.g. for
            transfers in flight that use them) without holding up the
            table's other users.

    """

    def __init__(
        self,
        backend: VmmBackend,
        geometry: KVPageGeometry,
        max_pages: int,
        on_segment_mapped: SegmentCallback | None = None,
        before_segment_unmapped: SegmentCallback | None = None,
        wait_before_unmap: Callable[[list[int]], None] | None = None,
    ) -> None:
        if geometry.granularity != backend.granularity:
            raise ValueError(
                f"geometry granularity {geometry.granularity} differs from the "
                f"backend's ({backend.granularity}); build the geometry with "
                "backend.granularity"
            )
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        self.backend = backend
        self.geometry = geometry
        self.max_pages = max_pages
        self.on_segment_mapped = on_segment_mapped
        self.before_segment_unmapped = before_segment_unmapped
        self.wait_before_unmap = wait_before_unmap
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self._closed = False
        self._bases: list[int] = []
        try:
            for nbytes in geometry.tensor_bytes:
                self._bases.append(backend.reserve(nbytes))
        except BaseException:
            for base, nbytes in zip(self._bases, geometry.tensor_bytes):
                backend.free_reservation(base, nbytes)
            raise
        # Per (tensor, region): the address of segment 0 and the segment size
        # (also the distance between segments), so the map path does one
        # multiply per chunk.
        self._chunk_layout = [
            (
                t,
                region,
                base + geometry.region_offset(t, region, 0),
                geometry.page_region_bytes[t] * geometry.pages_per_segment,
            )
            for t, (base, layout) in enumerate(zip(self._bases, geometry.layouts))
            for region in range(layout.num_regions)
        ]
        #: One flat ``uint8`` tensor per KV tensor, over its whole reservation.
        #: View them like any tensor (``.view(dtype).view(shape).permute(...)``).
        self.tensors: list[torch.Tensor] = [
            backend.tensor(base, nbytes)
            for base, nbytes in zip(self._bases, geometry.tensor_bytes)
        ]

    # -- state ------------------------------------------------------------
    @property
    def num_mapped_pages(self) -> int:
        return len(self._segments) * self.geometry.pages_per_segment

    @property
    def mapped_bytes(self) -> int:
        return self.num_mapped_pages * self.geometry.page_bytes

    def mapped_pages(self) -> list[int]:
        with self._lock:
            segments = sorted(self._segments)
        return [p for s in segments for p in self.geometry.pages_of_segment(s)]

    def is_mapped(self, page_id: int) -> bool:
        return self.geometry.segment_of_page(page_id) in self._segments

    def segments(self) -> list[Segment]:
        """Mapped segments in ascending order (e.g. to register them all)."""
        with self._lock:
            return [self._segments[s] for s in sorted(self._segments)]

    # -- map / unmap ------------------------------------------------------
    def map_pages(self, page_ids: Iterable[int]) -> list[int]:
        """Make ``page_ids`` accessible in every tensor of the group.

        Pages already mapped are skipped (idempotent); a page's whole segment
        is mapped with it. All or nothing: on a budget or out-of-memory error
        nothing new stays mapped. Returns the newly mapped page ids.
        """
        # This is the per-step hot path of an elastic KV cache: keep the
        # Python work around the backend calls small (bench_vmm.py measures
        # it against the raw calls).
        geometry = self.geometry
        with self._lock:
            if self._closed:
                self._check_open()
            missing = self._segment_ids(page_ids)
            missing.difference_update(self._segments)
            if not missing:
                return []
            wanted = sorted(missing) if len(missing) > 1 else list(missing)
            per_segment = geometry.pages_per_segment
            new_pages = len(wanted) * per_segment
            mapped_pages = len(self._segments) * per_segment
            if mapped_pages + new_pages > self.max_pages:
                raise KVPageBudgetError(
                    f"mapping {new_pages} more KV pages would exceed the physical "
                    f"budget of {self.max_pages} pages "
                    f"({self.max_pages * geometry.page_bytes} bytes; "
                    f"{mapped_pages} mapped). Unmap pages first or "
                    "raise the budget."
                )
            created: list[Segment] = []
            try:
                for segment_id in wanted:
                    created.append(self._create_segment(segment_id))
                self._set_access(created)
            except BaseException:
                for segment in created:
                    self._destroy_segment(segment)
                raise
            for segment in created:
                self._segments[segment.segment_id] = segment
            if self.on_segment_mapped is not None:
                for segment in created:
                    self.on_segment_mapped(segment)
            if len(created) == 1:
                return list(created[0].pages)
            return [p for s in created for p in s.pages]

    def unmap_pages(self, page_ids: Iterable[int]) -> list[int]:
        """Give the memory of ``page_ids`` back, in every tensor of the group.

        Pages not mapped are skipped (idempotent). ``page_ids`` must name
        whole segments. ``wait_before_unmap`` runs first, outside the lock;
        then work queued on the device is waited for, and
        ``before_segment_unmapped`` runs for every segment before any of
        them is unmapped; if either raises, nothing is unmapped. Returns the
        unmapped page ids.
        """
        geometry = self.geometry
        pages = set(page_ids)
        segment_ids = sorted(self._segment_ids(pages))
        for segment_id in segment_ids if geometry.pages_per_segment > 1 else ():
            missing = set(geometry.pages_of_segment(segment_id)) - pages
            if missing:
                raise ValueError(
                    f"unmap_pages needs whole segments: segment {segment_id} "
                    f"also holds pages {sorted(missing)}; pass all of "
                    f"{geometry.pages_of_segment(segment_id)}"
                )
        if self.wait_before_unmap is not None and segment_ids:
            self.wait_before_unmap(segment_ids)
        with self._lock:
            self._check_open()
            victims = [self._segments[s] for s in segment_ids if s in self._segments]
            if not victims:
                return []
            if self.before_segment_unmapped is not None:
                for segment in victims:
                    self.before_segment_unmapped(segment)
            self.backend.synchronize()
            for segment in victims:
                del self._segments[segment.segment_id]
                self._destroy_segment(segment)
            return [p for s in victims for p in s.pages]

    def close(self) -> None:
        """Unmap every page (callbacks included) and free the reservations.

        Views of ``tensors`` must not be used afterwards: their addresses are
        no longer reserved.
        """
        mapped = self.mapped_pages()
        if mapped:
            self.unmap_pages(mapped)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.tensors = []
            for base, nbytes in zip(self._bases, self.geometry.tensor_bytes):
                self.backend.free_reservation(base, nbytes)

    # -- internals --------------------------------------------------------
    def _segment_ids(self, page_ids: Iterable[int]) -> set[int]:
        pages = set(page_ids)
        if pages and (min(pages) < 0 or max(pages) >= self.geometry.num_pages):
            bad = sorted(p for p in pages if not 0 <= p < self.geometry.num_pages)
            raise ValueError(
                f"page ids {bad} are outside [0, {self.geometry.num_pages}) of "
                f"{self.geometry}"
            )
        per_segment = self.geometry.pages_per_segment
        if per_segment == 1:
            return pages
        return {p // per_segment for p in pages}

    def _check_open(self) -> None:
        if self._closed:
            raise VmmError("the KV page table is closed")

    def _create_segment(self, segment_id: int) -> Segment:
        geometry = self.geometry
        create = self.backend.create
        map_ = self.backend.map
        chunks: list[SegmentChunk] = []
        try:
            for t, region, region_base, nbytes in self._chunk_layout:
                va = region_base + segment_id * nbytes
                handle = create(nbytes)
                try:
                    map_(va, nbytes, handle)
                except BaseException:
                    self.backend.release(handle)
                    raise
                chunks.append(
                    _make_tuple(SegmentChunk, (t, region, va, nbytes, handle))
                )
        except BaseException:
            for chunk in chunks:
                self.backend.unmap(chunk.va, chunk.nbytes)
                self.backend.release(chunk.handle)
            raise
        first = segment_id * geometry.pages_per_segment
        last = first + geometry.pages_per_segment
        bpp = geometry.blocks_per_page
        return _make_tuple(
            Segment,
            (
                segment_id,
                range(first, last),
                range(first * bpp, last * bpp),
                tuple(chunks),
            ),
        )

    def _set_access(self, segments: list[Segment]) -> None:
        # One call per run of adjacent chunks: adjacent segments of a region,
        # and the last segment of one region with the first of the next, are
        # contiguous in the reservation.
        if len(segments) == 1 and len(segments[0].chunks) == 1:
            chunk = segments[0].chunks[0]
            self.backend.set_access(chunk.va, chunk.nbytes)
            return
        ranges = sorted([(c.va, c.nbytes) for s in segments for c in s.chunks])
        run_start, run_bytes = ranges[0]
        for va, nbytes in ranges[1:]:
            if va == run_start + run_bytes:
                run_bytes += nbytes
                continue
            self.backend.set_access(run_start, run_bytes)
            run_start, run_bytes = va, nbytes
        self.backend.set_access(run_start, run_bytes)

    def _destroy_segment(self, segment: Segment) -> None:
        for chunk in segment.chunks:
            self.backend.unmap(chunk.va, chunk.nbytes)
            self.backend.release(chunk.handle)
