# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The copies of same-host reads: ``(dst, src, nbytes)`` runs from a
producer's chunks mapped into this process into our KV memory.

- Host memory (:class:`HostCopier`): a background thread copies the runs
  with ``process_vm_readv`` on this very process, up to 1024 runs per system
  call, so it gives the GIL up once per call instead of once per run; where
  a seccomp profile refuses the call, ``memmove`` per run.
- Device memory (:class:`DeviceCopier`): the copies are enqueued on the
  caller's thread on a stream of the reader's device (the VMM backend's
  :meth:`~vllm.v1.kv_vmm.backend.VmmBackend.copy_stream`), as one Triton
  kernel launch (:mod:`.cuda_copy`) or, where that cannot run (no Triton, or
  an address or length that is not a multiple of 16 bytes), one batched
  copy-engine call; an event recorded after them is polled, like a NIXL
  transfer: no thread of ours waits on the device.

Either way a read's copies are a :class:`CopyJob` its transfer polls.
"""

import ctypes
import dataclasses
import errno
import os
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from vllm.logger import init_logger
from vllm.v1.kv_vmm.backend import DeviceCopyStream, VmmBackend, VmmError

logger = init_logger(__name__)

# iovecs per process_vm_readv call (the kernel's UIO_MAXIOV).
_IOV_MAX = 1024


def coalesce(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``(dst, src, n)`` copy runs: rows adjacent on both sides to the row
    before them merged (for copiers that pay per run: a system call's
    iovec, a copy-engine copy).

    Rows are merged in the read's order, without sorting: NixlConnector
    lists a read's descriptors region by region, blocks in the request's
    order, so blocks the two instances hold in the same order are neighbours
    already; sorting a prompt's 16,000 rows took longer than copying them.
    """
    n = len(dst)
    if n == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    new_run = np.empty(n, dtype=bool)
    new_run[0] = True
    np.not_equal(dst[1:], dst[:-1] + lengths[:-1], out=new_run[1:])
    new_run[1:] |= src[1:] != src[:-1] + lengths[:-1]
    starts = np.flatnonzero(new_run)
    runs = np.empty((len(starts), 3), dtype=np.uint64)
    runs[:, 0] = dst[starts]
    runs[:, 1] = src[starts]
    runs[:, 2] = np.add.reduceat(lengths, starts)
    return runs


def _column(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.uint64).reshape(-1)


# Length -> a read-only column of it, as long as the longest asked for.
_REPEATED: dict[int, np.ndarray] = {}


def repeated(nbytes: int, n: int) -> np.ndarray:
    """A read-only uint64 column of ``n`` times ``nbytes``: the lengths of a
    read whose descriptors all have the same, without filling a new array
    per read."""
    column = _REPEATED.get(nbytes)
    if column is None or len(column) < n:
        column = np.full(max(n, 1024), nbytes, dtype=np.uint64)
        column.flags.writeable = False
        _REPEATED[nbytes] = column
    return column[:n]


