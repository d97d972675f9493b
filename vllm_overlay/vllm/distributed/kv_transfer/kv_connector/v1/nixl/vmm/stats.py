# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the same-host path of this process did, and why it did not.

Counters per process (read back through the worker: :func:`same_host_stats`):
reads done as local copies and their bytes, reads that failed, channels
opened; every read or channel that went to NIXL/UCX instead, by reason; and
on a producer, every reader it refused, by reason. The first time a peer
falls back (or is refused) for a reason, a warning names the peer and the
reason; later ones are counted only.
"""

import enum
import threading
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)


class Fallback(str, enum.Enum):
    """Why KV reads from a peer go through NIXL/UCX instead of the same-host
    path (the reader's side), or why a producer refused a reader."""

    #: The peer offers no same-host channel: stock KV tensors, the path
    #: switched off, or a release without it.
    UNSHARED = "unshared"
    #: Nothing listens at the peer's channel: another host or network
    #: namespace, or the peer is gone.
    UNREACHABLE = "unreachable"
    #: The peer did not answer in time (busy); tried again later.
    TIMEOUT = "timeout"
    #: The peer runs on another kernel (boot id or hostname differ).
    OTHER_HOST = "other_host"
    #: A process of another user is at the other end, or the producer
    #: refused this reader's proof (or is closing).
    REFUSED = "refused"
    #: The other end could not prove it holds the handshake's secret.
    AUTH = "auth"
    #: The producer shares another kind of memory than the reader copies
    #: into (host and device).
    KIND = "kind"
    #: Messages that do not follow the protocol.
    PROTOCOL = "protocol"
    #: The reader ran out of file descriptors (RLIMIT_NOFILE).
    FD_LIMIT = "fd_limit"
    #: The channel closed (the producer left, or detached the reader).
    CLOSED = "channel_closed"
    #: Rows of the read lie outside the chunks the producer shares now.
    NOT_SHARED = "not_shared"
    #: This process could not set the path up (no listener, no device).
    SETUP = "setup"
    #: The producer was busy: too many channels in their handshake at once
    #: (its side), or it closed the channel before the reader's proof came
    #: (the reader's side: it gave up waiting); tried again later.
    BUSY = "busy"


#: The order of the reasons in a vector of fallback counts
#: (:func:`take_fallback_counts`).
FALLBACK_REASONS: tuple[Fallback, ...] = tuple(Fallback)

# Peers and reasons logged once; past this many, only counted.
_MAX_LOGGED = 1024
_FELL_BACK = "KV reads from %s go through NIXL/UCX (%s): %s"


class SameHostStats:
    """Counters of one process; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {
            "reads": 0,
            "bytes": 0,
            "failed": 0,
            "channels": 0,
            "fallbacks": 0,
            "refused": 0,
        }
        self._logged: set[tuple[str, str, str]] = set()
        # Fallbacks per reason since the last take_fallback_counts().
        self._untaken = dict.fromkeys(FALLBACK_REASONS, 0)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._counts[key] += value

    def fallback(
        self, peer: str, reason: Fallback, detail: object, quiet: bool = False
    ) -> None:
        """A read (or a channel) of ``peer`` goes through NIXL/UCX because of
        ``reason``: counted, and the first time for this peer and reason a
        warning. ``quiet``: the peer never had a same-host path (a reader
        with stock KV tensors asks every peer, and most are stock): a debug
        line, not counted."""
        if quiet:
            if self._first_log("fallback", peer, reason):
                logger.debug(_FELL_BACK, peer, reason.value, detail)
            return
        with self._lock:
            self._counts["fallbacks"] += 1
            key = f"fallbacks_{reason.value}"
            self._counts[key] = self._counts.get(key, 0) + 1
            self._untaken[reason] += 1
        if self._first_log("fallback", peer, reason):
            logger.warning(_FELL_BACK, peer, reason.value, detail)

    def refused(self, peer: str, reason: Fallback, detail: object) -> None:
        """A producer refused (or dropped) the reader ``peer``."""
        with self._lock:
            self._counts["refused"] += 1
            key = f"refused_{reason.value}"
            self._counts[key] = self._counts.get(key, 0) + 1
        if self._first_log("refused", peer, reason):
            logger.warning(
                "Same-host KV channel of %s refused (%s): %s",
                peer,
                reason.value,
                detail,
            )

    def _first_log(self, kind: str, peer: str, reason: Fallback) -> bool:
        """Whether this is the first line for this peer and reason."""
        seen = (kind, peer, reason.value)
        with self._lock:
            if seen in self._logged or len(self._logged) >= _MAX_LOGGED:
                return False
            self._logged.add(seen)
            return True

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def take_fallback_counts(self) -> list[int]:
        """Fallbacks since the last call, one count per reason in
        :data:`FALLBACK_REASONS` order."""
        with self._lock:
            counts = [self._untaken[r] for r in FALLBACK_REASONS]
            self._untaken = dict.fromkeys(FALLBACK_REASONS, 0)
        return counts


#: This process's counters.
STATS = SameHostStats()


def take_fallback_counts() -> list[int]:
    """This process's fallbacks since the last call, per reason
    (:data:`FALLBACK_REASONS` order; all zero when there were none): what
    NixlConnector's own stats (the log line, ``vllm:nixl_*`` metrics) add up.
    One consumer per process: the connector's worker."""
    return STATS.take_fallback_counts()


def same_host_stats() -> dict[str, int]:
    """This process's counters: ``reads`` (same-host reads done), ``bytes``
    (copied), ``failed`` (reads that failed), ``channels`` (opened),
    ``fallbacks`` (reads or channels that went to NIXL/UCX) and
    ``fallbacks_<reason>`` per :class:`Fallback` reason, ``refused`` (readers
    a producer refused) and ``refused_<reason>``."""
    return STATS.snapshot()


# -- NixlConnector's own stats -------------------------------------------------

#: The key of ``NixlKVConnectorStats.data`` holding fallback counts: one
#: count per reason of :data:`FALLBACK_REASONS`, per recorded interval.
STATS_KEY = "same_host_fallbacks"


def record_fallbacks(data: dict[str, list]) -> None:
    """Add this process's fallbacks since the last call to the data of a
    ``NixlKVConnectorStats`` (nothing when there were none)."""
    counts = take_fallback_counts()
    if any(counts):
        data.setdefault(STATS_KEY, []).extend(counts)


def fallbacks_by_reason(data: dict[str, Any]) -> dict[str, int]:
    """The fallbacks a ``NixlKVConnectorStats`` data holds, per reason (the
    ones that happened)."""
    counts = data.get(STATS_KEY, ())
    n = len(FALLBACK_REASONS)
    totals = {r.value: sum(counts[i::n]) for i, r in enumerate(FALLBACK_REASONS)}
    return {reason: total for reason, total in totals.items() if total}


def reduced_fallbacks(data: dict[str, Any]) -> dict[str, int]:
    """The part of NixlConnector's log line for fallbacks (none without)."""
    total = sum(fallbacks_by_reason(data).values())
    return {"Num same-host fallbacks": total} if total else {}
