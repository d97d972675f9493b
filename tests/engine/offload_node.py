# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One node of the multi-node KV offload region test.

Run inside its own mount namespace with a private tmpfs on /dev/shm, so its
/dev/shm is as separate from the other node's as on two hosts. It starts
the node's local ranks; every rank joins one gloo group with the ranks of
the other node (TCP on the loopback), sizes the CPU offload pool with
vLLM's CPUOffloadingSpec, maps its node's SharedOffloadRegion with a
barrier over all ranks, and writes its own slot. Local rank 0 then checks
the node's region and writes a JSON report.
"""

import argparse
import json
import mmap
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

PAGE = mmap.PAGESIZE


def _config(rank: int, world_size: int, nnodes: int, cpu_bytes: int):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),),
        worker_kv_bytes_per_block=PAGE,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_bytes},
        engine_id="multinode-test",
        model=OffloadingModelConfig(name="test-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
            nnodes=nnodes,
        ),
    )


def _rank_main(local_rank: int, args: argparse.Namespace) -> None:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    world_size = args.nnodes * args.local_world_size
    rank = args.node * args.local_world_size + local_rank
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world_size,
    )
    spec = CPUOffloadingSpec(_config(rank, world_size, args.nnodes, args.cpu_bytes))
    region = SharedOffloadRegion(
        engine_id=spec.config.engine_id,
        num_chunks=spec.num_chunks,
        rank=spec._region_slot(),
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
        barrier=dist.barrier,
    )
    view = region.create_next_worker_view(spec.cpu_page_size_per_worker)
    view.fill_(rank + 1)
    dist.barrier()  # every rank of every node has written its slot
    if local_rank == 0:
        rows = region.base_tensor.view(spec.num_chunks, -1)
        slots = rows.view(spec.num_chunks, -1, spec.cpu_page_size_per_worker)
        report = {
            "node": args.node,
            "num_chunks": spec.num_chunks,
            "region_bytes": region.total_size_bytes,
            "page_bytes": spec.cpu_page_size_per_worker,
            # value written into each slot of every row (0 = never written)
            "slot_values": sorted(
                {tuple(int(v) for v in row[:, 0].tolist()) for row in slots}
            ),
            "uniform_slots": bool((slots == slots[:, :, :1]).all().item()),
            # files left in this node's /dev/shm (the region is unlinked once
            # all ranks have mapped it)
            "shm_files": sorted(os.listdir("/dev/shm")),
        }
        with open(args.report, "w") as f:
            json.dump(report, f)
    dist.barrier()
    region.cleanup()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--local-world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cpu-bytes", type=int, required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    mp.start_processes(
        _rank_main,
        args=(args,),
        nprocs=args.local_world_size,
        join=True,
        start_method="spawn",
    )


if __name__ == "__main__":
    sys.exit(main())
