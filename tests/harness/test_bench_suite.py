"""The benchmark suite's driver (scripts/bench/bench.py, bench_items.py, bench_proc.py) and
report without vLLM: how the A/B pairs of items 1 and 2 become figures, what a CPU run
reports, the doc section, and how a benchmark process that fails or stalls ends its
measurement.

Processes are real: bench_child.py (its failure injected where it starts,
KVSERIES_BENCH_FAULT, before it imports torch or vLLM) and small commands for the session
kill. Items 1 and 2's aggregation runs on the results of a stand-in Runner (one engine per
result would need the engine tier; tests/engine/test_bench_suite.py runs the whole suite on
real engines, marked slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts")]

from bench_items import Budget, Runner, item_engine_ab, item_pd, item_tp2_startup  # noqa: E402
from bench_proc import run_logged  # noqa: E402
from bench_report import IDLE_TTFT, render_results, update_doc  # noqa: E402

CPU = {"models": ["tiny-llama"], "repeats": 2, "engine": {"max_num_seqs": 8},
       "vmm_args": {"kv_cache_vmm_headroom_pages": 1}, "idle_ttft_input": 600,
       "workloads": {"prefill": {"num": 8, "input": 128, "output": 2},
                     "decode": {"num": 8, "input": 16, "output": 16}},
       "elastic": {"model": "tiny-llama"}, "est_child_s": 1, "est_serve_s": 1,
       "warmup": False}


class StandInRunner:
    """Answers each engine process of items 1 and 2 with figures that depend on the side and
    the pair (stock: 100 tokens/s x pair, VMM: 90 x pair); a name in ``fail`` fails."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[str] = []
        self.fail = fail

    def child(self, name: str, spec: dict, timeout: float) -> dict:
        self.calls.append(name)
        if name == self.fail:
            return {"error": "exit status 1; log 03-x.log: RuntimeError: boom"}
        pair = sum(c == name for c in self.calls)
        speed = (100.0 if spec["backend"] == "default" else 90.0) * pair
        keys = [k + s for k in spec["workloads"] for s in ("", ", 2nd run")]
        result = {"startup_s": 10.0 * pair + (1 if spec["backend"] == "vmm" else 0),
                  "workloads": {k: {"tokens_per_s": speed} for k in keys},
                  "idle_ttft": {"ttft_s": 0.5 * pair, "mapped_bytes_idle": 4 << 20},
                  "wall_s": 1.0}
        if spec["backend"] == "vmm":
            result["page_stats"] = [{"kv_pages_mapped_total": 3 * pair, "page_bytes": 2 << 20}]
        return result


def test_items_1_and_2_pair_the_sides_and_keep_what_the_vmm_side_ran_with(tmp_path):
    runner = StandInRunner()
    got = item_engine_ab(runner, CPU, {"throughput", "startup"}, Budget(3600), tmp_path, 0)
    # Interleaved: pair 1 stock first, pair 2 VMM first.
    assert runner.calls == ["tiny-llama-default", "tiny-llama-vmm", "tiny-llama-vmm",
                            "tiny-llama-default"]
    model = got["throughput"]["models"]["tiny-llama"]
    for key in ("prefill", "decode", "prefill, 2nd run", "decode, 2nd run"):
        s = model[key]
        assert (s["a"], s["b"], s["n"]) == ([100.0, 200.0], [90.0, 180.0], 2)
        assert s["ratio"] == pytest.approx(0.9) and s["num"] == 8
    assert model["vmm_page_stats"] == [{"kv_pages_mapped_total": 6, "page_bytes": 2 << 20}]
    idle = model[IDLE_TTFT]
    assert idle["input"] == 600 and idle["vmm_idle_mapped_bytes"] == [4 << 20, 4 << 20]
    assert got["throughput"]["vmm_args"] == CPU["vmm_args"]
    startup = got["startup"]["models"]["tiny-llama"]["startup_s"]
    assert startup["a"] == [10.0, 20.0] and startup["b"] == [11.0, 21.0]
    assert got["throughput"]["engine"] == CPU["engine"]
    md = render_results({"items": got})
    assert "prefill, 2nd run (8 x 128 in / 2 out)" in md
    assert '`{"kv_cache_vmm_headroom_pages": 1}`' in md


def test_a_failed_engine_process_leaves_its_model_not_measured_with_the_error(tmp_path):
    runner = StandInRunner(fail="tiny-llama-vmm")
    got = item_engine_ab(runner, CPU, {"throughput", "startup"}, Budget(3600), tmp_path, 0)
    assert runner.calls == ["tiny-llama-default", "tiny-llama-vmm"]  # no further pairs
    for item in ("throughput", "startup"):
        assert got[item]["models"]["tiny-llama"] == {
            "not_measured": "exit status 1; log 03-x.log: RuntimeError: boom"}


