#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end time to first token of prefill/decode disaggregation over NixlConnector.

Two `vllm serve` instances on one host, the prefill instance on GPU 0 and the decode
instance on GPU 1 (``--device cpu``: each on half of the CPUs, KV in host memory), both
with the same --kv-cache-memory-backend. Each request goes the way a disaggregating proxy
sends it: to the prefill instance with max_tokens=1 and
``kv_transfer_params={"do_remote_decode": true, ...}``, then, with the transfer params that
come back, to the decode instance, which reads the prompt's KV from the prefill instance's
GPU over NIXL and produces the first token. TTFT is the wall time of both requests, one
request at a time, after one untimed request (the NIXL handshake).

Writes ``{"ttft_ms": median, "ttft_ms_runs": [...], ...}`` to --json, with the decode
instance's reads as NixlConnector timed them over the timed requests (``decode_nixl``: mean
transfer and post ms per read, from its /metrics); scripts/bench/bench.py (item 5) runs it
once per A/B repetition.

Every wait has the deadline --timeout: an instance's start (to /health 200) and each request.
When an instance ends, fails a request or does not answer in time, the run ends at once with
the requests measured so far, then which instance failed, how, whether it still runs and the
last lines of its log; exit status 1, no --json.

  python scripts/bench/bench_pd.py --backend vmm --model <config dir> --json /tmp/pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proc import TAIL_LINES, describe_exit, exit_on_signals, tail  # noqa: E402
from bench_server import Server, fetch_metrics, free_port, metric_samples  # noqa: E402

# NixlConnector's prefill-side request fields, as a disaggregating proxy sends them.
PREFILL_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                           "remote_engine_id": None, "remote_block_ids": None,
                           "remote_host": None, "remote_port": None}


class InstanceFailed(Exception):
    """An instance ended, failed a request, or did not answer in time."""

    def __init__(self, role: str, server: Server, what: str) -> None:
        self.role, self.server = role, server
        super().__init__(f"{role} instance: {what}")

    def report(self) -> str:
        """The error, whether the instance still runs, and its log's last lines."""
        # A server that broke the connection is usually on its way out: give it a moment,
        # so that the report says how it ended.
        deadline = time.monotonic() + 2
        while self.server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = [f"{self} ({describe_exit(self.server.proc.poll())})",
                 f"--- last lines of {self.server.log}:"]
        return "\n".join(lines + [f"  {line}" for line in tail(self.server.log, TAIL_LINES)])


def _post(server: Server, role: str, body: dict, timeout: float) -> dict:
    """POST /v1/completions to one instance; InstanceFailed if it is not running, or the
    request fails or gets no answer within ``timeout`` seconds."""
    if server.proc.poll() is not None:
        raise InstanceFailed(role, server, "ended before the request")
    req = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        raise InstanceFailed(role, server, f"HTTP {e.code}: {detail}") from None
    except (TimeoutError, urllib.error.URLError) as e:
        if not isinstance(e, TimeoutError) and not isinstance(e.reason, TimeoutError):
            raise InstanceFailed(role, server, f"request failed: {e.reason!r}") from None
        raise InstanceFailed(role, server, f"no answer in {timeout:g} s (--timeout)") from None
    except (OSError, ValueError) as e:  # connection refused or reset, a reply not JSON
        raise InstanceFailed(role, server, f"request failed: {e!r}") from None


