"""The docs name what exists: modules, test files and test names, scripts, flags, metrics.

Design docs state the current design, so a module that is added, moved or removed, a test that
is renamed or a flag that is spelled otherwise must show up in the docs at once. These tests
read README.md and docs/*.md and check each name against the tree:

- the module tables of docs/KV_VMM.md and docs/NIXL_VMM.md list every module of their package
  and nothing else;
- every `tests/...py` and `scripts/...` path exists (the series' unit tests live in
  `vllm_overlay/tests/` and in the tests the patches add, and the docs name them as they sit
  in vLLM's tree: `tests/v1/kv_vmm/...`); every `test_x.py::test_name` names a test of that
  file;
- every `--kv-cache-vmm-*` flag is one the 0.32.0 series adds, and every `vllm:kv_cache_vmm_*`
  metric one the series exports.

History is exempt: docs/BENCHMARKS.md is checked up to its generated results section (the
dated runs after it quote paths as they were then), and docs/range-diff/ is not read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "vllm_overlay"
KV_VMM = OVERLAY / "vllm" / "v1" / "kv_vmm"
NIXL_VMM = OVERLAY / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "vmm"
#: The release whose patches are the reference for flag and metric names.
FLAG_RELEASE = "v0.32.0"
#: Where the dated history of docs/BENCHMARKS.md starts (the generated section, then the runs).
BENCHMARKS_HISTORY = "<!-- bench.py results: begin"

# A path of this repository (or of vLLM's tree, for tests), not a part of a longer path
# (`<tree>/tests/...`, `build/vllm-X/tests/...`) or of a module name (`vllm.tests`).
PATH = re.compile(r"(?<![\w./<>-])((?:tests|scripts|vllm_overlay)/[\w./*-]*[\w*/])")
# A test file, alone or with a directory, and the test names after it (`file.py::a`, `::b`).
TEST_FILE = re.compile(r"(?<![\w./<>-])((?:[\w.-]+/)*(test_\w+\.py))((?:::\w+)?)")
TEST_NAME_ONLY = re.compile(r"(?<![\w.])::(\w+)")
FLAG = re.compile(r"--kv-cache-(?:vmm|memory)[\w-]*\w")
METRIC = re.compile(r"vllm:(kv_cache_vmm_\w+|nixl_\w+)")


def doc_files() -> dict[str, str]:
    """README.md and docs/*.md, each as the text that states the current design."""
    docs = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text()
        if path.name == "BENCHMARKS.md":
            text = text.split(BENCHMARKS_HISTORY, 1)[0]
        docs[f"docs/{path.name}"] = text
    return docs


def module_table(text: str) -> list[str]:
    """The file column of the doc's module table (the table whose header is `| file | what |`)."""
    rows, inside = [], False
    for line in text.splitlines():
        if re.match(r"\|\s*file\s*\|\s*what\s*\|", line):
            inside = True
            continue
        if inside:
            if not line.startswith("|"):
                break
            cell = line.split("|")[1].strip()
            if set(cell) <= set("-: "):
                continue
            rows.append(cell.strip("`"))
    return rows


def package_modules(package: Path) -> set[str]:
    return {p.relative_to(package).as_posix() for p in package.rglob("*.py")
            if "__pycache__" not in p.parts}


def patch_texts() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text(errors="replace")
            for p in sorted((ROOT / "patches").glob("v*/*.patch"))}


