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

The file is the engine's own: created exclusively, owner-only (mode 0600),
in the engines' directory next to the device ledgers
(:mod:`vllm.v1.kv_vmm.shm_files`), and checked when a rank opens it. Its
name carries the liveness token of the engine core's process: files of
processes that died are removed by the next engine that starts (and by
the ledger CLI), files of a process that exits cleanly at its exit.
"""

import contextlib
import fcntl
import mmap
import os
import struct
import uuid
from collections.abc import Iterable

from vllm.v1.kv_vmm import shm_files
from vllm.v1.kv_vmm.shm_files import FileOwner, SharedFileError

_PREFIX = "vllm-kv-pages-"
_SUFFIX = ".bin"
_SLOT = struct.Struct("<HH")  # ranks that mapped the page, ranks that failed


class KVPageStatus:
    """The per-page report of an engine's ranks.

    Args:
        path: the file (see :func:`create_page_status`).

    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = shm_files.open_file(
            path, FileOwner(os.geteuid()), what="KV page report"
        )
        size = os.fstat(self._fd).st_size
        if size == 0 or size % _SLOT.size:
            os.close(self._fd)
            raise SharedFileError(
                f"KV page report {path} is not valid: {size} bytes, not a "
                f"multiple of {_SLOT.size}; remove it (rm {path}) and start "
                "the engine again"
            )
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
            shm_files.disown_file(self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def sweep_page_status(directory: str) -> None:
    """Remove the report files (and liveness lock files) of engine cores
    that died: those whose liveness token's lock can be taken. Names that
    are not of this form are left alone."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
                continue
            token = name[len(_PREFIX) :].split("-", 1)[0]
            if not shm_files.is_token(token):
                continue
            try:
                alive = shm_files.token_alive(directory, token)
            except PermissionError:
                continue
            if not alive:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(os.path.join(directory, name))
    shm_files.sweep_tokens(directory)


def create_page_status(
    num_pages: int,
    tag: str,
    directory: str | None = None,
    group: str | None = None,
) -> KVPageStatus:
    """A new, zeroed report file for an engine of ``num_pages`` pages, in
    the engines' directory under ``directory`` (default
    ``VLLM_KV_VMM_LEDGER_DIR``, else ``/dev/shm``; that of
    ``--kv-cache-vmm-shared-group`` ``group`` if given)."""
    owner = shm_files.file_owner(group)
    path_dir = shm_files.shared_dir(owner, directory)
    sweep_page_status(path_dir)
    token = shm_files.process_token(path_dir, owner)
    safe_tag = "".join(c if c.isascii() and c.isalnum() else "_" for c in tag)
    # Unique within the process too (engines made one after another in it).
    unique = f"{safe_tag}-{uuid.uuid4().hex[:8]}"
    path = os.path.join(path_dir, f"{_PREFIX}{token}-{unique}{_SUFFIX}")
    # The engine's own file (its ranks run as its user), even in a group's
    # directory.
    fd = shm_files.create_file(path, FileOwner(owner.uid))
    try:
        os.ftruncate(fd, num_pages * _SLOT.size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    shm_files.own_file(path)
    return KVPageStatus(path)
