# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the KV page table tests: the same suite runs on the Linux
host backend (everywhere) and on the CUDA backend (GPU hosts only)."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.v1.kv_vmm.utils import requires_cuda_vmm
from vllm.v1.kv_vmm import HostVmmBackend, VmmBackend


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device and cuda-python (cuda.bindings)"
    )


@pytest.fixture(
    params=[
        "host",
        pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda_vmm]),
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[VmmBackend]:
    if request.param == "host":
        b: VmmBackend = HostVmmBackend()
    else:
        from vllm.v1.kv_vmm.cuda import CudaVmmBackend

        b = CudaVmmBackend(torch.device("cuda", 0))
    yield b
    b.close()


@pytest.fixture(autouse=True)
def ledger_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Device ledgers and page reports of these tests go to a directory of
    their own (never among real engines' files in /dev/shm), sticky and
    writable by every user like /dev/shm, so tests can act as other users
    in it."""
    path = Path(tempfile.mkdtemp(prefix="vllm-kv-test-"))
    path.chmod(0o1777)
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
