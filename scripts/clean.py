#!/usr/bin/env python3
"""Delete build trees (and their virtualenvs), refusing where that would lose the user's work.

  python3 scripts/clean.py --version 0.32.0    # build/vllm-0.32.0 only
  python3 scripts/clean.py --all               # all of build/ (the sdist cache stays)

A build tree holding anything of the user's is kept unless FORCE=1, and the refusal names it:
commits on any branch or tag that are not the series', stash entries, a git operation in
progress, uncommitted, untracked or ignored files other than the harness's own caches and build
outputs, worktrees outside build/, a git process working in it (treework.py says what is whose).
A path at build/vllm-X that is not a build tree `make apply` made (a plain directory, another
git repository, a symbolic link) is never deleted, FORCE=1 or not. `--all` checks every
build/vllm-* first and deletes nothing unless all of them may go.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import not_a_build_tree, recorded_commits, step_residue  # noqa: E402
from seriestool import (  # noqa: E402
    Release, SeriesError, build_dir, get_release, git, load_matrix, main_guard, read_state,
    stop_on_sigterm,
)
from treework import (  # noqa: E402
    HARNESS_OUTPUTS, file_work, foreign_commits, foreign_worktrees, git_processes_in,
    is_harness_worktree, linked_worktrees, operation_in_progress, rev, stash_count, tree_lock,
    worktree_paths,
)

SHOWN = 10  # entries listed per kind of work


def listing(items: list[str], indent: str = "    ") -> str:
    more = [f"... and {len(items) - SHOWN} more"] if len(items) > SHOWN else []
    return "\n".join(indent + item for item in items[:SHOWN] + more)


def release_of(tree: Path) -> Release:
    """The release a build/vllm-* is a tree of: its name's, or, for a tree moved aside
    (build/vllm-X.old), the one whose pristine tag it carries; a bare Release for a release
    the matrix no longer lists."""
    version = tree.name.removeprefix("vllm-")
    if (tree / ".git").is_dir() and not tree.is_symlink():
        tags = git(tree, "tag", "--list", "v*", check=False).stdout.split()
        if f"v{version}" not in tags:
            version = next((t[1:] for t in tags if version.startswith(t[1:])), version)
    _, releases = load_matrix()
    return releases.get(version) or Release(version, "", "", "", "", False)


def not_a_tree_problem(tree: Path, release: Release) -> str | None:
    if tree.is_symlink():
        return (f"{tree} is a symbolic link (to {os.readlink(tree)}), not a build tree "
                "that `make apply` made")
    problem = not_a_build_tree(tree, release)
    return f"{tree} is not a build tree that `make apply` made: {problem}" if problem else None


# ---------------------------------------------------------------------------------------------
# What of the user's a build tree holds


def interrupted_residue(tree: Path, state: dict) -> tuple[set[str], str | None]:
    """Files and the commit an interrupted `make apply` step left: the harness's, not work."""
    step = state.get("step")
    if not step or rev(tree, step.get("from", "")) is None:
        return set(), None
    residue = step_residue(tree, step)
    if residue.unexplained or not residue.head_ok:
        return set(), None
    return set(residue.untracked) | set(changed_paths(tree)), rev(tree, "HEAD")


def changed_paths(tree: Path) -> list[str]:
    work = file_work(tree, ignored=False)
    return work.changed + work.untracked


@dataclass
class Work:
    kind: str
    text: str
    keep: str = ""  # for commits: what names them in `git bundle create`


def work_in(tree: Path, release: Release) -> list[Work]:
    """Each thing of the user's in the tree."""
    state = read_state(tree)
    residue, residue_head = interrupted_residue(tree, state)
    found = []
    busy = git_processes_in(worktree_paths(tree))
    if busy:
        found.append(Work("busy", "git is running in it: " + "; ".join(
            f"pid {pid} ({cmd})" for pid, cmd in busy)))
    op = operation_in_progress(tree)
    if op and not residue_head:
        found.append(Work("op", f"a `git {op}` is in progress (what it has done so far)"))
    known = [release.tag] + [c for c in recorded_commits(state) + [residue_head]
                             if c and rev(tree, c)]
    for (ref, sha), commits in foreign_commits(tree, known).items():
        n = len(commits)
        keep = ref.split(" ", 1)[1] if ref.startswith(("branch ", "tag ")) else \
            "HEAD" if ref.startswith("HEAD (detached)") else sha[:12]
        found.append(Work("commits", f"{ref}: {n} commit{'s' * (n != 1)} not in "
                          f"patches/{release.tag}/:\n{listing(commits, '      ')}", keep))
    stashes = stash_count(tree)
    if stashes:
        found.append(Work("stash", f"{stashes} stash entr{'ies' if stashes != 1 else 'y'} "
                          f"(`git -C {tree} stash list`)"))
    for wt in foreign_worktrees(tree):
        found.append(Work("worktree", f"the worktree {wt} (deleting the tree's repository "
                          "breaks it)"))
    files = file_work(tree, residue=residue)
    for kind, paths, what in (("files", files.changed, "uncommitted changes to"),
                              ("files", files.untracked, "untracked files"),
                              ("files", files.ignored, "ignored files that are not the "
                               f"harness's own ({HARNESS_OUTPUTS})")):
        if paths:
            found.append(Work(kind, f"{what}:\n{listing(paths, '      ')}"))
    return found


