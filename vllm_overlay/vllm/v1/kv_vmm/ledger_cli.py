# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read and change the KV memory ledgers of this host.

    python -m vllm.v1.kv_vmm.ledger_cli list [--key KEY] [--json]
    python -m vllm.v1.kv_vmm.ledger_cli set ENGINE --key KEY \\
        [--limit-bytes SIZE|none] [--floor-bytes SIZE]
    python -m vllm.v1.kv_vmm.ledger_cli capacity SIZE --key KEY

ENGINE is an entry's id, pid or name. SIZE is bytes, or with a suffix as
vLLM's options take it (``512M``, ``4G``: binary; ``512m``, ``1.5g``:
decimal). An engine applies a lowered limit at its
next step (free pages first, cached prefix blocks on them evicted).
"""

import argparse
import json
import sys
from collections.abc import Sequence

from vllm.v1.kv_cache_compat import parse_size
from vllm.v1.kv_vmm.ledger import (
    KVMemoryLedger,
    LedgerState,
    find_entry,
    list_ledgers,
)


def parse_bytes(text: str) -> int:
    """A size in bytes as vLLM's own options read it (``512M``: MiB,
    ``512m``: 10^6 bytes), so the CLI and the engine's flags agree."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 30):.2f} GiB"


def format_state(state: LedgerState) -> str:
    lines = [
        f"{state.key}: capacity {_gib(state.capacity_bytes)}, "
        f"held {_gib(state.held_bytes)}, free {_gib(state.free_bytes)}",
        f"  {'id':<12} {'pid':>8} {'mapped':>12} {'floor':>12} {'limit':>12}  name",
    ]
    for e in state.entries:
        lines.append(
            f"  {e.id:<12} {e.pid:>8} {_gib(e.mapped_bytes):>12} "
            f"{_gib(e.floor_bytes):>12} {_gib(e.limit_bytes):>12}  {e.name}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, directory: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.v1.kv_vmm.ledger_cli", description=__doc__
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="every engine of every (or one) ledger")
    p_list.add_argument("--key", help="device UUID, or 'host'")
    p_list.add_argument("--json", action="store_true")
    p_set = sub.add_parser("set", help="an engine's limit and floor, in bytes")
    p_set.add_argument("engine", help="entry id, pid or name")
    p_set.add_argument("--key", required=True)
    p_set.add_argument("--limit-bytes")
    p_set.add_argument("--floor-bytes", type=parse_bytes)
    p_cap = sub.add_parser("capacity", help="the KV memory the engines share")
    p_cap.add_argument("size", type=parse_bytes)
    p_cap.add_argument("--key", required=True)
    args = parser.parse_args(argv)

    if args.command == "list":
        keys = [args.key] if args.key else list_ledgers(directory)
        states = [KVMemoryLedger(k, directory).read() for k in keys]
        found = [s for s in states if s is not None]
        if args.json:
            print(json.dumps([s.to_json() for s in found], indent=1))
        else:
            print("\n".join(format_state(s) for s in found) or "no KV memory ledger")
        return 0

    ledger = KVMemoryLedger(args.key, directory)
    if args.command == "capacity":
        ledger.set_capacity(args.size)
        return 0
    state = ledger.read()
    if state is None:
        print(f"no KV memory ledger for {args.key}", file=sys.stderr)
        return 1
    try:
        entry = find_entry(state, args.engine)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 1
    fields: dict[str, int | None] = {}
    if args.limit_bytes is not None:
        none = args.limit_bytes.lower() == "none"
        fields["limit_bytes"] = None if none else parse_bytes(args.limit_bytes)
    if args.floor_bytes is not None:
        fields["floor_bytes"] = args.floor_bytes
    ledger.update(entry.id, **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
