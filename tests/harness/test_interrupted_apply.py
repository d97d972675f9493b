"""`make apply` killed (SIGTERM, SIGKILL) at each of its stages, with real git and real
processes: the next apply finishes the tree, or refuses with the commands that let it, and
never loses the user's work.

The kill lands at a known point through a `git` earlier on PATH (test code only) that stops
once, at the n-th call of one git subcommand, in one of three ways:

  before   it sleeps instead of running git (apply is between two git commands);
  hook     the real git runs with hooks that sleep: `pre-applypatch` (a `git am` that has
           patched the files and the index but not committed) or `reference-transaction`
           (git holds HEAD.lock and the branch's lock while it moves HEAD);
  smudge   the real git runs with a smudge filter that sleeps while git writes a chosen file
           (git holds .git/index.lock and has written part of the files).

Then the test kills apply.py: SIGKILL to its whole process group (nothing cleans up: git's
lock files stay), SIGTERM to apply.py alone (it stops its git with SIGTERM and exits 143), or
SIGKILL to apply.py alone (its git goes on running, stopped, in the tree).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, Project, add_patch, make_sdist, write_matrix

V1, V2 = "1.0.0", "2.0.0"
WAIT_S = 60

WRAPPER = """#!/bin/bash
# git, stopped once at the n-th call of one subcommand (see test_interrupted_apply.py)
dir={dir}
i=0; args=("$@")
while [[ ${{args[i]}} == -c || ${{args[i]}} == -C ]]; do i=$((i + 2)); done
while [[ ${{args[i]}} == --* ]]; do i=$((i + 1)); done
if [[ -e $dir/sub && ! -e $dir/fired && ${{args[i]}} == "$(cat $dir/sub)" ]]; then
    echo x >> $dir/calls
    if [[ $(wc -l < $dir/calls) -eq $(cat $dir/nth) ]]; then
        touch $dir/fired
        case $(cat $dir/how) in
            before) echo $$ > $dir/reached; exec sleep 600 ;;
            hook) exec {git} -c core.hooksPath=$dir/hooks "$@" ;;
            smudge) exec {git} -c core.attributesFile=$dir/attributes \\
                        -c filter.kvstop.smudge=$dir/stop "$@" ;;
        esac
    fi
