# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the elastic KV cache files need of vLLM's KV cache interfaces, in one
place: the planning functions, the spec and tensor fields, the block pool's
reuse notifications and the size parser they read.
"""

from fractions import Fraction
from typing import TYPE_CHECKING

import vllm.envs as envs
from vllm.utils.argparse_utils import human_readable_int

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


def tokens_per_state(spec: "KVCacheSpec") -> int | Fraction:
    """How many tokens share one entry of a layer's KV cache (compressed
    caches keep one state per several tokens)."""
    return spec.tokens_per_state


def set_kv_cache_layout(vllm_config: "VllmConfig", layout: str) -> None:
    """Set the KV cache layout that the engine core resolves before planning."""
    vllm_config.cache_config.kv_cache_layout = layout


def get_kv_cache_configs(
    vllm_config: "VllmConfig",
    kv_cache_specs: list[dict[str, "KVCacheSpec"]],
    available_memory: list[int],
) -> list["KVCacheConfig"]:
    """Plan the KV cache of every worker as the engine core does: the groups
    of the whole model first, then each worker's configuration."""
    from vllm.v1.core import kv_cache_planning

    return kv_cache_planning.get_kv_cache_configs(
        vllm_config,
        kv_cache_specs,
        available_memory,
        kv_cache_planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs),
    )


def check_enough_kv_cache_memory(
    vllm_config: "VllmConfig",
    kv_cache_spec: dict[str, "KVCacheSpec"],
    available_memory: int,
) -> None:
    """The public check that one worker holding `kv_cache_spec` can serve a
    max-length request."""
    from vllm.v1.core import kv_cache_planning

    kv_cache_planning.check_enough_kv_cache_memory(
        vllm_config, kv_cache_spec, available_memory
    )


def kv_tensors_share_one_backing(kv_cache_config: "KVCacheConfig") -> bool:
    """Whether a rank's KV tensors live in one backing allocation: each
    `KVCacheTensor` says where it lies in it (`block_stride`)."""
    return True


def notify_blocks_reused(block_pool: "BlockPool", blocks: "list[KVCacheBlock]") -> None:
    """Tell readers of blocks released with `unpin_blocks` that the blocks are
    gone."""
    if block_pool._reuse_watchers:
        block_pool._notify_reuse(blocks)


def kv_storage_block_size(kv_cache_spec: "KVCacheSpec") -> int:
    """Tokens per block as the KV tensor stores them."""
    return kv_cache_spec.block_size


def parse_size(text: str) -> int:
    """A size as vLLM's own options read it (``--kv-cache-memory-bytes``,
    ``--kv-cache-vmm-*-bytes``): ``4096``, ``512M`` (MiB), ``512m`` (10^6).
    Raises ValueError or argparse.ArgumentTypeError as the option parser
    does."""
    return human_readable_int(text)


def kv_vmm_shm_base() -> str:
    """``VLLM_KV_VMM_LEDGER_DIR``: where engines sharing a device keep their
    ledgers and page reports (default ``/dev/shm``), read when used."""
    return envs.VLLM_KV_VMM_LEDGER_DIR
