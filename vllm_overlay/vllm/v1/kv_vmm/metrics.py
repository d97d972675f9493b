# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""VMM-backed KV memory in vLLM's stats loggers: a part of the periodic log
line and Prometheus metrics, from the :class:`KVPageStats` the scheduler
attaches to its stats."""

import dataclasses
from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_vmm.pages import KVPageStats
from vllm.v1.metrics.utils import create_metric_per_engine


def kv_page_log_part(stats: KVPageStats) -> tuple[str, list[float]]:
    """Format and arguments of the log line's KV page part."""
    return (
        "KV pages mapped: %d/%d (%.2f GiB per device), +%d/-%d since start",
        [
            stats.mapped_pages,
            stats.page_limit,
            stats.mapped_bytes / (1 << 30),
            stats.pages_mapped_total,
            stats.pages_unmapped_total,
        ],
    )


def sum_kv_page_stats(
    stats: Iterable[KVPageStats | None],
) -> KVPageStats | None:
    """The KV pages of several engines (data parallel) as one: every count
    summed, the device ledgers merged; None when no engine reports pages."""
    reported = [s for s in stats if s is not None]
    if not reported:
        return None
    ledgers = [s.ledger for s in reported if s.ledger is not None]
    return KVPageStats(
        **{
            f.name: sum(getattr(s, f.name) for s in reported)
            for f in dataclasses.fields(KVPageStats)
            if f.name != "ledger"
        },
        ledger={k: v for ledger in ledgers for k, v in ledger.items()} or None,
    )


#: Each engine's quantities in ``vllm:kv_cache_vmm_ledger_bytes`` (an
#: entry's ``<quantity>_bytes``; ``share`` only under the fair policy, the
#: rest absent in entries of older engines).
_LEDGER_QUANTITIES = ("mapped", "floor", "limit", "used", "waiting", "share")


