"""Where the project's public model configs are: ci/hf-models/<org>/<name>/, and nowhere else.

Every config the project runs is shipped there, with its source in SOURCES.md: the tiny
dummy-weight models of the CPU tests and the smoke run (scripts/tiny_model.py), the benchmark
models (scripts/bench/bench.py), the GPU tests and the offline hub cache of vLLM's own tests
(scripts/hf_cache.py). A model is named by its short name ("Qwen3-8B") or its hub id
("Qwen/Qwen3-8B"). KVSERIES_MODELS=<dir> (a directory of <name>/config.json) is looked at first,
to run a model the project does not ship.
"""

from __future__ import annotations

import os
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "ci" / "hf-models"


def shipped_models(root: Path = SHIPPED) -> dict[str, Path]:
    """hub id -> directory, for every <root>/<org>/<name>/."""
    return {f"{d.parent.name}/{d.name}": d for d in sorted(root.glob("*/*")) if d.is_dir()}


def model_path(name: str) -> Path:
    """The directory holding `name`'s public config.json (short name or hub id)."""
    short = name.split("/")[-1]
    override = os.environ.get("KVSERIES_MODELS")
    if override and (Path(override) / short / "config.json").is_file():
        return Path(override) / short
    shipped = {k: d for k, d in shipped_models().items() if (d / "config.json").is_file()}
    for model_id, directory in shipped.items():
        if name in (model_id, directory.name):
            return directory
    looked = (f"KVSERIES_MODELS={override} or " if override else "") + str(SHIPPED)
    raise FileNotFoundError(
        f"no public config.json of model {name!r} in {looked}. The project ships: "
        f"{', '.join(shipped) or 'none (is the checkout complete?)'}. To run another model, "
        f"add its public config under {SHIPPED}/<org>/<name>/ with its source in SOURCES.md, "
        "or set KVSERIES_MODELS to a directory of <name>/config.json.")
