"""What in a build tree is the user's, what the harness made, and who is working in it.

`make apply` uses it to finish what an interrupted apply left without touching anything of the
user's; `make clean-tree` / `make clean` to delete a tree only when nothing of the user's is in
it. The harness makes, and may delete without asking:

  - the pristine commit (tag vX) and the commits .git/kv-series-state.json records;
  - caches and build outputs (HARNESS_OUTPUTS): __pycache__/, *.pyc, *.pyo, .pytest_cache/,
    .mypy_cache/, .ruff_cache/, *.egg-info/, and the prebuilt kernel files that `make install`
    copies under vllm/ (it lists each in .git/info/exclude as /vllm/...);
  - its own worktrees of the tree, under build/.<name>/ (check-series, export, the stock tree).

Everything else is the user's: commits on any branch or tag that the state does not record,
stash entries, uncommitted and untracked files, ignored files other than the above, a git
operation in progress, and worktrees elsewhere.

A git lock file (.git/index.lock, .git/HEAD.lock, .git/refs/heads/series.lock, ...) is stale
when no git process of this host works in the tree: none has its current directory in the tree
(or one of its worktrees) or names it on its command line. Processes of other users cannot be
seen, which is fine as long as they cannot write to the tree.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from seriestool import HARNESS_IDENT, SeriesError, build_dir, git

# Directory names and file suffixes of caches and build outputs: never the user's work.
CACHE_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
OUTPUT_SUFFIXES = (".pyc", ".pyo")
OUTPUT_DIR_SUFFIXES = (".egg-info",)
HARNESS_OUTPUTS = "__pycache__/, *.pyc, *.pyo, .pytest_cache/, .mypy_cache/, .ruff_cache/, " \
    "*.egg-info/, and the kernels `make install` copied (listed in .git/info/exclude)"

# ---------------------------------------------------------------------------------------------
# One harness command at a time per tree

_held: dict[str, int] = {}


def lock_path(tree: Path) -> Path:
    return tree.parent / f".{tree.name}.lock"


def _lock_holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    pid = os.read(fd, 32).decode(errors="replace").strip()
    return f"pid {pid}" if pid.isdigit() else "another process"


@contextmanager
def tree_lock(tree: Path):
    """Hold build/.vllm-X.lock (flock) while a command changes or deletes the tree.

    The kernel releases it when its holder dies, SIGKILL included, so it never goes stale.
    Re-entrant within one process."""
    key = str(lock_path(tree))
    if _held.get(key):
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    build_dir().mkdir(parents=True, exist_ok=True)
    tree.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise SeriesError(f"{key} belongs to another user.",
                              "Remove it (it is only a lock file) and run the command again.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SeriesError(
                f"another harness command ({_lock_holder(fd)}) is working on {tree}.",
                "Wait for it to finish, then run this command again.",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases the flock


# ---------------------------------------------------------------------------------------------
# Git processes and stale locks


def linked_worktrees(tree: Path) -> list[tuple[Path, Path]]:
    """(admin dir in .git/worktrees/, worktree path) of each linked worktree; no git runs, so
    this works whatever locks are held."""
    found = []
    for gitdir in sorted((tree / ".git" / "worktrees").glob("*/gitdir")):
        try:
            found.append((gitdir.parent, Path(gitdir.read_text().strip()).parent))
        except OSError:
            continue
    return found


def worktree_paths(tree: Path) -> list[Path]:
    """The tree and its linked worktrees."""
    return [tree] + [path for _, path in linked_worktrees(tree)]


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def git_processes_in(paths: list[Path]) -> list[tuple[int, str]]:
    """(pid, command line) of every git process of this host working in one of `paths`."""
    roots = [os.path.realpath(p) for p in paths]
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if not (Path(entry.path) / "comm").read_text().startswith("git"):
                continue
            argv = (Path(entry.path) / "cmdline").read_bytes().decode(errors="replace")
            argv = argv.rstrip("\0").split("\0")
            cwd = os.readlink(Path(entry.path) / "cwd")
        except OSError:  # gone, a zombie, or another user's
            continue
        if _inside(cwd, roots) or any(_inside(os.path.realpath(a), roots) for a in argv[1:]
                                      if a.startswith("/")):
            found.append((int(entry.name), " ".join(argv)))
    return found


def lock_files(tree: Path) -> list[Path]:
    """Git's *.lock files in the tree's .git (objects/ aside)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(tree / ".git"):
        if dirpath == str(tree / ".git") and "objects" in dirnames:
            dirnames.remove("objects")
        found += [Path(dirpath) / f for f in filenames if f.endswith(".lock")]
    return sorted(found)


