# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The device ledger counts in the unit of every other byte figure of
VMM-backed KV memory (test_byte_units.py): bytes per device, on the device
that holds the most of the engine's KV memory. The same number of bytes
gives the same page limit through --kv-cache-vmm-limit-bytes with sharing
on, the runtime limit and the ledger's CLI."""

import pytest

from tests.v1.kv_vmm.elastic_utils import (  # noqa: F401 (the fixtures)
    ledger_base_fixture,
    ledger_dir_fixture,
    requires_vmm_kv_wiring,
)
from tests.v1.kv_vmm.pool_utils import Clock, make_block_pool
from tests.v1.kv_vmm.test_byte_units import (
    DEVICES,
    SHAPES,
    rank_configs,
    vmm_options,
)
from vllm.v1.kv_vmm.device_share import DeviceShare
from vllm.v1.kv_vmm.ledger import KVMemoryLedger
from vllm.v1.kv_vmm.ledger_cli import main as ledger_cli
from vllm.v1.kv_vmm.pages import make_kv_page_policy

pytestmark = [requires_vmm_kv_wiring, pytest.mark.skip_global_cleanup]


@pytest.mark.parametrize("devices", list(DEVICES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_device_ledger_counts_in_the_same_unit(
    tmp_path, ledger_dir, shape, devices
):
    configs = rank_configs(tmp_path, shape)
    keys = DEVICES[devices]
    base = make_kv_page_policy(vmm_options(), configs, device_keys=keys)
    page = base.device_page_bytes
    limit = 5 * page + page // 2
    # The flag with sharing on: the engine joins each device's ledger with
    # its page limit in that device's bytes.
    options = vmm_options(kv_cache_vmm_shared=True, kv_cache_vmm_limit_bytes=limit)
    policy = make_kv_page_policy(
        options, configs, device_keys=keys, share_options=options
    )
    assert policy.ledger is not None
    per_device = policy.ledger.devices
    assert max(per_device.values()) == page
    pool = make_block_pool(
        policy,
        min(c.num_blocks for c in configs),
        Clock(0.0),
        share_factory=DeviceShare,
    )
    try:
        for key, device_page in per_device.items():
            (entry,) = KVMemoryLedger(key).read().entries
            assert entry.limit_bytes == 5 * device_page
        # The largest device's ledger shows the engine's figures as they are.
        largest = max(per_device, key=per_device.__getitem__)
        (entry,) = KVMemoryLedger(largest).read().entries
        assert entry.mapped_bytes == pool.make_page_stats().mapped_bytes

        # The runtime limit writes the same bytes back to the ledgers.
        pool.set_page_limit(max_bytes=3 * page)
        (entry,) = KVMemoryLedger(largest).read().entries
        assert entry.limit_bytes == 3 * page == pool.page_stats()["kv_limit_bytes"]

        # The operator's CLI: the same number of bytes on each device of the
        # engine is the same page limit at the engine's next ledger read.
        for key in per_device:
            (own,) = KVMemoryLedger(key).read().entries
            args = ["set", own.id, "--key", key, "--limit-bytes", str(limit)]
            assert ledger_cli(args, str(ledger_dir)) == 0
        pool.clock.now += 1.0
        pool.take_page_ops()
        assert pool.policy.max_pages == 5
        assert pool.page_stats()["kv_limit_bytes"] == 5 * page
        # The floor the metrics show is the largest device's, as the ledger has it.
        assert pool.make_page_stats().floor_bytes == entry.floor_bytes
    finally:
        pool.close()
