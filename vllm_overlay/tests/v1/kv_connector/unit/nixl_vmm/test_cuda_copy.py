# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The copy kernel of same-host KV reads (nixl/vmm/cuda_copy.py).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, a
subprocess: the variable is read when Triton is imported), which executes
its loads and stores at the real addresses of CPU tensors; on a GPU host
test_copies.py runs it on the device.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import (
    Runs,
    repeated,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.cuda_copy import (
    PIECE_BYTES,
    RunCopier,
    kernel_pieces,
    split_runs,
)


def test_split_runs_cuts_long_runs_into_pieces_that_cover_them():
    runs = np.array(
        [[1 << 20, 8 << 20, 32 << 10], [4 << 20, 16 << 20, 2 * PIECE_BYTES + 48]],
        dtype=np.uint64,
    )
    pieces = split_runs(Runs.of(runs))
    assert np.stack([pieces.dst, pieces.src, pieces.nbytes], axis=1).tolist() == [
        [1 << 20, 8 << 20, 32 << 10],
        [4 << 20, 16 << 20, PIECE_BYTES],
        [(4 << 20) + PIECE_BYTES, (16 << 20) + PIECE_BYTES, PIECE_BYTES],
        [(4 << 20) + 2 * PIECE_BYTES, (16 << 20) + 2 * PIECE_BYTES, 48],
    ]
    assert len(split_runs(Runs.of(np.zeros((0, 3))))) == 0


def test_only_runs_of_16_byte_multiples_go_to_the_kernel():
    assert RunCopier.accepts(Runs.of(np.array([[1 << 20, 2 << 20, 4096]])))
    assert not RunCopier.accepts(Runs.of(np.array([[1 << 20, 2 << 20, 40]])))
    assert not RunCopier.accepts(Runs.of(np.array([[(1 << 20) + 8, 0, 16]])))
    assert not RunCopier.accepts(Runs.of(np.array([[1 << 20, (2 << 20) + 8, 16]])))


def test_what_the_maker_knows_of_runs_spares_looking_at_them():
    """A read's lengths all equal and its alignment known (a same-host read
    knows both per descriptor list): the kernel's words are the same as
    from the columns, and no column is reduced to accept them."""
    rng = np.random.default_rng(0)
    dst = (rng.choice(4096, 600, replace=False) * 4096 + (1 << 30)).astype(np.uint64)
    src = (rng.choice(4096, 600, replace=False) * 4096 + (1 << 32)).astype(np.uint64)
    for nbytes in (4096, PIECE_BYTES, PIECE_BYTES + 4096):
        column = np.full(600, nbytes, dtype=np.uint64)
        known = Runs(dst, src, repeated(nbytes, 600), uniform_nbytes=nbytes)
        assert known.total_bytes == Runs(dst, src, column).total_bytes
        assert known.longest == nbytes
        for capacity in (None, 2048):
            out = np.full(1 + 3 * 2048, -1, dtype=np.int64)
            want = kernel_pieces(Runs(dst, src, column), 1 << 20, out.copy(), capacity)
            got = kernel_pieces(known, 1 << 20, out, capacity)
            assert got.tolist() == want.tolist()
    assert Runs(dst[:0], src[:0], repeated(4096, 0), uniform_nbytes=4096).longest == 0
    # Vouched for: not looked at (these addresses would be refused).
    odd = Runs.of(np.array([[(1 << 20) + 8, 0, 16]]))
    assert not RunCopier.accepts(odd)
    assert RunCopier.accepts(Runs(odd.dst, odd.src, odd.nbytes, alignment=16))
    assert not RunCopier.accepts(Runs(odd.dst, odd.src, odd.nbytes, alignment=8))
    assert not RunCopier.accepts(
        Runs(dst, src, repeated(40, 600), uniform_nbytes=40, alignment=8)
    )


def test_repeated_lengths_are_one_read_only_column():
    first = repeated(32 << 10, 100)
    assert first.tolist() == [32 << 10] * 100 and first.dtype == np.uint64
    assert not first.flags.writeable
    assert repeated(32 << 10, 5000).tolist() == [32 << 10] * 5000
    assert repeated(32 << 10, 0).tolist() == []
    assert repeated(48, 3).tolist() == [48] * 3


def test_kernel_copies_every_run_and_nothing_else():
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import numpy as np, torch, triton, triton.language as tl
        import vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.cuda_copy as cc
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import Runs

        # Without a GPU vllm.triton_utils hands out placeholders: the module
        # keeps the kernel's Python function, which the interpreter runs.
        cc.tl = tl

        # Some Triton releases' interpreters cannot take a loop bound loaded
        # from memory under NumPy >= 2.4 (``int()`` of a 1-element array);
        # that is the interpreter's limit, not the kernel's.
        @triton.jit
        def loaded_bound(n_ptr, out_ptr):
            for i in range(0, tl.load(n_ptr), 1):
                tl.store(out_ptr + i, i)

        try:
            loaded_bound[(1,)](torch.full((1,), 2), torch.zeros(2, dtype=torch.int64))
        except Exception as e:
            print("SKIP", f"Triton {triton.__version__} with NumPy "
                  f"{np.__version__} cannot interpret a loaded loop bound: {e}")
            raise SystemExit(0)
        kernel = triton.jit(getattr(cc._copy_runs_kernel, "fn", cc._copy_runs_kernel))
        src = torch.arange(1 << 18, dtype=torch.int64)
        dst = torch.full((1 << 18,), -1, dtype=torch.int64)
        base = torch.zeros(4, dtype=torch.int64)
        s, d = src.data_ptr(), dst.data_ptr()
        # Blocks of 4 KiB in another order on each side, one run longer than
        # a piece, runs next to each other, and runs with a masked tail after
        # whole iterations or only one.
        runs = np.array([[d, s + 65536, 4096], [d + 4096, s, 4096],
                         [d + 8192, s + 8192, 2 * cc.PIECE_BYTES + 512],
                         [d + 600000, s + 600000, 4096 + 48],
                         [d + 700000, s + 800000, 16]], dtype=np.uint64)
        # Columns longer than the pieces (a slot of a larger read's size).
        pieces = torch.from_numpy(
            cc.kernel_pieces(Runs.of(runs), base.data_ptr(), capacity=16))
        n = int(pieces[0])
        # Fewer programs than pieces: each copies several, in turn.
        kernel[(2,)](base, pieces, 16, WORDS_PER_ITER=512)
        want = torch.full_like(dst, -1)
        for r in runs.tolist():
            want[r[0] - d >> 3 : r[0] - d + r[2] >> 3] = src[
                r[1] - s >> 3 : r[1] - s + r[2] >> 3]
        assert torch.equal(dst, want), (dst != want).nonzero()[:5]
        assert int((dst >= 0).sum()) == int(runs[:, 2].sum()) // 8
        print("copied", n, "pieces")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The child's own lines (vLLM may log before them).
    skips = [ln for ln in done.stdout.splitlines() if ln.startswith("SKIP ")]
    if skips:
        pytest.skip(skips[0][5:].strip())
    assert "copied 7 pieces" in done.stdout


def test_kernel_pieces_of_short_runs_need_no_cut():
    """Runs no longer than a piece (a prompt's blocks) are the kernel's rows
    as they are, in words from the base."""
    runs = Runs.of(np.array([[4096, 8192, 32], [1024, 2048, PIECE_BYTES]]))
    pieces = kernel_pieces(runs, 1024)
    # The number of pieces, then the columns dst, src, nwords.
    assert pieces.tolist() == [2, 384, 0, 896, 128, 4, PIECE_BYTES // 8]
    long = Runs.of(np.array([[1024, 2048, PIECE_BYTES + 16]]))
    assert kernel_pieces(long, 1024)[0] == 2
    # Into a buffer's first words, as a launch uploads them.
    out = np.full(12, -1, dtype=np.int64)
    kernel_pieces(runs, 1024, out=out)
    assert out.tolist() == [2, 384, 0, 896, 128, 4, PIECE_BYTES // 8] + [-1] * 5
    # Columns of a slot's capacity: a captured launch reads them at fixed
    # places, whatever the read's size.
    out = np.full(12, -1, dtype=np.int64)
    kernel_pieces(runs, 1024, out=out, capacity=3)
    assert out[:10].tolist() == [2, 384, 0, -1, 896, 128, -1, 4, PIECE_BYTES // 8, -1]
    assert out[10:].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="do not fit"):
        kernel_pieces(runs, 1024, capacity=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "triton"])
def test_queued_launches_keep_their_own_pieces(graphs: bool):
    """Reads queued on one stream, more than the copier has upload slots of
    their size and of growing and shrinking sizes, each copy exactly their
    runs (a slot reused before its upload ran would copy another read's
    runs; a captured launch that read a size fixed at capture would copy
    too many or too few), launched through captured graphs or Triton."""
    device = torch.device("cuda:0")
    copier = RunCopier(device, graphs=graphs)
    stream = torch.cuda.Stream(device)
    copier.warm_up(stream.cuda_stream)
    block = 256
    src = torch.arange(1 << 20, dtype=torch.int64, device=device)
    nblocks = src.numel() * 8 // block
    rng = np.random.default_rng(0)
    reads = []
    with torch.cuda.stream(stream):
        # Work ahead of the reads, so they queue behind it.
        torch.cuda._sleep(10_000_000)
        for k in (3, 2000, 5, 3000, 7, 1, 4000, 9, 2500, 11, 1024, 1025, 13):
            ids = rng.choice(nblocks, k, replace=False)
            dst = torch.full_like(src, -1)
            runs = Runs(
                dst.data_ptr() + ids * block,
                src.data_ptr() + ids * block,
                np.full(k, block),
            )
            copier.launch(runs, stream.cuda_stream)
            reads.append((ids, dst))
    stream.synchronize()
    # No capture failed (it would have turned graphs off).
    assert copier.graphs is graphs
    captured = [slot.graph is not None for v in copier._slots.values() for slot in v]
    assert any(captured) if graphs else not any(captured)
    words = block // 8
    for ids, dst in reads:
        want = torch.full_like(src, -1).view(-1, words)
        index = torch.from_numpy(ids).to(device)
        want[index] = src.view(-1, words)[index]
        assert torch.equal(dst.view(-1, words), want)
    copier.close()
