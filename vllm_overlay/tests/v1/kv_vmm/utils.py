# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture
def should_do_global_cleanup_after_test() -> bool:
    """Do the global cleanup of vLLM's tests (distributed state, a garbage
    collection, device caches) only where a GPU is: without one these tests
    start no distributed state and hold no device memory, and the cleanup
    (about 0.6 s a test) would be most of the suite's time. Conftests that
    import this override the fixture of ``tests/conftest.py``."""
    return torch.cuda.is_available()


def vllm_wires_vmm_kv() -> bool:
    """Whether this vLLM carries the patch that wires VMM-backed KV memory into
    the engine (``--kv-cache-memory-backend``); the overlay alone does not, e.g.
    on a release the patch has not been carried to yet."""
    from vllm.config import CacheConfig

    return "kv_cache_memory_backend" in getattr(CacheConfig, "__dataclass_fields__", {})


requires_vmm_kv_wiring = pytest.mark.skipif(
    not vllm_wires_vmm_kv(),
    reason="this vLLM does not carry the VMM-backed KV cache patch",
)


def vllm_reports_kv_page_stats() -> bool:
    """Whether the scheduler stats carry the VMM page counters (the metrics
    patch; carried separately from the wiring)."""
    from vllm.v1.metrics.stats import SchedulerStats

    return "kv_page_stats" in getattr(SchedulerStats, "__dataclass_fields__", {})


requires_kv_page_stats = pytest.mark.skipif(
    not vllm_reports_kv_page_stats(),
    reason="this vLLM does not carry the VMM KV page metrics patch",
)


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


class Clock:
    """A clock the tests move by hand: ``now``, in seconds."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def write_tiny_llama_config(path: Path, **overrides) -> str:
    """A one-layer Llama config in ``path`` (no weights, no tokenizer): a
    model for vLLM's scheduler test helpers; returns the directory.
    ``overrides`` replace its fields, for a test whose KV cache sizes
    depend on the model's shape."""
    import json

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
        **overrides,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
