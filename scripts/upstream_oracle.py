#!/usr/bin/env python3
"""vLLM's own tests as a regression oracle: the patched tree against the stock release.

  python3 scripts/upstream_oracle.py --version 0.32.0                  # make upstream-test
  python3 scripts/upstream_oracle.py --version 0.32.0 --write-baseline # make upstream-baseline
  python3 scripts/upstream_oracle.py --version 0.32.0 --stock          # stock and patched, now

Runs the test files that ci/upstream/curated.toml lists for the release (vLLM's own tests, as
shipped in its sdist) with the release's virtualenv (`make install`), offline:
HF_HUB_OFFLINE=1 and a hub cache of public model configs (scripts/hf_cache.py), so tests that
build a ModelConfig from a hub id run for real. Each file runs in its own pytest process (as
many side by side as there are CPUs; KVSERIES_UPSTREAM_JOBS=1 runs one at a time) with
cwd = the tree under test (vLLM's tests/conftest.py and `tests.*` imports resolve there), a
per-test timeout, and a per-file time limit; tests the curated list names as unrunnable here
are taken out of the run and reported with their reason.

The stock tree is a git worktree of build/vllm-X at tag vX (build/.stock/vllm-X) with the build
tree's prebuilt kernel files copied in; KVSERIES_VLLM_TREE points the virtualenv's `import vllm`
at it (see FINDER in scripts/install.py).

--write-baseline runs the stock tree and writes ci/upstream/vX.txt (one "test-id outcome" line
per test, sorted). The default run tests the patched tree and compares with that file: it fails
when a test that passed on stock does not pass on the patched tree. --stock runs both trees now
instead of reading the baseline file.

The patched run's outcomes are saved to build/upstream/vX-patched-outcomes.txt, and every test
that did not pass is listed with its failure line in build/upstream/vX-<stock|patched>.txt;
--patched-outcomes FILE compares saved outcomes again without running anything.

--summary-json FILE writes {"passed", "failed", "skipped"} for run_tests.py: passed = tests
passing on the patched tree, failed = regressions, skipped = every other test (skipped,
unrunnable here, or failing on stock as well).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import apply_series, is_build_tree  # noqa: E402
from hf_cache import offline_env  # noqa: E402
from install import default_venv, refresh_finder  # noqa: E402
from seriestool import ROOT, Release, SeriesError, build_dir, get_release, git, main_guard  # noqa: E402
from treework import copy_build_outputs  # noqa: E402

CURATED = ROOT / "ci" / "upstream" / "curated.toml"
REQUIREMENTS = ROOT / "ci" / "upstream" / "requirements.txt"
PASSING = {"passed", "xfailed"}
NOT_RUN = {"skipped", "unrunnable"}


def baseline_path(release: Release) -> Path:
    return ROOT / "ci" / "upstream" / f"{release.tag}.txt"


# ---------------------------------------------------------------------------------------------
# The curated list


def load_curated(release: Release, ci: bool = False) -> dict:
    """{"files": [...], "unrunnable": {id: reason}, "timeout": s, "file_timeout": s}.

    ci: only the release's `ci_files` (the subset `make test` runs to stay within CI's time;
    `make upstream-test` runs every file)."""
    data = tomllib.loads(CURATED.read_text())
    defaults = data.get("defaults", {})
    entry = data.get("release", {}).get(release.version)
    if not entry:
        raise SeriesError(
            f"{CURATED.relative_to(ROOT)} has no [release.\"{release.version}\"] section.",
            "Add the release's curated test files there (see the other releases).")
    return {
        "files": entry.get("ci_files", entry["files"]) if ci else entry["files"],
        "unrunnable": entry.get("unrunnable", {}),
        "timeout": entry.get("timeout", defaults.get("timeout", 120)),
        "file_timeout": entry.get("file_timeout", defaults.get("file_timeout", 900)),
    }


# ---------------------------------------------------------------------------------------------
# Outcomes and their comparison


def read_outcomes(path: Path) -> dict[str, str]:
    """A baseline file: "test-id outcome" per line (the id may hold spaces, the outcome not)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            nodeid, outcome = line.rstrip().rsplit(None, 1)
            out[nodeid] = outcome
    return out


