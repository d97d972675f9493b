#!/usr/bin/env python3
"""Make build/vllm-X: the pristine sdist (tag vX), the overlay commit, then patches/vX/series.

  python3 scripts/apply.py --version 0.32.0

Re-running is a no-op; new or changed patches are applied on top of what is unchanged. A build
tree with uncommitted edits or commits not in the series is never touched (see `make refresh`).
An apply that was interrupted (SIGTERM, SIGKILL, a crash) at any point is finished by the next
one, or that one says which commands let it (see buildtree.recover_interrupted).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from buildtree import apply_series  # noqa: E402
from seriestool import get_release, main_guard, stop_on_sigterm, version_from_args  # noqa: E402


def main() -> None:
    stop_on_sigterm()
    release = get_release(version_from_args())
    print(apply_series(release))


if __name__ == "__main__":
    main_guard(main)
