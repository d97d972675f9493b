"""The real release matrix and the CI workflow agree, and every release has a series."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def test_matrix_releases_have_series_and_pinned_sdists():
    data = tomllib.loads((ROOT / "ci" / "matrix.toml").read_text())
    assert data["default"] in data["release"]
    for version, entry in data["release"].items():
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sdist_sha256"]), version
        assert (ROOT / "patches" / f"v{version}" / "series").exists(), version
        assert set(entry["ci_tiers"]) <= {"harness", "unit", "engine", "upstream", "lint",
                                          "bisect", "bisect-tests"}
        if "engine" in entry["ci_tiers"]:
            assert entry["cpu_kernels"], f"{version}: engine tier needs installable CPU kernels"


def test_workflow_runs_every_matrix_release():
    data = tomllib.loads((ROOT / "ci" / "matrix.toml").read_text())
    workflow = (ROOT / "ci" / "workflow.yml").read_text()
    listed = re.search(r"vllm: \[([^\]]*)\]", workflow).group(1)
    assert sorted(re.findall(r'"([^"]+)"', listed)) == sorted(data["release"])


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^    (make test)$", readme, re.M).group(1)
    assert command in (ROOT / ".ci" / "run").read_text()


def test_python_only_install_drops_only_the_named_version_floors(tmp_path: Path):
    from install import python_only_requirements

    req = tmp_path / "tree" / "requirements"
    req.mkdir(parents=True)
    (req / "common.txt").write_text(
        "requests >= 2.33.0\ncertifi >= 2026.10.19\n"
        "certifi-extra >= 1.0  # a different package\n-r more.txt\n"
    )
    out = python_only_requirements(tmp_path / "tree", ["certifi"], tmp_path / "out.txt")
    assert out.read_text().splitlines() == [
        "requests >= 2.33.0",
        "certifi",
        "certifi-extra >= 1.0  # a different package",
        f"-r {req / 'more.txt'}",
    ]
    # Nothing to drop: the release's own file, untouched.
    assert python_only_requirements(tmp_path / "tree", [], tmp_path / "x.txt") == req / "common.txt"
