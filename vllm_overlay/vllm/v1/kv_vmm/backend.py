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

Sharing with other processes (a KV connector's same-host reads) is optional:
``export_chunk`` hands out a physical allocation as a file descriptor, and
``import_chunk`` / ``unmap_import`` map another process's allocation into
this one. They keep no state in the backend, so any thread may call them.
Copies into device memory are the device's work: ``copy_stream`` gives a
stream of asynchronous device copies where the backend's memory is a
device's (host memory is copied by the CPU, and has none).
"""

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np


class VmmError(RuntimeError):
    """A virtual-memory operation failed; the message names the call."""


class VmmOutOfMemoryError(VmmError):
    """The device or the host could not provide more physical memory."""


@dataclasses.dataclass(frozen=True)
class ImportedChunk:
    """Another process's physical allocation, mapped read-only into this one
    (:meth:`VmmBackend.import_chunk`)."""

    #: Where it is mapped in this process.
    addr: int
    nbytes: int
    #: What the backend needs to unmap it (the imported CUDA allocation).
    handle: object = None


class DeviceCopyStream(ABC):
    """Asynchronous copies between device addresses, in order, on one stream
    of the backend's device; an event recorded after them says when they
    are over. Methods may be called from any thread."""

    @property
    @abstractmethod
    def handle(self) -> int:
        """The stream's handle (a kernel may be launched on it)."""

    @abstractmethod
    def copy(self, runs: "np.ndarray") -> None:
        """Enqueue the ``(dst, src, nbytes)`` rows of ``runs`` as copy-engine
        copies."""

    @abstractmethod
    def record(self) -> object:
        """An event that completes once everything enqueued so far did."""

    @abstractmethod
    def query(self, event: object) -> bool:
        """Whether ``event`` completed; raises :class:`VmmError` if the work
        before it failed."""

    @abstractmethod
    def wait(self, event: object) -> None:
        """Block until ``event`` completed."""

    @abstractmethod
    def free(self, event: object) -> None:
        """Give an event of :meth:`record` back (once it completed); the
        stream may reuse it."""


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

    def export_chunk(self, handle: object) -> tuple[int, int]:
        """A new file descriptor of the physical allocation ``handle`` and the
        allocation's offset in it, for another process to
        :meth:`import_chunk` (the caller closes the fd). The other process
        must have unmapped it before the allocation is released."""
        raise VmmError(f"{type(self).__name__} cannot share its memory")

    def import_chunk(self, fd: int, offset: int, nbytes: int) -> ImportedChunk:
        """Map ``nbytes`` at ``offset`` of another process's exported
        allocation (:meth:`export_chunk`) read-only into this process, with
        access for this backend's device; the caller closes ``fd``."""
        raise VmmError(f"{type(self).__name__} cannot map shared memory")

    def unmap_import(self, chunk: ImportedChunk) -> None:
        """Unmap what :meth:`import_chunk` mapped."""
        raise VmmError(f"{type(self).__name__} cannot map shared memory")

    def copy_stream(self) -> DeviceCopyStream | None:
        """A new stream of asynchronous copies on the backend's device, or
        None where the CPU copies the memory (host memory)."""
        return None

    @abstractmethod
    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` tensor over ``[va, va + nbytes)`` that does not own
        the memory; it must not outlive the reservation."""

    @abstractmethod
    def close(self) -> None:
        """Unmap, release and free everything this backend still holds."""
