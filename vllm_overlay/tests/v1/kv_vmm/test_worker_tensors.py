# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""VMM-backed KV tensors of model runners that allocate one tensor per
KVCacheTensor (each layer laid out by its attention backend), over real
Linux memory (the host backend)."""

import threading

import pytest
import torch

from tests.v1.kv_vmm.utils import requires_vmm_kv_wiring
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.kv_vmm.backend import VmmError
from vllm.v1.kv_vmm.page_status import create_page_status
from vllm.v1.kv_vmm.pages import KVLedgerOptions, KVPageOps, make_kv_page_policy
from vllm.v1.kv_vmm.worker import (
    allocate_vmm_kv_tensors,
    attention_kv_regions,
    kv_tensor_regions,
)

# Releases that place a rank's KV tensors in one backing allocation describe
# the layout in the KV cache config (covered by the engine tests) and give the
# attention backends no get_kv_cache_shape.
per_tensor_release = pytest.mark.skipif(
    not hasattr(KVCacheTensor, "__dataclass_fields__")
    or "shared_by" not in KVCacheTensor.__dataclass_fields__,
    reason="this vLLM allocates the KV cache of a rank as one backing tensor",
)

SPEC = FullAttentionSpec(
    block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16
)
MLA_SPEC = MLAAttentionSpec(
    block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
)


def backend(module: str, name: str):
    # Not every build ships every backend's dependencies.
    package = "vllm.v1.attention.backends"
    return getattr(pytest.importorskip(f"{package}.{module}"), name)


@per_tensor_release
@pytest.mark.parametrize(
    "module, name, spec, regions",
    [
        ("flash_attn", "FlashAttentionBackend", SPEC, 2),  # (2, num_blocks, ...)
        ("triton_attn", "TritonAttentionBackend", SPEC, 1),  # (num_blocks, 2, ...)
        ("cpu_attn", "CPUAttentionBackend", SPEC, 2),
        ("mla.triton_mla", "TritonMLABackend", MLA_SPEC, 1),
    ],
)
def test_attention_kv_regions_follow_the_backend_layout(module, name, spec, regions):
    attn_backend = backend(module, name)
    if not hasattr(attn_backend, "get_kv_cache_shape"):
        pytest.skip("this vLLM's attention backends take the layout from the config")
    with set_current_vllm_config(VllmConfig()):
        assert attention_kv_regions(attn_backend, spec, spec.block_size, "auto") == (
            regions
        )


def per_tensor_config(num_blocks: int) -> KVCacheConfig:
    page = SPEC.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * page, shared_by=["l0"]),
            KVCacheTensor(size=num_blocks * page, shared_by=["l1"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], SPEC)],
    )


def block_ranges(view: torch.Tensor, block: int) -> list[tuple[int, int]]:
    """Byte ranges of one block in a ``(.., num_blocks, ..)`` view, K and V."""
    nbytes = SPEC.page_size_bytes // 2
    if view.shape[0] == 2:  # (2, num_blocks, ...)
        return [(view[i, block].data_ptr(), nbytes) for i in range(2)]
    return [(view[block].data_ptr(), 2 * nbytes)]


def is_backed(table, start: int, nbytes: int) -> bool:
    return any(
        chunk.va <= start and start + nbytes <= chunk.va + chunk.nbytes
        for segment in table.segments()
        for chunk in segment.chunks
    )


@per_tensor_release
@requires_vmm_kv_wiring
def test_per_tensor_pages_back_every_block_in_both_layouts():
    # Not a multiple of a page: the tensors are rounded up to whole pages.
    num_blocks = 1000
    config = per_tensor_config(num_blocks)
    cache_config = CacheConfig(
        kv_cache_memory_backend="vmm", kv_cache_vmm_headroom_pages=1
    )
    policy = make_kv_page_policy(cache_config, [config])
    # 2 MiB in each half of a K/V split layer: 256 blocks of 16 KiB.
    assert policy.blocks_per_page == 256
    assert policy.device_page_bytes == 256 * 2 * SPEC.page_size_bytes
    config.kv_page_policy = policy

    # l0 is split K/V, l1 block-outermost: a page is the same block ids in both.
    raw, mapper = allocate_vmm_kv_tensors(
        config, torch.device("cpu"), {"l0": 2, "l1": 1}
    )
    try:
        num_virtual = mapper.geometry.num_blocks
        assert num_virtual == 1024
        views = {
            "l0": raw["l0"].view(torch.float16).view(2, num_virtual, 16, 4, 64),
            "l1": raw["l1"].view(torch.float16).view(num_virtual, 2, 16, 4, 64),
        }
        assert {mapper.table.is_mapped(p) for p in range(2)} == {True}
        assert mapper.mapped_bytes == 2 * policy.device_page_bytes

        def backed(block: int) -> set[bool]:
            return {
                is_backed(mapper.table, start, nbytes)
                for view in views.values()
                for start, nbytes in block_ranges(view, block)
            }

        for block in (0, 255, 256, 511):
            assert backed(block) == {True}
        for block in (512, 767, 999):
            assert backed(block) == {False}

        mapper.apply(KVPageOps(map=[3]))
        assert backed(999) == {True} and backed(512) == {False}
        # Real memory: what is written to the last block's V is read back.
        views["l0"][1, 999].fill_(3.0)
        views["l1"][999, 1].fill_(5.0)
        assert views["l0"][1, 999].sum().item() == 3.0 * 16 * 4 * 64
        assert views["l1"][999, 1].sum().item() == 5.0 * 16 * 4 * 64
        assert mapper.mapped_bytes == 3 * policy.device_page_bytes

        mapper.apply(KVPageOps(unmap=[3]))
        assert backed(999) == {False}
        assert mapper.mapped_bytes == 2 * policy.device_page_bytes
        assert mapper.stats()["kv_pages_unmapped_total"] == 1

        # Pages mapped ahead: not before the forward pass (apply), only
        # after it is launched (apply_ahead).
        ahead = KVPageOps(ahead=[2])
        mapper.apply(ahead)
        assert backed(512) == {False}
        mapper.apply_ahead(ahead)
        assert backed(512) == {True} and backed(999) == {False}
        assert mapper.stats()["kv_pages_mapped_ahead_total"] == 1
        assert mapper.mapped_bytes == 3 * policy.device_page_bytes

        # With a connector registering segments, the step's ahead pages are
        # mapped (and registered) before its forward pass, with its own.
        registered: list[object] = []
        mapper.table.on_segment_mapped = registered.append
        assert not mapper.maps_ahead_after_forward
        mapper.apply(KVPageOps(ahead=[3]))
        assert backed(999) == {True} and len(registered) == 1
        # Counted as mapped ahead of demand (for the steps after this one).
        before = mapper.stats()
        assert before["kv_pages_mapped_ahead_total"] == 2
        mapper.apply_ahead(KVPageOps(ahead=[3]))  # nothing left to do after it
        assert mapper.stats() == before and len(registered) == 1
    finally:
        mapper.close()


@per_tensor_release
@requires_vmm_kv_wiring
def test_sharing_a_device_pages_are_mapped_ahead_on_a_thread_of_their_own():
    """The scheduler hands out pages mapped ahead only once every rank
    reported them, so the worker's thread need not wait for their maps: with
    a device ledger (engines sharing a device) they run on a thread of their
    own while the worker goes on with the step."""
    config = per_tensor_config(1000)
    cache_config = CacheConfig(
        kv_cache_memory_backend="vmm", kv_cache_vmm_headroom_pages=1
    )
    policy = make_kv_page_policy(cache_config, [config])
    status = create_page_status(4, tag="ahead-thread")
    policy.page_status_path = status.path
    policy.ledger = KVLedgerOptions(devices={"host": policy.device_page_bytes})
    config.kv_page_policy = policy
    _, mapper = allocate_vmm_kv_tensors(config, torch.device("cpu"), {"l0": 2, "l1": 1})
    try:
        page = policy.device_page_bytes
        backend = mapper.table.backend
        real_create = backend.create
        go = threading.Event()
        threads: list[str] = []

        def slow_create(nbytes: int) -> object:
            threads.append(threading.current_thread().name)
            assert go.wait(10)
            return real_create(nbytes)

        backend.create = slow_create
        mapper.apply_ahead(KVPageOps(ahead=[2]))
        mapper.apply_ahead(KVPageOps(ahead=[3]))  # queued behind it
        # Back at once: pages 2 and 3 are being mapped elsewhere, unreported.
        assert mapper.mapped_bytes == 2 * page
        assert status.counts(2) == status.counts(3) == (0, 0)
        go.set()
        mapper.wait_for_ahead_maps()
        assert mapper.mapped_bytes == 4 * page
        assert status.counts(2) == status.counts(3) == (1, 0)
        assert threads and {t.split("_")[0] for t in threads} == {"kv-page-map"}

        # The worker's own unmaps (and maps) follow a batch still running.
        mapper.apply(KVPageOps(unmap=[3]))
        go.clear()
        mapper.apply_ahead(KVPageOps(ahead=[3]))
        threading.Timer(0.3, go.set).start()
        mapper.apply(KVPageOps(unmap=[2]))
        assert mapper.mapped_bytes == 3 * page  # 3 mapped, then 2 unmapped
        assert mapper.stats()["kv_pages_mapped_ahead_total"] == 3

        # A driver error on the map thread is raised on the worker's thread.
        def failing_create(nbytes: int) -> object:
            raise VmmError("cuMemCreate failed: CUDA_ERROR_UNKNOWN")

        backend.create = failing_create
        mapper.apply_ahead(KVPageOps(ahead=[2]))
        with pytest.raises(VmmError, match="CUDA_ERROR_UNKNOWN"):
            mapper.wait_for_ahead_maps()
        backend.create = real_create
    finally:
        mapper.close()
        status.close(unlink=True)


@per_tensor_release
def test_layers_sharing_a_tensor_must_agree_on_the_layout():
    config = per_tensor_config(512)
    config.kv_cache_tensors[0].shared_by.append("l2")
    with pytest.raises(NotImplementedError, match="one KV layout per tensor"):
        kv_tensor_regions(config, {"l0": 2, "l1": 1, "l2": 1})
