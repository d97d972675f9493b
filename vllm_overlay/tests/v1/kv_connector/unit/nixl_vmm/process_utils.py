# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the same-host tests that run a peer in a process of its own
(started with the channel's name and secret, killed with SIGKILL)."""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

_PYTHON_PRELUDE = textwrap.dedent("""
    import os, sys, time, signal, uuid
    import numpy as np, torch
    from vllm.v1.kv_vmm import (
        HostVmmBackend, KVPageGeometry, KVPageTable, KVTensorLayout,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.exporter import (
        ChunkExporter,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.importer import (
        ChunkImporter,
    )
    BLOCK = 256 * 1024
    NAME, SECRET = sys.argv[1], bytes.fromhex(sys.argv[2])
""")


def start_child(code: str, peer) -> subprocess.Popen:
    """A Python child running ``code`` with NAME and SECRET of ``peer``."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PYTHON_PRELUDE + textwrap.dedent(code),
            peer.name,
            peer.secret.hex(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The child's output lines as a thread reads them (None at its end), so
    that a wait for a line has a deadline even while the child prints
    nothing."""
    lines = _LINES.get(proc)
    if lines is None:
        lines = _LINES[proc] = queue.Queue()
        assert proc.stdout is not None

        def pump(stdout=proc.stdout, lines=lines) -> None:
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True, name="child-stdout").start()
    return lines


_LINES: "weakref.WeakKeyDictionary[subprocess.Popen, queue.Queue]" = (
    weakref.WeakKeyDictionary()
)


def readline(proc: subprocess.Popen, want: str, timeout: float = 300) -> str:
    """The first line of the child that starts with ``want`` (importing vLLM
    takes a while on a busy host), within ``timeout`` seconds: a child that
    stalls, silent or not, fails the test then."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    lines = _lines(proc)
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(want):
            return line
    raise AssertionError(f"child never printed {want!r}:\n{''.join(seen)}")
