#!/usr/bin/env python3
"""Run the test tiers: the harness, then for each release its tiers from ci/matrix.toml.

  python3 scripts/run_tests.py                       # every release, its ci_tiers (make test)
  python3 scripts/run_tests.py --version 0.32.0      # one release
  python3 scripts/run_tests.py --tiers unit,engine   # chosen tiers
  python3 scripts/run_tests.py --gpu                 # a GPU host: each release's gpu_tiers

The harness tier runs with build/venv-harness (pytest and pytest-timeout from
ci/requirements-harness.txt, made on first use with this Python and made again when that file
changes): nothing needs to be installed beforehand. For each release: `make apply`,
`make install` (CPU kernels where the matrix says they install, else python-only; its
virtualenv gets ci/requirements-test.txt), then the tiers with that release's virtualenv.
Prints one table and a closing "N passed, N failed, N skipped" line summed over every pytest
run (the lint tier counts one per check: passed when the series adds no finding).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import apply_series  # noqa: E402
from hf_cache import offline_env  # noqa: E402
from install import (  # noqa: E402
    TEST_REQUIREMENTS, default_venv, detect_kernels, ensure_harness_venv, install,
)
from seriestool import ROOT, SeriesError, git_out, load_matrix, main_guard  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def series_tests(release) -> list[str]:
    """Test files the series adds to the tree (upstream layout), relative to it.

    Upstream test files the series changes run in the upstream tier, against the stock
    baseline (they hold tests that need the offline model cache)."""
    out = git_out(release.tree, "diff", "--name-only", "--diff-filter=A", f"{release.tag}..HEAD",
                  "--", "tests")
    return [p for p in out.split() if Path(p).name.startswith("test_") and p.endswith(".py")]


def timed_call(cmd: list[str], **kwargs) -> tuple[int, float]:
    """(exit code, wall seconds) of a command."""
    start = time.monotonic()
    rc = subprocess.call(cmd, **kwargs)
    return rc, time.monotonic() - start


def setup_result(version: str, rc: int, seconds: float) -> tuple:
    """The summary row of a release's setup."""
    counts = {"passed": 0, "failed": 0 if rc == 0 else 1, "skipped": 0}
    return (f"{version} setup (apply, install)", rc, counts, seconds)


def pytest(python: str, args: list[str], cwd: Path, label: str, results: list,
           env: dict | None = None) -> None:
    with tempfile.NamedTemporaryFile(suffix=".xml", delete=False) as f:
        xml = f.name
    # The slowest cases are listed: what CI's time goes to is in every run's log.
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--durations=10",
           f"--junitxml={xml}", *args]
    print(f"\n=== {label}: {' '.join(cmd)}  (in {cwd})", flush=True)
    rc, seconds = timed_call(cmd, cwd=cwd, env={**os.environ, **ENV, **(env or {})})
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    try:
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            total = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            counts["failed"] += failed
            counts["skipped"] += skipped
            counts["passed"] += total - failed - skipped
    except (ET.ParseError, FileNotFoundError):
        pass
    finally:
        Path(xml).unlink(missing_ok=True)
    if rc not in (0, 5) and counts["failed"] == 0:
        counts["failed"] = 1  # pytest itself failed (collection error, crash)
    results.append((label, rc, counts, seconds))


def tally(keys) -> dict:
    """Counts of a summary: one per "passed", "failed" or "skipped" in ``keys``."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for key in keys:
        counts[key] += 1
    return counts


def summarized(cmd: list[str], heading: str, label: str, count, results: list) -> None:
    """Run a harness script with `--summary-json FILE` (a temporary file) and add its row to
    ``results``, counted by ``count`` from the summary. A summary that is missing or not JSON
    counts nothing, and a script that fails with nothing counted as failed counts as one
    failure: a script that died before writing its summary never makes a green row."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        summary = Path(f.name)
    cmd = [*cmd, "--summary-json", str(summary)]
    print(f"\n=== {heading}: {' '.join(cmd)}", flush=True)
    rc, seconds = timed_call(cmd)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    try:
        counts = count(json.loads(summary.read_text()))
    except (json.JSONDecodeError, FileNotFoundError):
        pass
    finally:
        summary.unlink(missing_ok=True)
    if rc != 0 and counts["failed"] == 0:
        counts["failed"] = 1
    results.append((label, rc, counts, seconds))


