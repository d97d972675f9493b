# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read and change the KV memory ledgers of this host.

    python -m vllm.v1.kv_vmm.ledger_cli list [--key KEY] [--json]
    python -m vllm.v1.kv_vmm.ledger_cli set ENGINE --key KEY \\
        [--limit-bytes SIZE|none] [--floor-bytes SIZE] [--weight W] \\
        [--share-policy fair|first-come] [--group G | --user U]
    python -m vllm.v1.kv_vmm.ledger_cli capacity SIZE --key KEY \\
        [--group G | --user U]

ENGINE is an entry's id, pid or name. SIZE is read as vLLM's own size
options read it (``human_readable_int``: ``4096``, ``512M``/``4G``: binary,
``512m``/``1.5g``: decimal). ``--group``: the ledger of engines started
with ``--kv-cache-vmm-shared-group G``; ``--user``: another user's ledger
(root); default: this user's. An engine applies a lowered limit at its
next step (free pages first, cached prefix blocks on them evicted).
``--weight``: the engine's fair-share weight (a positive number; shares
are proportional to it), applied at the engines' next ledger read.
``--share-policy``: the engine's ``--kv-cache-vmm-share-policy``, applied
at its next ledger read (an idle engine's: at its next step): ``fair``
yields its pages beyond its share to engines below theirs that wait,
``first-come`` keeps what it maps.

``list`` shows per engine what it maps, its floor and limit, its demand
(pages with a block in use plus what its waiting requests need), how long
its requests have waited for KV memory, its weight and its fair share of
the capacity now (``vllm.v1.kv_vmm.shares.fair_shares`` of the
entries) and its share policy (an engine of ``first-come`` is shown with
a share too, but does not act on it).

Exit status: 0 done, 1 no such ledger or engine, 2 a bad argument or a
ledger that is unsafe or not valid (one line on stderr says which and
the fix).
"""

import argparse
import contextlib
import json
import math
import os
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_cache_compat import parse_size
from vllm.v1.kv_vmm import shm_files
from vllm.v1.kv_vmm.ledger import (
    MAX_LEDGER_BYTES,
    MAX_SHARE_WEIGHT,
    SHARE_POLICIES,
    KVMemoryLedger,
    LedgerState,
    find_entry,
    list_ledgers,
)
from vllm.v1.kv_vmm.page_status import sweep_page_status
from vllm.v1.kv_vmm.shm_files import FileOwner, SharedFileError

PROG = "python -m vllm.v1.kv_vmm.ledger_cli"


class UsageError(ValueError):
    """A bad argument: one line, exit status 2."""


def parse_bytes(text: str, what: str = "size", minimum: int = 0) -> int:
    """A size in bytes as vLLM's own size options read it (their parser,
    ``human_readable_int``: ``512M`` is MiB, ``512m`` 10^6 bytes), at
    least ``minimum``."""
    try:
        value = parse_size(text)
    except (ValueError, argparse.ArgumentTypeError) as e:
        detail = str(e) if isinstance(e, argparse.ArgumentTypeError) else ""
        raise UsageError(
            f"{what} {text!r} is not a size in bytes (e.g. 4096, 512M, 4G, "
            f"1.5g){': ' + detail if detail else ''}"
        ) from None
    if value < minimum:
        raise UsageError(
            f"{what} {text!r} is {'negative' if value < 0 else 'zero'}: give "
            f"at least {minimum} byte{'s' if minimum != 1 else ''}"
        )
    if value > MAX_LEDGER_BYTES:
        raise UsageError(f"{what} {text!r} is larger than {MAX_LEDGER_BYTES} bytes")
    return value


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 30):.2f} GiB"


def parse_weight(text: str) -> float:
    """A fair-share weight: a positive number, at most the ledger's
    largest."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_SHARE_WEIGHT):
        raise UsageError(
            f"--weight {text!r} is not a positive number (at most "
            f"{MAX_SHARE_WEIGHT:g}); e.g. 2 gives an engine twice the share of "
            "an engine of weight 1"
        )
    return value


def _waited(since: float | None, now: float) -> str:
    return "-" if since is None else f"{max(now - since, 0.0):.1f} s"


def format_state(state: LedgerState, ledger: KVMemoryLedger | None = None) -> str:
    where = ""
    if ledger is not None:
        where = f" ({ledger.owner.describe()}: {ledger.path})"
    shares = state.shares()
    now = time.monotonic()
    lines = [
        f"{state.key}: capacity {_gib(state.capacity_bytes)}, "
        f"held {_gib(state.held_bytes)}, free {_gib(state.free_bytes)}{where}",
        f"  {'id':<12} {'pid':>8} {'mapped':>12} {'floor':>12} {'limit':>12} "
        f"{'demand':>12} {'waited':>8} {'weight':>7} {'share':>12} "
        f"{'policy':<10}  name",
    ]
    for e in state.entries:
        demand = e.demand().demand_bytes
        lines.append(
            f"  {e.id:<12} {e.pid:>8} {_gib(e.mapped_bytes):>12} "
            f"{_gib(e.floor_bytes):>12} {_gib(e.limit_bytes):>12} "
            f"{_gib(demand):>12} {_waited(e.waiting_since, now):>8} "
            f"{e.weight:>7g} {_gib(shares[e.id]):>12} {e.share_policy:<10}  "
            f"{e.name}"
        )
    return "\n".join(lines)


