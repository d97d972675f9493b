#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL READ throughput out of and into KV memory: stock vs VMM-backed.

Two processes (a reader and an owner), each with one NIXL agent (UCX). Each
iteration the reader READs ``--blocks-per-read`` random blocks of the owner's
KV memory into random blocks of its own, the way NixlConnector reads a
prompt's KV (one descriptor per block).

* ``stock``: one ``torch.empty`` allocation per side, registered once, and
  descriptor lists prepared once (``prep_xfer_dlist`` + ``make_prepped_xfer``),
  as NixlConnector does for stock KV tensors.
* ``vmm``: a KVPageTable over VMM memory (``cuMemCreate`` segments on CUDA,
  memfd pages on the host), every segment mapped, registered per physical
  chunk (NixlSegmentRegistry), shared with same-host readers
  (ChunkExporter) and transfers created per read with SegmentedXferAgent,
  as the patched NixlConnector does for VMM-backed KV: the reads run over
  the same-host path (the owner's chunks imported and mapped by the reader,
  runs of adjacent blocks copied by the reader's device). The mode fails if
  a read did not take that path.
* ``vmm_ucx``: the same with the same-host path off: every read goes
  through NIXL/UCX (the path between hosts).
* ``vmm_batch`` (only with ``--modes``): ``vmm`` with the reader's copies
  enqueued as one ``cuMemcpyBatchAsync`` instead of the copy kernel.
* ``link``: the reader's device copies the same number of bytes out of one
  allocation of the owner's device in one copy: what the link between them
  moves (on the host: one memmove).

Prints GB/s per mode (median over ``--iters`` reads after ``--warmup``), the
vmm/stock ratio and each mode's fraction of the link; ``--json`` writes
them. On a GPU host with two GPUs (owner on cuda:1, reader on cuda:0; UCX
picks cuda_ipc where it can)::

    python scripts/bench_nixl_vmm.py --kind cuda --json nixl_vmm.json

The shape of one prompt's read in the P/D TTFT item (Llama-3.1-8B, 4000 tokens: 250
blocks x 32 layers x K and V, 32 KiB each), without the slow path between hosts::

    python scripts/bench_nixl_vmm.py --kind cuda --block-bytes 32768 --num-blocks 32768 \
        --blocks-per-read 16000 --modes stock,vmm,vmm_batch,link

On the host (DRAM over UCX loopback)::

    UCX_TLS=tcp,self,sm UCX_NET_DEVICES=lo python scripts/bench_nixl_vmm.py --kind host

