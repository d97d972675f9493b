# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefill/decode disaggregation through NixlConnector between two real vLLM instances on CPU.

A prefill instance and a decode instance (each its own process tree, vLLM's engine core and
CPU worker, dummy weights) exchange KV through real NIXL agents over UCX on the loopback, with
the KV cache in host memory (kv_buffer_device="cpu"). No proxy: the prefill instance runs each
prompt with max_tokens=1 and hands its kv_transfer_params to the decode instance. The decode's
token ids must equal a single instance's, and the decode must have taken the prompt's KV from
the prefill instance (kv_load_failure_policy is "fail", and the prompt tokens count as
externally computed).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

nixl = pytest.importorskip("nixl", reason="NixlConnector needs the nixl package")

import nixl_pd_node as node  # noqa: E402
from bench_pd import cpu_half  # noqa: E402

MAX_TOKENS = 6
TIMEOUT = 600
NODE_ARGS = ["--max-tokens", str(MAX_TOKENS)]
# The CPU backend's block size; K and V of 2 layers x 4 KV heads x 64 dims in bfloat16.
BLOCK_SIZE = 128
BLOCK_KV_BYTES = 2 * 2 * 4 * 64 * 2 * BLOCK_SIZE


def _prompts() -> list[list[int]]:
    """A short prompt, two mid-sized ones and one of 3500 tokens: 28 blocks of 128 tokens,
    more than one VMM page (16 blocks) holds. The second wave (700 + 3500 tokens, 34
    blocks) needs more than the 31 usable blocks of the two pages mapped at startup."""
    lengths = [37, 300, 700, 3500]
    return [[(7 * i + 13 * j) % 4000 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def _env(role: str = "single") -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if role in ("prefill", "decode"):
        # Two instances share the machine: each worker's OpenMP threads on its own half.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_half(role))
    # UCX between two processes of one host over the loopback.
    env.setdefault("UCX_TLS", "tcp,self,sm")
    env.setdefault("UCX_NET_DEVICES", "lo")
    return env


def run_single(model: Path, workdir: Path, backend: str = "default") -> dict:
    return node.run_single(model, workdir, _prompts(), _env(), NODE_ARGS, backend,
                           timeout=TIMEOUT)


def run_disaggregated(model: Path, workdir: Path, backend: str,
                      prefill_extra: dict | None = None,
                      decode_extra: dict | None = None,
                      connector_extra: dict | None = None) -> tuple[dict, dict]:
    args = [*NODE_ARGS, "--connector-extra", json.dumps(connector_extra or {})]
    return node.run_disaggregated(model, workdir, _prompts(), backend, _env, args,
                                  prefill_extra, decode_extra, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def pd_model(tmp_path_factory) -> Path:
    from tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", num_key_value_heads=4)


@pytest.fixture(scope="module")
def reference(pd_model, tmp_path_factory) -> list[list[int]]:
    return run_single(pd_model, tmp_path_factory.mktemp("single"))["token_ids"]


def _check(reference: list[list[int]], prefill: dict, decode: dict) -> None:
    full_blocks = sum(len(p) // BLOCK_SIZE for p in _prompts())
    node.check_disaggregated(reference, prefill, decode, MAX_TOKENS,
                             full_blocks * BLOCK_KV_BYTES,
                             min_loaded_tokens=node.full_block_tokens(_prompts(), BLOCK_SIZE))


def _check_same_host(decode: dict, workdir: Path) -> None:
    """Every full block of every prompt came over the same-host path. One exception, said
    as a warning: a channel whose first handshake did not finish in time (two instances
    starting on two cores): the prefill instance did not answer the decode instance in
    time (counted as timeouts), or gave up waiting for the decode instance's proof and
    closed the channel (counted as busy); then the first wave's reads went through
    NIXL/UCX, the channel opened on its retry, and every full block of the second wave
    came over it."""
    prompts = _prompts()
    same_host, why = node.same_host_reads(decode, workdir)
    late = same_host.get("fallbacks_timeout", 0) + same_host.get("fallbacks_busy", 0)
    if not late:
        full_blocks = sum(len(p) // BLOCK_SIZE for p in prompts)
        node.check_same_host_reads(decode, workdir, full_blocks * BLOCK_KV_BYTES)
        assert decode["nixl"][-1].get("vllm:nixl_num_same_host_fallbacks", 0) == 0
        return
    warnings.warn(f"the same-host channel opened late ({late} busy or timed out): {why}",
                  stacklevel=2)
    assert same_host["fallbacks"] == late, f"{same_host}\n{why}"
    assert same_host["channels"] >= 1 and same_host["failed"] == 0, f"{same_host}\n{why}"
    lo, hi = node.waves(len(prompts))[-1]
    second_wave = sum(len(p) // BLOCK_SIZE for p in prompts[lo:hi]) * BLOCK_KV_BYTES
    before = decode["stats"][-2][0].get("same_host", {}).get("bytes", 0)
    assert same_host["bytes"] - before >= second_wave, f"{same_host}\n{why}"


def test_disaggregated_stock_kv_matches_single_instance(pd_model, reference, tmp_path):
    prefill, decode = run_disaggregated(pd_model, tmp_path, "default")
    _check(reference, prefill, decode)
    # Stock KV: nothing to share, every read went through NIXL/UCX.
    same_host, why = node.same_host_reads(decode, tmp_path)
    assert same_host.get("reads", 0) == 0, f"{same_host}\n{why}"


def test_disaggregated_vmm_kv_matches_single_instance(pd_model, reference, tmp_path):
    """VMM-backed KV on both instances. Each starts with the null block's page and one
    headroom page mapped. The second wave (prefilled after the decode instance's handshake)
    needs more: the prefill instance maps new segments whose registrations the decode
    instance has not seen, and the decode instance maps new segments while it runs; both
    give pages back when idle."""
    prefill, decode = run_disaggregated(pd_model, tmp_path, "vmm")
    _check(reference, prefill, decode)
    # Same host: the prefill instance shared its chunks, and every prompt's KV came as
    # local copies out of them, none through UCX and none failed.
    _check_same_host(decode, tmp_path)
    # The prefill instance mapped pages while prefilling the second wave: the requests
    # it finished then tell the decode instance that its registrations changed.
    second = json.loads((tmp_path / "params1.json").read_text())
    assert max(t.get("remote_registration_epoch", 0) for t in second) >= 1
    for side in (prefill, decode):
        start, after_first, after_second = [s[0] for s in side["stats"]]
        assert after_first["kv_pages_mapped_total"] == start["kv_pages_mapped_total"]
        assert after_second["kv_pages_mapped_total"] > after_first["kv_pages_mapped_total"]
        assert after_second["kv_mapped_bytes_peak"] >= 3 * start["page_bytes"]


# Slow: VMM segments through NIXL/UCX with their registration events are a unit test
# (test_nixl_transfer.py::test_nixl_transfer_host_segments); CI keeps the two main pairs.
@pytest.mark.slow
def test_disaggregated_vmm_kv_through_ucx_with_the_same_host_path_off(pd_model, reference,
                                                                     tmp_path):
    """VMM-backed KV on both instances, kv_connector_extra_config {"vmm_same_host": false}:
    every read goes through NIXL/UCX (as between hosts), against the registrations of the
    prefill instance's mapped segments, fetched again when the second wave mapped more."""
    prefill, decode = run_disaggregated(pd_model, tmp_path, "vmm",
                                        connector_extra={"vmm_same_host": False})
    _check(reference, prefill, decode)
    same_host, why = node.same_host_reads(decode, tmp_path)
    assert same_host["channels"] == 0 and same_host["reads"] == 0, f"{same_host}\n{why}"
    second = json.loads((tmp_path / "params1.json").read_text())
    assert max(t.get("remote_registration_epoch", 0) for t in second) >= 1
    assert "same-host" not in (tmp_path / "decode.log").read_text()


# Slow: UCX reads of VMM memory are CI's same-host-off case; the fallback count is a unit test
# (test_transfers.py).
@pytest.mark.slow
def test_disaggregated_stock_prefill_vmm_decode_reads_through_ucx(pd_model, reference,
                                                                 tmp_path):
    """A mixed pair: the stock prefill instance has no VMM chunks to share. The VMM decode
    instance finds no same-host channel, says why once, and reads through NIXL/UCX."""
    prefill, decode = run_disaggregated(pd_model, tmp_path, ("default", "vmm"))
    _check(reference, prefill, decode)
    same_host, why = node.same_host_reads(decode, tmp_path)
    assert same_host["channels"] == 0 and same_host["reads"] == 0, f"{same_host}\n{why}"
    log = (tmp_path / "decode.log").read_text()
    assert "go through NIXL/UCX (unshared): no same-host channel" in log
    # Counted in the connector's metrics, by reason.
    assert decode["nixl"][-1].get("vllm:nixl_num_same_host_fallbacks", 0) >= 1


# Slow: the same mixed pair runs in tests/gpu/test_nixl_pd_gpu.py on a GPU host; the same-host
# reads are CI's VMM pair.
@pytest.mark.slow
def test_disaggregated_vmm_prefill_stock_decode_reads_through_shared_memory(pd_model, reference,
                                                                            tmp_path):
    """The other mixed pair: a VMM prefill instance shares its chunks and the stock decode
    instance reads every prompt's KV as local copies out of them into its stock KV tensors
    (NIXL could not even prepare descriptors over the prefill instance's unmapped pages).
    The second wave's new chunks reach the decode instance over the same channel."""
    prefill, decode = run_disaggregated(pd_model, tmp_path, ("vmm", "default"))
    _check(reference, prefill, decode)
    _check_same_host(decode, tmp_path)
    second = json.loads((tmp_path / "params1.json").read_text())
    assert max(t.get("remote_registration_epoch", 0) for t in second) >= 1