def test_the_two_gpu_items_say_why_a_cpu_or_one_gpu_host_skips_them(tmp_path):
    runner = Runner(tmp_path, "cpu")
    assert item_pd(runner, CPU, tmp_path, 0, Budget(60)) == {
        "not_measured": "needs 2 GPUs, this host has 0"}
    assert item_tp2_startup(runner, CPU, tmp_path, "cpu", 0, 2, Budget(60)) == {
        "not_measured": "needs 2 GPUs (CPU run)"}
    assert item_tp2_startup(runner, CPU, tmp_path, "cuda", 1, 2, Budget(60)) == {
        "not_measured": "needs 2 GPUs, this host has 1"}
    assert runner.failures == []  # not measured here is no failure
    md = render_results({"items": {"pd": {"not_measured": "needs 2 GPUs, this host has 1"}}})
    assert "| 5 | P/D over NIXL |  |  | not measured: needs 2 GPUs, this host has 1 |" in md


class TransferRunner(Runner):
    """Answers item 5's transfer invocations (bench_nixl_vmm.py, which needs two GPUs) with
    fixed figures, keeping each command; the TTFT pairs are left out by the budget."""

    def __init__(self, out: Path) -> None:
        super().__init__(out, "cuda")
        self.commands: list[list[str]] = []

    def run_json(self, name, cmd, js, log, timeout):
        self.commands.append(cmd)
        cpus = cmd[cmd.index("--cpus") + 1] if "--cpus" in cmd else None
        vmm = {"gb_per_s": 300.0} | ({"affinity": [2, 3, 4, 5]} if cpus else {})
        return {"stock": {"gb_per_s": 30.0}, "vmm": vmm, "vmm_ucx": {"gb_per_s": 0.5},
                "link": {"gb_per_s": 360.0}}, None


def test_item_5_places_its_reader_where_asked_and_says_so(tmp_path):
    prof = CPU | {"repeats": 2, "reader_cpus": "gpu", "elastic": {"model": "tiny-llama"}}
    runner = TransferRunner(tmp_path)
    got = item_pd(runner, prof, tmp_path, 2, Budget(0))
    assert [c[c.index("--cpus"):c.index("--cpus") + 2] for c in runner.commands] == [
        ["--cpus", "gpu"]] * 2
    assert got["reader_cpus"] == {"asked": "gpu", "cpus": [2, 3, 4, 5]}
    assert got["transfer_gbps"]["of_link"]["vmm"]["median"] == pytest.approx(300 / 360)
    md = render_results({"items": {"pd": got}})
    assert ("the reader and the link's copy on CPUs 2-5 (next to its GPU, --pd-reader-cpus "
            "gpu).") in md
    # Without it the reader runs wherever the kernel puts it, and the report says nothing.
    runner = TransferRunner(tmp_path)
    got = item_pd(runner, CPU | {"repeats": 1}, tmp_path, 2, Budget(0))
    assert all("--cpus" not in c for c in runner.commands) and "reader_cpus" not in got
    assert "--pd-reader-cpus" not in render_results({"items": {"pd": got}})


@pytest.mark.parametrize("cpus, message", [
    ("3-1", "--pd-reader-cpus '3-1': the range 3-1 runs backwards, or gpu"),
    ("x", "--pd-reader-cpus 'x': give CPUs as a list like 0-3,8, or gpu"),
    ("100000", "--pd-reader-cpus 100000: CPU(s) [100000] are not ours to run on"),
])
def test_a_bad_reader_cpu_list_stops_the_suite_before_anything_runs(tmp_path, cpus, message):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"),
                           "--items", "5", "--device", "cpu", "--out", str(tmp_path),
                           "--pd-reader-cpus", cpus], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and message in done.stderr
    assert not (tmp_path / "logs").exists()  # not even the probe ran


def child_with_fault(tmp_path: Path, monkeypatch, kind: str, fault: str,
                     timeout: float) -> tuple[Runner, dict, float]:
    """Runner.child of a `kind` measurement whose process meets `fault` where it starts
    (KVSERIES_BENCH_FAULT, before it imports torch or vLLM: what is timed is the runner's
    handling of it): the runner, its result and the seconds it took."""
    monkeypatch.setenv("KVSERIES_BENCH_FAULT", f"child:{kind}={fault}")
    runner = Runner(tmp_path, "cpu")
    start = time.monotonic()
    r = runner.child(kind, {"kind": kind}, timeout=timeout)
    return runner, r, time.monotonic() - start


def test_a_failing_benchmark_process_ends_its_measurement_with_its_error(tmp_path, monkeypatch):
    runner, r, seconds = child_with_fault(tmp_path, monkeypatch, "probe", "raise", timeout=120)
    assert seconds < 30
    assert r["error"].startswith("exit status 1; log 01-probe.log: ")
    assert "RuntimeError: fault injected at child:probe (KVSERIES_BENCH_FAULT)" in r["error"]
    assert runner.failures == [f"probe: {r['error']}"]


