# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the same-host tests that run a peer in a process of its own
(started with the channel's name and secret, killed with SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

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


def readline(proc: subprocess.Popen, want: str, timeout: float = 300) -> str:
    """The first line of the child that starts with ``want`` (importing vLLM
    takes a while on a busy host)."""
    deadline = time.monotonic() + timeout
    lines = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(want):
            return line
    raise AssertionError(f"child never printed {want!r}:\n{''.join(lines)}")
