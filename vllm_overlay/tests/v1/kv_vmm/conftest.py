# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the KV page table tests. ``backend`` is the Linux host
backend, so the suite runs everywhere; test_cuda_backend.py runs the same
tests on the CUDA backend (GPU hosts only)."""

import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.v1.kv_vmm.utils import (
    should_do_global_cleanup_after_test,  # noqa: F401 (the fixture)
)
from vllm.v1.kv_vmm import HostVmmBackend, VmmBackend, VmmOutOfMemoryError


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


@pytest.fixture
def ledger_dir(ledger_base: Path) -> Path:
    """The ledgers and page reports of a test (``ledger_base``)."""
    return ledger_base


class MapFailures:
    """The device out of memory, on demand: physical allocations of the host
    backend fail as out of memory at ``rate`` (0.0 to 1.0), drawn from a
    seeded RNG; ``count`` is how many failed so far."""

    def __init__(self, seed: int = 0) -> None:
        self.rate = 0.0
        self.count = 0
        self._rng = random.Random(seed)

    def draw(self) -> bool:
        if self.rate and self._rng.random() < self.rate:
            self.count += 1
            return True
        return False


@pytest.fixture
def map_failures(monkeypatch: pytest.MonkeyPatch) -> MapFailures:
    """Test hook for map failures: wraps ``HostVmmBackend.create`` (every page
    table of the test process) to raise :class:`VmmOutOfMemoryError` as the
    CUDA driver does when the device is full."""
    failures = MapFailures()
    create = HostVmmBackend.create

    def failing_create(self: HostVmmBackend, nbytes: int) -> int:
        if failures.draw():
            raise VmmOutOfMemoryError(
                f"cuMemCreate({nbytes}) failed: CUDA_ERROR_OUT_OF_MEMORY "
                "(injected by the test)"
            )
        return create(self, nbytes)

    monkeypatch.setattr(HostVmmBackend, "create", failing_create)
    return failures
