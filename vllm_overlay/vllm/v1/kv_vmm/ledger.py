# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A per-device ledger of the KV memory that engines sharing a device map.

Several engines with VMM-backed KV memory on one device see each other
through one small JSON file in shared memory, named after the device (its
UUID on CUDA, ``host`` for the host backend), in the engines' directory
(:mod:`vllm.v1.kv_vmm.shm_files`: ``/dev/shm/vllm-kv-u<uid>/``, or
``vllm-kv-g<gid>/`` for engines of several users with
``--kv-cache-vmm-shared-group``). Every engine has one entry: the KV bytes
it maps now, its floor and its limit. Reads and writes hold an exclusive
``flock`` on a lock file next to it; a write replaces the file whole (a new
file renamed over it), so a process that dies mid-write leaves the old
file, never half of one.

Policy (first come, first served, with floors and caps):

* ``capacity`` is the KV memory the engines on the device share. Each GPU
  engine measures it when it starts (:meth:`KVMemoryLedger.measure_capacity`:
  its memory request minus everything on the device that is neither its own
  nor KV memory of the ledger's engines, minus its own non-KV memory), so
  the engine started last, which sees every engine's weights, sets it. An
  explicit size (``--kv-cache-vmm-shared-bytes`` or the CLI) is kept over
  measurements. Where nothing was measured (host backend), the first engine
  sets it to its own KV budget.
* An engine's floor is reserved for it: it may always map up to its floor.
  Beyond the floor it maps only what the ledger shows as free, i.e.
  ``capacity`` minus every other engine's ``max(mapped, floor)`` minus its
  own mapped bytes, and never more than its limit. An idle engine keeps its
  floor mapped: giving it back would free nothing for the others.
* Each entry names its process's liveness token (an ``flock`` the process
  holds while it lives, :func:`~vllm.v1.kv_vmm.shm_files.token_alive`);
  entries of processes that died are dropped by whoever opens the ledger
  next, and the file (with its lock file) is removed when its last entry
  leaves. The pid is kept for people to read, never to decide liveness.
* A file that is not a valid ledger (garbage, a field of the wrong type or
  out of range) raises :class:`LedgerError`, naming the file, the problem
  and the fix: a starting engine refuses to start, a running engine keeps
  serving with what it has mapped (see ``PagedBlockPool``).

Only the standard library is used; the file is small enough (one entry per
engine on the device) to be rewritten on each change.
"""

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from vllm.v1.kv_vmm import shm_files
from vllm.v1.kv_vmm.ledger_format import (
    _ENTRY_ID_LEN,
    LEDGER_FORMAT,
    MAX_LEDGER_BYTES,
    MAX_LEDGER_ENTRIES,
    MAX_LEDGER_FILE_BYTES,
    MAX_NAME_CHARS,
    MAX_SHARE_WEIGHT,
    SHARE_POLICIES,
    LedgerEntry,
    LedgerState,
    _check_bytes,
    check_entry_fields,
    find_entry,
    parse_ledger,
)
from vllm.v1.kv_vmm.shm_files import FileOwner, SharedFileError

__all__ = [
    "KVMemoryLedger",
    "LEDGER_FORMAT",
    "LEDGER_LOCK_TIMEOUT_S",
    "LedgerEntry",
    "LedgerError",
    "LedgerState",
    "MAX_LEDGER_BYTES",
    "MAX_LEDGER_ENTRIES",
    "MAX_LEDGER_FILE_BYTES",
    "MAX_NAME_CHARS",
    "MAX_SHARE_WEIGHT",
    "SERVING_LOCK_TIMEOUT_S",
    "SHARE_POLICIES",
    "STAMP_SETTLE_S",
    "check_entry_fields",
    "find_entry",
    "ledger_path",
    "list_ledgers",
    "parse_ledger",
    "stamp_is_settled",
]

_PREFIX = "vllm-kv-ledger-"
_SUFFIX = ".json"
_LOCK_SUFFIX = ".lock"
#: A lock held longer than this is a fault (a process stopped while it held
#: it), reported as such instead of waiting forever.
LEDGER_LOCK_TIMEOUT_S = 5.0
#: How long a serving engine waits for the lock (``lock_timeout_s``): a lock
#: held longer costs it one ledger read (no growth from the ledger until the
#: next), not seconds of every step.
SERVING_LOCK_TIMEOUT_S = 0.25


class LedgerError(SharedFileError):
    """A ledger that cannot be used: unsafe, unreadable or not valid."""


def _safe_key(key: str) -> str:
    return "".join(
        c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in key
    )


def ledger_path(key: str, directory: str) -> str:
    """The ledger file of device ``key`` (a UUID or ``host``) in the
    engines' ``directory`` (see :func:`shm_files.shared_dir`)."""
    return os.path.join(directory, f"{_PREFIX}{_safe_key(key)}{_SUFFIX}")


