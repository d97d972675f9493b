# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A per-device ledger of the KV memory that engines sharing a device map.

Several engines with VMM-backed KV memory on one device see each other
through one small file in shared memory (``/dev/shm``), created on demand
and named after the device (its UUID on CUDA, ``host`` for the host
backend). Every engine has one entry: the KV bytes it maps now, its floor
and its limit. All reads and writes hold an exclusive ``flock`` on the file.

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
* Entries of engines whose process is gone (pid not alive, or alive with
  another start time: a reused pid) are dropped by whoever opens the ledger
  next; the file is removed when its last entry leaves.

Only the standard library is used; the file is a JSON document, small
enough (one entry per engine on the device) to be rewritten on each change.
"""

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

#: Where ledgers live: shared memory, visible to every process of the host
#: (another directory, e.g. for tests that must not meet other engines:
#: ``VLLM_KV_VMM_LEDGER_DIR``).
LEDGER_DIR = os.environ.get("VLLM_KV_VMM_LEDGER_DIR", "/dev/shm")
_PREFIX = "vllm-kv-ledger-"


def ledger_path(key: str, directory: str | None = None) -> str:
    """The ledger file of device ``key`` (a UUID or ``host``)."""
    safe = "".join(
        c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in key
    )
    return os.path.join(directory or LEDGER_DIR, f"{_PREFIX}{safe}.json")


def list_ledgers(directory: str | None = None) -> list[str]:
    """Keys of the ledgers present on this host."""
    directory = directory or LEDGER_DIR
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        n[len(_PREFIX) : -len(".json")]
        for n in names
        if n.startswith(_PREFIX) and n.endswith(".json")
    )


def process_start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), None if it is gone.

    Together with the pid it names one process: a pid reused by another
    process has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` runs and is the process that started at ``start_time``
    (None: any), so a reused pid does not count."""
    current = process_start_time(pid)
    return current is not None and (start_time is None or current == start_time)


@dataclass
class LedgerEntry:
    """One engine on the device."""

    id: str
    pid: int
    start_time: int | None
    name: str
    mapped_bytes: int = 0
    floor_bytes: int = 0
    limit_bytes: int | None = None
    """None: no cap but the capacity."""
    updated: float = field(default_factory=time.time)

    @property
    def held_bytes(self) -> int:
        """What the entry keeps from the others: its mapping or its floor."""
        return max(self.mapped_bytes, self.floor_bytes)


@dataclass
class LedgerState:
    key: str
    capacity_bytes: int
    entries: list[LedgerEntry]
    capacity_fixed: bool = False
    """The capacity was given explicitly (option or CLI): measurements of
    starting engines do not change it."""
    measured_by: list[Any] | None = None
    """``[pid, start time]`` of the process that measured the capacity last:
    the ledger stays while that process lives, before its engine joins."""

    @property
    def held_bytes(self) -> int:
        return sum(e.held_bytes for e in self.entries)

    @property
    def free_bytes(self) -> int:
        """Memory no engine maps or keeps as its floor."""
        return max(self.capacity_bytes - self.held_bytes, 0)

    def entry(self, entry_id: str) -> LedgerEntry | None:
        return next((e for e in self.entries if e.id == entry_id), None)

    def room(self, entry_id: str) -> int:
        """Bytes the engine ``entry_id`` may map on top of what it maps."""
        me = self.entry(entry_id)
        if me is None:
            return 0
        others = sum(e.held_bytes for e in self.entries if e.id != entry_id)
        room = self.capacity_bytes - others - me.mapped_bytes
        room = max(room, me.floor_bytes - me.mapped_bytes, 0)
        if me.limit_bytes is not None:
            room = min(room, max(me.limit_bytes - me.mapped_bytes, 0))
        return room

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "capacity_bytes": self.capacity_bytes,
            "capacity_fixed": self.capacity_fixed,
            "measured_by": self.measured_by,
            "entries": [asdict(e) for e in self.entries],
        }


