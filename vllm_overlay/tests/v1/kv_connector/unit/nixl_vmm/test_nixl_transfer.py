# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real NIXL/UCX transfers out of and into mapped KV segments, between two
processes, each with its own page table whose segment callbacks register
(after map) and deregister (before unmap) every chunk with its NIXL agent.

Host memory (DRAM over UCX loopback) runs everywhere nixl is installed;
device memory (VRAM) runs on GPU hosts.
"""

import multiprocessing as mp
import queue
import traceback
from typing import Any

import pytest
import torch

from tests.v1.kv_connector.unit.nixl_vmm.utils import requires_nixl
from tests.v1.kv_vmm.cuda_utils import requires_cuda_vmm

NUM_PAGES = 4
PAGES_PER_SEGMENT = 2  # two segments of two pages each


def _pattern(seed: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)


def _peer(role: str, kind: str, conn: Any, results: Any) -> None:
    """One side of the transfer. ``initiator`` writes its pattern into the
    target's segments, then reads the target's second pattern back."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        from vllm.v1.kv_vmm import (
            HostVmmBackend,
            KVPageGeometry,
            KVPageTable,
            KVTensorLayout,
            Segment,
        )

        if kind == "cuda":
            from vllm.v1.kv_vmm.cuda import CudaVmmBackend

            torch.accelerator.set_device_index(0)
            backend: Any = CudaVmmBackend(0)
            mem_type, dev_id = "VRAM", 0
        else:
            backend = HostVmmBackend()
            mem_type, dev_id = "DRAM", 0

        agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
        registrations: dict[int, Any] = {}
        events: list[str] = []

        def register(segment: Segment) -> None:
            descs = [(c.va, c.nbytes, dev_id, "") for c in segment.chunks]
            registrations[segment.segment_id] = agent.register_memory(descs, mem_type)
            events.append(f"register {segment.segment_id}")

        def deregister(segment: Segment) -> None:
            agent.deregister_memory(registrations.pop(segment.segment_id))
            events.append(f"deregister {segment.segment_id}")

        geometry = KVPageGeometry(
            [KVTensorLayout(block_bytes=64 * 1024, num_regions=2)],
            num_blocks=1,
            granularity=backend.granularity,
            pages_per_segment=PAGES_PER_SEGMENT,
        )
        # Virtual room for more pages than are ever mapped.
        geometry = KVPageGeometry(
            geometry.layouts,
            num_blocks=2 * NUM_PAGES * geometry.blocks_per_page,
            granularity=backend.granularity,
            pages_per_segment=PAGES_PER_SEGMENT,
        )
        table = KVPageTable(
            backend,
            geometry,
            max_pages=NUM_PAGES,
            on_segment_mapped=register,
            before_segment_unmapped=deregister,
        )
        table.map_pages(range(NUM_PAGES))
        flat = table.tensors[0]
        chunks = [c for s in table.segments() for c in s.chunks]
        nbytes = sum(c.nbytes for c in chunks)

        def chunk_bytes() -> torch.Tensor:
            return torch.cat(
                [
                    flat[c.va - flat.data_ptr() : c.va - flat.data_ptr() + c.nbytes]
                    for c in chunks
                ]
            ).cpu()

        def set_chunk_bytes(data: torch.Tensor) -> None:
            pos = 0
            for c in chunks:
                off = c.va - flat.data_ptr()
                flat[off : off + c.nbytes].copy_(data[pos : pos + c.nbytes])
                pos += c.nbytes

        # Clear before the handshake: once the peer has our metadata it may write
        # at any time, and clearing afterwards would race with its WRITE.
        set_chunk_bytes(torch.zeros(nbytes, dtype=torch.uint8, device=flat.device))
        xfer_descs = [(c.va, c.nbytes, dev_id) for c in chunks]
        conn.send((agent.get_agent_metadata(), xfer_descs))
        remote_meta, remote_descs = conn.recv()
        remote_name = agent.add_remote_agent(remote_meta)

        def run(op: str) -> None:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(xfer_descs, mem_type),
                agent.get_xfer_descs(remote_descs, mem_type),
                remote_name,
            )
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            assert state == "DONE", f"{op} ended in state {state}"
            agent.release_xfer_handle(handle)

        if role == "initiator":
            set_chunk_bytes(_pattern(1, nbytes).to(flat.device))
            run("WRITE")
            conn.send("written")
            assert conn.recv() == "second pattern ready"
            set_chunk_bytes(torch.zeros(nbytes, dtype=torch.uint8, device=flat.device))
            run("READ")
            ok = torch.equal(chunk_bytes(), _pattern(2, nbytes))
            conn.send("done")
        else:
            assert conn.recv() == "written"
            ok = torch.equal(chunk_bytes(), _pattern(1, nbytes))
            set_chunk_bytes(_pattern(2, nbytes).to(flat.device))
            conn.send("second pattern ready")
            assert conn.recv() == "done"
        agent.remove_remote_agent(remote_name)
        table.close()
        backend.close()
        results.put((role, ok, len(chunks), events))
    except BaseException:
        results.put((role, traceback.format_exc(), 0, []))
        raise


def _run_pair(kind: str) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    a_conn, b_conn = ctx.Pipe()
    procs = [
        ctx.Process(target=_peer, args=("initiator", kind, a_conn, results)),
        ctx.Process(target=_peer, args=("target", kind, b_conn, results)),
    ]
    for p in procs:
        p.start()
    outcomes = {}
    try:
        for _ in procs:
            role, ok, num_chunks, events = results.get(timeout=240)
            outcomes[role] = (ok, num_chunks, events)
    except queue.Empty:
        pytest.fail(f"no result from the peers: {outcomes}")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for role, (ok, num_chunks, events) in outcomes.items():
        assert ok is True, f"{role}: {ok}"
        # Two segments x (K, V) regions: four allocations, four descriptors.
        assert num_chunks == 4
        assert events == ["register 0", "register 1", "deregister 0", "deregister 1"]


@requires_nixl
def test_nixl_transfer_host_segments():
    _run_pair("host")


@pytest.mark.gpu
@requires_nixl
@requires_cuda_vmm
def test_nixl_transfer_cuda_segments():
    _run_pair("cuda")
