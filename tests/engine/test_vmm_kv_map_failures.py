"""A device without memory for KV pages, in a real vLLM 0.32.0 engine on CPU (host VMM backend).

The workers' physical allocations fail as out of memory at a rate the test sets while the engine
runs (kv_map_failures.py, a test-only vLLM plugin loaded in the engine's processes), at TP=1 and
TP=2:

- every allocation fails from the start: the engine fails at startup with an error that names
  the memory (host memory, the KV memfd, the device ledger), instead of waiting for memory;
- half the allocations fail from the start: the engine starts (the startup pages are tried
  again) and every request completes with the token ids of the default memory backend;
- then every allocation fails for a while: requests that fit the mapped pages complete, the
  others wait (the engine keeps stepping), and once allocations succeed again every request
  completes, with the same token ids.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from kv_map_failures import plugin_env
from own_session import run_in_own_session
from tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 8

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    import threading
    import time
    from pathlib import Path

    from kv_map_failures import set_rate


    def mapped_bytes(worker):
        return worker.model_runner.kv_page_mapper.mapped_bytes


    def idle_bytes(worker):
        mapper = worker.model_runner.kv_page_mapper
        return (1 + mapper.policy.headroom_pages) * mapper.page_bytes


    def mapped_blocks(worker):
        mapper = worker.model_runner.kv_page_mapper
        return mapper.mapped_bytes // mapper.page_bytes * mapper.policy.blocks_per_page


    def map_failures(worker):
        return worker.model_runner.kv_page_mapper.stats()["kv_map_failures_total"]


    def make_llm(args, backend):
        from vllm import LLM

        return LLM(model=args["model"], load_format="dummy", skip_tokenizer_init=True,
                   enforce_eager=True, max_model_len=4096, max_num_seqs=8, seed=0,
                   kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=8192,
                   enable_prefix_caching=False, tensor_parallel_size=args["tp"],
                   distributed_executor_backend="mp", kv_cache_memory_backend=backend,
                   **({"kv_cache_vmm_shrink_delay": 0, "kv_cache_vmm_headroom_pages": 0}
                      if backend == "vmm" else {}))


    def generate(llm, prompts):
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"],
                                detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]


    def wait_idle(llm):
        # The idle engine gives back what is beyond the headroom (shrink delay 0).
        deadline = time.monotonic() + 60
        while any(m > i for m, i in zip(llm.collective_rpc(mapped_bytes),
                                        llm.collective_rpc(idle_bytes))):
            assert time.monotonic() < deadline, llm.collective_rpc(mapped_bytes)
            time.sleep(0.2)


    def outage(llm, prompts, rate_file):
        # Every allocation fails while the requests arrive: the short ones run in the mapped
        # pages, the long one (more blocks than are mapped) waits; the memory comes back once
        # the short ones are done and outage_s passed.
        from vllm import SamplingParams

        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"],
                                detokenize=False)
        # The premise, on every rank's geometry: the short requests fit the idle engine's
        # mapped blocks (less the null block), the long one does not.
        block_size = engine.vllm_config.cache_config.block_size
        free = min(llm.collective_rpc(mapped_blocks)) - 1
        need = [-(-(len(p) + args["max_tokens"]) // block_size) for p in prompts]
        assert max(need[:-1]) <= free < need[-1], (free, need)
        set_rate(rate_file, 1.0)
        failures = sum(llm.collective_rpc(map_failures))
        ids, finished_at, restored = {}, {}, {}
        start = time.monotonic()

        def restore():
            # engine.step() blocks while nothing runs: the rate comes back from here.
            while time.monotonic() - start < 120 and not (
                len(ids) >= len(prompts) - 1 and time.monotonic() - start >= args["outage_s"]
            ):
                time.sleep(0.05)
            restored["at"] = time.monotonic()
            set_rate(rate_file, 0.0)

        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        timer = threading.Thread(target=restore, daemon=True)
        timer.start()
        while len(ids) < len(prompts):
            for out in engine.step():
                if out.finished:
                    ids[out.request_id] = list(out.outputs[0].token_ids)
                    finished_at[out.request_id] = time.monotonic()
        timer.join()
        during = {
            "finished": sorted(int(r) for r, t in finished_at.items() if t < restored["at"]),
            "seconds": restored["at"] - start,
            "map_failures": sum(llm.collective_rpc(map_failures)) - failures,
        }
        return [ids[str(i)] for i in range(len(prompts))], during


    def main():
        global args
        args = json.loads(sys.argv[1])
        rate_file = Path(args["rate_file"])
        result = {}
        if args["mode"] == "serve":
            llm = make_llm(args, "default")
            result["reference"] = generate(llm, args["prompts"])
            llm.llm_engine.engine_core.shutdown()
            del llm
            set_rate(rate_file, 0.5, seed=7)
        llm = make_llm(args, "vmm")  # with the plugin's rate from the start
        result["half"] = generate(llm, args["prompts"])
        result["half_failures"] = sum(llm.collective_rpc(map_failures))
        set_rate(rate_file, 0.0)
        wait_idle(llm)
        result["outage"], result["during"] = outage(llm, args["prompts"], rate_file)
        llm.llm_engine.engine_core.shutdown()
        print("RESULT " + json.dumps(result))


    if __name__ == "__main__":
        main()
    """
)


