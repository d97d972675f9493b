"""scripts/lint.py on fixture releases: only findings the series adds count (see conftest.py).

The fixture release ships a .pre-commit-config.yaml (JSON, which is YAML) with one local hook
in vLLM's style: it prints `path:line: message` per finding and fails when it finds any.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import Project, add_patch, make_sdist, write_matrix

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from lint import diff_hunks, select_files  # noqa: E402

V1, V2 = "1.0.0", "2.0.0"

CHECK_FIXME = """\
import sys

bad = 0
for path in sys.argv[1:]:
    for n, line in enumerate(open(path), 1):
        if "FIXME" in line:
            print(f"{path}:{n}: FIXME left in: {line.strip()}")
            bad += 1
sys.exit(1 if bad else 0)
"""

LOCAL_HOOK = {
    "id": "check-fixme", "name": "No FIXME", "language": "system",
    "entry": "python3 tools/pre_commit/check_fixme.py", "types": ["python"],
}


def lint_project(project: Project, repos: list[dict]) -> Project:
    """Rebuild the fixture releases with a pre-commit config and vllm/core.py holding one
    FIXME already in the pristine release."""
    config = {"exclude": "vllm/third_party/.*", "repos": repos}
    extra = {
        ".pre-commit-config.yaml": json.dumps(config, indent=1),
        "tools/pre_commit/check_fixme.py": CHECK_FIXME,
        "vllm/old.py": "A = 1  # FIXME: pristine\n",
    }
    cache = project.root / "cache"
    shas = {v: make_sdist(cache / f"vllm-{v}.tar.gz", v, extra) for v in (V1, V2)}
    write_matrix(project.root, shas)
    return project


@pytest.fixture
def linted(project: Project) -> Project:
    return lint_project(project, [{"repo": "local", "hooks": [LOCAL_HOOK]}])


def lint(project: Project, *args: str):
    return project.run("lint.py", "--version", V1, *args, check=False)


def test_a_finding_on_pristine_is_not_counted_even_when_lines_shift(linted: Project):
    # The patch moves the pristine FIXME two lines down and touches the file: same finding.
    add_patch(linted, V1, "vllm/old.py", "A = 1", "Z = 0\nY = 0\nA = 1", "[Core] Shift lines")
    proc = lint(linted)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hook:check-fixme" in proc.stdout
    assert "0 added  (patched 1, pristine 1" in proc.stdout
    assert "summary: vLLM 1.0.0: 0 findings added by the series" in proc.stdout


def test_a_new_finding_counts_and_fails(linted: Project, tmp_path: Path):
    add_patch(linted, V1, "vllm/old.py", "A = 1", "B = 2  # FIXME: from the series\nA = 1",
              "[Core] New FIXME")
    # A file the series adds (overlay) exists only on the patched side: its findings count.
    (linted.overlay / "vllm" / "newpkg" / "__init__.py").write_text("X = 1  # FIXME: new file\n")
    linted.run("apply.py", "--version", V1)
    summary = tmp_path / "summary.json"
    proc = lint(linted, "--summary-json", str(summary))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 added  (patched 3, pristine 1" in proc.stdout
    assert "vllm/old.py: FIXME left in: B = 2  # FIXME: from the series" in proc.stdout
    assert "vllm/newpkg/__init__.py: FIXME left in: X = 1  # FIXME: new file" in proc.stdout
    assert "FIXME: pristine" not in proc.stdout.split("check-fixme", 1)[1]
    checks = {c["check"]: c for c in json.loads(summary.read_text())}
    assert len(checks["hook:check-fixme"]["added"]) == 2
    assert checks["signoff"]["added"] == []


def test_a_second_copy_of_a_pristine_finding_in_the_same_file_counts(linted: Project):
    add_patch(linted, V1, "vllm/old.py", "A = 1  # FIXME: pristine\n",
              "A = 1  # FIXME: pristine\nA = 1  # FIXME: pristine\n", "[Core] Copy")
    proc = lint(linted)
    assert proc.returncode == 1
    assert "1 added  (patched 2, pristine 1" in proc.stdout


def test_a_patch_without_signed_off_by_fails(linted: Project):
    linted.run("apply.py", "--version", V1)
    core = linted.tree(V1) / "vllm" / "core.py"
    core.write_text(core.read_text() + "\n\ndef g():\n    return 1\n")
    linted.git(V1, "commit", "-q", "-a", "-m", "[Core] Unsigned\n\nBody.\n\nDrop when: never.")
    linted.run("refresh.py", "--version", V1)
    proc = lint(linted)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "signoff" in proc.stdout
    assert "patches/v1.0.0/Core-Unsigned.patch: no Signed-off-by: line" in proc.stdout


def test_a_tool_that_cannot_be_installed_says_which_and_how(project: Project, tmp_path: Path):
    lint_project(project, [{"repo": "https://github.com/astral-sh/ruff-pre-commit",
                            "rev": "v0.14.0", "hooks": [{"id": "ruff-check"}]}])
    project.run("apply.py", "--version", V1)
    # No package index: pip cannot get the pinned ruff.
    proc = project.run("lint.py", "--version", V1, check=False,
                       env={"KVSERIES_LINT_VENV": str(tmp_path / "lint-venv"),
                            "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""})
    assert proc.returncode == 1
    assert "error: cannot install the lint tool ruff-0.14.0 (ruff==0.14.0)" in proc.stderr
    assert f"{tmp_path / 'lint-venv' / 'ruff-0.14.0'}/bin/pip install ruff==0.14.0" in proc.stderr


def test_lint_needs_an_applied_tree(linted: Project):
    proc = lint(linted)
    assert proc.returncode == 1
    assert "make apply VLLM_VERSION=1.0.0" in proc.stderr


def test_files_are_selected_as_pre_commit_does():
    files = ["vllm/a.py", "vllm/b.pyi", "tests/t.py", "vllm/third_party/x.py", "docs/d.md"]
    assert select_files(files, {"types": ["python"]}, "vllm/third_party/.*") == [
        "vllm/a.py", "tests/t.py"]
    assert select_files(files, {"types_or": ["python", "pyi"], "files": "^vllm/"}, "") == [
        "vllm/a.py", "vllm/b.pyi", "vllm/third_party/x.py"]
    assert select_files(files, {"exclude": r"\.md$"}, "^tests/") == [
        "vllm/a.py", "vllm/b.pyi", "vllm/third_party/x.py"]


def test_format_findings_ignore_where_the_hunk_is():
    hunk = "-x = ( 1 )\n+x = 1\n"
    at = lambda n: f"--- a.py\n+++ a.py\n@@ -{n},1 +{n},1 @@\n{hunk}"  # noqa: E731
    assert diff_hunks(at(3)) == diff_hunks(at(40))
    assert diff_hunks(at(3) + "@@ -50,1 +50,1 @@\n" + hunk) == Counter(
        {("a.py", "would reformat: -x = ( 1 ) | +x = 1"): 2})
