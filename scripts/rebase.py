#!/usr/bin/env python3
"""Carry the series from one supported release to another, with a range-diff for review.

  python3 scripts/rebase.py --from 0.32.0 --to 0.33.0 [--report docs/range-diff/...txt]

The target release must be in ci/matrix.toml (its sdist hash pinned). The patches of the
source release are applied with `git am --3way` onto the target's pristine tree + overlay:
- a patch whose change upstream already has ("already applied" / empty) is dropped, and the
  target series' header says so;
- the first real conflict stops the rebase with the same report as `make apply` (patch, file,
  hunk), the tree left mid-`git am`: resolve, `git am --continue`, then `make refresh`
  VLLM_VERSION=<to> (pending patches keep their place) and run the rebase's last step,
  `make apply`, again.
On success patches/v<to>/ is written and `git range-diff` of the two series is saved (default
docs/range-diff/v<from>-v<to>.txt) so a reviewer sees what changed in each patch.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import (  # noqa: E402
    apply_patch, apply_series, commit_overlay, ensure_pristine, failure_error, require_clean,
    require_no_user_commits,
)
from refresh import refresh  # noqa: E402
from seriestool import (  # noqa: E402
    ROOT, SeriesError, get_release, git, main_guard, overlay_digest, read_series, read_state,
    sha256_file, write_state,
)


def rebase(src, dst, log=print) -> tuple[list[str], list[str]]:
    """Returns (patches carried, patches dropped because upstream has them)."""
    if src.version == dst.version:
        raise SeriesError("--from and --to name the same release.")
    apply_series(src, log=lambda *_: None)
    header, names = read_series(src)
    tree = ensure_pristine(dst)
    require_clean(tree, dst, "rebase")
    require_no_user_commits(tree, dst, "rebase")
    git(tree, "reset", "-q", "--hard", dst.tag)
    state = {"overlay": {"commit": commit_overlay(tree, dst), "digest": overlay_digest()},
             "patches": []}
    write_state(tree, state)
    # The source release's blobs let `git am --3way` merge instead of failing outright.
    fetch_source_series(src, dst)
    carried, dropped = [], []
    for i, name in enumerate(names):
        patch = src.series_dir / name
        before = git(tree, "rev-parse", "HEAD").stdout.strip()
        failure, _ = apply_patch(tree, patch)
        empty = failure is None and git(tree, "rev-parse", "HEAD").stdout.strip() == before
        if failure and "already applied" in failure.output:
            git(tree, "am", "--skip", check=False)
            git(tree, "am", "--abort", check=False)
            empty = True
        if empty:
            dropped.append(name)
            log(f"dropped {name}: vLLM {dst.version} already has this change")
            continue
        if failure:
            # Keep the not-yet-applied patches reachable for `make refresh` after resolving.
            dst.series_dir.mkdir(parents=True, exist_ok=True)
            for n in names[i:]:
                (dst.series_dir / n).write_bytes((src.series_dir / n).read_bytes())
            _write_series(dst, header, names[i:], src, dropped)
            state["pending"] = names[i:]
            write_state(tree, state)
            err = failure_error(tree, dst, failure)
            err.problem = f"rebase {src.tag} -> {dst.tag}: " + err.problem
            moved = moved_definitions(tree, dst, patch)
            if moved:
                err.problem += "\nCode the patch changes has moved in " + dst.tag + ":\n" + \
                    "\n".join(f"  {m}" for m in moved)
            raise err
        state["patches"].append({"name": name, "digest": sha256_file(patch),
                                 "commit": git(tree, "rev-parse", "HEAD").stdout.strip()})
        write_state(tree, state)
        carried.append(name)
        log(f"carried {name}")
    # Start the target series afresh (header + note), then write the carried patches.
    _, old = read_series(dst)
    for n in old:
        (dst.series_dir / n).unlink(missing_ok=True)
    _write_series(dst, header, [], src, dropped)
    state["patches"] = []
    write_state(tree, state)
    refresh(dst)
    return carried, dropped


# The function/class a hunk is in: its @@ context, or a definition among its old lines.
_HUNK_DEF = re.compile(r"^(?:@@ [^@]* @@ |[ -]\s*)(?:async )?(?:def|class) (\w+)", re.M)


def moved_definitions(tree: Path, dst, patch: Path) -> list[str]:
    """For each function/class a patch's hunks sit in (their @@ context) that the target
    release no longer defines in the same file, where the target defines it instead.

    A 3-way merge cannot follow code that moved to another file (e.g. vLLM 0.33 split
    kv_cache_utils.py into kv_cache_planning.py): it reports the whole region as a conflict.
    Naming the new home tells the reader where to re-apply the hunk by hand."""
    found = []
    for section in re.split(r"^diff --git ", patch.read_text(errors="replace"), flags=re.M)[1:]:
        m = re.match(r"a/(\S+) b/", section)
        if not m:
            continue
        path = m.group(1)
        old = git(tree, "show", f"{dst.tag}:{path}", check=False)
        for name in dict.fromkeys(_HUNK_DEF.findall(section)):
            pattern = rf"^\s*(async )?(def|class) {name}\b"
            if old.returncode == 0 and re.search(pattern, old.stdout, re.M):
                continue
            hits = git(tree, "grep", "-l", "-E", rf"^\s*(async )?(def|class) {name}\b",
                       dst.tag, "--", "*.py", check=False).stdout.split()
            where = [h.split(":", 1)[1] for h in hits if h.split(":", 1)[1] != path]
            if where:
                found.append(f"{name} (in {path} on the source release) is in "
                             f"{', '.join(where)} on {dst.tag}")
    return found


def _write_series(dst, header: list[str], names: list[str], src, dropped: list[str]) -> None:
    notes = [ln for ln in header if not ln.startswith("# Rebased from")
             and not ln.startswith("# Dropped")]
    notes.append(f"# Rebased from {src.tag} with scripts/rebase.py.")
    if dropped:
        notes.append(f"# Dropped (vLLM {dst.version} already has them): {', '.join(dropped)}")
    dst.series_dir.mkdir(parents=True, exist_ok=True)
    (dst.series_dir / "series").write_text("\n".join(notes + names) + "\n")


def fetch_source_series(src, dst) -> None:
    git(dst.tree, "fetch", "-q", "--no-tags", str(src.tree), "+HEAD:refs/kv-series/rebase-from")


def range_diff(src, dst) -> str:
    """`git range-diff` of src's series against dst's, both as commits in dst's tree."""
    tree = dst.tree
    fetch_source_series(src, dst)
    src_overlay = read_state(src.tree)["overlay"]["commit"]
    dst_overlay = read_state(tree)["overlay"]["commit"]
    out = git(tree, "range-diff", "--no-color", "--creation-factor=80",
              f"{src_overlay}..refs/kv-series/rebase-from", f"{dst_overlay}..HEAD").stdout
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--from", dest="src", required=True)
    p.add_argument("--to", dest="dst", required=True)
    p.add_argument("--report", type=Path, default=None)
    p.add_argument("--range-diff-only", action="store_true",
                   help="only (re)write the range-diff report from the applied build trees, "
                   "e.g. after resolving conflicts and `make refresh`")
    args = p.parse_args()
    src, dst = get_release(args.src), get_release(args.dst)
    report = args.report or ROOT / "docs" / "range-diff" / f"{src.tag}-{dst.tag}.txt"
    if args.range_diff_only:
        apply_series(src, log=lambda *_: None)
        apply_series(dst, log=lambda *_: None)
        write_report(report, src, dst, range_diff(src, dst))
        print(f"range-diff {src.tag} -> {dst.tag} in {report}")
        return
    carried, dropped = rebase(src, dst)
    write_report(report, src, dst, range_diff(src, dst))
    print(f"{src.tag} -> {dst.tag}: {len(carried)} patches carried, {len(dropped)} dropped; "
          f"patches/{dst.tag}/ written; range-diff in {report}")


def write_report(report: Path, src, dst, text: str) -> None:
    """The range-diff with a header a reviewer can read without knowing git range-diff."""
    header, _ = read_series(dst)
    notes = "\n".join(ln for ln in header if ln.startswith("#"))
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(
        f"The series carried from vLLM {src.version} to vLLM {dst.version}\n"
        f"({src.tag}: patches/{src.tag}/, left; {dst.tag}: patches/{dst.tag}/, right).\n\n"
        "How to read it: one line per patch pair, `N: <commit> <mark> M: <commit> <subject>`.\n"
        "  =  the patch is the same on both releases (only line numbers moved)\n"
        "  !  the patch changed; the lines below it are a diff of the two patches:\n"
        "     a leading -/+ says whether a line of the patch is only on the left or\n"
        "     only on the right (the second column is the patch's own -/+)\n"
        "  <  only on the left: dropped or not carried (see the series notes below)\n"
        "  >  only on the right: new for this release\n\n"
        f"Series notes (patches/{dst.tag}/series):\n{notes or '(none)'}\n\n" + text)


if __name__ == "__main__":
    main_guard(main)
