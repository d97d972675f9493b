#!/usr/bin/env python3
"""Check that a release's exported stack bisects: each patch, on top of the ones before it,
compiles, passes the release's ruff and passes its own tests.

  python3 scripts/check_bisect.py --version 0.32.0          # make check-bisect VLLM_VERSION=0.32.0
  python3 scripts/check_bisect.py --version 0.32.0 --cheap  # compile + ruff only (the CI tier)
  python3 scripts/check_bisect.py --all --cheap             # every release of ci/matrix.toml
  python3 scripts/check_bisect.py --patches build/export/vllm-0.32.0   # an export you made

The stack is what `make export` sends upstream (scripts/export.py, run here as a draft with a
neutral identity into build/.bisect/export-X/, so no git identity is needed), or the patch
files of --patches. They are applied one by one with `git am` onto a throwaway worktree of the
pristine release (build/.bisect/vllm-X), and after each patch:

  compile   every Python file the patch adds or changes compiles (`compile()`, as py_compile
            does, without writing bytecode)
  ruff      `ruff check` and `ruff format --check` on those files, at the version the
            release's .pre-commit-config.yaml pins (the tool virtualenvs of scripts/lint.py),
            with the tree's own configuration; a finding counts when the patch adds it (file +
            message, as `make lint` counts them)
  tests     the test files the patch adds or changes (tests/**/test_*.py), with the release's
            virtualenv (build/venv-X, `make install`) pointed at the worktree
            (KVSERIES_VLLM_TREE), offline, `-m "not gpu"`; a failing test of a file the patch
            changes counts unless it fails before the patch too (run again one patch back)

--cheap skips the tests. One line per patch (OK, or FAIL with the steps that failed), exit
status 1 on any failure. Every step has a time limit (--compile-timeout, --ruff-timeout,
--test-timeout); a step that runs past it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import require_applied_tree, scratch_worktree  # noqa: E402
from export import TEST_NAME, export  # noqa: E402
from lint import QUIET_ENV, diff_hunks, load_precommit, remote_hook, tool_venv  # noqa: E402
from seriestool import (  # noqa: E402
    Release, SeriesError, build_dir, get_release, git, git_out, load_matrix, main_guard,
    stop_on_sigterm,
)
from treework import copy_build_outputs, tree_lock  # noqa: E402

# The exported commits of a check are authored by nobody in particular: they never leave here.
BISECT_IDENT = ("Series Bisect Check", "bisect@kv-series.invalid")
COMPILE = """\
import sys
bad = 0
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            compile(f.read(), path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        print(f"{path}:{getattr(e, 'lineno', '?')}: {type(e).__name__}: {getattr(e, 'msg', e)}")
        bad += 1
sys.exit(1 if bad else 0)
"""


@dataclass
class Step:
    name: str
    ok: bool = True
    summary: str = ""
    details: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # printed whether it failed or not
    seconds: float = 0.0


@dataclass
class PatchResult:
    patch: str
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    def line(self, width: int) -> str:
        failed = [s for s in self.steps if not s.ok]
        took = sum(s.seconds for s in self.steps)
        if failed:
            what = "; ".join(f"{s.name}: {s.summary}" for s in failed)
            return f"{self.patch:<{width}}  FAIL  {what}  ({took:.0f} s)"
        what = ", ".join(f"{s.name} {s.summary}".strip() for s in self.steps)
        return f"{self.patch:<{width}}  OK    {what}  ({took:.0f} s)"


class StepTimeout(Exception):
    pass


class Stopped(Exception):
    """The check is stopping (Ctrl-C, SIGTERM): a test job that has not started does not."""


# Every command running now, in whichever thread: a stopped check ends them all (the tests of
# several patches run at once with --jobs).
_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()


def call(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """(exit status, output) of a command that must end within `timeout` seconds; past it,
    the command and every process it started (its own session) are killed."""
    with _RUNNING_LOCK:
        if _STOPPING.is_set():
            raise Stopped()
        proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, errors="replace")
        _RUNNING.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_session(proc)
        raise StepTimeout(f"ran past its time limit of {timeout:.0f} s: {' '.join(cmd[:4])} ...")
    except BaseException:  # Ctrl-C, SIGTERM (stop_on_sigterm): leave nothing running
        end_session(proc)
        raise
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
    if _STOPPING.is_set():  # ended by stop_everything() from another thread
        raise Stopped()
    return proc.returncode, out or ""


def end_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def stop_everything() -> None:
    """End every command any thread runs, and every one a thread would start after this."""
    with _RUNNING_LOCK:
        _STOPPING.set()
        running = list(_RUNNING)
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# The steps


def python_files(files: list[str]) -> list[str]:
    return [f for f in files if f.endswith((".py", ".pyi"))]


def is_test_file(rel: str) -> bool:
    p = PurePosixPath(rel)
    return p.parts[0] == "tests" and bool(TEST_NAME.match(p.name))


def compile_step(python: str, wt: Path, files: list[str], timeout: float) -> Step:
    step = Step("compile")
    py = python_files(files)
    if not py:
        step.summary = "(no Python file)"
        return step
    rc, out = call([python, "-c", COMPILE, *py], wt, timeout, {"PYTHONDONTWRITEBYTECODE": "1"})
    step.ok = rc == 0
    step.summary = (f"{len(py)} files" if step.ok
                    else f"{len(out.splitlines())} of {len(py)} files do not compile")
    step.details = out.strip().splitlines() if not step.ok else []
    return step


@dataclass
class Ruff:
    """The release's pinned ruff, or why there is none."""

    binary: Path | None
    version: str = ""
    missing: str = ""

    @classmethod
    def of(cls, tree: Path) -> Ruff:
        hook = remote_hook(load_precommit(tree), "ruff-pre-commit", "ruff-check")
        if not hook:
            return cls(None, missing="the release's .pre-commit-config.yaml pins no ruff")
        version = hook[0]
        venv = tool_venv(f"ruff-{version}", [f"ruff=={version}"])
        return cls(venv / "bin" / "ruff", version)

    def findings(self, wt: Path, files: list[str], timeout: float) -> Counter:
        """ruff check + ruff format findings of `files` (those that exist), as `make lint`
        counts them: (file, code and message) and (file, the hunk format would change)."""
        files = [f for f in python_files(files) if (wt / f).is_file()]
        found: Counter = Counter()
        if not files or not self.binary:
            return found
        rc, out = call([str(self.binary), "check", "--force-exclude", "--no-fix",
                        "--output-format", "json", *files], wt, timeout, QUIET_ENV)
        try:
            items = json.loads(out[out.index("["):])
        except ValueError:
            raise SeriesError(f"ruff check gave no JSON in {wt}:\n{out[-2000:]}")
        found.update((os.path.relpath(i["filename"], wt), f"{i['code']} {i['message']}")
                     for i in items)
        rc, out = call([str(self.binary), "format", "--force-exclude", "--diff", *files], wt,
                       timeout, QUIET_ENV)
        if rc not in (0, 1):
            raise SeriesError(f"ruff format failed in {wt}:\n{out[-2000:]}")
        found.update(diff_hunks(out))
        return found


def ruff_step(ruff: Ruff, before: Counter, wt: Path, files: list[str], timeout: float) -> Step:
    step = Step("ruff")
    if not ruff.binary:
        step.summary = f"skipped ({ruff.missing})"
        return step
    added = ruff.findings(wt, files, timeout) - before
    step.ok = not added
    n = sum(added.values())
    step.summary = f"{ruff.version}" if step.ok else f"{n} findings added (ruff {ruff.version})"
    step.details = [f"{path}: {msg}" + (f" (x{k})" if k > 1 else "")
                    for (path, msg), k in sorted(added.items())]
    return step


SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) (\S+)")
SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] [^:]+(?::\d+)?: (.*)$")


