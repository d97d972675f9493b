# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which pages every rank of an engine really mapped.

A page the scheduler asks to map is handed out only once every rank
reports it mapped: each rank, after trying, adds itself to the
page's ``mapped`` or ``failed`` count in one small shared-memory file of the
engine (created by the engine core, opened by every rank on the same host);
the scheduler reads the counts when it allocates. A page some rank could
not map is unmapped again on every rank, so the ranks never disagree on a
page the scheduler hands out. No socket and no thread: writes hold an
``flock``, reads are plain loads of two counters.
"""

import contextlib
import fcntl
import mmap
import os
import struct
from collections.abc import Iterable

from vllm.v1.kv_vmm import ledger
from vllm.v1.kv_vmm.ledger import process_alive, process_start_time

_PREFIX = "vllm-kv-pages-"
_SLOT = struct.Struct("<HH")  # ranks that mapped the page, ranks that failed


class KVPageStatus:
    """The per-page report of an engine's ranks.

    Args:
        path: the file (see :func:`create_page_status`).

    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR)
        size = os.fstat(self._fd).st_size
        self.num_pages = size // _SLOT.size
        self._map = mmap.mmap(self._fd, size)

    def counts(self, page: int) -> tuple[int, int]:
        """(ranks that mapped ``page``, ranks that failed to)."""
        return _SLOT.unpack_from(self._map, page * _SLOT.size)

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reset(self, pages: Iterable[int]) -> None:
        """Before the scheduler asks for ``pages``: nobody reported yet."""
        with self._locked():
            for page in pages:
                _SLOT.pack_into(self._map, page * _SLOT.size, 0, 0)

    def report(self, mapped: Iterable[int], failed: Iterable[int]) -> None:
        """A rank's outcome for the pages it was asked to map."""
        with self._locked():
            for pages, index in ((mapped, 0), (failed, 1)):
                for page in pages:
                    counts = list(_SLOT.unpack_from(self._map, page * _SLOT.size))
                    counts[index] += 1
                    _SLOT.pack_into(self._map, page * _SLOT.size, *counts)

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        os.close(self._fd)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _sweep(directory: str) -> None:
    # Files of engine cores that died (pid gone or reused).
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if not name.startswith(_PREFIX):
                continue
            try:
                pid, start = (int(x) for x in name[len(_PREFIX) :].split("-")[:2])
            except ValueError:
                continue
            if not process_alive(pid, start):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))


def create_page_status(
    num_pages: int, tag: str, directory: str | None = None
) -> KVPageStatus:
    """A new, zeroed report file for an engine of ``num_pages`` pages."""
    directory = directory or ledger.LEDGER_DIR
    _sweep(directory)
    pid = os.getpid()
    path = os.path.join(
        directory, f"{_PREFIX}{pid}-{process_start_time(pid)}-{tag}.bin"
    )
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, num_pages * _SLOT.size)
    finally:
        os.close(fd)
    return KVPageStatus(path)
