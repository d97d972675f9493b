# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Acting as other users, for the tests of files shared between users, and
waiting on a file that may block (a FIFO) with a deadline."""

import os
import threading

import pytest

#: Other users and a group for the tests of files shared between users (as
#: root: real uids and gids need no entry in /etc/passwd or /etc/group).
OTHER_UID = 65534
THIRD_UID = 65533
SHARED_GID = 65532

requires_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root to act as a second user (CI runs as root); without it "
    "the owner checks are covered by files of this user with the wrong mode",
)


class ForkedUser:
    """Runs ``fn(*args)`` in a forked child as another user (``uid``,
    ``gid``, supplementary ``groups``; None: this process's), and keeps the
    child alive until :meth:`stop` or :meth:`kill`: what it holds (a ledger
    entry, its liveness lock) lives as long as it does. Forked, so the
    child needs nothing it could not read as that user (no imports)."""

    def __init__(
        self,
        fn,
        *args,
        uid: int | None = None,
        gid: int | None = None,
        groups: list[int] | None = None,
    ) -> None:
        import json

        r_out, w_out = os.pipe()
        r_in, w_in = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.close(r_out)
                os.close(w_in)
                if groups is not None:
                    os.setgroups(groups)
                if gid is not None:
                    os.setgid(gid)
                if uid is not None:
                    os.setuid(uid)
                msg = json.dumps({"result": fn(*args)})
            except BaseException as e:  # reported to the parent
                msg = json.dumps({"error": f"{type(e).__name__}: {e}"})
            os.write(w_out, (msg + "\n").encode())
            os.read(r_in, 1)  # until the parent stops it (or dies)
            os._exit(0)
        os.close(w_out)
        os.close(r_in)
        self.pid = pid
        self._out = os.fdopen(r_out)
        self._in = w_in
        self._done = False

    def result(self, timeout: float = 60.0):
        """What ``fn`` returned; AssertionError with its exception if it
        raised."""
        import json
        import select

        ready, _, _ = select.select([self._out], [], [], timeout)
        assert ready, f"child {self.pid} did not answer in {timeout} s"
        doc = json.loads(self._out.readline())
        assert "error" not in doc, doc["error"]
        return doc["result"]

    def error(self, timeout: float = 60.0) -> str:
        """The exception ``fn`` raised (AssertionError if it returned)."""
        import json
        import select

        ready, _, _ = select.select([self._out], [], [], timeout)
        assert ready, f"child {self.pid} did not answer in {timeout} s"
        doc = json.loads(self._out.readline())
        assert "error" in doc, f"no error: returned {doc['result']!r}"
        return doc["error"]

    def stop(self) -> None:
        if not self._done:
            self._done = True
            os.close(self._in)
            os.waitpid(self.pid, 0)
            self._out.close()

    def kill(self) -> None:
        import signal

        if not self._done:
            self._done = True
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            os.close(self._in)
            self._out.close()


def ends_within(fn, seconds: float, fifos: list[str]):
    """``fn()``'s result or exception, or a failure if it still runs after
    ``seconds`` (it is then freed by opening ``fifos`` for writing)."""
    outcome: list = []

    def run():
        try:
            outcome.append(fn())
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(seconds)
        pytest.fail(f"still waiting after {seconds} s on a FIFO in {fifos}")
    return outcome[0]
