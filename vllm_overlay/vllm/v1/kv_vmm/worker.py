# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker side of VMM-backed KV memory: the backing allocation of a rank's
KV tensors over a virtual reservation, and the page changes the scheduler
sends: the step's own before its forward pass, the pages mapped ahead of
demand right after the forward pass is launched."""

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm.logger import init_logger
from vllm.v1.kv_vmm.backend import VmmBackend, VmmOutOfMemoryError
from vllm.v1.kv_vmm.host import HostVmmBackend
from vllm.v1.kv_vmm.kv_regions import (
    attention_kv_regions,
    attention_layer_regions,
    kv_tensor_regions,
)
from vllm.v1.kv_vmm.page_table import KVPageTable, SegmentCallback
from vllm.v1.kv_vmm.pages import (
    KVPageOps,
    KVPagePolicy,
    initial_kv_pages,
    kv_page_geometry,
    virtual_kv_cache_config,
)

__all__ = [
    "KVPageMapper",
    "allocate_vmm_kv_cache",
    "allocate_vmm_kv_tensors",
    "attention_kv_regions",
    "add_memory_report",
    "attention_layer_regions",
    "kv_tensor_regions",
    "make_vmm_backend",
    "map_kv_pages_ahead",
]

logger = init_logger(__name__)

#: Sentences about who else holds a device's memory, for the error of a rank
#: that cannot map pages (engines sharing a device add the engines of the
#: device's ledger: vllm.v1.kv_vmm.shared_device).
_memory_reports: list[Callable[[torch.device], str]] = []


def add_memory_report(report: Callable[[torch.device], str]) -> None:
    """Add ``report`` (a sentence about ``device``) to the error messages of a
    rank that cannot map KV pages."""
    if report not in _memory_reports:
        _memory_reports.append(report)


#: Startup: how long the pages every rank maps before the first step (the
#: null block's page and a step's worth ahead, ``initial_kv_pages``) are
#: tried again before the engine fails with what the device holds.
STARTUP_MAP_TIMEOUT_S = 5.0
STARTUP_MAP_RETRY_S = 0.05
#: Without the ranks' page reports (a rank on another host than the engine
#: core): how long a page the step needs is tried again before the worker
#: fails the engine (the scheduler has handed its blocks out already).
NEEDED_MAP_TIMEOUT_S = 10.0
NEEDED_MAP_RETRY_MAX_S = 1.0


def make_vmm_backend(device: torch.device, granularity: int) -> VmmBackend:
    if device.type == "cuda":
        from vllm.v1.kv_vmm.cuda import CudaVmmBackend

        backend: VmmBackend = CudaVmmBackend(device)
    elif device.type == "cpu":
        backend = HostVmmBackend(granularity)
    else:
        raise NotImplementedError(
            f"VMM-backed KV memory supports CUDA and CPU devices, not "
            f"{device.type}; use --kv-cache-memory-backend default"
        )
    if granularity % backend.granularity:
        raise NotImplementedError(
            f"the {device.type} VMM granularity ({backend.granularity} bytes) "
            f"does not divide the KV page granularity ({granularity} bytes); "
            "use --kv-cache-memory-backend default"
        )
    return backend


class KVPageMapper:
    """A rank's KV page table plus its share of the scheduler's decisions.

    A policy page is one segment of the rank's page table, so every rank
    maps its own bytes for the same page ids.

    Where every rank is on the engine core's host (the usual case), each rank
    reports each page it was asked to map as mapped or failed in the engine's
    page report (:mod:`vllm.v1.kv_vmm.page_status`), and the scheduler hands
    a page's blocks out only once every rank reported it mapped: a page the
    device has no memory for is tried once and reported, never waited for,
    and the scheduler treats it as not available (requests wait, or are
    preempted, as with a full KV cache). Only the startup pages must be
    mapped (:data:`STARTUP_MAP_TIMEOUT_S`, then a clear error).
    """

    def __init__(
        self,
        kv_cache_config,
        policy: KVPagePolicy,
        device: torch.device,
        on_segment_mapped: SegmentCallback | None = None,
        before_segment_unmapped: SegmentCallback | None = None,
        num_regions: Sequence[int] | None = None,
    ) -> None:
        self.policy = policy
        backend = make_vmm_backend(device, policy.granularity)
        self.geometry = kv_page_geometry(
            kv_cache_config, backend.granularity, policy.blocks_per_page, num_regions
        )
        self.virtual_config = virtual_kv_cache_config(kv_cache_config, self.geometry)
        # The table's own limit is the whole reservation: the scheduler
        # enforces the physical limit, which may change at runtime.
        self.table = KVPageTable(
            backend,
            self.geometry,
            max_pages=self.geometry.num_pages,
            on_segment_mapped=on_segment_mapped,
            before_segment_unmapped=before_segment_unmapped,
        )
        self.map_seconds = 0.0
        self.ahead_map_seconds = 0.0
        self.num_pages_mapped_total = 0
        self.num_pages_mapped_ahead_total = 0
        self.num_pages_unmapped_total = 0
        self.peak_mapped_bytes = 0
        self.num_map_failures_total = 0
        # Without page reports: pages mapped ahead that the device had no
        # memory for, mapped before the next forward pass, which may use them.
        self._owed: set[int] = set()
        # Pages to map ahead once this step's forward pass is launched; a step
        # without one (nothing scheduled) leaves them to the next step.
        self._ahead_pending: list[int] = []
        self._failure_logged = False
        self.status = None
        if policy.page_status_path is not None:
            from vllm.v1.kv_vmm.page_status import KVPageStatus

            try:
                self.status = KVPageStatus(policy.page_status_path)
            except FileNotFoundError:
                # A rank on another host than the engine core; see reporting.
                logger.warning(
                    "KV page report %s is not on this host: the scheduler hands "
                    "out KV pages without the ranks' reports, and a page this "
                    "rank cannot map within %.0f s fails the engine",
                    policy.page_status_path,
                    NEEDED_MAP_TIMEOUT_S,
                )
        self._reporting: bool | None = None
        # With the ranks' reports the scheduler hands out pages mapped ahead
        # only once every rank has them, so nothing waits for them: with a
        # device ledger (several engines on the device, where memory runs
        # out more often) a thread of their own maps them while this one
        # runs the steps (the driver calls release the GIL). Otherwise they
        # are mapped on this thread behind the forward pass.
        self._ahead_thread: ThreadPoolExecutor | None = None
        self._ahead_batches: list[Future[None]] = []
        if (
            self.status is not None
            and policy.ledger is not None
            and self.maps_ahead_after_forward
        ):
            self._ahead_thread = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="kv-page-map",
                initializer=backend.bind_thread,
            )
        try:
            self._map_startup(initial_kv_pages(policy))
        except BaseException:
            self.close()
            raise
        logger.info(
            "VMM-backed KV cache: %d virtual blocks (%.2f GiB reserved), "
            "%d blocks per page, %.2f MiB per page, %.2f MiB mapped at startup "
            "in %.1f ms",
            self.geometry.num_blocks,
            sum(self.geometry.tensor_bytes) / (1 << 30),
            policy.blocks_per_page,
            self.page_bytes / (1 << 20),
            self.mapped_bytes / (1 << 20),
            self.map_seconds * 1000,
        )

    @property
    def buffer(self) -> torch.Tensor:
        """The flat ``int8`` backing allocation, viewed per layer by vLLM."""
        return self.table.tensors[0].view(torch.int8)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """One flat ``int8`` tensor per KVCacheTensor (releases that allocate
        one tensor per KVCacheTensor)."""
        return [t.view(torch.int8) for t in self.table.tensors]

    @property
    def page_bytes(self) -> int:
        return self.geometry.page_bytes * self.geometry.pages_per_segment

    @property
    def mapped_bytes(self) -> int:
        return self.table.mapped_bytes

    def _table_pages(self, pages: list[int]) -> list[int]:
        return [p for segment in pages for p in self.geometry.pages_of_segment(segment)]

    @property
    def maps_ahead_after_forward(self) -> bool:
        """Whether pages mapped ahead of demand wait until the forward pass
        is launched. Not when a KV connector registers each mapped segment:
        it publishes its registrations with the step's own (a transfer of
        this step's requests may name the step's registration epoch), so
        every page of the step is mapped, and registered, before it."""
        return self.table.on_segment_mapped is None

    @property
    def reporting(self) -> bool:
        """Whether the scheduler hands pages out only once every rank
        reported them mapped: every rank opened the engine's page report and
        reported its startup pages there (page 0, the null block's, is one
        of them and never unmapped). Decided at the first step, when every
        rank has started; the scheduler decides the same from the same
        counts (``PagedBlockPool``)."""
        if self._reporting is None:
            self._reporting = (
                self.status is not None
                and self.status.counts(0)[0] >= self.policy.num_ranks
            )
        return self._reporting

    def apply(self, ops: KVPageOps) -> None:
        """Before the forward pass: unmap, then map the pages the scheduler
        asks for before it (and those mapped ahead, see
        :attr:`maps_ahead_after_forward`); the device is synchronized before
        unmapping. With page reports nothing here waits for memory: a page
        the device has none for is reported as failed."""
        start = time.perf_counter()
        # Asked for ahead by a step that launched no forward pass.
        deferred, self._ahead_pending = self._ahead_pending, []
        ahead_here = bool(ops.ahead) and not self.maps_ahead_after_forward
        if ops.ahead and not ahead_here:
            self._ahead_pending = list(ops.ahead)
        if not (deferred or ops.unmap or ops.map or self._owed or ahead_here):
            self.wait_for_ahead_maps(finished_only=True)  # raises their errors
            return
        # After the batches being mapped ahead, which may still run; the
        # scheduler unmaps only pages every rank reported.
        self.wait_for_ahead_maps()
        if deferred:
            self._map_reported(deferred, ahead=True)
        if ops.unmap:
            unmapped = self.table.unmap_pages(self._table_pages(ops.unmap))
            self.num_pages_unmapped_total += len(unmapped)
            self._owed.difference_update(ops.unmap)
        if self.reporting:
            if ops.map:
                self._map_reported(ops.map, ahead=False)
        else:
            needed = [*sorted(self._owed), *ops.map]
            if needed:
                self._map_needed(needed)
                self._owed.clear()
        if ahead_here:
            self._map_reported(ops.ahead, ahead=True)
        self.map_seconds += time.perf_counter() - start
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.mapped_bytes)

    def _map_each(
        self, pages: list[int]
    ) -> tuple[list[int], list[int], Exception | None]:
        """Map ``pages`` (all in one call, else one at a time: keep what
        fits); return the pages newly mapped, those the device had no memory
        for, and the last such error."""
        try:
            return self.table.map_pages(self._table_pages(pages)), [], None
        except VmmOutOfMemoryError as e:
            error: Exception = e
        mapped: list[int] = []
        failed: list[int] = []
        for page in pages:
            try:
                mapped += self.table.map_pages(self._table_pages([page]))
            except VmmOutOfMemoryError as e:
                failed.append(page)
                error = e
        return mapped, failed, error

    def _map_reported(self, pages: list[int], ahead: bool) -> None:
        """Map pages the scheduler hands out once mapped, as many as the
        device has memory for, trying each once; report each page's outcome
        (with page reports) or owe the failed ones to the next forward pass
        (without them)."""
        mapped, failed, error = self._map_each(pages)
        self.num_pages_mapped_total += len(mapped)
        if ahead:
            self.num_pages_mapped_ahead_total += len(mapped)
        if failed:
            self.num_map_failures_total += len(failed)
            assert error is not None
            self._log_failure("(not available until memory frees up)", failed, error)
        else:
            self._failure_logged = False
        if self.reporting:
            assert self.status is not None
            done = set(failed)
            self.status.report([p for p in pages if p not in done], failed)
        else:
            self._owed.update(failed)

    def _map_needed(self, pages: list[int]) -> None:
        """Without page reports (a rank on another host than the engine
        core): map pages whose blocks this step uses. The scheduler handed
        them out already, so a page the device has no memory for is tried
        again, with backoff, for :data:`NEEDED_MAP_TIMEOUT_S`; then the
        worker fails with what the device holds (the ranks cannot agree to
        skip the step)."""
        deadline = time.monotonic() + NEEDED_MAP_TIMEOUT_S
        delay = 0.01
        while True:
            mapped, failed, error = self._map_each(pages)
            self.num_pages_mapped_total += len(mapped)
            if not failed:
                break
            self.num_map_failures_total += len(failed)
            assert error is not None
            if time.monotonic() + delay > deadline:
                raise VmmOutOfMemoryError(
                    f"KV cache pages {failed} that this step uses could not be "
                    f"mapped within {NEEDED_MAP_TIMEOUT_S:g} s ({error}). "
                    f"{self._memory_report()} Without every rank on the engine "
                    "core's host the scheduler cannot learn that a rank is out "
                    "of memory before it hands out a page: run every rank of "
                    "the engine on one host, or free device memory."
                )
            self._log_failure("needed by this step; retrying", failed, error)
            time.sleep(delay)
            delay = min(delay * 2, NEEDED_MAP_RETRY_MAX_S)
            pages = failed
        self._failure_logged = False

    def _map_startup(self, pages: list[int]) -> None:
        """Map the pages every rank holds before the first step (the null
        block's page and a step's worth ahead) and report them; a page the
        device has no memory for is tried again for
        :data:`STARTUP_MAP_TIMEOUT_S`, then the engine fails with what the
        device holds (an engine that cannot map these would only wait)."""
        start = time.perf_counter()
        deadline = time.monotonic() + STARTUP_MAP_TIMEOUT_S
        wanted = pages
        while True:
            mapped, failed, error = self._map_each(wanted)
            self.num_pages_mapped_total += len(mapped)
            if not failed:
                break
            self.num_map_failures_total += len(failed)
            if time.monotonic() >= deadline:
                assert error is not None
                raise VmmOutOfMemoryError(
                    self._startup_error(pages, failed, error, start)
                )
            time.sleep(STARTUP_MAP_RETRY_S)
            wanted = failed
        self.map_seconds += time.perf_counter() - start
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.mapped_bytes)
        if self.status is not None:
            self.status.report(pages, [])

    def _startup_error(
        self, pages: list[int], failed: list[int], error: Exception, start: float
    ) -> str:
        device = self.table.backend.device
        return (
            f"VMM-backed KV cache: {len(failed)} of the {len(pages)} KV cache "
            f"pages mapped at startup ({self.page_bytes / (1 << 20):.2f} MiB "
            f"each on {device}) could not be mapped in "
            f"{time.perf_counter() - start:.1f} s: {error}. "
            f"{self._memory_report()} "
            "These pages (the null block's page and a step's worth of blocks "
            "ahead) are the least an engine maps. Free memory on the device "
            "(stop or shrink the engines or processes that hold it), or map "
            "less at startup: a smaller --max-num-batched-tokens or "
            "--kv-cache-vmm-page-bytes."
        )

    def _memory_report(self) -> str:
        """What the backend can tell about its memory, and what the reports
        of :func:`add_memory_report` add (for error messages)."""
        backend = self.table.backend
        report = backend.memory_report() or f"{backend.device}: no memory figures"
        others = " ".join(add(backend.device) for add in _memory_reports)
        return f"{report}. {others}" if others else f"{report}."

    def _log_failure(self, what: str, pages: list[int], error: Exception) -> None:
        if not self._failure_logged:
            logger.warning(
                "Could not map KV cache pages %s %s: %s. %s",
                pages,
                what,
                error,
                self._memory_report(),
            )
            self._failure_logged = True

    def apply_ahead(self, ops: KVPageOps) -> None:
        """After the forward pass is launched: map the pages the scheduler
        hands out from the next step on. Nothing in flight uses them, so the
        driver calls overlap the device's work instead of delaying it (and,
        with a device ledger, this thread's work too: see ``_ahead_thread``)."""
        if not ops.ahead or not self.maps_ahead_after_forward:
            return
        asked = set(ops.ahead)
        self._ahead_pending = [p for p in self._ahead_pending if p not in asked]
        if self._ahead_thread is None:
            self._map_ahead_timed(ops.ahead)
            return
        # One thread: the batches are mapped in the scheduler's order.
        self._ahead_batches.append(
            self._ahead_thread.submit(self._map_ahead_timed, list(ops.ahead))
        )

    def _map_ahead_timed(self, pages: list[int]) -> None:
        start = time.perf_counter()
        self._map_reported(pages, ahead=True)
        self.ahead_map_seconds += time.perf_counter() - start
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.mapped_bytes)

    def wait_for_ahead_maps(self, finished_only: bool = False) -> None:
        """Until the pages being mapped ahead are (raises what mapping them
        raised: a driver error other than a lack of memory); with
        ``finished_only``, take in the batches already done, wait for none."""
        batches: list[Future[None]] = []
        running: list[Future[None]] = []
        for batch in self._ahead_batches:
            done = not finished_only or batch.done()
            (batches if done else running).append(batch)
        self._ahead_batches = running
        errors: list[Exception] = []
        for batch in batches:
            try:
                batch.result()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def stats(self) -> dict[str, float]:
        self.wait_for_ahead_maps()
        pps = self.geometry.pages_per_segment
        return {
            "kv_mapped_bytes": self.mapped_bytes,
            "kv_mapped_bytes_peak": self.peak_mapped_bytes,
            "kv_pages_mapped_total": self.num_pages_mapped_total // pps,
            "kv_pages_unmapped_total": self.num_pages_unmapped_total // pps,
            "kv_pages_mapped_ahead_total": self.num_pages_mapped_ahead_total // pps,
            "kv_map_seconds": self.map_seconds,
            "kv_ahead_map_seconds": self.ahead_map_seconds,
            "kv_map_failures_total": self.num_map_failures_total,
        }

    def close(self) -> None:
        if self._ahead_thread is not None:
            self._ahead_thread.shutdown(wait=True)
            self._ahead_batches = []
        self.table.close()
        if self.status is not None:
            self.status.close()


