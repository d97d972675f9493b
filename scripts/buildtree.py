"""The build tree of a release: pristine sdist commit, overlay commit, one commit per patch.

    build/vllm-X   git repo, branch `series`
      tag vX       the sdist exactly as released (every file, .gitignore'd ones too)
      commit       "overlay": vllm_overlay/ copied in (subject from patches/overlay.msg)
      commits      one per patch of patches/vX/series, made by `git am --3way`

Harness-made commits use a fixed identity and dates, so the same inputs give the same commit
ids. .git/kv-series-state.json records which commits the harness made from which inputs; any
other commit is the user's and is never discarded.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from fetch import fetch_sdist
from seriestool import (
    HARNESS_IDENT, Release, SeriesError, build_dir, git, git_out, overlay_digest, overlay_dir,
    overlay_files, overlay_message, read_series, read_state, run, sha256_file, write_state,
)
from treework import (
    busy_error, clear_stale_locks, file_work, git_processes_in, installed_kernels,
    is_harness_commit, is_harness_output, operation_in_progress, rev, status, tree_lock,
    worktree_paths,
)

BRANCH = "series"


def git_dir(tree: Path) -> Path:
    return Path(git_out(tree, "rev-parse", "--absolute-git-dir"))


def pristine_subject(release: Release) -> str:
    return f"vLLM {release.version} (pristine sdist)"


def not_a_build_tree(tree: Path, release: Release) -> str | None:
    """Why `tree` is not a build tree that `make apply` made for the release, or None.

    A build tree is a git repository (not a linked worktree) whose tag vX is the harness's
    pristine commit: a root commit with the harness's committer and subject."""
    if not tree.is_dir():
        return "it is not a directory"
    if not (tree / ".git").is_dir():
        return "it is not a git repository" if not (tree / ".git").exists() else \
            "it is a worktree of another git repository"
    pristine = rev(tree, f"refs/tags/{release.tag}")
    if pristine is None:
        return f"its git repository has no tag {release.tag}"
    parents, subj, committer = git_out(
        tree, "log", "-1", "--format=%P%x00%s%x00%ce", pristine).split("\0")
    if parents or subj != pristine_subject(release) or \
            committer != HARNESS_IDENT["GIT_COMMITTER_EMAIL"]:
        return f"its tag {release.tag} is not the pristine sdist commit that `make apply` makes"
    return None


def is_build_tree(tree: Path, release: Release) -> bool:
    return not_a_build_tree(tree, release) is None


def ensure_pristine(release: Release, log=print) -> Path:
    """Create build/vllm-X with the pristine sdist committed and tagged vX, if not there.

    The tree is made in build/.unpack-X and renamed into place once tagged, so an interrupted
    run leaves build/vllm-X complete or absent; the next run deletes the half-made copy."""
    tree = release.tree
    with tree_lock(tree):
        if tree.exists():
            problem = not_a_build_tree(tree, release)
            if problem:
                raise SeriesError(
                    f"{tree} exists but is not a build tree of vLLM {release.version}: "
                    f"{problem}. The harness does not touch it.",
                    f"Move it out of {tree.parent} (e.g. `mv {tree} ~/vllm-{release.version}"
                    ".moved`) and run the command again; the harness recreates the tree from "
                    "the release's sdist.",
                )
            return tree
        sdist = fetch_sdist(release)
        tmp = tree.parent / f".unpack-{release.version}"
        if tmp.exists():
            shutil.rmtree(tmp)
            log(f"removed {tmp}: a half-made build tree left by an interrupted `make apply`")
        tmp.mkdir(parents=True)
        made = unpack(sdist, tmp)
        commit_pristine(made, release)
        made.rename(tree)
        tmp.rmdir()
    return tree


def unpack(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, **kwargs)
    top = list(dest.iterdir())
    if len(top) != 1 or not top[0].is_dir():
        raise SeriesError(f"{sdist} does not unpack to one top-level directory.")
    return top[0]


