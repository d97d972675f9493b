# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The per-device KV memory ledger: floors, caps, first come first served,
engines that die, files other users made or may write, and garbage in the
file. The CLI's cases are in test_ledger_cli.py, those of the engines' page
reports in test_page_status.py."""

import json
import os
import shutil
import signal
import stat
import time

import pytest

import vllm.envs  # noqa: F401  (children as other users import nothing)
from tests.v1.kv_vmm.elastic_utils import (
    ledger_base_fixture,  # noqa: F401 (the fixture)
)
from tests.v1.kv_vmm.user_utils import (
    OTHER_UID,
    SHARED_GID,
    THIRD_UID,
    ForkedUser,
    ends_within,
    requires_root,
)
from vllm.v1.kv_vmm import shm_files
from vllm.v1.kv_vmm.ledger import (
    MAX_LEDGER_FILE_BYTES,
    KVMemoryLedger,
    LedgerError,
    find_entry,
    ledger_path,
    list_ledgers,
)

MiB = 1 << 20
KEY = "GPU-test"


@pytest.fixture
def ledger(ledger_base) -> KVMemoryLedger:
    return KVMemoryLedger(KEY)


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
    # Values the ledger would not read back are refused before writing.
    with pytest.raises(ValueError, match="floor_bytes is -1"):
        ledger.update(b, floor_bytes=-1)
    with pytest.raises(ValueError, match="limit_bytes is 0"):
        ledger.update(b, limit_bytes=0)
    with pytest.raises(ValueError, match="capacity_bytes is -5"):
        ledger.set_capacity(-5)


def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_files_are_made_safely_and_the_last_engine_removes_them(ledger):
    a = ledger.join(10 * MiB, "a")
    b = ledger.join(10 * MiB, "b")
    assert list_ledgers(ledger.directory) == [KEY]
    # The engines' directory is this user's alone, and so is every file in it.
    st = os.lstat(ledger.directory)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert os.path.basename(ledger.directory) == f"vllm-kv-u{os.geteuid()}"
    # The engines' directory of this user, where their page reports go too.
    assert ledger.directory == shm_files.dir_path(shm_files.file_owner())
    for name in _files(ledger.directory):
        st = os.lstat(os.path.join(ledger.directory, name))
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600, name
    # A write replaces the file whole (a new file renamed over it): a process
    # that dies mid-write leaves the old one, never half of one.
    inode = os.stat(ledger.path).st_ino
    ledger.grow(a, MiB, unit=MiB)
    assert os.stat(ledger.path).st_ino != inode
    assert not [n for n in _files(ledger.directory) if n.endswith(".tmp")]
    ledger.leave(a)
    assert [e.id for e in ledger.read().entries] == [b]
    ledger.leave(b)
    # The ledger and its lock file go with the last engine; what is left is
    # this (live) process's liveness lock, removed at its exit.
    assert not os.path.exists(ledger.path)
    assert not os.path.exists(ledger.lock_path)
    assert [n for n in _files(ledger.directory) if "ledger" in n] == []
    assert ledger.read() is None
    # The next engine creates it again, with its own capacity.
    ledger.join(5 * MiB, "c")
    assert ledger.read().capacity_bytes == 5 * MiB


def _engine() -> str:
    ledger = KVMemoryLedger(KEY)
    entry = ledger.join(64 * MiB, "child", mapped_bytes=8 * MiB)
    ledger.grow(entry, 16 * MiB, unit=MiB)
    return entry


def test_a_killed_engine_leaves_the_ledger(ledger):
    child = ForkedUser(_engine)
    try:
        child.result()
        mine = ledger.join(0, "parent")
        state = ledger.read()
        other = find_entry(state, "child")
        assert other.pid == child.pid and other.mapped_bytes == 24 * MiB
        # The child's memory is not free for this engine.
        assert state.room(mine) == 64 * MiB - 24 * MiB
        child.kill()  # SIGKILL: nothing of it runs any more
        state = ledger.read()
        assert [e.name for e in state.entries] == ["parent"]
        assert state.room(mine) == 64 * MiB
        # Its liveness lock went with its entry.
        locks = [n for n in _files(ledger.directory) if n.startswith("vllm-kv-proc-")]
        assert locks == [f"vllm-kv-proc-{state.entries[0].owner}.lock"]
    finally:
        child.kill()


def _rewrite(path: str, edit) -> None:
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def test_liveness_is_the_engines_lock_not_its_pid(ledger):
    """Engines in other PID namespaces (containers sharing /dev/shm) have
    pids that mean nothing here: liveness is the flock each engine holds."""
    child = ForkedUser(lambda: KVMemoryLedger(KEY).join(10 * MiB, "child"))
    try:
        child_id = child.result()
        mine = ledger.join(10 * MiB, "parent")
        # Pids that name no process here (beyond any pid_max), or another one.
        never_a_pid = 1 << 23

        def set_pids(doc) -> None:
            for e in doc["entries"]:
                e["pid"] = never_a_pid if e["id"] == child_id else 1

        _rewrite(ledger.path, set_pids)
        assert {e.id for e in ledger.read().entries} == {child_id, mine}
        # An entry whose process holds no lock is dropped, whatever its pid.
        _rewrite(ledger.path, lambda d: d["entries"][1].update(owner="0" * 32))
        assert [e.id for e in ledger.read().entries] == [child_id]
    finally:
        child.kill()
    # The child is gone: so is its entry, and the file with its last entry.
    assert ledger.read() is None
    assert not os.path.exists(ledger.path)


CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1


def _join_in_a_new_pid_namespace() -> list:
    """Runs in a forked child: makes a PID namespace (with its own /proc, as
    a container has) and joins the ledger from its first process (pid 1
    there), which lives until this child dies. Returns [its pid there, its
    pid here]."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), what)

    check(libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount /")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            check(libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount /proc")
            KVMemoryLedger(KEY).join(10 * MiB, "namespaced")
            os.write(w, f"{os.getpid()}\n".encode())
        except BaseException as e:
            os.write(w, f"{type(e).__name__}: {e}\n".encode())
        while True:
            time.sleep(60)
    answer = os.fdopen(r).readline().strip()
    if not answer.isdigit():
        raise OSError(answer)
    return [int(answer), pid]


