# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NixlConnector over VMM-backed KV memory (``--kv-cache-memory-backend vmm``).

The release-independent part; each release's NixlConnector calls in from
its worker and scheduler (``worker.NixlVmmWorker``, with
``same_host.SameHostPath`` where it reads same-host peers through shared memory,
``scheduler.NixlVmmScheduler``). The KV memory itself is
:mod:`vllm.v1.kv_vmm`'s.

- ``registry``: NIXL registrations per physical chunk of mapped segments.
- ``agent``: the agent wrapper whose descriptor lists are resolved per
  transfer.
- ``transfers``: the transfer handles, and the hook that hands reads to
  another path than NIXL's.
- ``same_host``: the same-host path (the reads registry, its transfers, and
  what the connector passes the worker to take it).
- ``channel``: the same-host channel's wire protocol and proofs.
- ``exporter`` / ``importer``: the producer's and the reader's side of it.
- ``copies`` / ``cuda_copy``: the reads' copies (host, device, the kernel).
- ``stats``: same-host counters and fallback reasons.
"""
