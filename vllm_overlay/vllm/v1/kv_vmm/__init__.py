# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Elastic KV cache memory on virtual-memory management.

KV tensors are ordinary tensors over a virtual reservation sized for the full
block capacity; physical memory is mapped behind them page by page as the
block pool needs it, and given back when it does not.

* :class:`KVPageGeometry` -- pure blocks-to-pages arithmetic, shared by the
  scheduler (which decides what to map) and the workers (which map it).
* :class:`KVPageTable` -- per worker and KV cache group: reservations, the
  KV tensors over them, ``map_pages``/``unmap_pages`` for all tensors of the
  group in one call, physical budget, segment callbacks for KV connectors.
* Backends: :class:`HostVmmBackend` (Linux ``mmap`` + ``memfd``) and
  ``CudaVmmBackend`` (CUDA driver VMM, in :mod:`vllm.v1.kv_vmm.cuda`, which
  imports ``cuda.bindings`` when used).

Thread-safety contract
----------------------
* The owner of the page table (a worker's model-runner thread) applies
  map/unmap synchronously before the forward pass that needs the pages.
  Pages mapped ahead of demand are mapped on that thread right after the
  forward pass is launched, or, with a device ledger (engines sharing a
  device; the scheduler waits for every rank's report of a page before
  handing it out anyway), on one thread of the worker's own
  (``KVPageMapper``): the owner's next maps and unmaps
  wait for that batch, and a driver error there is raised on the owner's
  thread. (A KV connector may run threads of its own that export a table's
  chunks to other processes, ``VmmBackend.export_chunk``: only chunks it
  tracks as mapped and not being unmapped.)
* ``KVPageTable.map_pages``, ``unmap_pages``, ``close``, ``mapped_pages`` and
  ``segments`` are serialized by one internal lock, so another thread (e.g. a
  KV connector's transfer thread) may read the mapped state while the owner
  maps. The lock is held while segment callbacks run: a callback must not
  call back into the same page table (it would deadlock).
* Backends are not thread-safe on their own; only the page table calls them,
  under its lock. The CUDA backend must be used from threads where the
  device's primary context is current.
* Memory safety is the caller's: no kernel or copy may touch a page after it
  is unmapped. ``unmap_pages`` waits for the device (``synchronize``) before
  unmapping, and runs ``before_segment_unmapped`` first so connectors drop
  their registrations; transfers still in flight on another thread must be
  finished before their pages are unmapped. An access to an unmapped page
  faults (SIGSEGV on the host, an illegal-address error on CUDA) instead of
  silently reading a shared scratch page.
* If ``on_segment_mapped`` raises, the segments stay mapped and the error
  propagates; if ``before_segment_unmapped`` raises, nothing is unmapped.
"""

from vllm.v1.kv_vmm.backend import VmmBackend, VmmError, VmmOutOfMemoryError
from vllm.v1.kv_vmm.geometry import KVPageGeometry, KVTensorLayout
from vllm.v1.kv_vmm.host import HostVmmBackend
from vllm.v1.kv_vmm.page_table import (
    KVPageBudgetError,
    KVPageTable,
    Segment,
    SegmentChunk,
)

__all__ = [
    "HostVmmBackend",
    "KVPageBudgetError",
    "KVPageGeometry",
    "KVPageTable",
    "KVTensorLayout",
    "Segment",
    "SegmentChunk",
    "VmmBackend",
    "VmmError",
    "VmmOutOfMemoryError",
]
