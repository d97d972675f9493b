"""scripts/check_bisect.py on fixture releases (see conftest.py): the exported stack, patch by
patch onto the pristine release, compiles, passes ruff and passes each patch's own tests.

The fixture's tests run with this Python (pytest is a harness requirement) instead of a
release virtualenv; ruff is the real one at the releases' pin, installed like `make lint`
installs it (skipped where the package index cannot be reached).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Project, make_sdist, write_matrix

V1, V2 = "1.0.0", "2.0.0"
RUFF_REV = "v0.14.0"  # what every supported release's .pre-commit-config.yaml pins today

OLD_TEST = """\
from vllm.core import f1


def test_one():
    assert f1(0) == 1


def test_broken():
    assert f1(0) == 2  # broken in the release itself
"""


def bisect_project(project: Project, ruff: bool = False) -> Project:
    """Rebuild the fixture releases with a pre-commit config (pinning ruff, or nothing), a
    pristine test file with one failing test, and a pristine ruff finding."""
    repos = [{"repo": "https://github.com/astral-sh/ruff-pre-commit", "rev": RUFF_REV,
              "hooks": [{"id": "ruff-check"}, {"id": "ruff-format"}]}] if ruff else []
    extra = {
        ".pre-commit-config.yaml": json.dumps({"repos": repos}, indent=1),
        "tests/test_old.py": OLD_TEST,
        "vllm/old.py": "import os\n\nA = 1\n",  # F401 in the release itself
    }
    cache = project.root / "cache"
    shas = {v: make_sdist(cache / f"vllm-{v}.tar.gz", v, extra) for v in (V1, V2)}
    write_matrix(project.root, shas)
    return project


def commit(project: Project, files: dict[str, str], subject: str) -> None:
    """One patch of the series: these files (None deletes), committed and refreshed."""
    project.run("apply.py", "--version", V1)
    tree = project.tree(V1)
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
        project.git(V1, "add", rel)
    project.git(V1, "commit", "-q", "-s", "-m", f"{subject}\n\nBody.")
    project.run("refresh.py", "--version", V1)


def core_with(project: Project, old: str, new: str) -> str:
    project.run("apply.py", "--version", V1)
    text = (project.tree(V1) / "vllm" / "core.py").read_text()
    assert old in text
    return text.replace(old, new, 1)


def bisect(project: Project, *args: str, env: dict | None = None):
    return project.run("check_bisect.py", "--version", V1, "--python", sys.executable, *args,
                       check=False, env=env)


def lines(stdout: str) -> dict[str, str]:
    """The result line of each patch, by the patch's number."""
    return {ln[:4]: ln for ln in stdout.splitlines() if ln[:4].isdigit() and ln[4] == "-"}


@pytest.fixture
def series(project: Project) -> Project:
    """A: f3 changes, with its test. B: a test of what C does, ahead of C. C: the change B's
    test needs, and a new test in the release's own test file (whose broken test stays)."""
    bisect_project(project)
    commit(project, {
        "vllm/core.py": core_with(project, "return x + 3\n", "return x + 30\n"),
        "tests/test_thirty.py": "import pytest\n\nfrom vllm.core import f3\n\n\n"
                                "def test_thirty():\n    assert f3(0) == 30\n\n\n"
                                "@pytest.mark.skipif(True, reason='needs the Fifty patch')\n"
                                "def test_thirty_with_fifty():\n    pass\n",
    }, "[Core] Thirty")
    commit(project, {
        "tests/test_fifty.py": "from vllm.core import f5\n\n\n"
                               "def test_fifty():\n    assert f5(0) == 50\n",
    }, "[Core] Test fifty ahead of its change")
    commit(project, {
        "vllm/core.py": core_with(project, "return x + 5\n", "return x + 50\n"),
        "tests/test_old.py": OLD_TEST + "\n\ndef test_fifty_too():\n"
                             "    from vllm.core import f5\n\n    assert f5(1) == 51\n",
    }, "[Core] Fifty")
    return project


def test_a_test_that_arrives_before_its_change_fails_that_patch(series: Project):
    proc = bisect(series)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    by = lines(proc.stdout)
    assert list(by) == ["0001", "0002", "0003"], proc.stdout
    assert "  OK  " in by["0001"] and "tests 1 files: 1 passed, 0 failed, 1 skipped" in by["0001"]
    # A skip is no failure, but its reason is shown: a test waiting for a later patch.
    assert "tests: skipped (1): needs the Fifty patch" in proc.stdout
    assert "  FAIL  tests: 1 failed of 1 files" in by["0002"]
    assert "tests: failed: tests/test_fifty.py::test_fifty" in proc.stdout
    # The release's own broken test fails before C as after it: not C's fault, but named.
    assert "  OK  " in by["0003"], proc.stdout
    assert "1 failing before the patch too" in by["0003"]
    assert "tests: failing before the patch too: tests/test_old.py::test_broken" in proc.stdout
    assert "summary: vLLM 1.0.0: 2 of 3 patches OK; FAIL: 0002-" in proc.stdout
    # The build tree is left as it was; the worktree is gone.
    assert series.git(V1, "status", "--porcelain") == ""
    assert not (series.root / "build" / ".bisect" / f"vllm-{V1}").exists()


