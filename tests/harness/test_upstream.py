"""The upstream regression oracle's own logic: outcome files, the stock-vs-patched comparison,
which tests the curated list takes out, and the `import vllm` redirect to another tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import upstream_oracle as ut  # noqa: E402
from install import dist_info_name, finder_source  # noqa: E402
from upstream_oracle import unrunnable_reason  # noqa: E402

F = "tests/v1/core/test_kv_cache_utils.py"


def test_compare_flags_only_stock_passes_that_do_not_pass_patched():
    stock = {
        f"{F}::test_a": "passed",
        f"{F}::test_b": "passed",
        f"{F}::test_c": "failed",
        f"{F}::test_d": "skipped",
        f"{F}::test_e": "passed",
        f"{F}::test_f": "passed",
        f"{F}::test_g": "xfailed",
        f"{F}::test_h": "passed",
    }
    patched = {
        f"{F}::test_a": "passed",
        f"{F}::test_b": "failed",
        f"{F}::test_c": "passed",
        f"{F}::test_d": "skipped",
        f"{F}::test_e": "crashed",
        # test_f is gone from the patched run
        f"{F}::test_g": "xpassed",
        f"{F}::test_h": "skipped",
        f"{F}::test_new": "passed",
    }
    diff = ut.compare(stock, patched)
    assert diff["regressed"] == [f"{F}::test_b", f"{F}::test_e", f"{F}::test_f",
                                 f"{F}::test_g", f"{F}::test_h"]
    assert diff["fixed"] == [f"{F}::test_c"]
    assert diff["new"] == [f"{F}::test_new"]


def test_compare_ignores_files_the_patched_run_did_not_reach():
    stock = {f"{F}::a": "passed", "tests/other.py::b": "passed"}
    patched = {f"{F}::a": "passed"}
    assert ut.compare(stock, patched)["regressed"] == []
    assert ut.compare(stock, {f"{F}::c": "passed"})["regressed"] == [f"{F}::a"]


def test_mark_unrunnable_applies_the_current_list_to_old_records():
    got = ut.mark_unrunnable({f"{F}::t[1]": "failed", f"{F}::u": "passed"},
                             {f"{F}::t": "needs a GPU"})
    assert got == {f"{F}::t[1]": "unrunnable", f"{F}::u": "passed"}


def test_compare_identical_runs_have_no_regressions():
    run = {f"{F}::test_a[1]": "passed", f"{F}::test_a[2]": "failed", f"{F}::t": "unrunnable"}
    assert ut.compare(run, dict(run)) == {"regressed": [], "fixed": [], "new": []}


def test_outcome_file_round_trip_keeps_ids_with_spaces(tmp_path):
    outcomes = {f"{F}::test_a[x y]": "passed", f"{F}::test_b": "failed"}
    path = tmp_path / "v1.txt"
    ut.write_outcomes(path, outcomes, "header line\nsecond")
    text = path.read_text().splitlines()
    assert text[:2] == ["# header line", "# second"]
    assert text[2:] == sorted(text[2:])
    assert ut.read_outcomes(path) == outcomes


def test_comparison_table_counts_and_lists_regressions():
    stock = {f"{F}::a": "passed", f"{F}::b": "passed", "tests/x.py::c": "skipped"}
    patched = {f"{F}::a": "passed", f"{F}::b": "error", "tests/x.py::c": "skipped"}
    table = ut.comparison_table(stock, patched)
    row = next(line for line in table.splitlines() if line.startswith(F))
    assert row.split()[1:] == ["2/0/0/0", "1/1/0/0", "1"]
    assert f"{F}::b  [passed -> error]" in table
    assert "REGRESSED" in table


@pytest.mark.parametrize("nodeid, reason", [
    (f"{F}::test_a", "whole test"),
    (f"{F}::test_a[cuda-1]", "whole test"),
    (f"{F}::test_ab", None),
    ("tests/v1/gpu_only.py::TestX::test_y", "file"),
    (f"{F}::TestCls::test_z", "class"),
])
def test_unrunnable_entries_match_tests_params_classes_and_files(nodeid, reason):
    unrunnable = {f"{F}::test_a": "whole test", "tests/v1/gpu_only.py": "file",
                  f"{F}::TestCls": "class"}
    assert unrunnable_reason(nodeid, unrunnable) == reason


def test_finder_follows_kvseries_vllm_tree(tmp_path):
    """The editable install's finder maps `import vllm` to KVSERIES_VLLM_TREE when set, and
    answers the `vllm` distribution's metadata from the install, not from a tree's egg-info."""
    for name in ("installed", "other"):
        pkg = tmp_path / name / "vllm"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"TREE = {name!r}\n")
    (tmp_path / "finder.py").write_text(finder_source(tmp_path / "installed", "1.0+cpu"))
    info = tmp_path / dist_info_name("1.0+cpu")
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 1.0+cpu\n")
    # A tree on sys.path with the sdist's own egg-info must not shadow the install's metadata.
    egg = tmp_path / "installed" / "vllm.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 1.0\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import finder; finder.install(); "
            "import vllm, importlib.metadata as m; print(vllm.TREE, m.version('vllm'))")

    def which(env: dict) -> str:
        return subprocess.run([sys.executable, "-c", code, str(tmp_path / "installed")],
                              cwd=tmp_path, text=True, check=True,
                              capture_output=True, env={"PATH": "/usr/bin:/bin", **env}
                              ).stdout.strip()

    assert which({}) == "installed 1.0+cpu"
    assert which({"KVSERIES_VLLM_TREE": str(tmp_path / "other")}) == "other 1.0+cpu"


def test_curated_list_names_existing_baselines_and_reasons():
    """Every release of the matrix has a curated list; every unrunnable entry says why."""
    import tomllib

    data = tomllib.loads((ROOT / "ci" / "upstream" / "curated.toml").read_text())
    matrix = tomllib.loads((ROOT / "ci" / "matrix.toml").read_text())
    for version, release in matrix["release"].items():
        entry = data["release"][version]
        assert entry["files"], version
        for key, reason in entry.get("unrunnable", {}).items():
            assert key.startswith("tests/") and len(reason) > 10, (version, key)
        if "upstream" in release["ci_tiers"]:
            baseline = ROOT / "ci" / "upstream" / f"v{version}.txt"
            outcomes = ut.read_outcomes(baseline)
            assert outcomes and set(outcomes.values()) <= {
                "passed", "failed", "error", "skipped", "xfailed", "xpassed", "crashed",
                "unrunnable", "missing"}, version


def test_plugin_records_outcomes_and_takes_unrunnable_out(tmp_path):
    """The pytest plugin on a real pytest run: one outcome per test, unrunnable deselected."""
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip(reason='x')\n"
        "def test_skip(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError\n"
        "def test_setup_error(broken): pass\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_gpu(n): raise SystemExit('must not run')\n")
    outcomes = tmp_path / "out.jsonl"
    unrunnable = tmp_path / "unrunnable.json"
    unrunnable.write_text(json.dumps({"test_sample.py::test_gpu": "needs a GPU"}))
    subprocess.run([sys.executable, "-m", "pytest", "-p", "upstream_plugin", "-q",
                    "-p", "no:cacheprovider", "test_sample.py"], cwd=tmp_path,
                   env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "scripts"),
                        "KVSERIES_UPSTREAM_OUTCOMES": str(outcomes),
                        "KVSERIES_UPSTREAM_UNRUNNABLE": str(unrunnable)},
                   capture_output=True)
    records = [json.loads(line) for line in outcomes.read_text().splitlines()]
    got = {r["id"]: r["outcome"] for r in records if "id" in r}
    assert got == {
        "test_sample.py::test_ok": "passed",
        "test_sample.py::test_bad": "failed",
        "test_sample.py::test_skip": "skipped",
        "test_sample.py::test_setup_error": "error",
        "test_sample.py::test_gpu[1]": "unrunnable",
        "test_sample.py::test_gpu[2]": "unrunnable",
    }
    collected = next(r["collected"] for r in records if "collected" in r)
    assert not any("test_gpu" in n for n in collected)


def test_run_measured_reports_the_childs_own_cpu_and_the_time_limit(tmp_path):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    # Another child burning CPU beside it does not count towards it.
    other = subprocess.Popen([sys.executable, "-c", burn.replace("0.3", "1.5")])
    try:
        rc, output, cpu = ut._run_measured([sys.executable, "-c", burn + "print('done')"],
                                           tmp_path, dict(os.environ), timeout=60)
    finally:
        other.wait()
    assert rc == 0 and output.strip() == "done"
    assert 0.25 <= cpu < 1.2
    rc, output, _ = ut._run_measured(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        tmp_path, dict(os.environ), timeout=1)
    assert rc == "time limit" and "started" in output
