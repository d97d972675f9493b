# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The device ledger's file: its entries, its state and their validation.

What :mod:`vllm.v1.kv_vmm.ledger` reads and writes under its lock. A file
that is not a valid ledger raises ``ValueError`` naming the first field
that is not valid; the ledger turns it into a ``LedgerError``.
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

from vllm.v1.kv_vmm.page_policy import KVSharePolicy
from vllm.v1.kv_vmm.shares import EngineDemand, fair_shares

#: The ledger's format; another number is refused (an engine of another
#: version of this code on the same device). Fields a later version adds
#: that an older engine may ignore keep the number: an engine keeps the
#: fields it does not know as they are (``extra``) and writes them back, so
#: engines of several versions share a device during a rolling upgrade. A
#: change an older engine must not ignore takes a new number.
LEDGER_FORMAT = 1
#: Limits of a valid ledger: larger sizes, files or engine counts are
#: garbage, not a device.
MAX_LEDGER_BYTES = 1 << 60
MAX_LEDGER_FILE_BYTES = 1 << 20
MAX_LEDGER_ENTRIES = 1024
MAX_NAME_CHARS = 256
#: Largest share weight (``--kv-cache-vmm-share-weight``) a ledger holds.
MAX_SHARE_WEIGHT = 1e6
#: Most fields of a later version an entry or the ledger may carry.
MAX_EXTRA_FIELDS = 32
#: What an entry's ``share_policy`` may be (``--kv-cache-vmm-share-policy``).
SHARE_POLICIES: tuple[str, ...] = get_args(KVSharePolicy)


@dataclass
class LedgerEntry:
    """One engine on the device."""

    id: str
    pid: int
    """For people to read: the engine core's pid in its own PID namespace."""
    owner: str
    """Liveness token of the engine's process (the entry lives while it)."""
    name: str
    mapped_bytes: int = 0
    floor_bytes: int = 0
    limit_bytes: int | None = None
    """None: no cap but the capacity."""
    updated: float = field(default_factory=time.time)
    # What the fair share (vllm.v1.kv_vmm.shares) reads; an entry
    # without these fields (an engine of an older version) reads as below.
    used_bytes: int | None = None
    """Pages with a block in use, in bytes; None: ``mapped_bytes``."""
    waiting_bytes: int = 0
    """What its waiting requests need beyond its free blocks, in bytes."""
    waiting_since: float | None = None
    """Since when its waiting requests have needed more than its free
    blocks, on the host's monotonic clock; None: they do not."""
    weight: float = 1.0
    """``--kv-cache-vmm-share-weight`` (the ledger CLI may change it)."""
    share_policy: str = "fair"
    """``--kv-cache-vmm-share-policy`` (the ledger CLI may change it): an
    engine of ``first-come`` publishes its demand but keeps what it maps
    while others wait; one of ``fair`` yields its pages beyond its share."""
    page_bytes: int = 1
    """Bytes one of its pages takes on the device."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields of a later version of the ledger, kept as they are."""

    def demand(self) -> EngineDemand:
        """The entry as the fair share sees it."""
        return EngineDemand(
            id=self.id,
            mapped_bytes=self.mapped_bytes,
            floor_bytes=self.floor_bytes,
            limit_bytes=self.limit_bytes,
            used_bytes=self.mapped_bytes
            if self.used_bytes is None
            else self.used_bytes,
            waiting_bytes=self.waiting_bytes,
            waiting_since=self.waiting_since,
            weight=self.weight,
            page_bytes=self.page_bytes,
        )

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
    measured_by: str | None = None
    """Liveness token of the process that measured the capacity last: the
    ledger stays while that process lives, before its engine joins."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields of a later version of the ledger, kept as they are."""

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
            **self.extra,
            "format": LEDGER_FORMAT,
            "key": self.key,
            "capacity_bytes": self.capacity_bytes,
            "capacity_fixed": self.capacity_fixed,
            "measured_by": self.measured_by,
            "entries": [_entry_json(e) for e in self.entries],
        }

    def shares(self) -> dict[str, int]:
        """Each engine's fair share of the capacity now, in bytes."""
        return fair_shares(
            max(self.capacity_bytes, 0), [e.demand() for e in self.entries]
        )

    def report(self) -> dict[str, Any]:
        """:meth:`to_json` with each engine's fair share (``share_bytes``):
        what the ledger CLI prints and the engines' metrics show."""
        doc = self.to_json()
        shares = self.shares()
        for entry in doc["entries"]:
            entry["share_bytes"] = shares[entry["id"]]
        return doc


