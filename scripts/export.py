#!/usr/bin/env python3
"""Export the whole series of a release (overlay included) as upstream-ready patches.

  python3 scripts/export.py --version 0.32.0 [--out DIR]

Writes `git format-patch` files of every commit after the pristine tag into
build/export/vllm-X/ (or --out), with your Signed-off-by added (DCO) and the overlay commit
authored by you. Refuses if the build tree is not exactly the current series. Before it
reports success it checks that the files are what a reviewer gets: `git am` of them, in order,
onto the pristine release gives exactly the patched tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import (  # noqa: E402
    commits_after, desired_patches, recorded_commits, require_applied_tree, scratch_worktree,
)
from seriestool import (  # noqa: E402
    HARNESS_IDENT, SeriesError, build_dir, format_patch_args, get_release, git, git_out,
    main_guard, overlay_digest, read_state, run,
)


def user_ident(tree: Path) -> tuple[str, str]:
    proc = run(["git", "var", "GIT_AUTHOR_IDENT"], cwd=tree, check=False)
    m = re.match(r"(.*) <(.*)> \d+ [+-]\d{4}$", (proc.stdout or "").strip())
    if proc.returncode != 0 or not m or m.group(2) == HARNESS_IDENT["GIT_AUTHOR_EMAIL"]:
        raise SeriesError(
            "git does not know who you are, so the export cannot carry your Signed-off-by.",
            "Set it: `git config --global user.name 'Your Name'` and "
            "`git config --global user.email you@example.com`, then export again.",
        )
    return m.group(1), m.group(2)


def export(release, out: Path) -> list[Path]:
    tree = require_applied_tree(release, "export")
    state = read_state(tree)
    commits = commits_after(tree, release.tag)
    in_sync = (
        state.get("overlay", {}).get("digest") == overlay_digest()
        and [(p["name"], p["digest"]) for p in state.get("patches", [])] == desired_patches(release)
        and commits == recorded_commits(state)
    )
    if not in_sync:
        raise SeriesError(
            f"the build tree {tree} is not exactly the current series of {release.tag}.",
            f"Run `make refresh VLLM_VERSION={release.version}` to save your commits, or "
            f"`make apply VLLM_VERSION={release.version}` to bring the tree up to date, then "
            "export again.",
        )
    name, email = user_ident(tree)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # The user's own git config applies here (identity for --signoff), unlike harness commits.
    args = [a for a in format_patch_args() if a != "--zero-commit"]
    run(["git", *args, "--signoff", "-o", str(out), f"{release.tag}..HEAD"], cwd=tree)
    files = sorted(out.glob("*.patch"))
    harness_from = f"From: {HARNESS_IDENT['GIT_AUTHOR_NAME']} <{HARNESS_IDENT['GIT_AUTHOR_EMAIL']}>"
    for f in files:
        text = f.read_text()
        text = text.replace(harness_from, f"From: {name} <{email}>", 1)
        if "\nSigned-off-by: " not in text.split("\n---\n", 1)[0]:
            raise SeriesError(f"{f.name} has no Signed-off-by line after export.")
        f.write_text(text)
    check_round_trip(tree, release, files)
    return files


def check_round_trip(tree: Path, release, files: list[Path]) -> None:
    """`git am` of `files` onto pristine vX must reproduce the patched tree byte for byte.

    Plain `git am`, as a contributor or reviewer runs it: no --3way, no --keep-cr."""
    with scratch_worktree(tree, release.tag, "export-check") as wt:
        proc = git(wt, "am", "--quiet", *(str(f) for f in files), check=False, dated=False)
        if proc.returncode != 0:
            said = [line for line in (proc.stdout + proc.stderr).splitlines()
                    if line.startswith(("Patch failed", "error:"))]
            git(wt, "am", "--abort", check=False)
            raise SeriesError(
                f"the exported patches do not apply with `git am` to pristine {release.tag}:\n  "
                + "\n  ".join(said or ["git am failed"]),
                "Re-make the commit that fails so it applies as sent (a file with CRLF line ends, "
                "for example, loses its CRs in `git am`), `make refresh`, then export again.",
            )
        diff = git_out(wt, "diff", "--stat", "HEAD", git_out(tree, "rev-parse", "HEAD"))
        if diff:
            raise SeriesError(
                f"`git am` of the exported patches onto pristine {release.tag} does not "
                f"reproduce the patched tree; these files would reach a reviewer altered:\n{diff}",
                "Do not send these patches. Re-make the commits that touch those files so they "
                "survive `git am` (CRLF line ends, for example, lose their CRs), `make refresh`, "
                "then export again.",
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    release = get_release(args.version)
    out = args.out or build_dir() / "export" / f"vllm-{release.version}"
    files = export(release, out)
    print(f"{len(files)} upstream-ready patches in {out}:")
    for f in files:
        print(f"  {f.name}")
    print(f"Send one as a PR: git -C <your vllm clone> am {out}/<patch>")


if __name__ == "__main__":
    main_guard(main)
