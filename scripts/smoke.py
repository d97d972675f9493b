#!/usr/bin/env python3
"""Smoke run of the patched vLLM: a tiny dummy-weight Llama, greedy, end to end.

  build/venv-0.32.0/bin/python scripts/smoke.py

Prints where vllm was imported from, the series applied to that tree, and the generated token
ids; exits non-zero if the engine fails or greedy decoding is not reproducible.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import make_tiny_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    import vllm
    from vllm import LLM, SamplingParams

    tree = Path(vllm.__file__).resolve().parent.parent
    print(f"vllm {vllm.__version__} from {tree}")
    log = subprocess.run(["git", "-C", str(tree), "log", "--format=  %h %s", "-n", "20"],
                         capture_output=True, text=True).stdout
    print("series in this tree:\n" + log.rstrip())
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama")
        llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=512, max_num_seqs=4, seed=0,
                  # A fixed KV budget: on CPU the utilization fraction would depend on
                  # what else runs on the machine.
                  kv_cache_memory_bytes=256 << 20)
        params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
        prompts = [{"prompt_token_ids": list(range(10 + i, 42 + i))} for i in range(3)]
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i, ids in enumerate(first):
        print(f"prompt {i}: {list(ids)}")
    if any(len(ids) != 8 for ids in first) or first != again:
        print("smoke FAILED: outputs missing or greedy decoding not reproducible")
        return 1
    print("smoke OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
