# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Engines sharing a device size their KV memory apart from the startup
profile: the memory request does not need to be free, and the device's
shared capacity is measured by each starting engine with the other engines'
KV memory counted as available. A rank that cannot map its pages names the
engines of the device's ledger."""

import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch

from tests.v1.kv_vmm.elastic_utils import (  # noqa: F401 (the fixtures)
    ledger_base_fixture,
    ledger_dir_fixture,
    map_failures_fixture,
)
from tests.v1.kv_vmm.test_map_failures import startup_failure
from vllm.v1.kv_vmm.ledger import KVMemoryLedger
from vllm.v1.kv_vmm.ledger_cli import main as cli
from vllm.v1.kv_vmm.shared_device import (
    measure_shared_kv_capacity,
    shared_kv_memory_request,
)

GiB = 1 << 30
KEY = "GPU-shared-test"


def _cache_config(**kw):
    fields = dict(
        kv_cache_memory_backend="vmm",
        kv_cache_vmm_shared=True,
        kv_cache_vmm_shared_bytes=None,
        kv_cache_vmm_shared_group=None,
        gpu_memory_utilization=0.9,
    )
    return SimpleNamespace(**(fields | kw))


@pytest.fixture
def device_ledger(monkeypatch) -> KVMemoryLedger:
    # In the tests' own directory (VLLM_KV_VMM_LEDGER_DIR, conftest.py).
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        current_platform, "get_device_uuid", lambda index: KEY, raising=False
    )
    return KVMemoryLedger(KEY)


def _measure(config, init_free: int, non_kv: int, total: int = 80 * GiB):
    return measure_shared_kv_capacity(
        config,
        torch.device("cuda", 0),
        total_bytes=total,
        init_free_bytes=init_free,
        requested_bytes=int(total * config.gpu_memory_utilization),
        non_kv_bytes=non_kv,
    )


def test_request_without_free_memory_check():
    snapshot = SimpleNamespace(total_memory=80 * GiB, free_memory=30 * GiB)
    # Sharing: 0.9 of the device is requested although only 30 GiB are free
    # (stock vLLM refuses to start).
    assert shared_kv_memory_request(snapshot, _cache_config()) == 72 * GiB
    # Without sharing (or without VMM) vLLM's own request applies.
    assert (
        shared_kv_memory_request(snapshot, _cache_config(kv_cache_vmm_shared=False))
        is None
    )
    assert (
        shared_kv_memory_request(
            snapshot, _cache_config(kv_cache_memory_backend="default")
        )
        is None
    )


def test_later_engines_see_weights_not_idle_kv(device_ledger):
    config = _cache_config()
    # The first engine alone: 72 GiB requested, 0.5 GiB held at startup
    # (its CUDA context), 17 GiB of its own non-KV memory.
    measured = _measure(config, init_free=int(79.5 * GiB), non_kv=17 * GiB)
    assert measured == int(54.5 * GiB)
    a = device_ledger.join(1 * GiB, "a", mapped_bytes=2 * GiB)
    # The first engine keeps the measured capacity, not its own budget.
    assert device_ledger.read().capacity_bytes == int(54.5 * GiB)
    # The second engine starts while the first maps 2 GiB of KV memory:
    # only the first's 17.5 GiB of non-KV memory count against it.
    free = 80 * GiB - 17.5 * GiB - 2 * GiB - 0.5 * GiB
    assert _measure(config, init_free=int(free), non_kv=17 * GiB) == 37 * GiB
    device_ledger.join(1 * GiB, "b", mapped_bytes=2 * GiB)
    state = device_ledger.read()
    assert state.capacity_bytes == 37 * GiB
    assert state.room(a) == 37 * GiB - 2 * GiB - 2 * GiB


def test_explicit_capacity_is_kept(device_ledger):
    device_ledger.join(20 * GiB, "a", fixed=True)
    assert _measure(_cache_config(), init_free=60 * GiB, non_kv=17 * GiB) == 20 * GiB
    # The CLI's capacity is explicit too.
    assert cli(["capacity", "30G", "--key", KEY]) == 0
    assert _measure(_cache_config(), init_free=60 * GiB, non_kv=17 * GiB) == 30 * GiB
    assert device_ledger.read().capacity_bytes == 30 * GiB
    # An engine given --kv-cache-vmm-shared-bytes measures nothing.
    config = _cache_config(kv_cache_vmm_shared_bytes=8 * GiB)
    assert _measure(config, init_free=60 * GiB, non_kv=17 * GiB) is None


def _measure_and_exit() -> None:
    KVMemoryLedger(KEY).measure_capacity(5 * GiB)
    os._exit(0)


def test_measured_ledger_lives_while_its_engine_starts(device_ledger):
    path = device_ledger.path
    # Measured by this process, nobody joined yet: the ledger stays.
    device_ledger.measure_capacity(5 * GiB)
    assert device_ledger.read() is None  # no engine in it yet
    assert os.path.exists(path)
    device_ledger.join(1 * GiB, "a")
    assert device_ledger.read().capacity_bytes == 5 * GiB
    os.unlink(path)
    # Measured by a process that died before its engine joined: the next
    # reader removes it.
    proc = multiprocessing.get_context("fork").Process(target=_measure_and_exit)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0 and os.path.exists(path)
    assert device_ledger.read() is None
    assert not os.path.exists(path)


def test_startup_that_cannot_map_names_the_engines_of_the_ledger(
    monkeypatch, map_failures, ledger_dir
):
    # Another engine holds KV memory of this device (the host's ledger).
    other = KVMemoryLedger("host")
    other.join(
        capacity_bytes=1 << 30, name="engine-b", mapped_bytes=96 << 20, floor_bytes=0
    )
    message = startup_failure(monkeypatch, map_failures)
    assert "engine-b (pid" in message and "96 MiB mapped" in message
