# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One vLLM instance of the prefill/decode disaggregation test (NixlConnector).

Roles:
- ``single``: generates every prompt alone (the reference).
- ``prefill``: per wave of prompts, generates each with max_tokens=1 and
  ``kv_transfer_params={"do_remote_decode": True}``, writes the returned
  transfer params to ``<dir>/params<wave>.json`` and waits (KV blocks held)
  until ``<dir>/decode<wave>.done`` appears.
- ``decode``: per wave, waits for ``params<wave>.json``, generates each prompt
  with the prefill's params (NIXL reads the prompt's KV from the prefill
  instance over UCX), then writes ``decode<wave>.done``.

Every role writes ``<dir>/<role>.json``: token ids per prompt, plus the
worker's KV page stats when the KV memory backend is ``vmm``.

Each instance is a separate OS process with its own engine core and worker;
they meet only through the NIXL side channel (ZMQ on localhost) and UCX.

The same flow runs on CPU (KV in host memory) and on CUDA (KV in device
memory, one GPU per instance): ``run_single`` and ``run_disaggregated`` start
the instances as subprocesses with the environment the caller gives.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Page stats are read from the worker through collective_rpc with a function.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


#: KV lease of the prefill instance (NixlConnector's kv_lease_duration), seconds.
LEASE_S = 600


def _worker_stats(worker) -> dict:
    mapper = getattr(worker.model_runner, "kv_page_mapper", None)
    stats = {} if mapper is None else {**mapper.stats(), "page_bytes": mapper.page_bytes}
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.stats import (
            same_host_stats,
        )
    except ImportError:  # a vLLM without the same-host path
        return stats
    # Reads of VMM-backed peers' KV on this host done as local copies (this worker).
    return {**stats, "same_host": same_host_stats()}


