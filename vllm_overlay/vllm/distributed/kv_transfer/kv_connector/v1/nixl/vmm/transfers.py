# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Transfers of the VMM-aware NIXL agent.

Every transfer the connector drives through the agent is an
:class:`XferHandle`: a NIXL transfer (:class:`NixlXfer`) or one that
:class:`LocalReads` made instead (a read done as a local copy out of a
producer's shared chunks: the same-host path, :mod:`.same_host`). The agent
posts, polls, measures and releases all of them the same way.
"""

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

# check_xfer_state() of a transfer still moving data.
IN_FLIGHT = "PROC"


@functools.cache
def nixl_errors() -> tuple[type[Exception], ...]:
    """NIXL's errors of a transfer or notification that did not go through
    (its peer gone, unknown, or the backend failing); none where nixl is not
    importable (nothing raises them then)."""
    try:
        from nixl._bindings import (
            nixlBackendError,
            nixlNotAllowedError,
            nixlNotFoundError,
            nixlRemoteDisconnectError,
        )
    except ImportError:
        return ()
    return (
        nixlBackendError,
        nixlNotAllowedError,
        nixlNotFoundError,
        nixlRemoteDisconnectError,
    )


@functools.cache
def nixl_not_found() -> tuple[type[Exception], ...]:
    """NIXL's error for descriptors outside the registrations it knows."""
    try:
        from nixl._bindings import nixlNotFoundError
    except ImportError:
        return ()
    return (nixlNotFoundError,)


class XferHandle(ABC):
    """A transfer of the agent: posted once, polled, measured, released."""

    @abstractmethod
    def post(self, *args: Any, **kwargs: Any) -> str:
        """Start it (NIXL's ``transfer``); its state."""

    @abstractmethod
    def state(self) -> str:
        """NIXL's state name ("PROC", "DONE", "ERR"); no side effects."""

    def check(self) -> str:
        """The state the connector polls (``check_xfer_state``)."""
        return self.state()

    @abstractmethod
    def telemetry(self) -> Any:
        """NIXL's ``get_xfer_telemetry`` of it."""

    @abstractmethod
    def release(self) -> None:
        """Give it up (NIXL's ``release_xfer_handle``)."""


class NixlXfer(XferHandle):
    """A transfer NIXL runs (``handle`` from the wrapped agent)."""

    __slots__ = ("agent", "handle")

    def __init__(self, agent: Any, handle: Any) -> None:
        self.agent = agent
        self.handle = handle

    def post(self, *args: Any, **kwargs: Any) -> str:
        return self.agent.transfer(self.handle, *args, **kwargs)

    def state(self) -> str:
        return self.agent.check_xfer_state(self.handle)

    def telemetry(self) -> Any:
        return self.agent.get_xfer_telemetry(self.handle)

    def release(self) -> None:
        self.agent.release_xfer_handle(self.handle)


class LocalReads(ABC):
    """READs the agent hands to another path than NIXL's before it makes
    them NIXL transfers (the same-host path: :class:`~.same_host.SameHostReads`)."""

    @abstractmethod
    def has_channel(self, agent_name: str | bytes) -> bool:
        """Whether reads from ``agent_name`` may take this path (its
        descriptor lists are then kept and resolved per transfer)."""

    @abstractmethod
    def make_read(
        self,
        agent_name: str | bytes,
        local_rows: np.ndarray,
        remote_rows: np.ndarray,
        notif_msg: bytes,
        notify: Callable[[str | bytes, bytes], Any],
    ) -> XferHandle | None:
        """A read of ``remote_rows`` of the peer into ``local_rows``, or None
        (the agent makes it a NIXL transfer). ``notify`` sends the read's
        notification to the peer (by ``agent_name``), as NIXL does after a
        READ."""
