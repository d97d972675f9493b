# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Child processes of the benchmarks: every wait on one has a deadline, and a child that fails
or stalls ends the wait with its exit status and the last lines of its output. Also the
CPU lists (Linux's ``0-3,8``) that place a benchmark's timed process and report where it ran.

``KVSERIES_BENCH_FAULT`` is for tests only: it makes a child fail or stall at a named point
(``fault``), so that tests can check how a benchmark ends when one of its children does. It
holds comma-separated ``POINT=ACTION`` entries; POINT is a point's name or a prefix of it
that ends before a ``:`` (``nixl_vmm:stock`` is every process of mode stock, at its start).
ACTION is ``raise`` (an exception), ``exit`` (the process dies with status 3, no traceback)
or ``stall`` (it sleeps for an hour).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAULT_ENV = "KVSERIES_BENCH_FAULT"
FAULT_ACTIONS = ("raise", "exit", "stall")

#: How many of a failed child's last output lines an error carries.
TAIL_LINES = 20


def fault(point: str) -> None:
    """Fail or stall here if KVSERIES_BENCH_FAULT names this point (tests only)."""
    spec = os.environ.get(FAULT_ENV, "")
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        key, _, action = entry.partition("=")
        if action not in FAULT_ACTIONS:
            raise SystemExit(f"{FAULT_ENV}={spec!r}: {entry!r} is not POINT=ACTION with ACTION "
                             f"one of {', '.join(FAULT_ACTIONS)}")
        if point != key and not point.startswith(key + ":"):
            continue
        print(f"{FAULT_ENV}: {action} at {point} (pid {os.getpid()})", file=sys.stderr,
              flush=True)
        if action == "raise":
            raise RuntimeError(f"fault injected at {point} ({FAULT_ENV})")
        if action == "exit":
            os._exit(3)
        time.sleep(3600)


def tail(log: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last non-empty lines of a log ([] if there is none)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def describe_exit(code: int | None) -> str:
    """A child's exit code in words (multiprocessing's or subprocess's)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end this process like an error (SystemExit 128 + signal), so that
    its cleanup runs: the processes it started are killed, what it measured is written."""
    def handler(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def die_with_parent() -> None:
    """In a child before exec (``preexec_fn``): SIGKILL when the process that started it
    dies, also of SIGKILL, so a session of its own does not outlive the benchmark."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def kill_session(proc: subprocess.Popen) -> None:
    """Kill a child started with start_new_session=True and whatever it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict) -> int | None:
    """``cmd`` with its output in ``log``, in a session of its own; its exit code, or None if
    it ran past ``timeout`` seconds. A child that ran too long or failed is killed with every
    process it started (engine cores, workers), so none outlives it; so is one still running
    when the wait ends otherwise (Ctrl-C, SIGTERM through exit_on_signals), and the child
    dies with this process (die_with_parent)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=die_with_parent)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:
            kill_session(proc)
            raise
        if rc != 0:
            kill_session(proc)
    return rc


def failure(rc: int | None, timeout: float, log: Path, lines: int = 5) -> str:
    """One line for a failed ``run_logged`` child: how it ended and its output's last lines."""
    how = f"no result in {timeout:g} s (killed)" if rc is None else describe_exit(rc)
    return f"{how}; log {log.name}: " + " | ".join(tail(log, lines))


def parse_cpus(text: str) -> set[int]:
    """CPUs in Linux's list syntax (``0-3,8``, as ``numactl --physcpubind`` and sysfs's
    ``local_cpulist`` write them)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{text!r}: give CPUs as a list like 0-3,8")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"{text!r}: the range {part.strip()} runs backwards")
        cpus.update(range(lo, hi + 1))
    return cpus


def unusable_cpus(text: str) -> str | None:
    """Why the CPU list ``text`` cannot place a process of ours (CPUs outside our affinity),
    or None; a ValueError where ``text`` is no CPU list."""
    ours = os.sched_getaffinity(0)
    if missing := parse_cpus(text) - ours:
        return f"CPU(s) {sorted(missing)} are not ours to run on ({len(ours)} are)"
    return None


def cpu_list(cpus: list[int]) -> str:
    """``cpus`` (sorted) in list syntax: 0-3,8."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
