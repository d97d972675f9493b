"""scripts/bench/bench_pd.py ends at once when an instance fails: the requests measured before
are printed, then which instance failed, how, whether it still runs and its log's last lines;
exit status 1.

The instances here are a stand-in for `vllm serve` (a small HTTP server answering /health
and /v1/completions the way the P/D flow expects, as `vllm.entrypoints.openai.api_server` on
PYTHONPATH and KVSERIES_VLLM_TREE): a real server cannot be made to die or stall at a
chosen request, and needs the engine tier (tests/engine/test_bench_pd.py runs the flow with
real servers, marked slow). bench_pd.py itself, its server processes and HTTP are real.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from own_session import run_in_own_session

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "bench_pd.py"

# What FAKE_SERVE says, per role: "start-fail", "thread-dies", "die-at:N" or "stall-at:N" (at
# the N-th completion request, counting from 0), else it answers. The role is in its log's
# name.
STAND_IN = r'''
import http.server, json, os, sys, time

port = int(sys.argv[sys.argv.index("--port") + 1])
role = "prefill" if "prefill" in os.path.basename(os.readlink("/proc/self/fd/1")) else "decode"
plan = dict(e.split("=", 1) for e in os.environ.get("FAKE_SERVE", "").split(",") if e)
action = plan.get(role, "")
print(f"stand-in {role} server on port {port}: {action or 'answers'}", flush=True)
if action == "start-fail":
    print("RuntimeError: Engine core initialization failed (stand-in)", flush=True)
    sys.exit(1)
if action == "thread-dies":
    # As vLLM's engine core when NixlConnector's handshake listener cannot bind its port:
    # the thread dies, the engine waits for it, the server neither answers nor ends.
    print("(EngineCore pid=1) Exception in thread nixl_handshake_listener:", flush=True)
    print("(EngineCore pid=1) zmq.error.ZMQError: Address already in use (stand-in)",
          flush=True)
    time.sleep(3600)
count = 0


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path != "/metrics" or role != "decode":
            return self.reply({})
        # NixlConnector's read times: 2 ms per read, 0.5 ms of it posting, one read per
        # decode request.
        data = "".join(
            f'vllm:nixl_{name}_seconds_{kind}{{engine="0"}} {value}\n'
            for name, per_read in (("xfer_time", 0.002), ("post_time", 0.0005))
            for kind, value in (("sum", per_read * count), ("count", count))
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        global count
        self.rfile.read(int(self.headers["Content-Length"]))
        n, count = count, count + 1
        if action == f"die-at:{n}":
            print(f"request {n}: the {role} engine core died (stand-in)", flush=True)
            os._exit(3)
        if action == f"stall-at:{n}":
            print(f"request {n}: the {role} engine stalls (stand-in)", flush=True)
            time.sleep(3600)
        params = {"remote_block_ids": [1]} if role == "prefill" else None
        self.reply({"kv_transfer_params": params, "usage": {"completion_tokens": 1}})


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def run_pd(tmp_path: Path, plan: str, limit: float = 90, timeout: float = 5):
    stand_in = tmp_path / "stand-in"
    server = stand_in / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for pkg in (stand_in / "vllm", stand_in / "vllm" / "entrypoints", server):
        (pkg / "__init__.py").write_text("")
    (server / "api_server.py").write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": str(stand_in), "KVSERIES_VLLM_TREE": str(stand_in),
           "FAKE_SERVE": plan}
    out = tmp_path / "pd.json"
    start = time.monotonic()
    done = run_in_own_session(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--backend", "vmm", "--model",
         str(tmp_path), "--json", str(out), "--requests", "4", "--prompt-len", "8",
         "--timeout", str(timeout)], env=env, timeout=limit, what="bench_pd.py")
    return done, time.monotonic() - start, out


def test_the_flow_with_instances_that_answer(tmp_path):
    done, _, out = run_pd(tmp_path, "")
    assert done.returncode == 0, done.stdout
    assert out.exists() and "request 4:" in done.stdout
    # The decode instance's reads over the four timed requests, from its /metrics.
    nixl = json.loads(out.read_text())["decode_nixl"]
    assert nixl["reads"] == 4
    assert abs(nixl["xfer_ms"] - 2.0) < 1e-6 and abs(nixl["post_ms"] - 0.5) < 1e-6


def test_an_instance_that_dies_ends_the_run_with_its_log(tmp_path):
    # Request 0 is the untimed first one; 1 and 2 are measured; the decode instance dies at 3.
    done, seconds, out = run_pd(tmp_path, "decode=die-at:3")
    assert done.returncode == 1, done.stdout
    assert seconds < 30
    text = done.stdout
    assert "\nrequest 2: " in text and "\nrequest 3: " not in text
    assert "measured before the failure: 2 timed request(s), TTFT median" in text
    assert "error: decode instance: request failed:" in text
    assert "(exit status 3)" in text
    assert "pd-vmm-decode.log:" in text
    assert "request 3: the decode engine core died (stand-in)" in text
    assert not out.exists()


def test_an_instance_that_stalls_ends_the_run_at_the_deadline(tmp_path):
    done, seconds, _ = run_pd(tmp_path, "prefill=stall-at:1")
    assert done.returncode == 1, done.stdout
    assert seconds < 40  # --timeout 5 for the request, the instances' start and stop
    text = done.stdout
    assert "request 0:" in text and "measured before the failure" not in text
    assert "error: prefill instance: no answer in 5 s (--timeout) (still running)" in text
    assert "request 1: the prefill engine stalls (stand-in)" in text


def test_an_instance_that_fails_to_start_ends_the_run_with_its_log(tmp_path):
    done, seconds, _ = run_pd(tmp_path, "decode=start-fail")
    assert done.returncode == 1, done.stdout
    assert seconds < 30
    assert "error: decode instance: ended while starting (exit status 1)" in done.stdout
    assert "RuntimeError: Engine core initialization failed (stand-in)" in done.stdout


def test_an_instance_whose_thread_dies_while_starting_ends_the_run_at_once(tmp_path):
    # A deadline far away: only seeing the dead thread in the log ends the run in time.
    done, seconds, _ = run_pd(tmp_path, "decode=thread-dies", timeout=600)
    assert done.returncode == 1, done.stdout
    assert seconds < 30
    text = done.stdout
    assert ("error: decode instance: a thread died while starting: (EngineCore pid=1) "
            "Exception in thread nixl_handshake_listener:") in text
    assert "(still running)" in text and "Address already in use (stand-in)" in text


def test_ports_handed_to_servers_are_outside_the_ephemeral_range(tmp_path, monkeypatch):
    import socket

    import bench_server

    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(bench_server, "EPHEMERAL_RANGE_FILE", ranges)
    ranges.write_text("20000\t65535\n")
    ports = {bench_server.free_port() for _ in range(20)}
    assert all(bench_server.LOWEST_PORT <= p < 20000 for p in ports), ports
    ranges.write_text("1024 40000\n")
    assert all(40000 < bench_server.free_port() <= 65535 for _ in range(20))
    # A port something listens on is never handed out; with no other port outside the
    # range, the kernel picks one.
    low = bench_server.LOWEST_PORT
    ranges.write_text(f"{low + 1} 65535\n")
    with socket.socket() as taken:
        try:
            taken.bind(("", low))
        except OSError:
            pass  # already taken by something else: as good for the check
        assert bench_server.free_port() != low
    # No range to read: Linux's default one.
    ranges.unlink()
    assert not 32768 <= bench_server.free_port() <= 60999
