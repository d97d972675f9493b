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

Sizing, measured over NVLink (docs/BENCHMARKS.md,
scripts/bench/bench_copy_kernel.py): with half as many programs as SMs and
8 KiB per loop iteration the kernel read the peer at 0.92-0.94 of a
copy-engine copy of the same bytes on two H100s (one program per piece:
0.93-0.97), and a GEMM loop running beside the reads took 1.15x its time
alone (one program per piece: 1.50x). The kernel therefore runs on half the
SMs at most: a decode step of the reading engine keeps the other half. With
16 KiB per iteration (more bytes in flight per program) whole reads on two
H200s waited 4% (random 256 KiB blocks) and 2% (a prompt's 32 KiB blocks)
less for their copies than with 8 KiB.
"""

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.copies import Runs
from vllm.logger import init_logger
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.v1.kv_vmm.backend import VmmError

logger = init_logger(__name__)

# Longest piece one program copies at a time: longer rows are cut so the
# programs do about equal work. A descriptor of up to 256 KiB (a block of
# one layer) is one piece as it is: cutting a read's rows cost more host
# time than the copies gained.
PIECE_BYTES = 256 << 10
# What every address and length must be a multiple of (16-byte accesses).
ALIGNMENT = 16
_WORDS_PER_ITER = 2048  # int64 words each program moves per loop iteration
_NUM_WARPS = 8
# Upload slots per stream and size class, used in turn (RunCopier._slot_for).
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
        return (RuntimeError, VmmError)
    return (RuntimeError, VmmError, TritonError)


@triton.jit(do_not_specialize=["capacity"])
def _copy_runs_kernel(base_ptr, pieces_ptr, capacity, WORDS_PER_ITER: tl.constexpr):
    """Copy pieces ``program_id``, ``program_id + num_programs``, ... of
    ``pieces``: its first word is their number n, then three columns of
    ``capacity`` words each (dst, src and nwords of piece i at word i of its
    column, in int64 words relative to ``base_ptr``). The number is read
    here, not passed, so that one captured launch serves reads of any size
    up to ``capacity``. Whole iterations go unmasked, so their loads and
    stores are 16 bytes wide; only a piece's last words are masked."""
    num_pieces = tl.load(pieces_ptr)
    columns = pieces_ptr + 1
    for piece in range(tl.program_id(0), num_pieces, tl.num_programs(0)):
        dst = tl.multiple_of(tl.load(columns + piece), 2)
        src = tl.multiple_of(tl.load(columns + capacity + piece), 2)
        nwords = tl.load(columns + 2 * capacity + piece)
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
    runs: Runs,
    base_addr: int,
    out: np.ndarray | None = None,
    capacity: int | None = None,
) -> np.ndarray:
    """The kernel's pieces of ``runs`` (at most :data:`PIECE_BYTES` each) as
    the int64 words it reads: their number n, then the dst, src (int64 words
    from ``base_addr``) and nwords columns, each ``capacity`` words long
    (default n; only the first n words of a column are written). In the
    first words of ``out`` where given."""
    if runs.longest > PIECE_BYTES:
        runs = split_runs(runs)
    n = len(runs)
    if capacity is None:
        capacity = n
    elif capacity < n:
        raise ValueError(f"{n} pieces do not fit columns of {capacity}")
    if out is None:
        out = np.empty(1 + 3 * capacity, dtype=np.int64)
    words = out[: 1 + 3 * capacity]
    words[0] = n
    dst = words[1 : 1 + n]
    src = words[1 + capacity : 1 + capacity + n]
    nwords = words[1 + 2 * capacity : 1 + 2 * capacity + n]
    # Every address is below 2**63: the same bits as int64. Every address
    # and length is a multiple of 16 bytes: shifted into words row by row
    # (a shift of the three rows at once is a slower strided loop).
    np.subtract(runs.dst.view(np.int64), base_addr, out=dst)
    np.right_shift(dst, 3, out=dst)
    np.subtract(runs.src.view(np.int64), base_addr, out=src)
    np.right_shift(src, 3, out=src)
    if runs.uniform_nbytes is not None:
        nwords.fill(runs.uniform_nbytes >> 3)
    else:
        np.right_shift(runs.nbytes.view(np.int64), 3, out=nwords)
    return words


