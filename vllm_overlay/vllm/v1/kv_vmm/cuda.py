# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CUDA driver backend of the KV page table (``cuMemAddressReserve``,
``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``,
``cuMemRelease``) through cuda-python's ``cuda.bindings.driver``.

Allocations are flagged GPUDirect-RDMA capable and exportable as a POSIX
file descriptor where the device supports it, so NIXL/UCX can register and
share them; another process maps one with ``cuMemImportFromShareableHandle``
into a reservation of its own (``import_chunk``). Tensors over a reservation
are built through DLPack with an explicit device, because nothing is mapped
yet when they are built and a pointer query on unmapped addresses would
fail. ``copy_stream`` enqueues device copies on a stream of the backend's
own and completes them through events.
"""

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from vllm.v1.kv_vmm.backend import (
    DeviceCopyStream,
    ImportedChunk,
    VmmBackend,
    VmmError,
    VmmOutOfMemoryError,
)

if TYPE_CHECKING:
    import numpy as np


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError(
            "The CUDA KV page backend needs cuda-python's driver bindings: "
            "install the `cuda-bindings` package matching your CUDA major "
            "version (it ships with PyTorch's CUDA wheels)."
        ) from e
    return driver


class CudaVmmBackend(VmmBackend):
    """CUDA virtual-memory-management backend for one device.

    Use it from threads where the device's primary context is current (any
    thread that ran CUDA work through PyTorch on that device, or the one that
    built the backend).
    """

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        drv = _driver()
        self._drv = drv
        if device is None:
            device = torch.accelerator.current_device_index()
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CudaVmmBackend needs a CUDA device, got {dev}")
        index = dev.index if dev.index is not None else 0
        self.device = torch.device("cuda", index)
        self._check(drv.cuInit(0), "cuInit")
        cu_device = self._check(drv.cuDeviceGet(index), "cuDeviceGet")
        # Why driver calls from Python work here, while the cumem allocator
        # (vllm/device_allocator/cumem.py) found cuda-python and ctypes
        # wrappers failing on a "cuda context mismatch" and went to C:
        #
        # - No new context: PyTorch, through the CUDA runtime, runs all work
        #   of a device in the device's primary context, and
        #   cuDevicePrimaryCtxRetain returns that same context (there is one
        #   per device and process); nothing here calls cuCtxCreate. The
        #   reference it takes keeps the context alive until close(), even
        #   if every other user releases it, so the mappings never outlive
        #   the context they were made in.
        # - A context only where there is none: a thread with no current
        #   context (cuCtxGetCurrent is NULL) gets the primary one made
        #   current, exactly what cumem_allocator.cpp's ensure_context()
        #   does before each of its calls; a thread that already has a
        #   context (a thread that ran PyTorch work on this device, where it
        #   is the primary one) is left alone, so PyTorch never finds its
        #   thread switched to another context.
        # - Nothing context-bound is made: the reservation is in the
        #   process's unified address space, the physical allocations are
        #   placed by device ordinal (CUmemAllocationProp.location) and
        #   access is granted per device (cuMemSetAccess), so the mapped
        #   range is readable and writable from any context on this device,
        #   PyTorch's included. The tensors are built over the address with
        #   an explicit device (DLPack), not from a pointer query, which
        #   would ask the current context about the address.
        #
        # Later calls (map, unmap, set_access) come from the worker's thread,
        # which runs PyTorch on this device, or from its page-map thread
        # (bind_thread, the same rule as here); they make nothing
        # context-bound either, and a driver error is raised as a VmmError
        # naming the call.
        self._primary_ctx = self._check(
            drv.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain"
        )
        self.bind_thread()
        self._cu_device = cu_device

        attr = drv.CUdevice_attribute
        self.rdma_capable = bool(
            self._check(
                drv.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                    cu_device,
                ),
                "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)",
            )
        )
        self.fd_exportable = bool(
            self._check(
                drv.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                    cu_device,
                ),
                "cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)",
            )
        )
        self._prop = self._allocation_prop(index)
        self.granularity = int(
            self._check(
                drv.cuMemGetAllocationGranularity(
                    self._prop,
                    drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]
        self._reservations: dict[int, int] = {}
        self._allocations: dict[int, Any] = {}  # id(handle) -> handle
        self._mapped: dict[int, int] = {}

    def _allocation_prop(self, index: int) -> Any:
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        if self.fd_exportable:
            prop.requestedHandleTypes = (
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
        if self.rdma_capable:
            prop.allocFlags.gpuDirectRDMACapable = 1
        return prop

    def _check(self, result: tuple, call: str) -> Any:
        drv = self._drv
        err = result[0]
        if err != drv.CUresult.CUDA_SUCCESS:
            _, name = drv.cuGetErrorName(err)
            name = name.decode() if isinstance(name, bytes) else str(err)
            cls = (
                VmmOutOfMemoryError
                if err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
                else VmmError
            )
            raise cls(f"{call} failed on {self.device}: {name}")
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def reserve(self, nbytes: int) -> int:
        self.check_aligned(nbytes, "reservation")
        ptr = self._check(
            self._drv.cuMemAddressReserve(nbytes, self.granularity, 0, 0),
            f"cuMemAddressReserve({nbytes})",
        )
        va = int(ptr)
        self._reservations[va] = nbytes
        return va

    def free_reservation(self, va: int, nbytes: int) -> None:
        if self._reservations.get(va) != nbytes:
            raise VmmError(f"no reservation of {nbytes} bytes at {va:#x}")
        self._check(self._drv.cuMemAddressFree(va, nbytes), "cuMemAddressFree")
        del self._reservations[va]

    def create(self, nbytes: int) -> Any:
        self.check_aligned(nbytes, "allocation")
        handle = self._check(
            self._drv.cuMemCreate(nbytes, self._prop, 0), f"cuMemCreate({nbytes})"
        )
        self._allocations[id(handle)] = handle
        return handle

    def release(self, handle: object) -> None:
        self._check(self._drv.cuMemRelease(handle), "cuMemRelease")
        del self._allocations[id(handle)]

    def map(self, va: int, nbytes: int, handle: object) -> None:
        self._check(
            self._drv.cuMemMap(va, nbytes, 0, handle, 0), f"cuMemMap({va:#x}, {nbytes})"
        )
        self._mapped[va] = nbytes

    def unmap(self, va: int, nbytes: int) -> None:
        self._check(self._drv.cuMemUnmap(va, nbytes), f"cuMemUnmap({va:#x}, {nbytes})")
        self._mapped.pop(va, None)

    def set_access(self, va: int, nbytes: int) -> None:
        self._check(
            self._drv.cuMemSetAccess(va, nbytes, self._access, 1),
            f"cuMemSetAccess({va:#x}, {nbytes})",
        )

    def bind_thread(self) -> None:
        """A thread with no current context gets the primary one (a thread
        that has one keeps it; see __init__)."""
        drv = self._drv
        if int(self._check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
            self._check(drv.cuCtxSetCurrent(self._primary_ctx), "cuCtxSetCurrent")

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.device)

    def memory_report(self) -> str:
        try:
            self.bind_thread()
            free, total = self._check(self._drv.cuMemGetInfo(), "cuMemGetInfo")
        except VmmError as e:
            return f"{self.device}: free memory unknown ({e})"
        gib = 1 << 30
        return (
            f"{self.device}: {int(free) / gib:.2f} GiB free of "
            f"{int(total) / gib:.2f} GiB (cuMemGetInfo)"
        )

    def export_chunk(self, handle: object) -> tuple[int, int]:
        """A POSIX file descriptor of ``handle`` (offset 0)."""
        if not self.fd_exportable:
            raise VmmError(f"{self.device} cannot export allocations as POSIX fds")
        drv = self._drv
        fd = self._check(
            drv.cuMemExportToShareableHandle(
                handle,
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            ),
            "cuMemExportToShareableHandle",
        )
        return int(fd), 0

    def import_chunk(self, fd: int, offset: int, nbytes: int) -> ImportedChunk:
        """``cuMemImportFromShareableHandle``, mapped into a reservation of
        its own with access for this device (``cuMemSetAccess``)."""
        drv, check = self._drv, self._check
        self.bind_thread()
        handle = check(
            drv.cuMemImportFromShareableHandle(
                fd,
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ),
            "cuMemImportFromShareableHandle",
        )
        try:
            va = int(
                check(drv.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve")
            )
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        try:
            check(drv.cuMemMap(va, nbytes, offset, handle, 0), "cuMemMap")
            try:
                check(drv.cuMemSetAccess(va, nbytes, self._access, 1), "cuMemSetAccess")
            except BaseException:
                drv.cuMemUnmap(va, nbytes)
                raise
        except BaseException:
            drv.cuMemAddressFree(va, nbytes)
            drv.cuMemRelease(handle)
            raise
        return ImportedChunk(va, nbytes, handle)

    def unmap_import(self, chunk: ImportedChunk) -> None:
        drv, check = self._drv, self._check
        self.bind_thread()
        check(drv.cuMemUnmap(chunk.addr, chunk.nbytes), "cuMemUnmap")
        check(drv.cuMemRelease(chunk.handle), "cuMemRelease")
        check(drv.cuMemAddressFree(chunk.addr, chunk.nbytes), "cuMemAddressFree")

    def copy_stream(self) -> "CudaCopyStream":
        return CudaCopyStream(self)

    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        return _dlpack_uint8_tensor(va, nbytes, self.device.index)

    def close(self) -> None:
        if self._mapped:
            self.synchronize()
        for va, nbytes in list(self._mapped.items()):
            self.unmap(va, nbytes)
        for handle in list(self._allocations.values()):
            self.release(handle)
        for va, nbytes in list(self._reservations.items()):
            self.free_reservation(va, nbytes)
        if self._primary_ctx is not None:
            self._check(
                self._drv.cuDevicePrimaryCtxRelease(self._cu_device),
                "cuDevicePrimaryCtxRelease",
            )
            self._primary_ctx = None


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` of cuda.h."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
# cuMemcpyBatchAsync as CUDA 12.8 introduced it (with failIdx; CUDA 13 keeps
# the name for a signature without it): asked for by version, so the ABI
# below holds whatever the driver's own version.
_BATCH_ABI_VERSION = 12080
_BatchFn = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)


def _batch_copy_fn() -> Any:
    """The driver's ``cuMemcpyBatchAsync`` (the 12.8 ABI) to call with the
    copies' address and size columns as they are, or None where the driver
    has none (before 12.8, or no ``cuGetProcAddress_v2``). The bindings take
    a Python object per address; called this way, what is left is the
    driver's own work, about 1 us per copy on a GPU host (docs/BENCHMARKS.md),
    so same-host KV reads use it only where their copy kernel cannot run."""
    try:
        get = ctypes.CDLL("libcuda.so.1").cuGetProcAddress_v2
    except (OSError, AttributeError):
        return None
    fn, status = ctypes.c_void_p(), ctypes.c_int()
    err = get(
        b"cuMemcpyBatchAsync",
        ctypes.byref(fn),
        ctypes.c_int(_BATCH_ABI_VERSION),
        ctypes.c_uint64(0),
        ctypes.byref(status),
    )
    if err or status.value or not fn.value:
        return None
    return _BatchFn(fn.value)


# Events kept for reuse per stream: a read records one and frees it once over.
_KEPT_EVENTS = 64


class CudaCopyStream(DeviceCopyStream):
    """A non-blocking stream of the backend's device; copies are one
    ``cuMemcpyBatchAsync`` per call, through ctypes with the columns as
    they are, where the driver has it (12.8 and later), else one
    ``cuMemcpyAsync`` per run. The bindings' own ``cuMemcpyBatchAsync``
    (a Python object per address) is not used: every driver that has the
    batch has ``cuGetProcAddress_v2`` to reach it without them. Events are
    reused once freed. Each call makes the device's primary context
    current on a thread that has none (``bind_thread``)."""

    def __init__(self, backend: CudaVmmBackend) -> None:
        self._backend = backend
        drv = backend._drv
        backend.bind_thread()
        self._stream = backend._check(
            drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
            "cuStreamCreate",
        )
        self._batch_fn = _batch_copy_fn()
        self._c_attrs = _MemcpyAttributes(_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self._c_attrs_idx = ctypes.c_size_t(0)
        self._fail_idx = ctypes.c_size_t(0)
        self._free_events: list[Any] = []

    @property
    def handle(self) -> int:
        return int(self._stream)

    def copy(self, runs: "np.ndarray") -> None:
        self._backend.bind_thread()
        if not len(runs):
            return
        if self._batch_fn is not None:
            self._copy_columns(runs)
        else:
            drv, check = self._backend._drv, self._backend._check
            for dst, src, n in runs.tolist():
                check(drv.cuMemcpyAsync(dst, src, n, self._stream), "cuMemcpyAsync")

    def _copy_columns(self, runs: "np.ndarray") -> None:
        """One ``cuMemcpyBatchAsync`` through ctypes: the three columns made
        contiguous in one array, their addresses passed as they are."""
        import numpy as np

        cols = np.ascontiguousarray(runs.T, dtype=np.uint64)
        n = cols.shape[1]
        base, stride = cols.ctypes.data, cols.strides[0]
        err = self._batch_fn(
            base,
            base + stride,
            base + 2 * stride,
            n,
            ctypes.addressof(self._c_attrs),
            ctypes.addressof(self._c_attrs_idx),
            1,
            ctypes.addressof(self._fail_idx),
            self.handle,
        )
        if err:
            drv = self._backend._drv
            self._backend._check(
                (drv.CUresult(err),),
                f"cuMemcpyBatchAsync of {n} copies (copy {self._fail_idx.value})",
            )

    def record(self) -> Any:
        drv, check = self._backend._drv, self._backend._check
        self._backend.bind_thread()
        try:
            event = self._free_events.pop()
        except IndexError:
            event = check(
                drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                "cuEventCreate",
            )
        check(drv.cuEventRecord(event, self._stream), "cuEventRecord")
        return event

    def query(self, event: object) -> bool:
        drv = self._backend._drv
        err = drv.cuEventQuery(event)[0]
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        self._backend._check((err,), "cuEventQuery")
        return True

    def wait(self, event: object) -> None:
        self._backend._check(
            self._backend._drv.cuEventSynchronize(event), "cuEventSynchronize"
        )

    def free(self, event: object) -> None:
        """``event`` is kept for a later :meth:`record` (up to
        :data:`_KEPT_EVENTS`; beyond them destroyed)."""
        if len(self._free_events) < _KEPT_EVENTS:
            self._free_events.append(event)
            return
        self._backend._check(self._backend._drv.cuEventDestroy(event), "cuEventDestroy")


# Minimal DLPack (v0.x ABI, the one torch.from_dlpack accepts as a capsule).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
    ]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DLDeleter),
]
_KDL_CUDA = 2
_KDL_UINT = 1

# Structs handed to torch, kept alive until torch calls the deleter.
_dlpack_alive: dict[int, tuple[_DLManagedTensor, Any]] = {}


@_DLDeleter
def _dlpack_deleter(managed: Any) -> None:
    _dlpack_alive.pop(ctypes.addressof(managed.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _dlpack_uint8_tensor(va: int, nbytes: int, device_index: int) -> torch.Tensor:
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = va
    managed.dl_tensor.device = _DLDevice(_KDL_CUDA, device_index)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _dlpack_deleter
    _dlpack_alive[ctypes.addressof(managed)] = (managed, shape)
    capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)
