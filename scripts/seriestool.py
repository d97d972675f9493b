"""Shared pieces of the series tooling: configuration, errors, git, the release matrix.

Every script in scripts/ is a thin command over this module. Paths can be redirected with
environment variables so the harness tests can drive the same code on small fixture releases:

  KVSERIES_MATRIX    release matrix (default: ci/matrix.toml)
  KVSERIES_PATCHES   per-release series directories (default: patches/)
  KVSERIES_OVERLAY   whole new files laid over the tree (default: vllm_overlay/)
  KVSERIES_BUILD     build trees and virtualenvs (default: build/)
  KVSERIES_CACHE     downloaded sdists and wheels (default: ~/.cache/vllm-kv-series)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Every commit the harness makes carries this identity and fixed dates, so a build tree made
# from the same sdist, overlay and series has the same commit ids on every machine.
HARNESS_IDENT = {
    "GIT_AUTHOR_NAME": "vLLM KV series harness",
    "GIT_AUTHOR_EMAIL": "kv-series@localhost",
    "GIT_COMMITTER_NAME": "vLLM KV series harness",
    "GIT_COMMITTER_EMAIL": "kv-series@localhost",
}
FIXED_DATE = "2000-01-01T00:00:00+0000"
OVERLAY_MESSAGE = "overlay.msg"
STATE_FILE = "kv-series-state.json"


class SeriesError(Exception):
    """An error for the operator: what went wrong, then what to do about it."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def render(self) -> str:
        # Not wrapped: paths and commands in these messages must stay copy-pasteable.
        text = "error: " + self.problem.strip()
        if self.fix:
            text += "\n\n" + self.fix.strip()
        return text


class Terminated(BaseException):
    """SIGTERM arrived (see stop_on_sigterm). A BaseException, like KeyboardInterrupt, so no
    `except Exception` swallows it on the way out."""