def _prompts() -> list[list[int]]:
    # 8 prompts of 600 tokens (5 blocks of 128 tokens each), then one of 4000 (32 blocks): an
    # idle engine without headroom keeps only the null block's page mapped (16 blocks a page at
    # TP=1, 32 at TP=2: each rank's page holds the same bytes of half the heads), so without new
    # pages the short ones run, a few at a time, and the long one cannot (checked in the run).
    short = [[(7 * i + 3 * j) % 4000 + 1 for j in range(600)] for i in range(8)]
    return [*short, [(11 * j) % 4000 + 1 for j in range(4000)]]


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", num_key_value_heads=4)


def _omp_binding(tp: int) -> str:
    if tp == 1:
        return "0"
    from bench_pd import cpu_halves

    return "|".join(",".join(map(str, part)) for part in cpu_halves())


def _run(tmp_path: Path, model: Path, tp: int, mode: str, rate: float,
         outage_s: float = 3.0) -> tuple[int, str]:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    plugin, rate_file = plugin_env(tmp_path, rate)
    args = {"model": str(model), "tp": tp, "mode": mode, "prompts": _prompts(),
            "max_tokens": MAX_TOKENS, "rate_file": str(rate_file), "outage_s": outage_s}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           **plugin}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _omp_binding(tp))
    # Serve: two engines one after the other (the default memory backend's reference first).
    done = run_in_own_session([sys.executable, str(script), json.dumps(args)], env=env,
                              timeout=840, what=f"{mode} engine")
    return done.returncode, done.stdout


TWO_CORES = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU needs 2 cores")


@pytest.mark.parametrize("tp", ["tp1", pytest.param("tp2", marks=TWO_CORES)])
def test_no_memory_at_startup_fails_the_engine_naming_the_memory(tmp_path, kv_model, tp):
    returncode, output = _run(tmp_path, kv_model, int(tp[2:]), "start", rate=1.0)
    assert returncode != 0, output[-4000:]
    assert "RESULT" not in output
    match = re.search(r"VMM-backed KV cache: (\d+) of the \1 KV cache pages mapped at startup "
                      r"\([\d.]+ MiB each on cpu\) could not be mapped in ([\d.]+) s: "
                      r"growing the KV memfd by \d+ bytes failed: out of memory", output)
    assert match is not None, output[-6000:]
    assert float(match.group(2)) < 10  # STARTUP_MAP_TIMEOUT_S, then the error
    assert "host memory:" in output and "this process's KV memfd:" in output
    assert "No engine shares cpu through a device ledger" in output
    assert "--max-num-batched-tokens" in output


# TP=2: ranks that fail different pages (two TP=2 engines one after the other: about 130 s on
# two cores).
@pytest.mark.parametrize("tp", ["tp1", pytest.param("tp2", marks=TWO_CORES)])
def test_requests_wait_for_memory_and_complete_with_the_same_tokens(tmp_path, kv_model, tp):
    returncode, output = _run(tmp_path, kv_model, int(tp[2:]), "serve", rate=0.0)
    assert returncode == 0, output[-6000:]
    match = re.search(r"^RESULT (.*)$", output, re.MULTILINE)
    assert match is not None, output[-6000:]
    result = json.loads(match.group(1))
    reference = result["reference"]
    assert all(len(ids) == MAX_TOKENS for ids in reference)
    # Half of the allocations failed (the startup's and the steps'): the same tokens.
    assert result["half_failures"] > 0
    assert result["half"] == reference
    # While nothing could be mapped, the short requests ran in the mapped pages (no step waited
    # for memory) and the long one waited; it completed once the memory was back.
    during = result["during"]
    assert during["map_failures"] > 0, during
    assert during["finished"] == list(range(len(reference) - 1)), during
    assert result["outage"] == reference
