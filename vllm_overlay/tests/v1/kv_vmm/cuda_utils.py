# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Skip marker of the tests that need the CUDA VMM backend."""

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
