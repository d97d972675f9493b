# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The per-device KV memory ledger: floors, caps, first come first served,
engines that die, and the CLI that reads and changes it."""

import argparse
import json
import multiprocessing
import os
import signal
import time

import pytest

from vllm.v1.kv_vmm.ledger import (
    KVMemoryLedger,
    find_entry,
    ledger_path,
    list_ledgers,
)
from vllm.v1.kv_vmm.ledger_cli import main as cli
from vllm.v1.kv_vmm.ledger_cli import parse_bytes

MiB = 1 << 20


@pytest.fixture
def ledger(tmp_path) -> KVMemoryLedger:
    return KVMemoryLedger("GPU-test", directory=str(tmp_path))


def test_floor_cap_and_free_memory(ledger):
    a = ledger.join(100 * MiB, "a", mapped_bytes=4 * MiB, floor_bytes=10 * MiB)
    # The capacity is the first engine's; a later one does not change it.
    b = ledger.join(999 * MiB, "b", mapped_bytes=2 * MiB, floor_bytes=20 * MiB)
    state = ledger.read()
    assert state.capacity_bytes == 100 * MiB
    assert state.held_bytes == 30 * MiB  # the floors, not the mappings
    assert state.free_bytes == 70 * MiB
    # a may grow by the free memory plus its own unused floor.
    assert state.room(a) == 100 * MiB - 20 * MiB - 4 * MiB
    # Grants are whole units and at most the room.
    assert ledger.grow(a, 200 * MiB, unit=8 * MiB) == 72 * MiB
    assert ledger.read().entry(a).mapped_bytes == 76 * MiB
    # b still gets its floor (and what a left free) ...
    assert ledger.read().room(b) == 22 * MiB
    assert ledger.grow(b, 30 * MiB, unit=2 * MiB) == 22 * MiB
    # ... and nothing beyond, until a gives memory back.
    assert ledger.grow(b, 2 * MiB, unit=2 * MiB) == 0
    ledger.shrink(a, 40 * MiB)
    assert ledger.grow(b, 64 * MiB, unit=2 * MiB) == 40 * MiB
    # A cap bounds the room; force records memory mapped already.
    ledger.update(b, limit_bytes=60 * MiB)
    assert ledger.read().room(b) == 0
    assert ledger.grow(b, 2 * MiB, unit=2 * MiB, force=True) == 2 * MiB
    with pytest.raises(ValueError):
        ledger.update(b, mapped_bytes=0)


def test_last_engine_removes_the_ledger(ledger, tmp_path):
    a = ledger.join(10 * MiB, "a")
    b = ledger.join(10 * MiB, "b")
    assert list_ledgers(str(tmp_path)) == ["GPU-test"]
    ledger.leave(a)
    assert [e.id for e in ledger.read().entries] == [b]
    ledger.leave(b)
    assert not os.path.exists(ledger.path)
    assert ledger.read() is None
    # The next engine creates it again, with its own capacity.
    ledger.join(5 * MiB, "c")
    assert ledger.read().capacity_bytes == 5 * MiB


def _engine(directory: str, joined) -> None:
    ledger = KVMemoryLedger("GPU-test", directory=directory)
    entry = ledger.join(64 * MiB, "child", mapped_bytes=8 * MiB)
    ledger.grow(entry, 16 * MiB, unit=MiB)
    joined.set()
    time.sleep(60)


def test_a_killed_engine_leaves_the_ledger(ledger, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    joined = ctx.Event()
    child = ctx.Process(target=_engine, args=(str(tmp_path), joined))
    child.start()
    try:
        assert joined.wait(60)
        mine = ledger.join(0, "parent")
        state = ledger.read()
        other = find_entry(state, "child")
        assert other.pid == child.pid and other.mapped_bytes == 24 * MiB
        # The child's memory is not free for this engine.
        assert state.room(mine) == 64 * MiB - 24 * MiB
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        state = ledger.read()
        assert [e.name for e in state.entries] == ["parent"]
        assert state.room(mine) == 64 * MiB
    finally:
        child.kill()
        child.join(30)


def test_reused_pid_is_not_the_engine(ledger):
    ledger.join(10 * MiB, "a")
    with open(ledger.path) as f:
        doc = json.load(f)
    doc["entries"][0]["start_time"] += 1  # another process with this pid
    with open(ledger.path, "w") as f:
        json.dump(doc, f)
    # The file went with its last (dead) entry; with a live one it stays.
    assert ledger.read() is None
    ledger.join(10 * MiB, "a")
    live = ledger.join(10 * MiB, "b")
    with open(ledger.path) as f:
        doc = json.load(f)
    doc["entries"][0]["start_time"] += 1
    with open(ledger.path, "w") as f:
        json.dump(doc, f)
    assert [e.id for e in ledger.read().entries] == [live]


def test_cli_lists_and_sets_limits(ledger, tmp_path, capsys):
    directory = str(tmp_path)
    entry = ledger.join(8 << 30, "engine-a", mapped_bytes=1 << 30)
    assert cli(["list"], directory) == 0
    out = capsys.readouterr().out
    assert "GPU-test: capacity 8.00 GiB" in out
    assert entry in out and "engine-a" in out and "1.00 GiB" in out
    assert (
        cli(["set", "engine-a", "--key", "GPU-test", "--limit-bytes", "2G"], directory)
        == 0
    )
    assert (
        cli(
            ["set", str(os.getpid()), "--key", "GPU-test", "--floor-bytes", "512M"],
            directory,
        )
        == 0
    )
    assert cli(["capacity", "6G", "--key", "GPU-test"], directory) == 0
    state = ledger.read()
    assert state.capacity_bytes == 6 << 30
    assert state.entry(entry).limit_bytes == 2 << 30
    assert state.entry(entry).floor_bytes == 512 << 20
    assert cli(["list", "--json"], directory) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc[0]["entries"][0]["limit_bytes"] == 2 << 30
    assert (
        cli(["set", "nobody", "--key", "GPU-test", "--limit-bytes", "1G"], directory)
        == 1
    )
    assert (
        cli(["set", entry, "--key", "GPU-nope", "--limit-bytes", "1G"], directory) == 1
    )
    assert (
        cli(["set", entry, "--key", "GPU-test", "--limit-bytes", "none"], directory)
        == 0
    )
    assert ledger.read().entry(entry).limit_bytes is None


def test_sizes_and_paths():
    # The same reading as vLLM's own size options.
    assert parse_bytes("4096") == 4096
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("512m") == 512 * 10**6
    assert parse_bytes("1.5g") == 1_500_000_000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("1.5G")  # no decimals with binary suffixes, as vLLM
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
    assert ledger_path("GPU-1/2", "/x") == "/x/vllm-kv-ledger-GPU-1_2.json"
