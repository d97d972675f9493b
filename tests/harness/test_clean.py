"""`make clean-tree` / `make clean` (scripts/clean.py) on fixture releases: what counts as the
user's work, and that nothing of it is deleted without FORCE=1 (see scripts/treework.py)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
from pathlib import Path

from conftest import Project, write_matrix

V1, V2 = "1.0.0", "2.0.0"


def clean(project: Project, *args: str, force: bool = False):
    env = {"FORCE": "1"} if force else {}
    return project.run("clean.py", *args, check=False, env=env)


def clean_tree(project: Project, version: str = V1, force: bool = False):
    return clean(project, "--version", version, force=force)


def applied(project: Project, version: str = V1) -> Path:
    project.run("apply.py", "--version", version)
    return project.tree(version)


def refused(proc, *names: str) -> str:
    """The refusal's text; it names each of `names`, says FORCE=1 overrides, deleted nothing."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr
    for name in names:
        assert name in err, f"{name!r} not in:\n{err}"
    assert "deleted nothing" in err, err
    return err


def git_in(path: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


def test_clean_tree_deletes_a_tree_holding_only_harness_outputs(project: Project):
    tree = applied(project)
    (tree / "vllm" / "__pycache__").mkdir()
    (tree / "vllm" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\0")
    (tree / "vllm_kv.egg-info").mkdir()
    (tree / "vllm_kv.egg-info" / "PKG-INFO").write_text("Name: vllm\n")
    # A kernel `make install` copied in, listed where install lists it.
    (tree / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    with open(tree / ".git" / "info" / "exclude", "a") as f:
        f.write("/vllm/_C.abi3.so\n")
    proc = clean_tree(project)
    assert proc.returncode == 0, proc.stderr
    assert "deleted" in proc.stdout and not tree.exists()


def test_clean_tree_refuses_commits_on_another_branch(project: Project):
    tree = applied(project)
    git_in(tree, "switch", "-q", "-c", "wip")
    project.commit_in_tree(V1, "vllm/core.py", "mine = 1\n", "[Core] My experiment")
    git_in(tree, "switch", "-q", "series")
    err = refused(clean_tree(project), "branch wip: 1 commit", "[Core] My experiment", "FORCE=1",
                  "bundle create")
    assert "make clean-tree VLLM_VERSION=1.0.0 FORCE=1" in err
    assert tree.exists() and git_in(tree, "log", "-1", "--format=%s", "wip") == \
        "[Core] My experiment"


def test_clean_tree_refuses_a_detached_head_and_a_tag_with_their_own_commits(project: Project):
    tree = applied(project)
    git_in(tree, "switch", "-q", "--detach")
    project.commit_in_tree(V1, "vllm/core.py", "mine = 1\n", "[Core] Detached work")
    git_in(tree, "tag", "keep-me")
    project.commit_in_tree(V1, "vllm/core.py", "mine = 2\n", "[Core] More detached work")
    err = refused(clean_tree(project), "HEAD (detached): 2 commits", "tag keep-me: 1 commit")
    assert "[Core] More detached work" in err
    assert tree.exists()


def test_clean_tree_refuses_a_stash(project: Project):
    tree = applied(project)
    (tree / "vllm" / "core.py").write_text("stashed edit\n")
    git_in(tree, "stash", "-q", env=project.env)
    assert git_in(tree, "status", "--porcelain") == ""
    err = refused(clean_tree(project), "1 stash entry", "stash show -p", "FORCE=1")
    assert "untracked" not in err.split("To keep it")[0]
    assert tree.exists() and git_in(tree, "stash", "list")


def test_clean_tree_refuses_untracked_and_uncommitted_files(project: Project):
    tree = applied(project)
    (tree / "notes.txt").write_text("mine\n")
    (tree / "vllm" / "core.py").write_text("edited\n")
    refused(clean_tree(project), "untracked files:", "notes.txt",
                  "uncommitted changes to:", "vllm/core.py", "FORCE=1")
    assert (tree / "notes.txt").read_text() == "mine\n"


def test_clean_tree_refuses_ignored_files_the_harness_did_not_make(project: Project):
    tree = applied(project)
    # Ignored by the sdist's .gitignore (*.so) or the tree's exclude file, but the user's.
    (tree / "vllm" / "my_kernel.so").write_bytes(b"\x7fELF mine")
    with open(tree / ".git" / "info" / "exclude", "a") as f:
        f.write(".env\n")
    (tree / ".env").write_text("TOKEN=mine\n")
    (tree / "vllm" / "__pycache__").mkdir()
    (tree / "vllm" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\0")
    err = refused(clean_tree(project), "ignored files that are not the harness's own",
                  "vllm/my_kernel.so", ".env", "FORCE=1")
    assert "vllm/__pycache__" not in err
    assert (tree / ".env").exists() and (tree / "vllm" / "my_kernel.so").exists()


def test_clean_tree_never_deletes_a_plain_directory(project: Project):
    tree = project.tree(V1)
    (tree / "data").mkdir(parents=True)
    (tree / "data" / "results.csv").write_text("1,2\n")
    for force in (False, True):
        err = refused(clean_tree(project, force=force), str(tree), "not a git repository",
                      "FORCE=1 or not")
        assert "mv " in err
        assert (tree / "data" / "results.csv").read_text() == "1,2\n"


def test_clean_tree_never_deletes_a_foreign_git_repository(project: Project):
    tree = project.tree(V1)
    tree.mkdir(parents=True)
    git_in(tree, "init", "-q")
    (tree / "README").write_text("someone's vLLM clone\n")
    git_in(tree, "add", "README", env=project.env)
    git_in(tree, "commit", "-q", "-m", "init", env=project.env)
    # Even with the release's tag: the tag is not the harness's pristine commit.
    git_in(tree, "tag", f"v{V1}")
    for force in (False, True):
        refused(clean_tree(project, force=force), str(tree), "not the pristine sdist commit")
        assert (tree / "README").exists()


def test_clean_tree_never_deletes_through_a_symlink(project: Project):
    elsewhere = project.root / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x\n")
    project.tree(V1).parent.mkdir(parents=True)
    project.tree(V1).symlink_to(elsewhere)
    refused(clean_tree(project, force=True), "symbolic link")
    assert (elsewhere / "keep").exists() and project.tree(V1).is_symlink()


def test_clean_tree_with_force_deletes_the_work_too(project: Project):
    tree = applied(project)
    git_in(tree, "switch", "-q", "-c", "wip")
    project.commit_in_tree(V1, "vllm/core.py", "mine = 1\n", "[Core] My experiment")
    (tree / "notes.txt").write_text("mine\n")
    git_in(tree, "stash", "-q", "-u", env=project.env)
    proc = clean_tree(project, force=True)
    assert proc.returncode == 0, proc.stderr
    assert not tree.exists()
    # It says what went with the tree.
    assert "FORCE=1" in proc.stdout and "branch wip: 1 commit" in proc.stdout
    assert "1 stash entry" in proc.stdout


def test_clean_tree_deletes_the_harness_worktrees_of_the_tree(project: Project):
    tree = applied(project)
    stock = project.root / "build" / ".stock" / f"vllm-{V1}"
    git_in(tree, "worktree", "add", "-q", "--detach", str(stock), f"v{V1}")
    assert clean_tree(project).returncode == 0
    assert not tree.exists() and not stock.exists()


def test_clean_tree_refuses_a_worktree_outside_build(project: Project):
    tree = applied(project)
    mine = project.root / "my-worktree"
    git_in(tree, "worktree", "add", "-q", "-b", "mine", str(mine), "series")
    refused(clean_tree(project), f"the worktree {mine}")
    assert tree.exists()


def test_clean_all_refuses_as_a_whole_before_deleting_anything(project: Project):
    t1, t2 = applied(project, V1), applied(project, V2)
    venv = project.root / "build" / f"venv-{V1}"
    venv.mkdir()
    git_in(t2, "switch", "-q", "-c", "wip")
    project.commit_in_tree(V2, "vllm/core.py", "mine = 1\n", "[Core] Work in 2")
    git_in(t2, "switch", "-q", "series")
    err = refused(clean(project, "--all"), str(t2), "branch wip: 1 commit", "make clean FORCE=1")
    assert str(t1) not in err
    assert t1.exists() and t2.exists() and venv.exists()
    proc = clean(project, "--all", force=True)
    assert proc.returncode == 0, proc.stderr
    assert not (project.root / "build").exists()


def test_clean_all_never_deletes_a_directory_that_is_not_a_build_tree(project: Project):
    t1 = applied(project, V1)
    other = project.root / "build" / "vllm-9.9.9"
    other.mkdir()
    (other / "mine.txt").write_text("x\n")
    for force in (False, True):
        refused(clean(project, "--all", force=force), str(other), "not a git repository")
        assert t1.exists() and (other / "mine.txt").exists()
    other.rename(project.root / "moved")
    assert clean(project, "--all").returncode == 0
    assert not (project.root / "build").exists()


def test_clean_all_checks_a_tree_moved_aside_in_build(project: Project):
    tree = applied(project)
    moved = tree.with_name(f"vllm-{V1}.old")
    tree.rename(moved)
    (moved / "notes.txt").write_text("mine\n")
    refused(clean(project, "--all"), str(moved), "notes.txt")
    (moved / "notes.txt").unlink()
    assert clean(project, "--all").returncode == 0 and not moved.exists()


def test_clean_all_checks_a_tree_of_a_release_the_matrix_no_longer_lists(project: Project):
    t2 = applied(project, V2)
    (t2 / "notes.txt").write_text("mine\n")
    sha = hashlib.sha256((project.root / "cache" / f"vllm-{V1}.tar.gz").read_bytes()).hexdigest()
    write_matrix(project.root, {V1: sha})  # the matrix drops 2.0.0
    refused(clean(project, "--all"), str(t2), "notes.txt")
    assert t2.exists()
    assert clean_tree(project, V2, force=True).returncode == 0 and not t2.exists()


def test_clean_tree_refuses_while_another_harness_command_works_on_the_tree(project: Project):
    tree = applied(project)
    fd = os.open(project.root / "build" / f".vllm-{V1}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, b"4242\n")
        for force in (False, True):
            proc = clean_tree(project, force=force)
            assert proc.returncode == 1 and "pid 4242" in proc.stderr, proc.stderr
            assert "is working on" in proc.stderr and tree.exists()
    finally:
        os.close(fd)
    assert clean_tree(project).returncode == 0
