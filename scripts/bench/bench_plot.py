# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Timeline plot of the elasticity benchmark: mapped KV bytes and live tokens' KV bytes.

With matplotlib: a labelled plot. Without it (CI images): the same two lines drawn by a
small standard-library PNG writer, without text; mapped bytes in blue, live tokens' KV
bytes in orange, time on x, bytes on y from 0 to the peak.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

MAPPED = (31, 119, 180)
LIVE = (255, 127, 14)


def write_timeline_png(path: Path, timeline: list[list[float]], title: str = "") -> str:
    """Timeline rows: [seconds, mapped bytes, live tokens' bytes]. Returns the renderer used."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_raster(path, timeline)
        return "stdlib"
    t = [row[0] for row in timeline]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    ax.step(t, [row[1] / 2**20 for row in timeline], where="post", color="#1f77b4",
            label="mapped KV (MiB)")
    ax.step(t, [row[2] / 2**20 for row in timeline], where="post", color="#ff7f0e",
            label="live tokens' KV (MiB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def _write_raster(path: Path, timeline: list[list[float]], width: int = 800,
                  height: int = 400, margin: int = 20) -> None:
    pixels = [bytearray([255] * (3 * width)) for _ in range(height)]

    def put(x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[y][3 * x:3 * x + 3] = bytes(color)

    for x in range(margin, width - margin):  # x axis
        put(x, height - margin, (0, 0, 0))
    for y in range(margin, height - margin + 1):  # y axis
        put(margin, y, (0, 0, 0))
    if timeline:
        t_end = max(timeline[-1][0], 1e-9)
        top = max(max(row[1], row[2]) for row in timeline) or 1.0

        def xy(t: float, v: float) -> tuple[int, int]:
            return (margin + round(t / t_end * (width - 2 * margin)),
                    height - margin - round(v / top * (height - 2 * margin)))

        for col, color in ((2, LIVE), (1, MAPPED)):
            for prev, row in zip(timeline, timeline[1:]):
                (x0, y0), (x1, y1) = xy(prev[0], prev[col]), xy(row[0], prev[col])
                for x in range(x0, x1 + 1):  # horizontal run (step plot)
                    put(x, y0, color)
                    put(x, y0 - 1, color)
                _, y2 = xy(row[0], row[col])
                for y in range(min(y1, y2), max(y1, y2) + 1):  # vertical step
                    put(x1, y, color)
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