def first_token(prefill: Server, decode: Server, model: str, prompt: list[int],
                timeout: float) -> tuple[float, float]:
    """Seconds until the decode instance answers with the first token, and of those the
    seconds the prefill instance took."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True, "stream": False}
    t0 = time.perf_counter()
    done = _post(prefill, "prefill", {**body, "kv_transfer_params": PREFILL_TRANSFER_PARAMS},
                 timeout)
    prefill_s = time.perf_counter() - t0
    params = done.get("kv_transfer_params")
    if not params:
        raise InstanceFailed("prefill", prefill, f"returned no kv_transfer_params: {done}")
    out = _post(decode, "decode", {**body, "kv_transfer_params": params}, timeout)
    seconds = time.perf_counter() - t0
    if out.get("usage", {}).get("completion_tokens") != 1:
        raise InstanceFailed("decode", decode, f"answered {out.get('usage', out)}")
    return seconds, prefill_s


NIXL_TIMES = {"xfer": "vllm:nixl_xfer_time_seconds", "post": "vllm:nixl_post_time_seconds"}
"""NixlConnector's histograms of each read's transfer time (posted to done) and post time."""


def nixl_totals(server: Server) -> dict[str, tuple[float, float]]:
    """(sum in seconds, count) of each of :data:`NIXL_TIMES` on ``server``'s /metrics; zeros
    where it has none (no /metrics, or no read flushed into it yet)."""
    text = fetch_metrics(server) or ""
    return {key: (sum(v for _, v in metric_samples(text, (name + "_sum",))),
                  sum(v for _, v in metric_samples(text, (name + "_count",))))
            for key, name in NIXL_TIMES.items()}


def nixl_means(before: dict, after: dict) -> dict:
    """Mean ms per read of each of :data:`NIXL_TIMES` between two :func:`nixl_totals`, and
    how many reads that is (the connector's stats reach /metrics a step late, so the last
    read may be missing); empty where no read was counted."""
    reads = after["xfer"][1] - before["xfer"][1]
    if reads <= 0:
        return {}
    return {"reads": int(reads)} | {
        f"{key}_ms": (after[key][0] - before[key][0]) * 1000 / (after[key][1] - before[key][1])
        for key in NIXL_TIMES if after[key][1] > before[key][1]}


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, no more of them than its cgroup's CPU quota
    (cpu.max) pays for: a container limited to 2 CPUs of a larger host sees all of the
    host's CPUs in its affinity mask, and OpenMP threads bound to each of them would spin
    in turn on the quota, starving every other thread of the instance."""
    cpus = sorted(os.sched_getaffinity(0))
    cgroup = Path("/sys/fs/cgroup")
    try:
        if (cgroup / "cpu.max").exists():  # cgroup v2
            quota, period = (cgroup / "cpu.max").read_text().split()
        else:  # cgroup v1
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        if quota not in ("max", "-1"):
            cpus = cpus[:max(1, -(-int(quota) // int(period)))]
    except (OSError, ValueError):
        pass
    return cpus


def cpu_halves() -> tuple[list[int], list[int]]:
    """Two disjoint halves of the usable CPUs (the same one twice on a single CPU)."""
    cpus = usable_cpus()
    half = max(1, len(cpus) // 2)
    return cpus[:half], cpus[half:] or cpus[:half]


def cpu_half(role: str) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for one of two instances on this host's CPUs: the prefill
    instance's workers on the first half, the decode's on the second. Two instances whose
    OpenMP threads spin on the same cores starve each other's NIXL progress (on two cores,
    reads then took minutes)."""
    first, second = cpu_halves()
    return ",".join(map(str, first if role == "prefill" else second))


def instance_env(device: str, role: str) -> dict[str, str]:
    """Per instance: its own GPU, or on CPU its own half of the cores and UCX over the
    loopback."""
    if device == "cuda":
        return {"CUDA_VISIBLE_DEVICES": "0" if role == "prefill" else "1"}
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": cpu_half(role),
            "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["default", "vmm"], required=True)
    p.add_argument("--model", required=True, help="model config directory (dummy weights)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--requests", type=int, default=24, help="timed requests (default 24)")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--vmm-args", metavar="JSON", default="{}",
                   help="engine arguments of both instances with --backend vmm")
    p.add_argument("--logs", type=Path, default=None, help="server logs (default: beside --json)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds an instance may take to start, and to answer each request "
                   "(default 600)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: both instances on this host's CPUs, KV in host memory "
                   "(checks the flow; the figures are for GPUs)")
    args = p.parse_args()
    exit_on_signals()  # SIGTERM: the servers are stopped on the way out

    logs = args.logs or args.json.parent
    logs.mkdir(parents=True, exist_ok=True)
    transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    engine: dict = {"max_model_len": args.prompt_len + 16, "enforce_eager": True}
    if args.device == "cuda":
        engine |= {"gpu_memory_utilization": 0.85, "kv_transfer_config": transfer}
    else:
        engine |= {"kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4,
                   "kv_transfer_config": {**transfer, "kv_buffer_device": "cpu"}}
    if args.backend == "vmm":
        engine |= json.loads(args.vmm_args)
    base_env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    servers: dict[str, Server] = {}
    runs: list[float] = []
    prefill_runs: list[float] = []
    try:
        # One instance after the other: a port picked as free for one instance's NIXL side
        # channel could otherwise be taken by the other instance's own sockets before the
        # first binds it ("Address already in use"); once an instance is healthy, its
        # ports are bound.
        for role in ("decode", "prefill"):
            server = servers[role] = Server(
                args.model, args.backend, engine, logs / f"pd-{args.backend}-{role}.log",
                base_env, env={**instance_env(args.device, role),
                               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
            health = server.wait_healthy(args.timeout)
            if "error" in health:
                if server.proc.poll() is not None:
                    what = "ended while starting"
                elif "dead_thread" in health:
                    what = f"a thread died while starting: {health['dead_thread']}"
                else:
                    what = f"not healthy in {args.timeout:g} s (--timeout)"
                raise InstanceFailed(role, server, what)
        prefill, decode = servers["prefill"], servers["decode"]
        for i in range(args.requests + 1):
            prompt = [(7919 * i + 13 * j) % 3000 + 100 for j in range(args.prompt_len)]
            seconds, prefill_s = first_token(prefill, decode, args.model, prompt,
                                             args.timeout)
            if i:  # the first request also makes the NIXL handshake
                runs.append(seconds * 1000)
                prefill_runs.append(prefill_s * 1000)
            else:
                nixl_before = nixl_totals(decode)
            print(f"request {i}: {seconds * 1000:.1f} ms (prefill instance "
                  f"{prefill_s * 1000:.1f} ms)", flush=True)
        decode_reads = nixl_means(nixl_before, nixl_totals(decode))
    except InstanceFailed as e:
        if runs:
            print(f"measured before the failure: {len(runs)} timed request(s), TTFT median "
                  f"{statistics.median(runs):.1f} ms (runs: "
                  f"{', '.join(f'{ms:.1f}' for ms in runs)})", flush=True)
        print(f"error: {e.report()}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        for server in servers.values():
            server.stop()
    # Each TTFT split into the prefill instance's part (its prefill, and mapping pages and
    # publishing registrations with VMM-backed KV) and the decode instance's (the read of
    # the prompt's KV and the first decode step).
    result = {"ttft_ms": statistics.median(runs), "ttft_ms_runs": runs,
              "prefill_ms_runs": prefill_runs,
              "decode_ms_runs": [t - p for t, p in zip(runs, prefill_runs)],
              "backend": args.backend, "prompt_len": args.prompt_len, "engine": engine,
              # The decode instance's reads as its connector timed them: where the decode
              # part's time goes (the read, or the steps around it).
              "decode_nixl": decode_reads}
    if args.backend == "vmm":
        # Whether the decode instance read the prefill's VMM KV over the same-host path
        # (its connector logs it when the channel opens) or through NIXL/UCX.
        log = (logs / f"pd-{args.backend}-decode.log").read_text(errors="replace")
        result["same_host"] = "use the same-host path" in log
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("backend", "ttft_ms", "decode_nixl")}))


if __name__ == "__main__":
    main()