def write_outcomes(path: Path, outcomes: dict[str, str], header: str) -> None:
    lines = [f"# {h}" for h in header.splitlines()]
    lines += [f"{nodeid} {outcomes[nodeid]}" for nodeid in sorted(outcomes)]
    path.write_text("\n".join(lines) + "\n")


def passes(outcome: str | None) -> bool:
    return outcome in PASSING


def compare(stock: dict[str, str], patched: dict[str, str]) -> dict[str, list[str]]:
    """Sort every test id into what changed between stock and patched.

    regressed: passed on stock, does not pass patched (failed, error, crashed, skipped,
               unrunnable, or gone from its file's patched run)
    fixed:     did not pass on stock, passes patched
    new:       only in the patched run (tests the series adds or renames)
    """
    result: dict[str, list[str]] = {"regressed": [], "fixed": [], "new": []}
    patched_files = {file_of(n) for n in patched}
    for nodeid in sorted(set(stock) | set(patched)):
        before, after = stock.get(nodeid), patched.get(nodeid)
        if after is None and file_of(nodeid) not in patched_files:
            continue  # its file was not run on the patched tree at all
        if before is None:
            result["new"].append(nodeid)
        elif passes(before) and not passes(after):
            result["regressed"].append(nodeid)
        elif not passes(before) and passes(after):
            result["fixed"].append(nodeid)
    return result


def unrunnable_reason(nodeid: str, unrunnable: dict[str, str]) -> str | None:
    """The reason an entry gives for nodeid: exact id, a test's every parametrization
    (`file::test` matches `file::test[...]`), a class or a whole file."""
    for key, reason in unrunnable.items():
        if nodeid == key or nodeid.startswith((key + "[", key + "::")):
            return reason
    return None


def mark_unrunnable(outcomes: dict[str, str], unrunnable: dict[str, str]) -> dict[str, str]:
    """Outcomes with every test the curated list now names unrunnable marked so, whatever it
    did when recorded: a baseline recorded before an entry was added compares the same way."""
    return {n: "unrunnable" if unrunnable_reason(n, unrunnable) else o
            for n, o in outcomes.items()}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def counts(outcomes: dict[str, str], file: str | None = None) -> Counter:
    return Counter(o for n, o in outcomes.items() if file is None or file_of(n) == file)


def fmt_counts(c: Counter) -> str:
    failed = c["failed"] + c["error"] + c["crashed"] + c["xpassed"]
    return f"{c['passed'] + c['xfailed']}/{failed}/{c['skipped']}/{c['unrunnable']}"


def comparison_table(stock: dict[str, str], patched: dict[str, str]) -> str:
    diff = compare(stock, patched)
    files = sorted({file_of(n) for n in (*stock, *patched)})
    width = max([len(f) for f in files] + [len("total")])
    head = f"{'test file':<{width}}  {'stock p/f/s/u':>15}  {'patched p/f/s/u':>15}  regressed"
    rows = [head, "-" * len(head)]
    regressed_by_file = Counter(file_of(n) for n in diff["regressed"])
    for f in files:
        rows.append(f"{f:<{width}}  {fmt_counts(counts(stock, f)):>15}  "
                    f"{fmt_counts(counts(patched, f)):>15}  {regressed_by_file[f]}")
    rows.append("-" * len(head))
    rows.append(f"{'total':<{width}}  {fmt_counts(counts(stock)):>15}  "
                f"{fmt_counts(counts(patched)):>15}  {len(diff['regressed'])}")
    rows.append("p/f/s/u = passed / failed (error, crash, timeout) / skipped / unrunnable here")
    for key, title in (("regressed", "REGRESSED (passed on stock, not on the patched tree)"),
                       ("fixed", "fixed (failed on stock, passes patched)"),
                       ("new", "new (not in the stock run)")):
        if diff[key]:
            rows.append(f"\n{title}:")
            rows += [f"  {n}  [{stock.get(n, '-')} -> {patched.get(n, 'gone')}]"
                     for n in diff[key]]
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Trees and runs


