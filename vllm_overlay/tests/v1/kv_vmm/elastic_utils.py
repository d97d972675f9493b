# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Support of the elastic KV cache's tests: the engine's wiring, a model for
the scheduler, and the fixtures of its files and map failures. A test module
whose tests write page reports or device ledgers imports
``ledger_base_fixture`` (autouse there) so they never land among real
engines' files. Tests import a fixture by its function's name and ask for it
by the fixture's name, so no argument shadows an import."""

import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm.v1.kv_vmm import HostVmmBackend, VmmOutOfMemoryError


def vllm_wires_vmm_kv() -> bool:
    """Whether this vLLM carries the patch that wires VMM-backed KV memory into
    the engine (``--kv-cache-memory-backend``); the overlay alone does not, e.g.
    on a release the patch has not been carried to yet."""
    from vllm.config import CacheConfig

    return "kv_cache_memory_backend" in getattr(CacheConfig, "__dataclass_fields__", {})


requires_vmm_kv_wiring = pytest.mark.skipif(
    not vllm_wires_vmm_kv(),
    reason="this vLLM does not carry the VMM-backed KV cache patch",
)


def write_tiny_llama_config(path: Path, **overrides) -> str:
    """A one-layer Llama config in ``path`` (no weights, no tokenizer): a
    model for vLLM's scheduler test helpers; returns the directory.
    ``overrides`` replace its fields, for a test whose KV cache sizes
    depend on the model's shape."""
    import json

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
        **overrides,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(name="ledger_base", autouse=True)
def ledger_base_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Device ledgers and page reports of these tests go to a directory of
    their own (never among real engines' files in /dev/shm), sticky and
    writable by every user like /dev/shm, so tests can act as other users
    in it."""
    path = Path(tempfile.mkdtemp(prefix="vllm-kv-test-"))
    path.chmod(0o1777)
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(name="ledger_dir")
def ledger_dir_fixture(ledger_base: Path) -> Path:
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


@pytest.fixture(name="map_failures")
def map_failures_fixture(monkeypatch: pytest.MonkeyPatch) -> MapFailures:
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
