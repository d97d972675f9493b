#!/usr/bin/env python3
"""vLLM's own pre-commit checks on what the series changes, patched vs pristine.

  python3 scripts/lint.py --version 0.32.0     # make lint VLLM_VERSION=0.32.0
  python3 scripts/lint.py --all                # every release of ci/matrix.toml

What an upstream reviewer's CI runs (`pre-commit run --hook-stage manual`), read from the
release's own .pre-commit-config.yaml in build/vllm-X:

  ruff-check, ruff-format  ruff at the pinned `rev`, the tree's pyproject config
  typos                    typos at the pinned `rev` (the `typos` PyPI package), tree config
  hook:<id>                every `repo: local` hook of the manual stage that runs offline
                           (entry + args, files/exclude/types, pass_filenames), in a virtualenv
                           with its additional_dependencies
  mypy                     the release's tools/pre_commit/mypy.py hook (oldest Python it names)
                           with its pinned mypy and additional_dependencies, as pre-commit runs
                           it: the hook's own virtualenv, not vLLM's dependencies
  signoff                  every patch of patches/vX/ (and overlay.msg) has Signed-off-by

Each check runs on the files the series changes (`git diff --name-only vX..HEAD`), once in the
patched tree and once in a throwaway worktree at tag vX. A finding counts only when the series
adds it: findings are matched by file + code/message (never line numbers, which patches
shift), as multisets, so a second copy of a pristine finding in the same file counts. Files the
series adds exist only on the patched side: all their findings count.

Tools are pip-installed once into build/lint-venv/<tool>-<version>/ (KVSERIES_BUILD moves
build/, KVSERIES_LINT_VENV the tool virtualenvs alone). Exit status 1 when the series adds any
finding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import require_applied_tree  # noqa: E402
from seriestool import (  # noqa: E402
    OVERLAY_MESSAGE, Release, SeriesError, build_dir, get_release, git, git_out, load_matrix,
    main_guard, patches_dir, read_series, run,
)

# Local hooks left out, and why. Hooks of other stages (commit-msg, pre-commit only) are left
# out by the stage rule; the mypy hooks are the `mypy` check.
SKIP_HOOKS = {
    "suggestion": "prints a hint, checks nothing",
    "update-dockerfile-graph": "needs a Docker daemon; acts only on docker/Dockerfile",
    "shellcheck": "downloads shellcheck; acts only on shell scripts",
    "format-torch-nightly-test": "rewrites requirements files, acts only on those",
}
# Where the tool virtualenvs live (default build/lint-venv): one cache for every build tree.
LINT_VENV_ENV = "KVSERIES_LINT_VENV"
# Tools must not write caches into the trees (an untracked file makes `make apply` refuse).
QUIET_ENV = {"RUFF_NO_CACHE": "true", "PYTHONDONTWRITEBYTECODE": "1", "NO_COLOR": "1"}


@dataclass
class Check:
    name: str
    tool: str = ""
    patched: Counter = field(default_factory=Counter)
    pristine: Counter = field(default_factory=Counter)
    skipped: str = ""

    @property
    def added(self) -> Counter:
        return self.patched - self.pristine


# ---------------------------------------------------------------------------------------------
# Tool virtualenvs


def lint_venv_root() -> Path:
    value = os.environ.get(LINT_VENV_ENV)
    return Path(value).resolve() if value else build_dir() / "lint-venv"


def tool_venv(name: str, requirements: list[str]) -> Path:
    """build/lint-venv/<name> with exactly these requirements pip-installed (cached)."""
    venv = lint_venv_root() / name
    marker = venv / "kv-series-lint.json"
    want = sorted(requirements)
    if marker.exists() and json.loads(marker.read_text()) == want:
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    pip_cmd = f"{venv}/bin/pip install " + " ".join(shlex.quote(r) for r in want)
    fix = (f"Install it by hand (needs the package index, PyPI):\n"
           f"  python3 -m venv {venv} && {pip_cmd}\n"
           f"then run the lint again (delete {venv} to let the lint reinstall it).")
    print(f"installing {', '.join(want) or 'a bare virtualenv'} into {venv}", flush=True)
    made = run([sys.executable, "-m", "venv", str(venv)], check=False)
    if made.returncode != 0:
        raise SeriesError(f"cannot create the virtualenv {venv} for {name}:\n{made.stdout}", fix)
    proc = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                "--disable-pip-version-check", *want], check=False) if want else None
    if proc and proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-5:])
        raise SeriesError(f"cannot install the lint tool {name} ({', '.join(want)}) with "
                          f"pip:\n{tail}", fix)
    marker.write_text(json.dumps(want) + "\n")
    return venv


def venv_env(venv: Path) -> dict:
    return {**QUIET_ENV, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv)}


# ---------------------------------------------------------------------------------------------
# The release's .pre-commit-config.yaml


def load_precommit(tree: Path) -> dict:
    """The tree's .pre-commit-config.yaml as data (PyYAML in its own small lint venv)."""
    path = tree / ".pre-commit-config.yaml"
    if not path.exists():
        raise SeriesError(f"{path} does not exist: the release ships no pre-commit config.",
                          "Lint needs the release's own configuration; check the build tree.")
    try:
        return json.loads(path.read_text())  # JSON is YAML: such a config needs no parser
    except ValueError:
        pass
    venv = tool_venv("pyyaml", ["PyYAML"])
    code = ("import json, sys, yaml; "
            "print(json.dumps(yaml.safe_load(open(sys.argv[1], encoding='utf-8'))))")
    return json.loads(run([str(venv / "bin" / "python"), "-c", code, str(path)]).stdout)