def busy_error(tree: Path, busy: list[tuple[int, str]], why: str) -> SeriesError:
    listing = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in busy)
    pids = " ".join(str(pid) for pid, _ in busy)
    return SeriesError(
        f"git is running in {tree}:\n{listing}\n{why}",
        f"Wait for it to end, or end it (`kill {pids}`), then run the command again.",
    )


def clear_stale_locks(tree: Path, log) -> None:
    """Remove the lock files a killed git left; refuse while a git process works in the tree.

    A lock made after the process scan began is left alone (a git that just started)."""
    locks = lock_files(tree)
    if not locks:
        return
    began = time.time()
    busy = git_processes_in(worktree_paths(tree))
    if busy:
        raise busy_error(tree, busy, "It holds (or may take) the lock files "
                         f"{', '.join(str(p.relative_to(tree)) for p in locks)}; the harness "
                         "does not touch the tree while it runs.")
    for lock in locks:
        try:
            if lock.stat().st_mtime < began:
                lock.unlink()
                log(f"removed {lock}: left by a git process that was killed (no git process "
                    f"is working in {tree})")
        except FileNotFoundError:
            continue


# ---------------------------------------------------------------------------------------------
# The tree's files


@dataclass
class Entry:
    code: str  # git status' XY: "??" untracked, "!!" ignored, else a change to a tracked file
    path: str  # relative; a directory ends with "/"


def status(tree: Path, ignored: bool = False) -> list[Entry]:
    args = ["status", "--porcelain", "-z", "--untracked-files=all"]
    if ignored:
        args.append("--ignored=matching")
    out = git(tree, *args).stdout
    entries, parts = [], out.split("\0")
    i = 0
    while i < len(parts):
        item = parts[i]
        i += 1
        if not item:
            continue
        entries.append(Entry(item[:2], item[3:]))
        if item[0] in "RC":  # a rename or copy: the next field is its source
            entries.append(Entry(item[:2], parts[i]))
            i += 1
    return entries


def installed_kernels(tree: Path) -> set[str]:
    """Files `make install` copied into the tree (it lists each in .git/info/exclude)."""
    exclude = tree / ".git" / "info" / "exclude"
    try:
        lines = exclude.read_text().splitlines()
    except OSError:
        return set()
    return {ln[1:] for ln in lines if ln.startswith("/vllm/") and not any(c in ln for c in "*?[")}


def copy_build_outputs(tree: Path, dest: Path, replace_older: bool = False) -> int:
    """Copy the build outputs listed in `tree`'s .git/info/exclude (the kernels `make install`
    copied in) into `dest`, a worktree of it: git checks out only tracked files, so a worktree
    has no kernels to run vLLM with. A file `dest` has already is kept, unless
    `replace_older` and the tree's is newer (a worktree kept across installs). Returns how
    many files were copied."""
    exclude = tree / ".git" / "info" / "exclude"
    copied = 0
    for line in (exclude.read_text().splitlines() if exclude.exists() else []):
        rel = line.strip().lstrip("/")
        if not rel or line.startswith("#") or any(c in rel for c in "*?["):
            continue
        src, target = tree / rel, dest / rel
        if src.is_file() and (not target.exists() or (
                replace_older and target.stat().st_mtime < src.stat().st_mtime)):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
            copied += 1
    return copied


def is_harness_output(path: str, kernels: set[str]) -> bool:
    """A cache or build output the harness (or Python running in the tree) makes."""
    parts = path.rstrip("/").split("/")
    if CACHE_DIRS & set(parts) or path.rstrip("/") in kernels:
        return True
    if path.endswith("/"):
        return parts[-1].endswith(OUTPUT_DIR_SUFFIXES)
    return parts[-1].endswith(OUTPUT_SUFFIXES) or any(
        p.endswith(OUTPUT_DIR_SUFFIXES) for p in parts[:-1])