def commit_pristine(tree: Path, release: Release) -> None:
    git(tree, "init", "-q", f"--initial-branch={BRANCH}")
    # -f: the sdist ships files its own .gitignore names (e.g. vllm/_version.py); pristine
    # means every file of the sdist.
    git(tree, "add", "-A", "-f")
    git(tree, "commit", "-q", "--no-verify", "-m", pristine_subject(release))
    git(tree, "tag", release.tag)
    write_state(tree, {})


def dirty_paths(tree: Path) -> list[str]:
    """Uncommitted changes and untracked files, harness outputs (caches) left out."""
    work = file_work(tree, ignored=False)
    return work.changed + work.untracked


def commits_after(tree: Path, base: str) -> list[str]:
    out = git_out(tree, "rev-list", "--reverse", f"{base}..HEAD")
    return out.split() if out else []


def subject(tree: Path, commit: str) -> str:
    return git_out(tree, "log", "-1", "--format=%s", commit)


def require_applied_tree(release: Release, action: str, clean: bool = True) -> Path:
    """The build tree, applied (and clean, unless clean=False), for an action that works
    from it; else an error."""
    tree = release.tree
    if not is_build_tree(tree, release) or not read_state(tree).get("overlay"):
        raise SeriesError(f"there is no applied build tree at {tree}.",
                          f"Run `make apply VLLM_VERSION={release.version}` first.")
    require_not_interrupted(tree, release, action)
    if clean:
        require_clean(tree, release, action)
    return tree


def require_not_interrupted(tree: Path, release: Release, action: str) -> None:
    step = read_state(tree).get("step")
    if step:
        raise SeriesError(
            f"`make apply` was interrupted in {tree} while {describe(step)}; the tree is "
            f"between two states, so `make {action}` does not work from it.",
            f"Run `make apply VLLM_VERSION={release.version}` (it finishes the interrupted "
            f"apply, or says what keeps it from doing so), then `make {action}` again.",
        )


OPERATION_FIX = {
    "rebase": "finish it (`git -C {t} rebase --continue`) or go back (`git -C {t} rebase --abort`)",
    "merge": "finish it (`git -C {t} commit`) or go back (`git -C {t} merge --abort`)",
    "cherry-pick": "finish it (`git -C {t} cherry-pick --continue`) or go back "
                   "(`git -C {t} cherry-pick --abort`)",
    "revert": "finish it (`git -C {t} revert --continue`) or go back (`git -C {t} revert --abort`)",
    "bisect": "end it (`git -C {t} bisect reset`)",
}


def require_clean(tree: Path, release: Release, action: str) -> None:
    v = release.version
    require_not_interrupted(tree, release, action)
    op = operation_in_progress(tree)
    if op == "am":
        raise am_in_progress_error(tree, release, action)
    if op:
        raise SeriesError(
            f"a `git {op}` is in progress in {tree}; `make {action}` does not touch a tree in "
            "the middle of one.",
            f"First {OPERATION_FIX[op].format(t=tree)}, then run `make {action} "
            f"VLLM_VERSION={v}` again.",
        )
    dirty = dirty_paths(tree)
    if dirty:
        listing = "\n".join(f"  {p}" for p in dirty[:10])
        more = f"\n  ... and {len(dirty) - 10} more" if len(dirty) > 10 else ""
        raise SeriesError(
            f"the build tree {tree} has local changes that are not committed; `make {action}` "
            f"refuses to touch it so nothing is lost:\n{listing}{more}",
            f"To keep them in the series: commit them in the build tree "
            f"(`git -C {tree} commit -a -s`), then `make refresh VLLM_VERSION={v}` writes them "
            f"into patches/{release.tag}/. To set them aside: `git -C {tree} stash push "
            f"--include-untracked`.",
        )


