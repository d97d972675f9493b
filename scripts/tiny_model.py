"""Small dummy-weight models derived from the project's public model configs.

The architecture and tensor layout stay those of the real model (its config.json from
ci/hf-models, see model_configs.py); only sizes shrink, so a real vLLM engine builds and runs it
on 2 CPU cores in seconds. Weights come from load_format="dummy"; no tokenizer is needed
(skip_tokenizer_init=True, token-id prompts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_configs import model_path  # noqa: E402

TINY_LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def make_tiny_model(dest: Path, base: str = "Llama-3.1-8B-Instruct", **overrides) -> Path:
    """Write config.json of a shrunk `base` into dest; returns dest (a model directory)."""
    source = model_path(base)
    config = json.loads((source / "config.json").read_text())
    config.update(TINY_LLAMA if source.name.startswith("Llama") else {})
    config.update(overrides)
    config.pop("rope_scaling", None)  # long-context scaling of the full model: not for a toy
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
