"""rebase: carry a series to another release; drop what upstream has; stop at conflicts."""

from __future__ import annotations

import hashlib

from conftest import CORE_PY, Project, add_patch, make_sdist, write_matrix

V1, V2 = "1.0.0", "2.0.0"


def _new_release(project: Project, core: str) -> None:
    cache = project.root / "cache"
    sha1 = hashlib.sha256((cache / f"vllm-{V1}.tar.gz").read_bytes()).hexdigest()
    sha2 = make_sdist(cache / f"vllm-{V2}.tar.gz", V2, {"vllm/core.py": core})
    write_matrix(project.root, {V1: sha1, V2: sha2})


def test_rebase_carries_drops_and_writes_range_diff(project: Project, tmp_path):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    add_patch(project, V1, "vllm/core.py", "return x + 5\n", "return x + 50\n", "[Core] B")
    # Release 2.0.0 already has B's change, and moved f3 down by a few lines.
    _new_release(project, "# moved\n\n\n" + CORE_PY.replace("return x + 5\n", "return x + 50\n"))
    report = tmp_path / "rd.txt"
    out = project.run("rebase.py", "--from", V1, "--to", V2, "--report", str(report)).stdout
    assert "1 patches carried, 1 dropped" in out
    series = (project.patches / f"v{V2}" / "series").read_text()
    assert "# Rebased from v1.0.0" in series and "0001-Core-B.patch" not in series.split("\n")[-2]
    assert "Dropped (vLLM 2.0.0 already has them): 0002-Core-B.patch" in series
    assert series.strip().endswith("0001-Core-A.patch")
    assert "return x + 30" in (project.tree(V2) / "vllm/core.py").read_text()
    text = report.read_text()
    assert "[Core] A" in text and "[Core] B" in text  # A on both sides, B only on the left
    assert "already applied" in project.run("apply.py", "--version", V2).stdout


def test_rebase_stops_at_conflict_with_report(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 7\n", "return x + 70\n", "[Core] Seven")
    _new_release(project, CORE_PY.replace("return x + 7\n", "return x * 7\n"))
    proc = project.run("rebase.py", "--from", V1, "--to", V2, check=False)
    assert proc.returncode == 1
    assert "rebase v1.0.0 -> v2.0.0" in proc.stderr and "0001-Core-Seven.patch" in proc.stderr
    assert "vllm/core.py" in proc.stderr and "am --abort" in proc.stderr
