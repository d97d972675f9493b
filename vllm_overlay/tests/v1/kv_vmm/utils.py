# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import importlib.util

import pytest
import torch


def cuda_vmm_available() -> bool:
    return (
        torch.cuda.is_available()
        and importlib.util.find_spec("cuda") is not None
        and importlib.util.find_spec("cuda.bindings") is not None
    )


requires_cuda_vmm = pytest.mark.skipif(
    not cuda_vmm_available(), reason="needs a CUDA device and cuda-bindings"
)
requires_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="needs nixl"
)