def allocate_vmm_kv_cache(
    kv_cache_config,
    device: torch.device,
    allocate: Callable[..., dict[str, torch.Tensor]],
    *args,
    **kwargs,
) -> tuple[dict[str, torch.Tensor], KVPageMapper]:
    """Allocate a rank's KV cache views over VMM memory.

    ``allocate`` is vLLM's own allocation function, called with the virtual
    KV cache config and ``buffer=`` the reservation, so the views (strides,
    NHD/HND orders, kernel blocks) are exactly the ones the attention
    backend asked for.
    """
    policy = kv_cache_config.kv_page_policy
    mapper = KVPageMapper(kv_cache_config, policy, device)
    kv_caches = allocate(
        mapper.virtual_config, device, *args, buffer=mapper.buffer, **kwargs
    )
    return kv_caches, mapper


def allocate_vmm_kv_tensors(
    kv_cache_config,
    device: torch.device,
    layer_regions: dict[str, int],
) -> tuple[dict[str, torch.Tensor], KVPageMapper]:
    """Allocate a rank's KV tensors over VMM memory, one per KVCacheTensor
    (releases whose model runner allocates them one by one), as the flat
    ``int8`` tensors the model runner then views per layer.

    ``layer_regions``: each layer's region count
    (:func:`attention_kv_regions`). The tensors address the virtual block
    count (whole pages); the scheduler never hands out the extra block ids.
    """
    mapper = KVPageMapper(
        kv_cache_config,
        kv_cache_config.kv_page_policy,
        device,
        num_regions=kv_tensor_regions(kv_cache_config, layer_regions),
    )
    raw_tensors: dict[str, torch.Tensor] = {}
    for tensor, buffer in zip(kv_cache_config.kv_cache_tensors, mapper.buffers):
        for layer_name in tensor.shared_by:
            raw_tensors[layer_name] = buffer
    return raw_tensors, mapper


def map_kv_pages_ahead(mapper: "KVPageMapper | None", ops: KVPageOps | None) -> None:
    """The model runner's call right after it launched a step's forward pass
    (before anything of the step that may wait for the device, such as the
    logits or a KV connector's finalize): map the step's pages ahead of
    demand while the device runs the forward pass (``mapper`` is None
    without VMM-backed KV memory)."""
    if mapper is not None and ops:
        mapper.apply_ahead(ops)