class KVPagePrometheusMetrics:
    """Gauges of what is mapped now and counters of pages mapped and
    unmapped, one series per engine. Names follow vLLM's: ``kv_cache_vmm_``
    for the option they report on, the unit last, and counters that
    Prometheus exposes with ``_total`` (``vllm:kv_cache_vmm_page_maps_total``).

    Args:
        gauge_cls, counter_cls: the stat logger's metric classes.
        labelnames: the stat logger's label names.
        per_engine_labelvalues: label values per engine index.

    """

    def __init__(
        self,
        gauge_cls: Any,
        counter_cls: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[Any]],
    ) -> None:
        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.mapped_bytes = per_engine(
            gauge_cls(
                name="vllm:kv_cache_vmm_mapped_bytes",
                documentation="KV cache memory mapped, in bytes per device (on "
                "the device that holds the most of the engine's KV cache) "
                "(--kv-cache-memory-backend vmm).",
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
        )
        self.mapped_pages = per_engine(
            gauge_cls(
                name="vllm:kv_cache_vmm_mapped_pages",
                documentation="KV cache pages mapped now "
                "(--kv-cache-memory-backend vmm).",
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
        )
        self.page_limit = per_engine(
            gauge_cls(
                name="vllm:kv_cache_vmm_page_limit",
                documentation="Physical limit of the KV cache in pages "
                "(--kv-cache-memory-backend vmm).",
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
        )
        self.limit_bytes = per_engine(
            gauge_cls(
                name="vllm:kv_cache_vmm_limit_bytes",
                documentation="Physical limit of the KV cache in bytes per device "
                "(the page limit times the bytes of a page on the device that "
                "holds the most of the engine's KV cache) "
                "(--kv-cache-memory-backend vmm).",
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
        )
        self.page_maps = per_engine(
            counter_cls(
                name="vllm:kv_cache_vmm_page_maps",
                documentation="KV cache pages mapped since start "
                "(--kv-cache-memory-backend vmm).",
                labelnames=labelnames,
            )
        )
        self.page_unmaps = per_engine(
            counter_cls(
                name="vllm:kv_cache_vmm_page_unmaps",
                documentation="KV cache pages unmapped since start "
                "(--kv-cache-memory-backend vmm).",
                labelnames=labelnames,
            )
        )
        self.map_failures = per_engine(
            counter_cls(
                name="vllm:kv_cache_vmm_page_map_failures",
                documentation="KV cache pages a rank could not map for lack of "
                "device memory (--kv-cache-memory-backend vmm).",
                labelnames=labelnames,
            )
        )
        self.share_reclaimed_pages = per_engine(
            counter_cls(
                name="vllm:kv_cache_vmm_share_reclaimed_pages",
                documentation="KV cache pages the engine gave back because "
                "another engine below its fair share waited for memory "
                "(--kv-cache-vmm-share-policy fair).",
                labelnames=labelnames,
            )
        )
        self.floor_bytes = per_engine(
            gauge_cls(
                name="vllm:kv_cache_vmm_floor_bytes",
                documentation="KV cache memory reserved for the engine in its "
                "devices' ledgers, in bytes per device (--kv-cache-vmm-shared).",
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
        )
        # The device ledgers as this engine reads them: one series per
        # device, engine on it and quantity.
        self.ledger_bytes = gauge_cls(
            name="vllm:kv_cache_vmm_ledger_bytes",
            documentation="KV cache memory in the device ledger: capacity, "
            "and each engine's mapped, floor, limit, used and waiting bytes "
            "and, with --kv-cache-vmm-share-policy fair, its fair share "
            "(--kv-cache-vmm-shared).",
            multiprocess_mode="mostrecent",
            labelnames=[*labelnames, "device", "ledger_engine", "quantity"],
        )
        self._labels = per_engine_labelvalues
        self._ledger_series: dict[int, set[tuple[str, ...]]] = {}
        # Counters take increments; the scheduler reports running totals.
        self._last: dict[int, tuple[int, int, int, int]] = {}

    def record(self, engine_idx: int, stats: KVPageStats) -> None:
        self.mapped_bytes[engine_idx].set(stats.mapped_bytes)
        self.mapped_pages[engine_idx].set(stats.mapped_pages)
        self.page_limit[engine_idx].set(stats.page_limit)
        self.limit_bytes[engine_idx].set(stats.limit_bytes)
        totals = (
            stats.pages_mapped_total,
            stats.pages_unmapped_total,
            stats.map_failures_total,
            stats.share_reclaimed_pages_total,
        )
        counters = (
            self.page_maps,
            self.page_unmaps,
            self.map_failures,
            self.share_reclaimed_pages,
        )
        last = self._last.get(engine_idx, (0, 0, 0, 0))
        for counter, total, before in zip(counters, totals, last):
            counter[engine_idx].inc(total - before)
        self._last[engine_idx] = totals
        if stats.ledger is not None:
            self.floor_bytes[engine_idx].set(stats.floor_bytes)
            self._record_ledger(engine_idx, stats.ledger)

    def _record_ledger(self, engine_idx: int, ledgers: dict[str, Any]) -> None:
        labels = [str(v) for v in self._labels[engine_idx]]
        series: dict[tuple[str, ...], float] = {}
        for device, state in ledgers.items():
            series[(*labels, device, "", "capacity")] = state["capacity_bytes"]
            for entry in state["entries"]:
                engine = f"{entry['id']} (pid {entry['pid']})"
                for quantity in _LEDGER_QUANTITIES:
                    value = entry.get(f"{quantity}_bytes")
                    if value is not None:
                        series[(*labels, device, engine, quantity)] = value
        for key, value in series.items():
            self.ledger_bytes.labels(*key).set(value)
        # Engines that left the ledger leave the metric too.
        for key in self._ledger_series.get(engine_idx, set()) - series.keys():
            self.ledger_bytes.remove(*key)
        self._ledger_series[engine_idx] = set(series)
