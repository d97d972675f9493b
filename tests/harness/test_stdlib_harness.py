"""The harness (scripts/*.py) runs on a bare Python: it imports nothing beyond the standard
library and its own modules at import time. The benchmarks (scripts/bench/) import torch,
vLLM, NIXL and matplotlib; they live apart and the harness never imports them.

Two checks: every import statement that runs when a harness module is imported (module and
class bodies, `if`/`try`/`with` blocks; not function bodies, nor `if TYPE_CHECKING:`), by
name; and each harness module really imported by a Python started without site-packages
(`-S`), which also catches an import made some other way at import time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

# Modules in scripts/ that only pytest loads, inside a release's virtualenv (which has
# pytest): the harness itself must not import them.
PYTEST_PLUGINS = {"upstream_plugin": "`pytest -p upstream_plugin` in a release's virtualenv"}


def harness_modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SCRIPTS.glob("*.py"))}


def _imports(body: list[ast.stmt], top_level_only: bool):
    """(line, module) of every import in `body`: at import time only, or anywhere."""
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.lineno, node.module
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if not top_level_only:
                yield from _imports(node.body, top_level_only)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse, top_level_only)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _imports([child], top_level_only)
                elif isinstance(child, ast.excepthandler):
                    yield from _imports(child.body, top_level_only)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def non_stdlib_imports(source: str, local: set[str], top_level_only: bool = True) -> list[str]:
    """'line N: module' for each import of a module that is neither the standard library's
    nor one of `local`."""
    found = []
    for line, module in _imports(ast.parse(source).body, top_level_only):
        root = module.split(".")[0]
        if root not in sys.stdlib_module_names and root not in local and root != "__future__":
            found.append(f"line {line}: {module}")
    return found


def test_the_detector_finds_what_it_is_for():
    local = {"seriestool"}
    src = ("import json\nimport torch\nfrom seriestool import ROOT\n"
           "try:\n    import numpy as np\nexcept ImportError:\n    import yaml\n"
           "if sys.version_info > (3,):\n    from vllm.v1 import kv_vmm\n"
           "with open('x'):\n    import pytest\n"
           "class C:\n    import matplotlib\n"
           "def f():\n    import nixl\n"
           "if TYPE_CHECKING:\n    import torch.cuda\n")
    assert non_stdlib_imports(src, local) == [
        "line 2: torch", "line 5: numpy", "line 7: yaml", "line 9: vllm.v1",
        "line 11: pytest", "line 13: matplotlib"]
    assert "line 15: nixl" in non_stdlib_imports(src, local, top_level_only=False)
    assert non_stdlib_imports("from . import x\nimport os.path\n", local) == []


def test_harness_scripts_import_only_the_standard_library():
    modules = harness_modules()
    assert "run_tests" in modules and "bench" not in modules  # scripts/bench/ is apart
    assert set(PYTEST_PLUGINS) <= set(modules)
    harness = set(modules) - set(PYTEST_PLUGINS)
    offenders = []
    for name, path in modules.items():
        if name in PYTEST_PLUGINS:
            continue
        source = path.read_text()
        offenders += [f"scripts/{path.name} {hit}" for hit in non_stdlib_imports(source, harness)]
        # A pytest plugin imported by the harness, even inside a function, makes the
        # harness need pytest.
        offenders += [f"scripts/{path.name} {hit} (a pytest plugin)"
                      for hit in non_stdlib_imports(source, set(modules) - set(PYTEST_PLUGINS),
                                                    top_level_only=False)
                      if hit.split(": ")[1].split(".")[0] in PYTEST_PLUGINS]
    assert not offenders, ("harness scripts must import only the standard library (put "
                           "benchmark code in scripts/bench/):\n" + "\n".join(offenders))


def test_harness_modules_import_without_site_packages():
    names = sorted(set(harness_modules()) - set(PYTEST_PLUGINS))
    code = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r})\n"
            f"for name in {names!r}:\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ImportError as e:\n"
            "        print(f'{name}: {e}')\n")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", "harness modules that need more than the standard library:\n" + \
        proc.stdout
