# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the NixlConnector-over-VMM tests."""

from collections.abc import Iterator

import pytest

from tests.v1.kv_connector.unit.nixl_vmm.utils import Producer, Reader
from tests.v1.kv_vmm.utils import (
    should_do_global_cleanup_after_test,  # noqa: F401 (the fixture)
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device and cuda-python (cuda.bindings)"
    )


@pytest.fixture
def producer() -> Iterator[Producer]:
    p = Producer()
    yield p
    p.close()


@pytest.fixture
def reader() -> Iterator[Reader]:
    r = Reader()
    yield r
    r.close()