Run with the patched vLLM tree on PYTHONPATH, or where vLLM is not installed
(it then imports the package from ``vllm_overlay/``).
"""

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent  # noqa: F401
except ModuleNotFoundError:
    if "vllm" in sys.modules:
        raise SystemExit(
            "the installed vLLM has no NixlConnector VMM package (nixl/vmm): put the "
            "patched tree on PYTHONPATH, or run where vLLM is not installed"
        ) from None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_overlay"))


def _memory(mode: str, kind: str, device: int, nbytes: int, agent: Any):
    """(base address, NIXL memory type, device id, wrapped agent, closer,
    the same-host reads or None, the same-host secret)."""
    import torch

    if kind == "cuda":
        torch.cuda.set_device(device)
        mem_type, dev_id = "VRAM", device
    else:
        mem_type, dev_id = "DRAM", 0
    if mode == "stock":
        buf = torch.empty(nbytes, dtype=torch.uint8,
                          device=f"cuda:{device}" if kind == "cuda" else "cpu")
        descs = agent.get_reg_descs([(buf.data_ptr(), nbytes, dev_id, "")], mem_type)
        agent.register_memory(descs)

        def close_stock() -> None:
            agent.deregister_memory(descs)
            del buf_ref[:]  # the allocation lives until its registration is gone

        buf_ref = [buf]
        return buf.data_ptr(), mem_type, dev_id, agent, close_stock, None, b""

    from vllm.v1.kv_vmm import HostVmmBackend, KVPageGeometry, KVPageTable, KVTensorLayout
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent import (
        SegmentedXferAgent,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.registry import (
        NixlSegmentRegistry,
    )

    if kind == "cuda":
        from vllm.v1.kv_vmm.cuda import CudaVmmBackend

        backend: Any = CudaVmmBackend(f"cuda:{device}")
    else:
        backend = HostVmmBackend()
    geometry = KVPageGeometry([KVTensorLayout(block_bytes=nbytes, num_regions=1)],
                              num_blocks=1, granularity=backend.granularity)
    table = KVPageTable(backend, geometry, max_pages=geometry.num_pages)
    exporter = same_host = None
    secret = b""
    if mode in ("vmm", "vmm_batch"):
        # As NixlVmmWorker does: shared before the NIXL registry is attached.
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.channel import (
            new_secret,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
            copier_for,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
            ChunkExporter,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.transfers import (
            SameHostReads,
        )

        secret = new_secret()
        exporter = ChunkExporter(agent.name, secret)
        exporter.attach(table)
        same_host = SameHostReads(
            backend, copier_for(backend, copy_kernel=mode == "vmm"), agent.name)
    registry = NixlSegmentRegistry(agent, mem_type, dev_id)
    registry.attach(table)
    table.map_pages(range(geometry.num_pages))

    def close() -> None:
        if same_host is not None:
            same_host.close()
        table.close()
        registry.close()
        if exporter is not None:
            exporter.close()
        backend.close()

    return (table.tensors[0].data_ptr(), mem_type, dev_id,
            SegmentedXferAgent(agent, registry, same_host=same_host), close, same_host,
            secret)


def _side(role: str, args: argparse.Namespace, mode: str, conn: Any) -> None:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    nbytes = args.block_bytes * args.num_blocks
    device = 1 if role == "owner" else 0
    if args.kind == "cuda":
        import torch

        # UCX looks for a current CUDA context when it sets up its transports and
        # registrations; without one it leaves cuda_ipc out (host-staged copies).
        torch.cuda.set_device(device)
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{device}")
    agent = nixl_agent(f"{role}-{mode}", nixl_agent_config(backends=["UCX"]))
    base, mem_type, dev_id, xfer, close, same_host, secret = _memory(
        mode, args.kind, device, nbytes, agent)
    blocks = np.array([(base + b * args.block_bytes, args.block_bytes, dev_id)
                       for b in range(args.num_blocks)], dtype=np.uint64)
    if role == "owner":
        # Only the reader needs the other side's table. (When both sent theirs before
        # receiving, a table of many blocks, more than a pipe holds, had each side wait
        # for the other for ever.)
        conn.send((agent.get_agent_metadata(), blocks, secret))
        assert conn.recv() == "done"
        conn.send(None)
        close()
        return
    peer_meta, peer_blocks, peer_secret = conn.recv()
    peer = xfer.add_remote_agent(peer_meta)
    if same_host is not None and not same_host.offer(peer, peer_secret):
        raise SystemExit(f"{mode}: the same-host channel to {peer!r} did not open")
    local = xfer.prep_xfer_dlist("NIXL_INIT_AGENT", xfer.get_xfer_descs(blocks, mem_type))
    remote = xfer.prep_xfer_dlist(peer, xfer.get_xfer_descs(peer_blocks, mem_type))
    rng = np.random.default_rng(0)
    seconds = []
    for i in range(args.warmup + args.iters):
        local_ids = rng.choice(args.num_blocks, args.blocks_per_read, replace=False)
        remote_ids = rng.choice(args.num_blocks, args.blocks_per_read, replace=False)
        start = time.perf_counter()
        handle = xfer.make_prepped_xfer("READ", local, local_ids, remote, remote_ids)
        state = xfer.transfer(handle)
        while state == "PROC":
            state = xfer.check_xfer_state(handle)
        took = time.perf_counter() - start
        assert state == "DONE", f"read ended in state {state}"
        xfer.release_xfer_handle(handle)
        if i >= args.warmup:
            seconds.append(took)
    reads = 0
    if same_host is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
            same_host_stats,
        )

        reads = same_host_stats()["reads"]
        if reads != args.warmup + args.iters:
            raise SystemExit(f"{mode}: {reads} of {args.warmup + args.iters} reads took "
                             "the same-host path")
        same_host.close()  # our mappings of the owner's chunks go before it unmaps them
    xfer.remove_remote_agent(peer)
    conn.send("done")
    conn.recv()
    close()
    conn.send(_result(args.blocks_per_read * args.block_bytes, seconds)
              | {"same_host_reads": reads})


def _result(nbytes: int, seconds: list[float]) -> dict:
    return {"gb_per_s": nbytes / statistics.median(seconds) / 1e9,
            "median_ms": statistics.median(seconds) * 1e3,
            "min_ms": min(seconds) * 1e3, "max_ms": max(seconds) * 1e3}


def _link(args: argparse.Namespace, conn: Any) -> None:
    """One copy of a read's bytes out of the owner's device into the reader's."""
    nbytes = args.blocks_per_read * args.block_bytes
    if args.kind == "cuda":
        import torch

        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")

        def copy() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(0)
    else:
        import ctypes

        src_buf = ctypes.create_string_buffer(nbytes)
        dst_buf = ctypes.create_string_buffer(nbytes)

        def copy() -> None:
            ctypes.memmove(dst_buf, src_buf, nbytes)
    seconds = []
    for i in range(args.warmup + args.iters):
        start = time.perf_counter()
        copy()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
    conn.send(_result(nbytes, seconds))


