#!/usr/bin/env python3
"""Write the build tree's commits after the overlay commit back to patches/vX/ (series + files).

  python3 scripts/refresh.py --version 0.32.0

The quilt/gbp-pq "export" step: edit and commit in build/vllm-X, then refresh. Patch files are
named by topic, not by position: a commit keeps the file name of the series' patch with the same
subject, and a new commit is named after its subject as `git format-patch` spells it, without
the number (`Core-Do-this.patch`). So a topic has one name in every release's series and
inserting a patch renumbers nothing (`diff patches/v0.32.0/<topic>.patch
patches/v0.33.0/<topic>.patch` works); the order is the `series` file's. To rename a topic,
rename its file and its line in `series`. Bytes are stable too (see
seriestool.format_patch_args), so a refresh right after `make apply` changes no byte. Patches
that were not applied yet because an earlier one failed stay in the series, after the
refreshed ones.
"""

from __future__ import annotations

import sys
import tempfile
from email.parser import BytesHeaderParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import commits_after, require_applied_tree, subject  # noqa: E402
from seriestool import (  # noqa: E402
    SeriesError, format_patch_args, get_release, git, git_out, main_guard, overlay_files,
    read_series, read_state, sha256_file, version_from_args, write_state,
)


def patch_subject(path: Path) -> str:
    """The commit subject a patch file carries (its folded Subject header, without [PATCH])."""
    with path.open(errors="replace") as f:
        headers = BytesHeaderParser().parsebytes(f.read().encode(errors="replace"))
    subj = " ".join(str(headers.get("Subject", "")).split())
    return subj[len("[PATCH] "):] if subj.startswith("[PATCH] ") else subj


def topic_names(produced: list[Path], subjects: list[str], old: dict[str, str]) -> list[str]:
    """File names for the refreshed patches: the old name of the same subject, else the
    format-patch name without its number. Unique within the series."""
    names: list[str] = []
    for p, subj in zip(produced, subjects):
        name = old.get(" ".join(subj.split())) or p.name.split("-", 1)[1]
        stem, n = name[: -len(".patch")], 2
        while name in names:
            name, n = f"{stem}-{n}.patch", n + 1
        names.append(name)
    return names


def refresh(release) -> list[str]:
    tree = require_applied_tree(release, "refresh")
    state = read_state(tree)
    commits = commits_after(tree, release.tag)
    if not commits or not state.get("overlay") or commits[0] != state["overlay"]["commit"]:
        raise SeriesError(
            f"the first commit after {release.tag} in {tree} is not the harness's overlay commit.",
            "Changes to the overlay's files belong in vllm_overlay/. Recreate the tree with "
            f"`make clean-tree apply VLLM_VERSION={release.version}`.",
        )
    overlay_paths = {str(p) for p in overlay_files()}
    for c in commits[1:]:
        touched = set(git_out(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", c).split())
        clash = sorted(touched & overlay_paths)
        if clash:
            raise SeriesError(
                f"commit {c[:12]} ({subject(tree, c)}) changes files that come from "
                f"vllm_overlay/: {', '.join(clash)}. Those files are version-independent and "
                "live in vllm_overlay/, not in a per-release patch.",
                f"Copy your change into vllm_overlay/, drop it from the commit "
                f"(`git -C {tree} reset --soft HEAD~1` and recommit without those files), then "
                "refresh again.",
            )
    header, old_names = read_series(release)
    with tempfile.TemporaryDirectory() as tmp:
        git(tree, *format_patch_args(), "-o", tmp, f"{commits[0]}..HEAD")
        produced = sorted(Path(tmp).iterdir())
        subjects = [subject(tree, c) for c in commits[1:]]
        # Patches that were pending when a `git am` failed, and were not since applied
        # (matched by subject), keep their place after the refreshed ones.
        pending = [n for n in state.get("pending", []) if n in old_names]
        still_pending = []
        for n in pending:
            if patch_subject(release.series_dir / n) not in subjects:
                still_pending.append((n, (release.series_dir / n).read_bytes()))
        release.series_dir.mkdir(parents=True, exist_ok=True)
        old_by_subject: dict[str, str] = {}
        for n in old_names:
            old_by_subject.setdefault(patch_subject(release.series_dir / n), n)
        names = topic_names(produced, subjects, old_by_subject)
        for n in old_names:
            (release.series_dir / n).unlink()
        for p, n in zip(produced, names):
            (release.series_dir / n).write_bytes(p.read_bytes())
        for n, data in still_pending:
            if n in names:
                raise SeriesError(f"refreshed patch {n} has the name of a pending patch.")
            (release.series_dir / n).write_bytes(data)
            names.append(n)
    lines = header + names
    (release.series_dir / "series").write_text("\n".join(lines) + "\n")
    state["patches"] = [
        {"name": n, "digest": sha256_file(release.series_dir / n), "commit": c}
        for n, c in zip(names, commits[1:])
    ]
    state.pop("pending", None)
    write_state(tree, state)
    return names


def main() -> None:
    release = get_release(version_from_args())
    names = refresh(release)
    print(f"patches/{release.tag}/series: {len(names)} patches")
    for n in names:
        print(f"  {n}")


if __name__ == "__main__":
    main_guard(main)
