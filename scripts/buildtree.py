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
import tarfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fetch import fetch_sdist
from seriestool import (
    Release, SeriesError, build_dir, git, git_out, overlay_digest, overlay_dir, overlay_files,
    overlay_message, read_series, read_state, sha256_file, write_state,
)

BRANCH = "series"


def git_dir(tree: Path) -> Path:
    return Path(git_out(tree, "rev-parse", "--absolute-git-dir"))


def is_build_tree(tree: Path, release: Release) -> bool:
    if not (tree / ".git").exists():
        return False
    return git(tree, "rev-parse", "-q", "--verify", f"refs/tags/{release.tag}",
               check=False).returncode == 0


def ensure_pristine(release: Release) -> Path:
    """Create build/vllm-X with the pristine sdist committed and tagged vX, if not there."""
    tree = release.tree
    if tree.exists():
        if not is_build_tree(tree, release):
            raise SeriesError(
                f"{tree} exists but is not a build tree of vLLM {release.version} (no git "
                f"repository with tag {release.tag}).",
                f"Move it away (e.g. `mv {tree} {tree}.old`) and run the command again; the "
                "harness recreates it from the release's sdist.",
            )
        return tree
    sdist = fetch_sdist(release)
    tree.parent.mkdir(parents=True, exist_ok=True)
    tmp = tree.parent / f".unpack-{release.version}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with tarfile.open(sdist) as tar:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, **kwargs)
    top = [p for p in tmp.iterdir()]
    if len(top) != 1 or not top[0].is_dir():
        raise SeriesError(f"{sdist} does not unpack to one top-level directory.")
    top[0].rename(tree)
    tmp.rmdir()
    git(tree, "init", "-q", f"--initial-branch={BRANCH}")
    # -f: the sdist ships files its own .gitignore names (e.g. vllm/_version.py); pristine
    # means every file of the sdist.
    git(tree, "add", "-A", "-f")
    git(tree, "commit", "-q", "--no-verify", "-m", f"vLLM {release.version} (pristine sdist)")
    git(tree, "tag", release.tag)
    write_state(tree, {})
    return tree


def in_progress_am(tree: Path) -> bool:
    return (git_dir(tree) / "rebase-apply").exists()


def dirty_paths(tree: Path) -> list[str]:
    out = git(tree, "status", "--porcelain", "--untracked-files=all").stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


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
    if clean:
        require_clean(tree, release, action)
    return tree


def require_clean(tree: Path, release: Release, action: str) -> None:
    v = release.version
    if in_progress_am(tree):
        raise SeriesError(
            f"a `git am` is in progress in {tree}: a patch failed to apply earlier and has not "
            "been resolved.",
            f"Either resolve it (edit the files, `git -C {tree} add <files>`, "
            f"`git -C {tree} am --continue`, then `make refresh VLLM_VERSION={v}`), or go back "
            f"with `git -C {tree} am --abort`. Then run `make {action} VLLM_VERSION={v}` again.",
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
            f"into patches/{release.tag}/. To throw them away: `git -C {tree} stash` (or "
            f"`make clean-tree VLLM_VERSION={v}`).",
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
# Overlay and patches


def commit_overlay(tree: Path, release: Release) -> str:
    """Copy vllm_overlay/ into the tree and commit it as one commit (empty if no files)."""
    root = overlay_dir()
    files = overlay_files()
    clashes = [str(rel) for rel in files if (tree / rel).exists()
               and git(tree, "cat-file", "-e", f"{release.tag}:{rel}", check=False).returncode == 0]
    if clashes:
        raise SeriesError(
            "vllm_overlay/ holds files that already exist in vLLM "
            f"{release.version}: {', '.join(clashes)}. The overlay is for new files only.",
            "Move the change to those files into a patch of the series instead.",
        )
    for rel in files:
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest)
    if files:
        git(tree, "add", "-f", "--", *[str(r) for r in files])
    msg_file = git_dir(tree) / "kv-series-overlay.msg"
    msg_file.write_text(overlay_message())
    git(tree, "commit", "-q", "--no-verify", "--allow-empty", "-F", str(msg_file))
    msg_file.unlink()
    return git_out(tree, "rev-parse", "HEAD")


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
               three_way: bool = True, on_overlay=None, on_applied=None) -> ApplyResult:
    """Apply to the tree's HEAD the overlay commit (if `overlay`) and then the patches `names`
    of the release's series, in order, stopping at the first that does not apply (the tree is
    then left in the middle of `git am`). The one apply loop of `make apply` and `make
    check-series`, so the check tests what `make apply` does. `on_overlay(commit)` and
    `on_applied(name, merged)` run after each step, so a caller can record progress before a
    later patch fails.
    Raises SeriesError if the overlay cannot be committed."""
    result = ApplyResult()
    if overlay:
        result.overlay_commit = commit_overlay(tree, release)
        if on_overlay is not None:
            on_overlay(result.overlay_commit)
    for name in names:
        failure, merged = apply_patch(tree, release.series_dir / name, three_way=three_way)
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
    tree = ensure_pristine(release)
    require_clean(tree, release, "apply")
    require_no_user_commits(tree, release, "apply")
    state = read_state(tree)
    commits = commits_after(tree, release.tag)
    recorded = recorded_commits(state)
    want_overlay = overlay_digest()
    want = desired_patches(release)
    have = [(p["name"], p["digest"]) for p in state.get("patches", [])][: max(len(commits) - 1, 0)]

    if state.get("overlay", {}).get("digest") == want_overlay and commits:
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

    git(tree, "reset", "-q", "--hard", base)
    state = {"overlay": overlay_state, "patches": patches_state}
    digests = dict(want)

    def overlay_done(commit: str) -> None:
        state["overlay"] = {"commit": commit, "digest": want_overlay}
        write_state(tree, state)
        log(f"overlay: {len(overlay_files())} files committed")

    def patch_done(name: str, merged: bool) -> None:
        state["patches"].append(
            {"name": name, "digest": digests[name], "commit": git_out(tree, "rev-parse", "HEAD")})
        write_state(tree, state)
        log(f"applied {name}" + (" (3-way merge)" if merged else ""))

    if overlay_state is not None:
        write_state(tree, state)
    names = [n for n, _ in want[keep:]]
    result = apply_onto(tree, release, names, overlay=overlay_state is None,
                        on_overlay=overlay_done, on_applied=patch_done)
    if result.failure:
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
        git(tree, "worktree", "prune", check=False)
