# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV cache admission check, per rank.

Every rank must hold the KV cache of one max-length request for its own layers
(its PP stage) and its own head shard (TP; MLA latents are replicated), with
full-attention length split across DCP/PCP ranks, in its own memory. When a
rank does not, one error names every failing rank, what its need is made of,
and the fixes that apply.

The check sizes KV cache groups with the functions that plan the cache
(`KVCacheSizing`), so that it agrees with the allocation it guards.
"""

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import regex as re

from vllm.config import VllmConfig
from vllm.utils.mem_constants import GiB_bytes
from vllm.v1.kv_cache_compat import tokens_per_state
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

GroupsSizer = Callable[[VllmConfig, list[KVCacheGroupSpec]], int]


@dataclass(frozen=True)
class KVCacheSizing:
    """The functions that group and size the KV cache where it is planned."""

    get_kv_cache_groups: Callable[
        [VllmConfig, dict[str, KVCacheSpec]], list[KVCacheGroupSpec]
    ]
    """Group the layers of the whole model (may change the specs in place)."""
    project_groups_to_worker: Callable[
        [list[KVCacheGroupSpec], dict[str, KVCacheSpec]], list[KVCacheGroupSpec]
    ]
    """Project global groups onto the layers of one worker."""
    max_memory_usage_bytes: GroupsSizer
    """KV cache bytes of one max-length request in the given groups."""
    estimate_max_model_len: Callable[[VllmConfig, list[KVCacheGroupSpec], int], int]
    """The longest request the given groups hold in the given memory."""
    pool_bytes_per_block: GroupsSizer | None = None
    """Bytes of the block that the block pool holds back as its null block,
    where the planner reserves it before checking."""
    gpu_memory_utilization_sets_cpu_memory: bool = False
    """Whether --gpu-memory-utilization also sizes the KV cache of the CPU
    backend."""


def groups_with_layers(
    kv_cache_groups: list[KVCacheGroupSpec],
) -> list[KVCacheGroupSpec]:
    """The groups that hold at least one layer of a worker.

    Projection keeps groups without any layer on the worker (e.g. under pipeline
    parallelism) so that group ids line up across workers. Such a group holds no
    memory on that worker and must not count toward its KV cache need.
    """
    return [group for group in kv_cache_groups if group.layer_names]


def _per_layer_spec(group: KVCacheGroupSpec, layer_name: str) -> KVCacheSpec:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


def _format_index_ranges(indices: Iterable[int]) -> str:
    """Format sorted integers as ranges, e.g. "0-30, 40"."""
    ranges: list[str] = []
    start = prev = None
    for index in [*indices, None]:
        if prev is not None and index == prev + 1:
            prev = index
            continue
        if start is not None:
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = index
    return ", ".join(ranges)


def _worker_ranks_name(
    vllm_config: VllmConfig, worker_idxs: list[int], num_workers: int
) -> str:
    """Name workers of `get_kv_cache_configs` by their parallel ranks."""
    parallel_config = vllm_config.parallel_config
    tp_size = parallel_config.tensor_parallel_size
    pp_size = parallel_config.pipeline_parallel_size
    pcp_size = parallel_config.prefill_context_parallel_size
    if num_workers == tp_size * pp_size * pcp_size:
        # Workers are ordered by rank, laid out as [PP, PCP, TP] with TP
        # innermost (see `initialize_model_parallel`).
        stages = {idx // (tp_size * pcp_size) for idx in worker_idxs}
        pcp_ranks = {idx // tp_size % pcp_size for idx in worker_idxs}
        if len(stages) == 1 and len(pcp_ranks) == 1:
            tp_ranks = _format_index_ranges(sorted(i % tp_size for i in worker_idxs))
            name = f"PP stage {stages.pop()}"
            if pcp_size > 1:
                name += f" / PCP rank {pcp_ranks.pop()}"
            plural = "s" if len(worker_idxs) > 1 else ""
            return f"{name} / TP rank{plural} {tp_ranks}"
    plural = "s" if len(worker_idxs) > 1 else ""
    return f"Worker{plural} {_format_index_ranges(sorted(worker_idxs))}"


_LAYER_INDEX_RE = re.compile(r"\.(\d+)(?:\.|$)")


def _describe_layers(layer_names: Sequence[str]) -> str:
    """Summarize layer names, e.g. "layers 0-30 (123 KV cache layers)"."""
    indices = sorted(
        {
            int(match.group(1))
            for name in layer_names
            if (match := _LAYER_INDEX_RE.search(name))
        }
    )
    num_caches = f"{len(layer_names)} KV cache layers"
    if not indices:
        return num_caches
    return f"layers {_format_index_ranges(indices)} ({num_caches})"


def _describe_layer_kind(spec: KVCacheSpec) -> str:
    """A short operator-facing name of a layer's KV cache type."""
    details: list[str] = []
    if isinstance(spec, AttentionSpec):
        dtype = str(spec.dtype).removeprefix("torch.")
        details.append(f"{spec.num_kv_heads}x{spec.head_size} {dtype}")
        if (tokens := tokens_per_state(spec)) != 1:
            details.append(f"1 state per {tokens} tokens")
    if isinstance(spec, SlidingWindowSpec):
        details.append(f"window {spec.sliding_window}")
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        details.append(f"chunk {spec.attention_chunk_size}")
    kind = type(spec).__name__.removesuffix("Spec")
    return f"{kind} ({', '.join(details)})" if details else kind


