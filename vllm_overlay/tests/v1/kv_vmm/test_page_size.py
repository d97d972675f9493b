# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many blocks a KV page holds: enough for --kv-cache-vmm-page-bytes when
given, otherwise the smallest unit every rank can map (one granule per KV
tensor region)."""

import pytest

from tests.v1.kv_vmm.utils import requires_vmm_kv_wiring
from vllm.config import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_vmm import KVPageGeometry, KVTensorLayout
from vllm.v1.kv_vmm.pages import kv_page_multiple

pytestmark = requires_vmm_kv_wiring

MiB = 1 << 20

# 36 layers split K/V, 64 KiB per block: a 2 MiB granule holds 32 blocks per
# region, so the smallest page is 32 blocks = 72 allocations of 2 MiB.
LAYERS = [KVTensorLayout(block_bytes=64 * 1024, num_regions=2)] * 36
UNIT = KVPageGeometry(LAYERS, num_blocks=32, granularity=2 * MiB)


def vmm(**kwargs) -> CacheConfig:
    return CacheConfig(kv_cache_memory_backend="vmm", **kwargs)


def test_default_pages_are_the_smallest_mappable_unit():
    assert UNIT.page_bytes == 144 * MiB
    assert kv_page_multiple(vmm(), [UNIT], 1000) == 1
    assert kv_page_multiple(vmm(), [UNIT], 1) == 1


def test_explicit_page_bytes_round_up_on_the_largest_rank():
    # Pipeline ranks with 36 and 24 layers: the page is at least the asked
    # size on the larger one.
    small = KVPageGeometry(LAYERS[:24], num_blocks=32, granularity=2 * MiB)
    config = vmm(kv_cache_vmm_page_bytes=1 << 30)
    assert kv_page_multiple(config, [small, UNIT], 1000) == -(-1024 // 144)
    # A size below the smallest unit gives the smallest unit.
    assert kv_page_multiple(vmm(kv_cache_vmm_page_bytes=1), [UNIT], 1000) == 1


def test_page_larger_than_the_cache_is_refused():
    config = vmm(kv_cache_vmm_page_bytes=10 * 144 * MiB + 1)
    with pytest.raises(ValueError, match="--kv-cache-vmm-page-bytes .* larger than"):
        kv_page_multiple(config, [UNIT], 10)


def test_cli_takes_human_readable_sizes():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--kv-cache-vmm-page-bytes", "1G"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_cache_vmm_page_bytes == 1 << 30
    default = EngineArgs.from_cli_args(parser.parse_args([]))
    assert default.kv_cache_vmm_page_bytes is None