def test_cheap_skips_the_tests_and_still_compiles(series: Project, tmp_path: Path):
    summary = tmp_path / "summary.json"
    proc = bisect(series, "--cheap", "--summary-json", str(summary))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by = lines(proc.stdout)
    assert all("  OK  " in ln and "tests" not in ln for ln in by.values()), proc.stdout
    assert "compile 2 files" in by["0001"]
    assert "ruff skipped (the release's .pre-commit-config.yaml pins no ruff)" in by["0001"]
    assert [r["ok"] for r in json.loads(summary.read_text())] == [True, True, True]


def test_a_patch_that_does_not_compile_fails_and_the_next_is_still_checked(project: Project):
    bisect_project(project)
    commit(project, {"vllm/bad.py": "def broken(:\n    pass\n"}, "[Core] Broken")
    commit(project, {"vllm/bad.py": "def broken():\n    pass\n"}, "[Core] Mended")
    proc = bisect(project, "--cheap")
    assert proc.returncode == 1
    by = lines(proc.stdout)
    assert "FAIL  compile: 1 of 1 files do not compile" in by["0001"], proc.stdout
    assert "compile: vllm/bad.py:1: SyntaxError" in proc.stdout
    assert "  OK  " in by["0002"]


def test_a_patch_that_does_not_apply_stops_the_stack(series: Project, tmp_path: Path):
    series.run("check_bisect.py", "--version", V1, "--cheap", check=False)
    made = series.root / "build" / ".bisect" / f"export-{V1}"
    patches = tmp_path / "patches"
    patches.mkdir()
    for p in sorted(made.glob("*.patch")):
        (patches / p.name).write_bytes(p.read_bytes())
    second = sorted(patches.glob("*.patch"))[1]
    second.write_text(second.read_text().replace("--- /dev/null", "--- a/tests/nothing.py"))
    proc = bisect(series, "--cheap", "--patches", str(patches))
    assert proc.returncode == 1
    by = lines(proc.stdout)
    assert "  OK  " in by["0001"] and "FAIL  apply: does not apply" in by["0002"]
    assert "0003-Core-Fifty.patch" in proc.stdout.split("FAIL  apply", 1)[1]
    assert "not applied (a patch before it does not apply)" in proc.stdout
    assert "1 of 3 patches OK; FAIL: 0002-" in proc.stdout and "1 not applied" in proc.stdout


def test_the_tests_need_the_release_virtualenv(series: Project):
    proc = series.run("check_bisect.py", "--version", V1, check=False)
    assert proc.returncode == 1
    assert f"no virtualenv at {series.root / 'build' / f'venv-{V1}'}" in proc.stderr
    assert "make install VLLM_VERSION=1.0.0" in proc.stderr and "--cheap" in proc.stderr


@pytest.fixture(scope="module")
def lint_venv() -> Path:
    """The checkout's own tool virtualenvs (build/lint-venv), as `make lint` uses them: ruff
    at the releases' pin, installed once (skipped without a package index)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import lint
        import seriestool
    finally:
        sys.path.pop(0)
    try:
        lint.tool_venv(f"ruff-{RUFF_REV[1:]}", [f"ruff=={RUFF_REV[1:]}"])
    except seriestool.SeriesError as e:
        pytest.skip(f"ruff {RUFF_REV} cannot be installed here: {e.problem.splitlines()[0]}")
    return lint.lint_venv_root()


def test_ruff_findings_a_patch_adds_fail_it_and_pristine_ones_do_not(project: Project,
                                                                      lint_venv: Path):
    bisect_project(project, ruff=True)
    # A: touches the release's file that already has an unused import: not A's finding.
    commit(project, {"vllm/old.py": "import os\n\nA = 1\nB = 2\n"}, "[Core] Touch old")
    # B: a new unused import. C: code ruff format would change.
    commit(project, {"vllm/new.py": "import sys\n\nC = 1\n"}, "[Core] Unused import")
    commit(project, {"vllm/ugly.py": "D = [1,2]\n"}, "[Core] Unformatted")
    proc = bisect(project, "--cheap", env={"KVSERIES_LINT_VENV": str(lint_venv)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    by = lines(proc.stdout)
    assert "  OK  " in by["0001"] and f"ruff {RUFF_REV[1:]}" in by["0001"], proc.stdout
    assert "FAIL  ruff: 1 findings added" in by["0002"]
    assert "ruff: vllm/new.py: F401 `sys` imported but unused" in proc.stdout
    assert "FAIL  ruff: 1 findings added" in by["0003"]
    assert "ruff: vllm/ugly.py: would reformat: -D = [1,2] | +D = [1, 2]" in proc.stdout


def test_a_step_past_its_time_limit_fails_and_is_ended(project: Project):
    import time

    bisect_project(project)
    commit(project, {"tests/test_slow.py": "import time\n\n\n"
                                           "def test_slow():\n    time.sleep(120)\n"},
           "[Core] A slow test")
    start = time.monotonic()
    proc = bisect(project, "--test-timeout", "5")
    assert time.monotonic() - start < 90, proc.stdout
    assert proc.returncode == 1
    assert "FAIL  tests: ran past its time limit of 5 s" in lines(proc.stdout)["0001"], proc.stdout


def test_a_second_command_on_the_same_release_stops_instead_of_sharing_its_worktree(
        series: Project):
    import fcntl
    import os

    lock = series.root / "build" / f".vllm-{V1}.lock"  # the build tree's lock (treework.py)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running check holds it
        proc = bisect(series, "--cheap")
    finally:
        os.close(fd)
    assert proc.returncode == 1
    assert f"is working on {series.tree(V1)}" in proc.stderr, proc.stderr
    assert bisect(series, "--cheap").returncode == 0  # the lock goes with its holder


def test_the_ci_tier_counts_patches(project: Project, monkeypatch):
    """`make test`'s bisect tier: the cheap check, one pass or failure per patch."""
    bisect_project(project)
    commit(project, {"vllm/bad.py": "def broken(:\n    pass\n"}, "[Core] Broken")
    commit(project, {"vllm/bad.py": "def broken():\n    pass\n"}, "[Core] Mended")
    for key, value in project.env.items():
        if key.startswith("KVSERIES_"):
            monkeypatch.setenv(key, value)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import run_tests
    finally:
        sys.path.pop(0)
    results: list = []
    run_tests.bisect(V1, results)
    (label, rc, counts, _), = results
    assert label == "1.0.0 bisect (compile, ruff)" and rc == 1
    assert counts == {"passed": 1, "failed": 1, "skipped": 0}
    # The bisect-tests tier runs the tests too, in the release's virtualenv: without one it
    # fails as one failure, never a green row.
    results.clear()
    run_tests.bisect(V1, results, tests=True)
    (label, rc, counts, _), = results
    assert label == "1.0.0 bisect (compile, ruff, tests)" and rc == 1
    assert counts["failed"] == 1 and counts["passed"] == 0