def _owner_dirs(base: str) -> list[tuple[FileOwner, str]]:
    """The engines' directories under ``base`` (of any user or group)."""
    found = []
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.startswith("vllm-kv-") or name[8:9] not in ("u", "g"):
            continue
        number = name[9:]
        if not number.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        if name[8] == "u":
            owner = FileOwner(int(number))
        else:
            owner = FileOwner(st.st_uid, int(number))
        found.append((owner, path))
    return found


def _ledger(args: argparse.Namespace, directory: str | None) -> KVMemoryLedger:
    uid = None
    if args.user is not None:
        try:
            import pwd

            uid = (
                int(args.user)
                if args.user.isdigit()
                else pwd.getpwnam(args.user).pw_uid
            )
        except KeyError:
            raise UsageError(f"--user {args.user!r}: no such user") from None
    try:
        return KVMemoryLedger(args.key, directory, group=args.group, uid=uid)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _list(args: argparse.Namespace, directory: str | None) -> int:
    base = shm_files.base_dir(directory)
    docs: list[dict[str, Any]] = []
    texts: list[str] = []
    errors: list[str] = []
    for owner, path in _owner_dirs(base):
        try:
            shm_files.check_dir(path, owner)
            keys = [args.key] if args.key else list_ledgers(path)
        except (SharedFileError, PermissionError) as e:
            if owner.uid == os.geteuid() or os.geteuid() == 0:
                errors.append(str(e))
            continue  # another user's directory: not ours to read
        for key in keys:
            ledger = KVMemoryLedger(key, directory, uid=owner.uid)
            if owner.gid is not None:
                ledger = KVMemoryLedger(key, directory, group=str(owner.gid))
            try:
                state = ledger.read()
            except (SharedFileError, PermissionError) as e:
                errors.append(str(e))
                continue
            if state is None:
                continue
            owner_doc = {"path": ledger.path, "owner": ledger.owner.describe()}
            docs.append({**state.report(), **owner_doc})
            texts.append(format_state(state, ledger))
        # Reports of engines that died go too (sweep by liveness lock).
        with contextlib.suppress(OSError):
            sweep_page_status(path)
    if args.json:
        print(json.dumps(docs, indent=1))
    else:
        print("\n".join(texts) or "no KV memory ledger")
    for error in errors:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    return 2 if errors else 0


def _run(args: argparse.Namespace, directory: str | None) -> int:
    if args.command == "list":
        return _list(args, directory)
    ledger = _ledger(args, directory)
    if args.command == "capacity":
        size = parse_bytes(args.size, "capacity")
        try:
            ledger.set_capacity(size)
        except FileNotFoundError:
            print(
                f"no KV memory ledger for {args.key} ({ledger.path})", file=sys.stderr
            )
            return 1
        return 0
    fields: dict[str, float | str | None] = {}
    if args.limit_bytes is not None:
        none = args.limit_bytes.strip().lower() == "none"
        fields["limit_bytes"] = (
            None if none else parse_bytes(args.limit_bytes, "--limit-bytes", 1)
        )
    if args.floor_bytes is not None:
        fields["floor_bytes"] = parse_bytes(args.floor_bytes, "--floor-bytes")
    if args.weight is not None:
        fields["weight"] = parse_weight(args.weight)
    if args.share_policy is not None:
        fields["share_policy"] = args.share_policy
    if not fields:
        raise UsageError(
            "set: give --limit-bytes, --floor-bytes, --weight or --share-policy"
        )
    state = ledger.read()
    if state is None:
        print(f"no KV memory ledger for {args.key} ({ledger.path})", file=sys.stderr)
        return 1
    try:
        entry = find_entry(state, args.engine)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 1
    if ledger.update(entry.id, **fields) is None:
        print(f"engine {entry.id} left {ledger.path} meanwhile", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None, directory: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="every engine of every (or one) ledger")
    p_list.add_argument("--key", help="device UUID, or 'host'")
    p_list.add_argument("--json", action="store_true")
    p_set = sub.add_parser(
        "set",
        help="an engine's limit and floor, in bytes, its weight and share policy",
    )
    p_set.add_argument("engine", help="entry id, pid or name")
    p_set.add_argument("--limit-bytes", help="SIZE (at least 1), or none")
    p_set.add_argument("--floor-bytes", help="SIZE (0 or more)")
    p_set.add_argument("--weight", help="fair-share weight (a positive number)")
    p_set.add_argument(
        "--share-policy",
        choices=SHARE_POLICIES,
        help="fair: give pages beyond the share to waiting engines; "
        "first-come: keep what it maps",
    )
    p_cap = sub.add_parser("capacity", help="the KV memory the engines share")
    p_cap.add_argument("size", help="SIZE (0 or more)")
    for p in (p_set, p_cap):
        p.add_argument("--key", required=True, help="device UUID, or 'host'")
        who = p.add_mutually_exclusive_group()
        who.add_argument(
            "--group", help="the ledger of --kv-cache-vmm-shared-group GROUP"
        )
        who.add_argument("--user", help="another user's ledger (root)")
    args = parser.parse_args(argv)
    try:
        return _run(args, directory)
    except (UsageError, SharedFileError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
