# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` for the benchmark suite and bench_pd.py: one server in its own process group."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proc import describe_exit, die_with_parent, tail  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` in its own process group, so that its engine core and workers stop with
    it; ``env`` adds to (or overrides) ``base_env``; ``backend`` None leaves
    --kv-cache-memory-backend out."""

    def __init__(self, model: str, backend: str | None, engine: dict, log: Path,
                 base_env: dict, env: dict | None = None, tp: int = 1) -> None:
        self.port = _free_port()
        self.log = log
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--load-format", "dummy", "--skip-tokenizer-init", "--port", str(self.port),
               "--tensor-parallel-size", str(tp)]
        if backend is not None:  # None: a vLLM without the option (stock) runs too
            cmd += ["--kv-cache-memory-backend", backend]
        for key, value in engine.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value is not False:
                cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        with open(log, "w") as f:
            f.write(shlex.join(cmd) + "\n")
            f.flush()
            self.started = time.monotonic()
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         env={**base_env, **(env or {})},
                                         start_new_session=True, preexec_fn=die_with_parent)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float) -> dict:
        """{"health_s": seconds from spawning to GET /health 200} or {"error": ...}: how the
        server ended (or that it was not healthy in time) and its log's last lines."""
        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                return {"error": self.failure("server ended")}
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return {"health_s": time.monotonic() - self.started}
            except OSError:
                pass
            time.sleep(0.25)
        return {"error": self.failure(f"no /health 200 within {timeout:g} s")}

    def failure(self, what: str, lines: int = 5) -> str:
        """One line: ``what``, whether the server still runs, its log's last lines."""
        return (f"{what} ({describe_exit(self.proc.poll())}); log {self.log.name}: "
                + " | ".join(tail(self.log, lines)))

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s; also when the server
        itself has ended (what it started may still run)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # nothing of it is left
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def fetch_metrics(server: Server) -> str | None:
    """The server's /metrics text, None if it does not answer."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            return resp.read().decode(errors="replace") if resp.status == 200 else None
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return None


_SAMPLE_RE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_samples(text: str, names: tuple[str, ...]) -> list[tuple[dict, float]]:
    """(labels, value) of every sample in a Prometheus text whose name is one of ``names``."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE_RE.fullmatch(line.strip())
        if not m or m[1] not in names:
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        samples.append(({k: v for k, v in _LABEL_RE.findall(m[2] or "")}, value))
    return samples