def _nixl_metrics(llm) -> dict[str, float]:
    """NixlConnector's Prometheus metrics of this instance, and the tokens the connector
    loaded (``vllm:external_prefix_cache_*``): counters by value, histograms by sum and
    count."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith(("vllm:nixl", "vllm:external_prefix_cache")):
            continue
        if hasattr(m, "sum"):
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0) + m.sum
            out[m.name + ":count"] = out.get(m.name + ":count", 0) + m.count
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def waves(n: int) -> list[tuple[int, int]]:
    """Prompts go in two waves: the second is prefilled after the decode instance
    read the first (so after the handshake) and needs more KV pages on both."""
    half = max(1, n // 2)
    return [(0, half), (half, n)] if n > 1 else [(0, n)]


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("single", "prefill", "decode"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--backend", default="default")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-bytes", type=int, default=64 << 20)
    parser.add_argument("--kv-buffer-device", default="cpu",
                        help="where NIXL reads and writes the KV cache: cpu or cuda")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--extra", default="{}", help="JSON of extra LLM kwargs")
    parser.add_argument("--connector-extra", default="{}",
                        help="JSON of extra kv_connector_extra_config entries")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    prompts = json.loads((args.dir / "prompts.json").read_text())
    kwargs = dict(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        seed=0,
        kv_cache_memory_bytes=args.kv_bytes,
        # Every prompt token must come through NIXL, not from a local cache hit.
        enable_prefix_caching=False,
        kv_cache_memory_backend=args.backend,
        # The decode instance reports NIXL transfer metrics (bytes read from the prefill).
        disable_log_stats=False,
        **json.loads(args.extra),
    )
    # 1024 tokens per step on every instance (the single-instance reference included, so
    # all schedule alike): a step then allocates at most 16 blocks (8 + one per request),
    # one VMM page, so what a VMM instance keeps mapped ahead of demand is its headroom page
    # and the first wave fits in the pages mapped at startup.
    kwargs.setdefault("max_num_batched_tokens", 1024)
    if args.backend == "vmm":
        # Pages go back as soon as a wave is done, so the next wave maps (and the prefill
        # registers) segments the other instance has not seen.
        kwargs.setdefault("kv_cache_vmm_shrink_delay", 0)
    if args.role != "single":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
            kv_buffer_device=args.kv_buffer_device,
            # The prefill instance keeps a finished request's blocks for the decode
            # instance until it reports the read done, or for this many seconds. A busy
            # test machine can take longer than the default 30 s between the two; an
            # expired lease frees the blocks (with VMM-backed KV, possibly their pages
            # too) and the read then fails by design, which is not what this checks.
            kv_connector_extra_config={"kv_lease_duration": LEASE_S,
                                       **json.loads(args.connector_extra)},
        )
    llm = LLM(**kwargs)
    if args.role == "decode":
        # Up and connected to nothing yet: the prefill instance starts its first wave
        # only now, so no lease runs while this instance is still starting.
        (args.dir / "decode.ready").write_text("")
    try:
        out: dict = {"stats": [llm.collective_rpc(_worker_stats)]}
        if args.role == "single":
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                    detokenize=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            out["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        elif args.role == "prefill":
            _wait_for(args.dir / "decode.ready", timeout=600)
            out["token_ids"] = []
            for wave, (lo, hi) in enumerate(waves(len(prompts))):
                params = [
                    SamplingParams(
                        temperature=0.0, max_tokens=1, detokenize=False,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})
                    for _ in range(lo, hi)
                ]
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts[lo:hi]], params)
                out["token_ids"] += [list(o.outputs[0].token_ids) for o in outs]
                out["stats"].append(llm.collective_rpc(_worker_stats))
                tmp = args.dir / f"params{wave}.json.tmp"
                tmp.write_text(json.dumps([o.kv_transfer_params for o in outs]))
                tmp.rename(args.dir / f"params{wave}.json")
                # The decode instance reads our blocks; they stay allocated until
                # it reports each read done (or the lease expires).
                _wait_for(args.dir / f"decode{wave}.done", timeout=600)
        else:
            out["token_ids"] = []
            for wave, (lo, hi) in enumerate(waves(len(prompts))):
                _wait_for(args.dir / f"params{wave}.json", timeout=600)
                transfer = json.loads((args.dir / f"params{wave}.json").read_text())
                params = [
                    SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                   detokenize=False,
                                   extra_args={"kv_transfer_params": t})
                    for t in transfer
                ]
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts[lo:hi]], params)
                out["token_ids"] += [list(o.outputs[0].token_ids) for o in outs]
                # Tokens each request did not compute itself: with an empty local prefix
                # cache, the ones the connector loaded (reported per request, so unlike the
                # stat loggers' metrics never behind).
                out.setdefault("cached_tokens", []).extend(
                    o.num_cached_tokens or 0 for o in outs)
                out["stats"].append(llm.collective_rpc(_worker_stats))
                out.setdefault("nixl", []).append(_nixl_metrics(llm))
                (args.dir / f"decode{wave}.done").write_text("")
        (args.dir / f"{args.role}.json").write_text(json.dumps(out))
    finally:
        llm.llm_engine.engine_core.shutdown()


# -- driver: the test side --------------------------------------------------------------------

def _start(role: str, model: Path, workdir: Path, backend: str, env: dict[str, str],
           node_args: list[str]) -> subprocess.Popen:
    log = open(workdir / f"{role}.log", "w")
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, "--model", str(model),
         "--dir", str(workdir), "--backend", backend, *node_args],
        env=env, stdout=log, stderr=subprocess.STDOUT,
        # Its own process group: a failed run takes the engine core and worker along.
        start_new_session=True)


def _finish(procs: list[subprocess.Popen], workdir: Path, timeout: float) -> None:
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        if p.returncode != 0:
            role = p.args[p.args.index("--role") + 1]
            tail = (workdir / f"{role}.log").read_text()[-6000:]
            raise AssertionError(f"{role} instance exited with {p.returncode}:\n{tail}")


def _side_channel(env: dict[str, str], port: int) -> dict[str, str]:
    return {**env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def run_single(model: Path, workdir: Path, prompts: list[list[int]], env: dict[str, str],
               node_args: list[str], backend: str = "default",
               timeout: float = 600) -> dict:
    """One instance without a connector: the reference token ids."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    _finish([_start("single", model, workdir, backend, env, node_args)], workdir, timeout)
    return json.loads((workdir / "single.json").read_text())


