"""scripts/run_tests.py's own plumbing: a release set up in the background while earlier tests
run reports its output and its failure in order, the summary's times, and the harness tier's
virtualenv (its pytest) made from ci/requirements-harness.txt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import run_tests  # noqa: E402


def test_a_failed_background_setup_is_printed_when_due_and_fails_the_run(capsys):
    # An unsupported release: the setup process fails at once with the operator's error.
    setup = run_tests.BackgroundSetup(SimpleNamespace(version="9.9.9"), ["unit"])
    results: list = []
    assert not setup.wait(results)
    out = capsys.readouterr().out
    assert "vLLM release '9.9.9' is not supported" in out
    assert "(setup of 9.9.9:" in out
    (label, rc, counts, seconds), = results
    assert label == "9.9.9 setup (apply, install)" and rc != 0 and counts["failed"] == 1
    assert seconds > 0
    assert run_tests.summarize(results, wall_s=90.0) == 1
    out = capsys.readouterr().out
    assert "9.9.9 setup (apply, install)" in out and "FAILED" in out
    assert "total: 0 passed, 1 failed, 0 skipped in 1.5 min" in out


def test_summary_rows_carry_their_minutes(capsys):
    results = [("harness", 0, {"passed": 3, "failed": 0, "skipped": 1}, 30.0),
               ("0.32.0 engine", 0, {"passed": 2, "failed": 0, "skipped": 0}, 600.0)]
    assert run_tests.summarize(results) == 0
    out = capsys.readouterr().out
    assert "3 passed, 0 failed, 1 skipped  (0.5 min)" in out
    assert "2 passed, 0 failed, 0 skipped  (10.0 min)" in out
    assert "total: 5 passed, 0 failed, 1 skipped in 10.5 min" in out


def test_the_harness_tier_venv_is_made_once_per_requirements_file(tmp_path, monkeypatch, capsys):
    import install
    from seriestool import SeriesError

    req = tmp_path / "ci" / "requirements-harness.txt"
    req.parent.mkdir()
    req.write_text("pip>=1  # in every virtualenv already: no download\n")
    monkeypatch.setattr(install, "HARNESS_REQUIREMENTS", req)
    monkeypatch.setattr(install, "ROOT", tmp_path)
    venv = tmp_path / "build" / "venv-harness"
    python = install.ensure_harness_venv(venv)
    assert python == venv / "bin" / "python"
    assert "installing the harness tier's test tools (ci/requirements-harness.txt)" in \
        capsys.readouterr().out
    prefix = subprocess.run([str(python), "-c", "import sys; print(sys.prefix)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert Path(prefix) == venv
    made = (venv / "pyvenv.cfg").stat().st_mtime_ns
    # The same requirements: reused as it is.
    assert install.ensure_harness_venv(venv) == python
    assert capsys.readouterr().out == ""
    assert (venv / "pyvenv.cfg").stat().st_mtime_ns == made
    # Changed requirements: made again from them; one pip cannot install is named, with the
    # fix, and leaves no stamp (the next run makes it again).
    (venv / "leftover").write_text("x")
    req.write_text("pytest @ file:///nonexistent/pytest.whl\n")
    with pytest.raises(SeriesError) as err:
        install.ensure_harness_venv(venv)
    assert "installing the harness tier's test tools" in capsys.readouterr().out
    assert not (venv / "leftover").exists()
    assert "pip could not install ci/requirements-harness.txt into" in err.value.problem
    assert "package index" in err.value.fix
    assert not (venv / install.HARNESS_STAMP).exists()
