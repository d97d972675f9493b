"""Engines sharing one device's KV memory (--kv-cache-vmm-shared), on CPU (host VMM backend).

Two real vLLM 0.32.0 engines join the host's KV memory ledger: one's burst maps memory the other
gave back, and killing an engine frees its entry. A busy engine gives back the pages of its peak
beyond a step's worth after the shrink delay, while a request still runs. Map failures injected
into the workers (the device out of memory) never take an engine down, and its token ids stay
those of a run without them. Garbage written into the ledger while an OpenAI server serves fails
no request and is logged once; an engine started against it refuses with the file and the fix.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from kv_map_failures import plugin_env

pytestmark = pytest.mark.engine

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MAX_TOKENS = 8
_LEDGER_DIR: list[Path] = []


def _prompts() -> list[list[int]]:
    # 8 long prompts: several KV pages at once.
    return [[(7 * i + 3 * j) % 4000 + 1 for j in range(600)] for i in range(8)]


def _cpus(half: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of an engine's worker: one half of this host's CPUs. vLLM's
    automatic binding puts every engine's worker on the same cores: on two cores an engine
    started beside a busy one got no CPU time and was not up after 10 minutes."""
    from bench_pd import cpu_halves

    return ",".join(map(str, cpu_halves()[half]))


def _llm(model: Path, backend: str = "vmm", half: int = 0, **kwargs):
    """An offline engine whose worker runs on CPU half ``half`` (0 or 1)."""
    from vllm import LLM

    options = {"max_num_seqs": 8, "max_num_batched_tokens": 8192, **kwargs}
    # The binding is in the environment while the engine starts its processes.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", _cpus(half))
        return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                   enforce_eager=True, max_model_len=1024, seed=0,
                   kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True,
                   kv_cache_memory_backend=backend, **options)


def _generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # an engine whose core process was killed
        pass
    gc.collect()


def _map_failures(worker) -> int:
    return worker.model_runner.kv_page_mapper.stats()["kv_map_failures_total"]


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory) -> Path:
    from tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", num_key_value_heads=4)


@pytest.fixture
def ledger_dir(tmp_path, monkeypatch) -> Path:
    # A ledger of its own (engines of other runs on this host do not meet these): the
    # base directory VLLM_KV_VMM_LEDGER_DIR, read by every engine when it uses it.
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv("VLLM_KV_VMM_LEDGER_DIR", str(base))
    _LEDGER_DIR[:] = [base]
    return base


@pytest.fixture(scope="module")
def reference_ids(kv_model) -> list[list[int]]:
    llm = _llm(kv_model, backend="default")
    try:
        return _generate(llm)
    finally:
        _shutdown(llm)


# Alone: the same failure handling without a device ledger; CI runs the shared case.
@pytest.mark.parametrize(
    "shared", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["shared", "alone"]
)
# Slow: CI's map-failure engine cases are test_vmm_kv_map_failures.py (TP=1 and 2).
@pytest.mark.slow
def test_injected_map_failures_keep_the_engine_and_its_tokens(
        kv_model, reference_ids, ledger_dir, tmp_path, monkeypatch, shared):
    # 30% of the physical allocations fail as if the device were full (kv_map_failures.py, a
    # test-only plugin in the engine's processes): the scheduler hands out pages only once the
    # worker reported them, and asks again for the failed ones after a backoff.
    env, _ = plugin_env(tmp_path, rate=0.3, seed=7)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    llm = _llm(kv_model, kv_cache_vmm_shared=shared, kv_cache_vmm_shrink_delay=0)
    try:
        ids = [*_generate(llm), *_generate(llm)]
        failures = llm.collective_rpc(_map_failures)
    finally:
        _shutdown(llm)
    assert ids == reference_ids + reference_ids
    assert failures[0] > 0  # the failure path ran


def _entries(ledger_dir: Path) -> dict[str, dict]:
    from vllm.v1.kv_vmm.ledger import KVMemoryLedger

    state = KVMemoryLedger("host", directory=str(ledger_dir)).read()
    return {} if state is None else {e.name: vars(e) for e in state.entries}


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out; ledger: {_entries(_LEDGER_DIR[0])}"
        time.sleep(0.2)


