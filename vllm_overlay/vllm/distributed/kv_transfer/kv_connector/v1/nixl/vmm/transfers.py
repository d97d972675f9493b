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


def flat_desc_rows(descs: Any) -> np.ndarray:
    """Transfer descriptors as ``(addr, len, dev)`` rows, one per unit a
    transfer's indices count.

    NIXL's strided form (``(addr, len, dev, stride, count)`` rows, NIXL 1.5)
    names ``count`` units ``stride`` bytes apart; indices into a prepared
    strided list count those units, so they are expanded in order.
    """
    rows = np.asarray(descs, dtype=np.uint64)
    if rows.ndim != 2 or rows.shape[1] != 5:
        return rows.reshape(-1, 3)
    counts = rows[:, 4].astype(np.int64)
    unit = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    addrs = np.repeat(rows[:, 0], counts) + unit.astype(np.uint64) * np.repeat(
        rows[:, 3], counts
    )
    return np.stack(
        [addrs, np.repeat(rows[:, 1], counts), np.repeat(rows[:, 2], counts)], axis=1
    )


def alignment_of(bits: int) -> int:
    """The largest power of two that divides every value whose bitwise or is
    ``bits`` (2**63 for none or zeros: a bound, not a value)."""
    return bits & -bits if bits else 1 << 63


class Descs:
    """Transfer descriptors as the connector gave them (``source``) and
    their memory type; as ``(addr, len, dev)`` rows once first asked for.

    A read takes what it needs of its descriptors by index, out of columns
    made once per list (:attr:`addrs`, :attr:`lengths`): taking whole rows
    of a prompt's 16,000 descriptors, twice per read, cost more host time
    than the copy of their bytes. Lists are weakly referable, so what is
    derived from one (a producer's addresses as mapped here) can be kept
    for as long as the connector keeps the list.
    """

    __slots__ = ("__weakref__", "_columns", "_rows", "mem_type", "source")

    def __init__(self, source: Any, mem_type: str | None) -> None:
        self.source = source
        self.mem_type = mem_type
        self._rows: np.ndarray | None = None
        self._columns: tuple[np.ndarray, np.ndarray, int | None, int] | None = None

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = flat_desc_rows(self.source)
        return self._rows

    def _cols(self) -> tuple[np.ndarray, np.ndarray, int | None, int]:
        if self._columns is None:
            rows = self.rows
            addrs = np.ascontiguousarray(rows[:, 0])
            lengths = np.ascontiguousarray(rows[:, 1])
            uniform = (
                int(lengths[0])
                if len(lengths) and (lengths == lengths[0]).all()
                else None
            )
            bits = (
                int(np.bitwise_or.reduce(addrs) | np.bitwise_or.reduce(lengths))
                if len(addrs)
                else 0
            )
            self._columns = (addrs, lengths, uniform, alignment_of(bits))
        return self._columns

    @property
    def addrs(self) -> np.ndarray:
        """The descriptors' addresses (uint64, contiguous)."""
        return self._cols()[0]

    @property
    def lengths(self) -> np.ndarray:
        """The descriptors' lengths in bytes (uint64, contiguous)."""
        return self._cols()[1]

    @property
    def uniform_length(self) -> int | None:
        """The length every descriptor has, or None if they differ."""
        return self._cols()[2]

    @property
    def alignment(self) -> int:
        """A power of two every address and length is a multiple of (found
        once per list, so a read's copies need not be looked at for it)."""
        return self._cols()[3]

    def flatten(self) -> None:
        """Make the rows and columns now (off the transfer path)."""
        self._cols()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The rows: a list of ours is array-like, as raw rows are."""
        return self.rows if dtype is None else self.rows.astype(dtype)

    @staticmethod
    def of(xfer_list: Any, mem_type: str | None) -> "Descs":
        """What ``prep_xfer_dlist`` took, by NIXL's rule: a list made by
        ``get_xfer_descs`` carries its memory type (vLLM 0.21, 0.32); raw
        rows come with theirs (0.33 prepares strided arrays directly)."""
        return xfer_list if mem_type is None else Descs(xfer_list, mem_type)


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
        local: Descs,
        local_indices: np.ndarray,
        remote: Descs,
        remote_indices: np.ndarray,
        notif_msg: bytes,
        notify: Callable[[str | bytes, bytes], Any],
    ) -> XferHandle | None:
        """A read of the peer's descriptors ``remote_indices`` of ``remote``
        into our ``local_indices`` of ``local`` (int64 arrays, as many of
        each), or None (the agent makes it a NIXL transfer). ``notify`` sends
        the read's notification to the peer (by ``agent_name``), as NIXL
        does after a READ."""
