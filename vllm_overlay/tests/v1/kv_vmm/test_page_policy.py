# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The page policy of VMM-backed KV memory (vllm/v1/kv_vmm/pages.py over
page_policy.py and kv_layout.py), without the scheduler's pool or the engine
options: how many blocks a page holds (--kv-cache-vmm-page-bytes when given,
otherwise, on CUDA, enough for physical allocations of KV_PAGE_MIN_CHUNK_BYTES
per tensor region while the KV cache keeps at least KV_PAGE_MIN_COUNT pages),
the pages mapped at startup and the most blocks one step allocates.

The options are passed as the KVVmmOptions protocol the policy reads; the
engine's CacheConfig with the option is test_page_size.py's."""

from dataclasses import dataclass
from typing import Literal

import pytest

from vllm.v1.kv_vmm import KVPageGeometry, KVTensorLayout
from vllm.v1.kv_vmm.pages import (
    KV_PAGE_MIN_CHUNK_BYTES,
    KV_PAGE_MIN_COUNT,
    KVPagePolicy,
    KVPageShrinkPolicy,
    KVVmmOptions,
    initial_kv_pages,
    kv_page_multiple,
    kv_step_blocks,
)

MiB = 1 << 20
BPP = 4  # blocks per page

# 36 layers split K/V, 64 KiB per block: a 2 MiB granule holds 32 blocks per
# region, so the smallest page is 32 blocks = 72 allocations of 2 MiB.
LAYERS = [KVTensorLayout(block_bytes=64 * 1024, num_regions=2)] * 36
UNIT = KVPageGeometry(LAYERS, num_blocks=32, granularity=2 * MiB)


@dataclass
class VmmOptions:
    """The options of KVVmmOptions with the engine's defaults."""

    gpu_memory_utilization: float = 0.9
    kv_cache_memory_backend: Literal["default", "vmm"] = "vmm"
    kv_cache_vmm_headroom_pages: int = 1
    kv_cache_vmm_page_bytes: int | None = None
    kv_cache_vmm_max_pages: int | None = None
    kv_cache_vmm_shrink: KVPageShrinkPolicy = "idle"
    kv_cache_vmm_shrink_delay: float = 10.0
    kv_cache_vmm_limit_bytes: int | None = None


def vmm(**kwargs) -> KVVmmOptions:
    return VmmOptions(**kwargs)


def test_unit_pages_without_a_chunk_floor():
    assert UNIT.page_bytes == 144 * MiB
    assert kv_page_multiple(vmm(), [UNIT], 1000, min_chunk_bytes=0) == 1


@pytest.mark.parametrize(
    "region_block_bytes, min_chunk_mib, multiple",
    [
        (64 * 1024, 16, 8),
        (64 * 1024, 64, 32),
        (128 * 1024, 16, 8),
        (96 * 1024, 16, 3),
        (96 * 1024, 64, 11),
        (12 * MiB, 16, 2),
        (12 * MiB, 64, 6),
        (16 * MiB, 16, 1),
        (16 * MiB, 64, 4),
    ],
)
def test_chunk_floor(region_block_bytes, min_chunk_mib, multiple):
    layout = KVTensorLayout(block_bytes=2 * region_block_bytes, num_regions=2)
    unit = KVPageGeometry([layout] * 4, num_blocks=1, granularity=2 * MiB)
    got = kv_page_multiple(vmm(), [unit], 10_000, min_chunk_mib * MiB)
    assert got == multiple
    assert got * unit.page_region_bytes[0] >= min_chunk_mib * MiB
    # The smallest multiple that reaches the floor.
    assert (got - 1) * unit.page_region_bytes[0] < min_chunk_mib * MiB


def test_default_pages_are_the_smallest_unit():
    # Pages are mapped ahead of demand, so the default needs no floor above
    # one granule per region: the smallest unit every rank can map.
    assert UNIT.page_region_bytes[0] == KV_PAGE_MIN_CHUNK_BYTES
    assert kv_page_multiple(vmm(), [UNIT], 1000, KV_PAGE_MIN_CHUNK_BYTES) == 1


def test_chunk_floor_keeps_a_small_cache_elastic():
    # 40 smallest pages: allocations of a 64 MiB floor would leave one or a
    # few pages; the cache keeps at least KV_PAGE_MIN_COUNT.
    floor = 64 * MiB
    assert 40 * UNIT.page_region_bytes[0] // floor < KV_PAGE_MIN_COUNT
    got = kv_page_multiple(vmm(), [UNIT], 40, floor)
    assert got == 40 // KV_PAGE_MIN_COUNT == 2
    assert kv_page_multiple(vmm(), [UNIT], 10, floor) == 1


def test_explicit_page_bytes_are_per_device():
    # Pipeline ranks with 36 and 24 layers on a GPU each: the page is at
    # least the asked size on the larger one.
    small = KVPageGeometry(LAYERS[:24], num_blocks=32, granularity=2 * MiB)
    options = vmm(kv_cache_vmm_page_bytes=1 << 30)
    gpus = ["GPU-0", "GPU-1"]
    assert kv_page_multiple(
        options, [small, UNIT], 1000, KV_PAGE_MIN_CHUNK_BYTES, device_keys=gpus
    ) == -(-1024 // 144)
    # Both ranks on the host device (the CPU engine): their units add up there.
    assert kv_page_multiple(options, [small, UNIT], 1000, 0) == -(-1024 // (96 + 144))
    assert kv_page_multiple(
        options, [small, UNIT], 1000, 0, device_keys=["host", "host"]
    ) == -(-1024 // (96 + 144))
    # An explicit size wins over the floor, small pages included.
    assert kv_page_multiple(vmm(kv_cache_vmm_page_bytes=1), [UNIT], 1000, 16 * MiB) == 1


def test_page_larger_than_the_cache_is_refused():
    options = vmm(kv_cache_vmm_page_bytes=10 * 144 * MiB + 1)
    with pytest.raises(ValueError, match="--kv-cache-vmm-page-bytes .* larger than"):
        kv_page_multiple(options, [UNIT], 10, 0)


def test_startup_mapping_is_capped_by_the_limit():
    policy = KVPagePolicy(
        granularity=2 << 20, blocks_per_page=BPP, max_pages=2, ahead_blocks=100
    )
    assert initial_kv_pages(policy) == [0, 1]
    policy.ahead_blocks = 0
    policy.headroom_pages = 0
    assert initial_kv_pages(policy) == [0]


def test_step_blocks_bound():
    # 8192 tokens in 16-token blocks, plus one partly filled block per request.
    assert kv_step_blocks(8192, 256, [16]) == 512 + 256
    # A step never schedules more requests than tokens.
    assert kv_step_blocks(64, 1024, [16]) == 4 + 64
    # Each KV cache group allocates its own blocks from the shared pool.
    assert kv_step_blocks(8192, 256, [16, 32]) == (512 + 256) + (256 + 256)
