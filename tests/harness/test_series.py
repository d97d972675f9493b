"""apply / refresh / export / check-series on fixture releases (see conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from conftest import ROOT, Project, add_patch, make_sdist, write_matrix

V1, V2 = "1.0.0", "2.0.0"


def series_bytes(project: Project, version: str) -> dict[str, bytes]:
    d = project.patches / f"v{version}"
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_apply_builds_pristine_overlay_and_series(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 300\n",
              "[Core] Make f3 bigger")
    shutil.rmtree(project.tree(V1))
    out = project.run("apply.py", "--version", V1).stdout
    assert "applied Core-Make-f3-bigger.patch" in out
    log = project.git(V1, "log", "--format=%s").splitlines()
    assert log == ["[Core] Make f3 bigger", "[Core] Overlay", f"vLLM {V1} (pristine sdist)"]
    assert project.git(V1, "describe", "--tags", "--abbrev=0") == f"v{V1}"
    # The sdist's .gitignore'd file is part of the pristine commit; overlay files are added.
    assert project.git(V1, "ls-files", "vllm/_version.py") == "vllm/_version.py"
    assert (project.tree(V1) / "vllm" / "newpkg" / "__init__.py").read_text() == "X = 1\n"
    assert "return x + 300" in (project.tree(V1) / "vllm" / "core.py").read_text()


def test_apply_is_idempotent_and_reproducible(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    head = project.git(V1, "rev-parse", "HEAD")
    out = project.run("apply.py", "--version", V1).stdout
    assert "already applied" in out and "nothing to do" in out
    assert project.git(V1, "rev-parse", "HEAD") == head
    # Build trees made from the same inputs have the same commit ids (fixed identity/dates).
    shutil.rmtree(project.tree(V1))
    project.run("apply.py", "--version", V1)
    rebuilt = project.git(V1, "rev-parse", "HEAD")
    shutil.rmtree(project.tree(V1))
    project.run("apply.py", "--version", V1)
    assert project.git(V1, "rev-parse", "HEAD") == rebuilt


def test_apply_picks_up_new_patches_and_overlay_changes(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    first = project.git(V1, "rev-parse", "HEAD")
    add_patch(project, V1, "vllm/core.py", "return x + 5\n", "return x + 50\n", "[Core] B")
    assert project.git(V1, "rev-parse", "HEAD~1") == first
    (project.overlay / "vllm" / "newpkg" / "__init__.py").write_text("X = 2\n")
    out = project.run("apply.py", "--version", V1).stdout
    assert "overlay: 1 files committed" in out and "applied Core-B.patch" in out
    assert (project.tree(V1) / "vllm" / "newpkg" / "__init__.py").read_text() == "X = 2\n"


def test_apply_refuses_dirty_tree_and_keeps_the_edit(project: Project):
    project.run("apply.py", "--version", V1)
    core = project.tree(V1) / "vllm" / "core.py"
    core.write_text(core.read_text() + "# my local edit\n")
    (project.tree(V1) / "notes.txt").write_text("mine\n")
    (project.overlay / "vllm" / "newpkg" / "__init__.py").write_text("X = 3\n")  # would rebuild
    proc = project.run("apply.py", "--version", V1, check=False)
    assert proc.returncode == 1
    assert "local changes" in proc.stderr and "vllm/core.py" in proc.stderr
    assert "notes.txt" in proc.stderr and "make refresh" in proc.stderr
    assert core.read_text().endswith("# my local edit\n")
    assert (project.tree(V1) / "notes.txt").exists()


def test_apply_refuses_commits_not_in_series(project: Project):
    project.run("apply.py", "--version", V1)
    project.commit_in_tree(V1, "vllm/core.py", "changed = True\n", "[Core] My work")
    (project.overlay / "vllm" / "newpkg" / "__init__.py").write_text("X = 4\n")
    proc = project.run("apply.py", "--version", V1, check=False)
    assert proc.returncode == 1
    assert "[Core] My work" in proc.stderr and "make refresh" in proc.stderr
    assert project.git(V1, "log", "-1", "--format=%s") == "[Core] My work"
    # And a clean of that tree refuses too.
    proc = project.run("clean.py", "--version", V1, check=False)
    assert proc.returncode == 1 and project.tree(V1).exists()


def test_refresh_right_after_apply_changes_no_byte(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    add_patch(project, V1, "vllm/__init__.py", "__version__\n", "__version__  # noqa\n",
              "[Misc] B with a long subject line that git folds in the mail header of the file")
    before = series_bytes(project, V1)
    shutil.rmtree(project.tree(V1))
    project.run("apply.py", "--version", V1)
    project.run("refresh.py", "--version", V1)
    assert series_bytes(project, V1) == before
    series = (project.patches / f"v{V1}" / "series").read_text()
    assert series.startswith("# series of the fixture\n")  # header comments are kept


def test_refresh_writes_new_commits_with_stable_names(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    project.commit_in_tree(V1, "vllm/core.py",
                           (project.tree(V1) / "vllm/core.py").read_text() + "# B\n", "[Core] B")
    out = project.run("refresh.py", "--version", V1).stdout
    assert "Core-B.patch" in out
    names = (project.patches / f"v{V1}" / "series").read_text().split()
    assert names[-2:] == ["Core-A.patch", "Core-B.patch"]
    text = (project.patches / f"v{V1}" / "Core-B.patch").read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [PATCH] [Core] B" in text and "Signed-off-by: Test Dev" in text
    assert "\n-- \n" not in text  # no git version signature: stable across git versions
    assert "already applied" in project.run("apply.py", "--version", V1).stdout


def test_refresh_keeps_topic_names(project: Project):
    # A topic renamed by hand (file + series line) keeps its name through apply, a new
    # commit and refresh; the new commit gets its subject's name and renumbers nothing.
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    series_dir = project.patches / f"v{V1}"
    (series_dir / "Core-A.patch").rename(series_dir / "bigger-f3.patch")
    series = series_dir / "series"
    series.write_text(series.read_text().replace("Core-A.patch", "bigger-f3.patch"))
    shutil.rmtree(project.tree(V1))
    add_patch(project, V1, "vllm/core.py", "return x + 5\n", "return x + 50\n", "[Core] B")
    names = series.read_text().split()
    assert names[-2:] == ["bigger-f3.patch", "Core-B.patch"]
    assert sorted(p.name for p in series_dir.glob("*.patch")) == names[-2:][::-1]
    before = series_bytes(project, V1)
    project.run("refresh.py", "--version", V1)
    assert series_bytes(project, V1) == before


def test_failing_patch_names_patch_file_and_hunk(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 7\n", "return x + 70\n", "[Core] Seven")
    add_patch(project, V1, "vllm/core.py", "return x + 9\n", "return x + 90\n", "[Core] Nine")
    # Release 2.0.0 where f7's body differs: the first patch no longer applies.
    sha = make_sdist(project.root / "cache" / f"vllm-{V2}.tar.gz", V2,
                     {"vllm/core.py": CORE_V2})
    write_matrix(project.root, {V1: _sha(project, V1), V2: sha})
    for p in (project.patches / f"v{V1}").iterdir():
        shutil.copy(p, project.patches / f"v{V2}" / p.name)
    proc = project.run("apply.py", "--version", V2, check=False)
    assert proc.returncode == 1
    err = proc.stderr
    assert "Core-Seven.patch" in err and "vllm/core.py" in err
    assert "return x + 7" in err  # the failing hunk is shown
    assert "am --abort" in err and "make refresh" in err
    # The tree is left mid-am; --abort restores the state before the failing patch.
    subprocess.run(["git", "-C", str(project.tree(V2)), "am", "--abort"], check=True)
    assert project.git(V2, "log", "-1", "--format=%s") == "[Core] Overlay"
    assert project.git(V2, "status", "--porcelain") == ""


def test_refresh_after_resolving_keeps_pending_patches(project: Project):
    test_failing_patch_names_patch_file_and_hunk(project)
    # Resolve by hand: redo patch 1 for the new release, then refresh.
    core = project.tree(V2) / "vllm" / "core.py"
    project.commit_in_tree(V2, "vllm/core.py",
                           core.read_text().replace("return x * 7\n", "return x * 70\n"),
                           "[Core] Seven")
    out = project.run("refresh.py", "--version", V2).stdout
    assert "Core-Seven.patch" in out and "Core-Nine.patch" in out
    assert "applied Core-Nine.patch" in project.run("apply.py", "--version", V2).stdout


def _table(stdout: str) -> dict[str, str]:
    """check-series' rows by release (the table ends at the first blank line)."""
    rows = stdout.split("\n\n", 1)[0].splitlines()[2:]
    return {ln.split()[0]: ln for ln in rows}


