#!/usr/bin/env python3
"""Apply the series of every release in ci/matrix.toml to its pristine tree; print a table.

  python3 scripts/check_series.py            # every release; exit 1 if any fails
  python3 scripts/check_series.py --3way     # let patches apply through a 3-way merge

Each check runs in a throwaway git worktree of build/vllm-X at tag vX, so the build trees and
any work in them are left alone. It applies the overlay and the series with the same code as
`make apply` (buildtree.apply_onto). By default every patch must apply as it is: one whose
context no longer matches fails, because a merge would hide that the patch went stale
(`make refresh` after `make apply` rewrites it). With --3way such a patch passes and is
named in the result.

It also reads every patch's message as upstream would get it (scripts/export.py's rules):
a subject of more than 72 characters or without a vLLM `[Area]` prefix, and project-only
notes (`Drop when:`, "On vX.Y.Z ...", "Checked on vX.Y.Z: ...", which belong in the notes at
the top of patches/vX/series) are listed under the table and fail the check.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import apply_onto, ensure_pristine, scratch_worktree  # noqa: E402
from export import message_problems  # noqa: E402
from seriestool import SeriesError, load_matrix, main_guard, read_series, run  # noqa: E402


def check_release(release, three_way: bool = False) -> tuple[int, str]:
    """(number of patches, result text) for one release."""
    try:
        _, names = read_series(release)
        tree = ensure_pristine(release)
    except SeriesError as e:
        return 0, f"ERROR: {e.problem.splitlines()[0]}"
    with scratch_worktree(tree, release.tag, "check") as wt:
        try:
            result = apply_onto(wt, release, names, three_way=three_way)
        except SeriesError as e:
            return len(names), f"FAIL at overlay: {e.problem.splitlines()[0]}"
    failure = result.failure
    if failure:
        where = failure.file + (f":{failure.line}" if failure.line else "")
        how = "" if three_way else "; does not apply cleanly, see --3way"
        return len(names), f"FAIL at {failure.patch} ({where or 'see make apply'}{how})"
    if result.merged:
        return len(names), f"OK (3-way merge: {', '.join(result.merged)})"
    return len(names), "OK"


def patch_message(path: Path) -> str:
    """The commit message `git am --keep-non-patch` makes of a patch file."""
    with tempfile.TemporaryDirectory() as tmp:
        msg, patch = Path(tmp) / "msg", Path(tmp) / "patch"
        with open(path, encoding="utf-8", errors="replace") as f:
            info = subprocess.run(["git", "mailinfo", "-b", str(msg), str(patch)], stdin=f,
                                  capture_output=True, text=True, errors="replace")
        if info.returncode != 0:
            raise SeriesError(f"git mailinfo cannot read {path}:\n{info.stderr.strip()}")
        subject = next((ln[len("Subject: "):] for ln in info.stdout.splitlines()
                        if ln.startswith("Subject: ")), "")
        return f"{subject}\n\n{msg.read_text(errors='replace')}"


def message_findings(release) -> list[str]:
    """`<patch>: <problem>` for every patch message of the release's series."""
    try:
        _, names = read_series(release)
    except SeriesError:
        return []  # reported by check_release
    return [f"{release.tag}/{name}: {problem}" for name in names
            for problem in message_problems(patch_message(release.series_dir / name))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--3way", dest="three_way", action="store_true",
                    help="let a patch whose context changed apply through a 3-way merge "
                         "(reported as such) instead of failing")
    args = ap.parse_args()
    _, releases = load_matrix()
    rows = []
    for version in sorted(releases, key=lambda v: tuple(int(x) for x in v.split("."))):
        n, result = check_release(releases[version], three_way=args.three_way)
        rows.append((version, str(n), result))
    head = ("release", "patches", "result")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*head))
    print(fmt.format(*("-" * w for w in widths)))
    for r in rows:
        print(fmt.format(*r))
    findings = [f for v in sorted(releases, key=lambda v: tuple(int(x) for x in v.split(".")))
                for f in message_findings(releases[v])]
    if findings:
        print(f"\npatch messages: {len(findings)} to fix (subjects: at most 72 characters, "
              "`[Area] Title`; project-only notes go to the notes at the top of "
              "patches/vX/series, see docs/CONTRIBUTING.md):")
        for f in findings:
            print(f"  {f}")
    else:
        print("\npatch messages: OK")
    return 0 if all(r[2].startswith("OK") for r in rows) and not findings else 1


if __name__ == "__main__":
    main_guard(main)