@dataclass
class TestRun:
    counts: Counter
    failed: list[str]
    rc: int
    tail: str
    skip_reasons: Counter


def pytest_run(python: str, wt: Path, args: list[str], env: dict, timeout: float,
               per_test: float) -> TestRun:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        rc, out = call([python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
                        "--tb=short", "-m", "not gpu", f"--timeout={per_test:.0f}",
                        f"--junitxml={xml}", *args], wt, timeout, env)
        counts: Counter = Counter()
        try:
            for suite in ET.parse(xml).getroot().iter("testsuite"):
                failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
                skipped = int(suite.get("skipped", 0))
                counts["failed"] += failed
                counts["skipped"] += skipped
                counts["passed"] += int(suite.get("tests", 0)) - failed - skipped
        except (ET.ParseError, FileNotFoundError):
            pass
    failed, skips = [], Counter()
    for line in out.splitlines():
        m = SUMMARY_LINE.match(line)
        if m and m.group(2) not in failed:
            failed.append(m.group(2))
        m = SKIP_LINE.match(line)
        if m:
            skips[m.group(2).strip()] += int(m.group(1))
    return TestRun(counts, failed, rc, "\n".join(out.strip().splitlines()[-15:]), skips)


def tests_step(python: str, wt: Path, files: list[str], added: set[str], env: dict,
               timeout: float, per_test: float) -> Step:
    step = Step("tests")
    tests = [f for f in files if is_test_file(f)]
    if not tests:
        step.summary = "(none in the patch)"
        return step
    after = git_out(wt, "rev-parse", "HEAD")
    run = pytest_run(python, wt, tests, env, timeout, per_test)
    c = run.counts
    counted = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
    if run.rc not in (0, 1, 5) and not run.failed:
        step.ok = False
        step.summary = f"pytest exit {run.rc} in {len(tests)} files"
        step.details = run.tail.splitlines()
        return step
    # A failing test of a file that was there before the patch: did it fail before it too?
    old = [t for t in run.failed if t.split("::", 1)[0] not in added]
    before_too: list[str] = []
    if old:
        git(wt, "checkout", "-q", "--detach", "HEAD~1")
        try:
            again = pytest_run(python, wt, old, env, timeout, per_test)
        finally:
            git(wt, "checkout", "-q", "--detach", after)
        before_too = [t for t in old if t in again.failed]
    regressions = [t for t in run.failed if t not in before_too]
    step.ok = not regressions
    step.summary = f"{len(tests)} files: {counted}"
    if before_too:
        step.summary += f" ({len(before_too)} failing before the patch too)"
    step.details = [f"failed: {t}" for t in regressions]
    # Shown either way: the release's own broken tests, and tests that skip (one that skips
    # because a later patch is missing should arrive with that patch).
    step.notes = [f"failing before the patch too: {t}" for t in before_too] + [
        f"skipped ({n}): {why}" for why, n in sorted(run.skip_reasons.items())]
    if regressions:
        step.summary = f"{len(regressions)} failed of {len(tests)} files ({counted})"
    return step


