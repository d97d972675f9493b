# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""--enable-sleep-mode with --kv-cache-memory-backend vmm is refused when the
config is made: VMM KV pages live outside the cumem pool sleep mode frees, so
sleeping would silently keep the KV memory."""

from types import SimpleNamespace

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
    requires_vmm_kv_wiring,
)
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.kv_vmm import pages
from vllm.v1.kv_vmm.pages import verify_vmm_kv_config

pytestmark = requires_vmm_kv_wiring


def _config(
    backend: str, sleep: bool | None
) -> tuple[CacheConfig, SimpleNamespace | None]:
    model = None if sleep is None else SimpleNamespace(enable_sleep_mode=sleep)
    return CacheConfig(kv_cache_memory_backend=backend), model


def test_vmm_with_sleep_mode_is_refused_naming_both_options_and_the_fix():
    with pytest.raises(ValueError) as err:
        verify_vmm_kv_config(*_config("vmm", sleep=True))
    msg = str(err.value)
    assert "--kv-cache-memory-backend vmm" in msg and "--enable-sleep-mode" in msg
    assert "drop --enable-sleep-mode" in msg
    assert "--kv-cache-memory-backend default" in msg


@pytest.mark.parametrize(
    "backend, sleep", [("vmm", False), ("vmm", None), ("default", True)]
)
def test_other_combinations_pass(backend, sleep):
    verify_vmm_kv_config(*_config(backend, sleep))


@pytest.mark.parametrize("backend, calls", [("vmm", 1), ("default", 0)])
def test_vllm_config_verifies_a_vmm_kv_cache(monkeypatch, backend, calls):
    seen: list[object] = []
    monkeypatch.setattr(pages, "verify_vmm_kv_config", lambda *args: seen.append(args))
    config = VllmConfig(cache_config=CacheConfig(kv_cache_memory_backend=backend))
    assert seen == [(config.cache_config, config.model_config)] * calls
