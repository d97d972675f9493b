# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The interface every virtual-memory backend of the KV page table implements.

A backend hands out three kinds of objects:

* a *reservation*: a range of virtual addresses with no memory behind it;
* a *physical allocation*: memory of a multiple of ``granularity`` bytes,
  identified by an opaque handle;
* a *mapping*: a physical allocation placed at an address inside a
  reservation. A fresh mapping is not accessible until ``set_access`` is
  called on its range (this mirrors ``cuMemMap`` + ``cuMemSetAccess`` and
  lets callers grant access once over a run of adjacent mappings).

Backends are not thread-safe on their own: :class:`KVPageTable` serializes
every call it makes. See the package docstring for the full contract.
"""

from abc import ABC, abstractmethod

import torch


class VmmError(RuntimeError):
    """A virtual-memory operation failed; the message names the call."""


class VmmOutOfMemoryError(VmmError):
    """The device or the host could not provide more physical memory."""


class VmmBackend(ABC):
    """Reserve/map/unmap physical pages of ``granularity`` bytes."""

    #: Device that tensors over this backend's reservations live on.
    device: torch.device
    #: Size, in bytes, that every reservation, allocation and mapping is a
    #: multiple of.
    granularity: int

    def check_aligned(self, nbytes: int, what: str) -> None:
        if nbytes <= 0 or nbytes % self.granularity:
            raise ValueError(
                f"{what} of {nbytes} bytes is not a positive multiple of the "
                f"{type(self).__name__} granularity ({self.granularity} bytes); "
                "round it up to the granularity."
            )

    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of virtual addresses; return the base address."""

    @abstractmethod
    def free_reservation(self, va: int, nbytes: int) -> None:
        """Give back a reservation. Everything mapped in it must be unmapped."""

    @abstractmethod
    def create(self, nbytes: int) -> object:
        """Allocate physical memory; return its handle.

        Raises :class:`VmmOutOfMemoryError` when the memory is not available.
        """

    @abstractmethod
    def release(self, handle: object) -> None:
        """Free a physical allocation that is no longer mapped anywhere."""

    @abstractmethod
    def map(self, va: int, nbytes: int, handle: object) -> None:
        """Map the whole allocation ``handle`` at ``va`` (not yet accessible)."""

    @abstractmethod
    def unmap(self, va: int, nbytes: int) -> None:
        """Unmap ``[va, va + nbytes)``; the addresses stay reserved."""

    @abstractmethod
    def set_access(self, va: int, nbytes: int) -> None:
        """Grant read/write access over a run of adjacent mappings."""

    def bind_thread(self) -> None:  # noqa: B027 - optional hook
        """Make the backend usable from the calling thread, one other than
        the thread that created it. Nothing to do for host memory."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Wait until no queued work can still touch memory about to be
        unmapped. Host memory is accessed synchronously: nothing to wait for.
        """

    def memory_report(self) -> str:
        """What this backend can tell about the memory it allocates from (free
        and total, limits), for an error message; empty if nothing."""
        return ""

    @abstractmethod
    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` tensor over ``[va, va + nbytes)`` that does not own
        the memory; it must not outlive the reservation."""

    @abstractmethod
    def close(self) -> None:
        """Unmap, release and free everything this backend still holds."""
