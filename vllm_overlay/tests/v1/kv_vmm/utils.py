# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Support of the VMM KV tests."""

import pytest
import torch


@pytest.fixture
def should_do_global_cleanup_after_test() -> bool:
    """Do the global cleanup of vLLM's tests (distributed state, a garbage
    collection, device caches) only where a GPU is: without one these tests
    start no distributed state and hold no device memory, and the cleanup
    (about 0.6 s a test) would be most of the suite's time. Conftests that
    import this override the fixture of ``tests/conftest.py``."""
    return torch.cuda.is_available()