# ---------------------------------------------------------------------------------------------
# One release


def patch_paths(wt: Path, patch: Path) -> list[str]:
    """Paths a patch file touches (as they are before it applies)."""
    out = git(wt, "apply", "--numstat", "-z", str(patch), check=False).stdout or ""
    fields = out.split("\0")
    paths, i = [], 0
    while i < len(fields):
        parts = fields[i].split("\t")
        if len(parts) == 3 and parts[2]:
            paths.append(parts[2])
            i += 1
        elif len(parts) == 3:  # a rename: the two paths follow
            paths += fields[i + 1: i + 3]
            i += 3
        else:
            i += 1
    return paths


def test_python(release: Release, python: str | None) -> tuple[str, dict]:
    """The interpreter the tests run with and the environment they need."""
    if python:
        return python, {}
    venv = build_dir() / f"venv-{release.version}"
    exe = venv / "bin" / "python"
    if not exe.exists():
        raise SeriesError(
            f"there is no virtualenv at {venv} to run the patches' tests with.",
            f"Run `make install VLLM_VERSION={release.version}` (VLLM_KERNELS=none for a "
            "python-only install) first, or check only compile and ruff with --cheap.",
        )
    try:
        kernels = json.loads((venv / "kv-series-install.json").read_text()).get("kernels")
    except (OSError, ValueError):
        kernels = None
    from hf_cache import offline_env

    env = dict(offline_env())
    if kernels in ("cpu", "none"):
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return str(exe), env


def stack(release: Release, patches_dir: Path | None) -> list[Path]:
    if patches_dir:
        files = sorted(patches_dir.glob("*.patch"))
        if not files:
            raise SeriesError(f"{patches_dir} holds no *.patch files.",
                              f"Export them first: `make export VLLM_VERSION={release.version}`.")
        return files
    out = build_dir() / ".bisect" / f"export-{release.version}"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # placement and message notes: make export's business
        # No round trip of its own: the check applies them, one by one.
        files = export(release, out, draft=True, ident=BISECT_IDENT, verify=False)
    print(f"exported {len(files)} patches of {release.tag} into {out} (`make export` without "
          "its message checks)", flush=True)
    return files