def remote_hook(config: dict, repo_part: str, hook_id: str) -> tuple[str, dict] | None:
    """(version without the leading v, hook) of a hook from a remote repo, or None."""
    for repo in config.get("repos", []):
        if repo_part in str(repo.get("repo", "")):
            for hook in repo.get("hooks", []):
                if hook.get("id") == hook_id:
                    return str(repo.get("rev", "")).lstrip("v"), hook
    return None


def local_hooks(config: dict) -> list[dict]:
    """The `repo: local` hooks that upstream CI runs (the manual stage)."""
    default_stages = config.get("default_stages") or ["pre-commit", "manual"]
    out = []
    for repo in config.get("repos", []):
        if repo.get("repo") != "local":
            continue
        for hook in repo.get("hooks", []):
            if "manual" in (hook.get("stages") or default_stages):
                out.append(hook)
    return out


# What pre-commit's `identify` tags a file with, for the extensions a series touches.
TAGS_BY_SUFFIX = {
    ".py": {"python"}, ".pyi": {"pyi"}, ".rs": {"rust"}, ".proto": {"proto"},
    ".sh": {"shell"}, ".png": {"png", "image", "binary"}, ".md": {"markdown"},
    ".yaml": {"yaml"}, ".yml": {"yaml"}, ".json": {"json"}, ".toml": {"toml"},
    ".txt": {"plain-text"}, ".cu": {"cuda"}, ".cpp": {"c++"}, ".h": {"header", "c"},
}


def file_tags(path: str) -> set[str]:
    tags = set(TAGS_BY_SUFFIX.get(Path(path).suffix, set()))
    if "binary" not in tags:
        tags.add("text")
    return tags | {"file"}


def select_files(files: list[str], hook: dict, global_exclude: str) -> list[str]:
    """pre-commit's file filter: top-level exclude, files/exclude regexes (re.search),
    types (all of), types_or (any of), exclude_types."""
    keep = []
    for f in files:
        if global_exclude and re.search(global_exclude, f):
            continue
        if not re.search(hook.get("files", ""), f):
            continue
        if hook.get("exclude") and re.search(hook["exclude"], f):
            continue
        tags = file_tags(f)
        if not set(hook.get("types", ["file"])) <= tags:
            continue
        if hook.get("types_or") and not set(hook["types_or"]) & tags:
            continue
        if set(hook.get("exclude_types", [])) & tags:
            continue
        keep.append(f)
    return keep


# ---------------------------------------------------------------------------------------------
# The checks. Each returns the findings of one tree as a Counter of (file, message).

