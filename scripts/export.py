#!/usr/bin/env python3
"""Export the series of a release as upstream-ready patches, one per topic.

  python3 scripts/export.py --version 0.32.0 [--out DIR] [--draft]

Writes one `git format-patch` file per patch of the series into build/export/vllm-X/ (or
--out). The overlay is not sent as a commit of its own: each of its files goes into the first
patch, in series order, whose code uses it (see `place_overlay` and docs/CONTRIBUTING.md,
"Export a patch as an upstream PR"), so every patch brings the new files it needs and nothing
else. Every exported commit is authored by you and carries your `Signed-off-by:` as its only
sign-off, from the `user.name` / `user.email` git config of this checkout; project-only notes
(`Drop when:`, "On vX.Y.Z ...", "Checked on vX.Y.Z: ...") are stripped from the messages and
named. A subject longer than 72 characters or without a vLLM `[Area]` prefix stops the export
(--draft: named, not refused). Refuses if the build tree is not exactly the current series.
Before it reports success it checks that the files are what a reviewer gets: `git am` of them,
in order, onto the pristine release gives, patch by patch, the commits it exported and, at the
end, exactly the patched tree (less the overlay files the release does not use, which it
names).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import (  # noqa: E402
    commits_after, desired_patches, recorded_commits, require_applied_tree, scratch_worktree,
)
from seriestool import (  # noqa: E402
    HARNESS_IDENT, ROOT, SeriesError, build_dir, format_patch_args, get_release, git, git_out,
    main_guard, overlay_digest, overlay_files, read_series, read_state, run,
)

SIGNOFF_RE = re.compile(r"^Signed-off-by: (?P<name>[^<>\n]*\S) <(?P<email>[^<>\s@]+@[^<>\s]+)>$")


def user_ident(checkout: Path = ROOT) -> tuple[str, str]:
    """user.name and user.email from the git config of the checkout the export runs from."""

    def config(key: str) -> str:
        proc = run(["git", "config", "--get", key], cwd=checkout, check=False)
        return (proc.stdout or "").strip() if proc.returncode == 0 else ""

    name, email = config("user.name"), config("user.email")
    problem = ""
    if not name or not email:
        unset = " and ".join(k for k, v in (("user.name", name), ("user.email", email)) if not v)
        problem = f"git config {unset} is not set"
    elif email == HARNESS_IDENT["GIT_AUTHOR_EMAIL"]:
        problem = f"git config user.email is the harness's own identity ({email})"
    elif not SIGNOFF_RE.match(f"Signed-off-by: {name} <{email}>"):
        problem = (f"git config user.name/user.email ({name!r} / {email!r}) is not a name "
                   "and an email")
    if problem:
        raise SeriesError(
            f"{problem}, so the export cannot be authored by you or carry your Signed-off-by "
            "(the Developer Certificate of Origin needs a real name and email).",
            "Set it: `git config --global user.name 'Your Name'` and "
            "`git config --global user.email you@example.com` (or without --global in this "
            "checkout), then export again.",
        )
    return name, email


# ---------------------------------------------------------------------------------------------
# Which patch each overlay file goes into

TEST_NAME = re.compile(r"^(test_.*|.*_test)\.py$")
# A string in code that is, as a whole, a module path (`vllm.v1.kv_vmm.pages`), a qualified name
# in it (`vllm.v1.kv_vmm.pages.KVPagePolicy`) or an entry point (`vllm.v1.kv_vmm.ledger_cli:main`).
MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_][\w.]*)?$")
# Non-Python files other than docs: dotted module paths and file paths in their text.
DOTTED = re.compile(r"\b(?:vllm|tests)(?:\.[A-Za-z_]\w*)+")
PATHLIKE = re.compile(r"\b(?:vllm|tests)(?:/[\w.-]+)+")
# Prose: a module it names is mentioned, not used.
DOC_SUFFIXES = (".md", ".rst", ".txt")


def is_test_side(rel: str) -> bool:
    return rel.startswith("tests/")


def is_test_file(rel: str) -> bool:
    return is_test_side(rel) and bool(TEST_NAME.match(PurePosixPath(rel).name))


def is_doc(rel: str) -> bool:
    return rel.endswith(DOC_SUFFIXES) or PurePosixPath(rel).parts[0] == "docs"


def is_compat(rel: str) -> bool:
    """A compat module: shims for what some releases lack, imported only from their glue."""
    p = PurePosixPath(rel)
    return p.name in ("compat.py", "_compat.py") or "compat" in p.parts[:-1]


def module_of(rel: str) -> str | None:
    p = PurePosixPath(rel)
    if p.suffix != ".py":
        return None
    parts = list(p.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def python_uses(rel: str, text: str) -> tuple[set[str], set[str]]:
    """(dotted names, file paths) that the code of Python file `rel` uses, read with `ast`:

    - every import statement, wherever it is: module level, inside a function (lazy), under
      `if TYPE_CHECKING:` (a type checker resolves those, so the module must exist for the
      patch to pass the release's mypy), absolute or relative;
    - every string constant of the code that is, as a whole, a module path, a qualified name
      or an entry point (`importlib.import_module("vllm.x")`, `resolve_obj_by_qualname(...)`,
      a registry entry, `mock.patch("vllm.x.f")`, `[python, "-m", "vllm.x"]`), and
      `import_module(".x", package="vllm.y")`; a string that is exactly a file path is kept
      as a path.

    Comments are not code, and docstrings and other bare string statements are not either:
    a module they name is not used. Nor are the literal parts of f-strings (messages). A file
    that does not parse here is read as `text_uses` reads other files, with a warning."""
    try:
        tree = ast.parse(text, filename=rel)
    except SyntaxError as e:
        # Not code this interpreter can read (a patch that breaks it, a later Python's
        # syntax): the names in its text are the best guess. `make check-bisect` fails it.
        print(f"warning: {rel} is not valid Python here ({e.msg}, line {e.lineno}): placed "
              "by the module names in its text", file=sys.stderr)
        return text_uses(text)
    package = PurePosixPath(rel).parent.parts
    names: set[str] = set()
    paths: set[str] = set()
    prose: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            prose.add(id(node.value))  # a docstring or a bare string statement
        elif isinstance(node, ast.JoinedStr):
            prose.update(id(v) for v in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and _relative_import_module(node):
            names.add(_relative_import_module(node))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in prose):
            value = node.value.strip()
            if MODULE_PATH.match(value):
                names.add(value.replace(":", "."))
            elif "/" in value and PATHLIKE.fullmatch(value):
                paths.add(value)
    return names, paths


def _relative_import_module(call: ast.Call) -> str:
    """The module of `import_module(".x", package="a.b")` (or `"a.b"` as second argument)."""
    func = call.func
    fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if fname != "import_module" or not call.args:
        return ""
    first = call.args[0]
    pkg = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "package"), None)
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)
            and first.value.startswith(".") and isinstance(pkg, ast.Constant)
            and isinstance(pkg.value, str)):
        return ""
    name = first.value
    level = len(name) - len(name.lstrip("."))
    parts = pkg.value.split(".")
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*base, *([name.lstrip(".")] if name.lstrip(".") else [])])


def text_uses(text: str) -> tuple[set[str], set[str]]:
    """(dotted names, file paths) a non-Python, non-doc file (a config, a CI step, a shell
    script) names: such files name a module to load or run it. Whole-line `#` comments are
    left out."""
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    return set(DOTTED.findall(code)), set(PATHLIKE.findall(code))


def is_program(rel: str, text: str) -> bool:
    """A module run as a program: it has an `if __name__ == "__main__":` block."""
    if not rel.endswith(".py"):
        return False
    try:
        body = ast.parse(text, filename=rel).body
    except SyntaxError:
        return False
    for node in body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
                and test.left.id == "__name__" and len(test.comparators) == 1
                and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == "__main__"):
            return True
    return False


def references(rel: str, text: str, modules: dict[str, str], paths: set[str]) -> set[str]:
    """Overlay files that the code of file `rel` (contents `text`) uses (see `python_uses`,
    `text_uses`); docs use none."""
    if rel.endswith((".py", ".pyi")):
        names, named_paths = python_uses(rel, text)
    elif is_doc(rel):
        return set()
    else:
        names, named_paths = text_uses(text)
    found = set()
    for name in names:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            hit = modules.get(".".join(parts[:n]))
            if hit:
                found.add(hit)
                break
    found.update(p for p in named_paths if p in paths)
    found.discard(rel)
    return found


@dataclass
class Placement:
    """Where each overlay file goes: index into the topic commits, or dropped (and why)."""

    at: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    def files_of(self, index: int) -> list[str]:
        return sorted(f for f, i in self.at.items() if i == index)


def used_by_other_releases(release, files: dict[str, str]) -> frozenset[str]:
    """Support files under tests/ (not tests) that the patches of another release import."""
    texts = [p.read_text() for d in release.series_dir.parent.glob("v*")
             if d != release.series_dir for p in sorted(d.glob("*.patch"))]
    return frozenset(rel for rel in files
                     if is_test_side(rel) and not is_test_file(rel)
                     and (m := module_of(rel)) and any(m in t for t in texts))


def place_overlay(files: dict[str, str], patch_refs: list[set[str]],
                  elsewhere: frozenset[str] = frozenset()) -> Placement:
    """The rule (docs/CONTRIBUTING.md, "Export a patch as an upstream PR"):

    - a file outside tests/ goes into the first patch that uses it: code of a file the patch
      changes imports it or names its module as a string (`references`), or uses an overlay
      file that does (transitively); a module needs its package's __init__.py, so that goes
      with it; a program (`if __name__ == "__main__":`) that nothing imports goes where the
      last overlay module it imports arrives;
    - a test file (tests/**/test_*.py) goes with the module it tests: into the patch where the
      last overlay file it needs (its imports, its conftest.py/__init__.py, through support
      modules such as utils.py) arrives; a test that a patch names (a CI step that runs it)
      goes into that patch instead, and brings the modules it imports if they have not
      arrived yet (a library patch is its modules and the CI step of their tests; a later
      patch names the tests of what it adds to earlier modules);
    - other files under tests/ (conftest.py, utils.py, __init__.py) go with the first test
      that needs them;
    - unused: a compat module (compat.py, _compat.py, compat/) is dropped (the release needs
      none); a directory of the overlay none of whose files the release uses is a topic the
      release does not carry and is dropped; a support file under tests/ that only other
      releases' patches import (`elsewhere`: checks those releases' tests run on their own
      objects) is dropped; any other unused file is an error.
    """
    modules = {m: rel for rel in files if (m := module_of(rel))}
    paths = set(files)
    deps = {rel: references(rel, text, modules, paths) for rel, text in files.items()}
    for rel in files:  # a module needs the __init__.py of each package it is in
        for parent in PurePosixPath(rel).parents:
            init = str(parent / "__init__.py")
            if init in files and init != rel:
                deps[rel].add(init)
        if is_test_file(rel):  # and a test its conftest.py files
            for parent in PurePosixPath(rel).parents:
                conf = str(parent / "conftest.py")
                if conf in files:
                    deps[rel].add(conf)
    placed = Placement()
    first_ref: dict[str, int] = {}
    for i, refs in enumerate(patch_refs):
        for rel in refs:
            first_ref.setdefault(rel, i)

    def closure(rel: str) -> set[str]:
        seen, todo = set(), [rel]
        while todo:
            for dep in deps[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    if is_test_side(dep) and not is_test_file(dep):
                        todo.append(dep)
        return seen

    # Files outside tests/: the first patch that uses them, directly or through each other.
    at = {rel: i for rel, i in first_ref.items() if not is_test_side(rel)}
    # A test a patch names (a CI step that runs it) is that patch's test: the modules it
    # imports are used by that patch too (a library patch is its modules and the CI step of
    # their tests).
    for rel, i in first_ref.items():
        if is_test_file(rel):
            for dep in closure(rel):
                if not is_test_side(dep) and at.get(dep, len(patch_refs)) > i:
                    at[dep] = i
    changed = True
    while changed:
        changed = False
        for user, i in list(at.items()):
            for dep in deps[user]:
                if not is_test_side(dep) and at.get(dep, len(patch_refs)) > i:
                    at[dep] = i
                    changed = True
    # A program (`python -m vllm.x`) that no patch imports: where the last overlay module it
    # imports arrives (it drives that module, and cannot come before it).
    for rel in sorted(files):
        if not is_test_side(rel) and rel not in at and is_program(rel, files[rel]):
            needs = {d for d in deps[rel] if not is_test_side(d)}
            if needs and needs <= set(at):
                at[rel] = max(at[d] for d in needs)
    unused = sorted(rel for rel in files if not is_test_side(rel) and rel not in at)
    by_dir: dict[str, list[str]] = {}
    for rel in files:
        if not is_test_side(rel):
            by_dir.setdefault(str(PurePosixPath(rel).parent), []).append(rel)
    orphans = []
    for rel in unused:
        if is_compat(rel):
            placed.dropped[rel] = "compat module no patch of this release imports"
        elif not any(f in at for f in by_dir[str(PurePosixPath(rel).parent)]):
            placed.dropped[rel] = "no patch of this release uses its directory (topic not carried)"
        else:
            orphans.append(rel)

    # Test files: where the last file they need arrives, or in the patch that names them
    # (the feature they test arrives there: a later patch's CI step names the tests of what
    # it adds to earlier modules).
    tests_at: dict[str, int] = {}
    for rel in sorted(files):
        if not is_test_file(rel):
            continue
        needs = {d for d in closure(rel) if not is_test_side(d)}
        if needs & set(placed.dropped):  # it cannot run without them
            placed.dropped[rel] = "needs files this release does not carry"
            continue
        if not needs - set(placed.dropped) and rel not in first_ref:
            orphans.append(rel)
            continue
        i = max((at[d] for d in needs if d in at), default=first_ref.get(rel, 0))
        if needs - set(at) - set(placed.dropped):
            continue  # needs an unused file: reported with it
        tests_at[rel] = first_ref.get(rel, i)
    # Support files under tests/: with the first test that needs them.
    for rel in sorted(files):
        if not is_test_side(rel) or is_test_file(rel):
            continue
        users = [i for t, i in tests_at.items() if rel in closure(t)]
        if rel in first_ref:
            users.append(first_ref[rel])
        if users:
            at[rel] = min(users)
        elif all(t in placed.dropped for t in files if is_test_file(t) and rel in closure(t)) \
                and any(is_test_file(t) and rel in closure(t) for t in files):
            placed.dropped[rel] = "used only by tests this release does not carry"
        elif rel in elsewhere and not any(is_test_file(t) and rel in closure(t) for t in files):
            placed.dropped[rel] = "used only by the tests of other releases' patches"
        else:
            orphans.append(rel)
    at.update(tests_at)
    if orphans:
        raise SeriesError(
            "these overlay files are used by no patch of the series, so the export has no "
            "patch to send them with:\n  " + "\n  ".join(sorted(orphans)) + "\n(a patch uses a "
            "file when its code imports it or names its module in a string, directly or "
            "through another overlay file; a docstring or comment that names it is no use; a "
            "test goes with the modules it imports)",
            "Use them from the patch they belong to, or delete them from vllm_overlay/ "
            "(a shim some releases need is a compat module: name it compat.py).",
        )
    placed.at = {rel: i for rel, i in at.items() if rel not in placed.dropped}
    return placed


# A note of patches/vX/series that gives overlay tests to a patch:
#   # Tests of vmm-runtime-page-limit.patch: tests/v1/kv_vmm/test_page_limit.py
# (paths separated by spaces or commas, on one line). The patch is their patch as if a CI
# step of it named them: the feature they test arrives there, even when the modules they
# import arrived earlier.
TESTS_OF = re.compile(r"^#\s*Tests of (?P<patch>[\w.+-]+\.patch):\s*(?P<files>\S.*)$")


def tests_named_in_series(release, overlay: set[str]) -> dict[int, set[str]]:
    """{index of the patch in the series: overlay test files the series' notes give it}."""
    header, names = read_series(release)
    found: dict[int, set[str]] = {}
    bad = []
    for line in header:
        m = TESTS_OF.match(line.strip())
        if not m:
            continue
        files = [f for f in re.split(r"[\s,]+", m["files"]) if f]
        if m["patch"] not in names:
            bad.append(f"{line.strip()!r}: {m['patch']} is not in the series")
            continue
        for f in files:
            if f not in overlay or not is_test_file(f):
                bad.append(f"{line.strip()!r}: {f} is not a test file of vllm_overlay/")
        found.setdefault(names.index(m["patch"]), set()).update(
            f for f in files if f in overlay and is_test_file(f))
    if bad:
        raise SeriesError(
            f"patches/{release.tag}/series gives tests to patches it cannot:\n  "
            + "\n  ".join(bad),
            "Name a patch of the series and test files of vllm_overlay/ (tests/**/test_*.py).",
        )
    return found


# Overlay files the export of one release sends in another form: patches/vX/export/<path>
# replaces vllm_overlay/<path> in every exported patch that has it. The overlay's compat
# module probes releases (getattr, hasattr, ImportError) because one file serves every
# release; what goes upstream for the newest release is that release's behaviour alone.
EXPORT_VARIANTS = "export"


def export_variants(release, overlay: set[str]) -> dict[str, str]:
    """{overlay path: text the export sends instead} from patches/vX/export/."""
    root = release.series_dir / EXPORT_VARIANTS
    if not root.is_dir():
        return {}
    found = {str(f.relative_to(root).as_posix()): f.read_text()
             for f in sorted(root.rglob("*")) if f.is_file() and "__pycache__" not in f.parts}
    stray = sorted(rel for rel in found if rel not in overlay)
    if stray:
        raise SeriesError(
            f"patches/{release.tag}/{EXPORT_VARIANTS}/ has files that replace no file of "
            "vllm_overlay/:\n  " + "\n  ".join(stray),
            f"Name them as the overlay file they replace (patches/{release.tag}/"
            f"{EXPORT_VARIANTS}/vllm/v1/kv_cache_compat.py), or delete them.",
        )
    return found


# An exported patch a reviewer can take adds at most about this many lines (tests and docs
# counted). One that adds more says why in the notes of patches/vX/series:
#   # Over 1,500 lines: vmm-elastic-kv-cache.patch: <why>
#   #   <the reason may go on, on lines indented under it>
SIZE_LIMIT = 1500
OVER_LIMIT = re.compile(r"^#\s*Over 1,500 lines: (?P<patch>[\w.+-]+\.patch):\s*(?P<why>.*)$")


def size_reasons(release) -> dict[str, str]:
    """{patch name: why it may add more than SIZE_LIMIT lines} from the series' notes."""
    header, _ = read_series(release)
    found: dict[str, str] = {}
    current = None
    for line in header:
        m = OVER_LIMIT.match(line.strip())
        if m:
            current = m["patch"]
            found[current] = m["why"].strip()
        elif current and line.startswith("#   ") and line[4:].strip():
            found[current] += " " + line[4:].strip()
        else:
            current = None
    return found


def added_lines(patch: Path) -> int:
    """Lines a `git format-patch` file adds."""
    body = patch.read_text().split("\n---\n", 1)[-1]
    return sum(1 for ln in body.splitlines() if ln.startswith("+") and not ln.startswith("+++"))


def patch_references(tree: Path, commit: str, modules: dict[str, str],
                     paths: set[str]) -> set[str]:
    """Overlay files that the code of the files a topic commit changes uses, as they are
    after it."""
    changed = git_out(tree, "diff-tree", "--no-commit-id", "--name-only", "-r", "-z",
                      f"{commit}^", commit)
    found: set[str] = set()
    for rel in filter(None, changed.split("\0")):
        proc = git(tree, "show", f"{commit}:{rel}", check=False)
        if proc.returncode == 0:
            found |= references(rel, proc.stdout or "", modules, paths)
    return found


# ---------------------------------------------------------------------------------------------
# The exported commits


# Lines of a patch message that speak of this project, not of the change: a reviewer upstream
# has no use for them. Each starts a note that runs to the end of its paragraph (or to a
# trailer line such as `Signed-off-by:`). They belong in the notes at the top of
# patches/vX/series; the export strips them and says so, `make check-series` names the
# patches that still carry them.
PROJECT_NOTES = [
    (re.compile(r"^Drop when:"), "`Drop when:` (when the series can drop the patch)"),
    (re.compile(r"^On (?:vLLM )?v?\d+\.\d+(?:\.\d+)?\b"),
     "`On vX.Y.Z ...` (how the patch differs on one release)"),
    (re.compile(r"^Checked on (?:vLLM )?v?\d+\.\d+(?:\.\d+)?\b"),
     "`Checked on vX.Y.Z: file:line` (where the defect was read in one release)"),
]
TRAILER = re.compile(r"^[A-Za-z][\w-]*: \S")
# What ends a note before its paragraph does: a trailer git itself would take (Signed-off-by,
# Co-authored-by, Fixes, ...), not a sentence that starts with a name and a colon.
NOTE_END = re.compile(r"^(?:[A-Za-z]+(?:-[A-Za-z]+)+|Fixes|Link|Closes|Cc): \S")
SIGNOFF_ANY = re.compile(r"^Signed-off-by:", re.I)
SUBJECT_MAX = 72
# vLLM's commit subjects start with one or more tags naming the area: [Core], [KV Connector],
# [Bugfix][PP], [Frontend], [Metrics], [Docs], [CI/Build], [Misc], [torch.compile], ...
AREA_PREFIX = re.compile(r"^(?:\[[^\[\]\s][^\[\]]*\])+ \S")


def is_project_note(line: str) -> bool:
    return any(rx.match(line) for rx, _ in PROJECT_NOTES)


def strip_project_notes(message: str) -> tuple[str, list[str]]:
    """(message without project-only notes, the notes it had, one string each). The subject
    line is never a note."""
    lines = message.rstrip("\n").split("\n")
    out, notes = lines[:1], []
    note: list[str] | None = None
    for line in lines[1:]:
        if is_project_note(line):
            note = [line]
            notes.append(note)
            continue
        if note is not None:
            if line.strip() and not NOTE_END.match(line):
                note.append(line)
                continue
            note = None
        out.append(line)
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n")
    return text + "\n", ["\n".join(n) for n in notes]


def subject_problems(subject: str) -> list[str]:
    """What makes `subject` unfit for an upstream commit (empty when it is fine)."""
    problems = []
    if len(subject) > SUBJECT_MAX:
        problems.append(f"{len(subject)} characters, more than {SUBJECT_MAX}")
    if not AREA_PREFIX.match(subject):
        problems.append("no vLLM area prefix such as `[Core] `, `[KV Connector] `, "
                        "`[Bugfix] `, `[Frontend] `, `[Metrics] `, `[Docs] `, `[CI] `, "
                        "`[Misc] `")
    return problems


def message_problems(message: str) -> list[str]:
    """The subject's problems and the project-only notes of a patch message, one line each,
    for reports (`make check-series`)."""
    subject = message.split("\n", 1)[0]
    found = [f"subject {subject!r}: {p}" for p in subject_problems(subject)]
    for note in strip_project_notes(message)[1]:
        first = note.split("\n", 1)[0]
        found.append(f"project-only note: {first[:60]!r}"
                     + (" ..." if "\n" in note or len(first) > 60 else ""))
    return found


def export_message(message: str, name: str, email: str) -> tuple[str, list[str]]:
    """(the commit message as exported, the project-only notes stripped from it).

    The exporter's Signed-off-by is the last trailer and the only sign-off: every other
    `Signed-off-by:` line of the series is dropped (other trailers stay)."""
    text, notes = strip_project_notes(message)
    kept = [ln for ln in text.rstrip("\n").split("\n") if not SIGNOFF_ANY.match(ln)]
    while kept and not kept[-1].strip():
        kept.pop()
    last_para = []
    for ln in reversed(kept):
        if not ln.strip():
            break
        last_para.append(ln)
    is_trailers = bool(last_para) and len(kept) > len(last_para) and all(
        TRAILER.match(ln) for ln in last_para)
    mine = f"Signed-off-by: {name} <{email}>"
    out = [*kept, mine] if is_trailers else [*kept, "", mine]
    return "\n".join(out) + "\n", notes


def export(release, out: Path, draft: bool = False,
           ident: tuple[str, str] | None = None, verify: bool = True) -> list[Path]:
    """Write the exported patches of `release` into `out`; return them.

    `draft`: subjects that break the rule are reported, not refused (a stack to look at or to
    bisect, not to send). `ident`: (name, email) instead of this checkout's git identity.
    `verify=False` leaves out the `git am` round trip (for a caller that applies them itself,
    scripts/check_bisect.py)."""
    tree = require_applied_tree(release, "export")
    state = read_state(tree)
    commits = commits_after(tree, release.tag)
    in_sync = (
        state.get("overlay", {}).get("digest") == overlay_digest()
        and [(p["name"], p["digest"]) for p in state.get("patches", [])] == desired_patches(release)
        and commits == recorded_commits(state)
    )
    if not in_sync:
        raise SeriesError(
            f"the build tree {tree} is not exactly the current series of {release.tag}.",
            f"Run `make refresh VLLM_VERSION={release.version}` to save your commits, or "
            f"`make apply VLLM_VERSION={release.version}` to bring the tree up to date, then "
            "export again.",
        )
    name, email = ident or user_ident()
    overlay_commit, topics = commits[0], commits[1:]
    if not topics:
        raise SeriesError(f"the series of {release.tag} has no patch to export.")
    names = [git_out(tree, "log", "-1", "--format=%s", c) for c in topics]
    bad = [(n, p) for n in names if (p := subject_problems(n))]
    if bad:
        listing = "\n".join(f"  {n!r}: {'; '.join(p)}" for n, p in bad)
        if not draft:
            raise SeriesError(
                f"{len(bad)} of the {len(names)} patch subjects of {release.tag} are not fit "
                f"for an upstream commit (at most {SUBJECT_MAX} characters, starting with a "
                f"vLLM area prefix such as `[Core]`):\n{listing}",
                "Reword them in the build tree (`git rebase -i` with `reword`), "
                f"`make refresh VLLM_VERSION={release.version}`, then export again "
                "(`python3 scripts/export.py --draft` writes the patches anyway, to look at).",
            )
        print(f"warning: subjects not fit for an upstream commit (--draft):\n{listing}")
    files = {str(rel): git(tree, "show", f"{overlay_commit}:{rel}").stdout
             for rel in overlay_files()}
    modules = {m: rel for rel in files if (m := module_of(rel))}
    refs = [patch_references(tree, c, modules, set(files)) for c in topics]
    for i, tests in tests_named_in_series(release, set(files)).items():
        refs[i] |= tests
    placed = place_overlay(files, refs, used_by_other_releases(release, files))
    variants = export_variants(release, set(files))
    exported, stripped = build_commits(tree, release.tag, topics, placed, name, email,
                                       variants)

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    args = [a for a in format_patch_args() if a != "--zero-commit"]
    git(tree, *args, "-o", str(out), f"{release.tag}..{exported[-1]}", dated=False)
    patches = sorted(out.glob("*.patch"))
    if verify:
        check_round_trip(tree, release, patches, exported=exported,
                         dropped=sorted(placed.dropped), variants=variants)
    for i, name_ in enumerate(names):
        added = placed.files_of(i)
        if added:
            print(f"{name_}: with {len(added)} overlay files: {', '.join(added)}")
    for rel, why in sorted(placed.dropped.items()):
        print(f"not exported: {rel} ({why})")
    for rel in sorted(variants):
        if rel in placed.at:
            print(f"exported as patches/{release.tag}/{EXPORT_VARIANTS}/{rel}: {rel} "
                  f"(the overlay's file serves every release)")
    reasons = size_reasons(release)
    _, series_names = read_series(release)
    for patch, topic in zip(patches, series_names):
        n = added_lines(patch)
        if n > SIZE_LIMIT:
            why = reasons.get(topic)
            print(f"size: {patch.name} adds {n} lines, over ~{SIZE_LIMIT:,}: "
                  + (why if why else f"no reason given (a note `# Over 1,500 lines: {topic}: "
                     f"<why>` in patches/{release.tag}/series)"))
    for patch, notes in zip(patches, stripped):
        for note in notes:
            lines = note.split("\n")
            more = f" (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
            print(f"warning: {patch.name}: project-only note stripped: {lines[0]!r}{more}")
    if any(stripped):
        print(f"(project-only notes belong in the notes of patches/{release.tag}/series; "
              "`make check-series` lists the patches that carry them)")
    return patches


def build_commits(tree: Path, base: str, topics: list[str], placed: Placement, name: str,
                  email: str, variants: dict[str, str] | None = None,
                  ) -> tuple[list[str], list[list[str]]]:
    """One commit per topic on the pristine tag: the topic's tree less the overlay files of
    later topics (and the dropped ones), your identity, the message as `export_message` makes
    it. Returns the commits and, per commit, the project-only notes stripped."""
    ident = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
             "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email}
    parent = git_out(tree, "rev-parse", f"{base}^{{commit}}")
    out, stripped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**ident, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        for i, commit in enumerate(topics):
            git(tree, "read-tree", commit, env=env)
            later = [f for f, at in placed.at.items() if at > i] + list(placed.dropped)
            if later:
                git(tree, "update-index", "--force-remove", "--", *sorted(later), env=env)
            for rel, text in sorted((variants or {}).items()):
                if placed.at.get(rel, len(topics)) <= i:
                    variant = Path(tmp) / "variant"
                    variant.write_text(text)
                    blob = git_out(tree, "hash-object", "-w", str(variant))
                    git(tree, "update-index", "--add", "--cacheinfo",
                        f"100644,{blob},{rel}", env=env)
            new_tree = git_out_env(tree, env, "write-tree")
            msg = Path(tmp) / "msg"
            text, notes = export_message(git_out(tree, "log", "-1", "--format=%B", commit),
                                         name, email)
            msg.write_text(text)
            stripped.append(notes)
            parent = git_out_env(tree, env, "commit-tree", new_tree, "-p", parent, "-F",
                                 str(msg), dated=False)
            out.append(parent)
    return out, stripped


def git_out_env(tree: Path, env: dict, *args: str, dated: bool = True) -> str:
    return git(tree, *args, env=env, dated=dated).stdout.strip()


def check_round_trip(tree: Path, release, files: list[Path], exported: list[str] | None = None,
                     dropped: list[str] | None = None,
                     variants: dict[str, str] | None = None) -> None:
    """`git am` of `files` onto pristine vX must reproduce the patched tree byte for byte,
    less the `dropped` overlay files; with `exported`, each patch must also give exactly the
    tree of the commit it was made from.

    Plain `git am`, as a contributor or reviewer runs it: no --3way, no --keep-cr."""
    with scratch_worktree(tree, release.tag, "export-check") as wt:
        proc = git(wt, "am", "--quiet", *(str(f) for f in files), check=False, dated=False)
        if proc.returncode != 0:
            said = [line for line in (proc.stdout + proc.stderr).splitlines()
                    if line.startswith(("Patch failed", "error:"))]
            git(wt, "am", "--abort", check=False)
            raise SeriesError(
                f"the exported patches do not apply with `git am` to pristine {release.tag}:\n  "
                + "\n  ".join(said or ["git am failed"]),
                "Re-make the commit that fails so it applies as sent (a file with CRLF line ends, "
                "for example, loses its CRs in `git am`), `make refresh`, then export again.",
            )
        excluded = [f":(exclude){p}" for p in [*(dropped or []), *(variants or {})]]
        diff = git_out(wt, "diff", "--stat", "HEAD", git_out(tree, "rev-parse", "HEAD"),
                       "--", ".", *excluded)
        missing = [p for p in dropped or []
                   if git(wt, "cat-file", "-e", f"HEAD:{p}", check=False).returncode == 0]
        for rel, text in sorted((variants or {}).items()):
            sent = git(wt, "show", f"HEAD:{rel}", check=False)
            if sent.returncode == 0 and sent.stdout != text:
                diff += f"\n {rel} (not patches/{release.tag}/{EXPORT_VARIANTS}/{rel})"
        if diff or missing:
            raise SeriesError(
                f"`git am` of the exported patches onto pristine {release.tag} does not "
                f"reproduce the patched tree; these files would reach a reviewer altered:\n"
                f"{diff}{''.join(f'{chr(10)} {p} (meant to be left out)' for p in missing)}",
                "Do not send these patches. Re-make the commits that touch those files so they "
                "survive `git am` (CRLF line ends, for example, lose their CRs), `make refresh`, "
                "then export again.",
            )
        if exported:
            applied = commits_after(wt, release.tag)
            bad = [Path(f).name for f, a, e in zip(files, applied, exported)
                   if git_out(wt, "rev-parse", f"{a}^{{tree}}")
                   != git_out(tree, "rev-parse", f"{e}^{{tree}}")]
            if bad or len(applied) != len(exported):
                raise SeriesError(
                    "`git am` of the exported patches does not give the commits they were "
                    f"made from: {', '.join(bad) or f'{len(applied)} of {len(exported)} applied'}.",
                    "Do not send these patches; report this as a bug of scripts/export.py.",
                )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--out", type=Path)
    p.add_argument("--draft", action="store_true",
                   help="write the patches even when subjects break the rule (named): a stack "
                        "to look at or bisect, not to send")
    args = p.parse_args()
    release = get_release(args.version)
    out = args.out or build_dir() / "export" / f"vllm-{release.version}"
    files = export(release, out, draft=args.draft)
    print(f"{len(files)} upstream-ready patches in {out}:")
    for f in files:
        print(f"  {f.name}")
    print(f"Send one as a PR: git -C <your vllm clone> am {out}/<patch>")


if __name__ == "__main__":
    main_guard(main)