def stock_tree(release: Release) -> Path:
    """build/.stock/vllm-X: a worktree of the build tree at vX, plus its prebuilt kernels."""
    tree = release.tree
    stock = build_dir() / ".stock" / f"vllm-{release.version}"
    usable = (stock / ".git").exists() and git(stock, "rev-parse", "-q", "--verify",
                                               "HEAD", check=False).returncode == 0
    if not usable:  # never made, or its build tree was deleted and made again
        shutil.rmtree(stock, ignore_errors=True)
        git(tree, "worktree", "prune")
        stock.parent.mkdir(parents=True, exist_ok=True)
        git(tree, "worktree", "add", "-q", "--detach", str(stock), release.tag)
    else:
        git(stock, "checkout", "-q", "--detach", release.tag)
        git(stock, "reset", "-q", "--hard", release.tag)
    # The build tree's ignored build outputs (kernels copied by `make install`) are not in git.
    copied = copy_build_outputs(tree, stock, replace_older=True)
    if copied:
        print(f"stock tree {stock}: {copied} prebuilt files copied from {tree}")
    return stock


def ensure_test_requirements(python: Path) -> None:
    """vLLM's tests/conftest.py imports a few packages vLLM itself does not depend on."""
    if not REQUIREMENTS.exists():
        return
    names = [ln.split("#")[0].strip() for ln in REQUIREMENTS.read_text().splitlines()]
    names = [n for n in names if n]
    mods = {n: n.split("[")[0].split("=")[0].split(">")[0].replace("-", "_") for n in names}
    missing = [n for n, m in mods.items()
               if subprocess.call([str(python), "-c", f"import {m}"],
                                  stderr=subprocess.DEVNULL) != 0]
    if missing:
        print(f"installing vLLM's test requirements: {' '.join(missing)}", flush=True)
        subprocess.check_call([str(python), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", *missing])


def _run_measured(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple:
    """(exit code or "time limit", output, CPU seconds) of one child process. The CPU time is
    the child's own (wait4), so files running side by side each report theirs."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    rc: int | str | None = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if rc is None and time.monotonic() > deadline:
            rc = "time limit"
            proc.kill()
        time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=30)
    return (rc or proc.returncode, "".join(chunks), usage.ru_utime + usage.ru_stime)


def _children_cpu() -> float:
    """CPU seconds (user + system) of finished child processes: on a shared machine the wall
    time of a run says little about how long it takes on a CI runner of its own."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_file(python: Path, tree: Path, test_file: str, curated: dict, env: dict,
             messages: dict[str, str]) -> dict[str, str]:
    """Run one test file; return {test id: outcome}. Tests collected but never reported
    (pytest crashed or hit the file time limit) are "crashed"."""
    with tempfile.TemporaryDirectory() as tmp:
        outcomes_file = Path(tmp) / "outcomes.jsonl"
        unrunnable_file = Path(tmp) / "unrunnable.json"
        unrunnable_file.write_text(json.dumps(curated["unrunnable"]))
        run_env = {
            **os.environ, **env,
            "KVSERIES_VLLM_TREE": str(tree),
            "KVSERIES_UPSTREAM_OUTCOMES": str(outcomes_file),
            "KVSERIES_UPSTREAM_UNRUNNABLE": str(unrunnable_file),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "scripts")] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        }
        cmd = [str(python), "-m", "pytest", "-p", "upstream_plugin", "-p", "no:cacheprovider",
               "-q", "-rfE", "--tb=line", f"--timeout={curated['timeout']}", test_file]
        if not (tree / test_file).exists():
            return {test_file: "missing"}
        start = time.monotonic()
        rc, output, cpu = _run_measured(cmd, tree, run_env, curated["file_timeout"])
        took = time.monotonic() - start
        collected: list[str] = []
        outcomes: dict[str, str] = {}
        if outcomes_file.exists():
            for line in outcomes_file.read_text().splitlines():
                record = json.loads(line)
                if "collected" in record:
                    collected = record["collected"]
                else:
                    outcomes[record["id"]] = record["outcome"]
                    if record.get("message") or record.get("reason"):
                        messages[record["id"]] = record.get("message") or record["reason"]
        for nodeid in collected:
            outcomes.setdefault(nodeid, "crashed")
        c = Counter(outcomes.values())
        print(f"  {test_file}: {dict(sorted(c.items()))} in {took:.0f}s wall, {cpu:.0f}s CPU "
              f"(pytest exit {rc})", flush=True)
        if rc not in (0, 1, 5) or not outcomes:
            # Collection error, crash or time limit: show pytest's own words.
            tail = "\n".join(output.strip().splitlines()[-25:])
            print("    " + tail.replace("\n", "\n    "), flush=True)
        if not outcomes:
            outcomes[test_file] = "error"  # the file did not even collect
        return outcomes


