"""GPU tier: skipped cleanly where there is no CUDA device."""

from __future__ import annotations

import os

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
    for item in items:
        item.add_marker(skip)