def upstream(version: str, results: list) -> None:
    """vLLM's own curated tests, patched vs stock (scripts/upstream_oracle.py). Counts: passed on
    the patched tree / regressions against stock / the rest (skipped, unrunnable here, or
    failing on stock as well). A failing run with no regression counted: the script itself
    failed (setup error, no baseline)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "upstream_oracle.py"), "--version", version,
           "--ci"]
    summarized(cmd, f"{version} upstream", f"{version} upstream (vs stock)", dict, results)


def lint(version: str, results: list) -> None:
    """vLLM's own pre-commit checks on what the series changes (scripts/lint.py). Counts: per
    check, passed = the series adds no finding, failed = it adds some, skipped = the check does
    not apply to the changed files (or cannot run offline). A failing run with no check counted
    as failed: a tool that cannot be installed."""
    cmd = [sys.executable, str(ROOT / "scripts" / "lint.py"), "--version", version]
    summarized(cmd, f"{version} lint", f"{version} lint (added vs pristine)",
               lambda checks: tally("skipped" if c["skipped"] else "failed" if c["added"]
                                    else "passed" for c in checks), results)


def bisect(version: str, results: list, tests: bool = False) -> None:
    """The exported stack patch by patch onto the pristine release: compile and ruff
    (scripts/check_bisect.py --cheap), and with `tests` each patch's own tests too (the
    `bisect-tests` tier, in the release's virtualenv). Counts: patches OK / failing (or never
    applied). A failing run with no patch counted as failing: the export or the ruff install
    failed."""
    cmd = [sys.executable, str(ROOT / "scripts" / "check_bisect.py"), "--version", version,
           *([] if tests else ["--cheap"])]
    label = "bisect (compile, ruff, tests)" if tests else "bisect (compile, ruff)"
    summarized(cmd, f"{version} {'bisect-tests' if tests else 'bisect'}", f"{version} {label}",
               lambda patches: tally("passed" if p["ok"] else "failed" for p in patches),
               results)


def kernels_for(release, tiers: list[str]) -> str:
    return os.environ.get("VLLM_KERNELS") or (
        detect_kernels() if "gpu" in tiers else ("cpu" if release.cpu_kernels else "none"))


def setup(release, tiers: list[str]) -> None:
    """`make apply` and `make install` of one release (what its tiers need)."""
    print(f"\n=== vLLM {release.version}: {apply_series(release)}", flush=True)
    print(install(release, default_venv(release), kernels_for(release, tiers)), flush=True)


class BackgroundSetup:
    """`setup` of a release in a process of its own, started while the tiers of the release
    before it run: downloads and installs mostly wait for the network and the disk, and the
    tests rarely keep both CPUs busy. Its output is kept and printed when the release is due,
    so the log still reads release by release."""

    def __init__(self, release, tiers: list[str]) -> None:
        self.version = release.version
        self.log = tempfile.TemporaryFile(mode="w+")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--setup-only", "--version",
             release.version, "--tiers", ",".join(tiers)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
        self.end: float | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.proc.wait()
        self.end = time.monotonic()

    def wait(self, results: list) -> bool:
        """Wait for it, print its output; record it in `results`. True if it succeeded."""
        waited = time.monotonic()
        rc = self.proc.wait()
        waited = time.monotonic() - waited
        self.log.seek(0)
        sys.stdout.write(self.log.read())
        self.log.close()
        took = (self.end or time.monotonic()) - self.start
        print(f"(setup of {self.version}: {took / 60:.1f} min, {waited / 60:.1f} min of it "
              "waited for)", flush=True)
        results.append(setup_result(self.version, rc, took))
        return rc == 0


def run_release(release, tiers: list[str], results: list, slow: bool = False,
                prepared: BackgroundSetup | None = None,
                when_set_up: Callable[[], None] = lambda: None) -> None:
    """A release's tiers, after its setup (done here, or by `prepared` in the background);
    `when_set_up` runs between the two."""
    v = release.version
    start = time.monotonic()
    if prepared is not None:
        ok = prepared.wait(results)
        when_set_up()
        if not ok:
            return
    else:
        try:
            setup(release, tiers)
        except SeriesError as e:
            print(e.render(), file=sys.stderr)
            results.append(setup_result(v, 1, time.monotonic() - start))
            return
        results.append(setup_result(v, 0, time.monotonic() - start))
        when_set_up()
    kernels = kernels_for(release, tiers)
    python = str(default_venv(release) / "bin" / "python")
    # Inside the build tree the sdist's vllm.egg-info (version without "+cpu") shadows the
    # installed metadata vLLM's platform detection reads; say the platform explicitly.
    env = {"VLLM_TARGET_DEVICE": "cpu"} if kernels in ("cpu", "none") else {}
    for tier in tiers:
        if tier == "harness":
            continue  # release-independent, run once
        if tier == "unit":
            tests = series_tests(release)
            if tests:
                # Series tests built on vLLM's own test helpers name hub models (e.g.
                # facebook/opt-125m): the offline hub cache of public configs serves them.
                # vLLM's slow_test cases (the overlay's real-process ones: the same code on
                # every release) run on the default release only.
                marks = "not gpu" if v == load_matrix()[0] else "not gpu and not slow_test"
                pytest(python, ["-m", marks, "--timeout=600", *tests], release.tree,
                       f"{v} unit (series tests in tree)", results, {**offline_env(), **env})
        elif tier == "engine":
            select = [] if slow else ["-m", "not slow"]
            pytest(python, ["--timeout=900", *select, "tests/engine"], ROOT, f"{v} engine",
                   results, env)
        elif tier == "gpu":
            tests = series_tests(release)
            pytest(python, ["--timeout=900", "tests/gpu", *[str(release.tree / t) for t in tests]],
                   ROOT, f"{v} gpu", results)
        elif tier == "upstream":
            upstream(v, results)
        elif tier == "lint":
            lint(v, results)
        elif tier in ("bisect", "bisect-tests"):
            bisect(v, results, tests=tier == "bisect-tests")
        else:
            raise SeriesError(f"unknown test tier {tier!r} in ci/matrix.toml.")


def main() -> int:
    p = argparse.ArgumentParser()
    # Not VLLM_VERSION from the environment: `make test` means every release.
    p.add_argument("--version", default=None)
    p.add_argument("--tiers", default=None, help="comma-separated; default: the matrix's")
    p.add_argument("--gpu", action="store_true", help="run each release's gpu_tiers")
    p.add_argument("--slow", action="store_true",
                   help="engine tier: also the cases marked slow (shapes CI covers otherwise)")
    p.add_argument("--setup-only", action="store_true",
                   help="only apply and install the release(s) their tiers need")
    p.add_argument("--installed", action="store_true",
                   help="test the vLLM this Python imports (e.g. after make overlay-install): "
                        "tests/gpu, tests/engine and the overlay's own tests; no apply/install")
    args = p.parse_args()
    if args.installed:
        return test_installed()
    _, releases = load_matrix()
    if args.version and args.version not in releases:
        from seriestool import get_release
        get_release(args.version)  # raises the operator error
    chosen = [releases[args.version]] if args.version else list(releases.values())
    results: list = []

    def tiers_of(r):
        if args.tiers:
            return args.tiers.split(",")
        return r.gpu_tiers if args.gpu else r.ci_tiers

    if args.setup_only:
        for release in chosen:
            setup(release, tiers_of(release))
        return 0
    started = time.monotonic()
    todo = [r for r in chosen if [t for t in tiers_of(r) if t != "harness"]]
    # Each release's setup runs in the background while the tests before it run.
    ahead = BackgroundSetup(todo[0], tiers_of(todo[0])) if len(todo) > 1 else None
    if any("harness" in tiers_of(r) for r in chosen):
        harness(results)
    for i, release in enumerate(todo):
        prepared, ahead = ahead, None

        def start_next(i: int = i) -> None:
            nonlocal ahead
            if i + 1 < len(todo):
                ahead = BackgroundSetup(todo[i + 1], tiers_of(todo[i + 1]))

        run_release(release, tiers_of(release), results, slow=args.slow, prepared=prepared,
                    when_set_up=start_next)

    return summarize(results, time.monotonic() - started)


def harness(results: list) -> None:
    """The harness's own tests, with the harness tier's virtualenv (made here if needed)."""
    start = time.monotonic()
    try:
        python = ensure_harness_venv()
    except SeriesError as e:
        print(e.render(), file=sys.stderr)
        results.append(("harness (test tools)", 1, {"passed": 0, "failed": 1, "skipped": 0},
                        time.monotonic() - start))
        return
    pytest(str(python), ["--timeout=900", "tests/harness"], ROOT, "harness", results)


def test_installed() -> int:
    """A host where vLLM is installed with the series laid over it (make overlay-install):
    tests/gpu, then the overlay's own upstream-layout tests, in a scratch `tests` package as
    they sit in vLLM's tree (they import `tests.v1...`)."""
    import shutil

    if not _has_plugin("pytest"):
        raise SeriesError(
            f"make test-installed runs pytest with the Python that imports the installed vLLM "
            f"({sys.executable}), and it has no pytest.",
            f"install the test tools into it: {sys.executable} -m pip install -r "
            f"{TEST_REQUIREMENTS.relative_to(ROOT)} (or PYTHON=<that Python> make "
            "test-installed).")
    results: list = []
    timeout = ["--timeout=900"] if _has_plugin("pytest_timeout") else []
    pytest(sys.executable, [*timeout, "tests/gpu"], ROOT, "installed: tests/gpu", results)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        shutil.copytree(ROOT / "vllm_overlay" / "tests", scratch / "tests")
        for pkg in (scratch / "tests").rglob("*"):
            if pkg.is_dir() and not (pkg / "__init__.py").exists():
                (pkg / "__init__.py").touch()
        (scratch / "tests" / "__init__.py").touch()
        pytest(sys.executable, [*timeout, "tests"], scratch, "installed: overlay tests", results)
    return summarize(results)


def _has_plugin(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def summarize(results: list, wall_s: float | None = None) -> int:
    print("\n=== summary")
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for label, rc, c, seconds in results:
        status = "ok" if rc in (0, 5) and c["failed"] == 0 else "FAILED"
        print(f"  {label:<40} {status:<7} {c['passed']} passed, {c['failed']} failed, "
              f"{c['skipped']} skipped  ({seconds / 60:.1f} min)")
        for k in total:
            total[k] += c[k]
    # Setups overlap the tests before them: the run's own wall time where known.
    minutes = (wall_s if wall_s is not None else sum(r[3] for r in results)) / 60
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped"
          f" in {minutes:.1f} min")
    return 0 if total["failed"] == 0 and total["passed"] > 0 else 1


if __name__ == "__main__":
    main_guard(main)
