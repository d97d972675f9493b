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
* ``vmm_triton`` (only with ``--modes``): ``vmm`` with the copy kernel
  launched through Triton at every read instead of as a captured CUDA graph.
* ``link``: the reader's device copies the same number of bytes out of one
  allocation of the owner's device in one copy: what the link between them
  moves (on the host: one memmove).

Prints GB/s per mode (median over ``--iters`` reads after ``--warmup``), the
vmm/stock ratio and each mode's fraction of the link, and for the NIXL modes
where a read's time goes on the reader's thread (median ms of
``make_prepped_xfer``, of posting it with ``transfer`` and of polling until it is
done), the CPUs the reading thread ran on, how long it waited runnable for a CPU during
each read (the kernel's schedstat) and which other threads of the reader were busy
meanwhile (a NIXL agent's progress thread spins on a CPU of its own); ``--json`` writes
them, and each read's phases, CPU and wait in order (``phases_ms``, ``cpus``,
``queued_ms``; ``busy_threads``). On a GPU host with two GPUs (owner on
cuda:1, reader on cuda:0; UCX picks cuda_ipc where it can)::

    python scripts/bench/bench_nixl_vmm.py --kind cuda --json nixl_vmm.json

The shape of one prompt's read in the P/D TTFT item (Llama-3.1-8B, 4000 tokens: 250
blocks x 32 layers x K and V, 32 KiB each), without the slow path between hosts::

    python scripts/bench/bench_nixl_vmm.py --kind cuda --block-bytes 32768 --num-blocks 32768 \
        --blocks-per-read 16000 --modes stock,vmm,vmm_batch,link

On the host (DRAM over UCX loopback)::

    UCX_TLS=tcp,self,sm UCX_NET_DEVICES=lo python scripts/bench/bench_nixl_vmm.py --kind host

``--cpus 0-7`` (or ``--cpus gpu``: the CPUs next to the reader's GPU, as numactl or vLLM's
``--numa-bind`` place a decode worker) pins the reader and the link's copy: a read's host
work (make, post) differed 2x between processes of one host (docs/BENCHMARKS.md, the
twenty-first runs), and this puts it on chosen CPUs in every mode alike.

Run with the patched vLLM tree on PYTHONPATH, or where vLLM is not installed
(it then imports the package from ``vllm_overlay/``).

Each mode runs in fresh processes, and every wait on them has a deadline
(``--child-timeout-s``, the whole mode): when a process of a mode fails, dies
or stalls, the run ends at once with the modes measured so far printed (and
in ``--json``, with ``"error"``), then the failed mode, how its process ended
and the last lines of its output; exit status 1.
"""

import argparse
import cProfile
import importlib.util
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proc import (  # noqa: E402
    cpu_list, describe_exit, die_with_parent, exit_on_signals, fault, parse_cpus, tail,
    unusable_cpus)

VLLM_OVERLAY = Path(__file__).resolve().parents[2] / "vllm_overlay"
if (__name__ in ("__main__", "__mp_main__") and str(VLLM_OVERLAY) not in sys.path
        and importlib.util.find_spec("vllm") is None):
    # No vLLM installed: the KV memory package from the overlay (a spawned process
    # inherits this path).
    sys.path.insert(0, str(VLLM_OVERLAY))


def _import_kv_vmm() -> None:
    """NixlConnector's VMM package, or the reason the installed vLLM lacks it."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.agent  # noqa: F401
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "vllm":
            raise
        raise SystemExit(
            "the installed vLLM has no NixlConnector VMM package (nixl/vmm): put the "
            "patched tree on PYTHONPATH, or run where vLLM is not installed"
        ) from None


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

    _import_kv_vmm()
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
    if mode in ("vmm", "vmm_batch", "vmm_triton"):
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
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.same_host import (
            SameHostReads,
        )

        secret = new_secret()
        exporter = ChunkExporter(agent.name, secret)
        exporter.attach(table)
        copier = copier_for(backend, copy_kernel=mode != "vmm_batch",
                            graphs=mode != "vmm_triton")
        same_host = SameHostReads(backend, copier, agent.name)
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


