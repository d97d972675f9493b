# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import importlib.util

import pytest
import torch


def cuda_vmm_available() -> bool:
    return (
        torch.cuda.is_available()
        and importlib.util.find_spec("cuda") is not None
        and importlib.util.find_spec("cuda.bindings") is not None
    )


requires_cuda_vmm = pytest.mark.skipif(
    not cuda_vmm_available(), reason="needs a CUDA device and cuda-bindings"
)


def vllm_wires_vmm_kv() -> bool:
    """Whether this vLLM carries the patch that wires VMM-backed KV memory into
    the engine (``--kv-cache-memory-backend``); the overlay alone does not, e.g.
    on a release the patch has not been carried to yet."""
    from vllm.config import CacheConfig

    return "kv_cache_memory_backend" in getattr(CacheConfig, "__dataclass_fields__", {})


requires_vmm_kv_wiring = pytest.mark.skipif(
    not vllm_wires_vmm_kv(),
    reason="this vLLM does not carry the VMM-backed KV cache patch",
)


def vllm_reports_kv_page_stats() -> bool:
    """Whether the scheduler stats carry the VMM page counters (the metrics
    patch; carried separately from the wiring)."""
    from vllm.v1.metrics.stats import SchedulerStats

    return "kv_page_stats" in getattr(SchedulerStats, "__dataclass_fields__", {})


requires_kv_page_stats = pytest.mark.skipif(
    not vllm_reports_kv_page_stats(),
    reason="this vLLM does not carry the VMM KV page metrics patch",
)