_LINE_NO = re.compile(r"(?<=\S):\d+(?::\d+)?(?=[:\s]|$)|\bline \d+\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def normalize(line: str) -> str:
    """An output line without colours and line/column numbers (patches shift them)."""
    return _LINE_NO.sub("", _ANSI.sub("", line)).strip()


def ruff_check(venv: Path, tree: Path, files: list[str]) -> Counter:
    proc = run([str(venv / "bin" / "ruff"), "check", "--force-exclude", "--no-fix",
                "--output-format", "json", *files], cwd=tree, env=QUIET_ENV, check=False)
    try:
        items = json.loads(proc.stdout[proc.stdout.index("["):])
    except ValueError:
        raise SeriesError(f"ruff check gave no JSON in {tree}:\n{proc.stdout[-2000:]}")
    return Counter((os.path.relpath(i["filename"], tree), f"{i['code']} {i['message']}")
                   for i in items)


def ruff_format(venv: Path, tree: Path, files: list[str]) -> Counter:
    """One finding per hunk that `ruff format` would change (its text, not its position)."""
    proc = run([str(venv / "bin" / "ruff"), "format", "--force-exclude", "--diff", *files],
               cwd=tree, env=QUIET_ENV, check=False)
    if proc.returncode not in (0, 1):
        raise SeriesError(f"ruff format failed in {tree}:\n{proc.stdout[-2000:]}")
    return diff_hunks(proc.stdout)


def diff_hunks(text: str) -> Counter:
    found: Counter = Counter()
    path, hunk = None, []

    def flush():
        if path and hunk:
            changed = [h for h in hunk if h[:1] in "+-"]
            found[(path, "would reformat: " + " | ".join(c.strip() for c in changed)[:300])] += 1

    for line in text.splitlines():
        if line.startswith("--- "):
            flush()
            path, hunk = None, []
        elif line.startswith("+++ "):
            path = line[4:].strip().split("\t")[0]
        elif line.startswith("@@"):
            flush()
            hunk = []
        elif path and line[:1] in "+- ":
            hunk.append(line)
    flush()
    return found


def typos_check(venv: Path, tree: Path, files: list[str]) -> Counter:
    proc = run([str(venv / "bin" / "typos"), "--force-exclude", "--format", "json", *files],
               cwd=tree, env=QUIET_ENV, check=False)
    found: Counter = Counter()
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        item = json.loads(line)
        if item.get("type") == "typo":
            fixes = ", ".join(item.get("corrections", []))
            found[(item["path"], f"`{item['typo']}` -> {fixes}")] += 1
        elif item.get("type") == "error":
            found[(item.get("path", "?"), item.get("msg", "typos error"))] += 1
    return found


def run_hook(hook: dict, venv: Path | None, tree: Path, files: list[str]) -> Counter:
    """A local hook as pre-commit runs it; its output lines are the findings when it fails."""
    cmd = shlex.split(hook["entry"]) + [str(a) for a in hook.get("args", [])]
    if hook.get("pass_filenames", True):
        cmd += files
    if hook.get("language") == "script":
        cmd[0] = str(tree / cmd[0])
    env = venv_env(venv) if venv else dict(QUIET_ENV)
    proc = run(cmd, cwd=tree, env=env, check=False)
    if proc.returncode == 0:
        return Counter()
    lines = [normalize(ln) for ln in proc.stdout.splitlines() if ln.strip()]
    found = Counter(hook_finding(ln, files) for ln in lines)
    # Lines that name a file are the findings; the rest is advice around them (unless that is
    # all the hook says).
    if any(path for path, _ in found):
        found = Counter({k: n for k, n in found.items() if k[0]})
    return found or Counter({("", f"{hook['id']} failed with exit status {proc.returncode}"): 1})


def hook_finding(line: str, files: list[str]) -> tuple[str, str]:
    """(file, message) of a hook's output line; file is "" when the line names none."""
    for f in sorted(files, key=len, reverse=True):
        if f in line:
            if line.startswith(f):
                line = line[len(f):].lstrip(": ")
            return f, line
    return "", line


_MYPY_LINE = re.compile(r"^(?P<file>[^:\s]+\.pyi?):\d+(?::\d+)?: error: (?P<msg>.*)$")


def run_mypy(hook: dict, venv: Path, tree: Path, files: list[str], cache: Path) -> Counter:
    cmd = shlex.split(hook["entry"]) + [str(a) for a in hook.get("args", [])] + files
    env = {**venv_env(venv), "MYPY_CACHE_DIR": str(cache)}
    proc = run(cmd, cwd=tree, env=env, check=False)
    found: Counter = Counter()
    for line in proc.stdout.splitlines():
        m = _MYPY_LINE.match(line.strip())
        if m:
            found[(m["file"], m["msg"].strip())] += 1
    if proc.returncode != 0 and not found:
        raise SeriesError(f"mypy failed in {tree} without reporting errors:\n"
                          f"{proc.stdout[-2000:]}")
    return found


def signoff_findings(release: Release) -> Counter:
    """Patch files (and the overlay commit's message) without a Signed-off-by line."""
    _, names = read_series(release)
    found: Counter = Counter()
    messages = [(release.series_dir / n, True) for n in names]
    overlay_msg = patches_dir() / OVERLAY_MESSAGE
    if overlay_msg.exists():
        messages.append((overlay_msg, False))
    for path, is_patch in messages:
        text = path.read_text(errors="replace")
        if is_patch:
            text = text.split("\n---\n", 1)[0]
        if not re.search(r"^Signed-off-by: \S.*<[^>]+>\s*$", text, re.M):
            found[(str(path.relative_to(patches_dir().parent)), "no Signed-off-by: line")] += 1
    return found


# ---------------------------------------------------------------------------------------------
# One release


def changed_files(tree: Path, tag: str) -> list[str]:
    out = git_out(tree, "diff", "--name-only", "--no-renames", f"{tag}..HEAD")
    return [f for f in out.splitlines() if f]


def pristine_worktree(release: Release) -> Path:
    tree = release.tree
    wt = build_dir() / ".lint" / f"vllm-{release.version}"
    git(tree, "worktree", "remove", "--force", str(wt), check=False)
    shutil.rmtree(wt, ignore_errors=True)
    git(tree, "worktree", "prune")
    wt.parent.mkdir(parents=True, exist_ok=True)
    git(tree, "worktree", "add", "-q", "--detach", str(wt), release.tag)
    return wt


def drop_worktree(release: Release, wt: Path) -> None:
    git(release.tree, "worktree", "remove", "--force", str(wt), check=False)
    shutil.rmtree(wt, ignore_errors=True)
    git(release.tree, "worktree", "prune", check=False)


def mypy_hook(config: dict) -> dict | None:
    """The CI mypy hook: the manual-stage one for the oldest Python version it names."""
    hooks = [h for h in local_hooks(config) if h["id"].startswith("mypy")]

    def py_version(h):
        m = re.search(r"3\.(\d+)", h["entry"])
        return int(m.group(1)) if m else 99

    return min(hooks, key=py_version) if hooks else None


def pinned(deps: list[str], name: str) -> str:
    for d in deps:
        m = re.match(rf"^{name}(\[[^\]]*\])?==(\S+)$", d)
        if m:
            return m.group(2)
    return ""


def lint_release(release: Release) -> list[Check]:
    tree = require_applied_tree(release, "lint")
    config = load_precommit(tree)
    files = changed_files(tree, release.tag)
    global_exclude = config.get("exclude", "")
    print(f"\n=== vLLM {release.version}: {len(files)} files changed by the series "
          f"(patched {tree} vs pristine {release.tag})", flush=True)
    wt = pristine_worktree(release)
    try:
        sides = [(tree, "patched"), (wt, "pristine")]
        on = {side: [f for f in files if (t / f).is_file()] for t, side in sides}
        checks: list[Check] = []

        ruff = remote_hook(config, "ruff-pre-commit", "ruff-check")
        if ruff:
            version = ruff[0]
            venv = tool_venv(f"ruff-{version}", [f"ruff=={version}"])
            py = {side: select_files(fs, {"types_or": ["python", "pyi"]}, global_exclude)
                  for side, fs in on.items()}
            for name, fn in (("ruff-check", ruff_check), ("ruff-format", ruff_format)):
                c = Check(name, f"ruff {version}")
                for t, side in sides:
                    if py[side]:
                        getattr(c, side).update(fn(venv, t, py[side]))
                checks.append(c)
        typos = remote_hook(config, "crate-ci/typos", "typos")
        if typos:
            version = typos[0]
            venv = tool_venv(f"typos-{version}", [f"typos=={version}"])
            sel = {side: select_files(fs, typos[1], global_exclude) for side, fs in on.items()}
            c = Check("typos", f"typos {version}")
            for t, side in sides:
                if sel[side]:
                    getattr(c, side).update(typos_check(venv, t, sel[side]))
            checks.append(c)

        for hook in local_hooks(config):
            hid = hook["id"]
            if hid.startswith("mypy"):
                continue
            c = Check(f"hook:{hid}", hook.get("language", ""))
            if hid in SKIP_HOOKS:
                c.skipped = SKIP_HOOKS[hid]
                checks.append(c)
                continue
            sel = {side: select_files(fs, hook, global_exclude) for side, fs in on.items()}
            if not sel["patched"] and not hook.get("always_run"):
                c.skipped = "no changed file matches it"
                checks.append(c)
                continue
            venv = None
            if hook.get("language") == "python":
                deps = sorted(set(hook.get("additional_dependencies", [])))
                key = hashlib.sha256(json.dumps(deps).encode()).hexdigest()[:10]
                venv = tool_venv(f"hooks-{key}", deps)
            for t, side in sides:
                # pre-commit does not run a hook that no file of this side selects.
                if sel[side] or hook.get("always_run"):
                    getattr(c, side).update(run_hook(hook, venv, t, sel[side]))
            checks.append(c)

        hook = mypy_hook(config)
        if hook:
            deps = hook.get("additional_dependencies", [])
            version = pinned(deps, "mypy")
            key = hashlib.sha256(json.dumps(sorted(deps)).encode()).hexdigest()[:10]
            venv = tool_venv(f"mypy-{version or 'unpinned'}-{key}", deps)
            c = Check("mypy", f"mypy {version}, hook {hook['id']}: {hook['entry']}")
            # The slowest check: both sides at once (separate caches, one core each).
            with ThreadPoolExecutor(max_workers=2) as pool:
                runs = {}
                for t, side in sides:
                    sel = select_files(on[side], hook, global_exclude)
                    if sel:
                        cache = build_dir() / ".lint" / "mypy-cache" / f"{release.version}-{side}"
                        runs[side] = pool.submit(run_mypy, hook, venv, t, sel, cache)
                for side, fut in runs.items():
                    getattr(c, side).update(fut.result())
            checks.append(c)
    finally:
        drop_worktree(release, wt)

    c = Check("signoff", "patches/" + release.tag)
    c.patched = signoff_findings(release)
    checks.append(c)
    return checks


def report(release: Release, checks: list[Check], seconds: float) -> int:
    total = 0
    for c in checks:
        if c.skipped:
            print(f"  {c.name:<38} skipped ({c.skipped})")
            continue
        added = c.added
        n = sum(added.values())
        total += n
        print(f"  {c.name:<38} {n} added  (patched {sum(c.patched.values())}, pristine "
              f"{sum(c.pristine.values())}; {c.tool})")
        for (path, msg), count in sorted(added.items()):
            times = f" (x{count})" if count > 1 else ""
            print(f"      {path or '-'}: {msg}{times}")
    ran = [c for c in checks if not c.skipped]
    failed = [c.name for c in ran if c.added]
    print(f"summary: vLLM {release.version}: {total} findings added by the series in "
          f"{len(failed)} of {len(ran)} checks"
          + (f" ({', '.join(failed)})" if failed else "") + f"; {seconds:.0f} s", flush=True)
    return total


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--all", action="store_true", help="every release of ci/matrix.toml")
    p.add_argument("--summary-json", default=None,
                   help="write per-check results here (for scripts/run_tests.py)")
    args = p.parse_args()
    if args.all:
        _, releases = load_matrix()
        chosen = [releases[v] for v in sorted(
            releases, key=lambda v: tuple(int(x) for x in v.split(".")))]
    else:
        chosen = [get_release(args.version)]
    summary, total = [], 0
    for release in chosen:
        start = time.monotonic()
        checks = lint_release(release)
        total += report(release, checks, time.monotonic() - start)
        for c in checks:
            summary.append({
                "release": release.version, "check": c.name, "skipped": c.skipped,
                "added": [[path, msg] for (path, msg), n in sorted(c.added.items())
                          for _ in range(n)],
            })
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
    if len(chosen) > 1:
        print(f"total: {total} findings added by the series over {len(chosen)} releases")
    return 1 if total else 0


if __name__ == "__main__":
    main_guard(main)
