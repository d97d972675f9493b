# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the NixlConnector-over-VMM tests."""

import pytest

from tests.v1.kv_vmm.utils import (
    should_do_global_cleanup_after_test,  # noqa: F401 (the fixture)
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device and cuda-python (cuda.bindings)"
    )
