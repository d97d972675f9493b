# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many blocks a KV page holds: --kv-cache-vmm-page-bytes when given,
otherwise (on CUDA) enough for physical allocations of KV_PAGE_MIN_CHUNK_BYTES
per tensor region while the KV cache keeps at least KV_PAGE_MIN_COUNT pages."""

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
    requires_vmm_kv_wiring,
)
from vllm.config import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_vmm import KVPageGeometry, KVTensorLayout
from vllm.v1.kv_vmm.pages import (
    KV_PAGE_MIN_CHUNK_BYTES,
    KV_PAGE_MIN_COUNT,
    kv_page_multiple,
)

pytestmark = requires_vmm_kv_wiring

MiB = 1 << 20

# 36 layers split K/V, 64 KiB per block: a 2 MiB granule holds 32 blocks per
# region, so the smallest page is 32 blocks = 72 allocations of 2 MiB.
LAYERS = [KVTensorLayout(block_bytes=64 * 1024, num_regions=2)] * 36
UNIT = KVPageGeometry(LAYERS, num_blocks=32, granularity=2 * MiB)


def vmm(**kwargs) -> CacheConfig:
    return CacheConfig(kv_cache_memory_backend="vmm", **kwargs)


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
    config = vmm(kv_cache_vmm_page_bytes=1 << 30)
    gpus = ["GPU-0", "GPU-1"]
    assert kv_page_multiple(
        config, [small, UNIT], 1000, KV_PAGE_MIN_CHUNK_BYTES, device_keys=gpus
    ) == -(-1024 // 144)
    # Both ranks on the host device (the CPU engine): their units add up there.
    assert kv_page_multiple(config, [small, UNIT], 1000, 0) == -(-1024 // (96 + 144))
    assert kv_page_multiple(
        config, [small, UNIT], 1000, 0, device_keys=["host", "host"]
    ) == -(-1024 // (96 + 144))
    # An explicit size wins over the floor, small pages included.
    assert kv_page_multiple(vmm(kv_cache_vmm_page_bytes=1), [UNIT], 1000, 16 * MiB) == 1


def test_page_larger_than_the_cache_is_refused():
    config = vmm(kv_cache_vmm_page_bytes=10 * 144 * MiB + 1)
    with pytest.raises(ValueError, match="--kv-cache-vmm-page-bytes .* larger than"):
        kv_page_multiple(config, [UNIT], 10, 0)


def test_cli_takes_human_readable_sizes(tmp_path):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    # A local model directory: with HF_HUB_OFFLINE=1 EngineArgs resolves a
    # hub name (the default model) against a cache that may be empty.
    model = ["--model", str(tmp_path)]
    args = parser.parse_args([*model, "--kv-cache-vmm-page-bytes", "1G"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_cache_vmm_page_bytes == 1 << 30
    default = EngineArgs.from_cli_args(parser.parse_args(model))
    assert default.kv_cache_vmm_page_bytes is None
