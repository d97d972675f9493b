# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The device ledger's CLI (``python -m vllm.v1.kv_vmm.ledger_cli``): it
lists and changes the ledgers, refuses bad sizes and garbage in one line,
reads sizes as the engine's flags do, and sweeps what dead engines left."""

import json
import os
from pathlib import Path

import pytest

from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
)
from tests.v1.kv_vmm.user_utils import ForkedUser, ends_within
from vllm.v1.kv_vmm.ledger import KVMemoryLedger
from vllm.v1.kv_vmm.ledger_cli import UsageError, parse_bytes
from vllm.v1.kv_vmm.ledger_cli import main as cli
from vllm.v1.kv_vmm.page_status import create_page_status

MiB = 1 << 20
KEY = "GPU-test"


@pytest.fixture
def ledger(ledger_base) -> KVMemoryLedger:
    return KVMemoryLedger(KEY)


def test_cli_lists_and_sets_limits(ledger, capsys):
    entry = ledger.join(8 << 30, "engine-a", mapped_bytes=1 << 30)
    assert cli(["list"]) == 0
    out = capsys.readouterr().out
    assert "GPU-test: capacity 8.00 GiB" in out
    assert entry in out and "engine-a" in out and "1.00 GiB" in out
    # Whose ledger it is, and where.
    assert f"({ledger.owner.describe()}: {ledger.path})" in out
    assert cli(["set", "engine-a", "--key", KEY, "--limit-bytes", "2G"]) == 0
    assert cli(["set", str(os.getpid()), "--key", KEY, "--floor-bytes", "512M"]) == 0
    assert cli(["capacity", "6G", "--key", KEY]) == 0
    state = ledger.read()
    assert state.capacity_bytes == 6 << 30
    assert state.entry(entry).limit_bytes == 2 << 30
    assert state.entry(entry).floor_bytes == 512 << 20
    assert cli(["list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc[0]["entries"][0]["limit_bytes"] == 2 << 30
    assert doc[0]["path"] == ledger.path and doc[0]["owner"].startswith("user ")
    assert cli(["set", "nobody", "--key", KEY, "--limit-bytes", "1G"]) == 1
    assert cli(["set", entry, "--key", "GPU-nope", "--limit-bytes", "1G"]) == 1
    assert cli(["set", entry, "--key", KEY, "--limit-bytes", "none"]) == 0
    assert ledger.read().entry(entry).limit_bytes is None


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["capacity", "-5"], "capacity '-5' is negative"),
        (["set", "engine-a", "--floor-bytes", "-1"], "--floor-bytes '-1' is negative"),
        (["set", "engine-a", "--limit-bytes", "0"], "--limit-bytes '0' is zero"),
        (["set", "engine-a", "--limit-bytes", "lots"], "is not a size in bytes"),
        (["capacity", "1GiB"], "capacity '1GiB' is not a size in bytes"),
        (["capacity", "1.5G"], "Decimals are not allowed"),
        (["capacity", str(1 << 61)], "larger than"),
        (["set", "engine-a"], "--floor-bytes, --weight or --share-policy"),
    ],
)
def test_cli_refuses_bad_sizes_in_one_line(ledger, capsys, argv, problem):
    entry = ledger.join(8 << 30, "engine-a", floor_bytes=1 << 30)
    before = Path(ledger.path).read_bytes()
    assert cli([*argv, "--key", KEY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and problem in err, err
    assert err.startswith("python -m vllm.v1.kv_vmm.ledger_cli: error: ")
    # Nothing changed.
    assert Path(ledger.path).read_bytes() == before
    assert ledger.read().entry(entry).floor_bytes == 1 << 30


def test_cli_on_a_garbage_ledger_says_so_in_one_line(ledger, capsys):
    ledger.join(8 << 30, "engine-a")
    with open(ledger.path, "w") as f:
        f.write('{"format": 1, "key": "GPU-test", "capacity_bytes": -9')
    for argv in (["list"], ["capacity", "1G", "--key", KEY],
                 ["set", "engine-a", "--key", KEY, "--floor-bytes", "1G"]):  # fmt: skip
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"KV memory ledger {ledger.path} is not valid: not JSON" in err
        assert f"remove it (rm {ledger.path})" in err


def test_cli_reads_sizes_with_units_and_refuses_the_rest():
    # That these are the engine flags' own readings: test_byte_units.py.
    assert parse_bytes("4096") == 4096
    assert parse_bytes("1G") == 1 << 30 and parse_bytes("1.5g") == 1_500_000_000
    for text in ("1GiB", "1.5G", "lots"):
        with pytest.raises(UsageError):
            parse_bytes(text)
    with pytest.raises(UsageError, match="negative"):
        parse_bytes("-1")
    with pytest.raises(UsageError, match="not a size"):
        parse_bytes("")


def test_cli_list_passes_over_a_fifo_lock_file(ledger, capsys):
    """A FIFO named as an engine's liveness lock file is no regular file:
    ``list`` passes over it and answers, never opening it in a way that
    waits for a writer that never comes."""
    ledger.join(10 * MiB, "b")
    token = os.path.join(ledger.directory, f"vllm-kv-proc-{'ab' * 16}.lock")
    os.mkfifo(token, 0o600)
    assert ends_within(lambda: cli(["list"]), 10, [token]) == 0
    assert "b" in capsys.readouterr().out


def _report_of_a_child() -> str:
    return create_page_status(4, tag="child").path


def test_cli_list_sweeps_the_page_reports_of_dead_engines():
    """``list`` removes the page reports of engine cores that died (by their
    liveness lock, as a starting engine does) and keeps those of live
    ones."""
    status = create_page_status(4, tag="t")
    dead = ForkedUser(_report_of_a_child)
    dead_path = dead.result()
    dead.kill()  # SIGKILL: its report stays behind
    assert os.path.exists(dead_path)
    assert cli(["list"]) == 0
    assert not os.path.exists(dead_path)
    assert os.path.exists(status.path)
    status.close(unlink=True)
