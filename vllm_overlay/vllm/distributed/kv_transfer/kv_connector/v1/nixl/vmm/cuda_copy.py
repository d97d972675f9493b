# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Many ``(dst, src, nbytes)`` copies between device addresses in one kernel.

A same-host KV read copies a prompt's blocks out of a peer's memory mapped
into this process, one run per stretch of blocks adjacent on both sides.
Where the two instances' free block queues hand out blocks in different
orders, little is adjacent: a 4000-token prompt of a Llama-3.1-8B is 16,000
blocks of 32 KiB (one per layer, K and V). Enqueued as copy-engine copies
(``cuMemcpyBatchAsync``, one Python object per address) such a read held the
engine's thread for up to 74 ms on a GPU host. One kernel copies them with
the SMs instead: the runs go to the device as one small array, and a fixed
number of programs copy its pieces in turn.

Sizing, measured on two H100s over NVLink (docs/BENCHMARKS.md,
scripts/bench/bench_copy_kernel.py): with half as many programs as SMs and
8 KiB per loop iteration the kernel read the peer at 0.92-0.94 of a
copy-engine copy of the same bytes (one program per piece: 0.93-0.97), and a
GEMM loop running beside the reads took 1.15x its time alone (one program
per piece: 1.50x). The kernel therefore runs on half the SMs at most: a
decode step of the reading engine keeps the other half.
"""

import threading
from dataclasses import dataclass

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import Runs
from vllm.triton_utils import HAS_TRITON, tl, triton

# Longest piece one program copies at a time: longer rows are cut so the
# programs do about equal work. A descriptor of up to 256 KiB (a block of
# one layer) is one piece as it is: cutting a read's rows cost more host
# time than the copies gained.
PIECE_BYTES = 256 << 10
# What every address and length must be a multiple of (16-byte accesses).
ALIGNMENT = 16
_WORDS_PER_ITER = 1024  # int64 words each program moves per loop iteration
_NUM_WARPS = 8
# Upload buffers per stream, used in turn (see RunCopier._uploads_for).
_UPLOAD_SLOTS = 4


class CopyKernelUnavailable(RuntimeError):
    """The copy kernel cannot run on this host (the message says why)."""


def _kernel_errors() -> tuple[type[Exception], ...]:
    """What a kernel that cannot be built or launched here raises: Triton's
    errors (no compiler for the device, too few resources) and the
    runtime's (``RuntimeError``: no driver support)."""
    try:
        from triton.errors import TritonError
    except ImportError:
        return (RuntimeError,)
    return (RuntimeError, TritonError)


@triton.jit
def _copy_runs_kernel(base_ptr, pieces_ptr, num_pieces, WORDS_PER_ITER: tl.constexpr):
    """Copy pieces ``program_id``, ``program_id + num_programs``, ... of
    ``pieces`` (three columns of ``num_pieces`` each: dst, src and nwords,
    in int64 words relative to ``base_ptr``). Whole iterations go unmasked,
    so their loads and stores are 16 bytes wide; only a piece's last words
    are masked."""
    for piece in range(tl.program_id(0), num_pieces, tl.num_programs(0)):
        dst = tl.multiple_of(tl.load(pieces_ptr + piece), 2)
        src = tl.multiple_of(tl.load(pieces_ptr + num_pieces + piece), 2)
        nwords = tl.load(pieces_ptr + 2 * num_pieces + piece)
        whole = nwords // WORDS_PER_ITER * WORDS_PER_ITER
        for start in range(0, whole, WORDS_PER_ITER):
            offs = start + tl.arange(0, WORDS_PER_ITER)
            tl.store(base_ptr + dst + offs, tl.load(base_ptr + src + offs))
        if whole < nwords:
            offs = whole + tl.arange(0, WORDS_PER_ITER)
            mask = offs < nwords
            words = tl.load(base_ptr + src + offs, mask=mask)
            tl.store(base_ptr + dst + offs, words, mask=mask)


