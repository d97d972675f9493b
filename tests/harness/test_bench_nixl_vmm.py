"""scripts/bench/bench_nixl_vmm.py ends at once when a process of a mode fails, dies or stalls:
the modes measured before it are printed (and written to --json), then the failed mode, how
its process ended and the last lines of its output; exit status 1. And its report without
NIXL: each mode's GB/s, its fraction of the link and the VMM/stock ratio.

Real runs of the script with real child processes; the failure is injected where the child
starts (KVSERIES_BENCH_FAULT, scripts/bench/bench_proc.py), before it imports NIXL, so no
NIXL or vLLM is needed: the `link` mode (one host memmove per read) is the mode measured
before the failure. tests/engine/test_bench_nixl_vmm.py fails a real NIXL read's process,
and runs every mode on real NIXL agents (marked slow).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from own_session import run_in_own_session

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts")]

import bench_nixl_vmm  # noqa: E402

SCRIPT = ROOT / "scripts" / "bench" / "bench_nixl_vmm.py"
SMALL = ["--kind", "host", "--block-bytes", "1024", "--num-blocks", "64", "--blocks-per-read",
         "16", "--warmup", "1", "--iters", "3"]


def run(tmp_path: Path, fault: str, *args: str, limit: float = 60):
    """The script with a fault injected; (finished process, seconds it took, --json data)."""
    out = tmp_path / "nixl.json"
    env = {**os.environ, "KVSERIES_BENCH_FAULT": fault}
    start = time.monotonic()
    done = run_in_own_session([sys.executable, str(SCRIPT), *SMALL, "--json", str(out), *args],
                              env=env, timeout=limit, what="bench_nixl_vmm.py")
    return done, time.monotonic() - start, json.loads(out.read_text()) if out.exists() else None


def test_an_exception_in_a_mode_ends_the_run_with_it_after_the_earlier_modes(tmp_path):
    done, seconds, data = run(tmp_path, "nixl_vmm:stock=raise", "--modes", "link,stock,vmm")
    assert done.returncode == 1, done.stdout
    assert seconds < 30
    out = done.stdout
    # The mode measured before, then the failed mode with its process's traceback.
    assert "measured before the failure:" in out
    assert out.index("link   :") < out.index("error: stock: the ")
    assert "RuntimeError: fault injected at nixl_vmm:stock:" in out
    assert data["link"]["gb_per_s"] > 0 and "stock" not in data and "vmm" not in data
    assert data["error"]["mode"] == "stock"
    assert "fault injected at nixl_vmm:stock:" in data["error"]["message"]


def test_a_stalled_mode_ends_at_the_deadline_with_each_process_output(tmp_path):
    done, seconds, data = run(tmp_path, "nixl_vmm:stock=stall", "--modes", "link,stock",
                              "--child-timeout-s", "2")
    assert done.returncode == 1, done.stdout
    # 2 s for the mode, plus starting the processes and killing them (2 shared CPUs).
    assert seconds < 30
    out = done.stdout
    assert "link   :" in out
    assert "error: stock: not done in 2 s (--child-timeout-s); still running: owner, reader" in out
    for role in ("owner", "reader"):
        assert f"--- last lines of the {role} process (mode stock):" in out
        assert f"KVSERIES_BENCH_FAULT: stall at nixl_vmm:stock:{role}" in out
    assert data["error"]["mode"] == "stock" and data["link"]["gb_per_s"] > 0


def test_a_process_that_dies_ends_the_mode_without_waiting_for_the_other(tmp_path):
    # The reader dies without a word while the owner waits for it (the owner would wait
    # until the deadline of 600 s): its death ends the mode.
    done, seconds, _ = run(tmp_path, "nixl_vmm:stock:reader=exit,nixl_vmm:stock:owner=stall",
                           "--modes", "link,stock")
    assert done.returncode == 1, done.stdout
    assert seconds < 30
    assert ("error: stock: the reader process ended without a result (exit status 3)"
            in done.stdout)
    assert "KVSERIES_BENCH_FAULT: exit at nixl_vmm:stock:reader" in done.stdout


def test_a_read_larger_than_the_memory_is_refused_before_anything_starts(tmp_path):
    done = run_in_own_session([sys.executable, str(SCRIPT), "--kind", "host", "--num-blocks",
                               "8", "--blocks-per-read", "16"], env=dict(os.environ),
                              timeout=60, what="bench_nixl_vmm.py")
    assert done.returncode == 2
    assert "--blocks-per-read 16 is more than --num-blocks 8" in done.stdout


def test_the_summary_gives_each_mode_measured_as_a_fraction_of_the_link():
    def r(gbps: float) -> dict:
        return {"gb_per_s": gbps, "median_ms": 1.0, "min_ms": 0.5, "max_ms": 2.0}

    results = {"stock": r(10.0), "vmm": r(40.0), "link": r(50.0)}
    lines = bench_nixl_vmm.summary(results, ["stock", "vmm", "vmm_ucx", "link"])
    assert results["of_link"] == {"stock": 0.2, "vmm": 0.8, "link": 1.0}
    assert results["vmm_over_stock"] == pytest.approx(4.0)
    assert lines[0].startswith("stock  :    10.00 GB/s") and "0.200 of the link" in lines[0]
    assert [line.split(":")[0].strip() for line in lines] == ["stock", "vmm", "link",
                                                              "vmm/stock"]
    # Without the link (or without stock) there is nothing to divide by.
    partial = {"vmm": r(40.0)}
    assert bench_nixl_vmm.summary(partial, ["stock", "vmm"]) == [
        "vmm    :    40.00 GB/s  (median 1.00 ms, min 0.50, max 2.00 per read)"]
    assert "of_link" not in partial and "vmm_over_stock" not in partial


def test_a_reads_time_is_split_into_its_phases_on_the_readers_thread():
    # Two reads: (make, post, wait) of 1+2+7 ms and 3+2+5 ms; 1000 bytes each.
    result = bench_nixl_vmm._result(1000, [0.010, 0.010],
                                    [(0.001, 0.002, 0.007), (0.003, 0.002, 0.005)])
    assert result["phase_median_ms"] == pytest.approx({"make": 2.0, "post": 2.0, "wait": 6.0})
    assert result["median_ms"] == pytest.approx(10.0)
    lines = bench_nixl_vmm.summary({"vmm": result}, ["vmm"])
    assert lines[1] == "         per read, median ms: make 2.000, post 2.000, wait 6.000"
    # The link's one copy has no phases.
    assert "phase_median_ms" not in bench_nixl_vmm._result(1000, [0.001])
    # The CPUs the reading thread ran on, where they were read.
    lines = bench_nixl_vmm.summary({"vmm": result | {"cpus": [5, None, 3, 5]}}, ["vmm"])
    assert lines[2] == "         reader's CPUs: 3, 5"


def test_the_cpu_a_thread_runs_on_is_read_from_its_stat(tmp_path):
    cpu = bench_nixl_vmm.current_cpu()
    if not Path("/proc/thread-self/stat").exists():
        assert cpu is None
    else:
        assert cpu in os.sched_getaffinity(0)
    # A command with spaces and parentheses; field 39 is the CPU.
    stat = tmp_path / "stat"
    stat.write_text("42 (a (b) c) S " + " ".join(str(i) for i in range(4, 39)) + " 7 0 0\n")
    assert bench_nixl_vmm.current_cpu(stat) == 7
    stat.write_text("42 (short) S 1 2\n")
    assert bench_nixl_vmm.current_cpu(stat) is None
    assert bench_nixl_vmm.current_cpu(tmp_path / "absent") is None


def test_a_readers_wait_for_a_cpu_and_the_busy_threads_beside_it_are_reported(tmp_path):
    """The kernel's schedstat of a thread (ns run, ns waited runnable), the threads of this
    process, which of them were busy between two samples, and the summary's line."""
    stat = tmp_path / "schedstat"
    stat.write_text("2500000 1500000 7\n")
    assert bench_nixl_vmm.sched_times(stat) == (2500000, 1500000)
    stat.write_text("garbage\n")
    assert bench_nixl_vmm.sched_times(stat) is None
    assert bench_nixl_vmm.sched_times(tmp_path / "absent") is None
    # This process's threads, with one that spins while we sample.
    if bench_nixl_vmm.sched_times() is not None:
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                pass

        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            first, t0 = bench_nixl_vmm.thread_cpu_times(), time.perf_counter()
            time.sleep(0.3)
            busy = bench_nixl_vmm.busy_threads(first, bench_nixl_vmm.thread_cpu_times(),
                                               time.perf_counter() - t0)
        finally:
            stop.set()
            spinner.join()
        assert threading.get_native_id() in first and spinner.native_id in first
        assert len(busy) == 1 and busy[0]["share"] > 0.2  # the spinner; not this thread
        assert busy[0]["cpu"] in os.sched_getaffinity(0)
    # Shares from two samples: a thread that ran 0.9 s of 1 s, one that did not run, one
    # that started between them, and this thread (never listed).
    me = threading.get_native_id()
    before = {me: (0, 1), 11: (1_000_000_000, 3), 12: (5, 4)}
    after = {me: (900_000_000, 1), 11: (1_900_000_000, 1), 12: (5, 4), 13: (500_000_000, 6)}
    assert bench_nixl_vmm.busy_threads(before, after, 1.0) == [
        {"share": 0.9, "cpu": 1}, {"share": 0.5, "cpu": 6}]
    r = {"queued_ms": [0.0, 0.2, None, 0.05], "cpus": [1, 1, 1, 1],
         "busy_threads": [{"share": 0.9, "cpu": 1}, {"share": 0.5, "cpu": 6}]}
    assert bench_nixl_vmm.contention(r) == (
        "waited for a CPU, median ms per read 0.050 (max 0.200); other busy threads of the "
        "reader: CPU 1 (the reader's) 0.90, CPU 6 0.50")
    assert bench_nixl_vmm.contention({"queued_ms": [None], "cpus": [1]}) == ""
    assert bench_nixl_vmm.contention({"queued_ms": [0.0], "busy_threads": []}).endswith(
        "reader: none")


