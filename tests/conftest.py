"""Shared fixtures of the project's test tiers (harness tests have their own conftest)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The harness's shared helpers (tiny_model) and the benchmarks (bench_pd's CPU split).
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "bench")]
# nixl_pd_node: the prefill/decode driver the CPU and the GPU P/D tests share.
sys.path.insert(0, str(ROOT / "tests" / "engine"))


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    """A 2-layer dummy-weight Llama (public Llama-3.1-8B config, shrunk) as a model dir."""
    from tiny_model import make_tiny_model

    return make_tiny_model(tmp_path / "tiny-llama")
