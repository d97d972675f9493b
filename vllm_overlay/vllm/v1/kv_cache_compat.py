# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the KV cache files of the elastic KV series need to know about the vLLM
release they are part of, in one place.

The new files of the series are the same on every release it supports; where
those releases name or place a KV cache interface differently, the difference
is resolved here, not where it is used.
"""

import importlib
import os
from fractions import Fraction
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


def tokens_per_state(spec: "KVCacheSpec") -> int | Fraction:
    """How many tokens share one entry of a layer's KV cache (compressed
    caches keep one state per several tokens).

    `AttentionSpec.tokens_per_state` since vLLM 0.32; `compress_ratio` of the
    MLA specs before; 1 where a release has neither.
    """
    return getattr(spec, "tokens_per_state", getattr(spec, "compress_ratio", 1))


def set_kv_cache_layout(vllm_config: "VllmConfig", layout: str) -> None:
    """Set the KV cache layout that the engine core resolves before planning
    (since vLLM 0.32; earlier releases have no layout to set)."""
    cache_config: Any = vllm_config.cache_config
    if "kv_cache_layout" in getattr(type(cache_config), "__dataclass_fields__", {}):
        cache_config.kv_cache_layout = layout


def _kv_cache_planning() -> ModuleType:
    """The module of the engine core's KV cache planning: `kv_cache_planning`
    since vLLM 0.33, `kv_cache_utils` before."""
    try:
        return importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ImportError:
        return importlib.import_module("vllm.v1.core.kv_cache_utils")


def get_kv_cache_configs(
    vllm_config: "VllmConfig",
    kv_cache_specs: list[dict[str, "KVCacheSpec"]],
    available_memory: list[int],
) -> list["KVCacheConfig"]:
    """Plan the KV cache of every worker as the engine core does.

    Since vLLM 0.33 the engine core groups the whole model
    (`get_global_kv_cache_groups`) and hands the groups to the planning.
    """
    planning = _kv_cache_planning()
    if not hasattr(planning, "get_global_kv_cache_groups"):
        return planning.get_kv_cache_configs(
            vllm_config, kv_cache_specs, available_memory
        )
    return planning.get_kv_cache_configs(
        vllm_config,
        kv_cache_specs,
        available_memory,
        planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs),
    )


def check_enough_kv_cache_memory(
    vllm_config: "VllmConfig",
    kv_cache_spec: dict[str, "KVCacheSpec"],
    available_memory: int,
) -> None:
    """The public check that one worker holding `kv_cache_spec` can serve a
    max-length request."""
    _kv_cache_planning().check_enough_kv_cache_memory(
        vllm_config, kv_cache_spec, available_memory
    )


def kv_tensors_share_one_backing(kv_cache_config: "KVCacheConfig") -> bool:
    """Whether a rank's KV tensors live in one backing allocation.

    Since vLLM 0.32 each `KVCacheTensor` says where it lies in that allocation
    (`block_stride`); before, the model runner allocates one tensor per
    `KVCacheTensor`.
    """
    return hasattr(kv_cache_config.kv_cache_tensors[0], "block_stride")


def notify_blocks_reused(block_pool: "BlockPool", blocks: "list[KVCacheBlock]") -> None:
    """Tell readers of blocks released with `unpin_blocks` that the blocks are
    gone (since vLLM 0.33; block pools before have no such readers)."""
    notify = getattr(block_pool, "_notify_reuse", None)
    if notify is not None and getattr(block_pool, "_reuse_watchers", None):
        notify(blocks)


def kv_storage_block_size(kv_cache_spec: "KVCacheSpec") -> int:
    """Tokens per block as the KV tensor stores them: `storage_block_size`
    where a release distinguishes it from the scheduler's block size."""
    return getattr(kv_cache_spec, "storage_block_size", kv_cache_spec.block_size)


def parse_size(text: str) -> int:
    """A size as vLLM's own options read it (``--kv-cache-memory-bytes``,
    ``--kv-cache-vmm-*-bytes``): ``4096``, ``512M`` (MiB), ``512m`` (10^6),
    through `human_readable_int` (in `vllm.utils.argparse_utils` since vLLM
    0.21, in `vllm.engine.arg_utils` before). Raises ValueError or
    argparse.ArgumentTypeError as the option parser does."""
    for name in ("vllm.utils.argparse_utils", "vllm.engine.arg_utils"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "human_readable_int"):
            return module.human_readable_int(text)
    raise ImportError("this vLLM has no human_readable_int to read sizes with")


def kv_vmm_shm_base() -> str:
    """``VLLM_KV_VMM_LEDGER_DIR``: where engines sharing a device keep their
    ledgers and page reports (default ``/dev/shm``), read when used.

    Registered in `vllm.envs` by the release's VMM patch; a release that
    carries only the new files (0.18.1) reads the variable itself."""
    import vllm.envs as envs

    try:
        base = envs.VLLM_KV_VMM_LEDGER_DIR
    except AttributeError:
        base = os.environ.get("VLLM_KV_VMM_LEDGER_DIR", "")
    # Set but empty is unset, not a directory named "".
    return base or "/dev/shm"