def _recv(conn: Connection, timeout: float, what: str) -> Any:
    """The other side's next message; it must come within ``timeout`` seconds (an ended
    other side ends this one too: EOFError)."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} in {timeout:g} s")
    return conn.recv()


def _side(role: str, args: argparse.Namespace, mode: str, conn: Connection) -> dict | None:
    """One side of a mode: the owner lends its memory, the reader reads it and returns the
    figures."""
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
    timeout = args.child_timeout_s
    if role == "owner":
        # Only the reader needs the other side's table. (When both sent theirs before
        # receiving, a table of many blocks, more than a pipe holds, had each side wait
        # for the other for ever.)
        conn.send((agent.get_agent_metadata(), blocks, secret))
        if _recv(conn, timeout, "word from the reader that it has read") != "done":
            raise RuntimeError("the reader sent something else than 'done'")
        conn.send(None)
        close()
        return None
    peer_meta, peer_blocks, peer_secret = _recv(conn, timeout, "block table from the owner")
    peer = xfer.add_remote_agent(peer_meta)
    if same_host is not None and not same_host.offer(peer, peer_secret):
        raise SystemExit(f"{mode}: the same-host channel to {peer!r} did not open")
    local = xfer.prep_xfer_dlist("NIXL_INIT_AGENT", xfer.get_xfer_descs(blocks, mem_type))
    remote = xfer.prep_xfer_dlist(peer, xfer.get_xfer_descs(peer_blocks, mem_type))
    rng = np.random.default_rng(0)
    seconds, phases, cpus, queued = [], [], [], []
    profiler = cProfile.Profile() if args.profile else None
    threads: dict[int, tuple[int, int | None]] = {}
    loop_start = 0.0
    for i in range(args.warmup + args.iters):
        local_ids = rng.choice(args.num_blocks, args.blocks_per_read, replace=False)
        remote_ids = rng.choice(args.num_blocks, args.blocks_per_read, replace=False)
        if i == args.warmup:
            threads, loop_start = thread_cpu_times(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
        before = sched_times()
        handle, state, (start, made, posted, done) = timed_read(
            xfer, local, local_ids, remote, remote_ids)
        after = sched_times()
        assert state == "DONE", f"read ended in state {state}"
        xfer.release_xfer_handle(handle)
        if i >= args.warmup:
            seconds.append(done - start)
            phases.append((made - start, posted - made, done - posted))
            cpus.append(current_cpu())
            queued.append(None if before is None or after is None else
                          (after[1] - before[1]) / 1e6)
    if profiler is not None:
        profiler.disable()
    others = busy_threads(threads, thread_cpu_times(), time.perf_counter() - loop_start)
    fault(f"nixl_vmm:{mode}:reader:read")
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
    _recv(conn, timeout, "word from the owner that the read is over")
    close()
    return _result(args.blocks_per_read * args.block_bytes, seconds, phases) | {
        "same_host_reads": reads, "cpus": cpus, "queued_ms": queued,
        "busy_threads": others} | (
        {"profile": profile_rows(profiler)} if profiler else {})


def current_cpu(stat: Path = Path("/proc/thread-self/stat")) -> int | None:
    """The CPU this thread last ran on (Linux: the 39th field of its stat), None where it
    cannot be read: the host time of a read may depend on where its thread runs."""
    try:
        # The second field (the command) may hold spaces: count after its ")".
        return int(stat.read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def sched_times(path: Path = Path("/proc/thread-self/schedstat")) -> tuple[int, int] | None:
    """Nanoseconds this thread has run and has waited runnable for a CPU (the kernel's
    schedstat), None where the kernel keeps no such figures. A read's host work takes longer
    where its thread shares a CPU with another busy thread (a NIXL agent's progress thread
    spins on one), and the wait says so."""
    try:
        ran, waited = path.read_text().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def thread_cpu_times(tasks: Path = Path("/proc/self/task")) -> dict[int, tuple[int, int | None]]:
    """Each thread of this process: nanoseconds it has run, and the CPU it last ran on."""
    out: dict[int, tuple[int, int | None]] = {}
    try:
        tids = [int(t.name) for t in tasks.iterdir()]
    except OSError:
        return out
    for tid in tids:
        times = sched_times(tasks / str(tid) / "schedstat")
        if times is not None:
            out[tid] = (times[0], current_cpu(tasks / str(tid) / "stat"))
    return out


def busy_threads(before: dict[int, tuple[int, int | None]],
                 after: dict[int, tuple[int, int | None]], seconds: float,
                 at_least: float = 0.2) -> list[dict]:
    """Threads other than this one that ran at least ``at_least`` of ``seconds`` between the
    two samples: the share of the time each ran, and the CPU it last ran on."""
    me = threading.get_native_id()
    busy = []
    for tid, (ran, cpu) in sorted(after.items()):
        share = (ran - before.get(tid, (0, None))[0]) / 1e9 / seconds if seconds > 0 else 0.0
        if tid != me and share >= at_least:
            busy.append({"share": round(share, 3), "cpu": cpu})
    return busy


def gpu_local_cpus(device: int, devices: Path = Path("/sys/bus/pci/devices")) -> set[int]:
    """The CPUs next to CUDA device ``device`` (the PCI device's ``local_cpulist``: its
    NUMA node's), what vLLM's ``--numa-bind`` gives a worker of that GPU."""
    import torch

    props = torch.cuda.get_device_properties(device)
    try:
        address = (f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
                   f"{props.pci_device_id:02x}.0")
    except AttributeError:
        raise SystemExit("--cpus gpu: this torch does not give the GPU's PCI address; give "
                         "the CPUs (nvidia-smi topo -m: the GPU's CPU affinity)") from None
    path = devices / address / "local_cpulist"
    try:
        return parse_cpus(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--cpus gpu: no CPU list for cuda:{device} ({e}); give the CPUs "
                         "(nvidia-smi topo -m: the GPU's CPU affinity)") from None


def pin(cpus: str | None, device: int) -> list[int] | None:
    """This process on ``cpus`` (a CPU list, or ``gpu``: those next to CUDA device
    ``device``); the CPUs it may run on after, None where nothing was asked."""
    if not cpus:
        return None
    os.sched_setaffinity(0, gpu_local_cpus(device) if cpus == "gpu" else parse_cpus(cpus))
    return sorted(os.sched_getaffinity(0))


def timed_read(xfer: Any, local: Any, local_ids: Any, remote: Any, remote_ids: Any,
               **kwargs: Any) -> tuple[Any, str, tuple[float, float, float, float]]:
    """One READ of ``remote_ids`` into ``local_ids`` through a NIXL agent (or the series'
    wrapper of one), polled until it is over: its handle, its last state, and
    ``perf_counter()`` before ``make_prepped_xfer``, after it, after ``transfer`` and when
    the polling ended."""
    start = time.perf_counter()
    handle = xfer.make_prepped_xfer("READ", local, local_ids, remote, remote_ids, **kwargs)
    made = time.perf_counter()
    state = xfer.transfer(handle)
    posted = time.perf_counter()
    while state == "PROC":
        state = xfer.check_xfer_state(handle)
    return handle, state, (start, made, posted, time.perf_counter())


def profile_rows(profiler: cProfile.Profile, sort: str = "tottime", rows: int = 30) -> str:
    """The top ``rows`` of what ``profiler`` saw, by ``sort`` (default: own time): where a
    reader's host time goes."""
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(rows)
    return out.getvalue()


PHASES = ("make", "post", "wait")
"""Where a read's time goes, on the reader's thread: ``make_prepped_xfer``, ``transfer``
(posting it) and polling ``check_xfer_state`` until it is done."""


def _result(nbytes: int, seconds: list[float],
            phases: list[tuple[float, ...]] | None = None) -> dict:
    result = {"gb_per_s": nbytes / statistics.median(seconds) / 1e9,
              "median_ms": statistics.median(seconds) * 1e3,
              "min_ms": min(seconds) * 1e3, "max_ms": max(seconds) * 1e3}
    if phases:
        result["phase_median_ms"] = {
            name: statistics.median(p[i] for p in phases) * 1e3
            for i, name in enumerate(PHASES)}
        # Read by read, in order: how the first reads differ from later ones.
        result["phases_ms"] = [[round(t * 1e3, 4) for t in p] for p in phases]
    return result


def _link(args: argparse.Namespace) -> dict:
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
    return _result(nbytes, seconds)


def _child(mode: str, role: str, args: argparse.Namespace, peer: Connection | None,
           report: Connection, log: str) -> None:
    """A process of a mode: its output goes to ``log`` (the parent shows it), and its
    outcome to ``report``: ("ok", result) or ("error", traceback). It dies with the parent."""
    die_with_parent()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        fault(f"nixl_vmm:{mode}:{role}")
        # The timed side only (the reader, or the link's copy), next to the reader's GPU.
        affinity = pin(args.cpus, 0) if role in ("reader", "link") else None
        result = _link(args) if role == "link" else _side(role, args, mode, peer)
        if result is not None and affinity is not None:
            result["affinity"] = affinity
    except BaseException:  # SystemExit included: its message is the error
        traceback.print_exc()
        sys.stderr.flush()
        report.send(("error", traceback.format_exc()))
        os._exit(1)
    report.send(("ok", result))


class ModeFailed(Exception):
    """A process of a mode failed, died or ran past the deadline."""

    def __init__(self, mode: str, what: str, logs: dict[str, Path]) -> None:
        self.mode = mode
        lines = [f"{mode}: {what}"]
        for role, log in logs.items():
            last = tail(log)
            if last:
                lines.append(f"--- last lines of the {role} process (mode {mode}):")
                lines += [f"  {line}" for line in last]
        super().__init__("\n".join(lines))


def _processes(mode: str) -> tuple[str, ...]:
    return ("link",) if mode == "link" else ("owner", "reader")


def _run(mode: str, args: argparse.Namespace, logs_dir: Path) -> dict:
    """A mode's processes, started afresh; the reader's (or link's) result. Every wait has
    the deadline ``--child-timeout-s``; a process that fails, dies or is not done by then
    ends the mode (ModeFailed) and the other processes of the mode are killed."""
    ctx = mp.get_context("spawn")
    roles = _processes(mode)
    owner_end, reader_end = ctx.Pipe() if len(roles) == 2 else (None, None)
    peers = {"owner": owner_end, "reader": reader_end, "link": None}
    logs = {role: logs_dir / f"{mode}-{role}.log" for role in roles}
    procs, reports = {}, {}
    for role in roles:
        mine, theirs = ctx.Pipe(duplex=False)
        procs[role] = ctx.Process(target=_child, daemon=True, name=f"{mode}-{role}",
                                  args=(mode, role, args, peers[role], theirs,
                                        str(logs[role])))
        procs[role].start()
        theirs.close()  # a child that dies closes the last write end: EOF here
        reports[role] = mine
    for end in (owner_end, reader_end):
        if end is not None:
            end.close()  # each side holds the only copy of its end: one's exit ends the other
    deadline = time.monotonic() + args.child_timeout_s
    results: dict[str, Any] = {}
    try:
        while len(results) < len(roles):
            pending = [r for r in roles if r not in results]
            ready = wait([reports[r] for r in pending] + [procs[r].sentinel for r in pending],
                         timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise ModeFailed(mode, f"not done in {args.child_timeout_s:g} s "
                                 f"(--child-timeout-s); still running: {', '.join(pending)}",
                                 logs)
            for role in pending:
                # A process that exited has written all it sent: its report is read first.
                if not reports[role].poll() and procs[role].sentinel not in ready:
                    continue
                try:
                    kind, payload = reports[role].recv()
                except EOFError:
                    procs[role].join(timeout=5)
                    raise ModeFailed(mode, f"the {role} process ended without a result "
                                     f"({describe_exit(procs[role].exitcode)})", logs) from None
                if kind == "error":
                    raise ModeFailed(mode, f"the {role} process failed:\n{payload.rstrip()}",
                                     {r: logs[r] for r in roles if r != role})
                results[role] = payload
        for proc in procs.values():
            proc.join(timeout=30)  # done: each process tears its agent down and exits
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in reports.values():
            conn.close()
    for role in roles:
        _show(mode, role, logs[role])
    return results[roles[-1]]


def _show(mode: str, role: str, log: Path) -> None:
    """A finished process's output, if it wrote any, on our stderr."""
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        print(f"[{mode} {role}] {line}", file=sys.stderr)


def summary(results: dict[str, Any], modes: list[str]) -> list[str]:
    """Lines for the modes measured (in this order); adds their fraction of the link and the
    VMM/stock ratio to ``results`` where both are there."""
    measured = [m for m in modes if m in results]
    if "link" in results:
        link = results["link"]["gb_per_s"]
        results["of_link"] = {m: results[m]["gb_per_s"] / link for m in measured}
    lines = []
    for mode in measured:
        r = results[mode]
        of_link = (f"; {results['of_link'][mode]:.3f} of the link"
                   if "of_link" in results else "")
        lines.append(f"{mode:7s}: {r['gb_per_s']:8.2f} GB/s  (median {r['median_ms']:.2f} ms, "
                     f"min {r['min_ms']:.2f}, max {r['max_ms']:.2f} per read{of_link})")
        if "phase_median_ms" in r:
            lines.append("         per read, median ms: " + ", ".join(
                f"{name} {ms:.3f}" for name, ms in r["phase_median_ms"].items()))
        if r.get("cpus"):
            lines.append("         reader's CPUs: " + ", ".join(
                str(c) for c in sorted({c for c in r["cpus"] if c is not None})))
        if line := contention(r):
            lines.append("         " + line)
        if r.get("affinity"):
            lines.append(f"         pinned to CPUs {cpu_list(r['affinity'])} (--cpus)")
        if "profile" in r:
            lines.append(f"         the reader's reads under cProfile:\n{r['profile']}")
    if "vmm" in results and "stock" in results:
        results["vmm_over_stock"] = results["vmm"]["gb_per_s"] / results["stock"]["gb_per_s"]
        lines.append(f"vmm/stock: {results['vmm_over_stock']:.3f}")
    return lines


SAME_CPU = " (the reader's)"


def contention(r: dict) -> str:
    """How much the reader's thread waited for a CPU during its timed reads, and which other
    threads of its process were busy meanwhile (on the reader's CPU or elsewhere)."""
    queued = [q for q in r.get("queued_ms") or [] if q is not None]
    if not queued:
        return ""
    mine = {c for c in r.get("cpus") or [] if c is not None}
    busy = ", ".join(
        f"CPU {t['cpu']}{SAME_CPU if t['cpu'] in mine else ''} {t['share']:.2f}"
        for t in r.get("busy_threads") or [])
    return (f"waited for a CPU, median ms per read {statistics.median(queued):.3f} (max "
            f"{max(queued):.3f}); other busy threads of the reader: {busy or 'none'}")


MODES = ("stock", "vmm", "vmm_ucx", "link")
OPTIONAL_MODES = ("vmm_batch", "vmm_triton")


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
    parser.add_argument("--child-timeout-s", type=float, default=600,
                        help="seconds a mode's processes may take, start to result; a mode "
                        "not done by then ends the run (default 600)")
    parser.add_argument("--cpus", metavar="LIST|gpu",
                        help="the reader's (and the link copy's) CPUs, e.g. 0-7, or gpu: those "
                        "next to the reader's GPU (its PCI device's local_cpulist), as "
                        "numactl or vLLM's --numa-bind place a decode worker (default: "
                        "wherever the kernel runs them)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true",
                        help="the reader's timed reads of each mode under cProfile: its rows "
                        "by own time are printed and written to --json (\"profile\"); the "
                        "phases then include the profiler's own cost")
    args = parser.parse_args()
    exit_on_signals()  # SIGTERM: the modes measured are printed, the processes killed
    modes = [m for m in args.modes.split(",") if m]
    if unknown := sorted(set(modes) - set(MODES + OPTIONAL_MODES)):
        parser.error(f"unknown mode(s) {unknown}; choose from "
                     f"{', '.join(MODES + OPTIONAL_MODES)}")
    if args.blocks_per_read > args.num_blocks:
        parser.error(f"--blocks-per-read {args.blocks_per_read} is more than --num-blocks "
                     f"{args.num_blocks}: a read takes distinct blocks")
    if args.child_timeout_s <= 0:
        parser.error("--child-timeout-s must be positive")
    if args.cpus == "gpu" and args.kind != "cuda":
        parser.error("--cpus gpu needs --kind cuda (the CPUs next to the reader's GPU)")
    if args.cpus and args.cpus != "gpu":
        try:
            if why := unusable_cpus(args.cpus):
                parser.error(f"--cpus {args.cpus}: {why}")
        except ValueError as e:
            parser.error(f"--cpus {e}")
    if args.kind == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit("--kind cuda needs two GPUs (owner cuda:1, reader cuda:0)")
    results: dict[str, Any] = {}
    failed: ModeFailed | None = None
    with tempfile.TemporaryDirectory(prefix="bench-nixl-vmm-") as logs_dir:
        for mode in modes:
            try:
                results[mode] = _run(mode, args, Path(logs_dir))
            except ModeFailed as e:
                failed = e
                break
    lines = summary(results, modes)
    results["config"] = vars(args) | {"json": str(args.json) if args.json else None}
    if failed is not None:
        results["error"] = {"mode": failed.mode, "message": str(failed)}
        if lines:
            lines.insert(0, "measured before the failure:")
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if failed is not None:
        print(f"\nerror: {failed}", file=sys.stderr, flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
