# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the KV page table tests: the same suite runs on the Linux
host backend (everywhere) and on the CUDA backend (GPU hosts only)."""

from collections.abc import Iterator

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
