#!/usr/bin/env python3
"""Apply the series of every release in ci/matrix.toml to its pristine tree; print a table.

  python3 scripts/check_series.py            # every release; exit 1 if any fails

Each check runs in a throwaway git worktree of build/vllm-X at tag vX, so the build trees and
any work in them are left alone.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import apply_patch, commit_overlay, ensure_pristine  # noqa: E402
from seriestool import SeriesError, build_dir, git, load_matrix, main_guard, read_series  # noqa: E402


def check_release(release) -> tuple[int, str]:
    """(number of patches, result text) for one release."""
    try:
        _, names = read_series(release)
        tree = ensure_pristine(release)
    except SeriesError as e:
        return 0, f"ERROR: {e.problem.splitlines()[0]}"
    wt = build_dir() / ".check" / f"vllm-{release.version}"
    git(tree, "worktree", "remove", "--force", str(wt), check=False)
    shutil.rmtree(wt, ignore_errors=True)
    git(tree, "worktree", "prune")
    wt.parent.mkdir(parents=True, exist_ok=True)
    git(tree, "worktree", "add", "-q", "--detach", str(wt), release.tag)
    try:
        try:
            commit_overlay(wt, release)
        except SeriesError as e:
            return len(names), f"FAIL at overlay: {e.problem.splitlines()[0]}"
        merged = []
        for name in names:
            failure, three_way = apply_patch(wt, release.series_dir / name)
            if failure:
                where = failure.file + (f":{failure.line}" if failure.line else "")
                return len(names), f"FAIL at {name} ({where or 'see make apply'})"
            if three_way:
                merged.append(name)
        if merged:
            return len(names), f"OK (3-way merge needed: {', '.join(merged)})"
        return len(names), "OK"
    finally:
        git(tree, "worktree", "remove", "--force", str(wt), check=False)
        shutil.rmtree(wt, ignore_errors=True)
        git(tree, "worktree", "prune", check=False)


def main() -> int:
    _, releases = load_matrix()
    rows = []
    for version in sorted(releases, key=lambda v: tuple(int(x) for x in v.split("."))):
        n, result = check_release(releases[version])
        rows.append((version, str(n), result))
    head = ("release", "patches", "result")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*head))
    print(fmt.format(*("-" * w for w in widths)))
    for r in rows:
        print(fmt.format(*r))
    return 0 if all(r[2].startswith("OK") for r in rows) else 1


if __name__ == "__main__":
    main_guard(main)
