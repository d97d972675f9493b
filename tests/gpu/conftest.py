"""GPU tier: skipped cleanly where there is no CUDA device."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The test process may have touched CUDA (e.g. the availability check below); engine
# processes must then be spawned, not forked ("Cannot re-initialize CUDA in forked
# subprocess").
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    here = Path(__file__).parent
    for item in items:
        # Only this tier's tests: a run that collects tests/engine too keeps those.
        if here in Path(item.fspath).parents:
            item.add_marker(skip)
