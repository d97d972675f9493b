# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NixlConnector over VMM-backed KV memory (``--kv-cache-memory-backend vmm``).

The release-independent part; each release's NixlConnector calls in from
its worker and scheduler (``worker.NixlVmmWorker``,
``scheduler.NixlVmmScheduler``). The KV memory itself is
:mod:`vllm.v1.kv_vmm`'s.

- ``registry``: NIXL registrations per physical chunk of mapped segments.
- ``agent``: the agent wrapper whose descriptor lists are resolved per
  transfer.
- ``transfers``: the transfer handles (NIXL's and same-host reads) and the
  same-host reads registry.
- ``channel``: the same-host channel's wire protocol and proofs.
- ``exporter`` / ``importer``: the producer's and the reader's side of it.
- ``copies`` / ``cuda_copy``: the reads' copies (host, device, the kernel).
- ``stats``: same-host counters and fallback reasons.
"""
