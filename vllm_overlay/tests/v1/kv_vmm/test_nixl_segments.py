# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NixlSegmentRegistry and SegmentedXferAgent with real NIXL agents (UCX over
the loopback) and real host VMM memory (memfd pages behind a reservation).

Two agents, "prefill" and "decode", live in this process; each has its own
page table over its own reservation. The decode side reads blocks of the
prefill side, as NixlConnector does.
"""

import time

import pytest
import torch

from tests.v1.kv_vmm.utils import requires_nixl, ucx_over_loopback


@pytest.fixture(autouse=True)
def _ucx_over_loopback(monkeypatch):
    ucx_over_loopback(monkeypatch)


BLOCK_BYTES = 256 * 1024  # 8 blocks per 2 MiB page
NUM_BLOCKS = 64  # 8 pages of virtual room


def _side(
    name: str,
    block_bytes: int = BLOCK_BYTES,
    num_blocks: int = NUM_BLOCKS,
    granularity: int = 2 << 20,
    wrap=None,
):
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm.v1.kv_vmm import (
        HostVmmBackend,
        KVPageGeometry,
        KVPageTable,
        KVTensorLayout,
    )
    from vllm.v1.kv_vmm.nixl_segments import NixlSegmentRegistry, SegmentedXferAgent

    backend = HostVmmBackend(granularity)
    geometry = KVPageGeometry(
        [KVTensorLayout(block_bytes=block_bytes, num_regions=1)],
        num_blocks=num_blocks,
        granularity=backend.granularity,
    )
    table = KVPageTable(backend, geometry, max_pages=geometry.num_pages)
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if wrap is not None:
        agent = wrap(agent)
    registry = NixlSegmentRegistry(agent, "DRAM", 0)
    registry.attach(table)
    return backend, table, agent, registry, SegmentedXferAgent(agent, registry)


def _block_descs(table, block_bytes: int, num_blocks: int):
    base = table.tensors[0].data_ptr()
    return [(base + b * block_bytes, block_bytes, 0) for b in range(num_blocks)]


def _block(table, block: int, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    flat = table.tensors[0].view(torch.uint8)
    return flat[block * block_bytes : (block + 1) * block_bytes]


def _read(xfer, local, local_ids, remote, remote_ids) -> str:
    handle = xfer.make_prepped_xfer("READ", local, local_ids, remote, remote_ids)
    state = xfer.transfer(handle)
    deadline = time.monotonic() + 60
    while state == "PROC" and time.monotonic() < deadline:
        state = xfer.check_xfer_state(handle)
    xfer.release_xfer_handle(handle)
    return state


@pytest.fixture
def pair():
    sides = [_side("prefill"), _side("decode")]
    yield sides
    for backend, table, agent, registry, _ in reversed(sides):
        table.close()
        registry.close()
        backend.close()


@requires_nixl
def test_registrations_follow_segments(pair):
    _, table, _, registry, _ = pair[0]
    table.map_pages([0, 2])
    chunks = sorted((c.va, c.nbytes) for s in table.segments() for c in s.chunks)
    assert registry.registered_ranges == chunks and len(chunks) == 2
    generation = registry.generation
    table.unmap_pages([0])
    assert registry.registered_ranges == chunks[1:]
    assert registry.generation == generation + 1
    table.map_pages([1])
    assert len(registry.registered_ranges) == 2
    assert registry.generation == generation + 2

    # Which transfer rows a registration covers: one chunk must hold a row
    # whole; a row across two adjacent chunks is covered by neither.
    import numpy as np

    page = 2 << 20
    base = table.tensors[0].data_ptr()
    rows = np.array(
        [
            (base + page, 4096, 0),  # page 1, mapped
            (base + 3 * page - 4096, 4096, 0),  # end of page 2, mapped
            (base + 2 * page - 2048, 4096, 0),  # across pages 1 and 2
            (base, 4096, 0),  # page 0, unmapped
        ],
        dtype=np.uint64,
    )
    assert registry.unregistered(rows).tolist() == rows[2:].tolist()


@requires_nixl
def test_reads_resolve_against_current_registrations(pair):
    from nixl._api import nixlBind

    from vllm.v1.kv_vmm.backend import VmmError

    _, p_table, p_agent, _, _ = pair[0]
    _, d_table, d_agent, _, d_xfer = pair[1]
    p_table.map_pages([0, 1])
    d_table.map_pages([0])
    for b in range(16):
        _block(p_table, b).fill_(b + 1)
    remote = d_xfer.add_remote_agent(p_agent.get_agent_metadata())
    # Descriptors of every block, mapped or not: preparing them cannot fail.
    local = d_xfer.prep_xfer_dlist(
        "NIXL_INIT_AGENT",
        d_xfer.get_xfer_descs(_block_descs(d_table, BLOCK_BYTES, NUM_BLOCKS), "DRAM"),
    )
    remote_descs = d_xfer.prep_xfer_dlist(
        remote,
        d_xfer.get_xfer_descs(_block_descs(p_table, BLOCK_BYTES, NUM_BLOCKS), "DRAM"),
    )

    assert _read(d_xfer, local, [1, 2], remote_descs, [3, 9]) == "DONE"
    assert torch.all(_block(d_table, 1) == 4) and torch.all(_block(d_table, 2) == 10)

    # A segment the prefill side mapped after the decode side took its metadata
    # is unknown to the decode side: the read is refused, nothing is moved.
    p_table.map_pages([2])
    _block(p_table, 17).fill_(77)
    with pytest.raises(nixlBind.nixlNotFoundError):
        d_xfer.make_prepped_xfer("READ", local, [3], remote_descs, [17])
    # With a way to fetch the peer's current metadata, the read refreshes it
    # once and goes through with the same prepared descriptors.
    refreshed = []

    def refresh(agent_name: str) -> bool:
        refreshed.append(agent_name)
        d_xfer.add_remote_agent(p_agent.get_agent_metadata())
        return True

    d_xfer.refresh_remote = refresh
    assert _read(d_xfer, local, [3], remote_descs, [17]) == "DONE"
    assert refreshed == [remote]
    assert torch.all(_block(d_table, 3) == 77)

    # Out of a peer block its current registrations do not hold either (its
    # page is not mapped): one refresh, then an error naming the peer memory.
    with pytest.raises(VmmError, match="not in its current registrations"):
        d_xfer.make_prepped_xfer("READ", local, [4], remote_descs, [40])
    assert refreshed == [remote, remote]

    # Into a block of an unmapped local page: refused without asking the peer
    # (a refresh cannot help), naming the local memory; never written.
    with pytest.raises(VmmError, match="1 local ones are not inside a registered"):
        d_xfer.make_prepped_xfer("READ", local, [8], remote_descs, [3])
    assert refreshed == [remote, remote]
    d_table.map_pages([1])
    assert _read(d_xfer, local, [8], remote_descs, [3]) == "DONE"
    assert torch.all(_block(d_table, 8) == 4)
    d_xfer.remove_remote_agent(remote)


def test_strided_descriptors_expand_to_the_units_indices_count():
    """NIXL 1.5's strided (Nx5) descriptor lists, as NixlConnector prepares
    them from vLLM 0.33 on, resolve to one row per block in index order."""
    import numpy as np

    from vllm.v1.kv_vmm.nixl_segments import flat_desc_rows

    strided = np.array(
        [[0x1000, 64, 3, 256, 3], [0x9000, 32, 3, 32, 1], [0xA000, 16, 0, 48, 2]],
        dtype=np.uint64,
    )
    assert flat_desc_rows(strided).tolist() == [
        [0x1000, 64, 3],
        [0x1100, 64, 3],
        [0x1200, 64, 3],
        [0x9000, 32, 3],
        [0xA000, 16, 0],
        [0xA030, 16, 0],
    ]
    # The (addr, len, dev) form is kept as it is.
    flat = [(0x1000, 64, 3), (0x2000, 64, 3)]
    assert flat_desc_rows(flat).tolist() == [list(r) for r in flat]


class _HeldCompletion:
    """A real NIXL agent whose transfers report "PROC" until the test releases them.

    A fake on purpose, and only for ordering: the transfer itself is real (UCX
    moves the bytes between real host VMM pages), but whether it has finished is
    what the unmap has to wait for, and a real transfer may finish inside
    transfer() or at any moment after. Holding back the reported completion
    makes "the unmap runs while the transfer is in flight" happen on every run
    instead of when the transfer loses a race.
    """

    def __init__(self, agent) -> None:
        import threading

        self._agent = agent
        self.released = threading.Event()
        # Set once a state query was answered "PROC" because of the hold.
        self.held_query = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def real_state(self, handle) -> str:
        return self._agent.check_xfer_state(handle)

    def transfer(self, handle, *args, **kwargs) -> str:
        state = self._agent.transfer(handle, *args, **kwargs)
        return state if self.released.is_set() or state == "ERR" else "PROC"

    def check_xfer_state(self, handle) -> str:
        state = self._agent.check_xfer_state(handle)
        if self.released.is_set() or state == "ERR":
            return state
        self.held_query.set()
        return "PROC"


@requires_nixl
def test_unmap_waits_for_transfers_that_touch_the_segment():
    import threading

    from vllm.v1.kv_vmm import VmmError

    block = 2 << 20  # one block per page
    p_side = _side("prefill2", block_bytes=block, num_blocks=4)
    d_side = _side("decode2", block_bytes=block, num_blocks=4, wrap=_HeldCompletion)
    sides = [p_side, d_side]
    try:
        _, p_table, p_agent, _, _ = p_side
        _, d_table, held, d_registry, d_xfer = d_side
        p_table.map_pages([0])
        d_table.map_pages([0, 1])
        _block(p_table, 0, block).fill_(5)
        remote = d_xfer.add_remote_agent(p_agent.get_agent_metadata())
        local = d_xfer.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            d_xfer.get_xfer_descs(_block_descs(d_table, block, 4), "DRAM"),
        )
        remote_descs = d_xfer.prep_xfer_dlist(
            remote, d_xfer.get_xfer_descs(_block_descs(p_table, block, 4), "DRAM")
        )
        handle = d_xfer.make_prepped_xfer("READ", local, [0], remote_descs, [0])
        assert d_xfer.transfer(handle) == "PROC"

        # In flight: an unmap that may not wait is refused and the page stays mapped.
        d_registry.unmap_timeout_s = 0.0
        with pytest.raises(VmmError, match="cannot be unmapped"):
            d_table.unmap_pages([0])
        assert d_table.is_mapped(0)
        # Page 1 holds no block of the transfer: it unmaps at once.
        d_table.unmap_pages([1])
        assert not d_table.is_mapped(1)

        # The bytes really arrive (the real transfer finishes on its own).
        deadline = time.monotonic() + 60
        while held.real_state(handle) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert held.real_state(handle) == "DONE"
        assert torch.all(_block(d_table, 0, block) == 5)

        # An unmap allowed to wait blocks while the transfer is reported in flight...
        d_registry.unmap_timeout_s = 60.0
        held.held_query.clear()
        errors: list[BaseException] = []

        def unmap() -> None:
            try:
                d_table.unmap_pages([0])
            except BaseException as e:  # reported by the test thread below
                errors.append(e)

        unmapping = threading.Thread(target=unmap)
        unmapping.start()
        assert held.held_query.wait(60), "the unmap never asked for the state"
        assert unmapping.is_alive()
        assert d_table.is_mapped(0)
        # The wait does not hold the page table's lock: its mapped state can
        # be read meanwhile (segments() takes the lock).
        reader = threading.Thread(target=d_table.segments)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the unmap waits under the page table lock"
        assert unmapping.is_alive() and d_table.is_mapped(0)
        # ... and goes ahead once the transfer completes.
        held.released.set()
        unmapping.join(60)
        assert not unmapping.is_alive()
        assert errors == []
        assert not d_table.is_mapped(0)
        assert d_registry.registered_ranges == []
        d_xfer.release_xfer_handle(handle)
        d_xfer.remove_remote_agent(remote)
    finally:
        # A failed check must not leave an unmap waiting on the hold.
        d_side[2].released.set()
        for backend, table, _, registry, _ in reversed(sides):
            table.close()
            registry.close()
            backend.close()