def list_ledgers(directory: str) -> list[str]:
    """Keys of the ledgers in the engines' ``directory``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        n[len(_PREFIX) : -len(_SUFFIX)]
        for n in names
        if n.startswith(_PREFIX) and n.endswith(_SUFFIX)
    )


class KVMemoryLedger:
    """The ledger of one device, as one process sees it.

    Args:
        key: the device (its UUID, or ``host`` for the host backend).
        directory: the base directory (default ``VLLM_KV_VMM_LEDGER_DIR``,
            read now, else ``/dev/shm``); the ledger lives in the engines'
            directory in it.
        group: ``--kv-cache-vmm-shared-group`` (a name or a gid): the ledger
            of the engines of that group's users; None: this user's.
        uid: the user whose ledger this is (default: this process's; root
            may manage another user's).

    """

    def __init__(
        self,
        key: str,
        directory: str | None = None,
        group: str | None = None,
        uid: int | None = None,
    ) -> None:
        self.key = key
        self.owner: FileOwner = shm_files.file_owner(group, uid)
        self.base = shm_files.base_dir(directory)
        self.directory = shm_files.dir_path(self.owner, self.base)
        self.path = ledger_path(key, self.directory)
        self.lock_path = self.path[: -len(_SUFFIX)] + _LOCK_SUFFIX
        #: How long to wait for the lock; None: ``LEDGER_LOCK_TIMEOUT_S``.
        self.lock_timeout_s: float | None = None

    def _error(self, problem: str) -> LedgerError:
        return LedgerError(
            f"KV memory ledger {self.path} is not valid: {problem}; remove it "
            f"(rm {self.path}): the engines sharing the device re-create it"
        )

    def _directory(self, create: bool) -> bool:
        """Check the engines' directory (made if missing with ``create``);
        False if it is missing."""
        try:
            shm_files.shared_dir(self.owner, self.base, create=create)
        except FileNotFoundError:
            return False
        except SharedFileError as e:
            raise LedgerError(str(e)) from None
        except OSError as e:
            raise self._os_error(e) from None
        return True

    def _lock(self, create: bool) -> int | None:
        """An fd holding the ledger's lock; None if there is no ledger (and
        not ``create``)."""
        if not self._directory(create):
            return None
        timeout = self.lock_timeout_s
        if timeout is None:
            timeout = LEDGER_LOCK_TIMEOUT_S
        deadline = time.monotonic() + timeout
        while True:
            if not create:
                try:
                    os.lstat(self.path)
                except FileNotFoundError:
                    return None
            try:
                fd = shm_files.open_or_create(self.lock_path, self.owner)
            except SharedFileError as e:
                raise LedgerError(str(e)) from None
            if not self._flock(fd, deadline):
                os.close(fd)
                raise LedgerError(
                    f"KV memory ledger {self.path}: its lock {self.lock_path} "
                    f"was held for more than {timeout:g} s (a "
                    "process stopped while it held it?); stop that process or "
                    f"remove the lock file (rm {self.lock_path})"
                )
            # The last engine may have removed the lock file while this
            # process waited for it: lock the current one then.
            try:
                if os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    @staticmethod
    def _flock(fd: int, deadline: float) -> bool:
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.01)

    def _load(self) -> LedgerState | None:
        try:
            raw = shm_files.read_file(self.path, self.owner, MAX_LEDGER_FILE_BYTES)
        except SharedFileError as e:
            raise LedgerError(str(e)) from None
        if raw is None:
            return None
        try:
            return parse_ledger(raw, self.key)
        except ValueError as e:
            raise self._error(str(e)) from None

    def _alive(self, token: str | None) -> bool:
        if token is None:
            return False
        try:
            return shm_files.token_alive(self.directory, token)
        except PermissionError:
            return True  # cannot tell: keep it

    def _os_error(self, error: OSError) -> LedgerError:
        return LedgerError(
            f"KV memory ledger {self.path}: {error.strerror or error} "
            f"({error.filename or self.directory}); give this user access to "
            f"{self.directory} or remove it (rm -r {self.directory}): the "
            "engines re-create it"
        )

    @contextlib.contextmanager
    def _locked(self, create: bool) -> Iterator[LedgerState | None]:
        try:
            fd = self._lock(create)
        except OSError as e:
            raise self._os_error(e) from None
        if fd is None:
            yield None
            return
        try:
            try:
                state = self._load()
            except OSError as e:
                raise self._os_error(e) from None
            if state is None:
                if not create:
                    yield None
                    return
                state = LedgerState(key=self.key, capacity_bytes=-1, entries=[])
                before = None
            else:
                before = json.dumps(state.to_json(), sort_keys=True)
            state.entries = [e for e in state.entries if self._alive(e.owner)]
            if not self._alive(state.measured_by):
                state.measured_by = None
            yield state
            if (
                not state.entries
                and state.capacity_bytes >= 0
                and state.measured_by is None
            ):
                # The last engine left or died (and no engine is starting):
                # the ledger goes with it, and its lock file (whoever waits
                # for it finds it removed and takes the current one).
                for path in (self.path, self.lock_path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                return
            after = json.dumps(state.to_json(), sort_keys=True)
            if after != before:
                try:
                    shm_files.replace_file(self.path, after.encode(), self.owner)
                except OSError as e:
                    raise self._os_error(e) from None
        finally:
            os.close(fd)

    def file_stamp(self) -> tuple[int, int, int] | None:
        """(inode, size, modification time in ns) of the ledger file, None if
        there is none: one ``stat`` that tells a reader whether anybody wrote
        the ledger since it last read it (see :func:`stamp_is_settled`)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def read(self) -> LedgerState | None:
        """The ledger now (dead engines dropped), None if there is none."""
        with self._locked(create=False) as state:
            result = state
        return result if result is not None and result.entries else None

    def _token(self) -> str:
        self._directory(create=True)
        try:
            return shm_files.process_token(self.directory, self.owner)
        except OSError as e:
            raise self._os_error(e) from None

    def join(
        self,
        capacity_bytes: int,
        name: str,
        mapped_bytes: int = 0,
        floor_bytes: int = 0,
        limit_bytes: int | None = None,
        fixed: bool = False,
        weight: float = 1.0,
        page_bytes: int = 1,
        share_policy: str = "fair",
    ) -> str:
        """Add this engine; return its entry id.

        ``capacity_bytes`` is used if the ledger has no capacity yet (the
        first engine, when no starting engine measured one), or with
        ``fixed`` (an explicit size) unless an explicit size is set already.
        ``weight``, ``page_bytes`` and ``share_policy``: its fair share's
        weight, its page size on the device and its share policy.
        """
        check_entry_fields(
            {
                "floor_bytes": floor_bytes,
                "limit_bytes": limit_bytes,
                "name": name,
                "weight": weight,
                "page_bytes": page_bytes,
                "share_policy": share_policy,
            }
        )
        _check_bytes("capacity_bytes", capacity_bytes, 0)
        _check_bytes("mapped_bytes", mapped_bytes, 0)
        entry = LedgerEntry(
            id=uuid.uuid4().hex[:_ENTRY_ID_LEN],
            pid=os.getpid(),
            owner=self._token(),
            name=name,
            mapped_bytes=mapped_bytes,
            floor_bytes=floor_bytes,
            limit_bytes=limit_bytes,
            weight=weight,
            page_bytes=page_bytes,
            share_policy=share_policy,
        )
        with self._locked(create=True) as state:
            assert state is not None
            if fixed and not state.capacity_fixed:
                state.capacity_bytes = capacity_bytes
                state.capacity_fixed = True
            elif state.capacity_bytes < 0 or (
                not state.entries and state.measured_by is None
            ):
                state.capacity_bytes = capacity_bytes
            state.entries.append(entry)
        return entry.id

    def leave(self, entry_id: str) -> None:
        with self._locked(create=False) as state:
            if state is not None:
                state.entries = [e for e in state.entries if e.id != entry_id]

    def grow(self, entry_id: str, nbytes: int, unit: int, force: bool = False) -> int:
        """Record up to ``nbytes`` more mapped by ``entry_id``, in whole
        ``unit``s, as far as its room allows (all of it with ``force``: the
        memory is mapped already). Returns the bytes recorded."""
        with self._locked(create=False) as state:
            entry = state.entry(entry_id) if state is not None else None
            if entry is None:
                return nbytes if force else 0
            if not force:
                assert state is not None
                nbytes = min(nbytes, state.room(entry_id) // unit * unit)
            entry.mapped_bytes = min(entry.mapped_bytes + nbytes, MAX_LEDGER_BYTES)
            entry.updated = time.time()
            return nbytes

    def shrink(self, entry_id: str, nbytes: int) -> None:
        """Record ``nbytes`` given back by ``entry_id``."""
        with self._locked(create=False) as state:
            entry = state.entry(entry_id) if state is not None else None
            if entry is not None:
                entry.mapped_bytes = max(entry.mapped_bytes - nbytes, 0)
                entry.updated = time.time()

    def set_mapped(self, entry_id: str, nbytes: int) -> bool:
        """Record what ``entry_id`` maps now (after a time the ledger could
        not be read); False if there is no such entry."""
        _check_bytes("mapped_bytes", nbytes, 0)
        with self._locked(create=False) as state:
            entry = state.entry(entry_id) if state is not None else None
            if entry is None:
                return False
            entry.mapped_bytes = nbytes
            entry.updated = time.time()
            return True

    def update(self, entry_id: str, **fields: Any) -> LedgerEntry | None:
        """Set fields of one entry (``floor_bytes``, ``limit_bytes``,
        ``name``, ``weight``, ``share_policy``, and what the engine publishes
        for the fair share: ``used_bytes``, ``waiting_bytes``,
        ``waiting_since``); returns the entry, None if there is no such
        entry."""
        check_entry_fields(fields)
        with self._locked(create=False) as state:
            entry = state.entry(entry_id) if state is not None else None
            if entry is None:
                return None
            for name, value in fields.items():
                setattr(entry, name, value)
            return entry

    def set_capacity(self, capacity_bytes: int) -> None:
        """An explicit capacity (the CLI): kept over later measurements."""
        _check_bytes("capacity_bytes", capacity_bytes, 0)
        with self._locked(create=False) as state:
            if state is None:
                raise FileNotFoundError(f"no KV memory ledger at {self.path}")
            state.capacity_bytes = capacity_bytes
            state.capacity_fixed = True

    def mapped_bytes(self) -> int:
        """KV memory the ledger's engines map now (0 without a ledger)."""
        state = self.read()
        return 0 if state is None else sum(e.mapped_bytes for e in state.entries)

    def measure_capacity(self, capacity_bytes: int) -> int:
        """Record the device's shared KV capacity as a starting engine
        measured it (before its engine joins); returns the capacity in
        force, which an explicit size keeps."""
        capacity_bytes = min(max(capacity_bytes, 0), MAX_LEDGER_BYTES)
        token = self._token()
        with self._locked(create=True) as state:
            assert state is not None
            if not state.capacity_fixed:
                state.capacity_bytes = capacity_bytes
            state.measured_by = token
            result = state.capacity_bytes
        return result


#: A ledger file's stamp tells it apart from a later write only once its
#: modification time is this much older than the clock: file times advance
#: in coarse ticks (a few ms), so two writes in one tick may leave equal
#: stamps when the size did not change either.
STAMP_SETTLE_S = 0.05


def stamp_is_settled(stamp: tuple[int, int, int] | None, now: float) -> bool:
    """Whether a write after ``stamp`` was taken at wall-clock time ``now``
    would change the stamp."""
    return stamp is not None and now - stamp[2] / 1e9 > STAMP_SETTLE_S
