# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV cache admission check, per rank (vllm/v1/core/kv_cache_admission.py).

The first tests drive the check itself with sizing functions whose numbers
they can state exactly; the others go through the engine core's KV cache
planning (`get_kv_cache_configs`, `check_enough_kv_cache_memory`) with the
specs that models' attention layers report, so they test how the release
wires the check in.
"""

import json
from dataclasses import replace

import pytest
import regex as re
import torch

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.utils import get_pp_indices
from vllm.utils.mem_constants import GiB_bytes
from vllm.v1.core.kv_cache_admission import (
    KVCacheSizing,
    check_kv_cache_memory_of_one_rank,
    check_kv_cache_memory_per_rank,
)
from vllm.v1.kv_cache_compat import (
    check_enough_kv_cache_memory,
    get_kv_cache_configs,
    set_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

# Pure configuration tests: no device or distributed state to clean up.
pytestmark = pytest.mark.skip_global_cleanup

# The parallel shape of vLLM issue #43755: TP8 x PP2.
TP, PP = 8, 2


def make_vllm_config(
    tmp_path,
    *,
    tp: int = TP,
    pp: int = PP,
    dcp: int = 1,
    num_kv_heads: int = 8,
    max_model_len: int = 1_000_000,
    block_size: int = 16,
    cache_dtype: str = "auto",
    disable_hybrid_kv_cache_manager: bool | None = False,
    **cache_kwargs,
) -> VllmConfig:
    """A VllmConfig with the given parallel shape; its model is a small local
    Llama config, only used for config validation. The KV cache layout is
    LBNHC; `disable_hybrid_kv_cache_manager=None` leaves the flag as vLLM
    resolves it."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 1024,
                "intermediate_size": 2048,
                "num_attention_heads": 16,
                "num_key_value_heads": num_kv_heads,
                "head_dim": 64,
                "num_hidden_layers": 2,
                "max_position_embeddings": 1 << 21,
                "vocab_size": 1024,
                "torch_dtype": "bfloat16",
            }
        )
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
        ),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(
            block_size=block_size,
            cache_dtype=cache_dtype,
            **cache_kwargs,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            decode_context_parallel_size=dcp,
        ),
    )
    if disable_hybrid_kv_cache_manager is not None:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = (
            disable_hybrid_kv_cache_manager
        )
    set_kv_cache_layout(vllm_config, "LBNHC")
    return vllm_config


def paragraph(message: str, rank: str) -> str:
    """The paragraph of the error that starts with the name of `rank`."""
    [line] = [line for line in message.splitlines() if line.startswith(rank)]
    return line


# The check with sizing functions of its own: a rank needs the sum of its
# layers' `max_memory_usage_bytes`, and holds as many tokens as its memory
# holds at that rate. Grouping keeps one group per spec, so that the hybrid KV
# cache manager's grouping keeps sliding windows.


def _specs_of(groups: list[KVCacheGroupSpec]) -> list[KVCacheSpec]:
    return [group.kv_cache_spec for group in groups for _ in group.layer_names]


def _need(vllm_config: VllmConfig, groups: list[KVCacheGroupSpec]) -> int:
    return sum(spec.max_memory_usage_bytes(vllm_config) for spec in _specs_of(groups))


def _max_len(vllm_config: VllmConfig, groups, available_memory: int) -> int:
    max_model_len = vllm_config.model_config.max_model_len
    return max(0, available_memory) * max_model_len // _need(vllm_config, groups)


def _group_by_spec(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec]):
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    return [KVCacheGroupSpec(names, spec) for spec, names in by_spec.items()]


def _project(groups: list[KVCacheGroupSpec], worker_spec: dict[str, KVCacheSpec]):
    return [
        KVCacheGroupSpec(
            [name for name in group.layer_names if name in worker_spec],
            group.kv_cache_spec,
        )
        for group in groups
    ]


SIZING = KVCacheSizing(
    get_kv_cache_groups=_group_by_spec,
    project_groups_to_worker=_project,
    max_memory_usage_bytes=_need,
    estimate_max_model_len=_max_len,
)
FULL = FullAttentionSpec(
    block_size=16, num_kv_heads=1, head_size=128, dtype=torch.bfloat16
)
# Bytes per token of one FULL layer: K + V, 128 each, bf16.
FULL_BYTES_PER_TOKEN = 2 * 128 * 2