def test_cpu_lists_are_read_as_linux_writes_them(tmp_path, monkeypatch):
    assert bench_nixl_vmm.parse_cpus("0-3,8, 10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert bench_nixl_vmm.parse_cpus("5") == {5}
    for bad in ("", "a-3", "3-", "4-2", "1,,2"):
        with pytest.raises(ValueError):
            bench_nixl_vmm.parse_cpus(bad)
    assert bench_nixl_vmm.cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    # The CPUs next to a GPU: its PCI device's local_cpulist (a stand-in for torch's
    # device properties and sysfs, which need a GPU).
    import types

    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0)
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_device_properties=lambda device: props))
    monkeypatch.setitem(sys.modules, "torch", torch)
    (tmp_path / "0000:19:00.0").mkdir()
    (tmp_path / "0000:19:00.0" / "local_cpulist").write_text("0-7,64-71\n")
    assert bench_nixl_vmm.gpu_local_cpus(0, tmp_path) == set(range(8)) | set(range(64, 72))
    props.pci_bus_id = 0x1A
    with pytest.raises(SystemExit, match="--cpus gpu: no CPU list for cuda:0"):
        bench_nixl_vmm.gpu_local_cpus(0, tmp_path)
    del props.pci_bus_id
    with pytest.raises(SystemExit, match="does not give the GPU's PCI address"):
        bench_nixl_vmm.gpu_local_cpus(0, tmp_path)


