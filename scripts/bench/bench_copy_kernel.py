#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-host copy kernel reading a peer GPU: launch sizes side by side.

On a host with two GPUs (reader cuda:0, owner cuda:1, peer access on), times the
copy kernel of NixlConnector's same-host reads (``nixl/vmm/cuda_copy.py``) with CUDA
events for two read shapes, 512 random blocks of 256 KiB out of 2048 and one prompt's
16,000 random blocks of 32 KiB out of 32,768, over a grid of launch sizes (programs,
warps, words per loop iteration, piece size), next to one copy-engine copy of the same
bytes (the link). Every variant's bytes are checked. Then the cost of the reads to
work running beside them: a loop of bf16 GEMMs (a decode step's shape: 64 tokens x
4096 x 14336) timed alone and with reads queued on another stream, for the shipped
launch (``RunCopier``), one program per piece, and the copy engines.

    python scripts/bench/bench_copy_kernel.py --json copy_kernel.json

Run with the patched vLLM on PYTHONPATH (the kernel is imported from it). Device time
only: the host work of a read (its rows, the upload) is not in these figures;
``bench_nixl_vmm.py`` measures whole reads.
"""

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

SHAPES = {"random_256k": (256 << 10, 2048, 512), "prompt_32k": (32 << 10, 32768, 16000)}


def timed(fn, stream, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` between two events on ``stream``."""
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def enable_peer_access() -> None:
    """A copy each way makes torch enable peer access between the two devices."""
    for a, b in ((0, 1), (1, 0)):
        with torch.cuda.device(a):
            torch.empty(4, device=f"cuda:{a}").copy_(torch.ones(4, device=f"cuda:{b}"))


def pieces_on_device(cc, runs, base: torch.Tensor, piece_bytes: int):
    """The kernel's pieces of ``runs`` (``copies.Runs``) cut into pieces of
    ``piece_bytes`` (at most the module's own piece size, so ``kernel_pieces`` cuts no
    further), on the device, and how many there are."""
    words = cc.kernel_pieces(cc.split_runs(runs, piece_bytes), base.data_ptr())
    return torch.from_numpy(words).to(base.device).contiguous(), int(words[0])