def _layers(start: int, end: int, spec: KVCacheSpec = FULL) -> dict[str, KVCacheSpec]:
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(start, end)}


def _check(vllm_config, worker_specs, available, sizing=SIZING, reported=None):
    groups = _group_by_spec(
        vllm_config, {n: s for w in worker_specs for n, s in w.items()}
    )
    check_kv_cache_memory_per_rank(
        sizing,
        vllm_config,
        [_project(groups, worker_spec) for worker_spec in worker_specs],
        available,
        reported or {n: s for w in worker_specs for n, s in w.items()},
        worker_specs,
    )


def test_rank_fits_exactly_its_need(tmp_path):
    vllm_config = make_vllm_config(tmp_path, tp=1, pp=1, max_model_len=4096)
    workers = [_layers(0, 4)]
    need = 4 * FULL_BYTES_PER_TOKEN * 4096

    _check(vllm_config, workers, [need])
    with pytest.raises(ValueError) as exc_info:
        _check(vllm_config, workers, [need - FULL_BYTES_PER_TOKEN])

    message = str(exc_info.value)
    assert message.startswith(
        "Not enough KV cache memory on 1 of 1 rank(s) to serve one request "
        "with the model's max seq len (4096)."
    )
    rank = paragraph(message, "PP stage 0 / TP rank 0, layers 0-3")
    assert f"needs {need / GiB_bytes:.2f} GiB" in rank
    assert "it can hold at most 4095 tokens." in rank
    assert "Need by layer kind: 4 x FullAttention (1x128 bfloat16):" in rank
    assert "lower --max-model-len to 4095 or less" in message
    assert "add pipeline stages" in message
    assert "hybrid KV cache manager" not in message


