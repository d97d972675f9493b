# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One unit for every byte figure of VMM-backed KV memory: bytes per device,
on the device that holds the most of the engine's KV memory (the largest
rank's share with one rank per GPU, the ranks' sum where they share the host
backend's device), the unit the device ledger counts in.

Two ranks' KV cache configs, planned by the release's own planner, on two
GPUs (one rank each) and on the host device (both ranks): the same number of
bytes gives the same page limit through --kv-cache-vmm-limit-bytes, the
runtime limit (the Python API and the HTTP route's query), and the counters
and the metrics show it back in the same unit (the device ledger's:
test_byte_units_shared.py). The ledger CLI reads a size as those flags do."""

import pytest
import torch

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
    requires_vmm_kv_wiring,
    write_tiny_llama_config,
)
from tests.v1.kv_vmm.pool_utils import Clock, make_block_pool
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.v1.kv_cache_compat import get_kv_cache_configs, set_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.kv_vmm.ledger_cli import UsageError, parse_bytes
from vllm.v1.kv_vmm.pages import (
    KV_PAGE_GRANULARITY,
    KVPagePolicy,
    kv_page_geometry,
    kv_page_limit_arguments,
    kv_page_limit_result,
    make_kv_page_policy,
    parse_kv_page_limit,
)
from vllm.v1.kv_vmm.scheduler import PagedBlockPool
from vllm.v1.serial_utils import MsgpackEncoder

pytestmark = [requires_vmm_kv_wiring, pytest.mark.skip_global_cleanup]

# Ranks of one engine: two TP ranks (equal shares), or two pipeline stages
# with 3 and 1 layers (the first holds the most).
SHAPES = {"tp2": (2, 1, [2, 2]), "pp2": (1, 2, [3, 1])}
# Where the ranks' KV memory lives: a GPU each, or both on the host device.
DEVICES = {"two-gpus": ["GPU-units-0", "GPU-units-1"], "host": ["host", "host"]}


def rank_configs(tmp_path, shape: str) -> list[KVCacheConfig]:
    tp, pp, layers = SHAPES[shape]
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    write_tiny_llama_config(
        model_dir,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        num_hidden_layers=sum(layers) // tp,
        vocab_size=1024,
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, max_model_len=1024
        ),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp
        ),
    )
    set_kv_cache_layout(vllm_config, "LBNHC")
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8 // tp, head_size=64, dtype=torch.float16
    )
    first = 0
    specs = []
    for n in layers:
        specs.append({f"model.layers.{first + i}.attn": spec for i in range(n)})
        first += n if pp > 1 else 0
    # 4096 blocks' worth of the largest rank's layers, on every rank.
    memory = max(layers) * spec.page_size_bytes * 4096
    return get_kv_cache_configs(vllm_config, specs, [memory] * len(layers))


def vmm_options(**kwargs) -> CacheConfig:
    return CacheConfig(kv_cache_memory_backend="vmm", **kwargs)


def make_pool(policy: KVPagePolicy, configs: list[KVCacheConfig]) -> PagedBlockPool:
    return make_block_pool(policy, min(c.num_blocks for c in configs), Clock(0.0))


@pytest.mark.parametrize("devices", list(DEVICES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_same_bytes_give_the_same_pages_everywhere(tmp_path, shape, devices):
    configs = rank_configs(tmp_path, shape)
    keys = DEVICES[devices]
    policy = make_kv_page_policy(vmm_options(), configs, device_keys=keys)
    rank_bytes = [
        kv_page_geometry(c, KV_PAGE_GRANULARITY, policy.blocks_per_page).page_bytes
        for c in configs
    ]
    assert rank_bytes[0] >= rank_bytes[1] > 0
    # The unit: the largest rank's page on its own GPU, both ranks' on the
    # host device they share.
    page = sum(rank_bytes) if devices == "host" else rank_bytes[0]
    assert policy.device_page_bytes == page
    capacity = -(-configs[0].num_blocks // policy.blocks_per_page)
    assert capacity > 6
    limit = 5 * page + page // 2  # five pages and a half: five pages

    # --kv-cache-vmm-limit-bytes
    flagged = make_kv_page_policy(
        vmm_options(kv_cache_vmm_limit_bytes=limit), configs, device_keys=keys
    )
    assert flagged.max_pages == 5 and flagged.device_page_bytes == page

    # set_kv_cache_page_limit(max_bytes=): the pool the engine core calls.
    pool = make_pool(policy, configs)
    counters = pool.set_page_limit(max_bytes=limit)
    assert counters["kv_page_limit"] == 5
    assert counters["kv_limit_bytes"] == 5 * page
    assert counters["kv_page_bytes"] == page
    assert counters["kv_mapped_bytes"] == counters["kv_pages_mapped"] * page
    stats = pool.make_page_stats()  # what the metrics show
    assert stats.limit_bytes == 5 * page
    assert stats.mapped_bytes == stats.mapped_pages * page

    # POST /kv_cache/page_limit?max_bytes=: the query as the route reads it,
    # handed to the same pool (the route itself: the runtime-limit patch's
    # test and tests/engine/test_vmm_kv_page_limit_server.py).
    pool.set_page_limit(max_pages=1)
    query = parse_kv_page_limit(None, str(limit))
    assert query == (None, limit)
    answer = kv_page_limit_result(pool.set_page_limit(*query))
    assert answer["kv_page_limit"] == 5 and answer["kv_limit_bytes"] == 5 * page


@pytest.mark.parametrize("name", ["max_pages", "max_bytes"])
def test_a_runtime_limit_no_device_has_is_refused_before_the_engine(name):
    """A limit above 2^60 (the largest size the device ledger holds) is no
    limit of any device: refused with the bound, as the ledger CLI refuses it,
    instead of failing to cross to the engine core (msgpack carries no int
    above 2^64 - 1: the route answered 500)."""
    most = 1 << 60
    ok = {name: most}
    assert kv_page_limit_arguments(**ok) == (ok.get("max_pages"), ok.get("max_bytes"))
    MsgpackEncoder().encode((most, None))
    for value in (most + 1, 1 << 64, 10**30):
        with pytest.raises(ValueError, match=f"{name} must be at most {most}"):
            kv_page_limit_arguments(**{name: value})
        with pytest.raises(ValueError, match=f"{name} must be at most {most}"):
            parse_kv_page_limit(**{name: str(value)})


def test_a_flag_below_one_page_is_refused_and_beyond_the_capacity_lowered(
    tmp_path,
):
    configs = rank_configs(tmp_path, "tp2")
    keys = DEVICES["two-gpus"]
    base = make_kv_page_policy(vmm_options(), configs, device_keys=keys)
    page = base.device_page_bytes
    capacity = -(-configs[0].num_blocks // base.blocks_per_page)
    with pytest.raises(ValueError, match="less than one KV cache page"):
        make_kv_page_policy(
            vmm_options(kv_cache_vmm_limit_bytes=page - 1), configs, device_keys=keys
        )
    huge = make_kv_page_policy(
        vmm_options(kv_cache_vmm_limit_bytes=1 << 50), configs, device_keys=keys
    )
    assert huge.max_pages == capacity
    pages = make_kv_page_policy(
        vmm_options(kv_cache_vmm_max_pages=10 * capacity), configs, device_keys=keys
    )
    assert pages.max_pages == capacity
    both = make_kv_page_policy(
        vmm_options(kv_cache_vmm_max_pages=2, kv_cache_vmm_limit_bytes=4 * page),
        configs,
        device_keys=keys,
    )
    assert both.max_pages == 2


def test_the_ledger_cli_reads_sizes_as_the_engine_flags_do():
    """The ledger CLI (``set --limit-bytes``, ``capacity``) reads a size as
    --kv-cache-vmm-limit-bytes (and --kv-cache-memory-bytes) read it."""
    import argparse

    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import get_kwargs

    flag = get_kwargs(CacheConfig)["kv_cache_vmm_limit_bytes"]["type"]
    for text in ("4096", "512M", "512m", "1G", "1.5g", "2T", "8k"):
        assert parse_bytes(text) == flag(text), text
    for text in ("1GiB", "1.5G", "lots"):
        with pytest.raises((ValueError, argparse.ArgumentTypeError)):
            flag(text)
        with pytest.raises(UsageError):
            parse_bytes(text)