def _is_promoted_to_full_length(reported: KVCacheSpec, effective: KVCacheSpec) -> bool:
    """Whether grouping turned a local-attention cache into a full-length one.

    This happens when the hybrid KV cache manager is disabled: sliding-window
    and chunked-local layers then keep blocks for every token.
    """
    local_types = (SlidingWindowSpec, ChunkedLocalAttentionSpec)
    return isinstance(reported, local_types) and not isinstance(effective, local_types)


def _num_promoted_layers(
    groups: list[KVCacheGroupSpec], reported_specs: dict[str, KVCacheSpec]
) -> int:
    return sum(
        _is_promoted_to_full_length(
            reported_specs.get(name, _per_layer_spec(group, name)),
            _per_layer_spec(group, name),
        )
        for group in groups
        for name in group.layer_names
    )


@dataclass
class _LayerKindNeed:
    num_layers: int = 0
    needed_bytes: int = 0
    promoted: bool = False


def _gib(num_bytes: int | float) -> str:
    return f"{num_bytes / GiB_bytes:.2f}"


def _null_block_bytes(
    sizing: KVCacheSizing, vllm_config: VllmConfig, groups: list[KVCacheGroupSpec]
) -> int:
    """The memory the planner reserves for the block pool's null block."""
    if sizing.pool_bytes_per_block is None:
        return 0
    return sizing.pool_bytes_per_block(vllm_config, groups)


