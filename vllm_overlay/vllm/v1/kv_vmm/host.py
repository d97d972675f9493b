# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host (Linux virtual memory) backend of the KV page table.

Real memory management, not a model of it: reservations are
``mmap(PROT_NONE)`` ranges, physical pages are extents of one ``memfd``
mapped ``MAP_FIXED | MAP_SHARED`` into the reservation, unmapping puts an
inaccessible anonymous mapping back, and released extents are hole-punched
so their memory returns to the kernel. An access to an unmapped page raises
SIGSEGV, as a kernel touching unmapped device memory faults on a GPU.

This lets the elastic KV cache run unchanged on CPU hosts and in CI.
"""

import ctypes
import errno
import mmap
import os
import resource
from collections import defaultdict

import torch

from vllm.v1.kv_vmm.backend import (
    ImportedChunk,
    VmmBackend,
    VmmError,
    VmmOutOfMemoryError,
)

_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mprotect = _libc.mprotect
_mprotect.restype = ctypes.c_int
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_fallocate = _libc.fallocate
_fallocate.restype = ctypes.c_int
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _os_error(call: str) -> VmmError:
    err = ctypes.get_errno()
    cls = VmmOutOfMemoryError if err == errno.ENOMEM else VmmError
    return cls(f"{call} failed: [errno {err}] {os.strerror(err)}")


class HostVmmBackend(VmmBackend):
    """Linux virtual-memory backend (``mmap`` + ``memfd``).

    Args:
        granularity: page size in bytes; a multiple of the OS page size.
            The default, 2 MiB, matches the CUDA granularity so the page
            arithmetic is the same on CPU and GPU.

    """

    def __init__(self, granularity: int = 2 << 20) -> None:
        os_page = mmap.PAGESIZE
        if granularity <= 0 or granularity % os_page:
            raise ValueError(
                f"granularity {granularity} must be a positive multiple of the "
                f"OS page size ({os_page} bytes)"
            )
        self.device = torch.device("cpu")
        self.granularity = granularity
        self._fd = os.memfd_create("vllm-kv-vmm", os.MFD_CLOEXEC)
        self._file_bytes = 0
        # Released extents by size, reused before the file grows.
        self._free_extents: defaultdict[int, list[int]] = defaultdict(list)
        self._allocations: dict[int, int] = {}  # offset -> nbytes
        self._reservations: dict[int, int] = {}  # va -> nbytes
        self._mapped: dict[int, int] = {}  # va -> nbytes

    def reserve(self, nbytes: int) -> int:
        self.check_aligned(nbytes, "reservation")
        # Over-reserve by one granule and trim so the base is aligned to the
        # granularity, as device reservations are.
        total = nbytes + self.granularity
        raw = _mmap(
            None,
            total,
            _PROT_NONE,
            _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
            -1,
            0,
        )
        if raw == _MAP_FAILED:
            raise _os_error(f"mmap(PROT_NONE, {total})")
        va = -(-raw // self.granularity) * self.granularity
        if va > raw:
            _munmap(raw, va - raw)
        tail = raw + total - (va + nbytes)
        if tail:
            _munmap(va + nbytes, tail)
        self._reservations[va] = nbytes
        return va

    def free_reservation(self, va: int, nbytes: int) -> None:
        if self._reservations.get(va) != nbytes:
            raise VmmError(f"no reservation of {nbytes} bytes at {va:#x}")
        if _munmap(va, nbytes) != 0:
            raise _os_error(f"munmap({va:#x}, {nbytes})")
        del self._reservations[va]

    def create(self, nbytes: int) -> int:
        if nbytes % self.granularity or nbytes <= 0:
            self.check_aligned(nbytes, "allocation")
        free = self._free_extents[nbytes]
        if free:
            offset = free.pop()
        else:
            offset = self._file_bytes
            try:
                os.ftruncate(self._fd, offset + nbytes)
            except OSError as e:
                raise VmmOutOfMemoryError(
                    f"growing the KV memfd to {offset + nbytes} bytes failed: {e}"
                ) from e
            self._file_bytes = offset + nbytes
        self._allocations[offset] = nbytes
        return offset

    def release(self, handle: object) -> None:
        assert isinstance(handle, int)
        nbytes = self._allocations.pop(handle)
        # Punch a hole so the pages go back to the kernel now, not when the
        # whole file is closed; the extent reads as zeros when reused.
        if (
            _fallocate(
                self._fd,
                _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                handle,
                nbytes,
            )
            != 0
        ):
            raise _os_error(f"fallocate(PUNCH_HOLE, {handle}, {nbytes})")
        self._free_extents[nbytes].append(handle)

    def export_chunk(self, handle: object) -> tuple[int, int]:
        """A new file descriptor of the memfd and the allocation's offset in
        it. The receiver must unmap it before the allocation is released: a
        punched hole frees the pages under its mapping too."""
        assert isinstance(handle, int)
        if handle not in self._allocations:
            raise VmmError(f"export: no allocation at {handle}")
        return os.dup(self._fd), handle

    def import_chunk(self, fd: int, offset: int, nbytes: int) -> ImportedChunk:
        """``mmap`` of another process's memfd extent, read-only, anywhere."""
        if nbytes <= 0 or offset < 0 or offset % mmap.PAGESIZE:
            raise VmmError(
                f"a shared KV chunk of {nbytes} bytes at offset {offset} is not "
                "a page-aligned extent"
            )
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            raise VmmError(f"a shared KV chunk's file descriptor: {e}") from e
        # Pages past the end of the file would fault on the first read.
        if offset + nbytes > size:
            raise VmmError(
                f"a shared KV chunk ({nbytes} bytes at offset {offset}) ends "
                f"past its file ({size} bytes)"
            )
        addr = _mmap(None, nbytes, mmap.PROT_READ, _MAP_SHARED, fd, offset)
        if addr == _MAP_FAILED:
            raise _os_error(f"mmap of a shared KV chunk ({nbytes} bytes at {offset})")
        return ImportedChunk(addr, nbytes)

    def unmap_import(self, chunk: ImportedChunk) -> None:
        if _munmap(chunk.addr, chunk.nbytes) != 0:
            raise _os_error(f"munmap({chunk.addr:#x}, {chunk.nbytes})")

    def map(self, va: int, nbytes: int, handle: object) -> None:
        assert isinstance(handle, int)
        if self._allocations.get(handle) != nbytes:
            raise VmmError(f"map: no allocation of {nbytes} bytes at {handle}")
        addr = _mmap(va, nbytes, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, self._fd, handle)
        if addr == _MAP_FAILED:
            raise _os_error(f"mmap(MAP_FIXED, {va:#x}, {nbytes})")
        self._mapped[va] = nbytes

    def unmap(self, va: int, nbytes: int) -> None:
        # Replacing the mapping (instead of munmap) keeps the addresses
        # reserved, so nothing else can be placed there in the meantime.
        addr = _mmap(
            va,
            nbytes,
            _PROT_NONE,
            _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
            -1,
            0,
        )
        if addr == _MAP_FAILED:
            raise _os_error(f"mmap(PROT_NONE, MAP_FIXED, {va:#x}, {nbytes})")
        self._mapped.pop(va, None)

    def set_access(self, va: int, nbytes: int) -> None:
        if _mprotect(va, nbytes, _PROT_RW) != 0:
            raise _os_error(f"mprotect({va:#x}, {nbytes}, READ|WRITE)")

    def memory_report(self) -> str:
        """Host memory, this backend's memfd, and the limits that make an
        allocation or a mapping fail (``RLIMIT_FSIZE`` on the memfd,
        ``RLIMIT_AS``, ``vm.max_map_count``, the cgroup's ``memory.max``)."""
        gib, mib = 1 << 30, 1 << 20
        parts = []
        meminfo = _read_kib("/proc/meminfo", ("MemAvailable", "MemTotal"))
        if len(meminfo) == 2:
            parts.append(
                f"host memory: {meminfo['MemAvailable'] / gib:.2f} GiB available "
                f"of {meminfo['MemTotal'] / gib:.2f} GiB"
            )
        limit = _read_text("/sys/fs/cgroup/memory.max")
        if limit is not None and limit != "max":
            used = _read_text("/sys/fs/cgroup/memory.current") or "?"
            parts.append(f"cgroup memory.max {limit} bytes ({used} used)")
        allocated = sum(self._allocations.values())
        parts.append(
            f"this process's KV memfd: {allocated / mib:.0f} MiB in "
            f"{len(self._allocations)} allocations"
        )
        for name in ("RLIMIT_FSIZE", "RLIMIT_AS"):
            soft, _ = resource.getrlimit(getattr(resource, name))
            if soft != resource.RLIM_INFINITY:
                parts.append(f"{name} {soft} bytes")
        max_maps = _read_text("/proc/sys/vm/max_map_count")
        maps = _read_text("/proc/self/maps")
        if max_maps is not None and maps is not None:
            parts.append(
                f"{len(maps.splitlines())} memory mappings of vm.max_map_count "
                f"{max_maps}"
            )
        return "; ".join(parts)

    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        # A ctypes array at a fixed address exports the buffer protocol
        # without reading it, so unmapped pages are not touched here.
        buf = (ctypes.c_uint8 * nbytes).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def close(self) -> None:
        for va, nbytes in list(self._mapped.items()):
            self.unmap(va, nbytes)
        for va, nbytes in list(self._reservations.items()):
            self.free_reservation(va, nbytes)
        for handle in list(self._allocations):
            self.release(handle)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """Fields of a ``/proc/meminfo``-style file, in bytes."""
    found: dict[str, int] = {}
    for line in (_read_text(path) or "").splitlines():
        key, _, value = line.partition(":")
        if key in keys and value.strip().endswith("kB"):
            found[key] = int(value.split()[0]) << 10
    return found
