#!/usr/bin/env python3
"""Delete build trees (and their virtualenvs), refusing where that would lose the user's work.

  python3 scripts/clean.py --version 0.32.0    # build/vllm-0.32.0 only
  python3 scripts/clean.py --all               # all of build/ (the sdist cache stays)

A tree with uncommitted edits or commits not in the series is kept unless FORCE=1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import is_build_tree, require_clean, require_no_user_commits  # noqa: E402
from seriestool import SeriesError, build_dir, get_release, load_matrix, main_guard  # noqa: E402
from treework import operation_in_progress  # noqa: E402


def clean_tree(release, force: bool) -> str:
    tree = release.tree
    if not tree.exists():
        return f"{tree}: not there"
    if not force and is_build_tree(tree, release):
        if operation_in_progress(tree) != "am":
            require_no_user_commits(tree, release, "clean-tree")
        require_clean(tree, release, "clean-tree")
    shutil.rmtree(tree)
    return f"{tree}: deleted"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--all", action="store_true")
    args = p.parse_args()
    force = os.environ.get("FORCE") == "1"
    if args.all:
        _, releases = load_matrix()
        errors = []
        for r in releases.values():
            try:
                print(clean_tree(r, force))
            except SeriesError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        shutil.rmtree(build_dir(), ignore_errors=True)
        print(f"{build_dir()}: deleted")
    else:
        print(clean_tree(get_release(args.version), force))


if __name__ == "__main__":
    main_guard(main)
