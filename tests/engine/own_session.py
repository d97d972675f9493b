# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run a command that starts processes of its own (engine cores, workers, NIXL agents) so
that a hang cannot outlive the test."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run_in_own_session(cmd: list[str], *, env: dict[str, str], timeout: float,
                       what: str) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, stdout and stderr together in ``stdout``. On a
    timeout the whole session is killed and the test fails with the output's tail."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"{what} did not finish in {timeout:g} s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output)