# Slow: CI's two-engine case is test_vmm_kv_fair_share_engine.py (same host ledger, token
# ids equal the default backend).
@pytest.mark.slow
def test_two_engines_share_the_host_ledger(kv_model, reference_ids, ledger_dir):
    from vllm.v1.kv_vmm.ledger import KVMemoryLedger
    from vllm.v1.kv_vmm.ledger_cli import main as ledger_cli

    options = dict(kv_cache_vmm_shared=True, kv_cache_vmm_shrink_delay=1.0)
    a = _llm(kv_model, **options)
    b = None
    try:
        (page,) = set(a.collective_rpc(_page_bytes))
        # The operator's view: 12 pages for both engines, 2 reserved for each (set at run time
        # with the ledger CLI, in bytes).
        capacity = 12 * page
        run = ["--key", "host"]
        assert ledger_cli(["capacity", str(capacity), *run], str(ledger_dir)) == 0
        (name_a,) = _entries(ledger_dir)
        b = _llm(kv_model, half=1, **options)
        (name_b,) = set(_entries(ledger_dir)) - {name_a}
        for name in (name_a, name_b):
            args = ["set", _entries(ledger_dir)[name]["id"], "--floor-bytes", str(2 * page)]
            assert ledger_cli([*args, *run], str(ledger_dir)) == 0
        assert KVMemoryLedger("host", str(ledger_dir)).read().capacity_bytes == capacity
        # Both idle again: each maps the null block's page and the headroom.
        _wait(lambda: all(e["mapped_bytes"] <= 2 * page for e in _entries(ledger_dir).values()))

        # b's burst: right after it (shrink delay 1 s), b still maps what it used.
        assert _generate(b) == reference_ids
        burst_b = _entries(ledger_dir)[name_b]["mapped_bytes"]
        assert burst_b > 2 * page
        assert sum(e["mapped_bytes"] for e in _entries(ledger_dir).values()) <= capacity
        # b gives it back once idle; a's burst maps it.
        _wait(lambda: _entries(ledger_dir)[name_b]["mapped_bytes"] <= 2 * page)
        assert _generate(a) == reference_ids
        burst_a = _entries(ledger_dir)[name_a]["mapped_bytes"]
        assert burst_a + burst_b > capacity  # memory b held during its burst
        assert sum(e["mapped_bytes"] for e in _entries(ledger_dir).values()) <= capacity

        # Killing an engine (its core process holds the entry) frees its entry.
        os.kill(_entries(ledger_dir)[name_a]["pid"], signal.SIGKILL)
        _wait(lambda: list(_entries(ledger_dir)) == [name_b])
        assert _generate(b) == reference_ids  # the other one runs on
    finally:
        _shutdown(a)
        if b is not None:
            _shutdown(b)


def _page_bytes(worker) -> int:
    return worker.model_runner.kv_page_mapper.policy.device_page_bytes


# Slow: giving a peak back after the delay is a unit test (test_scheduler_shared.py).
@pytest.mark.slow
def test_busy_engine_gives_back_its_peak(tmp_path, ledger_dir, monkeypatch):
    # A burst of 3 long prompts maps most of the engine's 16 pages; a long request (the
    # trickle) keeps the engine busy after it. A step's worth of free blocks stays mapped (2
    # blocks for 256 batched tokens, one per sequence: 2 pages); the rest goes back to the ledger
    # once it stayed free for the shrink delay, while the trickle still runs (before, only an
    # idle engine gave memory back: one serving a trickle kept its peak's memory).
    from tiny_model import make_tiny_model
    from vllm import SamplingParams

    # 4 KiB of KV per token and layer: 4 blocks of 128 tokens per page (the kv_model has 16).
    model = make_tiny_model(tmp_path / "tiny-llama", num_attention_heads=8,
                            num_key_value_heads=8, head_dim=128)
    llm = _llm(model, kv_cache_vmm_shared=True, kv_cache_vmm_shrink_delay=0.5,
               max_num_seqs=4, max_num_batched_tokens=256)
    try:
        (page,) = set(llm.collective_rpc(_page_bytes))
        (name,) = _entries(ledger_dir)
        engine = llm.llm_engine
        # When the engine core produced each output (time.monotonic: the host's clock).
        produced: list[float] = []
        get_output = engine.engine_core.get_output

        def stamped():
            outputs = get_output()
            produced.append(outputs.timestamp)
            return outputs

        monkeypatch.setattr(engine.engine_core, "get_output", stamped)
        finished: set[str] = set()

        def step() -> int:
            finished.update(out.request_id for out in engine.step() if out.finished)
            return _entries(ledger_dir)[name]["mapped_bytes"]

        greedy = dict(temperature=0.0, detokenize=False, ignore_eos=True)
        engine.add_request("trickle", {"prompt_token_ids": list(range(1, 9))},
                           SamplingParams(max_tokens=1000, **greedy))
        burst = [f"burst-{i}" for i in range(3)]
        for i, request_id in enumerate(burst):
            prompt = [(11 * i + 5 * j) % 4000 + 1 for j in range(1000)]
            engine.add_request(request_id, {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=16, **greedy))
        peak = 0
        while not finished >= set(burst):
            peak = max(peak, step())
        assert peak >= 6 * page  # 24 blocks of the burst at once

        # The trickle runs on (1000 tokens: seconds); the burst's pages go back.
        deadline = time.monotonic() + 30
        while (mapped := step()) > peak - 4 * page:
            assert "trickle" not in finished and time.monotonic() < deadline, (
                f"a busy engine kept {mapped // page} of its peak's {peak // page} pages")
        seen = time.monotonic()
        # ... while the trickle was running: an output the engine core produced after that
        # reading says it had not finished.
        while produced[-1] <= seen and "trickle" not in finished:
            step()
        assert "trickle" not in finished
    finally:
        _shutdown(llm)


