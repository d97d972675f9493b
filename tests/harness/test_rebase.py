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
    assert "# Rebased from v1.0.0" in series and "Core-B.patch" not in series.split("\n")[-2]
    assert "Dropped (vLLM 2.0.0 already has them): Core-B.patch" in series
    assert series.strip().endswith("Core-A.patch")
    assert "return x + 30" in (project.tree(V2) / "vllm/core.py").read_text()
    text = report.read_text()
    assert "[Core] A" in text and "[Core] B" in text  # A on both sides, B only on the left
    assert "already applied" in project.run("apply.py", "--version", V2).stdout


def test_rebase_stops_at_conflict_with_report(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 7\n", "return x + 70\n", "[Core] Seven")
    _new_release(project, CORE_PY.replace("return x + 7\n", "return x * 7\n"))
    proc = project.run("rebase.py", "--from", V1, "--to", V2, check=False)
    assert proc.returncode == 1
    assert "rebase v1.0.0 -> v2.0.0" in proc.stderr and "Core-Seven.patch" in proc.stderr
    assert "vllm/core.py" in proc.stderr and "am --abort" in proc.stderr


def test_rebase_conflict_names_where_moved_code_went(project: Project):
    """Upstream moved f7 to another file: the report says where it is now."""
    add_patch(project, V1, "vllm/core.py", "return x + 7\n", "return x + 70\n", "[Core] Seven")
    cache = project.root / "cache"
    sha1 = hashlib.sha256((cache / f"vllm-{V1}.tar.gz").read_bytes()).hexdigest()
    moved = "def f7(x):\n    return x + 7\n\n\n"
    sha2 = make_sdist(cache / f"vllm-{V2}.tar.gz", V2,
                      {"vllm/core.py": CORE_PY.replace(moved, ""), "vllm/planning.py": moved})
    write_matrix(project.root, {V1: sha1, V2: sha2})
    proc = project.run("rebase.py", "--from", V1, "--to", V2, check=False)
    assert proc.returncode == 1
    assert "f7 (in vllm/core.py on the source release) is in vllm/planning.py on v2.0.0" \
        in proc.stderr


def test_range_diff_only_after_resolving_a_conflict(project: Project, tmp_path):
    """Resolve by hand, refresh, then --range-diff-only writes the reviewer's report."""
    add_patch(project, V1, "vllm/core.py", "return x + 7\n", "return x + 70\n", "[Core] Seven")
    _new_release(project, CORE_PY.replace("return x + 7\n", "return x * 7\n"))
    assert project.run("rebase.py", "--from", V1, "--to", V2, check=False).returncode == 1
    tree = project.tree(V2)
    core = (tree / "vllm/core.py").read_text()
    start = core.index("<<<<<<<")
    end = core.index(">>>>>>>")
    end = core.index("\n", end) + 1
    (tree / "vllm/core.py").write_text(core[:start] + "    return x * 70\n" + core[end:])
    project.git(V2, "add", "vllm/core.py")
    project.git(V2, "am", "--continue")
    project.run("refresh.py", "--version", V2)
    series = project.patches / f"v{V2}" / "series"
    series.write_text("# Adapted: Seven multiplies on 2.0.0.\n" + series.read_text())
    report = tmp_path / "rd.txt"
    project.run("rebase.py", "--from", V1, "--to", V2, "--range-diff-only",
                "--report", str(report))
    text = report.read_text()
    assert "How to read it" in text and "# Adapted: Seven multiplies on 2.0.0." in text
    assert "!" in next(ln for ln in text.splitlines() if "[Core] Seven" in ln)
    assert "+    return x * 70" in text or "+    return x * 70" in text.replace("+ ", "+")