def _piece_counts(runs: Runs, piece_bytes: int) -> np.ndarray:
    """How many pieces of at most ``piece_bytes`` each run is cut into."""
    return np.maximum((runs.nbytes + piece_bytes - 1) // piece_bytes, 1)


def split_runs(runs: Runs, piece_bytes: int = PIECE_BYTES) -> Runs:
    """``runs`` cut into pieces of at most ``piece_bytes``."""
    counts = _piece_counts(runs, piece_bytes)
    owner = np.repeat(np.arange(len(runs)), counts.astype(np.int64))
    first = np.repeat(np.cumsum(counts) - counts, counts.astype(np.int64))
    offset = (np.arange(len(owner), dtype=np.uint64) - first) * np.uint64(piece_bytes)
    return Runs(
        runs.dst[owner] + offset,
        runs.src[owner] + offset,
        np.minimum(runs.nbytes[owner] - offset, np.uint64(piece_bytes)),
    )


def kernel_pieces(
    runs: Runs, base_addr: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The kernel's pieces of ``runs`` (at most :data:`PIECE_BYTES` each) as
    a ``(3, n)`` int64 array of dst, src (int64 words from ``base_addr``)
    and nwords; in the first ``3 * n`` words of ``out`` where given."""
    if len(runs) and int(runs.nbytes.max()) > PIECE_BYTES:
        runs = split_runs(runs)
    n = len(runs)
    if out is None:
        pieces = np.empty((3, n), dtype=np.int64)
    else:
        pieces = out[: 3 * n].reshape(3, n)
    # Every address is below 2**63: the same bits as int64.
    np.subtract(runs.dst.view(np.int64), base_addr, out=pieces[0])
    np.subtract(runs.src.view(np.int64), base_addr, out=pieces[1])
    pieces[2] = runs.nbytes.view(np.int64)
    pieces >>= 3  # every address and length is a multiple of 16 bytes
    return pieces


def num_pieces(runs: Runs) -> int:
    """How many pieces :func:`kernel_pieces` makes of ``runs``."""
    if not len(runs) or int(runs.nbytes.max()) <= PIECE_BYTES:
        return len(runs)
    return int(_piece_counts(runs, PIECE_BYTES).sum())


@dataclass
class _Uploads:
    """Where one stream's launches put their pieces: a pinned host buffer
    and a device buffer, reused (allocating and pinning host memory for
    each read cost more than the copies of a whole prompt), and the event
    after the last upload out of the host buffer."""

    host: torch.Tensor
    device: torch.Tensor
    uploaded: torch.cuda.Event


class RunCopier:
    """Launches the copy kernel on a device; every address is taken relative
    to a small tensor of ours, so one compiled kernel serves all reads."""

    def __init__(self, device: torch.device) -> None:
        if not HAS_TRITON:
            raise CopyKernelUnavailable("Triton is not available")
        self.device = device
        self._uploads: dict[int, list[_Uploads]] = {}
        self._turns: dict[int, int] = {}
        self._lock = threading.Lock()
        self._base = torch.zeros(4, dtype=torch.int64, device=device)
        self._base_addr = self._base.data_ptr()
        # Programs of one launch: half the SMs (see the module docstring).
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._max_programs = max(1, sms // 2)
        if self._base_addr % ALIGNMENT:
            raise CopyKernelUnavailable("unaligned base tensor")

    @staticmethod
    def accepts(runs: Runs) -> bool:
        """Whether every address and length of ``runs`` allows the kernel's
        16-byte accesses."""
        if not len(runs):
            return True
        bits = np.bitwise_or.reduce(runs.dst) | np.bitwise_or.reduce(runs.src)
        return not int(bits | np.bitwise_or.reduce(runs.nbytes)) % ALIGNMENT

    def launch(self, runs: Runs, stream: int) -> None:
        """Enqueue the copies of ``runs`` (:meth:`accepts` them) on the CUDA
        stream ``stream`` (a handle) of our device."""
        n = num_pieces(runs)
        if not n:
            return
        with (
            self._lock,
            torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)),
        ):
            uploads = self._uploads_for(stream, n)
            kernel_pieces(runs, self._base_addr, out=uploads.host.numpy())
            # Asynchronous out of pinned memory; the device buffer is reused
            # in the stream's order, the host one once this upload is over.
            uploads.device[: 3 * n].copy_(uploads.host[: 3 * n], non_blocking=True)
            uploads.uploaded.record()
            _copy_runs_kernel[(min(n, self._max_programs),)](
                self._base,
                uploads.device,
                n,
                WORDS_PER_ITER=_WORDS_PER_ITER,
                num_warps=_NUM_WARPS,
            )

    def _uploads_for(self, stream: int, n: int) -> _Uploads:
        """Buffers of ``stream`` for ``n`` pieces, their host buffer free to
        write. Each stream has :data:`_UPLOAD_SLOTS` of them in turn, so a
        launch waits for an upload only with that many reads queued."""
        slots = self._uploads.setdefault(stream, [])
        turn = self._turns.get(stream, 0)
        self._turns[stream] = (turn + 1) % _UPLOAD_SLOTS
        if turn < len(slots):
            slots[turn].uploaded.synchronize()
            if len(slots[turn].host) >= 3 * n:
                return slots[turn]
        words = 3 * max(1024, 1 << (n - 1).bit_length())
        uploads = _Uploads(
            host=torch.empty(words, dtype=torch.int64, pin_memory=True),
            device=torch.empty(words, dtype=torch.int64, device=self.device),
            uploaded=torch.cuda.Event(),
        )
        if turn < len(slots):
            slots[turn] = uploads
        else:
            slots.append(uploads)
        return uploads

    def warm_up(self, stream: int) -> None:
        """Compile the kernel now (the engine is starting) with a copy inside
        our own tensor, and check that it copied; raises
        :class:`CopyKernelUnavailable` if it cannot run here."""
        try:
            self._base[2:] = torch.tensor([7, 11], device=self.device)
            torch.accelerator.synchronize(self.device)
            addr = self._base_addr
            self.launch(Runs.of(np.array([[addr, addr + 16, 16]])), stream)
            torch.cuda.ExternalStream(stream, device=self.device).synchronize()
        except _kernel_errors() as e:
            raise CopyKernelUnavailable(f"{type(e).__name__}: {e}") from e
        if self._base[:2].tolist() != [7, 11]:
            raise CopyKernelUnavailable("the copy kernel did not copy")
