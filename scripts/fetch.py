#!/usr/bin/env python3
"""Fetch the PyPI sdist of a supported vLLM release into the cache and verify its hash.

  python3 scripts/fetch.py --version 0.32.0      # prints the path of the cached sdist

The sdist is found through the package index's JSON simple API (PEP 691), so no build backend
runs. The sha256 pinned in ci/matrix.toml must match: a different file is never used.
Offline: put the file at the printed cache path yourself, or set VLLM_SDIST=/path/to/sdist.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seriestool import Release, SeriesError, cache_dir, get_release, main_guard, sha256_file  # noqa: E402
from seriestool import version_from_args  # noqa: E402

DEFAULT_INDEX = "https://pypi.org/simple"


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def find_sdist_url(release: Release) -> str:
    if release.sdist_url:
        return release.sdist_url
    url = f"{index_url()}/vllm/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = json.load(resp)
    name = f"vllm-{release.version}.tar.gz"
    for f in data.get("files", []):
        if f.get("filename") == name:
            return f["url"]
    raise SeriesError(f"the package index at {url} lists no {name}.")


def _verify(path: Path, release: Release) -> None:
    got = sha256_file(path)
    if got != release.sdist_sha256:
        raise SeriesError(
            f"{path} has sha256 {got}, but ci/matrix.toml pins {release.sdist_sha256} "
            f"for vLLM {release.version}. The file is not the released sdist.",
            f"Delete {path} and run the command again to download it afresh.",
        )


def fetch_sdist(release: Release) -> Path:
    override = os.environ.get("VLLM_SDIST")
    if override:
        path = Path(override)
        if not path.exists():
            raise SeriesError(f"VLLM_SDIST={override} does not exist.")
        _verify(path, release)
        return path
    dest = cache_dir() / f"vllm-{release.version}.tar.gz"
    if dest.exists():
        _verify(dest, release)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    try:
        url = find_sdist_url(release)
        print(f"downloading {url}", file=sys.stderr)
        with urllib.request.urlopen(url, timeout=120) as resp, open(tmp, "wb") as out:
            shutil.copyfileobj(resp, out)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        tmp.unlink(missing_ok=True)
        raise SeriesError(
            f"could not download the sdist of vLLM {release.version}: {e}.",
            "Check the network or the package index (PIP_INDEX_URL). Offline, copy the file "
            f"vllm-{release.version}.tar.gz (sha256 {release.sdist_sha256}) to {dest}, or "
            "point VLLM_SDIST at it, and run the command again.",
        ) from e
    _verify(tmp, release)
    tmp.rename(dest)
    return dest


def main() -> None:
    release = get_release(version_from_args())
    print(fetch_sdist(release))


if __name__ == "__main__":
    main_guard(main)