def keep_advice(tree: Path, release: Release, work: list[Work]) -> list[str]:
    kinds, v, advice = {w.kind for w in work}, release.version, []
    if "busy" in kinds:
        advice.append("let the git process finish (or end it)")
    if "op" in kinds:
        advice.append(f"finish or abort the git operation (`git -C {tree} status` says how)")
    refs = [w.keep for w in work if w.kind == "commits"]
    if "branch series" in [w.text.split(":")[0] for w in work]:
        advice.append(f"bring the commits of branch series into the series with `make refresh "
                      f"VLLM_VERSION={v}`")
    if refs:
        advice.append(f"save the commits with `git -C {tree} bundle create <file> "
                      f"{' '.join(refs)}` (`git clone <file>` gives them back)")
    if "stash" in kinds:
        advice.append(f"save each stash entry with `git -C {tree} stash show -p "
                      "--include-untracked stash@{N} > stash-N.patch`")
    if "worktree" in kinds:
        advice.append(f"move that worktree's work elsewhere, then `git -C {tree} worktree "
                      "remove <path>`")
    if "unreadable" in kinds:
        advice.append(f"copy out what you need, or repair the repository (`git -C {tree} "
                      "fsck` says what is wrong)")
    if "files" in kinds:
        advice.append(f"commit the files (then `make refresh VLLM_VERSION={v}`) or copy them "
                      f"out of {tree}")
    return advice


def work_error(tree: Path, release: Release, work: list[Work], action: str) -> str:
    items = "\n".join(f"  - {w.text}" for w in work)
    return (f"{tree} holds work that is not in the series:\n{items}\n\n"
            f"To keep it: {'; '.join(keep_advice(tree, release, work))}. "
            f"To delete it with the tree anyway: `make {action} FORCE=1`.")


# ---------------------------------------------------------------------------------------------
# Deleting


def remove(path: Path) -> None:
    """Rename into build/.trash/ (atomic: the tree is whole or gone), then delete."""
    trash = build_dir() / ".trash"
    trash.mkdir(parents=True, exist_ok=True)
    moved = trash / f"{path.name}.{os.getpid()}"
    path.rename(moved)
    shutil.rmtree(moved)


def remove_tree(tree: Path) -> None:
    """The tree and the harness's own worktrees of it (build/.<name>/vllm-X)."""
    own = [path for _, path in linked_worktrees(tree) if is_harness_worktree(path)]
    remove(tree)
    for path in own:
        shutil.rmtree(path, ignore_errors=True)


def sweep_trash() -> None:
    """What an interrupted clean left in build/.trash/."""
    shutil.rmtree(build_dir() / ".trash", ignore_errors=True)


@dataclass
class Verdict:
    refusal: str = ""               # why the tree may not be deleted ("" if it may)
    forced: list[Work] = field(default_factory=list)  # the work FORCE=1 deletes with it


def check(tree: Path, force: bool, action: str) -> Verdict:
    release = release_of(tree)
    problem = not_a_tree_problem(tree, release)
    if problem:
        return Verdict(f"{problem}.\n\nThe harness deletes only trees it made, FORCE=1 or "
                       f"not; move it out of {tree.parent} (e.g. `mv {tree} ~/{tree.name}"
                       ".moved`) or delete it yourself.")
    try:
        work = work_in(tree, release)
    except SeriesError as e:  # a repository git cannot read: nothing can be told apart
        work = [Work("unreadable", f"git cannot read the repository: {e.problem}")]
    if force:
        return Verdict(forced=work)
    return Verdict(work_error(tree, release, work, action) if work else "")


def deleted(tree: Path, verdict: Verdict) -> str:
    if not verdict.forced:
        return f"{tree}: deleted"
    items = "\n".join(f"  - {w.text}" for w in verdict.forced)
    return f"{tree}: deleted (FORCE=1), and with it:\n{items}"


def clean_tree(release: Release, force: bool) -> str:
    tree = release.tree
    if not tree.exists() and not tree.is_symlink():
        return f"{tree}: not there"
    with tree_lock(tree):
        verdict = check(tree, force, f"clean-tree VLLM_VERSION={release.version}")
        if verdict.refusal:
            raise SeriesError(f"`make clean-tree` deleted nothing. {verdict.refusal}")
        remove_tree(tree)
    sweep_trash()
    return deleted(tree, verdict)


def trees_in_build() -> list[Path]:
    build = build_dir()
    return sorted(p for p in build.glob("vllm-*")) if build.is_dir() else []


def clean_all(force: bool) -> str:
    build = build_dir()
    if not build.exists():
        return f"{build}: not there"
    with ExitStack() as stack:
        trees = trees_in_build()
        # Also the trees a running `make apply` may be making (build/.unpack-X) right now.
        _, releases = load_matrix()
        for tree in sorted(set(trees) | {r.tree for r in releases.values()}):
            stack.enter_context(tree_lock(tree))
        verdicts = {t: check(t, force, "clean") for t in trees}
        refusals = [v.refusal for v in verdicts.values() if v.refusal]
        if refusals:
            raise SeriesError("`make clean` deleted nothing: " + "\n\n".join(refusals))
        for tree in trees:
            remove_tree(tree)
        shutil.rmtree(build, ignore_errors=True)
    return "\n".join([deleted(t, v) for t, v in verdicts.items() if v.forced] +
                     [f"{build}: deleted"])


def main() -> None:
    stop_on_sigterm()
    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--all", action="store_true")
    args = p.parse_args()
    force = os.environ.get("FORCE") == "1"
    if args.all:
        print(clean_all(force))
        return
    try:
        release = get_release(args.version)
    except SeriesError:
        if not args.version or not (build_dir() / f"vllm-{args.version}").exists():
            raise
        release = release_of(build_dir() / f"vllm-{args.version}")  # no longer in the matrix
    print(clean_tree(release, force))


if __name__ == "__main__":
    main_guard(main)