@dataclasses.dataclass(frozen=True)
class Runs:
    """A read's copies as three columns (uint64, contiguous): ``nbytes[i]``
    bytes from address ``src[i]`` to ``dst[i]``. Columns, not rows: the
    copy kernel takes them as they are, and a prompt's 16,000 copies are
    made by taking a column of each descriptor list.

    What the maker knows of them besides, so that a launch need not reduce
    a column again per read (each reduction of a prompt's columns costs
    microseconds of the reader's thread): ``uniform_nbytes``, the length
    every run has (None: see ``nbytes``), and ``alignment``, a power of two
    every address and length is a multiple of (0: not known)."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray
    uniform_nbytes: int | None = None
    alignment: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst", _column(self.dst))
        object.__setattr__(self, "src", _column(self.src))
        object.__setattr__(self, "nbytes", _column(self.nbytes))
        if not len(self.dst) == len(self.src) == len(self.nbytes):
            raise ValueError("copy runs: columns of different lengths")

    @staticmethod
    def of(rows: np.ndarray) -> "Runs":
        """Runs of ``(dst, src, nbytes)`` rows."""
        rows = np.asarray(rows, dtype=np.uint64).reshape(-1, 3)
        return Runs(rows[:, 0], rows[:, 1], rows[:, 2])

    def __len__(self) -> int:
        return len(self.dst)

    @property
    def total_bytes(self) -> int:
        if self.uniform_nbytes is not None:
            return self.uniform_nbytes * len(self.dst)
        return int(self.nbytes.sum())

    @property
    def longest(self) -> int:
        """The bytes of the longest run (0 for none)."""
        if not len(self.nbytes):
            return 0
        if self.uniform_nbytes is not None:
            return self.uniform_nbytes
        return int(self.nbytes.max())

    def coalesced(self) -> np.ndarray:
        """``(dst, src, n)`` rows, adjacent copies merged (:func:`coalesce`)."""
        return coalesce(self.dst, self.src, self.nbytes)


class CopyJob(ABC):
    """The copies of one read, started."""

    @abstractmethod
    def done(self) -> bool:
        """Whether they are over; raises :class:`VmmError` if they failed."""

    @abstractmethod
    def wait(self) -> None:
        """Block until they are over; raises :class:`VmmError` if they failed."""

    def free(self) -> None:  # noqa: B027 - optional hook
        """Give back what tracked them (once over)."""


class Copier(ABC):
    """Starts the copies of reads into one kind of memory."""

    @abstractmethod
    def submit(self, runs: Runs) -> CopyJob:
        """Start copying ``runs`` (one per descriptor of the read); raises
        :class:`VmmError` if they cannot be started."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop; copies started before finish first."""


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _process_vm_readv() -> Any:
    """The C library's ``process_vm_readv``, or None where it has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (AttributeError, OSError):
        return None
    iov, count = ctypes.POINTER(_IoVec), ctypes.c_ulong
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, iov, count, iov, count, ctypes.c_ulong]
    return fn


class _FutureJob(CopyJob):
    def __init__(self, future: "Future[None]") -> None:
        self._future = future

    def done(self) -> bool:
        if not self._future.done():
            return False
        self._future.result()
        return True

    def wait(self) -> None:
        self._future.result()


class HostCopier(Copier):
    """Copies into host memory on a thread of its own (one at a time, in
    order); :meth:`copy` is one read's copies, on that thread. One memmove
    per run gave the GIL up and waited for it again at every run while the
    engine's thread ran Python; ``process_vm_readv`` takes up to 1024 runs
    per call."""

    def __init__(self) -> None:
        self._readv = _process_vm_readv()
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, runs: Runs) -> CopyJob:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kv-vmm-same-host-copy"
            )
        return _FutureJob(self._executor.submit(self.copy, runs))

    def copy(self, runs: Runs) -> None:
        """Copy ``runs`` now."""
        rows = runs.coalesced()
        if self._readv is not None and self._copy_readv(rows):
            return
        for dst, src, n in rows.tolist():
            ctypes.memmove(dst, src, n)

    def _copy_readv(self, runs: np.ndarray) -> bool:
        """False (nothing copied, memmove from now on) if the kernel refuses
        the call; raises if a copy failed part-way."""
        pid = os.getpid()
        iov = ctypes.POINTER(_IoVec)
        runs = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
        for start in range(0, len(runs), _IOV_MAX):
            batch = runs[start : start + _IOV_MAX]
            # struct iovec {void *base; size_t len;}: two 64-bit words.
            local = np.ascontiguousarray(batch[:, [0, 2]])
            remote = np.ascontiguousarray(batch[:, [1, 2]])
            total = int(batch[:, 2].sum())
            n = len(batch)
            got = self._readv(
                pid, local.ctypes.data_as(iov), n, remote.ctypes.data_as(iov), n, 0
            )
            if got == -1 and start == 0:
                err = ctypes.get_errno()
                if err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                    logger.info(
                        "Same-host KV copies use memmove (process_vm_readv: %s)",
                        os.strerror(err),
                    )
                    self._readv = None
                    return False
            if got != total:
                why = os.strerror(ctypes.get_errno()) if got == -1 else f"{got} bytes"
                raise VmmError(
                    f"same-host KV copy of {total} bytes failed part-way "
                    f"(process_vm_readv: {why})"
                )
        return True

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class _EventJob(CopyJob):
    def __init__(self, stream: DeviceCopyStream, event: object) -> None:
        self._stream = stream
        self._event = event

    def done(self) -> bool:
        return self._stream.query(self._event)

    def wait(self) -> None:
        self._stream.wait(self._event)

    def free(self) -> None:
        self._stream.free(self._event)


class DeviceCopier(Copier):
    """Enqueues a read's copies on ``stream``, with the copy kernel where
    ``kernel`` (a :class:`~.cuda_copy.RunCopier`) accepts the runs, else as
    copy-engine copies. A thread issuing one driver call per copy would give
    the GIL up and wait for it again at every call, up to the interpreter's
    switch interval (5 ms) each while the engine's thread runs Python."""

    def __init__(self, stream: DeviceCopyStream, kernel: Any = None) -> None:
        self.stream = stream
        self.kernel = kernel

    def submit(self, runs: Runs) -> CopyJob:
        if self.kernel is not None and self.kernel.accepts(runs):
            # Runs as they are: the kernel cuts work into pieces anyway.
            self.kernel.launch(runs, self.stream.handle)
        else:
            self.stream.copy(runs.coalesced())
        return _EventJob(self.stream, self.stream.record())

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.close()


def copier_for(
    backend: VmmBackend, copy_kernel: bool = True, graphs: bool = True
) -> Copier:
    """How a reader whose KV memory is ``backend``'s copies: on the device
    where the backend has a copy stream, else on the host. ``copy_kernel``
    False keeps device copies to the copy engines, ``graphs`` False launches
    the copy kernel through Triton at every read (both to compare)."""
    stream = backend.copy_stream()
    if stream is None:
        return HostCopier()
    if not copy_kernel:
        return DeviceCopier(stream)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.vmm.cuda_copy import (
        CopyKernelUnavailable,
        RunCopier,
    )

    try:
        kernel = RunCopier(backend.device, graphs=graphs)
        kernel.warm_up(stream.handle)
    except CopyKernelUnavailable as e:
        logger.info(
            "Same-host KV reads copy with the copy engines: the copy kernel "
            "cannot run here (%s)",
            e,
        )
        return DeviceCopier(stream)
    return DeviceCopier(stream, kernel)