class Tree:
    """The test files a doc may name: this repository's, the overlay's (as `tests/...` in
    vLLM's tree) and those the patches add; and where each test name is defined."""

    def __init__(self) -> None:
        self.patches = patch_texts()
        self.files: dict[str, list[str]] = {}  # tests/... path -> texts that define it
        for base in (ROOT, OVERLAY):
            for p in (base / "tests").rglob("*.py"):
                rel = p.relative_to(base).as_posix()
                self.files.setdefault(rel, []).append(p.read_text(errors="replace"))
        for text in self.patches.values():
            for m in re.finditer(r"^\+\+\+ b/(tests/\S+\.py)\n(.*?)(?=^diff --git |\Z)", text,
                                 re.M | re.S):
                self.files.setdefault(m.group(1), []).append(m.group(2))

    def path_exists(self, path: str) -> bool:
        if "*" in path:
            return any(base.glob(path) for base in (ROOT, OVERLAY)) or any(
                Path(f).match(path) for f in self.files)
        path = path.rstrip("/")
        if path.startswith("vllm_overlay/"):
            return (ROOT / path).exists()
        if (ROOT / path).exists() or (OVERLAY / path).exists():
            return True
        return any(f == path or f.startswith(path + "/") for f in self.files)

    def test_files(self, name: str) -> list[str]:
        """Paths of the test files a name (`test_x.py`, or with directories) can mean."""
        name = name.removeprefix("vllm_overlay/")
        if "/" in name:
            return [f for f in self.files if f == name or f.endswith("/" + name)]
        return [f for f in self.files if f.rsplit("/", 1)[-1] == name]

    def defines(self, files: list[str], test: str) -> bool:
        pattern = re.compile(rf"^[+ ]?\s*(?:async\s+)?def {re.escape(test)}\(", re.M)
        return any(pattern.search(text) for f in files for text in self.files[f])


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree()


def missing_paths(docs: dict[str, str], tree: Tree) -> list[str]:
    found = []
    for doc, text in docs.items():
        for n, line in enumerate(text.splitlines(), 1):
            for m in PATH.finditer(line):
                path = m.group(1)
                if not tree.path_exists(path):
                    found.append(f"{doc}:{n}: {path}")
    return found


def missing_tests(docs: dict[str, str], tree: Tree) -> list[str]:
    """`file.py::name` and the `::name` after it on the same line that name no test there."""
    found = []
    for doc, text in docs.items():
        for n, line in enumerate(text.splitlines(), 1):
            files: list[str] = []
            spans = sorted([(m.start(), "file", m) for m in TEST_FILE.finditer(line)]
                           + [(m.start(), "name", m) for m in TEST_NAME_ONLY.finditer(line)],
                           key=lambda t: t[0])
            for _, kind, m in spans:
                if kind == "file":
                    files = tree.test_files(m.group(1))
                    if not files:
                        found.append(f"{doc}:{n}: {m.group(1)} (no such test file)")
                        continue
                    test = m.group(3)[2:]
                else:
                    if m.start() > 0 and line[m.start() - 1] not in " `(,;[":
                        continue  # the `::name` of a file matched above
                    test = m.group(1)
                if test and files and not tree.defines(files, test):
                    found.append(f"{doc}:{n}: {test} is not a test of {', '.join(files)}")
    return found


def unknown_flags(docs: dict[str, str], patches: dict[str, str]) -> list[str]:
    added = "\n".join(text for name, text in patches.items() if name.startswith(f"patches/{FLAG_RELEASE}/"))
    found = []
    for doc, text in docs.items():
        for flag in sorted(set(FLAG.findall(text))):
            if f'"{flag}"' not in added and f"'{flag}'" not in added and (
                    flag.removeprefix("--").replace("-", "_") not in added):
                found.append(f"{doc}: {flag}")
    return found


def unknown_metrics(docs: dict[str, str], patches: dict[str, str]) -> list[str]:
    code = "\n".join(patches.values()) + "\n".join(
        p.read_text() for p in (OVERLAY / "vllm").rglob("*.py"))
    found = []
    for doc, text in docs.items():
        for name in sorted(set(METRIC.findall(text))):
            base = name.removesuffix("_total")
            if f"vllm:{base}" not in code:
                found.append(f"{doc}: vllm:{name}")
    return found


