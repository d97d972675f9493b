"""Test-only vLLM plugin: the device out of memory, on demand, in every process of an engine.

Engine tests start engines whose workers run in processes of their own, so a fixture of the test
process cannot reach their VMM backends. vLLM loads its general plugins (entry point group
``vllm.general_plugins``) in each of its processes; :func:`plugin_env` gives an engine the
environment that registers :func:`register` there (an entry point in a generated ``.dist-info``
on ``PYTHONPATH``, next to this directory), and the file it names sets the failure rate at run
time. Nothing of this is in vLLM or the series: without that environment the plugin is never
found, and with it but without the file variable it does nothing.

:func:`register` wraps ``HostVmmBackend.create`` (the CPU engine's physical allocations) so that
it raises ``VmmOutOfMemoryError``, as the CUDA backend does when the device is full, at the rate
the file holds (``RATE`` or ``RATE SEED``, read at every allocation), drawn from a RNG seeded
with the seed and the worker's rank.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

RATE_FILE_ENV = "KV_TEST_MAP_FAILURE_RATE_FILE"
PLUGIN = "kv_test_map_failures"
HERE = Path(__file__).resolve().parent


def plugin_env(tmp_path: Path, rate: float = 0.0, seed: int = 0) -> tuple[dict[str, str], Path]:
    """Environment entries that load the plugin in every process of an engine started with them,
    and the rate file (holding ``rate``) to change the rate while it runs."""
    site = tmp_path / "plugin-site"
    dist = site / f"{PLUGIN}-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN} = kv_map_failures:register\n")
    rate_file = tmp_path / "map-failure-rate"
    set_rate(rate_file, rate, seed)
    env = {
        RATE_FILE_ENV: str(rate_file),
        "PYTHONPATH": os.pathsep.join(
            [str(site), str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    }
    if os.environ.get("VLLM_PLUGINS"):  # a list that would leave it out
        env["VLLM_PLUGINS"] = f"{os.environ['VLLM_PLUGINS']},{PLUGIN}"
    return env, rate_file


def set_rate(rate_file: Path, rate: float, seed: int = 0) -> None:
    """Change the failure rate of the engines using ``rate_file`` (atomically)."""
    tmp = rate_file.with_suffix(".tmp")
    tmp.write_text(f"{rate} {seed}\n")
    tmp.replace(rate_file)


def _read_rate(path: str) -> tuple[float, int]:
    try:
        rate, _, seed = Path(path).read_text().strip().partition(" ")
        return float(rate), int(seed or 0)
    except (OSError, ValueError):
        return 0.0, 0


def register() -> None:
    """The plugin's entry point (vLLM calls it in each process, maybe more than once)."""
    path = os.environ.get(RATE_FILE_ENV)
    if not path:
        return
    from vllm.v1.kv_vmm.backend import VmmOutOfMemoryError
    from vllm.v1.kv_vmm.host import HostVmmBackend

    create = HostVmmBackend.create
    if getattr(create, "_kv_test_injected", False):
        return
    rngs: dict[int, random.Random] = {}

    def failing_create(self: HostVmmBackend, nbytes: int) -> int:
        rate, seed = _read_rate(path)
        if rate > 0:
            rng = rngs.get(seed)
            if rng is None:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else 0
                rng = rngs[seed] = random.Random(seed * 1000 + rank)
            if rng.random() < rate:
                raise VmmOutOfMemoryError(
                    f"growing the KV memfd by {nbytes} bytes failed: out of memory "
                    "(injected by the test)")
        return create(self, nbytes)

    failing_create._kv_test_injected = True  # type: ignore[attr-defined]
    HostVmmBackend.create = failing_create  # type: ignore[method-assign]