def test_the_timed_process_runs_on_the_cpus_asked_for(tmp_path):
    """A real run of the link mode (no NIXL needed) pinned to one CPU of ours: the result
    says where it was pinned; CPUs that are not ours, or a bad list, stop the run before
    any process starts."""
    cpu = max(os.sched_getaffinity(0))
    out = tmp_path / "nixl.json"
    done = run_in_own_session([sys.executable, str(SCRIPT), *SMALL, "--modes", "link",
                               "--cpus", str(cpu), "--json", str(out)],
                              env=dict(os.environ), timeout=60, what="bench_nixl_vmm.py")
    assert done.returncode == 0, done.stdout
    assert json.loads(out.read_text())["link"]["affinity"] == [cpu]
    assert f"pinned to CPUs {cpu} (--cpus)" in done.stdout
    for bad, message in ((str(cpu + 4096), f"CPU(s) [{cpu + 4096}] are not ours"),
                         ("x", "give CPUs as a list like 0-3,8"),
                         ("gpu", "--cpus gpu needs --kind cuda")):
        done = run_in_own_session([sys.executable, str(SCRIPT), *SMALL, "--modes", "link",
                                   "--cpus", bad], env=dict(os.environ), timeout=60,
                                  what="bench_nixl_vmm.py")
        assert done.returncode == 2 and message in done.stdout, done.stdout