def stop_on_sigterm() -> None:
    """Turn SIGTERM into Terminated: the script then stops its running child (run() sends it
    SIGTERM, so git removes its lock files) and exits, instead of dying with the child left
    working in a build tree."""

    def handler(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def main_guard(fn) -> None:
    """Run a script's main(); print SeriesErrors as operator messages and exit 1."""
    try:
        sys.exit(fn() or 0)
    except SeriesError as e:
        print(e.render(), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Terminated:
        print("error: stopped by SIGTERM before finishing. Run the command again: `make apply` "
              "finishes what an interrupted one left.", file=sys.stderr)
        sys.exit(143)


def _env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).resolve() if value else default


def matrix_path() -> Path:
    return _env_path("KVSERIES_MATRIX", ROOT / "ci" / "matrix.toml")


def patches_dir() -> Path:
    return _env_path("KVSERIES_PATCHES", ROOT / "patches")


def overlay_dir() -> Path:
    return _env_path("KVSERIES_OVERLAY", ROOT / "vllm_overlay")


def build_dir() -> Path:
    return _env_path("KVSERIES_BUILD", ROOT / "build")


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-kv-series"
    return _env_path("KVSERIES_CACHE", default)


# ---------------------------------------------------------------------------------------------
# The release matrix


@dataclass
class Release:
    version: str
    sdist_sha256: str
    torch: str
    cuda_wheel: str
    cpu_wheel: str
    cpu_kernels: bool
    ci_tiers: list[str] = field(default_factory=list)
    gpu_tiers: list[str] = field(default_factory=list)
    python_only_torch: str = ""
    # Requirements whose version floor the python-only install drops (e.g. a floor newer than
    # any release on the package index; see ci/matrix.toml).
    python_only_unpin: list[str] = field(default_factory=list)
    sdist_url: str = ""
    notes: str = ""

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    @property
    def series_dir(self) -> Path:
        return patches_dir() / self.tag

    @property
    def tree(self) -> Path:
        return build_dir() / f"vllm-{self.version}"


def load_matrix() -> tuple[str, dict[str, Release]]:
    path = matrix_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SeriesError(f"the release matrix {path} does not exist.")
    except tomllib.TOMLDecodeError as e:
        raise SeriesError(f"the release matrix {path} is not valid TOML: {e}.")
    releases = {}
    for version, entry in data.get("release", {}).items():
        releases[version] = Release(version=version, **entry)
    return data.get("default", ""), releases


def get_release(version: str | None) -> Release:
    default, releases = load_matrix()
    version = version or default
    if version not in releases:
        supported = ", ".join(sorted(releases)) or "none"
        raise SeriesError(
            f"vLLM release {version!r} is not supported by this series "
            f"(supported: {supported}).",
            f"Pick one of the supported releases, e.g. `make apply VLLM_VERSION={default}`. "
            "To add a release, add it to ci/matrix.toml and create its series with "
            "`make rebase FROM=<supported> TO=<new>` (see docs/CONTRIBUTING.md).",
        )
    return releases[version]


def version_from_args(argv: list[str] | None = None) -> str | None:
    """The release from --version X, or VLLM_VERSION, or None for the matrix default."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    args, _ = p.parse_known_args(argv)
    return args.version


# ---------------------------------------------------------------------------------------------
# Processes and git


def run(cmd: list[str], cwd: Path | None = None, env: dict | None = None, check: bool = True,
        capture: bool = True, stdin_text: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    with subprocess.Popen(cmd, cwd=cwd, env=full_env, text=True,
                          stdin=subprocess.PIPE if stdin_text is not None else None,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None) as child:
        try:
            out, _ = child.communicate(stdin_text)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the child must not outlive us
            _stop(child)
            raise
    proc = subprocess.CompletedProcess(cmd, child.returncode, out, None)
    if check and proc.returncode != 0:
        out = (proc.stdout or "").strip()
        raise SeriesError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out}")
    return proc


def _stop(child: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM first (git removes its lock files on SIGTERM, not on SIGKILL), then SIGKILL."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def git_env(dated: bool = True) -> dict[str, str]:
    """Environment for harness-made commits: fixed identity and date, no user config."""
    env = dict(HARNESS_IDENT)
    # User/system config (format.*, diff.*, am.*) must not change what the harness produces.
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    # No automatic gc or maintenance: a `git gc --auto` that a commit or `git am` detaches would
    # still run in the tree when the next harness step starts, which then (rightly) waits for it.
    env.update({"GIT_CONFIG_COUNT": "2",
                "GIT_CONFIG_KEY_0": "gc.auto", "GIT_CONFIG_VALUE_0": "0",
                "GIT_CONFIG_KEY_1": "maintenance.auto", "GIT_CONFIG_VALUE_1": "false"})
    if dated:
        env["GIT_AUTHOR_DATE"] = FIXED_DATE
        env["GIT_COMMITTER_DATE"] = FIXED_DATE
    return env


def git(tree: Path, *args: str, check: bool = True, env: dict | None = None,
        dated: bool = True) -> subprocess.CompletedProcess:
    full = git_env(dated)
    if env:
        full.update(env)
    return run(["git", *args], cwd=tree, env=full, check=check)


def git_out(tree: Path, *args: str) -> str:
    return git(tree, *args).stdout.strip()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The series of a release


def read_series(release: Release) -> tuple[list[str], list[str]]:
    """(comment/header lines, patch file names) of patches/vX/series."""
    path = release.series_dir / "series"
    if not path.exists():
        return [], []
    header, names = [], []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            if not names:
                header.append(line)
            continue
        names.append(stripped)
    missing = [n for n in names if not (release.series_dir / n).exists()]
    if missing:
        raise SeriesError(
            f"{path} lists patch files that do not exist: {', '.join(missing)}.",
            "Restore them from git (`git checkout -- patches/`) or regenerate the series from "
            f"the build tree with `make refresh VLLM_VERSION={release.version}`.",
        )
    return header, names


def overlay_files() -> list[Path]:
    """Files of the overlay, relative to its root (sorted; caches excluded)."""
    root = overlay_dir()
    if not root.exists():
        return []
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            out.append(p.relative_to(root))
    return out


def overlay_digest() -> str:
    h = hashlib.sha256()
    for rel in overlay_files():
        h.update(str(rel).encode() + b"\0")
        h.update((overlay_dir() / rel).read_bytes() + b"\0")
    msg = patches_dir() / OVERLAY_MESSAGE
    if msg.exists():
        h.update(msg.read_bytes())
    return h.hexdigest()


def overlay_message() -> str:
    msg = patches_dir() / OVERLAY_MESSAGE
    if msg.exists():
        return msg.read_text()
    return "Add the series' new files (overlay)\n"


# ---------------------------------------------------------------------------------------------
# State of a build tree: which commits the harness made from which inputs.


def state_path(tree: Path) -> Path:
    return tree / ".git" / STATE_FILE


def read_state(tree: Path) -> dict:
    path = state_path(tree)
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, OSError) as e:
        state = e
    if not isinstance(state, dict):
        raise SeriesError(
            f"{path}, where the harness records which commits of the build tree it made, "
            f"cannot be read: {state}.",
            f"Recreate the tree: `make clean-tree apply` (clean-tree refuses if the tree holds "
            f"work of yours; it names it), or delete {path} and run `make apply` again, which "
            "then counts every commit after the pristine one as yours.",
        )
    return state


def write_state(tree: Path, state: dict) -> None:
    """Write the state atomically: an interrupted write leaves the old state, never half."""
    path = state_path(tree)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def format_patch_args() -> list[str]:
    """The one set of format-patch options used by refresh and by apply's idempotence check.

    Stable bytes whatever the git version or user config: no commit ids, no version signature,
    no [PATCH n/m] numbering (it changes when the series grows), full blob ids for --3way.
    """
    return ["format-patch", "--no-numbered", "--zero-commit", "--no-signature", "--full-index",
            "--diff-algorithm=myers", "--find-renames"]