def check_release(release: Release, args) -> tuple[list[PatchResult], int]:
    """The result of each patch applied (all, unless one does not apply) and the number of
    patches of the stack."""
    # The build tree's lock, as `make apply` and `make clean` take it: its export and its
    # worktree (build/.bisect/vllm-X) are made from the tree, and a second check of the same
    # release would remove the first one's worktree. A second command stops with an error.
    with tree_lock(release.tree):
        return _check_release(release, args)


@dataclass
class Applied:
    """A patch that applied: its commit in the check's worktree and the files it touched."""

    result: PatchResult
    commit: str
    changed: list[str]
    added: set[str]


def _check_release(release: Release, args) -> tuple[list[PatchResult], int]:
    tree = require_applied_tree(release, "check-bisect")
    patches = stack(release, args.patches)
    python, env = (sys.executable, {}) if args.cheap else test_python(release, args.python)
    ruff = Ruff.of(tree)
    width = max(len(p.name) for p in patches)
    jobs = 1 if args.cheap else max(1, args.jobs)
    print(f"=== vLLM {release.version}: {len(patches)} patches, each on the ones before it "
          f"onto pristine {release.tag}" + (" (--cheap: compile and ruff)" if args.cheap else
                                             f" ({jobs} at a time for the tests)"),
          flush=True)
    with scratch_worktree(tree, release.tag, "bisect") as wt:
        applied, stopped = apply_each(patches, wt, ruff, python, args,
                                      width if args.cheap else None)
        if not args.cheap:
            copy_build_outputs(tree, wt)
            test_each(applied, tree, wt, jobs, python, env, args, width)
            if stopped:
                report(stopped, width)
    results = [a.result for a in applied] + ([stopped] if stopped else [])
    for patch in patches[len(results):]:
        print(f"{patch.name:<{width}}  not applied (a patch before it does not apply)")
    return results, len(patches)


def apply_each(patches: list[Path], wt: Path, ruff: Ruff, python: str, args,
               width: int | None) -> tuple[list[Applied], PatchResult | None]:
    """`git am` each patch in turn, with its compile and ruff steps; each result is reported
    at once when `width` is given. Returns the patches that applied, and the result of the
    one that did not (the stack stops there), if any."""
    applied: list[Applied] = []
    for patch in patches:
        result = PatchResult(patch.name)
        start = time.monotonic()
        try:
            before = ruff.findings(wt, patch_paths(wt, patch), args.ruff_timeout)
        except StepTimeout as e:
            before = Counter()
            result.steps.append(Step("ruff", False, str(e)))
        proc = git(wt, "am", "--quiet", "--keep-non-patch", str(patch), check=False,
                   dated=False)
        apply = Step("apply", proc.returncode == 0, seconds=time.monotonic() - start)
        result.steps.insert(0, apply)
        if not apply.ok:
            apply.summary = "does not apply with `git am`"
            apply.details = [ln for ln in (proc.stdout or "").splitlines()
                             if ln.startswith(("error:", "Patch failed"))]
            git(wt, "am", "--abort", check=False)
            if width is not None:
                report(result, width)
            return applied, result
        changed = [f for f in git_out(wt, "diff", "--name-only", "--no-renames",
                                      "--diff-filter=d", "HEAD~1", "HEAD").split("\n") if f]
        added = set(git_out(wt, "diff", "--name-only", "--no-renames", "--diff-filter=A",
                            "HEAD~1", "HEAD").split("\n"))
        for name, fn in (
            ("compile", lambda: compile_step(python, wt, changed, args.compile_timeout)),
            ("ruff", lambda: ruff_step(ruff, before, wt, changed, args.ruff_timeout)),
        ):
            if any(s.name == name for s in result.steps):
                continue
            result.steps.append(timed(name, fn))
        applied.append(Applied(result, git_out(wt, "rev-parse", "HEAD"), changed, added))
        if width is not None:
            report(result, width)
    return applied, None


def timed(name: str, fn) -> Step:
    t0 = time.monotonic()
    try:
        step = fn()
    except StepTimeout as e:
        step = Step(name, False, str(e))
    step.seconds = time.monotonic() - t0
    return step