def test_the_checks_catch_what_they_are_for(tree: Tree):
    docs = {"doc.md": "\n".join([
        "Run `tests/engine/test_no_such_file.py` and `scripts/no_such_script.py`;",
        "`tests/v1/kv_vmm/test_ledger.py::test_that_does_not_exist`, "
        "`::test_a_killed_engine_leaves_the_ledger`;",
        "`test_map_failures.py::test_no_such_test[tp1]`, `test_nowhere.py`.",
        "Flags `--kv-cache-vmm-no-such-flag` and `--kv-cache-vmm-shared`; "
        "metric `vllm:kv_cache_vmm_no_such_metric_total`, `vllm:kv_cache_vmm_mapped_bytes`.",
    ])}
    assert missing_paths(docs, tree) == [
        "doc.md:1: tests/engine/test_no_such_file.py", "doc.md:1: scripts/no_such_script.py"]
    assert missing_tests(docs, tree) == [
        "doc.md:1: tests/engine/test_no_such_file.py (no such test file)",
        "doc.md:2: test_that_does_not_exist is not a test of tests/v1/kv_vmm/test_ledger.py",
        "doc.md:3: test_no_such_test is not a test of tests/v1/kv_vmm/test_map_failures.py",
        "doc.md:3: test_nowhere.py (no such test file)"]
    patches = patch_texts()
    assert unknown_flags(docs, patches) == ["doc.md: --kv-cache-vmm-no-such-flag"]
    assert unknown_metrics(docs, patches) == ["doc.md: vllm:kv_cache_vmm_no_such_metric_total"]
    table = "| file | what |\n|---|---|\n| `a.py` | A. |\n| `b/c.py` | C. |\n\nafter\n| `d.py` | |"
    assert module_table(table) == ["a.py", "b/c.py"]


@pytest.mark.parametrize("doc, package", [("docs/KV_VMM.md", KV_VMM),
                                          ("docs/NIXL_VMM.md", NIXL_VMM)],
                         ids=["kv_vmm", "nixl_vmm"])
def test_the_module_table_lists_every_module_of_its_package(doc: str, package: Path):
    rows = module_table((ROOT / doc).read_text())
    assert rows, f"{doc} has no module table (a `| file | what |` table)"
    modules = package_modules(package)
    where = package.relative_to(ROOT)
    assert not sorted(modules - set(rows)), (
        f"modules of {where} missing from the module table of {doc}: "
        f"{sorted(modules - set(rows))}")
    assert not sorted(set(rows) - modules), (
        f"rows of the module table of {doc} that name no module of {where}: "
        f"{sorted(set(rows) - modules)}")
    assert len(rows) == len(set(rows)), f"{doc} lists a module twice"


#: Docs whose names are known to be out of date; strict, so that the mark goes once they are
#: mended.
OUT_OF_DATE = {
    "docs/UPSTREAM.md": "its PR plan still names the modules and tests before the NIXL code "
                        "moved next to the connector and the offload tests into the overlay",
}


def each_doc() -> list:
    return [pytest.param(name, marks=pytest.mark.xfail(reason=OUT_OF_DATE[name], strict=True))
            if name in OUT_OF_DATE else name for name in doc_files()]


@pytest.mark.parametrize("doc", each_doc())
def test_every_test_and_script_path_the_doc_names_exists(tree: Tree, doc: str):
    missing = missing_paths({doc: doc_files()[doc]}, tree)
    assert not missing, "paths the doc names that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", each_doc())
def test_every_test_the_doc_names_exists(tree: Tree, doc: str):
    missing = missing_tests({doc: doc_files()[doc]}, tree)
    assert not missing, "tests the doc names that do not exist:\n" + "\n".join(missing)


def test_every_flag_the_docs_name_is_one_the_series_adds():
    unknown = unknown_flags(doc_files(), patch_texts())
    assert not unknown, (f"flags the docs name that patches/{FLAG_RELEASE} does not add:\n"
                         + "\n".join(unknown))


def test_every_metric_the_docs_name_is_one_the_series_exports():
    unknown = unknown_metrics(doc_files(), patch_texts())
    assert not unknown, "metrics the docs name that the series does not export:\n" + "\n".join(
        unknown)
