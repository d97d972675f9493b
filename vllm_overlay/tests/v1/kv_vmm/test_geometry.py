# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Blocks-to-pages arithmetic (no memory involved)."""

import pytest

from vllm.v1.kv_vmm import KVPageGeometry, KVTensorLayout

MiB = 1 << 20


def test_kv_split_layout_pages():
    # (2, num_blocks, 16 tokens, 8 heads, 64) bf16: 32 KiB per block, 16 KiB
    # per block in each of the K and V regions.
    layout = KVTensorLayout(block_bytes=2 * 16 * 8 * 64 * 2, num_regions=2)
    g = KVPageGeometry([layout] * 3, num_blocks=1000, granularity=2 * MiB)
    assert g.blocks_per_page == 128
    assert g.page_region_bytes == (2 * MiB,) * 3
    assert g.num_pages == 8 and g.num_blocks == 1024
    assert g.region_bytes == (16 * MiB,) * 3
    assert g.tensor_bytes == (32 * MiB,) * 3
    assert g.page_bytes == 3 * 2 * 2 * MiB
    assert g.region_offset(1, 1, 3) == 16 * MiB + 3 * 2 * MiB


def test_mixed_and_odd_block_sizes():
    # MLA-like 576 bf16 values x 64 tokens = 73728 bytes = 2**13 * 9: the
    # smallest whole-granule page holds 256 blocks (nine 2 MiB granules).
    mla = KVTensorLayout(block_bytes=576 * 2 * 64)
    small = KVTensorLayout(block_bytes=64 * 1024)  # 32 blocks per granule
    g = KVPageGeometry([mla, small], num_blocks=300, granularity=2 * MiB)
    assert g.blocks_per_page == 256
    assert g.page_region_bytes == (9 * 2 * MiB, 8 * 2 * MiB)
    assert all(b % (2 * MiB) == 0 for b in g.tensor_bytes)
    assert g.num_pages == 2 and g.num_blocks == 512


def test_blocks_pages_segments():
    g = KVPageGeometry(
        [KVTensorLayout(block_bytes=MiB)],
        num_blocks=9,
        granularity=2 * MiB,
        pages_per_segment=2,
    )
    assert g.blocks_per_page == 2
    # 9 blocks -> 5 pages -> 3 segments of 2 pages -> 12 blocks of capacity.
    assert (g.num_segments, g.num_pages, g.num_blocks) == (3, 6, 12)
    assert g.pages_for_blocks([0, 1, 5, 4, 11]) == [0, 2, 5]
    assert g.blocks_of_page(2) == range(4, 6)
    assert g.segment_of_page(3) == 1
    assert g.pages_of_segment(2) == range(4, 6)
    # Whole segments only: 2 MiB per page, 4 MiB per segment.
    assert g.pages_for_bytes(11 * MiB) == 4
    with pytest.raises(ValueError, match="block id 12"):
        g.page_of_block(12)
    with pytest.raises(ValueError, match="page id 6"):
        g.blocks_of_page(6)


def test_invalid_layouts():
    with pytest.raises(ValueError, match="not divisible"):
        KVTensorLayout(block_bytes=3, num_regions=2)
    with pytest.raises(ValueError, match="at least one"):
        KVPageGeometry([], num_blocks=1, granularity=4096)
