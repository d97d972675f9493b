# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` for the benchmark suite and bench_pd.py: one server in its own process group."""

from __future__ import annotations

import http.client
import json
import os
import random
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


# The kernel's range of ports for sockets that ask for none (Linux's default where it cannot
# be read).
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST_PORT = 10000
# What Python's threading prints when a thread ends with an exception.
DEAD_THREAD = "Exception in thread "


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def free_port(attempts: int = 200) -> int:
    """A TCP port nothing listens on now, outside the kernel's ephemeral range where the
    range leaves room: a port a server is told to bind later (its HTTP port, NixlConnector's
    side channel) is otherwise free for the kernel to give to any socket opened meanwhile,
    the server's own engine's included ("Address already in use" at the bind, after which
    vLLM's NIXL handshake listener thread dies and the engine waits for it forever)."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((LOWEST_PORT, low - 1), (high + 1, 65535)) if a <= b]
    rng = random.SystemRandom()
    for _ in range(attempts if spans else 0):
        a, b = rng.choice(spans)
        port = rng.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room outside the range: the kernel's choice
        s.bind(("", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` in its own process group, so that its engine core and workers stop with
    it; ``env`` adds to (or overrides) ``base_env``; ``backend`` None leaves
    --kv-cache-memory-backend out."""

    def __init__(self, model: str, backend: str | None, engine: dict, log: Path,
                 base_env: dict, env: dict | None = None, tp: int = 1) -> None:
        self.port = free_port()
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
        server ended (or that it was not healthy in time, or that a thread of it died while
        it started) and its log's last lines."""
        seen = 0
        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                return {"error": self.failure("server ended")}
            seen, died = self._dead_thread(seen)
            if died:
                return {"error": self.failure(
                    f"a thread of the server died while it started ({died}): it would wait "
                    "for that thread until the deadline", lines=12), "dead_thread": died}
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return {"health_s": time.monotonic() - self.started}
            except OSError:
                pass
            time.sleep(0.25)
        return {"error": self.failure(f"no /health 200 within {timeout:g} s")}

    def _dead_thread(self, offset: int) -> tuple[int, str]:
        """(where the log was read to, the first line saying a thread died from ``offset``
        on, or ""): vLLM starts threads that the engine then waits for (NixlConnector's
        handshake listener signals that it bound its port); one that dies of an exception
        leaves the server neither healthy nor ended."""
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return offset, ""
        end = data.rfind(b"\n") + 1  # whole lines only
        for line in data[:end].decode(errors="replace").splitlines():
            if DEAD_THREAD in line:
                return offset + end, line.strip()
        return offset + end, ""

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