@dataclass
class FileWork:
    changed: list[str] = field(default_factory=list)    # uncommitted changes to tracked files
    untracked: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)    # ignored, and not a harness output

    def __bool__(self) -> bool:
        return bool(self.changed or self.untracked or self.ignored)


def file_work(tree: Path, ignored: bool = True, residue: set[str] = frozenset()) -> FileWork:
    """The user's files in the tree, leaving out harness outputs and `residue` (files an
    interrupted harness step left, see buildtree.step_residue)."""
    kernels = installed_kernels(tree)
    work = FileWork()
    for e in status(tree, ignored=ignored):
        if e.path in residue or (e.code in ("??", "!!") and is_harness_output(e.path, kernels)):
            continue
        {"??": work.untracked, "!!": work.ignored}.get(e.code, work.changed).append(e.path)
    return work


# ---------------------------------------------------------------------------------------------
# Git state


def operation_in_progress(tree: Path) -> str | None:
    """The git operation a tree is in the middle of: am, rebase, merge, cherry-pick, revert,
    bisect; or None."""
    g = tree / ".git"
    if (g / "rebase-apply").is_dir():  # `git rebase --apply` marks it; `git am` may not yet
        return "rebase" if (g / "rebase-apply" / "rebasing").exists() else "am"
    for name, op in (("rebase-merge", "rebase"), ("MERGE_HEAD", "merge"),
                     ("CHERRY_PICK_HEAD", "cherry-pick"), ("REVERT_HEAD", "revert"),
                     ("BISECT_LOG", "bisect")):
        if (g / name).exists():
            return op
    return None


def rev(tree: Path, name: str) -> str | None:
    proc = git(tree, "rev-parse", "-q", "--verify", f"{name}^{{commit}}", check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def is_harness_commit(tree: Path, commit: str) -> bool:
    committer = git(tree, "log", "-1", "--format=%ce", commit).stdout.strip()
    return committer == HARNESS_IDENT["GIT_COMMITTER_EMAIL"]


def heads(tree: Path) -> list[tuple[str, str]]:
    """(description, commit) of every ref that can hold the user's commits: branches, tags, notes...
    (not remote-tracking refs, whose commits a remote has; not the stash, see stash_count),
    a detached HEAD, and the HEADs of linked worktrees."""
    out = git(tree, "for-each-ref", "--format=%(refname)%00%(objectname)").stdout
    found = []
    for line in out.splitlines():
        ref, _, sha = line.partition("\0")
        if ref.startswith("refs/remotes/") or ref == "refs/stash":
            continue
        for prefix, kind in (("refs/heads/", "branch "), ("refs/tags/", "tag ")):
            if ref.startswith(prefix):
                ref = kind + ref.removeprefix(prefix)
        found.append((ref, sha))
    if git(tree, "symbolic-ref", "-q", "HEAD", check=False).returncode != 0:
        head = rev(tree, "HEAD")
        if head:
            found.append(("HEAD (detached)", head))
    for admin, path in linked_worktrees(tree):
        try:
            head = (admin / "HEAD").read_text().strip()
        except OSError:
            continue
        if head and not head.startswith("ref:"):
            found.append((f"HEAD of worktree {path}", head))
    return found


def foreign_commits(tree: Path, known: list[str]) -> dict[tuple[str, str], list[str]]:
    """Per (ref description, commit), "<short id> <subject>" of its commits that are not
    `known` or their ancestors."""
    found = {}
    for name, sha in heads(tree):
        out = git(tree, "log", "--format=%h %s", sha, "--not", *known, "--").stdout
        if out.strip():
            found[(name, sha)] = out.strip().splitlines()
    return found


def stash_count(tree: Path) -> int:
    out = git(tree, "stash", "list", check=False).stdout
    return len([ln for ln in out.splitlines() if ln.strip()])


def is_harness_worktree(path: Path) -> bool:
    """build/.<name>/vllm-X: the worktrees check-series, export and the stock tree make."""
    try:
        rel = path.resolve().relative_to(build_dir().resolve())
    except ValueError:
        return False
    return len(rel.parts) == 2 and rel.parts[0].startswith(".")


def foreign_worktrees(tree: Path) -> list[Path]:
    return [p for p in worktree_paths(tree)[1:] if not is_harness_worktree(p)]
