# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NixlVmmWorker and NixlVmmScheduler: the NixlConnector state for
VMM-backed KV memory.

The peer fetches are about ordering (the read path must not wait for them),
so the tests control when a fetch returns; the timeout test uses a real ZMQ
side channel that never answers. Registration against a real NIXL agent is
covered in test_registry.py and the release's connector tests.
"""

import threading
import time

import msgspec
import pytest

from tests.v1.kv_connector.unit.nixl_vmm.utils import (  # noqa: F401 (fixture)
    RecordingAgent,
    two_region_table_fixture,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.scheduler import (
    NixlVmmScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.worker import (
    NixlVmmWorker,
    fetch_agent_metadata,
)


class _Agent(RecordingAgent):
    """NIXL agent stand-in: records registrations and loaded peer metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[bytes] = []
        self.threads: list[str] = []
        self.metadata = b"meta-0"

    def get_agent_metadata(self) -> bytes:
        return self.metadata

    def add_remote_agent(self, metadata: bytes) -> str:
        self.loaded.append(metadata)
        self.threads.append(threading.current_thread().name)
        return "peer"


class _Fetch:
    """A peer fetch the test releases (or fails) when it chooses."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.release = threading.Event()
        self.error: Exception | None = None
        self.reply = b"peer-meta-1"

    def __call__(self, path: str, request: bytes, timeout_s: float) -> bytes:
        self.calls.append((path, request))
        assert self.release.wait(60)
        if self.error is not None:
            raise self.error
        return self.reply


def _worker(table, fetch, fetch_attempts: int = 1) -> tuple[NixlVmmWorker, _Agent]:
    agent = _Agent()
    worker = NixlVmmWorker(agent, fetch=fetch, fetch_attempts=fetch_attempts)
    worker.page_table = table
    base = table.tensors[0].data_ptr()
    worker.register(["DRAM"], False, [(base, base + 4096)], 0)
    worker.add_peer("peer", "tcp://127.0.0.1:1", b"get-meta")
    return worker, agent


def _events():
    ready = threading.Event()
    failed: list[Exception] = []
    done = threading.Event()

    def on_failed(e: Exception) -> None:
        failed.append(e)
        done.set()

    return ready, failed, done, on_failed


def test_catch_up_fetches_in_the_background_and_loads_on_the_read_path(table):
    fetch = _Fetch()
    worker, agent = _worker(table, fetch)
    try:
        ready, failed, done, on_failed = _events()
        # Epoch 0 (stock or unchanged peer): nothing to fetch.
        assert worker.catch_up(["peer"], 0, ready.set, on_failed)
        assert fetch.calls == []

        # A newer epoch: the call returns at once while the fetch is held.
        start = time.monotonic()
        assert not worker.catch_up(["peer"], 2, ready.set, on_failed)
        assert time.monotonic() - start < 1.0
        assert not ready.is_set() and agent.loaded == []
        # A second read at the same epoch shares the fetch in flight.
        ready2, _, _, _ = _events()
        assert not worker.catch_up(["peer"], 2, ready2.set, on_failed)
        fetch.release.set()
        assert ready.wait(60) and ready2.wait(60)
        assert fetch.calls == [("tcp://127.0.0.1:1", b"get-meta")]
        assert failed == []
        # Loaded on the thread that retries the read, not the fetching one.
        assert agent.loaded == []
        assert worker.catch_up(["peer"], 2, ready.set, on_failed)
        assert agent.loaded == [b"peer-meta-1"]
        assert agent.threads == [threading.current_thread().name]
        # Caught up: no more fetches for that epoch or older ones.
        assert worker.catch_up(["peer"], 1, ready.set, on_failed)
        assert len(fetch.calls) == 1
        # Peers never handshaken with (no side channel) are not fetched.
        assert worker.catch_up(["other"], 5, ready.set, on_failed)
    finally:
        fetch.release.set()
        worker.close()


def test_a_failed_fetch_fails_the_waiting_reads(table):
    fetch = _Fetch()
    fetch.error = TimeoutError("no reply")
    worker, agent = _worker(table, fetch)
    try:
        ready, failed, done, on_failed = _events()
        assert not worker.catch_up(["peer"], 1, ready.set, on_failed)
        fetch.release.set()
        assert done.wait(60)
        assert [type(e) for e in failed] == [TimeoutError]
        assert not ready.is_set()
        # Nothing was loaded; a later read at that epoch fetches again.
        fetch.error = None
        ready, failed, done, on_failed = _events()
        assert not worker.catch_up(["peer"], 1, ready.set, on_failed)
        assert ready.wait(60) and failed == []
        assert worker.catch_up(["peer"], 1, ready.set, on_failed)
        assert agent.loaded == [b"peer-meta-1"] and len(fetch.calls) == 2
    finally:
        fetch.release.set()
        worker.close()


def test_a_fetch_that_failed_is_tried_again_before_the_reads_fail(table):
    """A busy peer's side channel can answer late: the reads fail only after
    every attempt failed."""
    fetch = _Fetch()
    failures = [TimeoutError("no reply"), TimeoutError("no reply")]

    def flaky(path: str, request: bytes, timeout_s: float) -> bytes:
        fetch.error = failures.pop(0) if failures else None
        return fetch(path, request, timeout_s)

    worker, agent = _worker(table, flaky, fetch_attempts=3)
    try:
        fetch.release.set()
        ready, failed, done, on_failed = _events()
        assert not worker.catch_up(["peer"], 1, ready.set, on_failed)
        assert ready.wait(60) and failed == []
        assert worker.catch_up(["peer"], 1, ready.set, on_failed)
        assert agent.loaded == [b"peer-meta-1"] and len(fetch.calls) == 3
        # Always failing: the reads fail after the last attempt, with its error.
        failures.extend([TimeoutError("a"), TimeoutError("b"), TimeoutError("c")])
        ready, failed, done, on_failed = _events()
        assert not worker.catch_up(["peer"], 2, ready.set, on_failed)
        assert done.wait(60)
        assert [str(e) for e in failed] == ["c"] and not ready.is_set()
        assert len(fetch.calls) == 6
    finally:
        worker.close()


def test_fetch_times_out_off_the_read_path():
    """A real side channel that never answers: the read path returns at once,
    and the fetch fails after its timeout."""
    zmq = pytest.importorskip("zmq")
    with zmq.Context() as ctx, ctx.socket(zmq.REP) as rep:
        rep.setsockopt(zmq.LINGER, 0)
        port = rep.bind_to_random_port("tcp://127.0.0.1")
        # A reader with stock KV tensors (no page table) catches up too.
        agent = _Agent()
        worker = NixlVmmWorker(agent, fetch_timeout_s=2.0, fetch_attempts=1)
        worker.add_peer("peer", f"tcp://127.0.0.1:{port}", b"get-meta")
        try:
            ready, failed, done, on_failed = _events()
            start = time.monotonic()
            assert not worker.catch_up(["peer"], 1, ready.set, on_failed)
            # Well under the fetch's timeout: the read path did not wait for it.
            assert time.monotonic() - start < 1.0
            assert rep.recv() == b"get-meta"  # asked, never answered
            assert done.wait(30)
            assert isinstance(failed[0], zmq.Again) and not ready.is_set()
        finally:
            worker.close()


def test_fetch_agent_metadata_decodes_the_handshake_payload():
    zmq = pytest.importorskip("zmq")
    nm = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata",
        reason="the release's NixlConnector has no nixl.metadata module",
    )

    def reply(sock, agent_metadata: bytes) -> None:
        sock.recv()
        # Only the field this path reads matters.
        fields = {"engine_id": "e", "agent_metadata": agent_metadata}
        encoded = msgspec.msgpack.encode(fields)
        payload = nm.NixlHandshakePayload(
            compatibility_hash="h", agent_metadata_bytes=encoded
        )
        sock.send(msgspec.msgpack.encode(payload))

    with zmq.Context() as ctx, ctx.socket(zmq.REP) as rep:
        rep.setsockopt(zmq.LINGER, 0)
        port = rep.bind_to_random_port("tcp://127.0.0.1")
        server = threading.Thread(target=reply, args=(rep, b"agent-bytes"))
        server.start()
        try:
            got = fetch_agent_metadata(f"tcp://127.0.0.1:{port}", b"get", 10.0)
        finally:
            server.join(10)
    assert got == b"agent-bytes"


def test_a_transfer_naming_unknown_peer_memory_does_not_wait(table):
    fetch = _Fetch()
    worker, agent = _worker(table, fetch)
    try:
        # The first miss starts a fetch and fails the transfer at once...
        assert worker._refresh_in_background("peer") is False
        assert worker._refresh_in_background("unknown") is False
        fetch.release.set()
        deadline = time.monotonic() + 60
        while not worker._fetches["peer"][1].done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent.loaded == []
        # ...a later miss loads what it fetched and retries.
        assert worker._refresh_in_background("peer") is True
        assert agent.loaded == [b"peer-meta-1"] and len(fetch.calls) == 1
    finally:
        fetch.release.set()
        worker.close()


def test_register_checks_the_configuration(table):
    base = table.tensors[0].data_ptr()
    end = base + table.geometry.tensor_bytes[0]

    def worker() -> NixlVmmWorker:
        w = NixlVmmWorker(_Agent())
        w.page_table = table
        return w

    with pytest.raises(NotImplementedError, match="host transfer buffer"):
        worker().register(["DRAM"], True, [], 0)
    with pytest.raises(NotImplementedError, match="one memory type"):
        worker().register(["DRAM", "VRAM"], False, [], 0)
    with pytest.raises(NotImplementedError, match="outside the VMM reservations"):
        worker().register(["DRAM"], False, [(base, end + 1)], 0)
    vmm = worker()
    agent = vmm.agent
    table.map_pages([0])
    vmm.register(["DRAM"], False, [(base, end)], 0)
    try:
        assert len(agent.registered) == 1
        # Registered chunk by chunk: nothing when no page is mapped, not
        # the reservation; later maps follow.
        table.map_pages([1])
        assert len(agent.registered) == 2
    finally:
        vmm.close()
    assert agent.registered == []


def test_registration_update_republishes_once_per_change(table):
    from dataclasses import dataclass

    @dataclass
    class Meta:
        engine_id: str
        agent_metadata: bytes

    @dataclass
    class Payload:
        compatibility_hash: str
        agent_metadata_bytes: bytes

    worker, agent = _worker(table, _Fetch())
    try:
        first = Payload("h", msgspec.msgpack.encode(Meta("e", b"meta-0")))
        worker.published(Meta("e", b"meta-0"))
        assert worker.registration_update(first) is None
        table.map_pages([1])
        agent.metadata = b"meta-1"
        update = worker.registration_update(first)
        assert update is not None
        new, old_bytes, new_bytes = update
        assert old_bytes == msgspec.msgpack.encode(first)
        assert new_bytes == msgspec.msgpack.encode(new)
        assert new.compatibility_hash == "h"
        assert msgspec.msgpack.decode(new.agent_metadata_bytes, type=Meta) == Meta(
            "e", b"meta-1"
        )
        assert worker.registration_update(new) is None  # published once
    finally:
        worker.close()


def test_scheduler_counts_epochs_and_serves_republished_payloads():
    class Step:
        def __init__(self, ops) -> None:
            self.kv_page_ops = ops

    scheduler = NixlVmmScheduler()
    scheduler.step(Step(None))
    assert scheduler.transfer_params() == {}  # stock KV tensors: no key
    scheduler.step(Step(["map"]))
    scheduler.step(Step([]))
    assert scheduler.transfer_params() == {"remote_registration_epoch": 1}
    served = {(0, 0): b"a", (0, 1): b"b"}
    NixlVmmScheduler.serve(served, {b"b": b"b2", b"x": b"y"})
    assert served == {(0, 0): b"a", (0, 1): b"b2"}