def test_a_stalled_benchmark_process_is_killed_at_its_deadline(tmp_path, monkeypatch):
    runner, r, seconds = child_with_fault(tmp_path, monkeypatch, "elasticity", "stall",
                                          timeout=2)
    assert seconds < 20
    assert r["error"].startswith("no result in 2 s (killed); log 01-elasticity.log: "
                                 "KVSERIES_BENCH_FAULT: stall at child:elasticity (pid ")
    assert len(runner.failures) == 1
    assert not _alive(int(r["error"].rsplit("(pid ", 1)[1].rstrip(")")))


def test_what_a_benchmark_started_dies_with_it(tmp_path):
    # The process running the benchmark is killed outright (SIGKILL: no cleanup of its own):
    # the process it started in a session of its own goes with it.
    log = tmp_path / "child.log"
    code = (f"import os, sys; sys.path.insert(0, {str(ROOT / 'scripts' / 'bench')!r})\n"
            "from bench_proc import run_logged\n"
            f"run_logged([sys.executable, '-c', 'import os, time; print(os.getpid(), "
            f"flush=True); time.sleep(600)'], __import__('pathlib').Path({str(log)!r}), 600, "
            "dict(os.environ))\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    child = _wait_for_pid(log)
    parent.kill()
    parent.wait()
    assert _gone(child)


def test_sigterm_ends_the_suite_and_what_it_started(tmp_path):
    env = {**os.environ, "KVSERIES_BENCH_FAULT": "child:probe=stall"}
    suite = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"),
                              "--device", "cpu", "--out", str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    probe = _wait_for_pid(tmp_path / "logs" / "01-probe.log", marker="(pid ")
    suite.terminate()
    assert suite.wait(timeout=30) == 128 + 15
    assert _gone(probe)


def _wait_for_pid(log: Path, marker: str = "") -> int:
    """The pid a process writes into its log (after ``marker``, else the first line)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if (marker in text if marker else text.endswith("\n")):
            return int((text.rsplit(marker, 1)[1] if marker else text).split(")")[0].split()[0])
        time.sleep(0.1)
    raise AssertionError(f"no pid in {log} in 60 s")


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_run_logged_kills_what_the_process_started(tmp_path):
    # A process that starts a grandchild and stalls: at the deadline both go.
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "print('started', flush=True)\ntime.sleep(600)\n")
    log = tmp_path / "x.log"
    assert run_logged([sys.executable, "-c", script], log, 3, dict(os.environ)) is None
    assert "started" in log.read_text()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert run_logged([sys.executable, "-c", "raise SystemExit(4)"], log, 30,
                      dict(os.environ)) == 4


def _alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped by its parent, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_suite_ends_with_the_probe_error(tmp_path):
    env = {**os.environ, "KVSERIES_BENCH_FAULT": "child:probe=exit"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"),
                           "--device", "cpu", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert ("the probe of torch, vLLM and the GPUs failed: exit status 3; log 01-probe.log: "
            "KVSERIES_BENCH_FAULT: exit at child:probe") in done.stderr


def test_the_doc_section_is_replaced_in_place_and_the_timeline_copied(tmp_path):
    run = {"date": "d", "command": "python3 scripts/bench/bench.py", "device": "cpu",
           "vllm": "0.32.0", "torch": "2.13.0", "python": "3.11", "cpu_count": 2,
           "suite_s": 120.0}
    out = tmp_path / "bench"
    out.mkdir()
    (out / "elasticity.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    el = {"run": run, "model": "tiny-llama", "png": "elasticity.png", "page_bytes": 2 << 20,
          "blocks_per_page": 16, "block_size": 128, "max_pages": 32, "headroom_pages": 1,
          "startup_mapped_bytes": 4 << 20, "bursts": [
              {"requests": 8, "input": 600, "output": 4, "peak_mapped_bytes": 10 << 20,
               "mapped_bytes_after": 4 << 20, "bound_bytes": 4 << 20, "live_tokens_after": 0,
               "ok": True}]}
    (out / "results.json").write_text(json.dumps({"items": {"elasticity": el}}))
    doc = tmp_path / "docs" / "BENCHMARKS.md"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\n## Page map (kept)\n\ntext\n")
    for _ in range(2):
        update_doc(doc, [out / "results.json"], tmp_path / "docs" / "bench" / "e2e")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Page map (kept)\n\ntext\n")
    assert text.count("## VMM KV vs stock KV allocation") == 1
    assert "| 3 | burst 1" in text and "docs/bench/e2e/elasticity.png" in text
    assert "whole run" in text
    e2e = tmp_path / "docs" / "bench" / "e2e"
    assert (e2e / "elasticity.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((e2e / "results.json").read_text())["items"]["elasticity"]["bursts"]
