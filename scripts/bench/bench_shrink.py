#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where VMM-backed KV loses decode throughput: page mapping or page access.

One engine per configuration, in this order: stock, VMM with ``--kv-cache-vmm-shrink
idle --kv-cache-vmm-shrink-delay 0`` (pages given back whenever the engine is idle, so
every burst maps them again), VMM with ``idle`` and the default shrink delay (bursts
closer together than the delay keep their pages), VMM with ``never`` (the first burst
maps, later bursts find the pages mapped), stock again. Each engine runs the same
decode burst three times after a short warm-up and prints tokens/s per burst and, for
VMM, the workers' page counters (pages mapped, seconds spent mapping). Bursts 2-3 of
``never`` against stock isolate the access speed of VMM memory; ``idle`` against stock
adds the map cost of every burst.

    python scripts/bench/bench_shrink.py <model dir with config.json> [--json out.json]

Runs on a GPU host with the patched vLLM importable (dummy weights, no tokenizer).
"""

import argparse
import gc
import json
import os
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the stats RPC below

# (memory backend, --kv-cache-vmm-shrink, --kv-cache-vmm-shrink-delay); None: the default.
CONFIGS = [("default", None, None), ("vmm", "idle", 0.0), ("vmm", "idle", None),
           ("vmm", "never", None), ("default", None, None)]


def _page_stats(worker) -> dict | None:
    mapper = getattr(worker.model_runner, "kv_page_mapper", None)
    return mapper.stats() if mapper is not None else None


def run(model: str, backend: str, shrink: str | None, delay: float | None, num: int,
        input_len: int, output_len: int) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = dict(model=model, load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=2048, max_num_seqs=256, gpu_memory_utilization=0.85,
                  compilation_config={"cudagraph_capture_sizes":
                                      [1, 2, 4, 8, 16, 32, 64, 128, 256]},
                  kv_cache_memory_backend=backend)
    if shrink:
        kwargs["kv_cache_vmm_shrink"] = shrink
    if delay is not None:
        kwargs["kv_cache_vmm_shrink_delay"] = delay
    start = time.monotonic()
    llm = LLM(**kwargs)
    startup = time.monotonic() - start
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 30000 + 1 for j in range(input_len)]}
               for i in range(num)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    llm.generate(prompts[:8], params, use_tqdm=False)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs)
                     / (time.perf_counter() - t))
    result = {"backend": backend, "shrink": shrink, "shrink_delay_s": delay,
              "startup_s": startup,
              "tokens_per_s": rates, "page_stats": llm.collective_rpc(_page_stats)}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--num", type=int, default=128)
    p.add_argument("--input", type=int, default=64)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--json")
    args = p.parse_args()
    results = []
    for backend, shrink, delay in CONFIGS:
        r = run(args.model, backend, shrink, delay, args.num, args.input, args.output)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