def _serve(model: Path, log: Path, half: int = 0, **engine):
    from bench_server import Server

    options = {"max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": True,
               "max_num_seqs": 8, "kv_cache_vmm_shared": True, **engine}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": _cpus(half)}
    return Server(str(model), "vmm", options, log, env)


def test_garbage_in_the_ledger_never_takes_a_serving_engine_down(kv_model, ledger_dir, tmp_path):
    """The ledger is a file other processes write: a process that died mid-write (before
    writes were atomic), or a tenant writing garbage. The serving engine keeps answering within
    the KV memory it has mapped and logs the file once; a new engine refuses to start with the
    file and the fix; once the file is removed (the fix) the server joins again."""
    from bench_sharing import stream_completion

    from vllm.v1.kv_vmm.ledger import KVMemoryLedger
    from vllm.v1.kv_vmm.ledger_cli import main as ledger_cli

    ledger = KVMemoryLedger("host")
    log = tmp_path / "server.log"
    server = _serve(kv_model, log)
    results: list[dict] = []
    stop, paused = threading.Event(), threading.Event()
    asking = [False, False]

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            if paused.is_set():
                time.sleep(0.1)
                continue
            n += 1
            prompt = [(13 * i + 7 * n + j) % 4000 + 1 for j in range(200)]
            asking[i] = True
            results.append(stream_completion(server.port, str(kv_model), prompt, 8, 120))
            asking[i] = False

    clients = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    try:
        health = server.wait_healthy(600)
        assert "error" not in health, f"{health}: {log.read_text()[-3000:]}"
        for c in clients:
            c.start()
        _wait(lambda: len(results) >= 4, timeout=120)
        good = Path(ledger.path).read_bytes()
        # Half a file, as a writer that died between truncating and writing left it.
        Path(ledger.path).write_bytes(good[: len(good) // 2])
        served = len(results)
        time.sleep(5)  # several ledger reads (every 50 ms, a full one every second)
        _wait(lambda: len(results) >= served + 4, timeout=120)
        assert server.proc.poll() is None, log.read_text()[-3000:]

        # A new engine against the garbage ledger refuses to start, naming the file. The
        # clients pause meanwhile: on a small host a busy server leaves a starting one so
        # little CPU time that it did not reach the ledger in 10 minutes.
        paused.set()
        _wait(lambda: not any(asking), timeout=180)
        log_b = tmp_path / "server-b.log"
        b = _serve(kv_model, log_b, half=1)
        try:
            health_b = b.wait_healthy(600)
            assert b.proc.poll() is not None, f"it did not end: {health_b}"
        finally:
            with contextlib.suppress(ProcessLookupError):  # its group is gone with it
                b.stop()
        paused.clear()
        assert b.proc.returncode != 0
        refusal = f"KV memory ledger {ledger.path} is not valid: not JSON"
        assert refusal in log_b.read_text(), log_b.read_text()[-3000:]
        assert f"remove it (rm {ledger.path})" in log_b.read_text()

        # The fix the message names: the file goes, the server joins again.
        os.unlink(ledger.path)
        _wait(lambda: len(_entries(ledger_dir)) == 1, timeout=60)
        served = len(results)
        _wait(lambda: len(results) >= served + 4, timeout=120)
    finally:
        stop.set()
        for c in clients:
            if c.is_alive():
                c.join(180)
        server.stop()
    failed = [r for r in results if "error" in r]
    assert not failed and len(results) >= 12, failed[:3]
    text = log.read_text()
    named = [line for line in text.splitlines() if f"{ledger.path} is not valid" in line]
    assert len(named) == 1, named
    assert f"KV memory ledger {ledger.path} can be used again" in text
    # Nothing is left behind: the server's entry, its page report and liveness lock go (the
    # CLI sweeps what the exited engine cores left), and the ledger with its last entry.
    _wait(lambda: ledger_cli(["list"]) == 0 and os.listdir(ledger.directory) == [], timeout=60)
