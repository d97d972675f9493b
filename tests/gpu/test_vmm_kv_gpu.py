"""VMM-backed KV memory (--kv-cache-memory-backend vmm) on CUDA: the CUDA VMM backend maps
device memory page by page under vLLM's own engine (tiny dummy-weight Llama, greedy)."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from bench_server import free_port

pytestmark = pytest.mark.gpu

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MAX_TOKENS = 8


def _series_has_vmm_kv() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    return hasattr(EngineArgs, "kv_cache_memory_backend")


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _prompts() -> list[dict]:
    batch = [[(7 * i + 3 * j) % 4000 + 1 for j in range(300 + 40 * i)] for i in range(8)]
    prefixed = [batch[0][:256] + [(13 * j) % 4000 + 1 for j in range(50)]]
    return [{"prompt_token_ids": p} for p in batch + prefixed]


def _worker_stats(worker) -> dict:
    mapper = worker.model_runner.kv_page_mapper
    return {} if mapper is None else mapper.stats()


def _generate(model: Path, backend: str, **kwargs) -> tuple[list[list[int]], list[dict]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=1024, max_num_seqs=8, seed=0,
              gpu_memory_utilization=0.3, enable_prefix_caching=True,
              kv_cache_memory_backend=backend, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
        ids = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts()[:8], params)]
        ids += [list(o.outputs[0].token_ids) for o in llm.generate(_prompts()[8:], params)]
        return ids, llm.collective_rpc(_worker_stats)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture
def gpu_model(tiny_llama: Path) -> Path:
    if not _series_has_vmm_kv():
        pytest.skip("this vLLM tree does not carry the VMM-backed KV cache patch")
    return tiny_llama


def test_vmm_token_ids_match_default_on_gpu(gpu_model: Path):
    ref, ref_stats = _generate(gpu_model, "default")
    ids, stats = _generate(gpu_model, "vmm")
    assert all(len(x) == MAX_TOKENS for x in ids)
    assert ids == ref
    assert ref_stats == [{}]
    assert stats[0]["kv_pages_mapped_total"] >= 2 and stats[0]["kv_mapped_bytes"] > 0


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_vmm_tensor_parallel_2_on_gpu(gpu_model: Path, executor: str):
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    if executor == "ray" and importlib.util.find_spec("ray") is None:
        pytest.skip("needs ray")
    if executor == "ray":
        # Ray's workers cannot import this test module: send _worker_stats by value.
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ref, _ = _generate(gpu_model, "default", tensor_parallel_size=2,
                       distributed_executor_backend=executor)
    ids, stats = _generate(gpu_model, "vmm", tensor_parallel_size=2,
                           distributed_executor_backend=executor)
    assert ids == ref
    assert len(stats) == 2
    assert stats[0]["kv_pages_mapped_total"] == stats[1]["kv_pages_mapped_total"] >= 2


def _http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_vmm_openai_server_tensor_parallel_2(gpu_model: Path, executor: str, tmp_path: Path):
    """`vllm serve` (the OpenAI API server) with TP=2 and --kv-cache-memory-backend vmm
    reaches /health 200, lists the model, answers a completion from prompt token ids, and
    reports the mapped KV pages on /metrics and on the page-limit endpoint."""
    import json
    import signal
    import subprocess
    import sys
    import time

    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs (TP=2)")
    if executor == "ray" and importlib.util.find_spec("ray") is None:
        pytest.skip("needs ray (pip install ray) for --distributed-executor-backend ray")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(gpu_model), "--load-format", "dummy", "--skip-tokenizer-init",
           "--tensor-parallel-size", "2", "--distributed-executor-backend", executor,
           "--kv-cache-memory-backend", "vmm", "--enforce-eager", "--max-model-len", "1024",
           "--gpu-memory-utilization", "0.3", "--host", "127.0.0.1", "--port", str(port)]
    # NVLink multicast off (NCCL_NVLS_ENABLE=0); the page-limit endpoint is a dev endpoint.
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "VLLM_SERVER_DEV_MODE": "1"}
    log_path = tmp_path / f"server-{executor}.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while _http(f"{base}/health", timeout=5)[0] != 200:
            if server.poll() is not None:
                pytest.fail(f"server exited with {server.returncode} before /health 200:\n"
                            + log_path.read_text(errors="replace")[-6000:])
            if time.monotonic() > deadline:
                pytest.fail("no /health 200 within 600 s:\n"
                            + log_path.read_text(errors="replace")[-6000:])
            time.sleep(2)

        status, body = _http(f"{base}/v1/models")
        assert status == 200, body
        model_ids = [m["id"] for m in json.loads(body)["data"]]
        assert model_ids == [str(gpu_model)]

        prompt = [(7 * j) % 4000 + 1 for j in range(300)]
        status, body = _http(f"{base}/v1/completions", {
            "model": model_ids[0], "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        assert status == 200, body
        completion = json.loads(body)
        assert completion["usage"]["completion_tokens"] == MAX_TOKENS
        assert len(completion["choices"][0]["token_ids"]) == MAX_TOKENS

        status, body = _http(f"{base}/metrics")
        assert status == 200
        mapped = [line for line in body.decode().splitlines()
                  if line.startswith("vllm:kv_cache_vmm_mapped_bytes{")]
        assert mapped and float(mapped[0].rsplit(" ", 1)[1]) > 0, mapped

        status, body = _http(f"{base}/kv_cache/page_limit?max_pages=4", {})
        assert status == 200, body
        pages = json.loads(body)
        assert pages["kv_page_limit"] == 4 and 1 <= pages["kv_pages_mapped"] <= 4
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


# The throughput ratio VMM/stock on realistic configs is measured by `make bench`
# (scripts/bench/bench.py, item 1: interleaved A/B pairs, results in docs/BENCHMARKS.md), not
# asserted here.
