# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the KV page table tests. ``backend`` is the Linux host
backend, so the suite runs everywhere; test_cuda_backend.py runs the same
tests on the CUDA backend (GPU hosts only)."""

from collections.abc import Iterator

import pytest

from tests.v1.kv_vmm.utils import (
    should_do_global_cleanup_after_test,  # noqa: F401 (the fixture)
)
from vllm.v1.kv_vmm import HostVmmBackend, VmmBackend


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device and cuda-python (cuda.bindings)"
    )


@pytest.fixture(params=["host"])
def backend() -> Iterator[VmmBackend]:
    """The backend the page table tests run on; the test ids name it, as
    those of test_cuda_backend.py (which overrides this fixture) do."""
    b = HostVmmBackend()
    yield b
    b.close()
