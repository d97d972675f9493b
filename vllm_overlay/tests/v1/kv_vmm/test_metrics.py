# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV page counters in the stats loggers: several data-parallel engines add up
in the aggregated log line; the Prometheus metrics as an operator sees them."""

import pytest

# The stats loggers' per-engine metric helpers (not in every release).
pytest.importorskip("vllm.v1.metrics.utils")

from vllm.v1.kv_vmm.metrics import (  # noqa: E402
    KVPagePrometheusMetrics,
    kv_page_log_part,
    sum_kv_page_stats,
)
from vllm.v1.kv_vmm.pages import KVPageStats  # noqa: E402


def vllm_reports_kv_page_stats() -> bool:
    """Whether the scheduler stats carry the VMM page counters (the metrics
    patch; carried separately from the wiring)."""
    from vllm.v1.metrics.stats import SchedulerStats

    return "kv_page_stats" in getattr(SchedulerStats, "__dataclass_fields__", {})


requires_kv_page_stats = pytest.mark.skipif(
    not vllm_reports_kv_page_stats(),
    reason="this vLLM does not carry the VMM KV page metrics patch",
)


def _stats(pages: int, limit: int = 10, mapped: int = 4, unmapped: int = 1):
    return KVPageStats(
        mapped_pages=pages,
        page_limit=limit,
        mapped_bytes=pages << 21,
        limit_bytes=limit << 21,
        pages_mapped_total=mapped,
        pages_unmapped_total=unmapped,
    )


def test_sum_of_engines():
    total = sum_kv_page_stats([_stats(3), None, _stats(5, limit=20, mapped=7)])
    assert total == KVPageStats(
        mapped_pages=8,
        page_limit=30,
        mapped_bytes=8 << 21,
        limit_bytes=30 << 21,
        pages_mapped_total=11,
        pages_unmapped_total=2,
    )
    assert sum_kv_page_stats([None, None]) is None
    assert sum_kv_page_stats([]) is None


@requires_kv_page_stats
def test_aggregated_logger_reports_every_engine():
    from vllm.config import VllmConfig
    from vllm.v1.metrics.loggers import AggregatedLoggingStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    stat_logger = AggregatedLoggingStatLogger(VllmConfig(), engine_indexes=[0, 1])
    for engine_idx, pages in ((0, 3), (1, 5)):
        stat_logger.record(
            SchedulerStats(kv_page_stats=_stats(pages)), None, engine_idx=engine_idx
        )
    stat_logger.aggregate_scheduler_stats()
    assert stat_logger.last_scheduler_stats.kv_page_stats == sum_kv_page_stats(
        [_stats(3), _stats(5)]
    )
    fmt, args = kv_page_log_part(stat_logger.last_scheduler_stats.kv_page_stats)
    assert (
        fmt % tuple(args)
        == "KV pages mapped: 8/20 (0.02 GiB per device), +8/-2 since start"
    )


def test_prometheus_exposition_names_and_values():
    """The names a scrape shows (counters with ``_total``, as vLLM's own), one
    series per engine, counters advanced by the running totals' increments."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()

    def bound(cls):
        def make(**kwargs):
            kwargs.pop("multiprocess_mode", None)
            return cls(registry=registry, **kwargs)

        return make

    prom = KVPagePrometheusMetrics(
        bound(prometheus_client.Gauge),
        bound(prometheus_client.Counter),
        ["engine"],
        {0: ["0"], 1: ["1"]},
    )
    prom.record(0, _stats(3, mapped=4, unmapped=1))
    prom.record(0, _stats(2, mapped=6, unmapped=4))
    prom.record(1, _stats(5, limit=20, mapped=7))

    def value(name: str, engine: str) -> float | None:
        return registry.get_sample_value(name, {"engine": engine})

    assert value("vllm:kv_cache_vmm_mapped_pages", "0") == 2
    assert value("vllm:kv_cache_vmm_mapped_bytes", "0") == 2 << 21
    assert value("vllm:kv_cache_vmm_page_limit", "1") == 20
    assert value("vllm:kv_cache_vmm_limit_bytes", "1") == 20 << 21
    assert value("vllm:kv_cache_vmm_page_maps_total", "0") == 6
    assert value("vllm:kv_cache_vmm_page_unmaps_total", "0") == 4
    assert value("vllm:kv_cache_vmm_page_maps_total", "1") == 7
    exposed = {
        sample.name
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }
    assert exposed == {
        "vllm:kv_cache_vmm_mapped_bytes",
        "vllm:kv_cache_vmm_limit_bytes",
        "vllm:kv_cache_vmm_mapped_pages",
        "vllm:kv_cache_vmm_page_limit",
        "vllm:kv_cache_vmm_page_maps_total",
        "vllm:kv_cache_vmm_page_unmaps_total",
        "vllm:kv_cache_vmm_page_map_failures_total",
        "vllm:kv_cache_vmm_share_reclaimed_pages_total",
        "vllm:kv_cache_vmm_floor_bytes",
    }


def test_prometheus_shows_the_device_ledger():
    prometheus_client = pytest.importorskip("prometheus_client")
    from vllm.v1.kv_vmm.metrics import KVPagePrometheusMetrics

    registry = prometheus_client.CollectorRegistry()

    def gauge(**kwargs):
        kwargs.pop("multiprocess_mode")
        return prometheus_client.Gauge(registry=registry, **kwargs)

    def counter(**kwargs):
        return prometheus_client.Counter(registry=registry, **kwargs)

    prom = KVPagePrometheusMetrics(gauge, counter, ["engine"], {0: ["0"]})

    def ledger(*engines):
        entries = [
            {
                "id": e,
                "pid": 10 + i,
                "mapped_bytes": 4 << 20,
                "floor_bytes": 2 << 20,
                "limit_bytes": None,
                # Share fields: a fair engine's snapshot ("a"), an older
                # engine's entry without them ("b").
                **(
                    {"used_bytes": 3 << 20, "waiting_bytes": 0, "share_bytes": 8 << 20}
                    if e == "a"
                    else {}
                ),
            }
            for i, e in enumerate(engines)
        ]
        return {
            "GPU-x": {"key": "GPU-x", "capacity_bytes": 64 << 20, "entries": entries}
        }

    def stats(failures, ledger_json, reclaimed=0):
        return KVPageStats(
            mapped_pages=2,
            page_limit=8,
            mapped_bytes=4 << 20,
            pages_mapped_total=5,
            pages_unmapped_total=3,
            map_failures_total=failures,
            floor_bytes=2 << 20,
            share_reclaimed_pages_total=reclaimed,
            ledger=ledger_json,
        )

    def value(name, **labels):
        return registry.get_sample_value(name, {"engine": "0", **labels})

    prom.record(0, stats(2, ledger("a", "b"), reclaimed=3))
    b_quantities = {
        s.labels["quantity"]
        for family in registry.collect()
        for s in family.samples
        if s.labels.get("ledger_engine") == "b (pid 11)"
    }
    assert b_quantities == {"mapped", "floor"}
    prom.record(0, stats(5, ledger("a"), reclaimed=7))
    assert value("vllm:kv_cache_vmm_page_map_failures_total") == 5
    assert value("vllm:kv_cache_vmm_share_reclaimed_pages_total") == 7
    for quantity, expected in [("used", 3 << 20), ("waiting", 0), ("share", 8 << 20)]:
        assert (
            value(
                "vllm:kv_cache_vmm_ledger_bytes",
                device="GPU-x",
                ledger_engine="a (pid 10)",
                quantity=quantity,
            )
            == expected
        )
    assert value("vllm:kv_cache_vmm_floor_bytes") == 2 << 20
    on = {"device": "GPU-x"}
    assert (
        value(
            "vllm:kv_cache_vmm_ledger_bytes",
            **on,
            ledger_engine="",
            quantity="capacity",
        )
        == 64 << 20
    )
    assert (
        value(
            "vllm:kv_cache_vmm_ledger_bytes",
            **on,
            ledger_engine="a (pid 10)",
            quantity="mapped",
        )
        == 4 << 20
    )
    # b left the ledger: its series are gone; nobody has a limit.
    assert (
        value(
            "vllm:kv_cache_vmm_ledger_bytes",
            **on,
            ledger_engine="b (pid 11)",
            quantity="mapped",
        )
        is None
    )
    assert (
        value(
            "vllm:kv_cache_vmm_ledger_bytes",
            **on,
            ledger_engine="a (pid 10)",
            quantity="limit",
        )
        is None
    )


@requires_kv_page_stats
def test_the_default_block_pool_reports_no_pages():
    # The scheduler asks every block pool for its page counters: the default
    # pool has none, and its scheduler stats carry none.
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    assert pool.make_page_stats() is None
