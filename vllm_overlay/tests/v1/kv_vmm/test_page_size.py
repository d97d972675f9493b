# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""--kv-cache-vmm-page-bytes through the engine: the CLI's sizes and the
engine's CacheConfig as the options the page policy reads. How many blocks a
page holds, for any options, is test_page_policy.py's."""

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
    requires_vmm_kv_wiring,
)
from vllm.config import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_vmm import KVPageGeometry, KVTensorLayout
from vllm.v1.kv_vmm.pages import KV_PAGE_MIN_CHUNK_BYTES, kv_page_multiple

pytestmark = requires_vmm_kv_wiring

MiB = 1 << 20

# 36 layers split K/V, 64 KiB per block: the smallest page is 144 MiB.
LAYERS = [KVTensorLayout(block_bytes=64 * 1024, num_regions=2)] * 36
UNIT = KVPageGeometry(LAYERS, num_blocks=32, granularity=2 * MiB)


def vmm(**kwargs) -> CacheConfig:
    return CacheConfig(kv_cache_memory_backend="vmm", **kwargs)


def test_the_cache_config_option_sizes_the_page():
    # Unset: the smallest unit; given: at least that size, and never larger
    # than the cache.
    assert kv_page_multiple(vmm(), [UNIT], 1000, KV_PAGE_MIN_CHUNK_BYTES) == 1
    config = vmm(kv_cache_vmm_page_bytes=1 << 30)
    assert kv_page_multiple(config, [UNIT], 1000, 0) == -(-1024 // 144)
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