def run_tree(release: Release, tree: Path, label: str,
             ci: bool = False) -> tuple[dict[str, str], float]:
    venv = default_venv(release)
    python = venv / "bin" / "python"
    if not python.exists():
        raise SeriesError(f"there is no virtualenv at {venv}.",
                          f"Run `make install VLLM_VERSION={release.version}` first.")
    refresh_finder(venv, release.tree)
    ensure_test_requirements(python)
    curated = load_curated(release, ci)
    env = {**offline_env(), "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONDONTWRITEBYTECODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    print(f"\n=== vLLM {release.version} upstream tests, {label} tree {tree}", flush=True)
    start, cpu_start = time.monotonic(), _children_cpu()
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    # Written after every file, so an interrupted run still leaves what it measured.
    partial = build_dir() / "upstream" / f"{release.tag}-{label}-outcomes.txt"
    report = build_dir() / "upstream" / f"{release.tag}-{label}.txt"
    report.parent.mkdir(parents=True, exist_ok=True)
    # Files run side by side, one per CPU (KVSERIES_UPSTREAM_JOBS overrides): each pytest
    # process is mostly one busy thread, and the tests share nothing but the read-only tree.
    jobs = max(1, int(os.environ.get("KVSERIES_UPSTREAM_JOBS") or os.cpu_count() or 1))
    done: list[str] = []
    with ThreadPoolExecutor(max_workers=min(jobs, len(curated["files"]) or 1)) as pool:
        running = {pool.submit(run_file, python, tree, f, curated, env, messages): f
                   for f in curated["files"]}
        for fut in as_completed(running):
            outcomes.update(fut.result())
            done.append(running[fut])
            write_outcomes(partial, outcomes, f"vLLM {release.version} {label} tree, files "
                           "run: " + " ".join(f for f in curated["files"] if f in done))
            # Why each test that did not pass failed (or is unrunnable), for the reader.
            report.write_text("".join(f"{n} {outcomes[n]}: {messages.get(n, '').strip()}\n"
                                      for n in sorted(outcomes) if not passes(outcomes[n])))
    print(f"  outcomes: {partial}; the ones other than passed, with the reason: {report}")
    print(f"  {label} tree: {len(outcomes)} tests in {time.monotonic() - start:.0f}s wall, "
          f"{_children_cpu() - cpu_start:.0f}s CPU", flush=True)
    run_files = tuple(curated["files"])
    stale = [k for k in curated["unrunnable"]
             if k.startswith(run_files)  # entries of files not run this time are not stale
             and not any(n == k or n.startswith((k + "[", k + "::")) for n in outcomes)]
    if stale:
        print("  note: unrunnable entries that match no test (stale?): " + ", ".join(stale))
    return outcomes, time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--write-baseline", action="store_true",
                   help="run the stock tree and write ci/upstream/vX.txt")
    p.add_argument("--stock", action="store_true",
                   help="run the stock tree now instead of reading the baseline file")
    p.add_argument("--patched-outcomes", type=Path, default=None,
                   help="compare these saved patched outcomes instead of running the tree")
    p.add_argument("--summary-json", type=Path, default=None)
    p.add_argument("--ci", action="store_true",
                   help="run only the release's ci_files of ci/upstream/curated.toml")
    args = p.parse_args()
    release = get_release(args.version)
    if not is_build_tree(release.tree, release):
        print(apply_series(release), flush=True)
    baseline = baseline_path(release)

    if args.write_baseline:
        outcomes, took = run_tree(release, stock_tree(release), "stock", args.ci)
        curated = load_curated(release, ci=args.ci)
        partial = ""
        if args.ci:
            # What CI compares against; `make upstream-test` then treats the other files'
            # tests as new until the baseline is recorded for every file.
            partial = ("\nPARTIAL: covers only these files of ci/upstream/curated.toml: "
                       + " ".join(curated["files"])
                       + "\nFiles not covered compare as new tests until the baseline is "
                       "recorded again.")
        write_outcomes(baseline, outcomes,
                       f"vLLM {release.version} stock ({release.tag}), vLLM's own tests offline: "
                       "test-id outcome\nWritten by `make upstream-baseline "
                       f"VLLM_VERSION={release.version}` from ci/upstream/curated.toml "
                       f"(timeout {curated['timeout']}s per test)." + partial)
        c = counts(outcomes)
        print(f"\nwrote {baseline.relative_to(ROOT)}: {len(outcomes)} tests, "
              f"p/f/s/u {fmt_counts(c)}, in {took:.0f}s")
        return 0

    stock = run_tree(release, stock_tree(release), "stock", args.ci)[0] if args.stock else None
    if args.patched_outcomes:
        patched, took = read_outcomes(args.patched_outcomes), 0.0
    else:
        patched, took = run_tree(release, release.tree, "patched", args.ci)
        saved = build_dir() / "upstream" / f"{release.tag}-patched-outcomes.txt"
        write_outcomes(saved, patched, f"vLLM {release.version} patched tree: test-id outcome")
        print(f"  patched outcomes saved to {saved} (compare again with --patched-outcomes)")
    if stock is None:
        if not baseline.exists():
            raise SeriesError(
                f"there is no baseline {baseline.relative_to(ROOT)} for vLLM {release.version}.",
                f"Record it from the stock tree: `make upstream-baseline "
                f"VLLM_VERSION={release.version}` (or compare live with --stock).")
        stock = read_outcomes(baseline)
    unrunnable = load_curated(release)["unrunnable"]
    stock, patched = mark_unrunnable(stock, unrunnable), mark_unrunnable(patched, unrunnable)
    print(f"\n=== vLLM {release.version}: stock ({'run now' if args.stock else baseline.name}) "
          f"vs patched ({took:.0f}s)")
    print(comparison_table(stock, patched))
    diff = compare(stock, patched)
    if args.summary_json:
        c = counts(patched)
        passed = c["passed"] + c["xfailed"]
        args.summary_json.write_text(json.dumps({
            "passed": passed, "failed": len(diff["regressed"]),
            "skipped": len(patched) - passed - len(diff["regressed"])}))
    if diff["regressed"]:
        print(f"\nFAILED: {len(diff['regressed'])} upstream tests pass on stock vLLM "
              f"{release.version} but not on the patched tree (listed above).")
        return 1
    print(f"\nOK: no upstream test that passes on stock vLLM {release.version} fails patched.")
    return 0


if __name__ == "__main__":
    main_guard(main)
