# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker side of VMM-backed KV memory: the backing allocation of a rank's
KV tensors over a virtual reservation, and the page changes the scheduler
sends, applied before the forward pass."""

import time
from collections.abc import Callable

import torch

from vllm.logger import init_logger
from vllm.v1.kv_vmm.backend import VmmBackend
from vllm.v1.kv_vmm.host import HostVmmBackend
from vllm.v1.kv_vmm.page_table import KVPageTable, SegmentCallback
from vllm.v1.kv_vmm.pages import (
    KVPageOps,
    KVPagePolicy,
    initial_kv_pages,
    kv_page_geometry,
    virtual_kv_cache_config,
)

logger = init_logger(__name__)


def make_vmm_backend(device: torch.device, granularity: int) -> VmmBackend:
    if device.type == "cuda":
        from vllm.v1.kv_vmm.cuda import CudaVmmBackend

        backend: VmmBackend = CudaVmmBackend(device)
    elif device.type == "cpu":
        backend = HostVmmBackend(granularity)
    else:
        raise NotImplementedError(
            f"VMM-backed KV memory supports CUDA and CPU devices, not "
            f"{device.type}; use --kv-cache-memory-backend default"
        )
    if granularity % backend.granularity:
        raise NotImplementedError(
            f"the {device.type} VMM granularity ({backend.granularity} bytes) "
            f"does not divide the KV page granularity ({granularity} bytes); "
            "use --kv-cache-memory-backend default"
        )
    return backend


class KVPageMapper:
    """A rank's KV page table plus its share of the scheduler's decisions.

    A policy page is one segment of the rank's page table, so every rank
    maps its own bytes for the same page ids.
    """

    def __init__(
        self,
        kv_cache_config,
        policy: KVPagePolicy,
        device: torch.device,
        on_segment_mapped: SegmentCallback | None = None,
        before_segment_unmapped: SegmentCallback | None = None,
    ) -> None:
        self.policy = policy
        backend = make_vmm_backend(device, policy.granularity)
        self.geometry = kv_page_geometry(
            kv_cache_config, backend.granularity, policy.blocks_per_page
        )
        self.virtual_config = virtual_kv_cache_config(kv_cache_config, self.geometry)
        # The table's own limit is the whole reservation: the scheduler
        # enforces the physical limit, which may change at runtime.
        self.table = KVPageTable(
            backend,
            self.geometry,
            max_pages=self.geometry.num_pages,
            on_segment_mapped=on_segment_mapped,
            before_segment_unmapped=before_segment_unmapped,
        )
        self.map_seconds = 0.0
        self.num_pages_mapped_total = 0
        self.num_pages_unmapped_total = 0
        self.peak_mapped_bytes = 0
        self.apply(KVPageOps(map=initial_kv_pages(policy)))
        logger.info(
            "VMM-backed KV cache: %d virtual blocks (%.2f GiB reserved), "
            "%d blocks per page, %.2f MiB per page, %.2f MiB mapped at startup",
            self.geometry.num_blocks,
            sum(self.geometry.tensor_bytes) / (1 << 30),
            policy.blocks_per_page,
            self.page_bytes / (1 << 20),
            self.mapped_bytes / (1 << 20),
        )

    @property
    def buffer(self) -> torch.Tensor:
        """The flat ``int8`` backing allocation, viewed per layer by vLLM."""
        return self.table.tensors[0].view(torch.int8)

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes * self.geometry.pages_per_segment

    @property
    def mapped_bytes(self) -> int:
        return self.table.mapped_bytes

    def _table_pages(self, pages: list[int]) -> list[int]:
        return [p for segment in pages for p in self.geometry.pages_of_segment(segment)]

    def apply(self, ops: KVPageOps) -> None:
        """Unmap, then map; the device is synchronized before unmapping."""
        start = time.perf_counter()
        if ops.unmap:
            unmapped = self.table.unmap_pages(self._table_pages(ops.unmap))
            self.num_pages_unmapped_total += len(unmapped)
        if ops.map:
            mapped = self.table.map_pages(self._table_pages(ops.map))
            self.num_pages_mapped_total += len(mapped)
        self.map_seconds += time.perf_counter() - start
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.mapped_bytes)

    def stats(self) -> dict[str, float]:
        pps = self.geometry.pages_per_segment
        return {
            "kv_mapped_bytes": self.mapped_bytes,
            "kv_mapped_bytes_peak": self.peak_mapped_bytes,
            "kv_pages_mapped_total": self.num_pages_mapped_total // pps,
            "kv_pages_unmapped_total": self.num_pages_unmapped_total // pps,
            "kv_map_seconds": self.map_seconds,
        }

    def close(self) -> None:
        self.table.close()


def allocate_vmm_kv_cache(
    kv_cache_config,
    device: torch.device,
    allocate: Callable[..., dict[str, torch.Tensor]],
    *args,
    **kwargs,
) -> tuple[dict[str, torch.Tensor], KVPageMapper]:
    """Allocate a rank's KV cache views over VMM memory.

    ``allocate`` is vLLM's own allocation function, called with the virtual
    KV cache config and ``buffer=`` the reservation, so the views (strides,
    NHD/HND orders, kernel blocks) are exactly the ones the attention
    backend asked for.
    """
    policy = kv_cache_config.kv_page_policy
    mapper = KVPageMapper(kv_cache_config, policy, device)
    kv_caches = allocate(
        mapper.virtual_config, device, *args, buffer=mapper.buffer, **kwargs
    )
    return kv_caches, mapper