def test_ranks_failing_alike_share_a_paragraph(tmp_path):
    """Ranks are checked against their own memory; the TP ranks of a stage
    that fail alike are named together, ranks that fit not at all."""
    vllm_config = make_vllm_config(tmp_path, tp=2, pp=2, max_model_len=1024)
    workers = [_layers(0, 2)] * 2 + [_layers(2, 4)] * 2
    need = 2 * FULL_BYTES_PER_TOKEN * 1024

    with pytest.raises(ValueError) as exc_info:
        _check(vllm_config, workers, [need, need, need // 2, need // 2])

    message = str(exc_info.value)
    assert "on 2 of 4 rank(s)" in message
    stage1 = paragraph(message, "PP stage 1 / TP ranks 0-1, layers 2-3")
    assert "it can hold at most 512 tokens." in stage1
    assert "PP stage 0" not in message
    assert "memory of other ranks and KV offloading do not count" in message


def test_ranks_failing_differently_get_a_paragraph_each(tmp_path):
    vllm_config = make_vllm_config(tmp_path, tp=2, pp=1, max_model_len=1024)
    workers = [_layers(0, 1)] * 2
    need = FULL_BYTES_PER_TOKEN * 1024

    with pytest.raises(ValueError) as exc_info:
        _check(vllm_config, workers, [need // 2, need // 4])

    message = str(exc_info.value)
    assert "at most 512 tokens" in paragraph(message, "PP stage 0 / TP rank 0,")
    assert "at most 256 tokens" in paragraph(message, "PP stage 0 / TP rank 1,")
    # The length that fits every rank.
    assert "lower --max-model-len to 256 or less" in message
    # One layer per rank: more pipeline stages would not help.
    assert "add pipeline stages" not in message


def test_workers_of_an_unknown_layout_are_named_by_index(tmp_path):
    vllm_config = make_vllm_config(tmp_path, tp=1, pp=1, max_model_len=1024)
    workers = [_layers(0, 1)] * 4

    with pytest.raises(ValueError) as exc_info:
        _check(vllm_config, workers, [0, 0, 1 << 30, 0])

    assert "\nWorkers 0-1, 3, layers 0 (1 KV cache layers): " in str(exc_info.value)


def test_rank_without_kv_cache_layers_needs_no_memory(tmp_path):
    vllm_config = make_vllm_config(tmp_path, tp=1, pp=2, max_model_len=1024)
    workers = [_layers(0, 2), {}]

    _check(vllm_config, workers, [2 * FULL_BYTES_PER_TOKEN * 1024, 0])


def test_rank_without_memory(tmp_path):
    vllm_config = make_vllm_config(tmp_path, tp=1, pp=2, max_model_len=1024)
    workers = [_layers(0, 2), _layers(2, 4)]

    with pytest.raises(ValueError) as exc_info:
        _check(vllm_config, workers, [1 << 30, 0])

    message = str(exc_info.value)
    assert (
        "PP stage 1 / TP rank 0, layers 2-3 (2 KV cache layers): no memory is "
        "available for the cache blocks (0.00 GiB)." in message
    )
    assert "--max-model-len" not in message


@pytest.mark.parametrize("sets_cpu_memory", [False, True])
def test_memory_utilization_fix_names_the_cpu_backend_where_it_applies(
    tmp_path, sets_cpu_memory
):
    vllm_config = make_vllm_config(tmp_path, tp=1, pp=1, max_model_len=1024)
    sizing = replace(SIZING, gpu_memory_utilization_sets_cpu_memory=sets_cpu_memory)

    with pytest.raises(ValueError) as exc_info:
        _check(vllm_config, [_layers(0, 1)], [1024], sizing=sizing)

    assert ("on the CPU backend" in str(exc_info.value)) == sets_cpu_memory


def _promoted_workers():
    """Two sliding-window layers reported, grouped as full attention as the
    grouping without the hybrid KV cache manager does, and one full layer."""
    window = SlidingWindowSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.bfloat16,
        sliding_window=64,
    )
    reported = {**_layers(0, 2, window), **_layers(2, 3)}
    effective = _layers(0, 3)
    return reported, effective


@pytest.mark.parametrize("hybrid_grouping", [True, False])
def test_promoted_local_attention_is_named_with_its_cost(tmp_path, hybrid_grouping):
    vllm_config = make_vllm_config(
        tmp_path,
        tp=1,
        pp=1,
        max_model_len=65536,
        disable_hybrid_kv_cache_manager=True,
    )
    reported, effective = _promoted_workers()
    hybrid_flags = []

    def get_kv_cache_groups(vllm_config, specs):
        hybrid_flags.append(
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        )
        if not hybrid_grouping:
            raise NotImplementedError
        return _group_by_spec(vllm_config, specs)

    sizing = replace(SIZING, get_kv_cache_groups=get_kv_cache_groups)
    full_need = 3 * FULL_BYTES_PER_TOKEN * 65536
    window_need = (
        reported["model.layers.0.self_attn.attn"].max_memory_usage_bytes(vllm_config)
        * 2
    )

    with pytest.raises(ValueError) as exc_info:
        check_kv_cache_memory_per_rank(
            sizing,
            vllm_config,
            [_group_by_spec(vllm_config, effective)],
            [full_need // 2],
            reported,
            [reported],
        )

    rank = paragraph(str(exc_info.value), "PP stage 0 / TP rank 0")
    assert "2 x SlidingWindow (1x128 bfloat16, window 64) promoted to full" in rank
    assert "1 x FullAttention (1x128 bfloat16)" in rank
    promoted = 2 * FULL_BYTES_PER_TOKEN * 65536
    assert (
        "so 2 sliding-window or chunked-local caches were promoted to full "
        f"length: they take {promoted / GiB_bytes:.2f} GiB here instead of "
        f"{window_need / GiB_bytes:.2f} GiB" in rank
    )
    assert "drop --disable-hybrid-kv-cache-manager" in str(exc_info.value)
    # The grouping of the hybrid manager is asked for, and the flag restored.
    assert hybrid_flags == [False]
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True
    hybrid_need = window_need + FULL_BYTES_PER_TOKEN * 65536
    assert (
        f"With the hybrid KV cache manager this rank would need "
        f"{hybrid_need / GiB_bytes:.2f} GiB and would fit." in rank
    ) == hybrid_grouping


@pytest.mark.parametrize("null_block", [0, 4096])
def test_one_rank_check_reserves_the_null_block(tmp_path, null_block):
    vllm_config = make_vllm_config(tmp_path, tp=1, pp=1, max_model_len=1024)
    sizing = replace(
        SIZING, pool_bytes_per_block=(lambda *_: null_block) if null_block else None
    )
    specs = _layers(0, 2)
    need = 2 * FULL_BYTES_PER_TOKEN * 1024

    check_kv_cache_memory_of_one_rank(sizing, vllm_config, {}, 0)
    check_kv_cache_memory_of_one_rank(sizing, vllm_config, specs, need + null_block)
    with pytest.raises(ValueError, match="PP stage 0 / TP rank 0, layers 0-1"):
        check_kv_cache_memory_of_one_rank(
            sizing, vllm_config, specs, need + null_block - 1
        )


# Through the engine core's planning, with the specs models report.


def _gqa_worker_specs(
    num_layers: int, num_kv_heads: int, head_size: int, tp: int, pp: int
) -> list[dict[str, KVCacheSpec]]:
    """What Llama-style attention layers report per rank: PP-local layers,
    kv heads sharded over TP."""
    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=num_kv_heads // tp,
        head_size=head_size,
        dtype=torch.bfloat16,
    )
    workers = []
    for pp_rank in range(pp):
        start, end = get_pp_indices(num_layers, pp_rank, pp)
        stage = {f"model.layers.{i}.self_attn.attn": spec for i in range(start, end)}
        workers += [stage] * tp
    return workers


# Llama-3.1-8B: 32 layers, 8 kv heads of 128. Under TP8 x PP2 one rank holds 16
# layers and one kv head: 16 layers x (K + V) x 128 x 2 bytes per token.
LLAMA_RANK_BYTES_PER_TOKEN = 16 * 2 * 1 * 128 * 2
LLAMA_MAX_LEN = 131072
LLAMA_PAGE_BYTES = 16 * LLAMA_RANK_BYTES_PER_TOKEN  # one block of every layer


def test_gqa_tp8_pp2_per_rank_need(tmp_path):
    vllm_config = make_vllm_config(tmp_path, max_model_len=LLAMA_MAX_LEN)
    workers = _gqa_worker_specs(32, 8, 128, TP, PP)
    need = LLAMA_MAX_LEN * LLAMA_RANK_BYTES_PER_TOKEN

    # One block more than the need: room for the block pool's null block.
    configs = get_kv_cache_configs(
        vllm_config, workers, [need + LLAMA_PAGE_BYTES] * TP * PP
    )
    assert [config.num_blocks for config in configs] == [
        LLAMA_MAX_LEN // 16 + 1
    ] * TP * PP

    with pytest.raises(ValueError) as exc_info:
        get_kv_cache_configs(vllm_config, workers, [need - LLAMA_PAGE_BYTES] * TP * PP)
    message = str(exc_info.value)
    assert "on 16 of 16 rank(s)" in message
    stage1 = paragraph(message, "PP stage 1 / TP ranks 0-7")
    assert "layers 16-31 (16 KV cache layers)" in stage1
    assert f"needs {need / GiB_bytes:.2f} GiB" in stage1
    fitting = re.search(r"lower --max-model-len to (\d+) or less", message)
    assert fitting is not None
    assert LLAMA_MAX_LEN - 2 * 16 <= int(fitting.group(1)) < LLAMA_MAX_LEN


def test_mla_is_not_divided_across_tp(tmp_path):
    """MLA latents are replicated on every TP rank: a rank needs the full
    latent of its layers, so memory for 1/TP of it must not be enough."""
    vllm_config = make_vllm_config(tmp_path, max_model_len=32768)
    spec = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )
    stage_layers = [range(*get_pp_indices(8, pp, PP)) for pp in range(PP)]
    workers = [
        {f"model.layers.{i}.self_attn.attn": spec for i in layers}
        for layers in stage_layers
        for _ in range(TP)
    ]
    need = 4 * 576 * 2 * 32768  # 4 layers per stage, one latent, bf16
    page = 4 * 16 * 576 * 2

    get_kv_cache_configs(vllm_config, workers, [need + page] * TP * PP)
    with pytest.raises(ValueError, match=f"needs {need / GiB_bytes:.2f} GiB"):
        get_kv_cache_configs(vllm_config, workers, [need // TP + page] * TP * PP)


def test_dcp_divides_full_attention_length(tmp_path):
    """Under DCP each rank holds 1/DCP of the tokens of its layers."""
    dcp = 2
    vllm_config = make_vllm_config(
        tmp_path, dcp=dcp, num_kv_heads=4, max_model_len=65536
    )
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=128, dtype=torch.bfloat16
    )
    workers = [
        {f"model.layers.{i}.self_attn.attn": spec for i in range(pp * 4, pp * 4 + 4)}
        for pp in range(PP)
        for _ in range(TP)
    ]
    need = 4 * 2 * 128 * 2 * 65536 // dcp
    page = 4 * 16 * 2 * 128 * 2

    get_kv_cache_configs(vllm_config, workers, [need + page] * TP * PP)
    with pytest.raises(ValueError) as exc_info:
        get_kv_cache_configs(vllm_config, workers, [need - page] * TP * PP)
    assert f"needs {need / GiB_bytes:.2f} GiB" in str(exc_info.value)


def test_unequal_memory_across_pp_stages(tmp_path):
    """Ranks are checked against their own memory: only the stage with less
    memory fails, and auto-fit takes the minimum over ranks."""
    vllm_config = make_vllm_config(tmp_path, max_model_len=LLAMA_MAX_LEN)
    workers = _gqa_worker_specs(32, 8, 128, TP, PP)
    need = LLAMA_MAX_LEN * LLAMA_RANK_BYTES_PER_TOKEN
    available = [need + LLAMA_PAGE_BYTES] * TP + [need // 2] * TP

    with pytest.raises(ValueError) as exc_info:
        get_kv_cache_configs(vllm_config, workers, available)
    message = str(exc_info.value)
    assert "on 8 of 16 rank(s)" in message
    assert "PP stage 1 / TP ranks 0-7" in message
    assert "PP stage 0" not in message

    auto_fit = make_vllm_config(tmp_path, max_model_len=-1)
    auto_fit.model_config.max_model_len = LLAMA_MAX_LEN
    get_kv_cache_configs(auto_fit, workers, available)
    fitted = auto_fit.model_config.max_model_len
    # The largest length, in whole blocks, that stage 1 holds (besides the
    # block pool's null block, where the release reserves it).
    assert fitted * LLAMA_RANK_BYTES_PER_TOKEN <= need // 2
    assert (fitted + 2 * 16) * LLAMA_RANK_BYTES_PER_TOKEN > need // 2


def test_rank_without_kv_cache_layers_is_skipped(tmp_path):
    """A worker that holds no KV cache layer needs no KV cache memory and
    allocates none; the others are checked and allocated as usual."""
    vllm_config = make_vllm_config(tmp_path, tp=1, max_model_len=4096)
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    workers = [{f"model.layers.{i}.self_attn.attn": spec for i in range(4)}, {}]
    available = 4 * 2 * 8 * 128 * 2 * 4096 * 2

    configs = get_kv_cache_configs(vllm_config, workers, [available, 0])

    assert configs[1].kv_cache_tensors == []
    assert configs[1].num_blocks == configs[0].num_blocks > 0
    assert [g.layer_names for g in configs[1].kv_cache_groups] == [[]]


def test_check_enough_kv_cache_memory_uses_the_rank_check(tmp_path):
    vllm_config = make_vllm_config(tmp_path, tp=1, pp=1, max_model_len=4096)
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(4)}
    need = 4 * 2 * 8 * 128 * 2 * 4096

    check_enough_kv_cache_memory(vllm_config, specs, need + 4 * spec.page_size_bytes)
    with pytest.raises(ValueError, match="PP stage 0 / TP rank 0, layers 0-3"):
        check_enough_kv_cache_memory(vllm_config, specs, need - 1)