def _run(mode: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    reader_end, owner_end = ctx.Pipe()
    if mode == "link":
        proc = ctx.Process(target=_link, args=(args, reader_end))
        proc.start()
        proc.join(timeout=600)
        if proc.exitcode != 0:
            raise SystemExit(f"link: exited with {proc.exitcode}")
        return owner_end.recv()
    procs = [ctx.Process(target=_side, args=("owner", args, mode, owner_end)),
             ctx.Process(target=_side, args=("reader", args, mode, reader_end))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    for p in procs:
        if p.exitcode != 0:
            raise SystemExit(f"{mode}: a side exited with {p.exitcode}")
    # The reader's last message (its result) arrives after the owner has exited.
    return owner_end.recv()


MODES = ("stock", "vmm", "vmm_ucx", "link")
OPTIONAL_MODES = ("vmm_batch",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--block-bytes", type=int, default=256 * 1024,
                        help="bytes per KV block descriptor (default 256 KiB)")
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--blocks-per-read", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated modes to measure, in this order (default "
                        f"{','.join(MODES)})")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := sorted(set(modes) - set(MODES + OPTIONAL_MODES)):
        parser.error(f"unknown mode(s) {unknown}; choose from "
                     f"{', '.join(MODES + OPTIONAL_MODES)}")
    if args.kind == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit("--kind cuda needs two GPUs (owner cuda:1, reader cuda:0)")
    results: dict[str, Any] = {mode: _run(mode, args) for mode in modes}
    if "link" in results:
        link = results["link"]["gb_per_s"]
        results["of_link"] = {mode: results[mode]["gb_per_s"] / link for mode in modes}
    results["config"] = vars(args) | {"json": str(args.json) if args.json else None}
    for mode in modes:
        r = results[mode]
        of_link = (f"; {results['of_link'][mode]:.3f} of the link"
                   if "of_link" in results else "")
        print(f"{mode:7s}: {r['gb_per_s']:8.2f} GB/s  (median {r['median_ms']:.2f} ms, "
              f"min {r['min_ms']:.2f}, max {r['max_ms']:.2f} per read{of_link})")
    if "vmm" in results and "stock" in results:
        results["vmm_over_stock"] = results["vmm"]["gb_per_s"] / results["stock"]["gb_per_s"]
        print(f"vmm/stock: {results['vmm_over_stock']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