def test_each(applied: list[Applied], tree: Path, wt: Path, jobs: int, python: str,
              env: dict, args, width: int) -> None:
    """Each applied patch's own tests, at its commit, `jobs` patches at a time, each job in a
    worktree of its own (the check's, and jobs - 1 more under build/.bisect/N/); results are
    reported in the stack's order as soon as every patch before them is done."""
    done: set[int] = set()  # positions in `applied`
    shown = 0
    lock = threading.Lock()
    test_env = {**env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false"}

    def show() -> None:
        nonlocal shown
        with lock:
            while shown in done:
                report(applied[shown].result, width)
                shown += 1

    with contextlib.ExitStack() as trees:
        free: list[Path] = [wt]
        for k in range(2, min(jobs, len(applied)) + 1):
            extra = trees.enter_context(scratch_worktree(tree, applied[-1].commit,
                                                         f"bisect/{k}"))
            copy_build_outputs(tree, extra)
            free.append(extra)

        def job(position: int) -> None:
            item = applied[position]
            with lock:
                where = free.pop()
            try:
                git(where, "checkout", "-q", "--detach", item.commit)
                item.result.steps.append(timed("tests", lambda: tests_step(
                    python, where, item.changed, item.added,
                    {**test_env, "KVSERIES_VLLM_TREE": str(where)}, args.test_timeout,
                    args.per_test_timeout)))
            finally:
                with lock:
                    free.append(where)
            with lock:
                done.add(position)
            show()

        if len(free) == 1:
            for position in range(len(applied)):
                job(position)
            return
        with ThreadPoolExecutor(len(free), thread_name_prefix="bisect-tests") as pool:
            futures = [pool.submit(job, position) for position in range(len(applied))]
            try:
                for future in futures:
                    future.result()
            except BaseException:  # Ctrl-C, SIGTERM, a failing job: end the others' tests
                pool.shutdown(wait=False, cancel_futures=True)
                stop_everything()
                raise


def report(result: PatchResult, width: int) -> None:
    print(result.line(width), flush=True)
    for step in result.steps:
        shown = ([] if step.ok else step.details) + step.notes
        for line in shown[:30]:
            print(f"      {step.name}: {line}")
        if len(shown) > 30:
            print(f"      {step.name}: ... and {len(shown) - 30} more")


def main() -> int:
    stop_on_sigterm()  # a stopped check removes its worktree and ends its tests
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--all", action="store_true", help="every release of ci/matrix.toml")
    p.add_argument("--cheap", action="store_true", help="compile and ruff only, no tests")
    p.add_argument("--patches", type=Path, default=None,
                   help="check these exported patch files (e.g. build/export/vllm-X) instead "
                        "of exporting the series afresh")
    p.add_argument("--python", default=None,
                   help="interpreter for the tests (default: build/venv-X/bin/python)")
    p.add_argument("--compile-timeout", type=float, default=120)
    p.add_argument("--ruff-timeout", type=float, default=120)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="patches whose tests run at once, each in a worktree of its own "
                        "(default: 2, or 1 on a machine with one CPU)")
    p.add_argument("--test-timeout", type=float, default=1200,
                   help="seconds for one patch's tests (default 1200)")
    p.add_argument("--per-test-timeout", type=float, default=600,
                   help="seconds for one test (pytest-timeout, default 600)")
    p.add_argument("--summary-json", type=Path, default=None,
                   help="write one record per patch here (for scripts/run_tests.py)")
    args = p.parse_args()
    if args.all:
        if args.patches:
            raise SeriesError("--patches names one release's export; it does not go with --all.")
        _, releases = load_matrix()
        chosen = [releases[v] for v in sorted(
            releases, key=lambda v: tuple(int(x) for x in v.split(".")))]
    else:
        chosen = [get_release(args.version)]
    summary, failed, total = [], 0, 0
    start = time.monotonic()
    for release in chosen:
        t0 = time.monotonic()
        results, n_patches = check_release(release, args)
        bad = [r.patch for r in results if not r.ok]
        unreached = n_patches - len(results)
        failed += len(bad) + unreached
        total += n_patches
        print(f"summary: vLLM {release.version}: {len(results) - len(bad)} of {n_patches} "
              f"patches OK" + (f"; FAIL: {', '.join(bad)}" if bad else "")
              + (f"; {unreached} not applied" if unreached else "")
              + f"; {time.monotonic() - t0:.0f} s", flush=True)
        for r in results:
            summary.append({"release": release.version, "patch": r.patch, "ok": r.ok,
                            "failed_steps": [s.name for s in r.steps if not s.ok]})
        summary += [{"release": release.version, "patch": None, "ok": False,
                     "failed_steps": ["apply"]}] * unreached
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=1) + "\n")
    if len(chosen) > 1:
        print(f"total: {total - failed} of {total} patches OK over {len(chosen)} releases in "
              f"{time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    main_guard(main)
