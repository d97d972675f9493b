# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Blocks-to-pages arithmetic for KV tensors that share block ids.

Pure arithmetic, no memory and no tensor: the scheduler, which owns the
block pool, uses it to decide which pages to map or unmap, and the workers
use the same object (built from the same numbers) to apply that decision.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVTensorLayout:
    """How the blocks of one KV tensor are laid out in memory.

    A KV tensor is ``num_regions`` equal regions one after the other, and
    each region holds every block back to back, ``block_bytes //
    num_regions`` bytes per block. ``num_regions`` is 1 when the block
    dimension is the outermost one (e.g. ``(num_blocks, 2, ...)``) and 2 when
    a K/V dimension comes before it (e.g. ``(2, num_blocks, ...)``). The order
    of the dimensions inside a block (NHD, HND) does not matter here.
    """

    block_bytes: int
    num_regions: int = 1

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.num_regions <= 0:
            raise ValueError(f"invalid layout {self}")
        if self.block_bytes % self.num_regions:
            raise ValueError(
                f"block_bytes {self.block_bytes} is not divisible by "
                f"num_regions {self.num_regions}"
            )

    @property
    def region_block_bytes(self) -> int:
        return self.block_bytes // self.num_regions


class KVPageGeometry:
    """Page arithmetic for a group of KV tensors sharing block ids.

    A *page* is the smallest unit that can be mapped: ``blocks_per_page``
    consecutive block ids, in every region of every tensor of the group.
    ``blocks_per_page`` is the smallest block count whose bytes are a whole
    number of granules in every region, so no block straddles two pages and
    pages never share physical memory.

    A *segment* is ``pages_per_segment`` consecutive pages whose memory is one
    physical allocation per tensor region: the unit of allocation and of
    registration with a KV connector. Mapping and unmapping happen in whole
    segments; with the default of one page per segment they are the same.

    Args:
        layouts: one layout per KV tensor of the group.
        num_blocks: block ids the tensors must address (virtual capacity);
            rounded up to whole segments.
        granularity: backend granularity in bytes.
        pages_per_segment: pages per physical allocation.

    """

    def __init__(
        self,
        layouts: Iterable[KVTensorLayout],
        num_blocks: int,
        granularity: int,
        pages_per_segment: int = 1,
    ) -> None:
        self.layouts = tuple(layouts)
        if not self.layouts:
            raise ValueError("a page geometry needs at least one KV tensor")
        if num_blocks <= 0 or granularity <= 0 or pages_per_segment <= 0:
            raise ValueError(
                f"num_blocks ({num_blocks}), granularity ({granularity}) and "
                f"pages_per_segment ({pages_per_segment}) must be positive"
            )
        self.granularity = granularity
        self.pages_per_segment = pages_per_segment
        self.blocks_per_page = math.lcm(
            *(
                granularity // math.gcd(granularity, layout.region_block_bytes)
                for layout in self.layouts
            )
        )
        blocks_per_segment = self.blocks_per_page * pages_per_segment
        self.num_segments = -(-num_blocks // blocks_per_segment)
        self.num_pages = self.num_segments * pages_per_segment
        self.num_blocks = self.num_pages * self.blocks_per_page
        #: Bytes of one page in one region of each tensor.
        self.page_region_bytes = tuple(
            self.blocks_per_page * layout.region_block_bytes for layout in self.layouts
        )
        #: Bytes of one region of each tensor (the stride of its outer dim).
        self.region_bytes = tuple(
            self.num_blocks * layout.region_block_bytes for layout in self.layouts
        )
        #: Virtual size of each tensor.
        self.tensor_bytes = tuple(
            layout.num_regions * region
            for layout, region in zip(self.layouts, self.region_bytes)
        )
        #: Physical bytes one page takes across all tensors of the group.
        self.page_bytes = sum(
            layout.num_regions * nbytes
            for layout, nbytes in zip(self.layouts, self.page_region_bytes)
        )

    def __repr__(self) -> str:
        return (
            f"KVPageGeometry(tensors={len(self.layouts)}, "
            f"num_blocks={self.num_blocks}, blocks_per_page={self.blocks_per_page}, "
            f"num_pages={self.num_pages}, pages_per_segment={self.pages_per_segment}, "
            f"page_bytes={self.page_bytes})"
        )

    def check_page(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(
                f"page id {page_id} is outside [0, {self.num_pages}) of {self}"
            )

    def page_of_block(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"block id {block_id} is outside [0, {self.num_blocks}) of {self}"
            )
        return block_id // self.blocks_per_page

    def pages_for_blocks(self, block_ids: Iterable[int]) -> list[int]:
        """Sorted page ids that must be mapped for ``block_ids`` to be usable."""
        return sorted({self.page_of_block(b) for b in block_ids})

    def blocks_of_page(self, page_id: int) -> range:
        self.check_page(page_id)
        start = page_id * self.blocks_per_page
        return range(start, start + self.blocks_per_page)

    def segment_of_page(self, page_id: int) -> int:
        self.check_page(page_id)
        return page_id // self.pages_per_segment

    def pages_of_segment(self, segment_id: int) -> range:
        start = segment_id * self.pages_per_segment
        return range(start, start + self.pages_per_segment)

    def pages_for_bytes(self, nbytes: int) -> int:
        """Whole segments' worth of pages that fit in ``nbytes`` of memory."""
        segment_bytes = self.page_bytes * self.pages_per_segment
        return (nbytes // segment_bytes) * self.pages_per_segment

    def region_offset(self, tensor_index: int, region: int, page_id: int) -> int:
        """Byte offset of ``page_id`` in ``region`` of a tensor."""
        return (
            region * self.region_bytes[tensor_index]
            + page_id * self.page_region_bytes[tensor_index]
        )
