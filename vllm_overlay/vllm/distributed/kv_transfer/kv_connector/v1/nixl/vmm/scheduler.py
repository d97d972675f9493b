# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NixlConnector's scheduler-side state for VMM-backed KV memory: counts the
registration epoch and serves the workers' republished payloads from the
side channel."""

from collections.abc import MutableMapping
from typing import Any


class NixlVmmScheduler:
    """Scheduler-side NixlConnector state for VMM-backed KV memory."""

    def __init__(self) -> None:
        # Steps that changed the workers' registrations (VMM-backed KV memory
        # mapped or unmapped pages); peers that loaded our metadata at an
        # older epoch fetch it again before reading.
        self.epoch = 0

    def step(self, scheduler_output: Any) -> None:
        """The workers map/unmap pages, and so change their registrations,
        at the start of the step being scheduled; requests that finish in
        this step name the new epoch, and by the time a peer sees it the
        side channel serves the new registrations (``serve`` runs in the
        same update as request_finished)."""
        if scheduler_output.kv_page_ops:
            self.epoch += 1

    def transfer_params(self) -> dict[str, int]:
        """What request_finished adds to kv_transfer_params (nothing with
        stock KV tensors)."""
        return {"remote_registration_epoch": self.epoch} if self.epoch else {}

    @staticmethod
    def serve(served: MutableMapping[Any, bytes], payloads: dict[bytes, bytes]) -> None:
        """Replace, in the side channel's ``served`` payloads, the ones the
        workers republished (encoded old payload -> encoded new payload)."""
        for key, payload in list(served.items()):
            if payload in payloads:
                served[key] = payloads[payload]
