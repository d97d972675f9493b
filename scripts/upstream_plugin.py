"""pytest plugin for scripts/upstream_oracle.py: one outcome per test, and the known-unrunnable
tests taken out of the run (with their reason kept for the report).

Loaded with `-p upstream_plugin` (scripts/ on PYTHONPATH). Reads KVSERIES_UPSTREAM_UNRUNNABLE
(a JSON file: {test id or prefix: reason}) and appends JSON lines to KVSERIES_UPSTREAM_OUTCOMES:
  {"collected": [ids]}                         after collection (a crash later leaves the rest
                                               of them without an outcome: "crashed")
  {"id": ..., "outcome": ..., "reason"/"message": ...}   per test (why it is unrunnable, or
                                               the first line of its failure)
Outcomes: passed, failed, error (setup/teardown failed), skipped, xfailed, xpassed, unrunnable.
"""

from __future__ import annotations

import json
import os

import pytest
from upstream_oracle import unrunnable_reason

_outcomes: dict[str, str] = {}
_messages: dict[str, str] = {}


def _emit(record: dict) -> None:
    path = os.environ.get("KVSERIES_UPSTREAM_OUTCOMES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get("KVSERIES_UPSTREAM_UNRUNNABLE")
    unrunnable = json.load(open(path)) if path else {}
    keep, out = [], []
    for item in items:
        reason = unrunnable_reason(item.nodeid, unrunnable)
        if reason is None:
            keep.append(item)
        else:
            out.append(item)
            _emit({"id": item.nodeid, "outcome": "unrunnable", "reason": reason})
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = keep
    _emit({"collected": [item.nodeid for item in items]})


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
        _outcomes[nodeid] = outcome
    elif report.outcome == "failed":
        _outcomes[nodeid] = "error"  # setup or teardown failed
    elif report.skipped and report.when == "setup":
        _outcomes[nodeid] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    if report.failed and nodeid not in _messages:
        crash = getattr(report.longrepr, "reprcrash", None)
        _messages[nodeid] = " ".join((crash.message if crash else str(report.longrepr)).split())[:300]
    if report.when == "teardown" and nodeid in _outcomes:
        record = {"id": nodeid, "outcome": _outcomes.pop(nodeid)}
        if nodeid in _messages:
            record["message"] = _messages.pop(nodeid)
        _emit(record)
