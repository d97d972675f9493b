# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU offloading spec for engine tests on the CPU backend.

vLLM's CPUOffloadingSpec refuses to build its worker on the CPU platform
("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"):
its copy engine launches swap kernels on device streams. This spec keeps
everything else real -- the connector, the scheduler-side
OffloadingConnectorScheduler and CPUOffloadingManager, pool sizing, job
ids, worker completion reports, aggregation and stats -- and replaces only
the copy engine with a synchronous torch copy between the engine's KV cache
tensors (which live in host memory on this backend) and a host buffer of
num_chunks pages per worker.
"""

import time

import numpy as np
import torch

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class HostCopyOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int):
        self._kv_pages: list[torch.Tensor] = []
        self._host_pages: list[torch.Tensor] = []
        for kv_tensor in kv_caches.tensors:
            pages = kv_tensor.tensor.view(torch.int8).view(
                -1, kv_tensor.page_size_bytes
            )
            self._kv_pages.append(pages)
            self._host_pages.append(
                torch.zeros((num_chunks, kv_tensor.page_size_bytes), dtype=torch.int8)
            )
        self._finished: list[TransferResult] = []

    def _copy(
        self,
        job_id: int,
        src: list[torch.Tensor],
        src_ids: np.ndarray,
        dst: list[torch.Tensor],
        dst_ids: np.ndarray,
    ) -> bool:
        assert len(src_ids) == len(dst_ids)
        start = time.perf_counter()
        src_index = torch.from_numpy(src_ids.astype(np.int64))
        dst_index = torch.from_numpy(dst_ids.astype(np.int64))
        num_bytes = 0
        for src_pages, dst_pages in zip(src, dst):
            dst_pages.index_copy_(0, dst_index, src_pages.index_select(0, src_index))
            num_bytes += len(src_ids) * src_pages.shape[1]
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        return self._copy(
            job_id,
            self._kv_pages,
            src_spec.block_ids,
            self._host_pages,
            dst_spec.block_ids,
        )

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        return self._copy(
            job_id,
            self._host_pages,
            src_spec.block_ids,
            self._kv_pages,
            dst_spec.block_ids,
        )

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        # Copies complete synchronously in submit_*.
        return None


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # One GPU block per offloaded chunk keeps the copy a plain gather.
        assert self.blocks_per_chunk == 1
        if self._worker is None:
            self._worker = HostCopyOffloadingWorker(kv_caches, self.num_chunks)
        return self._worker