def test_check_series_prints_table(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 7\n", "return x + 70\n", "[Core] Seven")
    sha = make_sdist(project.root / "cache" / f"vllm-{V2}.tar.gz", V2, {"vllm/core.py": CORE_V2})
    write_matrix(project.root, {V1: _sha(project, V1), V2: sha})
    for p in (project.patches / f"v{V1}").iterdir():
        shutil.copy(p, project.patches / f"v{V2}" / p.name)
    head = project.git(V1, "rev-parse", "HEAD")
    proc = project.run("check_series.py", check=False)
    assert proc.returncode == 1
    rows = _table(proc.stdout)
    assert rows[V1].split()[1:] == ["1", "OK"]
    assert "FAIL at Core-Seven.patch (vllm/core.py:" in rows[V2]
    # The build trees are left as they were.
    assert project.git(V1, "rev-parse", "HEAD") == head
    assert project.git(V2, "log", "-1", "--format=%s") == f"vLLM {V2} (pristine sdist)"


def test_check_series_refuses_a_patch_that_needs_a_3way_merge(project: Project):
    # B is made on the pristine tree; A, applied before it, changes a line of B's context
    # (not one B changes), so B applies only through a 3-way merge with its preimage blob.
    add_patch(project, V1, "vllm/core.py", "return x + 6\n", "return x + 60\n", "[Core] Sixty")
    series_dir = project.patches / f"v{V1}"
    b_text = (series_dir / "Core-Sixty.patch").read_bytes()
    shutil.rmtree(project.tree(V1))
    for p in series_dir.iterdir():
        p.unlink()
    (series_dir / "series").write_text("# series of the fixture\n")
    add_patch(project, V1, "vllm/core.py", "return x + 5\n\n\ndef f6",
              "return x + 5\n\n# f6 follows\ndef f6", "[Core] Comment")
    assert [p.name for p in series_dir.glob("*.patch")] == ["Core-Comment.patch"]
    (series_dir / "Core-Sixty.patch").write_bytes(b_text)
    with (series_dir / "series").open("a") as f:
        f.write("Core-Sixty.patch\n")
    head = project.git(V1, "rev-parse", "HEAD")

    strict = project.run("check_series.py", check=False)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    rows = _table(strict.stdout)
    assert "FAIL at Core-Sixty.patch (vllm/core.py" in rows[V1]
    assert "--3way" in rows[V1]
    assert rows[V2].split()[1:] == ["0", "OK"]

    merged = project.run("check_series.py", "--3way", check=False)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    rows = _table(merged.stdout)
    assert rows[V1].split(None, 2)[1:] == ["2", "OK (3-way merge: Core-Sixty.patch)"]
    # The checks left the build tree alone; make apply merges the patch and says so.
    assert project.git(V1, "rev-parse", "HEAD") == head
    out = project.run("apply.py", "--version", V1).stdout
    assert "applied Core-Sixty.patch (3-way merge)" in out
    assert "only through a 3-way merge" in out


def test_unknown_release_lists_supported(project: Project):
    proc = project.run("apply.py", "--version", "0.0.7", check=False)
    assert proc.returncode == 1
    assert "'0.0.7' is not supported" in proc.stderr and "1.0.0, 2.0.0" in proc.stderr


def test_missing_network_says_what_to_do(project: Project):
    (project.root / "cache" / f"vllm-{V2}.tar.gz").unlink()
    write_matrix(project.root, {V1: _sha(project, V1), V2: "0" * 64},
                 url={V2: "http://127.0.0.1:9/vllm-2.0.0.tar.gz"})
    proc = project.run("apply.py", "--version", V2, check=False)
    assert proc.returncode == 1
    assert "could not download the sdist of vLLM 2.0.0" in proc.stderr
    assert "VLLM_SDIST" in proc.stderr and str(project.root / "cache") in proc.stderr
    assert not project.tree(V2).exists()


def test_sdist_with_wrong_hash_is_refused(project: Project):
    write_matrix(project.root, {V1: "f" * 64})
    proc = project.run("apply.py", "--version", V1, check=False)
    assert proc.returncode == 1 and "not the released sdist" in proc.stderr


def test_overlay_may_not_replace_upstream_files(project: Project):
    (project.overlay / "vllm" / "core.py").write_text("replaced\n")
    proc = project.run("apply.py", "--version", V1, check=False)
    assert proc.returncode == 1 and "new files only" in proc.stderr and "vllm/core.py" in proc.stderr


def _exporter(project: Project, name: str = "Queue Dev", email: str = "queue@example.com"):
    """The environment of a contributor whose git config says who they are."""
    cfg = project.root / "exporter.gitconfig"
    lines = ["[user]"] + ([f"\tname = {name}"] if name else []) + (
        [f"\temail = {email}"] if email else [])
    cfg.write_text("\n".join(lines) + "\n")
    return {"GIT_CONFIG_GLOBAL": str(cfg), "GIT_CONFIG_NOSYSTEM": "1"}


def _export(project: Project, version: str = V1, check: bool = True, **ident):
    out = project.root / "out"
    proc = project.run("export.py", "--version", version, "--out", str(out), check=check,
                       env=_exporter(project, **ident))
    return proc, sorted(out.glob("*.patch"))


def _files_in(patch: Path) -> list[str]:
    return sorted(line.split(" b/", 1)[1] for line in patch.read_text().splitlines()
                  if line.startswith("diff --git "))


def _overlay(project: Project, files: dict[str, str]) -> None:
    shutil.rmtree(project.overlay)
    for rel, text in files.items():
        (project.overlay / rel).parent.mkdir(parents=True, exist_ok=True)
        (project.overlay / rel).write_text(text)


NEWPKG = {
    "vllm/newpkg/__init__.py": "X = 1\n",
    "vllm/newpkg/base.py": "def base():\n    return 1\n",
    # mod uses base only lazily; base must still arrive no later than mod.
    "vllm/newpkg/mod.py": "def f():\n    from vllm.newpkg.base import base\n"
                          "    return base()\n",
    "tests/newpkg/__init__.py": "",
    "tests/newpkg/conftest.py": "from tests.newpkg.utils import FIXTURE  # noqa: F401\n",
    "tests/newpkg/utils.py": "FIXTURE = 1\n",
    "tests/newpkg/test_base.py": "from vllm.newpkg import base\n",
    "tests/newpkg/test_mod.py": "from vllm.newpkg.mod import f\n",
}


def test_export_folds_each_overlay_file_into_the_first_patch_that_uses_it(project: Project):
    _overlay(project, NEWPKG)
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    add_patch(project, V1, "vllm/core.py", "def f5(x):\n",
              "def f5(x):\n    from vllm.newpkg.base import base  # noqa: F401\n",
              "[Core] B uses the base")
    add_patch(project, V1, "vllm/core.py", "def f9(x):\n",
              "def f9(x):\n    from vllm.newpkg import (  # noqa: F401\n        mod,\n    )\n",
              "[Core] C uses the module")
    proc, files = _export(project)
    assert [f.name for f in files] == ["0001-Core-A.patch", "0002-Core-B-uses-the-base.patch",
                                       "0003-Core-C-uses-the-module.patch"], proc.stdout
    assert _files_in(files[0]) == ["vllm/core.py"]
    # B: the base, its package's __init__.py, the test of the base with what it needs.
    assert _files_in(files[1]) == [
        "tests/newpkg/__init__.py", "tests/newpkg/conftest.py", "tests/newpkg/test_base.py",
        "tests/newpkg/utils.py", "vllm/core.py", "vllm/newpkg/__init__.py",
        "vllm/newpkg/base.py"]
    assert _files_in(files[2]) == ["tests/newpkg/test_mod.py", "vllm/core.py",
                                   "vllm/newpkg/mod.py"]
    assert "Overlay" not in proc.stdout and "not exported" not in proc.stdout
    # A reviewer's `git am` onto the release gives the build tree, commit by commit.
    reviewer = project.root / "reviewer"
    subprocess.run(["git", "clone", "-q", "--branch", f"v{V1}", str(project.tree(V1)),
                    str(reviewer)], check=True, env=project.env, capture_output=True)
    subprocess.run(["git", "-C", str(reviewer), "am", "-q", *map(str, files)], check=True,
                   env=project.env, capture_output=True)

    def tree_id(path, rev="HEAD"):
        return subprocess.run(["git", "-C", str(path), "rev-parse", f"{rev}^{{tree}}"],
                              check=True, capture_output=True, text=True).stdout.strip()

    assert tree_id(reviewer) == tree_id(project.tree(V1))
    ls = subprocess.run(["git", "-C", str(reviewer), "ls-tree", "-r", "--name-only", "HEAD~1"],
                        check=True, capture_output=True, text=True).stdout.split()
    assert "vllm/newpkg/base.py" in ls and "vllm/newpkg/mod.py" not in ls


def _scripts_module(name: str):
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


USES = '''"""Module docstring naming vllm.newpkg.doc_only and vllm/newpkg/doc_only.py."""
# A comment naming vllm.newpkg.comment_only.
import importlib
from typing import TYPE_CHECKING

from . import sibling
from .sub import deep

if TYPE_CHECKING:
    from vllm.newpkg.typing_only import T


class K:
    """Class docstring: vllm.newpkg.doc_only."""

    attr = 1
    """Attribute docstring: vllm.newpkg.doc_only."""


def f(x):
    """Function docstring: vllm.newpkg.doc_only."""
    from vllm.newpkg.lazy import g

    importlib.import_module("vllm.newpkg.by_string")
    importlib.import_module(".relative_string", package="vllm.newpkg")
    register("Name", "vllm.newpkg.registered", "Cls")
    resolve_obj_by_qualname("vllm.newpkg.qualname.Cls")
    run([sys.executable, "-m", "vllm.newpkg.program"])
    patch("vllm.newpkg.mocked:attr")
    print(f"a message naming vllm.newpkg.in_message {x}")
    print("a sentence about vllm.newpkg.in_sentence")
    return g(x)
'''


def test_export_reads_code_uses_with_ast_not_text():
    export = _scripts_module("export")
    mods = ["doc_only", "comment_only", "sibling", "sub.deep", "typing_only", "lazy",
            "by_string", "relative_string", "registered", "qualname", "program", "mocked",
            "in_message", "in_sentence"]
    files = {f"vllm/newpkg/{m.replace('.', '/')}.py": "" for m in mods}
    files["vllm/newpkg/__init__.py"] = ""
    files["vllm/newpkg/sub/__init__.py"] = ""
    modules = {m: rel for rel in files if (m := export.module_of(rel))}
    found = export.references("vllm/newpkg/user.py", USES, modules, set(files))
    used = sorted(PurePosixPath(f).stem if PurePosixPath(f).stem != "__init__"
                  else PurePosixPath(f).parent.name for f in found)
    # Imports anywhere (relative, lazy, TYPE_CHECKING) and strings that are a module path,
    # a qualified name or an entry point count; docstrings, comments, messages do not.
    assert used == sorted(["newpkg", "sibling", "sub", "deep", "typing_only", "lazy",
                           "by_string", "relative_string", "registered", "qualname",
                           "program", "mocked"]), used
    # Prose files name modules without using them; other files (a CI step) use what they
    # name outside comments.
    assert export.references("docs/newpkg.md", "See `vllm.newpkg.lazy`.", modules,
                             set(files)) == set()
    ci = "# vllm.newpkg.doc_only\nsteps:\n  - python -m vllm.newpkg.program\n"
    assert export.references(".buildkite/x.yaml", ci, modules, set(files)) == {
        "vllm/newpkg/program.py"}


PLACED = {
    "vllm/newpkg/__init__.py": '"""The package. Same-host reads: :mod:`vllm.newpkg.extra`."""\n',
    "vllm/newpkg/lazy.py": "def g():\n    return 1\n",
    "vllm/newpkg/extra.py": "E = 1\n",
    "vllm/newpkg/cli.py": '"""python -m vllm.newpkg.cli"""\nfrom vllm.newpkg.extra import E\n\n'
                          'if __name__ == "__main__":\n    print(E)\n',
    "tests/newpkg/__init__.py": "",
    "tests/newpkg/test_lazy.py": "from vllm.newpkg.lazy import g\n",
    "tests/newpkg/test_extra.py": "def test_e():\n    from vllm.newpkg.extra import E\n",
    "tests/newpkg/test_cli.py": "from vllm.newpkg.cli import E\n",
}


def test_export_places_a_file_where_code_uses_it_not_where_text_names_it(project: Project):
    _overlay(project, PLACED)
    # A: imports the package, whose docstring names `extra`; its own docstring and comment
    # name `extra` too, and a doc it adds names it. None of that is a use.
    project.run("apply.py", "--version", V1)
    tree = project.tree(V1)
    core = (tree / "vllm" / "core.py").read_text()
    core = core.replace("def f3(x):\n", 'def f3(x):\n    """Unlike vllm.newpkg.extra."""\n'
                        "    import vllm.newpkg  # noqa: F401  (not vllm.newpkg.extra)\n")
    _commit(project, V1, {"vllm/core.py": core, "docs/newpkg.md": "Uses vllm.newpkg.extra.\n"},
            "[Core] A imports the package\n\nBody.\n\nSigned-off-by: T <t@example.com>\n")
    # B: a lazy import, inside a function.
    add_patch(project, V1, "vllm/core.py", "def f5(x):\n",
              "def f5(x):\n    from vllm.newpkg.lazy import g  # noqa: F401\n", "[Core] B lazy")
    # C: a module path as a string in code.
    add_patch(project, V1, "vllm/core.py", "def f9(x):\n",
              'def f9(x):\n    __import__("importlib").import_module("vllm.newpkg.extra")\n',
              "[Core] C by name")
    proc, files = _export(project)
    assert _files_in(files[0]) == ["docs/newpkg.md", "vllm/core.py", "vllm/newpkg/__init__.py"], \
        proc.stdout
    assert _files_in(files[1]) == ["tests/newpkg/__init__.py", "tests/newpkg/test_lazy.py",
                                   "vllm/core.py", "vllm/newpkg/lazy.py"]
    # The program no module imports goes where the module it drives arrives, with its test.
    assert _files_in(files[2]) == ["tests/newpkg/test_cli.py", "tests/newpkg/test_extra.py",
                                   "vllm/core.py", "vllm/newpkg/cli.py", "vllm/newpkg/extra.py"]


def test_export_authors_and_signs_off_as_the_contributor(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    # The series' own sign-off (the identity of commit_in_tree) is dropped: the exporter's is
    # the only one.
    _, files = _export(project)
    text = files[0].read_text()
    head, _, _ = text.partition("\n---\n")
    assert "From: Queue Dev <queue@example.com>" in head
    assert "kv-series@localhost" not in text and "Test Dev" not in head
    trailers = head.rstrip().split("\n\n")[-1].splitlines()
    assert trailers == ["Signed-off-by: Queue Dev <queue@example.com>"], head
    # Exporting with the series' own email: one sign-off, the exporter's name.
    _, files = _export(project, name="Test Developer", email="dev@example.com")
    head = files[0].read_text().partition("\n---\n")[0]
    assert head.count("Signed-off-by:") == 1
    assert head.rstrip().endswith("Signed-off-by: Test Developer <dev@example.com>")


NOTED = """\
[Core] Make f3 bigger

Why it is bigger.

Addresses vLLM issue #1.
Drop when: upstream makes it bigger
itself (a second line of the note).

On v1.0.0 the function is
in core.py.

Checked on v1.0.0: vllm/core.py:10 (f3).

Co-authored-by: Helper Dev <helper@example.com>
Signed-off-by: Seed Placeholder <seed@users.noreply.seed.example>
Signed-off-by: Test Dev <dev@example.com>
"""


def _commit(project: Project, version: str, files: dict[str, str], message: str) -> None:
    """One commit of the series with these files and this exact message, then refresh."""
    project.run("apply.py", "--version", version)
    for rel, text in files.items():
        (project.tree(version) / rel).parent.mkdir(parents=True, exist_ok=True)
        (project.tree(version) / rel).write_text(text)
        project.git(version, "add", rel)
    project.git(version, "commit", "-q", "-m", message)
    project.run("refresh.py", "--version", version)


def test_export_strips_project_notes_and_other_sign_offs(project: Project):
    project.run("apply.py", "--version", V1)
    text = (project.tree(V1) / "vllm" / "core.py").read_text()
    _commit(project, V1, {"vllm/core.py": text.replace("x + 3\n", "x + 30\n")}, NOTED)
    proc, files = _export(project)
    head = files[0].read_text().partition("\n---\n")[0]
    body = head.split("\n\n", 1)[1]
    assert body.strip().split("\n\n") == [
        "Why it is bigger.", "Addresses vLLM issue #1.",
        "Co-authored-by: Helper Dev <helper@example.com>\n"
        "Signed-off-by: Queue Dev <queue@example.com>"], body
    for gone in ("Drop when", "itself (a second", "On v1.0.0", "in core.py.", "Checked on",
                 "Seed Placeholder", "Test Dev"):
        assert gone not in head, gone
    # The export says what it stripped and where such notes belong.
    warned = [ln for ln in proc.stdout.splitlines() if "project-only note stripped" in ln]
    assert len(warned) == 3 and "'Drop when: upstream makes it bigger' (+1 lines)" in warned[0]
    assert "patches/v1.0.0/series" in proc.stdout
    # The source patch keeps them until they are moved: check-series names it and fails.
    check = project.run("check_series.py", check=False)
    assert check.returncode == 1, check.stdout
    listed = check.stdout.split("patch messages:", 1)[1]
    assert "v1.0.0/Core-Make-f3-bigger.patch: project-only note: 'Drop when:" in listed
    assert "'On v1.0.0 the function is'" in listed and "'Checked on v1.0.0:" in listed


def test_export_refuses_subjects_upstream_would_not_take(project: Project):
    long = "[Core] " + "a very long subject " * 4
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", long.strip())
    add_patch(project, V1, "vllm/core.py", "return x + 5\n", "return x + 50\n",
              "Make f5 bigger")
    add_patch(project, V1, "vllm/core.py", "return x + 7\n", "return x + 70\n",
              "[KV Connector][NIXL] Fine")
    proc, files = _export(project, check=False)
    assert proc.returncode == 1 and not files, proc.stdout
    assert "2 of the 3 patch subjects" in proc.stderr
    assert f"{long.strip()!r}: 86 characters, more than 72" in proc.stderr
    assert "'Make f5 bigger': no vLLM area prefix" in proc.stderr
    assert "Fine" not in proc.stderr and "--draft" in proc.stderr
    # A draft writes them and names the subjects; check-series names them too.
    out = project.root / "draft"
    draft = project.run("export.py", "--version", V1, "--out", str(out), "--draft",
                        env=_exporter(project))
    assert len(list(out.glob("*.patch"))) == 3 and "'Make f5 bigger'" in draft.stdout
    check = project.run("check_series.py", check=False)
    assert check.returncode == 1
    assert "v1.0.0/Make-f5-bigger.patch: subject 'Make f5 bigger': no vLLM area" in check.stdout


def test_export_refuses_without_a_git_identity(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    proc, files = _export(project, check=False, email="")
    assert proc.returncode == 1 and "user.email is not set" in proc.stderr, proc.stderr
    assert "git config --global user.email" in proc.stderr and not files


def test_export_refuses_an_overlay_file_no_patch_uses(project: Project):
    _overlay(project, {**NEWPKG, "vllm/newpkg/dead.py": "DEAD = 1\n",
                       "tests/newpkg/test_nothing.py": "def test_x():\n    pass\n"})
    add_patch(project, V1, "vllm/core.py", "def f5(x):\n",
              "def f5(x):\n    import vllm.newpkg.mod  # noqa: F401\n", "[Core] B")
    proc, files = _export(project, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "used by no patch" in proc.stderr
    named = proc.stderr.split("used by no patch", 1)[1].split("(a patch uses", 1)[0]
    assert sorted(named.split()[-2:]) == ["tests/newpkg/test_nothing.py", "vllm/newpkg/dead.py"]
    assert "compat.py" in proc.stderr and not files


def test_export_drops_a_compat_module_the_release_does_not_import(project: Project):
    _overlay(project, {**NEWPKG, "vllm/newpkg/compat.py": "SHIM = 1\n"})
    add_patch(project, V1, "vllm/core.py", "def f5(x):\n",
              "def f5(x):\n    import vllm.newpkg.mod  # noqa: F401\n", "[Core] B")
    proc, files = _export(project)
    assert "not exported: vllm/newpkg/compat.py (compat module" in proc.stdout
    assert all("compat" not in f for p in files for f in _files_in(p))
    # A release whose glue imports the shim sends it with that glue.
    add_patch(project, V2, "vllm/core.py", "def f5(x):\n",
              "def f5(x):\n    import vllm.newpkg.mod  # noqa: F401\n"
              "    from vllm.newpkg.compat import SHIM  # noqa: F401\n", "[Core] S")
    proc, files = _export(project, V2)
    assert "vllm/newpkg/compat.py" in _files_in(files[0]) and "not exported" not in proc.stdout


def test_export_leaves_out_an_overlay_topic_the_release_does_not_carry(project: Project):
    """The fixture's overlay package is used by no patch: like VMM KV on 0.18.1."""
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    proc, files = _export(project)
    assert [f.name for f in files] == ["0001-Core-A.patch"]
    assert "not exported: vllm/newpkg/__init__.py (no patch" in proc.stdout
    assert _files_in(files[0]) == ["vllm/core.py"]


def test_export_applies_with_git_am_onto_pristine_and_reproduces_the_tree(project: Project):
    """What a reviewer does with the export: `git am` onto the released tree, nothing else."""
    _overlay(project, NEWPKG)
    add_patch(project, V1, "vllm/core.py", "return x + 3\n",
              "return x + 30 if __import__(\"vllm.newpkg.mod\") else 0\n", "[Core] A")
    add_patch(project, V1, "vllm/core.py", "return x + 9\n", "return x * 9\n", "[Core] B")
    _, files = _export(project)
    tree = project.tree(V1)
    pristine = project.root / "reviewer"
    subprocess.run(["git", "clone", "-q", "--branch", f"v{V1}", str(tree), str(pristine)],
                   check=True, env=project.env, capture_output=True)
    subprocess.run(["git", "-C", str(pristine), "am", "-q", *map(str, files)],
                   check=True, env=project.env, capture_output=True)

    def tree_id(path):
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD^{tree}"], check=True,
                              capture_output=True, text=True).stdout.strip()

    assert tree_id(pristine) == tree_id(tree)
    assert "vllm/newpkg/mod.py" in _files_in(files[0])
    assert project.git(V1, "log", "--format=%s", f"v{V1}..HEAD").splitlines()[0] == "[Core] B"


def test_export_round_trip_check_catches_a_dropped_file_that_is_needed(project: Project):
    """check_round_trip itself must be able to fail on the files it is told to leave out."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import export
        import seriestool
    finally:
        sys.path.pop(0)
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    _, files = _export(project)
    old = dict(os.environ)
    os.environ.update({k: v for k, v in project.env.items() if k.startswith("KVSERIES_")})
    try:
        release = seriestool.get_release(V1)
        export.check_round_trip(project.tree(V1), release, files,
                                dropped=["vllm/newpkg/__init__.py"])  # truly left out: OK
        with pytest.raises(seriestool.SeriesError, match="vllm/core.py"):
            export.check_round_trip(project.tree(V1), release, files[:0])
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_export_refuses_patches_that_git_am_would_change(project: Project):
    # `git am` strips the CR of CRLF lines, so such a commit would reach a reviewer altered.
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    project.commit_in_tree(V1, "vllm/crlf.txt", "one\r\ntwo\r\n", "[Misc] CRLF file")
    project.run("refresh.py", "--version", V1)
    proc = project.run("export.py", "--version", V1, "--out", str(project.root / "out"),
                       check=False)
    assert proc.returncode == 1, proc.stdout
    assert "pristine v1.0.0" in proc.stderr and "vllm/crlf.txt" in proc.stderr, proc.stderr
    assert "export again" in proc.stderr


def test_export_refuses_tree_out_of_sync(project: Project):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    project.commit_in_tree(V1, "vllm/core.py", "x\n", "[Core] Unrefreshed")
    proc = project.run("export.py", "--version", V1, check=False)
    assert proc.returncode == 1 and "make refresh" in proc.stderr


CORE_V2 = "".join(f"def f{i}(x):\n    return x {'*' if i == 7 else '+'} {i}\n\n\n"
                  for i in range(40))


def _sha(project: Project, version: str) -> str:
    import hashlib

    return hashlib.sha256((project.root / "cache" / f"vllm-{version}.tar.gz").read_bytes()
                          ).hexdigest()


def test_export_puts_a_test_with_the_patch_that_names_it(project: Project):
    _overlay(project, {**NEWPKG, "tests/newpkg/test_late.py": "from vllm.newpkg import base\n"})
    # A: a CI step that names the base's test: the library patch, with what the test needs.
    project.run("apply.py", "--version", V1)
    _commit(project, V1, {".buildkite/steps.yaml": "steps:\n  - source_file_dependencies:\n"
                          "    - tests/newpkg/test_base.py\n"},
            "[CI] A wires the base's tests\n\nBody.\n\nSigned-off-by: T <t@example.com>\n")
    add_patch(project, V1, "vllm/core.py", "def f9(x):\n",
              "def f9(x):\n    from vllm.newpkg.mod import f  # noqa: F401\n", "[Core] B mod")
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] C")
    series = project.patches / f"v{V1}" / "series"
    names = [n for n in series.read_text().splitlines() if n and not n.startswith("#")]
    # C gives the late test its feature: the series' notes say so.
    series.write_text(f"# Tests of {names[2]}: tests/newpkg/test_late.py\n"
                      + series.read_text())
    project.run("apply.py", "--version", V1)
    proc, files = _export(project)
    assert _files_in(files[0]) == [
        ".buildkite/steps.yaml", "tests/newpkg/__init__.py", "tests/newpkg/conftest.py",
        "tests/newpkg/test_base.py", "tests/newpkg/utils.py", "vllm/newpkg/__init__.py",
        "vllm/newpkg/base.py"], proc.stdout
    assert _files_in(files[1]) == ["tests/newpkg/test_mod.py", "vllm/core.py",
                                   "vllm/newpkg/mod.py"]
    assert _files_in(files[2]) == ["tests/newpkg/test_late.py", "vllm/core.py"]
    # A note that names what the series does not have stops the export.
    series.write_text(series.read_text().replace("test_late.py", "test_gone.py"))
    project.run("apply.py", "--version", V1)
    proc, files = _export(project, check=False)
    assert proc.returncode == 1 and "tests/newpkg/test_gone.py is not a test file" in proc.stderr


def test_export_sends_a_release_variant_of_an_overlay_file(project: Project):
    probing = "import importlib\n\n\ndef plan():\n    try:\n        return importlib.import_module" \
              "('vllm.new')\n    except ImportError:\n        return None\n"
    _overlay(project, {"vllm/newpkg/__init__.py": "", "vllm/newpkg/kv_compat.py": probing})
    add_patch(project, V1, "vllm/core.py", "def f5(x):\n",
              "def f5(x):\n    from vllm.newpkg.kv_compat import plan  # noqa: F401\n", "[Core] A")
    variant = project.patches / f"v{V1}" / "export" / "vllm" / "newpkg" / "kv_compat.py"
    variant.parent.mkdir(parents=True)
    variant.write_text("def plan():\n    return None\n")
    proc, files = _export(project)
    text = files[0].read_text()
    assert "+def plan():\n+    return None\n" in text and "ImportError" not in text, text
    assert f"exported as patches/v{V1}/export/vllm/newpkg/kv_compat.py" in proc.stdout
    # The build tree keeps the overlay's file (every release's tests run it).
    assert "ImportError" in (project.tree(V1) / "vllm/newpkg/kv_compat.py").read_text()
    # A variant of no overlay file stops the export.
    (variant.parent / "gone.py").write_text("")
    proc, files = _export(project, check=False)
    assert proc.returncode == 1 and "vllm/newpkg/gone.py" in proc.stderr


def _public_functions(text: str) -> dict[str, list[str]]:
    import ast

    return {n.name: [a.arg for a in n.args.args] for n in ast.parse(text).body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def test_release_variants_keep_the_interface_and_probe_nothing():
    """patches/vX/export/<path> is what the export of vX sends instead of the overlay's
    <path>: the same functions, with that release's behaviour and no probe of others."""
    import ast

    variants = sorted(ROOT.glob("patches/v*/export/**/*.py"))
    assert variants, "no release variant to check"
    for variant in variants:
        release_dir = next(d for d in variant.parents if d.parent.name == "patches")
        rel = variant.relative_to(release_dir / "export").as_posix()
        overlay = ROOT / "vllm_overlay" / rel
        assert overlay.is_file(), rel
        text = variant.read_text()
        assert _public_functions(text) == _public_functions(overlay.read_text()), rel
        probes = []
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                    "getattr", "hasattr"):
                probes.append(f"line {node.lineno}: {node.func.id}()")
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    a.name == "importlib" for a in node.names):
                probes.append(f"line {node.lineno}: importlib")
            elif isinstance(node, ast.ExceptHandler) and node.type is not None and \
                    ast.unparse(node.type) in ("ImportError", "AttributeError",
                                               "ModuleNotFoundError"):
                probes.append(f"line {node.lineno}: except {ast.unparse(node.type)}")
        assert not probes, f"{variant}: {probes}"


def test_export_leaves_out_a_test_that_needs_a_topic_the_release_does_not_carry(project: Project):
    # The test needs a shared module a patch uses and a package no patch uses (a compat
    # helper and VMM KV on 0.18.1): without the package it cannot run, so it is left out.
    _overlay(project, {
        "vllm/shared.py": "S = 1\n",
        "vllm/newpkg/__init__.py": "X = 1\n",
        "tests/newpkg/__init__.py": "",
        "tests/newpkg/test_both.py": "from vllm.newpkg import X\nfrom vllm.shared import S\n",
    })
    add_patch(project, V1, "vllm/core.py", "def f5(x):\n",
              "def f5(x):\n    from vllm.shared import S  # noqa: F401\n", "[Core] A")
    proc, files = _export(project)
    assert _files_in(files[0]) == ["vllm/core.py", "vllm/shared.py"], proc.stdout
    assert "not exported: tests/newpkg/test_both.py (needs files this release does not " \
           "carry)" in proc.stdout
