# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's side of engines sharing a device (``--kv-cache-vmm-shared``):
its memory request, the shared KV capacity it measures into the device
ledger, and who holds the device's KV memory (for error messages)."""

import math
from typing import Any, Protocol

import torch

from vllm.logger import init_logger
from vllm.v1.kv_vmm.pages import KVDeviceShareOptions, KVVmmOptions
from vllm.v1.kv_vmm.worker import add_memory_report

logger = init_logger(__name__)


class KVSharedVmmOptions(KVVmmOptions, KVDeviceShareOptions, Protocol):
    """The ``CacheConfig`` of an engine that can share its devices."""


def device_ledger_key(device: torch.device) -> str:
    """The device ledger's key of ``device``: its UUID, ``host`` for host
    memory (how the engine core names each rank's ledger)."""
    if device.type != "cuda":
        return "host"
    from vllm.platforms import current_platform

    return current_platform.get_device_uuid(device.index or 0)


def device_ledger_report(device: torch.device) -> str:
    """The engines the ledger of ``device`` lists, with what they map (for
    an error message: who holds the device's KV memory)."""
    from vllm.v1.kv_vmm.ledger import KVMemoryLedger

    try:
        key = device_ledger_key(device)
        state = KVMemoryLedger(key).read()
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        return f"Engines sharing {device}: unknown (device ledger unreadable: {e})."
    if state is None:
        return (
            f"No engine shares {device} through a device ledger "
            "(--kv-cache-vmm-shared)."
        )
    mib = 1 << 20
    engines = "; ".join(
        f"{e.name or e.id} (pid {e.pid}): {e.mapped_bytes / mib:.0f} MiB mapped, "
        f"floor {e.floor_bytes / mib:.0f} MiB"
        for e in state.entries
    )
    return (
        f"Engines in the ledger of {device} ({state.capacity_bytes / mib:.0f} MiB "
        f"shared): {engines}."
    )


def _sharing(cache_config: KVSharedVmmOptions) -> bool:
    return (
        cache_config.kv_cache_memory_backend == "vmm"
        and cache_config.kv_cache_vmm_shared
    )


def shared_kv_memory_request(
    init_snapshot: Any, cache_config: KVSharedVmmOptions
) -> int | None:
    """The worker's memory request with ``--kv-cache-vmm-shared``; None
    without it (vLLM's ``request_memory`` then applies, unchanged).

    ``--gpu-memory-utilization`` keeps its meaning: the share of the
    device's memory this engine may use, KV memory included. What is not
    required any more is that all of it be free at startup: KV memory is
    virtual until mapped, and what an engine maps comes from the device
    ledger's free room (other engines' idle KV memory included). The
    engine's virtual KV capacity is therefore what it would get alone on
    the device: the request minus its own weights and activations; the
    physical part is the ledger's business.
    """
    if not _sharing(cache_config):
        return None
    requested = math.ceil(
        init_snapshot.total_memory * cache_config.gpu_memory_utilization
    )
    if init_snapshot.free_memory < requested:
        logger.info(
            "KV memory shared through the device ledger: %.2f GiB of the "
            "%.2f GiB requested (--gpu-memory-utilization %s) are free at "
            "startup; KV memory is mapped from what the ledger shows free",
            init_snapshot.free_memory / (1 << 30),
            requested / (1 << 30),
            cache_config.gpu_memory_utilization,
        )
    return requested


def measure_shared_kv_capacity(
    cache_config: KVSharedVmmOptions,
    device: torch.device | None,
    total_bytes: int,
    init_free_bytes: int,
    requested_bytes: int,
    non_kv_bytes: int,
) -> int | None:
    """Measure the KV memory the engines of this device can share and
    record it in the device ledger (``--kv-cache-vmm-shared`` without
    ``--kv-cache-vmm-shared-bytes``); returns the capacity in force, None
    without sharing.

    The capacity is vLLM's own KV budget with the ledger's KV memory
    counted as available: this engine's request, minus what the device
    held at startup that is not KV memory of the ledger's engines (their
    weights and activations, other processes), minus this engine's non-KV
    memory (weights, peak activations, non-torch and CUDA graph memory).
    The engine started last sees every engine's weights, so its
    measurement is the one that counts. Like vLLM's profile, it assumes
    the other processes did not change their memory while it ran.
    """
    if not _sharing(cache_config) or device is None:
        return None
    if cache_config.kv_cache_vmm_shared_bytes is not None:
        return None
    from vllm.platforms import current_platform
    from vllm.v1.kv_vmm.ledger import KVMemoryLedger

    # The engine core names each rank's device ledger the same way.
    ledger_key = current_platform.get_device_uuid(device.index or 0)
    # A ledger that cannot be used refuses the start (LedgerError: the file,
    # the problem and the fix).
    ledger = KVMemoryLedger(ledger_key, group=cache_config.kv_cache_vmm_shared_group)
    ledger_kv = ledger.mapped_bytes()
    held_by_others = max(total_bytes - init_free_bytes - ledger_kv, 0)
    measured = requested_bytes - held_by_others - non_kv_bytes
    capacity = ledger.measure_capacity(measured)
    logger.info(
        "KV memory the engines on device %s share: %.2f GiB (measured "
        "%.2f GiB: requested %.2f, held by others %.2f, this engine's "
        "non-KV %.2f GiB)",
        ledger_key,
        capacity / (1 << 30),
        measured / (1 << 30),
        requested_bytes / (1 << 30),
        held_by_others / (1 << 30),
        non_kv_bytes / (1 << 30),
    )
    return capacity


# A rank that cannot map its pages names the engines of the device's ledger.
add_memory_report(device_ledger_report)
