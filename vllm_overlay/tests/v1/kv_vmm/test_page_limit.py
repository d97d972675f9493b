# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The runtime page limit on a block pool without pages: the engine core asks
whichever pool the scheduler has, and the default one refuses with the option
that gives it pages."""

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
    requires_vmm_kv_wiring,
)
from vllm.v1.core.block_pool import BlockPool

pytestmark = requires_vmm_kv_wiring


@pytest.mark.parametrize(
    "kwargs", [{"max_pages": 2}, {"max_bytes": 4 << 20}, {"max_pages": None}]
)
def test_the_default_block_pool_refuses_a_page_limit(kwargs):
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    with pytest.raises(ValueError, match="--kv-cache-memory-backend vmm"):
        pool.set_page_limit(**kwargs)
