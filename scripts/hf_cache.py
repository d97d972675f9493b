#!/usr/bin/env python3
"""An offline Hugging Face hub cache of public model configs, for vLLM's own tests.

  python3 scripts/hf_cache.py            # builds build/hf-cache, prints the HF_HUB_CACHE to use

vLLM's tests build a ModelConfig from a hub model id ("Qwen/Qwen3-0.6B", "facebook/opt-125m",
...). Offline (HF_HUB_OFFLINE=1) that fails with "Invalid repository ID or local directory";
online it needs the hub. This lays the public config files of those models out as a hub cache
(models--<org>--<name>/snapshots/<rev>/..., refs/main -> <rev>), so `transformers` and vLLM
resolve the ids from the cache exactly as after a download. No weights, and tokenizer files only
where a model directory ships them.

Sources, each file with where it came from in a SOURCES.md beside it:
  ci/hf-models/<org>/<name>/       committed with the harness (what CI uses)
  $KVSERIES_HF_MODELS/<name>/      optional extra directory of <name>/config.json files with a
                                   SOURCES.md naming each model's hub id as "(`org/name`)" (e.g. a
                                   shared models directory). Off by default: the upstream
                                   baselines are recorded with the committed configs only, so a
                                   local extra model cannot change which tests run.

The revision is a hash of the files, so the cache is rebuilt only when a source changes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_configs import SHIPPED, shipped_models  # noqa: E402
from seriestool import SeriesError, build_dir, main_guard  # noqa: E402
SKIP = {"SOURCES.md", "README.md"}


def extra_models_dir() -> Path | None:
    value = os.environ.get("KVSERIES_HF_MODELS")
    if not value:
        return None
    if not Path(value).is_dir():
        raise SeriesError(f"KVSERIES_HF_MODELS={value} is not a directory.")
    return Path(value)


def hf_cache_dir() -> Path:
    return build_dir() / "hf-cache"


def hub_cache_dir() -> Path:
    """What HF_HUB_CACHE must point at."""
    return hf_cache_dir() / "hub"


def extra_models(root: Path | None) -> dict[str, Path]:
    """hub id -> directory, for <root>/<name>/config.json whose id SOURCES.md names."""
    if root is None or not (root / "SOURCES.md").exists():
        return {}
    ids = re.findall(r"\(`([\w.-]+)/([\w.-]+)`\)", (root / "SOURCES.md").read_text())
    models = {}
    for org, name in ids:
        if (root / name / "config.json").exists():
            models[f"{org}/{name}"] = root / name
    return models


def model_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name not in SKIP)


def revision(files: list[Path]) -> str:
    """A 40-hex revision from the files' names and bytes (stands in for the hub's commit)."""
    h = hashlib.sha1()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def add_model(hub: Path, model_id: str, directory: Path) -> str:
    files = model_files(directory)
    if not any(f.name == "config.json" for f in files):
        raise SeriesError(f"{directory} has no config.json; every cached model needs one.")
    rev = revision(files)
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    if not snapshot.exists():
        shutil.rmtree(repo, ignore_errors=True)
        tmp = repo / "snapshots" / f".{rev}.tmp"
        tmp.mkdir(parents=True)
        for f in files:
            shutil.copy2(f, tmp / f.name)
        tmp.rename(snapshot)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return rev


def build() -> tuple[Path, dict[str, str]]:
    """Build the cache; return (HF_HUB_CACHE path, hub id -> revision)."""
    hub = hub_cache_dir()
    hub.mkdir(parents=True, exist_ok=True)
    models = extra_models(extra_models_dir())
    models.update(shipped_models())  # the committed copy wins: it is what CI tests with
    if not models:
        raise SeriesError(f"no model configs found under {SHIPPED}.")
    revisions = {mid: add_model(hub, mid, d) for mid, d in sorted(models.items())}
    # Models dropped from the sources leave the cache too, so a test never passes on a stale one.
    wanted = {"models--" + mid.replace("/", "--") for mid in models}
    for repo in hub.glob("models--*"):
        if repo.name not in wanted:
            shutil.rmtree(repo)
    return hub, revisions


def offline_env() -> dict[str, str]:
    """Environment that makes hub ids resolve from the cache and never from the network."""
    hub, _ = build()
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub),
        "HF_HOME": str(hf_cache_dir()),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def main() -> None:
    hub, revisions = build()
    for mid, rev in revisions.items():
        print(f"{mid:<45} {rev[:12]}")
    print(f"HF_HUB_CACHE={hub}")


if __name__ == "__main__":
    main_guard(main)