def test_an_engine_in_another_pid_namespace_is_kept(ledger):
    """Containers sharing /dev/shm (``--ipc=host``) have PID namespaces of
    their own: an engine's pid means nothing outside its namespace, and a
    look into /proc finds another process or none."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a PID namespace")
    child = ForkedUser(_join_in_a_new_pid_namespace)
    try:
        try:
            inner, outer = child.result()
        except AssertionError as e:
            pytest.skip(f"cannot make a PID namespace with its own /proc here: {e}")
        (entry,) = ledger.read().entries
        assert inner == 1 and outer != 1  # pid 1 there: the host's init here
        assert entry.name == "namespaced" and entry.pid == 1
        time.sleep(0.1)
        assert [e.name for e in ledger.read().entries] == ["namespaced"]
    finally:
        child.kill()  # and with it the namespace's first process
    deadline = time.monotonic() + 30
    while ledger.read() is not None:
        assert time.monotonic() < deadline, ledger.read()
        time.sleep(0.05)


# -- files other users made ---------------------------------------------------


def test_a_symlink_at_the_ledger_path_is_refused(ledger, tmp_path):
    ledger.join(10 * MiB, "a")
    target = tmp_path / "elsewhere.json"
    shutil.copy(ledger.path, target)
    os.unlink(ledger.path)
    os.symlink(target, ledger.path)
    with pytest.raises(LedgerError, match="is a symbolic link") as e:
        ledger.read()
    assert ledger.path in str(e.value) and "remove it" in str(e.value)
    # ... and one at the engines' directory.
    os.unlink(ledger.path)
    moved = tmp_path / "dir"
    os.rename(ledger.directory, moved)
    os.symlink(moved, ledger.directory)
    with pytest.raises(LedgerError, match="is a symbolic link"):
        KVMemoryLedger(KEY).join(10 * MiB, "b")


def test_a_fifo_in_the_directory_is_refused_not_waited_on(ledger):
    """A FIFO where the ledger belongs is no regular file: refused, never
    opened in a way that waits for a writer that never comes (a FIFO named
    as a liveness lock file: test_ledger_cli.py)."""
    ledger.join(10 * MiB, "a")
    os.unlink(ledger.path)
    os.mkfifo(ledger.path, 0o600)
    error = ends_within(ledger.read, 10, [ledger.path])
    assert isinstance(error, LedgerError), error
    assert "is not a regular file" in str(error) and ledger.path in str(error)
    os.unlink(ledger.path)
    ledger.join(10 * MiB, "b")
    assert [e.name for e in ledger.read().entries] == ["b"]


def test_files_others_may_write_are_refused_as_this_user(ledger):
    """Without a second user: the same checks see a mode another user could
    write through."""
    ledger.join(10 * MiB, "a")
    os.chmod(ledger.path, 0o666)
    with pytest.raises(LedgerError, match="mode 0666") as e:
        ledger.read()
    assert "another user may have made it" in str(e.value)
    os.chmod(ledger.path, 0o600)
    os.chmod(ledger.directory, 0o777)
    with pytest.raises(LedgerError, match="mode 0777"):
        ledger.read()
    os.chmod(ledger.directory, 0o700)
    assert ledger.read() is not None


@requires_root
def test_a_ledger_another_user_made_is_refused(ledger_base):
    # Another user, first on the host, makes this user's directory (it may:
    # the base is sticky and world-writable, like /dev/shm) and a ledger in
    # it that leaves no room for anybody.
    def plant(base: str, uid: int) -> str:
        directory = os.path.join(base, f"vllm-kv-u{uid}")
        os.mkdir(directory, 0o777)
        os.chmod(directory, 0o777)
        doc = {"format": 1, "key": KEY, "capacity_bytes": 0,
               "capacity_fixed": True, "measured_by": None, "entries": []}  # fmt: skip
        path = os.path.join(directory, f"vllm-kv-ledger-{KEY}.json")
        with open(path, "w") as f:
            json.dump(doc, f)
        os.chmod(path, 0o666)
        return directory

    other = ForkedUser(plant, str(ledger_base), os.geteuid(), uid=OTHER_UID,
                       gid=OTHER_UID, groups=[])  # fmt: skip
    directory = other.result()
    other.stop()
    assert os.stat(directory).st_uid == OTHER_UID
    with pytest.raises(LedgerError) as e:
        KVMemoryLedger(KEY).join(10 * MiB, "a")
    message = str(e.value)
    assert directory in message and f"uid {OTHER_UID}" in message
    assert "mode 0777" in message and f"rm -r {directory}" in message
    # Made with the right mode, but by the other user: refused the same way.
    os.chmod(directory, 0o700)
    with pytest.raises(LedgerError, match=f"uid {OTHER_UID}"):
        KVMemoryLedger(KEY).read()
    # A file of the other user in this user's own directory is refused too.
    shutil.rmtree(directory)
    ledger = KVMemoryLedger(KEY)
    ledger.join(10 * MiB, "a")
    os.chown(ledger.path, OTHER_UID, OTHER_UID)
    with pytest.raises(LedgerError, match=f"uid {OTHER_UID}"):
        ledger.read()


@requires_root
def test_another_user_cannot_read_or_join_a_users_ledger(ledger):
    ledger.join(10 * MiB, "a")

    def peek(path: str) -> str:
        with open(path) as f:
            return f.read()

    other = ForkedUser(peek, ledger.path, uid=OTHER_UID, gid=OTHER_UID, groups=[])
    assert "Permission denied" in other.error()
    other.stop()
    # Its own engines have a ledger of their own.
    other = ForkedUser(lambda: KVMemoryLedger(KEY).join(10 * MiB, "b"),
                       uid=OTHER_UID, gid=OTHER_UID, groups=[])  # fmt: skip
    try:
        other.result()
        assert [e.name for e in ledger.read().entries] == ["a"]
    finally:
        other.stop()


def _join_group(name: str) -> list:
    ledger = KVMemoryLedger(KEY, group=str(SHARED_GID))
    ledger.join(10 * MiB, name, mapped_bytes=MiB)
    return sorted(e.name for e in ledger.read().entries)


@requires_root
def test_two_users_share_a_ledger_with_a_group():
    users = []
    try:
        for uid, name in ((OTHER_UID, "first"), (THIRD_UID, "second")):
            users.append(ForkedUser(_join_group, name, uid=uid, gid=uid,
                                    groups=[SHARED_GID]))  # fmt: skip
            users[-1].result()
        ledger = KVMemoryLedger(KEY, group=str(SHARED_GID))
        assert sorted(e.name for e in ledger.read().entries) == ["first", "second"]
        st = os.lstat(ledger.directory)
        assert os.path.basename(ledger.directory) == f"vllm-kv-g{SHARED_GID}"
        assert st.st_gid == SHARED_GID and stat.S_IMODE(st.st_mode) == 0o2770
        for name in _files(ledger.directory):
            st = os.lstat(os.path.join(ledger.directory, name))
            assert st.st_gid == SHARED_GID and stat.S_IMODE(st.st_mode) == 0o660
        # A user outside the group may not read it.
        outsider = ForkedUser(
            lambda: KVMemoryLedger(KEY, group=str(SHARED_GID)).read(),
            uid=OTHER_UID, gid=OTHER_UID, groups=[],
        )  # fmt: skip
        assert "LedgerError" in outsider.error()
        outsider.stop()
        # One of them dies: the other one sees its entry go.
        users[0].kill()
        assert [e.name for e in ledger.read().entries] == ["second"]
    finally:
        for user in users:
            user.kill()


def test_an_unknown_group_is_a_clear_error():
    with pytest.raises(ValueError, match="no such group"):
        KVMemoryLedger(KEY, group="no-such-group-here")


# -- garbage ------------------------------------------------------------------


def _garbage_cases(doc: dict) -> dict[str, bytes]:
    def edited(**changes) -> bytes:
        return json.dumps({**doc, **changes}).encode()

    def entry(**changes) -> bytes:
        return edited(entries=[{**doc["entries"][0], **changes}])

    text = json.dumps(doc).encode()
    no_entries = json.dumps({k: v for k, v in doc.items() if k != "entries"}).encode()
    return {
        "truncated JSON": text[: len(text) // 2],
        "empty file": b"",
        "not UTF-8": b"\xff\xfe" * 10,
        "a list": b"[1, 2, 3]",
        "capacity a string": edited(capacity_bytes="lots"),
        "capacity a bool": edited(capacity_bytes=True),
        "capacity absurd": edited(capacity_bytes=1 << 70),
        "capacity negative": edited(capacity_bytes=-7),
        "entries missing": no_entries,
        "too many unknown fields": edited(**{f"later_{i}": i for i in range(40)}),
        "another format": edited(format=2),
        "another key": edited(key="GPU-other"),
        "mapped negative": entry(mapped_bytes=-1),
        "floor a float": entry(floor_bytes=1.5),
        "limit zero": entry(limit_bytes=0),
        "owner not a token": entry(owner="../../etc/passwd"),
        "name a number": entry(name=7),
        "updated NaN": entry(updated=float("nan")),
        "pid negative": entry(pid=-3),
        "entry not an object": edited(entries=[1]),
        "huge file": b" " * (MAX_LEDGER_FILE_BYTES + 1) + text,
    }  # fmt: skip


def test_garbage_in_any_field_is_one_clear_error(ledger):
    entry_id = ledger.join(10 * MiB, "a")
    with open(ledger.path) as f:
        doc = json.load(f)
    good = json.dumps(doc).encode()
    for case, raw in _garbage_cases(doc).items():
        with open(ledger.path, "wb") as f:
            f.write(raw)
        with pytest.raises(LedgerError) as e:
            ledger.read()
        message = str(e.value)
        assert message.startswith(f"KV memory ledger {ledger.path} is not valid: "), (
            case, message)  # fmt: skip
        assert message.endswith("the engines sharing the device re-create it"), case
        assert "\n" not in message and f"rm {ledger.path}" in message, case
        # A starting engine refuses with the same message; nothing is written.
        with pytest.raises(LedgerError, match="is not valid"):
            KVMemoryLedger(KEY).join(10 * MiB, "b")
        with open(ledger.path, "rb") as f:
            assert f.read() == raw, case
    with open(ledger.path, "wb") as f:
        f.write(good)
    assert [e.id for e in ledger.read().entries] == [entry_id]


def test_fields_of_a_later_version_are_kept_as_they_are(ledger):
    """An engine of a later version on the same device (a rolling upgrade)
    writes fields this one does not know: they are not garbage; this engine
    reads the rest and writes them back unchanged."""
    entry_id = ledger.join(10 * MiB, "a")
    with open(ledger.path) as f:
        doc = json.load(f)
    doc["later_policy"] = {"mode": "x"}
    doc["entries"][0]["later_hint"] = [1, 2]
    with open(ledger.path, "w") as f:
        json.dump(doc, f)
    assert ledger.read().entry(entry_id).mapped_bytes == 0
    ledger.set_mapped(entry_id, 2 * MiB)
    other = KVMemoryLedger(KEY).join(10 * MiB, "b")
    with open(ledger.path) as f:
        after = json.load(f)
    assert after["later_policy"] == {"mode": "x"}
    (a, b) = after["entries"]
    assert (a["id"], a["mapped_bytes"], a["later_hint"]) == (entry_id, 2 * MiB, [1, 2])
    assert b["id"] == other and "later_hint" not in b


def test_a_lock_held_too_long_is_an_error_not_a_hang(ledger, monkeypatch):
    import fcntl

    from vllm.v1.kv_vmm import ledger as ledger_module

    ledger.join(10 * MiB, "a")
    monkeypatch.setattr(ledger_module, "LEDGER_LOCK_TIMEOUT_S", 0.2)
    with open(ledger.lock_path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a process stopped while holding it
        started = time.monotonic()
        with pytest.raises(LedgerError, match="was held for more than") as e:
            ledger.read()
        assert time.monotonic() - started < 5
        assert f"rm {ledger.lock_path}" in str(e.value)
    assert ledger.read() is not None


def test_the_directory_is_read_when_used_not_at_import(monkeypatch, tmp_path):
    base = tmp_path / "elsewhere"
    base.mkdir()
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", str(base))
    ledger = KVMemoryLedger(KEY)
    assert ledger.directory == str(base / f"vllm-kv-u{os.geteuid()}")
    ledger.join(MiB, "a")
    assert os.path.exists(ledger.path)
    assert shm_files.base_dir() == str(base)
    # Set but empty (``VLLM_KV_VMM_LEDGER_DIR= vllm serve ...``): the default,
    # not a directory named "".
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", "")
    assert shm_files.base_dir() == "/dev/shm"
    assert KVMemoryLedger(KEY).directory.startswith("/dev/shm/vllm-kv-")


def test_a_ledger_is_named_after_its_device_key():
    assert ledger_path("GPU-1/2", "/x") == "/x/vllm-kv-ledger-GPU-1_2.json"