def full_block_tokens(prompts: list[list[int]], block_size: int) -> list[int]:
    """Per prompt, the tokens of its full blocks that a decode instance loads rather than
    computes (the prompt's last token is always computed: it yields the next token)."""
    return [(len(p) - 1) // block_size * block_size for p in prompts]


def check_kv_loaded(decode: dict, min_tokens: list[int]) -> None:
    """The decode instance computed none of the prompts' full blocks itself (a pair whose
    transfer failed and that recomputed the prompt, vLLM's fallback, answers the same token
    ids). Two witnesses, either suffices: each request's `num_cached_tokens` (its tokens it
    did not compute; reported per request, so never behind, but vLLM 0.32 and later report
    the prefill instance's prefix-cache hits there for a remote prefill) covers its
    prompt's full blocks; or the decode's `vllm:external_prefix_cache_hits` (tokens the
    connector loaded; behind the transfers on vLLM 0.21.0's offline LLM) covers all of
    them. The decode's local prefix cache starts empty and the prompts share no block."""
    cached = decode.get("cached_tokens", [])
    assert len(cached) == len(min_tokens), (cached, min_tokens)
    short = [(i, got, want) for i, (got, want) in enumerate(zip(cached, min_tokens))
             if got < want]
    hits = decode["nixl"][-1].get("vllm:external_prefix_cache_hits", 0)
    assert not short or hits >= sum(min_tokens), (
        "the decode instance recomputed KV it should have loaded through the connector: "
        f"(request, tokens not computed, full-block tokens of its prompt) {short}, tokens "
        f"the connector loaded {hits:.0f} of {sum(min_tokens)}; connector metrics after "
        f"each wave: {decode['nixl']}")


def check_disaggregated(reference: list[list[int]], prefill: dict, decode: dict,
                        max_tokens: int, min_nixl_bytes: int,
                        nixl_metrics_complete: bool = True,
                        min_loaded_tokens: list[int] | None = None) -> None:
    """A prefill/decode pair answered like one instance and moved the prompts' KV through
    NIXL: every request's full blocks loaded, not recomputed (`min_loaded_tokens`, per
    request), at least `min_nixl_bytes` (K and V of every layer for every full block of
    every prompt), with no failed transfer. Where the release's NIXL metrics trail the
    transfers (`nixl_metrics_complete=False`), the per-request check says that the KV
    came through the connector, and the byte metric only that NIXL reported bytes."""
    assert all(len(ids) == max_tokens for ids in reference)
    # The prefill instance's one token is the first token of the full generation.
    assert [ids[:1] for ids in prefill["token_ids"]] == [ids[:1] for ids in reference]
    assert decode["token_ids"] == reference
    if min_loaded_tokens is not None:
        check_kv_loaded(decode, min_loaded_tokens)
    nixl = decode["nixl"][-1]
    # Created per engine when the stat logger starts, so present even at 0.
    assert "vllm:nixl_num_failed_transfers" in nixl, nixl
    assert nixl["vllm:nixl_num_failed_transfers"] == 0, nixl
    moved = nixl["vllm:nixl_bytes_transferred:sum"]
    if nixl_metrics_complete:
        assert moved >= min_nixl_bytes, (
            f"NIXL moved {moved:.0f} bytes, expected at least {min_nixl_bytes} (KV loaded "
            f"per request: {decode.get('cached_tokens')}); metrics after each wave: "
            f"{decode['nixl']}")
    else:
        # The byte metric may not have caught up: the per-request check above is the proof
        # that the KV came through the connector; the bytes are reported for the record.
        assert min_loaded_tokens is not None, "trailing metrics need the per-request check"
        print(f"NIXL bytes reported by the decode instance: {moved:.0f} (its metrics "
              f"trail the transfers; KV tokens loaded per request: "
              f"{decode.get('cached_tokens')})")


def same_host_reads(decode: dict, workdir: Path) -> tuple[dict[str, int], str]:
    """The decode worker's same-host read counters after the last wave, and the lines of
    both instances' logs that say why a channel opened or not (for assertion messages)."""
    lines = [f"{role}: {line.strip()}"
             for role in ("prefill", "decode")
             if (workdir / f"{role}.log").exists()
             for line in (workdir / f"{role}.log").read_text().splitlines()
             if "same-host" in line.lower() or "NIXL/UCX" in line]
    return decode["stats"][-1][0].get("same_host", {}), "\n".join(lines[-20:])


def check_same_host_reads(decode: dict, workdir: Path, min_bytes: int) -> None:
    """The decode instance read every prompt's KV (at least `min_bytes`) over a same-host
    channel as local copies out of the prefill instance's shared memory: none through UCX
    and none failed."""
    same_host, why = same_host_reads(decode, workdir)
    assert same_host.get("channels", 0) >= 1, f"{same_host}\n{why}"
    assert same_host["reads"] >= 1, f"{same_host}\n{why}"
    assert same_host["bytes"] >= min_bytes, f"{same_host}\n{why}"
    assert same_host["failed"] == 0 and same_host["fallbacks"] == 0, f"{same_host}\n{why}"


def run_disaggregated(model: Path, workdir: Path, prompts: list[list[int]],
                      backend: str | tuple[str, str],
                      env_of: Callable[[str], dict[str, str]], node_args: list[str],
                      prefill_extra: dict | None = None, decode_extra: dict | None = None,
                      timeout: float = 600) -> tuple[dict, dict]:
    """A prefill and a decode instance at once; ``env_of(role)`` is each one's environment
    (e.g. its GPU); ``backend`` is both instances' KV memory backend, or (prefill's,
    decode's). Returns both instances' reports."""
    # scripts/bench is on the tests' path (tests/conftest.py), not on the instances'.
    from bench_server import free_port

    backends = dict(zip(("prefill", "decode"),
                        (backend, backend) if isinstance(backend, str) else backend))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    procs = [
        _start(role, model, workdir, backends[role], _side_channel(env_of(role), free_port()),
               [*node_args, "--extra", json.dumps(extra or {})])
        for role, extra in (("prefill", prefill_extra), ("decode", decode_extra))
    ]
    _finish(procs, workdir, timeout)
    return (json.loads((workdir / "prefill.json").read_text()),
            json.loads((workdir / "decode.json").read_text()))


if __name__ == "__main__":
    main()