MEET = """\
import os
import time
from pathlib import Path


def test_meets_the_other_patch():
    # Passes only while the other patch's test runs too: each says it is here and waits for
    # the other, so the two patches' tests ran at once.
    here = Path(os.environ["MEET"])
    (here / "{me}").write_text(os.environ["KVSERIES_VLLM_TREE"])
    deadline = time.monotonic() + 30
    while not (here / "{other}").exists():
        assert time.monotonic() < deadline, "the other patch's test never ran beside this one"
        time.sleep(0.05)
    time.sleep({linger})
"""


def test_jobs_run_patches_tests_at_once_each_in_its_worktree_reported_in_order(
        project: Project, tmp_path: Path):
    bisect_project(project)
    # The first patch's test lingers, so the second finishes first: its line still comes
    # second.
    commit(project, {"tests/test_a.py": MEET.format(me="a", other="b", linger=2)}, "[Core] A")
    commit(project, {"tests/test_b.py": MEET.format(me="b", other="a", linger=0)}, "[Core] B")
    proc = bisect(project, "--jobs", "2", env={"MEET": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(lines(proc.stdout)) == ["0001", "0002"], proc.stdout
    assert all("tests 1 files: 1 passed" in ln for ln in lines(proc.stdout).values())
    trees = {(tmp_path / n).read_text() for n in "ab"}
    assert len(trees) == 2, trees  # each job in a worktree of its own
    assert not any((project.root / "build" / ".bisect").glob(f"**/vllm-{V1}"))
    # One at a time, the two never meet: the check can fail.
    for marker in "ab":
        (tmp_path / marker).unlink()
    proc = bisect(project, "--jobs", "1", "--per-test-timeout", "60",
                  env={"MEET": str(tmp_path)})
    assert proc.returncode == 1
    assert "FAIL  tests: 1 failed of 1 files" in lines(proc.stdout)["0001"], proc.stdout


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_stopped_check_ends_the_tests_of_every_job_and_removes_its_worktrees(
        project: Project, tmp_path: Path, jobs: int):
    import os
    import signal
    import subprocess
    import time

    bisect_project(project)
    slow = ("import os\nimport time\n\n\n"
            "def test_slow():\n"
            "    with open(os.path.join(os.environ['STARTED'], '{n}'), 'w') as f:\n"
            "        f.write(str(os.getpid()))\n"
            "    time.sleep(300)\n")
    names = [str(n) for n in range(1, jobs + 1)]
    for n in names:
        commit(project, {f"tests/test_slow{n}.py": slow.format(n=n)}, f"[Core] Slow {n}")
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "check_bisect.py"),
                             "--version", V1, "--python", sys.executable, "--jobs", str(jobs)],
                            env={**project.env, "STARTED": str(tmp_path)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started = [tmp_path / n for n in names]
    try:
        deadline = time.monotonic() + 120
        while (not all(p.exists() and p.read_text() for p in started)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert all(p.exists() for p in started), "the slow tests never all started"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    for p in started:
        with pytest.raises(ProcessLookupError):
            os.kill(int(p.read_text()), 0)
    assert not any((project.root / "build" / ".bisect").glob(f"**/vllm-{V1}"))