fi
exec {git} "$@"
"""

STOP = """#!/bin/sh
echo $$ > {dir}/reached
exec sleep 600
"""

REF_TRANSACTION = """#!/bin/sh
# Stop while git holds the locks of the HEAD update it prepared.
[ "$1" = prepared ] || exit 0
grep -q ' HEAD$' || exit 0
exec {dir}/stop
"""


class Stopper:
    def __init__(self, dir: Path):
        self.dir = dir
        self.bin = dir / "bin"
        self.bin.mkdir(parents=True)
        git = shutil.which("git")
        for name, text, where in (("git", WRAPPER, self.bin), ("stop", STOP, dir)):
            (where / name).write_text(text.format(dir=dir, git=git))
            (where / name).chmod(0o755)
        hooks = dir / "hooks"
        hooks.mkdir()
        (hooks / "reference-transaction").write_text(REF_TRANSACTION.format(dir=dir))
        (hooks / "pre-applypatch").write_text(f"#!/bin/sh\nexec {dir}/stop\n")
        for hook in hooks.iterdir():
            hook.chmod(0o755)

    def arm(self, sub: str, how: str, nth: int = 1, path: str = "") -> None:
        for name in ("fired", "calls", "reached"):
            (self.dir / name).unlink(missing_ok=True)
        (self.dir / "sub").write_text(sub)
        (self.dir / "how").write_text(how)
        (self.dir / "nth").write_text(str(nth))
        (self.dir / "attributes").write_text(f"{path} filter=kvstop\n" if path else "")

    def wait_reached(self, proc: subprocess.Popen) -> None:
        end = time.monotonic() + WAIT_S
        while not (self.dir / "reached").exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"apply ended ({proc.returncode}) before the stop:\n"
                                     f"{out}\n{err}")
            assert time.monotonic() < end, "apply never reached the stop"
            time.sleep(0.02)


@pytest.fixture
def stopper(project: Project, tmp_path: Path):
    s = Stopper(tmp_path / "stopper")
    yield s
    # Whatever the test left sleeping (a stopped git, a hook) ends with the test.
    for pid in getattr(s, "groups", []):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def interrupted_apply(project: Project, stopper: Stopper, kill: str,
                      version: str = V1) -> subprocess.Popen:
    """Run apply.py until the armed stop, then kill it as `kill` says."""
    env = {**project.env, "PATH": f"{stopper.bin}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "apply.py"), "--version",
                             version],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    stopper.groups = [*getattr(stopper, "groups", []), proc.pid]
    stopper.wait_reached(proc)
    if kill == "SIGKILL-all":
        os.killpg(proc.pid, signal.SIGKILL)
    elif kill == "SIGTERM":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        assert kill == "SIGKILL-apply"
        os.kill(proc.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=WAIT_S)
    if kill == "SIGTERM":
        assert proc.returncode == 143 and "stopped by SIGTERM" in err, (proc.returncode, err)
    else:
        assert proc.returncode == -signal.SIGKILL
    return proc


def expect_finished(project: Project, want_head: str) -> str:
    """The next apply recovers and gives the very tree an uninterrupted apply gives."""
    proc = project.run("apply.py", "--version", V1)
    tree = project.tree(V1)
    assert project.git(V1, "rev-parse", "HEAD") == want_head, proc.stdout
    assert project.git(V1, "status", "--porcelain", "--untracked-files=all") == ""
    assert project.git(V1, "symbolic-ref", "--short", "HEAD") == "series"
    assert not (tree / ".git" / "rebase-apply").exists()
    assert not list((tree / ".git").rglob("*.lock"))
    assert '"step"' not in (tree / ".git" / "kv-series-state.json").read_text()
    assert not (project.root / "build" / f".unpack-{V1}").exists()
    assert "already applied" in project.run("apply.py", "--version", V1).stdout
    return proc.stdout


@pytest.fixture(scope="module")
def series_of_two(tmp_path_factory) -> tuple[dict[str, bytes], str]:
    """A series of two patches (file name -> bytes) and the HEAD an uninterrupted apply gives
    (the same in every fixture project: the harness's commits have fixed ids)."""
    from conftest import project as make_project

    proj = make_project.__wrapped__(tmp_path_factory.mktemp("series"))
    add_patch(proj, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    add_patch(proj, V1, "vllm/core.py", "return x + 9\n", "return x + 90\n", "[Core] B")
    shutil.rmtree(proj.tree(V1))
    proj.run("apply.py", "--version", V1)
    series = {p.name: p.read_bytes() for p in (proj.patches / f"v{V1}").iterdir()}
    return series, proj.git(V1, "rev-parse", "HEAD")


@pytest.fixture
def two_patches(project: Project, series_of_two) -> str:
    """The project's series is series_of_two's, no build tree yet; returns the HEAD to expect."""
    files, head = series_of_two
    for name, data in files.items():
        (project.patches / f"v{V1}" / name).write_bytes(data)
    return head


KILLS = ["SIGKILL-all", "SIGTERM"]


@pytest.mark.parametrize("kill", KILLS)
@pytest.mark.parametrize("sub,how,nth", [
    ("init", "before", 1),      # the sdist unpacked, no repository yet
    ("add", "before", 1),       # a repository, nothing committed
    ("commit", "hook", 1),      # the pristine commit, git holding HEAD.lock and index.lock
    ("tag", "before", 1),       # committed, not tagged
])
def test_interrupted_while_making_the_pristine_tree(project: Project, two_patches: str,
                                                    stopper: Stopper, kill: str, sub: str,
                                                    how: str, nth: int):
    want = two_patches
    stopper.arm(sub, how, nth)
    interrupted_apply(project, stopper, kill)
    # Nothing half-made sits at build/vllm-X: it appears only once tagged.
    assert not project.tree(V1).exists()
    out = expect_finished(project, want)
    assert f".unpack-{V1}: a half-made build tree left by an interrupted" in out


@pytest.mark.parametrize("kill", KILLS)
@pytest.mark.parametrize("how", ["before", "smudge", "hook"])
def test_interrupted_while_checking_out_the_overlay(project: Project, two_patches: str,
                                                    stopper: Stopper, kill: str, how: str):
    want = two_patches
    stopper.arm("reset", how, path="vllm/newpkg/__init__.py")
    interrupted_apply(project, stopper, kill)
    out = expect_finished(project, want)
    assert "undid the step an interrupted `make apply` was in (it checked out the overlay" in out
    if how == "smudge" and kill == "SIGKILL-all":
        assert f"removed {project.tree(V1)}/.git/index.lock" in out


@pytest.mark.parametrize("how,nth,kill", [
    # pre-applypatch: files and index patched, no commit (no lock held)
    ("hook", 1, "SIGKILL-all"), ("hook", 1, "SIGTERM"),
    # git writing vllm/core.py, holding index.lock (the case first reported)
    ("smudge", 1, "SIGKILL-all"), ("smudge", 1, "SIGTERM"),
    # the first patch applied, the second not begun: SIGTERM stops apply.py between them
    ("before", 2, "SIGTERM"),
])
def test_interrupted_in_git_am(project: Project, two_patches: str, stopper: Stopper, kill: str,
                               how: str, nth: int):
    want = two_patches
    stopper.arm("am", how, nth, path="vllm/core.py")
    interrupted_apply(project, stopper, kill)
    tree = project.tree(V1)
    if how != "before":
        assert (tree / ".git" / "rebase-apply").is_dir()
    if how == "smudge" and kill == "SIGKILL-all":
        assert (tree / ".git" / "index.lock").exists()
    out = expect_finished(project, want)
    if how != "before":
        assert "undid the step an interrupted `make apply` was in (`git am` applied Core-A" in out


def test_interrupted_while_git_am_moves_head(project: Project, two_patches: str, stopper: Stopper):
    """Killed with HEAD.lock and the branch's lock held, the commit made but not recorded."""
    want = two_patches
    stopper.arm("am", "hook", 2)  # the second patch's HEAD update
    (stopper.dir / "hooks" / "pre-applypatch").unlink()
    interrupted_apply(project, stopper, "SIGKILL-all")
    tree = project.tree(V1)
    assert (tree / ".git" / "HEAD.lock").exists()
    assert (tree / ".git" / "refs" / "heads" / "series.lock").exists()
    out = expect_finished(project, want)
    assert f"removed {tree}/.git/HEAD.lock" in out


def test_interrupted_while_resetting_to_apply_a_changed_patch(project: Project, two_patches: str,
                                                              stopper: Stopper):
    project.run("apply.py", "--version", V1)
    # Patch A changes; apply must go back to the overlay commit and apply both again.
    patch = project.patches / f"v{V1}" / "Core-A.patch"
    patch.write_text(patch.read_text().replace("return x + 30", "return x + 31"))
    want = reference_head_after(project)
    stopper.arm("reset", "smudge", path="vllm/core.py")
    interrupted_apply(project, stopper, "SIGKILL-all")
    out = expect_finished(project, want)
    assert "it reset the tree to" in out


def reference_head_after(project: Project) -> str:
    """HEAD an uninterrupted apply gives from here, in a copy of the build tree."""
    build = project.root / "build"
    saved = project.root / "build.saved"
    shutil.copytree(build, saved, symlinks=True)
    project.run("apply.py", "--version", V1)
    head = project.git(V1, "rev-parse", "HEAD")
    shutil.rmtree(build)
    saved.rename(build)
    return head


def _sha(project: Project, version: str) -> str:
    return hashlib.sha256((project.root / "cache" / f"vllm-{version}.tar.gz").read_bytes()
                          ).hexdigest()


def refusal_commands(err: str) -> list[str]:
    return re.findall(r"`([^`]+)`", err)


def test_a_git_still_running_is_named_and_ending_it_lets_apply_finish(project: Project,
                                                                      two_patches: str,
                                                                      stopper: Stopper):
    """apply.py alone is killed: its git goes on (stopped here) in the tree."""
    want = two_patches
    stopper.arm("am", "hook", 1)
    interrupted_apply(project, stopper, "SIGKILL-apply")
    proc = project.run("apply.py", "--version", V1, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "git is running in" in proc.stderr and "git -c core.hooksPath" in proc.stderr
    kill = [c for c in refusal_commands(proc.stderr) if c.startswith("kill ")]
    assert kill, proc.stderr
    pids = [int(p) for p in kill[0].split()[1:]]
    subprocess.run(kill[0].split(), check=True)
    end = time.monotonic() + WAIT_S
    while any(Path(f"/proc/{pid}").exists() and "Z" not in
              Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] for pid in pids):
        assert time.monotonic() < end
        time.sleep(0.02)
    expect_finished(project, want)


def test_edits_made_after_the_interruption_are_kept_and_named(project: Project, two_patches: str,
                                                              stopper: Stopper):
    want = two_patches
    stopper.arm("am", "hook", 1)
    interrupted_apply(project, stopper, "SIGKILL-all")
    tree = project.tree(V1)
    core = tree / "vllm" / "core.py"
    core.write_text(core.read_text() + "# my edit after the crash\n")
    (tree / "notes.txt").write_text("mine\n")
    proc = project.run("apply.py", "--version", V1, check=False)
    assert proc.returncode == 1
    assert "interrupted" in proc.stderr and "vllm/core.py" in proc.stderr
    assert "notes.txt" in proc.stderr
    assert core.read_text().endswith("# my edit after the crash\n")
    stash = [c for c in refusal_commands(proc.stderr) if " stash push" in c]
    assert stash, proc.stderr
    subprocess.run(stash[0].split(), check=True, env=project.env, capture_output=True)
    expect_finished(project, want)
    shown = project.git(V1, "stash", "show", "-p", "--include-untracked", "stash@{0}")
    assert "# my edit after the crash" in shown and "notes.txt" in shown


def test_a_git_am_apply_did_not_start_is_not_called_a_failed_patch(project: Project,
                                                                   two_patches: str):
    project.run("apply.py", "--version", V1)
    tree = project.tree(V1)
    mail = project.root / "mine.patch"
    core = tree / "vllm" / "core.py"
    core.write_text(core.read_text().replace("return x + 90\n", "return x + 99\n"))
    subprocess.run(["git", "-C", str(tree), "commit", "-qam", "[Core] Mine"], check=True,
                   env=project.env)
    mail.write_text(project.git(V1, "format-patch", "-1", "--stdout") + "\n")
    subprocess.run(["git", "-C", str(tree), "reset", "-q", "--hard", "HEAD~2"], check=True)
    am = subprocess.run(["git", "-C", str(tree), "am", "-q", str(mail)], env=project.env,
                        capture_output=True)
    assert am.returncode != 0  # it stops: the line it changes is not there before patch B
    proc = project.run("apply.py", "--version", V1, check=False)
    assert proc.returncode == 1
    assert "no record of" in proc.stderr and "failed to apply earlier" not in proc.stderr
    assert f"git -C {tree} am --abort" in proc.stderr


def test_an_interrupted_tree_needs_make_apply_before_refresh(project: Project, two_patches: str,
                                                             stopper: Stopper):
    want = two_patches
    stopper.arm("am", "before", 2)
    interrupted_apply(project, stopper, "SIGKILL-all")
    series = (project.patches / f"v{V1}" / "series").read_text()
    proc = project.run("refresh.py", "--version", V1, check=False)
    assert proc.returncode == 1 and "was interrupted" in proc.stderr
    assert "make apply VLLM_VERSION=1.0.0" in proc.stderr
    assert (project.patches / f"v{V1}" / "series").read_text() == series  # B is not dropped
    expect_finished(project, want)


def test_a_tree_left_by_an_interrupted_apply_is_not_work_to_clean(project: Project,
                                                                  two_patches: str,
                                                                  stopper: Stopper):
    stopper.arm("am", "hook", 1)
    interrupted_apply(project, stopper, "SIGKILL-all")
    proc = project.run("clean.py", "--version", V1, check=False)
    assert proc.returncode == 0, proc.stderr
    assert not project.tree(V1).exists()


def test_interrupted_before_a_patch_that_does_not_apply_ends_in_the_usual_stop(
        project: Project, two_patches: str, stopper: Stopper):
    """A real conflict keeps `make apply`'s message: the patch, the file, the commands."""
    core = "".join(f"def f{i}(x):\n    return x {'*' if i == 3 else '+'} {i}\n\n\n"
                   for i in range(40))
    sha = make_sdist(project.root / "cache" / f"vllm-{V2}.tar.gz", V2, {"vllm/core.py": core})
    write_matrix(project.root, {V1: _sha(project, V1), V2: sha})
    for p in (project.patches / f"v{V1}").iterdir():
        shutil.copy(p, project.patches / f"v{V2}" / p.name)
    stopper.arm("am", "before")
    interrupted_apply(project, stopper, "SIGKILL-all", V2)
    proc = project.run("apply.py", "--version", V2, check=False)
    assert proc.returncode == 1
    assert "undid the step an interrupted `make apply` was in" in proc.stdout
    assert "patch Core-A.patch of patches/v2.0.0/series no longer applies" in proc.stderr
    assert "vllm/core.py" in proc.stderr and f"git -C {project.tree(V2)} am --abort" in proc.stderr
    again = project.run("apply.py", "--version", V2, check=False)
    assert "`make apply` stopped in" in again.stderr and "at patch Core-A.patch" in again.stderr


def test_a_second_apply_of_the_same_tree_refuses_at_once_naming_the_first(
        project: Project, two_patches: str, stopper: Stopper):
    stopper.arm("am", "before")
    env = {**project.env, "PATH": f"{stopper.bin}:{os.environ['PATH']}"}
    first = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "apply.py"), "--version",
                              V1], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    stopper.groups = [first.pid]
    stopper.wait_reached(first)
    second = project.run("apply.py", "--version", V1, check=False)
    assert second.returncode == 1
    assert f"another harness command (pid {first.pid}) is working on" in second.stderr
    assert project.run("clean.py", "--version", V1, check=False).returncode == 1
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate(timeout=WAIT_S)
    expect_finished(project, two_patches)


def test_the_harness_git_starts_no_automatic_gc(tmp_path: Path):
    """A `git gc --auto` that a harness commit detaches would still run when the next step
    starts, which then refuses (a git works in the tree). The harness's git runs none."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from seriestool import git

    tree = tmp_path / "tree"
    tree.mkdir()
    git(tree, "init", "-q")
    # As eager as gc can be, and in the foreground, so that a gc shows at once as a pack.
    git(tree, "config", "gc.auto", "1")
    git(tree, "config", "gc.autoDetach", "false")
    # gc --auto estimates the loose objects from objects/17/: put three there.
    found, n = [], 0
    while len(found) < 3:
        data = f"{n}\n".encode()
        if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest().startswith("17"):
            found.append(data)
        n += 1
    for i, data in enumerate(found):
        (tree / f"f{i}").write_bytes(data)
        git(tree, "add", f"f{i}")
        git(tree, "commit", "-q", "--no-verify", "-m", f"c{i}")
    assert not list((tree / ".git" / "objects" / "pack").glob("*.pack"))