def sweep(cc, name: str, base: torch.Tensor, rng) -> list[dict]:
    block, num_blocks, per_read = SHAPES[name]
    src = torch.empty(num_blocks * block // 8, dtype=torch.int64, device="cuda:1").random_()
    dst = torch.zeros(num_blocks * block // 8, dtype=torch.int64, device="cuda:0")
    stream = torch.cuda.current_stream(0)
    nbytes = per_read * block
    link_ms = timed(lambda: dst[: nbytes // 8].copy_(src[: nbytes // 8], non_blocking=True),
                    stream)
    link = nbytes / link_ms / 1e6
    local = rng.choice(num_blocks, per_read, replace=False)
    remote = rng.choice(num_blocks, per_read, replace=False)
    runs = cc.Runs(dst.data_ptr() + local.astype(np.uint64) * block,
                   src.data_ptr() + remote.astype(np.uint64) * block,
                   np.full(per_read, block, np.uint64))
    want = src.view(num_blocks, -1)[torch.from_numpy(remote).to("cuda:1")].to("cuda:0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = [{"shape": name, "variant": "link", "gb_per_s": link, "ms": link_ms}]
    print(f"{name}: link {link:.1f} GB/s", flush=True)
    for piece in (64 << 10, 256 << 10):
        pieces, n = pieces_on_device(cc, runs, base, piece)
        for warps in (4, 8):
            for words in (512, 1024, 2048):
                for programs in (sms // 4, sms // 2, sms, n):
                    dst.zero_()

                    def launch(programs=min(programs, n), warps=warps, words=words):
                        cc._copy_runs_kernel[(programs,)](
                            base, pieces, n, WORDS_PER_ITER=words, num_warps=warps)

                    ms = timed(launch, stream)
                    ok = bool(torch.equal(dst.view(num_blocks, -1)[
                        torch.from_numpy(local).to("cuda:0")], want))
                    label = (f"piece {piece >> 10}K warps {warps} words {words} programs "
                             f"{'per piece' if programs == n else programs}")
                    gbs = nbytes / ms / 1e6
                    results.append({"shape": name, "variant": label, "gb_per_s": gbs,
                                    "of_link": gbs / link, "ms": ms, "bytes_ok": ok})
                    print(f"  {label:48s} {gbs:7.1f} GB/s  {gbs / link:.3f} of the link"
                          f"{'' if ok else '  BYTES WRONG'}", flush=True)
    return results


def beside_gemms(cc, base: torch.Tensor, rng) -> dict:
    """A GEMM loop alone and with reads queued beside it on another stream."""
    block, num_blocks, per_read = SHAPES["random_256k"]
    src = torch.empty(num_blocks * block // 8, dtype=torch.int64, device="cuda:1").random_()
    dst = torch.zeros(num_blocks * block // 8, dtype=torch.int64, device="cuda:0")
    runs = cc.Runs(dst.data_ptr() + rng.choice(num_blocks, per_read, replace=False)
                   .astype(np.uint64) * block,
                   src.data_ptr() + rng.choice(num_blocks, per_read, replace=False)
                   .astype(np.uint64) * block,
                   np.full(per_read, block, np.uint64))
    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda:0")
    weights = [torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda:0")
               for _ in range(4)]
    gemm_stream, copy_stream = torch.cuda.Stream(0), torch.cuda.Stream(0)

    def gemms():
        with torch.cuda.stream(gemm_stream):
            for i in range(64):
                torch.matmul(x, weights[i % 4])

    alone = timed(gemms, gemm_stream)
    copier = cc.RunCopier(torch.device("cuda:0"))
    copier.warm_up(copy_stream.cuda_stream)
    pieces, n = pieces_on_device(cc, runs, base, cc.PIECE_BYTES)
    nbytes = per_read * block
    launches = {
        "shipped launch (RunCopier)": lambda: copier.launch(runs, copy_stream.cuda_stream),
        "one program per piece": lambda: cc._copy_runs_kernel[(n,)](
            base, pieces, n, WORDS_PER_ITER=1024, num_warps=8),
        "copy engines (one copy)": lambda: dst[: nbytes // 8].copy_(
            src[: nbytes // 8], non_blocking=True),
    }
    out = {"gemms_alone_ms": alone}
    print(f"GEMM loop alone: {alone:.3f} ms", flush=True)
    for label, launch in launches.items():
        def reads(launch=launch):
            with torch.cuda.stream(copy_stream):
                for _ in range(8):
                    launch()

        reads_ms = timed(reads, copy_stream, iters=5)
        beside = []
        for i in range(8):
            torch.cuda.synchronize(0)
            reads()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(gemm_stream)
            gemms()
            end.record(gemm_stream)
            torch.cuda.synchronize(0)
            if i >= 2:
                beside.append(start.elapsed_time(end))
        ms = statistics.median(beside)
        gbs = 8 * nbytes / reads_ms / 1e6
        out[label] = {"reads_gb_per_s": gbs, "gemms_ms": ms, "gemms_over_alone": ms / alone}
        print(f"  {label:28s} reads {gbs:7.1f} GB/s; GEMM loop beside them {ms:.3f} ms "
              f"({ms / alone:.3f}x alone)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, this host has {torch.cuda.device_count()}")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm import cuda_copy as cc

    torch.cuda.set_device(0)
    enable_peer_access()
    base = torch.zeros(4, dtype=torch.int64, device="cuda:0")
    rng = np.random.default_rng(args.seed)
    print(torch.cuda.get_device_name(0), flush=True)
    results = {"device": torch.cuda.get_device_name(0), "sweep": []}
    for name in SHAPES:
        results["sweep"] += sweep(cc, name, base, rng)
    results["beside_gemms"] = beside_gemms(cc, base, rng)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