def _entry_json(entry: LedgerEntry) -> dict[str, Any]:
    doc = asdict(entry)
    return {**doc.pop("extra"), **doc}


# -- validation ---------------------------------------------------------------


class _Invalid(ValueError):
    pass


def _check_type(where: str, value: Any, kinds: tuple[type, ...]) -> None:
    # bool is an int to Python, not to the ledger.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise _Invalid(f"{where} is {json.dumps(value)[:40]}, not {names}")


def _check_bytes(where: str, value: Any, low: int) -> None:
    _check_type(where, value, (int,))
    if not low <= value <= MAX_LEDGER_BYTES:
        raise _Invalid(f"{where} is {value}, not in [{low}, {MAX_LEDGER_BYTES}]")


def _check_keys(
    where: str, doc: Any, keys: set[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Check that ``doc`` has ``keys`` (but ``optional``); returns the fields
    it has beyond them (a later version's, see ``LEDGER_FORMAT``)."""
    _check_type(where, doc, (dict,))
    missing, unknown = keys - optional - doc.keys(), doc.keys() - keys
    if missing:
        raise _Invalid(f"{where} has no {', '.join(sorted(missing))}")
    if len(unknown) > MAX_EXTRA_FIELDS:
        raise _Invalid(
            f"{where} has {len(unknown)} unknown fields (at most "
            f"{MAX_EXTRA_FIELDS}: {', '.join(sorted(unknown)[:5])}, ...)"
        )
    return {k: doc[k] for k in unknown}


def _check_id(where: str, value: Any, length: int) -> None:
    _check_type(where, value, (str,))
    if len(value) != length or not all(c in "0123456789abcdef" for c in value):
        raise _Invalid(f"{where} is {value[:40]!r}, not {length} hex digits")


_ENTRY_ID_LEN = 12
_ENTRY_FIELDS = {f for f in LedgerEntry.__dataclass_fields__} - {"extra"}
#: Fields an entry of an older version has not.
_SHARE_FIELDS = frozenset(
    (
        "used_bytes",
        "waiting_bytes",
        "waiting_since",
        "weight",
        "share_policy",
        "page_bytes",
    )
)
_STATE_FIELDS = {
    "format",
    "key",
    "capacity_bytes",
    "capacity_fixed",
    "measured_by",
    "entries",
}


def _parse_entry(i: int, doc: Any) -> LedgerEntry:
    where = f"entries[{i}]"
    extra = _check_keys(where, doc, _ENTRY_FIELDS, _SHARE_FIELDS)
    _check_id(f"{where}.id", doc["id"], _ENTRY_ID_LEN)
    _check_type(f"{where}.pid", doc["pid"], (int,))
    if not 0 <= doc["pid"] < 1 << 32:
        raise _Invalid(f"{where}.pid is {doc['pid']}, not a pid")
    _check_id(f"{where}.owner", doc["owner"], 32)
    _check_type(f"{where}.name", doc["name"], (str,))
    if len(doc["name"]) > MAX_NAME_CHARS:
        raise _Invalid(f"{where}.name is longer than {MAX_NAME_CHARS} characters")
    _check_bytes(f"{where}.mapped_bytes", doc["mapped_bytes"], 0)
    _check_bytes(f"{where}.floor_bytes", doc["floor_bytes"], 0)
    if doc["limit_bytes"] is not None:
        _check_bytes(f"{where}.limit_bytes", doc["limit_bytes"], 1)
    _check_time(f"{where}.updated", doc["updated"])
    _check_share_fields(where, doc)
    known = {k: v for k, v in doc.items() if k not in extra}
    return LedgerEntry(**known, extra=extra)


def _check_time(where: str, value: Any) -> None:
    _check_type(where, value, (int, float))
    if not math.isfinite(value) or value < 0:
        raise _Invalid(f"{where} is {value}, not a time")


def _check_weight(where: str, value: Any) -> None:
    _check_type(where, value, (int, float))
    if not (math.isfinite(value) and 0 < value <= MAX_SHARE_WEIGHT):
        raise _Invalid(f"{where} is {value}, not a number in (0, {MAX_SHARE_WEIGHT:g}]")


def _check_share_fields(where: str, doc: dict[str, Any]) -> None:
    """The fair share's fields of an entry, those it has."""
    if doc.get("used_bytes") is not None:
        _check_bytes(f"{where}.used_bytes", doc["used_bytes"], 0)
    if "waiting_bytes" in doc:
        _check_bytes(f"{where}.waiting_bytes", doc["waiting_bytes"], 0)
    if doc.get("waiting_since") is not None:
        _check_time(f"{where}.waiting_since", doc["waiting_since"])
    if "weight" in doc:
        _check_weight(f"{where}.weight", doc["weight"])
    if "share_policy" in doc:
        _check_type(f"{where}.share_policy", doc["share_policy"], (str,))
        if doc["share_policy"] not in SHARE_POLICIES:
            raise _Invalid(
                f"{where}.share_policy is {doc['share_policy'][:40]!r}, not one "
                f"of {', '.join(SHARE_POLICIES)}"
            )
    if "page_bytes" in doc:
        _check_bytes(f"{where}.page_bytes", doc["page_bytes"], 1)


def parse_ledger(raw: bytes, key: str) -> LedgerState:
    """A ledger file's content as a :class:`LedgerState`; raises ValueError
    naming the first field that is not valid."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Invalid(f"not JSON ({e})") from None
    except RecursionError:
        raise _Invalid("not JSON (nested too deep)") from None
    extra = _check_keys("the ledger", doc, _STATE_FIELDS)
    if doc["format"] != LEDGER_FORMAT or isinstance(doc["format"], bool):
        raise _Invalid(
            f"format is {json.dumps(doc['format'])[:40]}, not {LEDGER_FORMAT} "
            "(written by another version of vLLM's KV memory ledger)"
        )
    if doc["key"] != key:
        raise _Invalid(f"key is {json.dumps(doc['key'])[:40]}, not {key!r}")
    _check_bytes("capacity_bytes", doc["capacity_bytes"], -1)
    _check_type("capacity_fixed", doc["capacity_fixed"], (bool,))
    if doc["measured_by"] is not None:
        _check_id("measured_by", doc["measured_by"], 32)
    _check_type("entries", doc["entries"], (list,))
    if len(doc["entries"]) > MAX_LEDGER_ENTRIES:
        raise _Invalid(f"entries has more than {MAX_LEDGER_ENTRIES} engines")
    entries = [_parse_entry(i, e) for i, e in enumerate(doc["entries"])]
    if len({e.id for e in entries}) != len(entries):
        raise _Invalid("entries has two engines with one id")
    return LedgerState(
        key=key,
        capacity_bytes=doc["capacity_bytes"],
        entries=entries,
        capacity_fixed=doc["capacity_fixed"],
        measured_by=doc["measured_by"],
        extra=extra,
    )


def check_entry_fields(fields: dict[str, Any]) -> None:
    """Refuse values of ``floor_bytes``, ``limit_bytes``, ``name`` or the
    fair share's fields that the ledger would not read back (ValueError
    naming the field)."""
    share = {k: v for k, v in fields.items() if k in _SHARE_FIELDS}
    if share:
        _check_share_fields("the entry", share)
    for name, value in fields.items():
        if name in _SHARE_FIELDS:
            continue
        if name == "floor_bytes":
            _check_bytes(name, value, 0)
        elif name == "limit_bytes":
            if value is not None:
                _check_bytes(name, value, 1)
        elif name == "name":
            _check_type(name, value, (str,))
            if len(value) > MAX_NAME_CHARS:
                raise _Invalid(f"name is longer than {MAX_NAME_CHARS} characters")
        else:
            raise ValueError(f"cannot set {name!r} of a ledger entry")


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
