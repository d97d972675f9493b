# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KVPageTable on real virtual memory: the host backend (``backend`` fixture
in conftest.py); test_cuda_backend.py runs the tests that take ``backend`` on
the CUDA backend."""

import pytest
import torch

from vllm.v1.kv_vmm import (
    HostVmmBackend,
    KVPageBudgetError,
    KVPageGeometry,
    KVPageTable,
    KVTensorLayout,
    Segment,
    VmmBackend,
    VmmOutOfMemoryError,
)

BLOCK_SIZE, NUM_HEADS, HEAD_SIZE = 16, 8, 64
DTYPE = torch.float16
# One K or V block: 16 tokens x 8 heads x 64 x 2 bytes = 16 KiB.
KV_BLOCK_BYTES = 2 * BLOCK_SIZE * NUM_HEADS * HEAD_SIZE * DTYPE.itemsize

NHD = (0, 1, 2, 3, 4)
HND = (0, 1, 3, 2, 4)


def kv_view(
    flat: torch.Tensor, num_blocks: int, stride_order: tuple[int, ...]
) -> torch.Tensor:
    """The logical (2, num_blocks, block_size, heads, head_size) KV cache over
    raw bytes laid out in ``stride_order``, as vLLM's model runner builds it."""
    logical = (2, num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    physical = tuple(logical[i] for i in stride_order)
    inverse = tuple(stride_order.index(i) for i in range(len(stride_order)))
    return flat.view(DTYPE).view(physical).permute(*inverse)


def kv_geometry(
    backend: VmmBackend, num_tensors: int = 2, num_pages: int = 8, **kwargs
) -> KVPageGeometry:
    layout = KVTensorLayout(block_bytes=KV_BLOCK_BYTES, num_regions=2)
    blocks_per_granule = backend.granularity // (KV_BLOCK_BYTES // 2)
    return KVPageGeometry(
        [layout] * num_tensors,
        num_blocks=num_pages * blocks_per_granule,
        granularity=backend.granularity,
        **kwargs,
    )


def fill_page(table: KVPageTable, page: int, value: float) -> None:
    blocks = table.geometry.blocks_of_page(page)
    for flat in table.tensors:
        kv_view(flat, table.geometry.num_blocks, HND)[:, blocks.start : blocks.stop] = (
            value
        )


def page_values(table: KVPageTable, page: int) -> set[float]:
    blocks = table.geometry.blocks_of_page(page)
    values: set[float] = set()
    for flat in table.tensors:
        kv = kv_view(flat, table.geometry.num_blocks, HND)
        values |= set(kv[:, blocks.start : blocks.stop].unique().tolist())
    return values


def test_data_survives_other_pages_mapping(backend: VmmBackend):
    table = KVPageTable(backend, kv_geometry(backend), max_pages=8)
    table.map_pages([0, 1, 2, 3])
    for page in range(4):
        fill_page(table, page, page + 1)
    assert table.unmap_pages([1, 3]) == [1, 3]
    assert table.map_pages([4, 5]) == [4, 5]
    fill_page(table, 4, 5)
    fill_page(table, 5, 6)
    table.map_pages([1])
    fill_page(table, 1, 7)
    assert page_values(table, 0) == {1.0}
    assert page_values(table, 2) == {3.0}
    assert page_values(table, 4) == {5.0}
    assert page_values(table, 5) == {6.0}
    assert page_values(table, 1) == {7.0}
    assert table.mapped_pages() == [0, 1, 2, 4, 5]
    table.close()


def test_map_unmap_idempotent_and_accounting(backend: VmmBackend):
    geometry = kv_geometry(backend, num_tensors=3)
    table = KVPageTable(backend, geometry, max_pages=8)
    assert table.map_pages([2, 0, 2, 0]) == [0, 2]
    assert table.map_pages([0, 2]) == []
    assert table.num_mapped_pages == 2
    assert table.mapped_bytes == 2 * geometry.page_bytes
    # 3 tensors x (K, V) regions x one granule per page.
    assert geometry.page_bytes == 3 * 2 * backend.granularity
    assert table.unmap_pages([5]) == []
    assert table.unmap_pages([2, 2]) == [2]
    assert table.unmap_pages([2]) == []
    assert table.mapped_pages() == [0]
    assert table.is_mapped(0) and not table.is_mapped(2)
    with pytest.raises(ValueError, match=r"page ids \[8\] are outside"):
        table.map_pages([8])
    table.close()
    assert table.num_mapped_pages == 0


def test_budget_refusal_changes_nothing(backend: VmmBackend):
    table = KVPageTable(backend, kv_geometry(backend), max_pages=3)
    table.map_pages([0, 1])
    fill_page(table, 0, 1)
    with pytest.raises(KVPageBudgetError, match="budget of 3 pages"):
        table.map_pages([1, 2, 3])
    assert table.mapped_pages() == [0, 1]
    assert page_values(table, 0) == {1.0}
    table.unmap_pages([1])
    assert table.map_pages([2, 3]) == [2, 3]
    table.close()


class _FailingHostBackend(HostVmmBackend):
    """Real host backend whose n-th allocation fails, as an exhausted device
    would (fault injection: memory cannot be exhausted safely in a test)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.creates = 0
        self.fail_at = fail_at

    def create(self, nbytes: int) -> int:
        self.creates += 1
        if self.creates == self.fail_at:
            raise VmmOutOfMemoryError("injected: out of memory")
        return super().create(nbytes)


def test_out_of_memory_rolls_back():
    backend = _FailingHostBackend(fail_at=6)
    table = KVPageTable(backend, kv_geometry(backend), max_pages=8)
    table.map_pages([0])  # creates 1-4
    fill_page(table, 0, 2)
    # Page 1 needs creates 5-8; the 6th fails after one chunk was mapped.
    with pytest.raises(VmmOutOfMemoryError):
        table.map_pages([1, 2])
    assert table.mapped_pages() == [0]
    assert len(backend._allocations) == 4
    assert page_values(table, 0) == {2.0}
    assert table.map_pages([1]) == [1]
    table.close()
    assert not backend._allocations and not backend._mapped
    backend.close()


@pytest.mark.parametrize("stride_order", [NHD, HND], ids=["NHD", "HND"])
@pytest.mark.parametrize("kv_outer", [True, False], ids=["kv_outer", "blocks_outer"])
def test_views_address_same_bytes_as_reference(
    backend: VmmBackend, stride_order: tuple[int, ...], kv_outer: bool
):
    layout = KVTensorLayout(
        block_bytes=KV_BLOCK_BYTES, num_regions=2 if kv_outer else 1
    )
    geometry = KVPageGeometry([layout], num_blocks=1, granularity=backend.granularity)
    table = KVPageTable(backend, geometry, max_pages=geometry.num_pages)
    flat = table.tensors[0]
    nb = geometry.num_blocks
    reference = torch.zeros(flat.shape, dtype=torch.uint8, device=backend.device)
    assert flat.shape == reference.shape == (geometry.tensor_bytes[0],)

    def view(t: torch.Tensor) -> torch.Tensor:
        if kv_outer:
            return kv_view(t, nb, stride_order)
        # (num_blocks, 2, ...): the block dimension outermost.
        order = (0, 1, *stride_order[2:])
        logical = (nb, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
        physical = tuple(logical[i] for i in order)
        inverse = tuple(order.index(i) for i in range(5))
        return t.view(DTYPE).view(physical).permute(*inverse).transpose(0, 1)

    table.map_pages(range(geometry.num_pages))
    vmm_kv, ref_kv = view(flat), view(reference)
    assert vmm_kv.stride() == ref_kv.stride()
    data = torch.randn(vmm_kv.shape, device=backend.device).to(DTYPE)
    vmm_kv.copy_(data)
    ref_kv.copy_(data)
    assert torch.equal(flat, reference)
    # as_strided over the raw storage (how newer vLLM builds its views).
    strided = flat.view(DTYPE).as_strided(ref_kv.shape, ref_kv.stride())
    assert torch.equal(strided, data)
    # A block written through the view lands at the computed byte offsets.
    block = nb - 1
    vmm_kv[:, block] = 0
    per_region = layout.region_block_bytes
    for region in range(layout.num_regions):
        start = region * geometry.region_bytes[0] + block * per_region
        assert not flat[start : start + per_region].any()
    table.close()


def test_segment_callbacks_order(backend: VmmBackend):
    geometry = kv_geometry(backend, num_tensors=2, pages_per_segment=2)
    events: list[tuple[str, int]] = []

    def first_bytes(segment: Segment) -> list[int]:
        out = []
        for chunk in segment.chunks:
            flat = table.tensors[chunk.tensor_index]
            offset = chunk.va - flat.data_ptr()
            out.append(int(flat[offset]))
        return out

    def on_mapped(segment: Segment) -> None:
        # Registration needs the memory mapped and accessible.
        for chunk in segment.chunks:
            flat = table.tensors[chunk.tensor_index]
            flat[chunk.va - flat.data_ptr()] = 100 + segment.segment_id
        events.append(("mapped", segment.segment_id))

    def before_unmapped(segment: Segment) -> None:
        # Deregistration happens while the memory is still there.
        assert first_bytes(segment) == [100 + segment.segment_id] * 4
        events.append(("unmapping", segment.segment_id))

    table = KVPageTable(
        backend,
        geometry,
        max_pages=8,
        on_segment_mapped=on_mapped,
        before_segment_unmapped=before_unmapped,
    )
    # Pages 5 and 0 -> segments 2 and 0, each mapped whole.
    assert table.map_pages([5, 0]) == [0, 1, 4, 5]
    assert events == [("mapped", 0), ("mapped", 2)]
    segments = table.segments()
    assert [s.segment_id for s in segments] == [0, 2]
    seg = segments[1]
    assert seg.pages == range(4, 6)
    assert seg.blocks == range(
        4 * geometry.blocks_per_page, 6 * geometry.blocks_per_page
    )
    # One chunk (= one allocation) per tensor region, each two pages long.
    assert [(c.tensor_index, c.region) for c in seg.chunks] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert {c.nbytes for c in seg.chunks} == {2 * backend.granularity}
    with pytest.raises(ValueError, match="whole segments"):
        table.unmap_pages([4])
    assert table.unmap_pages([0, 1, 4, 5]) == [0, 1, 4, 5]
    assert events[2:] == [("unmapping", 0), ("unmapping", 2)]
    table.close()
    assert len(events) == 4


def test_failing_deregistration_keeps_memory_mapped(backend: VmmBackend):
    def refuse(segment: Segment) -> None:
        raise RuntimeError("transfer still in flight")

    table = KVPageTable(
        backend, kv_geometry(backend), max_pages=8, before_segment_unmapped=refuse
    )
    table.map_pages([0, 1])
    fill_page(table, 1, 4)
    with pytest.raises(RuntimeError, match="in flight"):
        table.unmap_pages([0, 1])
    assert table.mapped_pages() == [0, 1]
    assert page_values(table, 1) == {4.0}
    table.before_segment_unmapped = None
    table.close()