def am_in_progress_error(tree: Path, release: Release, action: str) -> SeriesError:
    """The true story of a `git am` in progress: one `make apply` stopped at, or another."""
    v, pending = release.version, read_state(tree).get("pending")
    if pending:
        problem = (f"`make apply` stopped in {tree} at patch {pending[0]} of "
                   f"patches/{release.tag}/series, which does not apply to vLLM {v}; the tree "
                   "is still in the middle of that `git am`.")
    else:
        problem = (f"a `git am` is in progress in {tree} that `make apply` has no record of "
                   "(one started by hand, or left by a harness older than the one that records "
                   "its steps).")
    return SeriesError(
        problem,
        f"Either finish it (edit the files, `git -C {tree} add <files>`, "
        f"`git -C {tree} am --continue`, then `make refresh VLLM_VERSION={v}`), or go back "
        f"with `git -C {tree} am --abort`. Then run `make {action} VLLM_VERSION={v}` again.",
    )


def require_on_branch(tree: Path, release: Release, action: str) -> None:
    """`make apply` keeps the branch `series`; it never moves another branch or a detached
    HEAD."""
    head = git(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip()
    if head != BRANCH:
        where = f"branch {head}" if head else "a detached HEAD"
        raise SeriesError(
            f"{tree} has {where} checked out, not the branch {BRANCH} that `make apply` "
            f"maintains; `make {action}` does not move it.",
            f"Check out {BRANCH} again (`git -C {tree} switch {BRANCH}`; your branch keeps its "
            f"commits), then run `make {action} VLLM_VERSION={release.version}` again.",
        )


def recorded_commits(state: dict) -> list[str]:
    """The commits the harness made (overlay, then one per patch), oldest first."""
    if not state.get("overlay"):
        return []
    return [state["overlay"]["commit"]] + [p["commit"] for p in state.get("patches", [])]


def require_no_user_commits(tree: Path, release: Release, action: str) -> None:
    """Refuse when HEAD has commits after vX that the harness did not make (the user's work)."""
    commits = commits_after(tree, release.tag)
    recorded = recorded_commits(read_state(tree))
    foreign = [c for c in commits if c not in recorded]
    if foreign or commits != recorded[: len(commits)]:
        listing = "\n".join(f"  {c[:12]} {subject(tree, c)}" for c in (foreign or commits))
        raise SeriesError(
            f"the build tree {tree} has commits that are not in patches/{release.tag}/:"
            f"\n{listing}\n`make {action}` refuses to touch them so nothing is lost.",
            f"To keep them: `make refresh VLLM_VERSION={release.version}` writes them into the "
            f"series. To drop them: `git -C {tree} reset --hard <commit>`, then "
            f"`make {action} VLLM_VERSION={release.version}` again.",
        )


# ---------------------------------------------------------------------------------------------
# Steps of `make apply`, recorded before they run, so an interrupted one can be undone
#
# Before each step that changes the tree (reset to an earlier commit, check out the overlay
# commit, `git am` one patch), the state records it as {"step": ..., "from": HEAD, "to": the
# commit or tree it makes}. A later `make apply` that finds a step recorded knows the harness
# was interrupted in it: every file that differs from HEAD must hold its content at "from" or
# at "to" (or be absent where one of them lacks it; where the step rewrites a file, it may
# also be absent or hold the start of either content: git deletes a file, then writes the new
# one), and HEAD must be "from", "to", or a harness-made child of "from". Then all of it is the
# harness's, and the step is undone (the `git am` aborted, the tree reset to "from") and done
# again. Anything else is the user's: apply refuses and says how to set it aside.


def describe(step: dict) -> str:
    if step.get("step") == "am":
        return f"`git am` applied {step.get('patch')}"
    if step.get("step") == "overlay":
        return "it checked out the overlay commit"
    return f"it reset the tree to {str(step.get('to'))[:12]}"


@dataclass
class Residue:
    head_ok: bool                  # HEAD is one the step explains
    unexplained: list[str]         # paths whose content the step does not explain
    untracked: list[str]           # untracked files the step made (reset --hard keeps them)


def step_residue(tree: Path, step: dict) -> Residue:
    start, to = step["from"], step.get("to")
    head = rev(tree, "HEAD")
    head_ok = head in (start, to) or (head is not None and is_harness_commit(tree, head)
                                      and git_out(tree, "log", "-1", "--format=%P", head) == start)
    kernels = installed_kernels(tree)
    entries = [e for e in status(tree)
               if not (e.code == "??" and is_harness_output(e.path, kernels))]
    paths = sorted({e.path for e in entries})
    known = [blobs_in(tree, c, paths) for c in (start, to) if c]
    worktree, index = worktree_blobs(tree, paths), index_blobs(tree, paths)

    def explained(path: str) -> bool:
        allowed = {k.get(path) for k in known}
        if len(allowed) > 1:  # the step rewrites it, and git deletes a file before writing it
            allowed.add(None)
        if not all(b in allowed for b in index.get(path, [None])):
            return False
        return worktree.get(path) in allowed or (len(allowed) > 1 and half_written(
            tree / path, [b for b in allowed if b]))

    unexplained = [p for p in paths if not explained(p)]
    # Files the step wrote that the index does not know yet: `reset --hard` keeps them.
    untracked = [e.path for e in entries if e.code == "??" and e.path not in unexplained
                 and e.path not in known[0]]
    return Residue(head_ok, unexplained, untracked)


def half_written(path: Path, blobs: list[str]) -> bool:
    """The file holds the start of one of these blobs: git was killed while writing it."""
    if not path.is_file():
        return False
    data = path.read_bytes()
    return any(blob_bytes(path.parent, b).startswith(data) for b in blobs)


def blob_bytes(cwd: Path, blob: str) -> bytes:
    return subprocess.run(["git", "cat-file", "blob", blob], cwd=cwd, check=True,
                          capture_output=True).stdout


def _chunks(paths: list[str], n: int = 500):
    for i in range(0, len(paths), n):
        yield paths[i:i + n]


def blobs_in(tree: Path, treeish: str, paths: list[str]) -> dict[str, str]:
    found = {}
    for chunk in _chunks(paths):
        out = git(tree, "--literal-pathspecs", "ls-tree", "-r", "-z", treeish, "--", *chunk).stdout
        for item in filter(None, out.split("\0")):
            meta, _, path = item.partition("\t")
            found[path] = meta.split()[2]
    return found


def index_blobs(tree: Path, paths: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for chunk in _chunks(paths):
        out = git(tree, "--literal-pathspecs", "ls-files", "-s", "-z", "--", *chunk).stdout
        for item in filter(None, out.split("\0")):
            meta, _, path = item.partition("\t")
            found.setdefault(path, []).append(meta.split()[1])
    return found


def worktree_blobs(tree: Path, paths: list[str]) -> dict[str, str]:
    present = [p for p in paths if (tree / p).is_file()]
    found = {}
    for chunk in _chunks(present):
        out = run(["git", "hash-object", "--stdin-paths"], cwd=tree,
                  stdin_text="\n".join(chunk) + "\n").stdout.split()
        found.update(zip(chunk, out))
    return found


def recover_interrupted(tree: Path, release: Release, log=print) -> None:
    """Undo what an interrupted `make apply` left (stale git locks, a half-done step), or
    refuse with the commands that let the next `make apply` do it."""
    clear_stale_locks(tree, log)
    sweep_scratch(tree)
    state = read_state(tree)
    step = state.get("step")
    if not step:
        return
    busy = git_processes_in(worktree_paths(tree))
    if busy:
        raise busy_error(tree, busy, f"`make apply` was interrupted there while {describe(step)}"
                         "; this may be its git, still working.")
    if rev(tree, step.get("from", "")) is None:  # nothing to go back to: forget the step
        state.pop("step")
        write_state(tree, state)
        return
    residue = step_residue(tree, step)
    am = operation_in_progress(tree) == "am"
    if residue.unexplained or not residue.head_ok:
        if am and step.get("step") == "am":
            raise interrupted_am_error(tree, release, state, residue)
        # Not (or no longer) the harness's state: the user has taken the tree over since;
        # what they made speaks for itself (require_clean, require_no_user_commits).
        state.pop("step")
        write_state(tree, state)
        return
    undo_step(tree, step, am, residue)
    state.pop("step")
    write_state(tree, state)
    log(f"{tree}: undid the step an interrupted `make apply` was in ({describe(step)}); "
        "applying again")


def sweep_scratch(tree: Path) -> None:
    """The harness's scratch files in .git that a killed run may have left (temporary indexes,
    a commit message, a state file being written)."""
    gd = tree / ".git"
    for path in [*gd.glob("kv-series-*.index"), *gd.glob("kv-series-*.msg"),
                 *gd.glob("kv-series-state.json.tmp-*")]:
        path.unlink(missing_ok=True)


def undo_step(tree: Path, step: dict, am: bool, residue: Residue) -> None:
    if am:
        git(tree, "am", "--abort", check=False)
        if operation_in_progress(tree) == "am":
            git(tree, "am", "--quit", check=False)
        if operation_in_progress(tree) == "am":  # killed before `git am` could mark it
            shutil.rmtree(tree / ".git" / "rebase-apply")
    git(tree, "reset", "-q", "--hard", step["from"])
    for path in residue.untracked:
        (tree / path).unlink(missing_ok=True)


def interrupted_am_error(tree: Path, release: Release, state: dict,
                         residue: Residue) -> SeriesError:
    step, v = state["step"], release.version
    listing = "\n".join(f"  {p}" for p in residue.unexplained[:10]) or \
        f"  HEAD is {rev(tree, 'HEAD')[:12]}"
    if step.get("to") is None:
        # The patch does not apply as it is: the tree is where a conflict stop leaves it.
        state.pop("step")
        state["pending"] = step.get("pending", [step.get("patch")])
        write_state(tree, state)
        return SeriesError(
            f"`make apply` was interrupted in {tree} while `git am` applied {step['patch']}, "
            f"which does not apply to vLLM {v} as it is; the tree is in the middle of that "
            f"`git am`, with changes since:\n{listing}",
            f"Either finish it (edit the files, `git -C {tree} add <files>`, "
            f"`git -C {tree} am --continue`, then `make refresh VLLM_VERSION={v}`), or go back "
            f"with `git -C {tree} am --abort`. Then run `make apply VLLM_VERSION={v}` again.",
        )
    return SeriesError(
        f"`make apply` was interrupted in {tree} while `git am` applied {step['patch']}, and "
        f"the tree has changes since that this step did not make:\n{listing}\n"
        "`make apply` leaves them alone.",
        f"Set them aside (`git -C {tree} stash push --include-untracked`; they stay in "
        f"`git -C {tree} stash list`), then run `make apply VLLM_VERSION={v}` again: it undoes "
        "the interrupted `git am` and applies the series.",
    )


# ---------------------------------------------------------------------------------------------
# Overlay and patches


def overlay_commit(tree: Path, release: Release) -> str:
    """The overlay commit (vllm_overlay/ as one commit on HEAD, empty if no files), made
    without touching the tree's files or index: a temporary index reads the overlay as its
    work tree. The caller checks it out (commit_overlay, apply_onto)."""
    files = [str(rel) for rel in overlay_files()]
    clashes = [rel for rel in files
               if git(tree, "cat-file", "-e", f"{release.tag}:{rel}", check=False).returncode == 0]
    if clashes:
        raise SeriesError(
            "vllm_overlay/ holds files that already exist in vLLM "
            f"{release.version}: {', '.join(clashes)}. The overlay is for new files only.",
            "Move the change to those files into a patch of the series instead.",
        )
    gd = git_dir(tree)
    index, msg = gd / "kv-series-overlay.index", gd / "kv-series-overlay.msg"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(tree, "read-tree", "HEAD", env=env)
        if files:
            git(overlay_dir(), f"--git-dir={gd}", f"--work-tree={overlay_dir()}", "add", "-f",
                "--", *files, env=env)
        tree_id = git_out_env(tree, env, "write-tree")
        msg.write_text(clean_message(overlay_message()))
        return git_out_env(tree, {}, "commit-tree", tree_id, "-p", "HEAD", "-F", str(msg))
    finally:
        index.unlink(missing_ok=True)
        msg.unlink(missing_ok=True)


def git_out_env(tree: Path, env: dict, *args: str) -> str:
    return git(tree, *args, env=env).stdout.strip()


def clean_message(text: str) -> str:
    """What `git commit -F` makes of a message (cleanup "whitespace"), so the overlay commit
    is the one `git commit` made before."""
    lines: list[str] = []
    for line in text.splitlines():
        line = line.rstrip()
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def commit_overlay(tree: Path, release: Release) -> str:
    """Make the overlay commit on HEAD and check it out."""
    commit = overlay_commit(tree, release)
    git(tree, "reset", "-q", "--hard", commit)
    return commit


def patched_tree(tree: Path, patch: Path) -> str | None:
    """The tree that `git am --3way` of `patch` on HEAD makes, worked out in a temporary index
    (the tree's own files and index are not touched); None if the patch needs a conflict
    resolution."""
    index = git_dir(tree) / "kv-series-patched.index"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        for extra in ([], ["--3way"]):
            git(tree, "read-tree", "HEAD", env=env)
            if git(tree, "apply", "--cached", *extra, str(patch), env=env,
                   check=False).returncode == 0:
                return git_out_env(tree, env, "write-tree")
        return None
    finally:
        index.unlink(missing_ok=True)


@dataclass
class PatchFailure:
    patch: str
    file: str
    line: int | None
    hunk: str
    output: str


def _hunk_at(patch_text: str, file: str, line: int | None) -> str:
    """The hunk of `file` in a patch whose old range covers `line` (or its first hunk)."""
    sections = re.split(r"^diff --git ", patch_text, flags=re.M)
    for sec in sections[1:]:
        header = sec.splitlines()[0] if sec else ""
        if not header.endswith(f" b/{file}") and f" a/{file} " not in header + " ":
            continue
        hunks = re.split(r"^(?=@@ )", sec, flags=re.M)[1:]
        for h in hunks:
            m = re.match(r"@@ -(\d+)(?:,(\d+))? ", h)
            if not m:
                continue
            start, count = int(m.group(1)), int(m.group(2) or 1)
            if line is None or start <= line <= start + max(count, 1):
                lines = h.splitlines()
                body = "\n".join(lines[:12])
                if len(lines) > 12:
                    body += f"\n... ({len(lines) - 12} more lines)"
                return body
    return ""


def apply_patch(tree: Path, patch: Path,
                three_way: bool = True) -> tuple[PatchFailure | None, bool]:
    """git am one patch. Returns (failure or None, applied-with-3-way-merge).

    Without `three_way`, a patch whose context does not match the tree exactly fails instead
    of being merged (what a patch queue must do: a merge hides that the patch went stale)."""
    # `git am --quiet` says nothing when it falls back to a merge: ask beforehand whether the
    # patch applies as it is.
    exact = not three_way or git(tree, "apply", "--check", str(patch), check=False).returncode == 0
    proc = git(tree, "am", *(["--3way"] if three_way else []), "--keep-non-patch", "--keep-cr",
               "--committer-date-is-author-date", "--quiet", str(patch),
               check=False, dated=False)
    out = proc.stdout or ""
    if proc.returncode == 0:
        return None, not exact
    file, line = "", None
    # With --3way, git am may report only the failed merge; a plain check names file and line.
    check = git(tree, "apply", "--check", "--verbose", str(patch), check=False).stdout or ""
    m = re.search(r"error: patch failed: (.+?):(\d+)", out + "\n" + check)
    if m:
        file, line = m.group(1), int(m.group(2))
    else:
        m = re.search(r"CONFLICT \([^)]*\): Merge conflict in (.+)", out) or \
            re.search(r"error: (.+?): (?:does not exist in index|No such file)", out)
        if m:
            file = m.group(1).strip()
    hunk = _hunk_at(patch.read_text(errors="replace"), file, line) if file else ""
    return PatchFailure(patch.name, file, line, hunk, out.strip()), False


@dataclass
class ApplyResult:
    overlay_commit: str | None = None
    applied: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)  # applied only through a 3-way merge
    failure: PatchFailure | None = None


def apply_onto(tree: Path, release: Release, names: list[str], *, overlay: bool = True,
               three_way: bool = True, on_overlay=None, on_applied=None,
               on_step=None) -> ApplyResult:
    """Apply to the tree's HEAD the overlay commit (if `overlay`) and then the patches `names`
    of the release's series, in order, stopping at the first that does not apply (the tree is
    then left in the middle of `git am`). The one apply loop of `make apply` and `make
    check-series`, so the check tests what `make apply` does. `on_overlay(commit)` and
    `on_applied(name, merged)` run after each step, so a caller can record progress before a
    later patch fails; `on_step(step, to, **info)` before each step changes the tree, with
    the commit or tree the step makes (see "Steps of `make apply`").
    Raises SeriesError if the overlay cannot be committed."""
    result = ApplyResult()
    if overlay:
        commit = overlay_commit(tree, release)
        if on_step is not None:
            on_step("overlay", commit)
        git(tree, "reset", "-q", "--hard", commit)
        result.overlay_commit = commit
        if on_overlay is not None:
            on_overlay(result.overlay_commit)
    for i, name in enumerate(names):
        patch = release.series_dir / name
        if on_step is not None:
            on_step("am", patched_tree(tree, patch), patch=name, pending=names[i:])
        failure, merged = apply_patch(tree, patch, three_way=three_way)
        if failure:
            result.failure = failure
            return result
        result.applied.append(name)
        if merged:
            result.merged.append(name)
        if on_applied is not None:
            on_applied(name, merged)
    return result


def failure_error(tree: Path, release: Release, f: PatchFailure) -> SeriesError:
    where = f"{f.file}" + (f" at line {f.line}" if f.line else "") if f.file else "(see git output)"
    hunk = "\n".join("  " + ln for ln in f.hunk.splitlines()) if f.hunk else "  (hunk not found)"
    out = "\n".join("  | " + ln for ln in f.output.splitlines()[-12:])
    return SeriesError(
        f"patch {f.patch} of patches/{release.tag}/series no longer applies to vLLM "
        f"{release.version}: {where}. The failing hunk:\n{hunk}\ngit am said:\n{out}",
        f"The build tree {tree} is left in the middle of `git am`, with the patches before "
        f"{f.patch} applied. To go back: `git -C {tree} am --abort`. To update the patch: fix "
        f"the conflict in {f.file or 'the files named above'}, `git -C {tree} add` them, "
        f"`git -C {tree} am --continue`, then `make refresh VLLM_VERSION={release.version}` "
        "writes the updated patch and keeps the patches not applied yet.",
    )


# ---------------------------------------------------------------------------------------------
# The whole apply, idempotent


def desired_patches(release: Release) -> list[tuple[str, str]]:
    _, names = read_series(release)
    return [(n, sha256_file(release.series_dir / n)) for n in names]


def apply_series(release: Release, log=print) -> str:
    """Bring build/vllm-X to pristine + overlay + series. Returns a one-line summary."""
    with tree_lock(release.tree):
        tree = ensure_pristine(release, log)
        recover_interrupted(tree, release, log)
        require_clean(tree, release, "apply")
        require_on_branch(tree, release, "apply")
        require_no_user_commits(tree, release, "apply")
        return _apply(tree, release, log)


def _apply(tree: Path, release: Release, log) -> str:
    state = read_state(tree)
    commits = commits_after(tree, release.tag)
    recorded = recorded_commits(state)
    want_overlay = overlay_digest()
    want = desired_patches(release)
    have = [(p["name"], p["digest"]) for p in state.get("patches", [])][: max(len(commits) - 1, 0)]

    if (state.get("overlay") or {}).get("digest") == want_overlay and commits:
        keep = 0
        while keep < len(have) and keep < len(want) and have[keep] == want[keep]:
            keep += 1
        base = recorded[keep]  # the overlay commit is recorded[0]
        patches_state = state["patches"][:keep]
        overlay_state = state["overlay"]
    else:
        keep, base = 0, release.tag
        patches_state, overlay_state = [], None

    if overlay_state and keep == len(want) and len(commits) == keep + 1:
        return (f"vLLM {release.version}: already applied (pristine {release.tag} + overlay + "
                f"{keep} patches), nothing to do")

    head, base = rev(tree, "HEAD"), rev(tree, base)
    if head != base:
        state["step"] = {"step": "reset", "from": head, "to": base}
        write_state(tree, state)
        git(tree, "reset", "-q", "--hard", base)
    state = {"overlay": overlay_state, "patches": patches_state}
    write_state(tree, state)
    digests = dict(want)

    def step(name: str, to: str | None, **info) -> None:
        state["step"] = {"step": name, "from": rev(tree, "HEAD"), "to": to, **info}
        write_state(tree, state)

    def overlay_done(commit: str) -> None:
        state.pop("step", None)
        state["overlay"] = {"commit": commit, "digest": want_overlay}
        write_state(tree, state)
        log(f"overlay: {len(overlay_files())} files committed")

    def patch_done(name: str, merged: bool) -> None:
        state.pop("step", None)
        state["patches"].append(
            {"name": name, "digest": digests[name], "commit": git_out(tree, "rev-parse", "HEAD")})
        write_state(tree, state)
        log(f"applied {name}" + (" (3-way merge)" if merged else ""))

    names = [n for n, _ in want[keep:]]
    result = apply_onto(tree, release, names, overlay=overlay_state is None,
                        on_overlay=overlay_done, on_applied=patch_done, on_step=step)
    if result.failure:
        state.pop("step", None)
        state["pending"] = names[len(result.applied):]
        write_state(tree, state)
        raise failure_error(tree, release, result.failure)
    if result.merged:
        log(f"warning: {', '.join(result.merged)} applied only through a 3-way merge; run "
            f"`make refresh VLLM_VERSION={release.version}` so the series applies exactly.")
    return (f"vLLM {release.version}: applied pristine {release.tag} + overlay + {len(want)} "
            f"patches in {tree}")


@contextmanager
def scratch_worktree(tree: Path, ref: str, name: str):
    """A throwaway detached worktree of `tree` at `ref` under build/.<name>/, removed after.

    For checks that must start from the pristine release without touching the build tree or
    any work in it."""
    wt = build_dir() / f".{name}" / tree.name
    git(tree, "worktree", "remove", "--force", str(wt), check=False)
    shutil.rmtree(wt, ignore_errors=True)
    git(tree, "worktree", "prune")
    wt.parent.mkdir(parents=True, exist_ok=True)
    git(tree, "worktree", "add", "-q", "--detach", str(wt), ref)
    try:
        yield wt
    finally:
        git(tree, "worktree", "remove", "--force", str(wt), check=False)
        shutil.rmtree(wt, ignore_errors=True)
        with suppress(OSError):  # build/.<name>/ once nothing else is in it
            wt.parent.rmdir()
        git(tree, "worktree", "prune", check=False)
