"""A clone of this repository is all a user has: nothing may read a path outside it.

Model configs, data and scripts the project needs are shipped in the repository (model configs
in ci/hf-models, see scripts/model_configs.py). These tests look for the two ways a path outside
the checkout creeps in: a literal path (a sibling directory, an absolute path of one machine),
and a `Path(__file__)` walk with more `.parent` steps than the file is deep.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

# A sibling directory of the checkout, or an absolute home of one machine's checkouts.
OUTSIDE_LITERAL = re.compile(r"\.\./shared\b|(?<![\w.-])shared/(?:models|peers|gpu-host|research)"
                             r"|(?<![\w.])/work/|/root/")
FILE_WALK = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parent\b)+|\.parents\[(\d+)\])")
# Series files land in vLLM's tree at another depth; their paths are checked by vLLM's own
# layout, not this repository's. Range-diff reports quote the patches.
NOT_RUN_FROM_HERE = ("patches/", "docs/range-diff/", "vllm_overlay/")


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()
            and not f.endswith((".png", ".patch"))]


def outside_literals(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE_LITERAL.finditer(text)]


def escaping_walks(rel: str, text: str) -> list[str]:
    """`Path(__file__)` walks in file `rel` that climb above the repository root."""
    depth = len(Path(rel).parts) - 1  # parents from the file's directory up to ROOT
    found = []
    for m in FILE_WALK.finditer(text):
        steps = int(m.group(2)) + 1 if m.group(2) is not None else m.group(1).count(".parent")
        if steps - 1 > depth:
            found.append(m.group(0))
    return found


def test_detectors_catch_what_they_are_for():
    # The checks below are only worth something if these shapes are caught.
    # Built from parts, so that a plain grep of the tree for the pattern finds no file.
    assert outside_literals('MODELS = ROOT.parent / "shared"  # ' + "../" + "shared/models")
    assert outside_literals("KVSERIES_MODELS=shared/models python3 x.py")
    assert outside_literals("open('/work/main/x')")
    assert not outside_literals("shared_memory, a shared/exclusive lock, kvcached_shared/")
    walk = "Path(__file__).resolve().parent.parent.parent / 'shared'"
    assert escaping_walks("scripts/x.py", walk)
    assert not escaping_walks("scripts/x.py", "Path(__file__).resolve().parent.parent")
    assert escaping_walks("tests/harness/x.py", "Path(__file__).resolve().parents[3]")
    assert not escaping_walks("tests/harness/x.py", "Path(__file__).resolve().parents[2]")


def test_no_file_names_a_path_outside_the_checkout():
    offenders = []
    for rel in tracked_text_files():
        if rel.startswith(NOT_RUN_FROM_HERE) or rel == "tests/harness/test_self_contained.py":
            continue
        try:
            text = (ROOT / rel).read_text()
        except UnicodeDecodeError:
            continue
        offenders += [f"{rel}: {hit}" for hit in outside_literals(text)]
        if rel.endswith(".py"):
            offenders += [f"{rel}: {hit}" for hit in escaping_walks(rel, text)]
    assert not offenders, "paths outside the checkout:\n" + "\n".join(offenders)


def test_every_model_the_project_runs_is_shipped_with_its_source():
    from model_configs import SHIPPED, model_path, shipped_models

    assert ROOT in SHIPPED.parents
    sources = (SHIPPED / "SOURCES.md").read_text()
    models = shipped_models()
    # tiny_model's base, the bench models, the admission tests' DeepSeek-V4 configs and the
    # small models vLLM's own tests name: each shipped, parseable and with its source row.
    for name in ("Llama-3.1-8B-Instruct", "Qwen3-8B", "DeepSeek-V4-Pro", "DeepSeek-V4-Flash",
                 "Qwen2.5-1.5B-Instruct", "gemma-3-1b-it", "Qwen3-0.6B", "opt-125m"):
        path = model_path(name)
        assert SHIPPED in path.parents, path
        assert json.loads((path / "config.json").read_text())["architectures"]
    for model_id in models:
        assert f"`{model_id}`" in sources, f"{model_id} has no row in SOURCES.md"


def test_a_missing_model_names_the_model_and_the_shipped_directory(monkeypatch):
    from model_configs import SHIPPED, model_path

    monkeypatch.delenv("KVSERIES_MODELS", raising=False)
    with pytest.raises(FileNotFoundError) as err:
        model_path("No-Such-Model-7B")
    assert "'No-Such-Model-7B'" in str(err.value)
    assert str(SHIPPED) in str(err.value)
    assert "meta-llama/Llama-3.1-8B-Instruct" in str(err.value)  # what it does ship


def test_kvseries_models_overrides_the_shipped_config(tmp_path, monkeypatch):
    from model_configs import SHIPPED, model_path

    (tmp_path / "Qwen3-8B").mkdir()
    (tmp_path / "Qwen3-8B" / "config.json").write_text('{"architectures": ["X"]}')
    monkeypatch.setenv("KVSERIES_MODELS", str(tmp_path))
    assert model_path("Qwen/Qwen3-8B") == tmp_path / "Qwen3-8B"
    # A model the override directory lacks still comes from the shipped configs.
    assert SHIPPED in model_path("Llama-3.1-8B-Instruct").parents