def _kv_cache_need_with_hybrid_manager(
    sizing: KVCacheSizing,
    vllm_config: VllmConfig,
    reported_specs: dict[str, KVCacheSpec],
    worker_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[tuple[int, int] | None]:
    """Per worker (need, estimated max model len) had the hybrid KV cache
    manager kept local-attention layers at their window. None where that
    grouping is not supported."""
    disable_hybrid = vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    try:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
        # Grouping may pad the specs in place; keep the reported ones intact.
        groups = sizing.get_kv_cache_groups(vllm_config, copy.deepcopy(reported_specs))
        results: list[tuple[int, int] | None] = []
        for worker_spec, avail_mem in zip(worker_specs, available_memory):
            worker_groups = groups_with_layers(
                sizing.project_groups_to_worker(groups, worker_spec)
            )
            if not worker_groups:
                results.append(None)
                continue
            usable = avail_mem - _null_block_bytes(sizing, vllm_config, worker_groups)
            results.append(
                (
                    sizing.max_memory_usage_bytes(vllm_config, worker_groups),
                    sizing.estimate_max_model_len(vllm_config, worker_groups, usable),
                )
            )
        return results
    except (ValueError, NotImplementedError, AssertionError):
        # The model or layout has no hybrid grouping: nothing to compare with.
        return [None] * len(worker_specs)
    finally:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = disable_hybrid


def _describe_rank_shortfall(
    vllm_config: VllmConfig,
    groups: list[KVCacheGroupSpec],
    reported_specs: dict[str, KVCacheSpec],
    needed_memory: int,
    available_memory: int,
    estimated_max_len: int,
    need_with_hybrid_manager: tuple[int, int] | None,
) -> str:
    """Why one rank cannot hold a max-length request, for one paragraph."""
    layer_names = [name for group in groups for name in group.layer_names]
    max_model_len = vllm_config.model_config.max_model_len
    text = (
        f"{_describe_layers(layer_names)}: needs "
        f"{_gib(needed_memory)} GiB of KV cache for one request of "
        f"{max_model_len} tokens but has {_gib(available_memory)} GiB available"
    )
    text += (
        f"; it can hold at most {estimated_max_len} tokens."
        if estimated_max_len > 0
        else "; it cannot hold a single token."
    )

    kinds: dict[str, _LayerKindNeed] = {}
    promoted_bytes = unpromoted_bytes = 0
    for group in groups:
        for layer_name in group.layer_names:
            effective = _per_layer_spec(group, layer_name)
            reported = reported_specs.get(layer_name, effective)
            promoted = _is_promoted_to_full_length(reported, effective)
            kind = _describe_layer_kind(reported)
            if promoted:
                kind += " promoted to full length"
            entry = kinds.setdefault(kind, _LayerKindNeed(promoted=promoted))
            entry.num_layers += 1
            layer_bytes = effective.max_memory_usage_bytes(vllm_config)
            entry.needed_bytes += layer_bytes
            if promoted:
                promoted_bytes += layer_bytes
                unpromoted_bytes += reported.max_memory_usage_bytes(vllm_config)
    by_kind = sorted(kinds.items(), key=lambda item: -item[1].needed_bytes)
    text += " Need by layer kind: " + "; ".join(
        f"{need.num_layers} x {kind}: {_gib(need.needed_bytes)} GiB"
        for kind, need in by_kind
    )
    layout_bytes = needed_memory - sum(need.needed_bytes for need in kinds.values())
    if layout_bytes >= GiB_bytes // 100:
        text += f"; block layout padding: {_gib(layout_bytes)} GiB"
    text += "."

    num_promoted = sum(need.num_layers for need in kinds.values() if need.promoted)
    if num_promoted:
        text += (
            f" The hybrid KV cache manager is disabled, so {num_promoted} "
            "sliding-window or chunked-local caches were promoted to full "
            "length: they "
            f"take {_gib(promoted_bytes)} GiB here instead of "
            f"{_gib(unpromoted_bytes)} GiB, costing "
            f"{_gib(promoted_bytes - unpromoted_bytes)} GiB."
        )
        if need_with_hybrid_manager is not None:
            hybrid_need, hybrid_max_len = need_with_hybrid_manager
            text += (
                " With the hybrid KV cache manager this rank would need "
                f"{_gib(hybrid_need)} GiB"
            )
            text += (
                " and would fit."
                if hybrid_max_len >= max_model_len
                else f" and could hold {hybrid_max_len} tokens."
            )
    return text


def check_kv_cache_memory_per_rank(
    sizing: KVCacheSizing,
    vllm_config: VllmConfig,
    groups_per_worker: list[list[KVCacheGroupSpec]],
    available_memory: list[int],
    reported_specs: dict[str, KVCacheSpec],
    worker_specs: list[dict[str, KVCacheSpec]],
) -> None:
    """Check that every rank can hold the KV cache of one max-length request.

    Each rank needs the KV cache of its own layers (its PP stage) and its own
    head shard (TP; MLA latents are replicated), with full-attention length
    split across DCP/PCP ranks; it is compared with that rank's own memory.
    Memory of other ranks, or of a KV offloading tier, does not count: a running
    request needs its whole KV cache on every rank that computes it.

    Args:
        sizing: The functions that group and size the KV cache.
        vllm_config: The global VllmConfig.
        groups_per_worker: The KV cache groups projected to each worker.
        available_memory: Memory available for KV cache on each worker.
        reported_specs: The KV cache specs as reported by the workers, before
            grouping unified them.
        worker_specs: The KV cache specs reported by each worker.

    Raises:
        ValueError: One paragraph per rank that does not fit.

    """
    max_model_len = vllm_config.model_config.max_model_len
    num_workers = len(groups_per_worker)
    shortfalls: list[tuple[int, list[KVCacheGroupSpec], int, int, int]] = []
    for worker_idx, (groups, avail_mem) in enumerate(
        zip(groups_per_worker, available_memory)
    ):
        groups = groups_with_layers(groups)
        if not groups:
            # A rank without KV cache layers needs no KV cache memory.
            continue
        if avail_mem <= 0:
            shortfalls.append((worker_idx, groups, -1, avail_mem, 0))
            continue
        needed_memory = sizing.max_memory_usage_bytes(vllm_config, groups)
        if needed_memory <= avail_mem:
            continue
        estimated_max_len = sizing.estimate_max_model_len(
            vllm_config, groups, avail_mem
        )
        shortfalls.append(
            (worker_idx, groups, needed_memory, avail_mem, estimated_max_len)
        )
    if not shortfalls:
        return

    any_promoted = any(
        _num_promoted_layers(groups, reported_specs) > 0
        for _, groups, _, _, _ in shortfalls
    )
    hybrid_needs: list[tuple[int, int] | None] = [None] * num_workers
    if any_promoted:
        hybrid_needs = _kv_cache_need_with_hybrid_manager(
            sizing, vllm_config, reported_specs, worker_specs, available_memory
        )

    # Ranks that fail the same way (e.g. the TP ranks of one PP stage) share a
    # paragraph.
    workers_by_reason: dict[str, list[int]] = defaultdict(list)
    for worker_idx, groups, needed, avail_mem, max_len in shortfalls:
        if needed < 0:
            reason = (
                f"{_describe_layers([n for g in groups for n in g.layer_names])}: "
                f"no memory is available for the cache blocks ({_gib(avail_mem)} "
                "GiB)."
            )
        else:
            reason = _describe_rank_shortfall(
                vllm_config,
                groups,
                reported_specs,
                needed,
                avail_mem,
                max_len,
                hybrid_needs[worker_idx],
            )
        workers_by_reason[reason].append(worker_idx)
    paragraphs = [
        f"{_worker_ranks_name(vllm_config, worker_idxs, num_workers)}, {reason}"
        for reason, worker_idxs in workers_by_reason.items()
    ]

    fixes: list[str] = []
    fitting_len = min(max_len for _, _, needed, _, max_len in shortfalls)
    if fitting_len > 0:
        fixes.append(f"lower --max-model-len to {fitting_len} or less")
    fixes.append(
        "raise --gpu-memory-utilization (on the CPU backend it also sets the "
        "CPU memory reserved for KV cache)"
        if sizing.gpu_memory_utilization_sets_cpu_memory
        else "raise --gpu-memory-utilization"
    )
    if any_promoted:
        fixes.append(
            "enable the hybrid KV cache manager (drop "
            "--disable-hybrid-kv-cache-manager, and use a KV connector that "
            "supports it) so that local-attention layers keep only their window"
        )
    if any(
        sum(len(group.layer_names) for group in groups) > 1
        for _, groups, _, _, _ in shortfalls
    ):
        fixes.append(
            "add pipeline stages (--pipeline-parallel-size) so that each rank "
            "holds fewer layers"
        )
    raise ValueError(
        f"Not enough KV cache memory on {len(shortfalls)} of {num_workers} "
        f"rank(s) to serve one request with the model's max seq len "
        f"({max_model_len}). Each rank must hold the KV cache of its own layers "
        "and head shard; memory of other ranks and KV offloading do not count "
        "toward it.\n"
        + "\n".join(paragraphs)
        + "\nTo fix: "
        + "; or ".join(fixes)
        + ". See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
        "for more details."
    )


def check_kv_cache_memory_of_one_rank(
    sizing: KVCacheSizing,
    vllm_config: VllmConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
) -> None:
    """`check_kv_cache_memory_per_rank` for one rank holding every layer of
    `kv_cache_spec`, as `check_enough_kv_cache_memory` asks."""
    if not kv_cache_spec:
        return
    # Group a copy of the specs since grouping may unify them in-place.
    groups = sizing.get_kv_cache_groups(vllm_config, dict(kv_cache_spec))
    if groups and available_memory > 0:
        available_memory -= _null_block_bytes(sizing, vllm_config, groups)
    check_kv_cache_memory_per_rank(
        sizing,
        vllm_config,
        [groups],
        [available_memory],
        kv_cache_spec,
        [kv_cache_spec],
    )
