# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import importlib.util
import os

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
requires_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="needs nixl"
)


def ucx_over_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL agents of one process exchanging host memory: UCX on TCP/shared
    memory over the loopback unless the environment chooses. Left to itself
    on a host with GPUs or RDMA devices, UCX may pick a transport these reads
    never complete on; and where GPUs are present, NIXL refuses a UCX without
    a CUDA transport, so cuda_copy is named there too."""
    if "UCX_TLS" not in os.environ:
        tls = "tcp,self,sm" + (",cuda_copy" if torch.cuda.is_available() else "")
        monkeypatch.setenv("UCX_TLS", tls)
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")


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