class KVMemoryLedger:
    """The ledger of one device, as one process sees it.

    Args:
        key: the device (its UUID, or ``host`` for the host backend).
        directory: where the file lives (default :data:`LEDGER_DIR`).

    """

    def __init__(self, key: str, directory: str | None = None) -> None:
        self.key = key
        self.path = ledger_path(key, directory)

    @contextlib.contextmanager
    def _locked(self, create: bool) -> Iterator[LedgerState | None]:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        while True:
            try:
                fd = os.open(self.path, flags, 0o666)
            except FileNotFoundError:
                yield None
                return
            fcntl.flock(fd, fcntl.LOCK_EX)
            # The last engine may have removed the file while this process
            # waited for the lock: open the current one then.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            raw = b""
            while chunk := os.read(fd, 1 << 16):
                raw += chunk
            if raw:
                doc = json.loads(raw)
                state = LedgerState(
                    key=doc["key"],
                    capacity_bytes=doc["capacity_bytes"],
                    entries=[LedgerEntry(**e) for e in doc["entries"]],
                    capacity_fixed=doc.get("capacity_fixed", False),
                    measured_by=doc.get("measured_by"),
                )
            elif create:
                state = LedgerState(key=self.key, capacity_bytes=-1, entries=[])
            else:
                yield None
                return
            before = json.dumps(state.to_json(), sort_keys=True)
            state.entries = [
                e for e in state.entries if process_alive(e.pid, e.start_time)
            ]
            if state.measured_by is not None and not process_alive(*state.measured_by):
                state.measured_by = None
            yield state
            if (
                not state.entries
                and state.capacity_bytes >= 0
                and state.measured_by is None
            ):
                # The last engine left or died (and no engine is starting):
                # the ledger goes with it.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                return
            after = json.dumps(state.to_json(), sort_keys=True)
            if after != before:
                data = after.encode()
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, data)
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

    def join(
        self,
        capacity_bytes: int,
        name: str,
        mapped_bytes: int = 0,
        floor_bytes: int = 0,
        limit_bytes: int | None = None,
        fixed: bool = False,
    ) -> str:
        """Add this engine; return its entry id.

        ``capacity_bytes`` is used if the ledger has no capacity yet (the
        first engine, when no starting engine measured one), or with
        ``fixed`` (an explicit size) unless an explicit size is set already.
        """
        pid = os.getpid()
        entry = LedgerEntry(
            id=uuid.uuid4().hex[:12],
            pid=pid,
            start_time=process_start_time(pid),
            name=name,
            mapped_bytes=mapped_bytes,
            floor_bytes=floor_bytes,
            limit_bytes=limit_bytes,
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
            entry.mapped_bytes += nbytes
            entry.updated = time.time()
            return nbytes

    def shrink(self, entry_id: str, nbytes: int) -> None:
        """Record ``nbytes`` given back by ``entry_id``."""
        with self._locked(create=False) as state:
            entry = state.entry(entry_id) if state is not None else None
            if entry is not None:
                entry.mapped_bytes = max(entry.mapped_bytes - nbytes, 0)
                entry.updated = time.time()

    def update(self, entry_id: str, **fields: Any) -> LedgerEntry | None:
        """Set fields of one entry (``floor_bytes``, ``limit_bytes``,
        ``name``); returns the entry, None if there is no such entry."""
        with self._locked(create=False) as state:
            entry = state.entry(entry_id) if state is not None else None
            if entry is None:
                return None
            for name, value in fields.items():
                if name not in ("floor_bytes", "limit_bytes", "name"):
                    raise ValueError(f"cannot set {name!r} of a ledger entry")
                setattr(entry, name, value)
            return entry

    def set_capacity(self, capacity_bytes: int) -> None:
        """An explicit capacity (the CLI): kept over later measurements."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity must not be negative: {capacity_bytes}")
        with self._locked(create=False) as state:
            if state is None:
                raise FileNotFoundError(f"no KV memory ledger for {self.key}")
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
        pid = os.getpid()
        with self._locked(create=True) as state:
            assert state is not None
            if not state.capacity_fixed:
                state.capacity_bytes = max(capacity_bytes, 0)
            state.measured_by = [pid, process_start_time(pid)]
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


def find_entry(state: LedgerState, ident: str) -> LedgerEntry:
    """An entry by id, pid or name (the CLI's way of naming an engine)."""
    found = [e for e in state.entries if ident in (e.id, str(e.pid), e.name)]
    if len(found) != 1:
        raise KeyError(
            f"{'no' if not found else 'more than one'} engine named {ident!r} "
            f"on {state.key} (give the id: "
            f"{', '.join(e.id for e in state.entries) or 'none'})"
        )
    return found[0]