def num_pieces(runs: Runs) -> int:
    """How many pieces :func:`kernel_pieces` makes of ``runs``."""
    if runs.longest <= PIECE_BYTES:
        return len(runs)
    return int(_piece_counts(runs, PIECE_BYTES).sum())


@dataclass
class _Slot:
    """Where a launch puts its pieces: a pinned host buffer and a device
    buffer of :func:`kernel_pieces`'s words for up to ``capacity`` pieces,
    reused (allocating and pinning host memory for each read cost more than
    the copies of a whole prompt), and an event after the last launch that
    read the host buffer. ``graph`` is the launch captured as a CUDA graph
    (the upload of the whole buffer and the kernel), once captured."""

    capacity: int
    host: torch.Tensor
    device: torch.Tensor
    used: Any
    graph: Any = None

    def __post_init__(self) -> None:
        self.words = self.host.numpy()


def _capacity(n: int) -> int:
    """The size class of a slot for ``n`` pieces: a power of two, at least
    1024 (a slot is at most twice as large as a read needs)."""
    return max(1024, 1 << (n - 1).bit_length())


class RunCopier:
    """Launches the copy kernel on a device; every address is taken relative
    to a small tensor of ours, so one compiled kernel serves all reads.

    A launch through Triton costs the engine's thread more than a read of a
    few hundred blocks takes on the device (a stream context, Triton's
    argument handling, an upload and an event through PyTorch). So each
    upload slot's launch (upload of the slot's whole buffer, then the kernel
    on a fixed number of programs, which read the number of pieces from the
    buffer) is captured once as a CUDA graph, and a read writes its pieces
    into the slot's pinned buffer and launches the graph with one driver
    call. Where a capture fails, launches go through Triton from then on.
    """

    def __init__(self, device: torch.device, graphs: bool = True) -> None:
        if not HAS_TRITON:
            raise CopyKernelUnavailable("Triton is not available")
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise CopyKernelUnavailable(f"no CUDA driver bindings ({e})") from e
        self._drv = driver
        self.device = device
        self.graphs = graphs
        # Upload slots per (stream, size class), used in turn.
        self._slots: dict[tuple[int, int], list[_Slot]] = {}
        self._turns: dict[tuple[int, int], int] = {}
        self._streams: dict[int, torch.cuda.ExternalStream] = {}
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
        16-byte accesses (known without looking at them where their maker
        knows an alignment of 16 bytes or more)."""
        if not len(runs) or runs.alignment >= ALIGNMENT:
            return True
        bits = np.bitwise_or.reduce(runs.dst) | np.bitwise_or.reduce(runs.src)
        if runs.uniform_nbytes is not None:
            return not int(bits | runs.uniform_nbytes) % ALIGNMENT
        return not int(bits | np.bitwise_or.reduce(runs.nbytes)) % ALIGNMENT

    def _check(self, result: tuple, call: str) -> Any:
        err = result[0]
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise VmmError(f"{call} failed on {self.device}: {err!r}")
        return result[1] if len(result) == 2 else None

    def launch(self, runs: Runs, stream: int) -> None:
        """Enqueue the copies of ``runs`` (:meth:`accepts` them) on the CUDA
        stream ``stream`` (a handle) of our device."""
        n = num_pieces(runs)
        if not n:
            return
        drv = self._drv
        with self._lock:
            slot = self._slot_for(stream, n)
            if self.graphs and slot.graph is None:
                slot.graph = self._capture(slot, stream)
            if slot.graph is not None:
                kernel_pieces(runs, self._base_addr, slot.words, slot.capacity)
                self._check(drv.cuGraphLaunch(slot.graph, stream), "cuGraphLaunch")
            else:
                # Columns of n words: only they are uploaded.
                kernel_pieces(runs, self._base_addr, slot.words)
                self._enqueue(slot, stream, programs=n, capacity=n)
            self._check(drv.cuEventRecord(slot.used, stream), "cuEventRecord")

    def _enqueue(self, slot: _Slot, stream: int, programs: int, capacity: int) -> None:
        """The upload of ``slot``'s words for columns of ``capacity`` and the
        kernel on ``min(programs, half the SMs)`` programs, on ``stream``."""
        self._check(
            self._drv.cuMemcpyHtoDAsync(
                slot.device.data_ptr(),
                slot.host.data_ptr(),
                8 * (1 + 3 * capacity),
                stream,
            ),
            "cuMemcpyHtoDAsync",
        )
        external = self._streams.get(stream)
        if external is None:
            external = torch.cuda.ExternalStream(stream, device=self.device)
            self._streams[stream] = external
        with torch.cuda.stream(external):
            _copy_runs_kernel[(min(programs, self._max_programs),)](
                self._base,
                slot.device,
                capacity,
                WORDS_PER_ITER=_WORDS_PER_ITER,
                num_warps=_NUM_WARPS,
            )

    def _capture(self, slot: _Slot, stream: int) -> Any:
        """``slot``'s launch on ``stream`` as an instantiated CUDA graph, or
        None (and no graphs from now on) where it cannot be captured. The
        capture is this thread's alone (other threads may use the device
        meanwhile); the kernel was compiled by :meth:`warm_up`."""
        drv = self._drv
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        graph = None
        try:
            self._check(drv.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
            try:
                self._enqueue(slot, stream, self._max_programs, slot.capacity)
            finally:
                graph = self._check(
                    drv.cuStreamEndCapture(stream), "cuStreamEndCapture"
                )
            return self._check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        except _kernel_errors() as e:
            logger.info(
                "Same-host KV reads launch the copy kernel without CUDA graphs "
                "(capture failed: %s)",
                e,
            )
            self.graphs = False
            return None
        finally:
            if graph is not None:
                drv.cuGraphDestroy(graph)

    def _slot_for(self, stream: int, n: int) -> _Slot:
        """A slot of ``stream`` for ``n`` pieces, its host buffer free to
        write. Each stream has :data:`_UPLOAD_SLOTS` slots per size class in
        turn, so a launch waits for an earlier one only with that many
        reads of its size queued."""
        key = (stream, _capacity(n))
        slots = self._slots.setdefault(key, [])
        turn = self._turns.get(key, 0)
        self._turns[key] = (turn + 1) % _UPLOAD_SLOTS
        if turn < len(slots):
            slot = slots[turn]
            self._check(self._drv.cuEventSynchronize(slot.used), "cuEventSynchronize")
            return slot
        words = 1 + 3 * key[1]
        event = self._check(
            self._drv.cuEventCreate(self._drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
            "cuEventCreate",
        )
        slot = _Slot(
            capacity=key[1],
            host=torch.empty(words, dtype=torch.int64, pin_memory=True),
            device=torch.empty(words, dtype=torch.int64, device=self.device),
            used=event,
        )
        slots.append(slot)
        return slot

    def warm_up(self, stream: int) -> None:
        """Compile the kernel now (the engine is starting) and check with a
        copy inside our own tensor that it copies, launched through Triton
        and then through a captured graph; raises
        :class:`CopyKernelUnavailable` if the kernel cannot run here (a
        captured launch that fails only turns graphs off)."""
        graphs, self.graphs = self.graphs, False
        try:
            if not self._copies(stream, [7, 11]):
                raise CopyKernelUnavailable("the copy kernel did not copy")
            self.graphs = graphs
            if graphs and not self._copies(stream, [13, 17]):
                logger.info(
                    "Same-host KV reads launch the copy kernel without CUDA "
                    "graphs (a captured launch did not copy)"
                )
                self.graphs = False
            # The first reads launch without a capture of their own.
            with self._lock:
                for _ in range(_UPLOAD_SLOTS if self.graphs else 0):
                    slot = self._slot_for(stream, 1)
                    if slot.graph is None:
                        slot.graph = self._capture(slot, stream)
        except _kernel_errors() as e:
            raise CopyKernelUnavailable(f"{type(e).__name__}: {e}") from e

    def _copies(self, stream: int, words: list[int]) -> bool:
        """Whether a launch copies ``words`` from one end of our tensor to
        the other."""
        self._base[2:] = torch.tensor(words, device=self.device)
        torch.accelerator.synchronize(self.device)
        addr = self._base_addr
        self.launch(Runs.of(np.array([[addr, addr + 16, 16]])), stream)
        self._check(self._drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return self._base[:2].tolist() == words

    def close(self) -> None:
        """Wait for the launches queued and destroy the slots' graphs and
        events."""
        with self._lock:
            for slots in self._slots.values():
                for slot in slots:
                    self._drv.cuEventSynchronize(slot.used)
                    if slot.graph is not None:
                        self._drv.cuGraphExecDestroy(slot.graph)
                    self._drv.cuEventDestroy(slot.used)
            self._slots.clear()
