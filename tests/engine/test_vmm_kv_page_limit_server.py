"""The KV page limit of a real OpenAI server (vLLM 0.32.0, CPU, TP=2, --kv-cache-memory-backend
vmm with a device ledger): one unit for every byte figure, and the dev-mode route's answers.

Both ranks of a TP=2 CPU engine live on the host backend's one device ("host"): a byte figure
is bytes of that device, both ranks' shares together, the unit the host ledger counts in. The
same number of bytes must give the same page limit through --kv-cache-vmm-limit-bytes, POST
/kv_cache/page_limit?max_bytes= and the ledger CLI, and /metrics shows it back in that unit.

POST /kv_cache/page_limit (VLLM_SERVER_DEV_MODE=1) asks for --api-key: without it or with a
wrong one it answers 401 and the limit stays; bad values are a 400 with the reason; a limit
beyond the KV cache's capacity is lowered to it (200, the counters show the limit in force, the
server logs a warning).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

API_KEY = "units-test-key"
# 41 MiB: a few pages of the tiny model's KV memory on the host device, not a whole number.
LIMIT = 41 << 20
MAX_TOKENS = 4


def _request(server, method: str, path: str, key: str | None = None,
             body: dict | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url(path), data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _set_limit(server, query: str, key: str | None = API_KEY) -> tuple[int, dict | str]:
    return _request(server, "POST", f"/kv_cache/page_limit?{query}", key)


def _metrics(server) -> dict[str, float]:
    """engine 0's VMM KV gauges, as /metrics shows them (once the stat logger recorded a
    step)."""
    deadline = time.monotonic() + 30
    while True:
        status, text = _request(server, "GET", "/metrics")
        assert status == 200
        values = {}
        for line in str(text).splitlines():
            if line.startswith("vllm:kv_cache_vmm_") and 'engine="0"' in line:
                name = line.split("{", 1)[0]
                values[name] = float(line.rsplit(" ", 1)[1])
        if values.get("vllm:kv_cache_vmm_page_limit") or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def _step(server) -> None:
    """One short completion: the engine steps, reads its ledger and records its stats."""
    body = {"model": server.model, "prompt": [1, 2, 3, 4, 5], "max_tokens": MAX_TOKENS,
            "temperature": 0.0}
    status, answer = _request(server, "POST", "/v1/completions", API_KEY, body)
    assert status == 200, answer


def _ledger_entry(ledger_dir: Path):
    from vllm.v1.kv_vmm.ledger import KVMemoryLedger

    state = KVMemoryLedger("host", directory=str(ledger_dir)).read()
    assert state is not None
    (entry,) = state.entries
    return entry


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bench_server import Server
    from tiny_model import make_tiny_model

    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on CPU needs 2 cores")
    tmp = tmp_path_factory.mktemp("page-limit")
    # 4 KV heads: the KV memory is several pages of 2 MiB per rank.
    model = make_tiny_model(tmp / "tiny-llama", num_key_value_heads=4)
    ledger_dir = tmp / "ledger"
    ledger_dir.mkdir()
    engine = {"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 4,
              "kv_cache_memory_bytes": 64 << 20, "kv_cache_vmm_shared": True,
              "kv_cache_vmm_limit_bytes": LIMIT, "kv_cache_vmm_shrink_delay": 0,
              "api_key": API_KEY, "disable_log_stats": False}
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "VLLM_KV_VMM_LEDGER_DIR": str(ledger_dir), "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "PYTHONUNBUFFERED": "1"}
    base_env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    srv = Server(str(model), "vmm", engine, tmp / "server.log", base_env, env=env, tp=2)
    srv.model = str(model)
    srv.ledger_dir = ledger_dir
    try:
        health = srv.wait_healthy(600)
        if "error" in health:
            pytest.fail(f"{health['error']}:\n{(tmp / 'server.log').read_text()[-4000:]}")
        yield srv
    finally:
        srv.stop()


def test_one_byte_unit_for_the_flag_the_route_the_ledger_and_the_metrics(server):
    from vllm.v1.kv_vmm.ledger_cli import main as ledger_cli

    # --kv-cache-vmm-limit-bytes: the limit the engine started with.
    _step(server)
    started = _metrics(server)
    flag_pages = int(started["vllm:kv_cache_vmm_page_limit"])
    page = int(started["vllm:kv_cache_vmm_limit_bytes"]) // flag_pages
    assert flag_pages * page == started["vllm:kv_cache_vmm_limit_bytes"]
    assert flag_pages == LIMIT // page >= 2
    entry = _ledger_entry(server.ledger_dir)
    assert entry.limit_bytes == flag_pages * page
    assert started["vllm:kv_cache_vmm_mapped_bytes"] == (
        started["vllm:kv_cache_vmm_mapped_pages"] * page)

    # POST /kv_cache/page_limit?max_bytes=: the same bytes, the same pages.
    status, counters = _set_limit(server, "max_pages=1")
    assert status == 200 and counters["kv_page_limit"] == 1
    status, counters = _set_limit(server, f"max_bytes={LIMIT}")
    assert status == 200, counters
    assert counters["kv_page_bytes"] == page
    assert counters["kv_page_limit"] == flag_pages
    assert counters["kv_limit_bytes"] == flag_pages * page
    assert _ledger_entry(server.ledger_dir).limit_bytes == flag_pages * page

    # The ledger CLI: the same bytes on the host device, the same pages at the next step.
    assert _set_limit(server, "max_pages=1")[0] == 200
    args = ["set", entry.id, "--key", "host", "--limit-bytes", str(LIMIT)]
    assert ledger_cli(args, str(server.ledger_dir)) == 0
    deadline = time.monotonic() + 60
    while True:
        _step(server)
        shown = _metrics(server)
        if shown["vllm:kv_cache_vmm_page_limit"] == flag_pages or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert shown["vllm:kv_cache_vmm_page_limit"] == flag_pages
    assert shown["vllm:kv_cache_vmm_limit_bytes"] == flag_pages * page


@pytest.mark.parametrize("key", [None, "wrong"], ids=["no-key", "wrong-key"])
def test_the_route_needs_the_api_key(server, key):
    before = _ledger_entry(server.ledger_dir).limit_bytes
    status, answer = _set_limit(server, "max_pages=1", key=key)
    assert status == 401, answer
    assert _ledger_entry(server.ledger_dir).limit_bytes == before
    # The right key changes it.
    status, counters = _set_limit(server, "max_pages=1")
    assert status == 200 and counters["kv_page_limit"] == 1
    assert _ledger_entry(server.ledger_dir).limit_bytes == counters["kv_limit_bytes"]
    assert _set_limit(server, f"max_bytes={LIMIT}")[0] == 200


@pytest.mark.parametrize("query, message", [
    ("max_pages=-1", "max_pages must be at least 1"),
    ("max_pages=0", "max_pages must be at least 1"),
    ("max_bytes=0", "max_bytes must be at least 1"),
    ("max_bytes=-5", "max_bytes must be at least 1"),
    ("", "not neither"),
    ("max_pages=2&max_bytes=4G", "not both"),
    ("max_pages=two", "max_pages must be a whole number of pages"),
    ("max_pages=1.5", "max_pages must be a whole number of pages"),
    ("max_bytes=1.5G", "max_bytes must be a size in bytes per device"),
    ("max_bytes=1000", "less than one page"),
])
def test_bad_values_are_a_400_with_the_reason(server, query, message):
    before = _ledger_entry(server.ledger_dir).limit_bytes
    status, answer = _set_limit(server, query)
    assert status == 400, answer
    assert message in answer["error"]
    assert _ledger_entry(server.ledger_dir).limit_bytes == before


def test_a_limit_beyond_the_capacity_is_lowered_to_it(server):
    status, counters = _set_limit(server, "max_bytes=1T")
    assert status == 200, counters
    capacity = counters["kv_page_capacity"]
    assert counters["kv_page_limit"] == capacity
    assert counters["kv_limit_bytes"] == counters["kv_capacity_bytes"] == (
        capacity * counters["kv_page_bytes"])
    assert _ledger_entry(server.ledger_dir).limit_bytes == counters["kv_capacity_bytes"]
    # Human-readable sizes as the flag takes them: 1T is 2^40 bytes.
    log = server.log.read_text()
    assert f"KV page limit of {(1 << 40) // counters['kv_page_bytes']} pages is beyond" in log
    status, counters = _set_limit(server, f"max_pages={capacity * 100}")
    assert status == 200 and counters["kv_page_limit"] == capacity
    assert _set_limit(server, f"max_bytes={LIMIT}")[0] == 200
