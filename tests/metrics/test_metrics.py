"""``certvllm.metrics.prometheus`` on the CPU: calls queued with deferred counters (what the CUDA backend
records, without a host synchronisation) fold to exactly the Prometheus values of the synchronous path
(``take_stats()`` read in the layer call, as the backend did before); ``flush()`` waits for values still in
flight and for a fold under way; a fold that fails does not stop the flusher. The CUDA side (pinned copies,
events, no synchronisation in N layer calls) is ``tests/metrics/test_gpu_metrics.py``."""

from __future__ import annotations

import threading
import time

import torch
from prometheus_client import CollectorRegistry

from certvllm.bounds.report import CertReport
from certvllm.kv.deferred import DeferredStats
from certvllm.metrics import CertMetrics, KeyPageCounts
from certvllm.testing import metric_samples


def samples(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample but creation times, keyed by name and labels (``model_name`` left out, so that two instances
    compare)."""
    return metric_samples(registry, drop=("model_name",))


def metrics(name: str, **kw) -> tuple[CertMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return CertMetrics(name, "0", registry=registry, **kw), registry


def synthetic_report(rows: int, heads: int, gen: torch.Generator) -> CertReport:
    """A report with every rung and flag, bounds across all buckets, and an infinite bound or two."""
    r = CertReport.zeros(rows, heads)
    r.rung.copy_(torch.randint(0, 5, (rows, heads), generator=gen).to(torch.int8))
    r.rung[torch.rand(rows, generator=gen) < 0.2] = 4  # whole rows at rung 4
    for name in ("e_key", "e_val", "e_round", "delta_tail", "alpha_tail"):
        getattr(r, name).copy_(10 ** (torch.rand(rows, heads, generator=gen) * 6 - 5))
    r.e_key[0, 0] = float("inf")
    r.v_max.copy_(torch.rand(rows, heads, generator=gen) + 0.05)
    r.k_star.copy_(torch.randint(0, 40, (rows, heads), generator=gen, dtype=torch.int32))
    r.v_promoted.copy_(torch.randint(0, 3, (rows, heads), generator=gen, dtype=torch.int32))
    for name in ("rank_fail", "boundary_fail", "bound_fail", "canary_fail", "precondition"):
        getattr(r, name).copy_(torch.rand(rows, heads, generator=gen) < 0.3)
    return r


def test_deferred_counters_fold_to_the_values_of_the_synchronous_path(gen):
    """A synthetic sequence of layer calls over three layers, with page-in traffic on the host and on the
    device, pool and prefetch counters: the synchronous path (the backend before: ``take_stats()`` in the
    layer call, ``record`` with the ints, ``count_key_pages`` at once) and the deferred one (the backend
    now: ``take_stats_deferred()`` handed to ``record``) give the same value for every sample."""
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.prefetch import StepPrefetcher
    from certvllm.kv.promotion_cache import PromotionCache
    from certvllm.testing import make_case, paged_batch

    cache, _, _ = paged_batch([make_case("sink_and_recency", 40, 4, 2, 32, torch.float16, gen)])
    sync, sync_registry = metrics("sync", flush_seconds=3600)
    deferred, deferred_registry = metrics("deferred", flush_seconds=3600)
    engines = [CudaPageInEngine("cpu") for _ in range(2)]
    pools = [PromotionCache(cache, 8) for _ in range(2)]
    prefetchers = [StepPrefetcher(32, torch.float16, cache.pages.device, 4) for _ in range(2)]
    for call in range(24):
        layer = call % 3
        report = synthetic_report(int(torch.randint(1, 6, (1,), generator=gen)), 8, gen)
        traffic = torch.randint(0, 1000, (3,), generator=gen)
        host_bytes, seconds = int(torch.randint(0, 2, (1,), generator=gen)) * 4096, 1e-4 * (call + 1)
        lookups = torch.randint(50, 100, (1,), generator=gen)
        hits, served = torch.randint(0, 25, (1,), generator=gen), torch.randint(0, 25, (1,), generator=gen)
        for engine, pool, prefetch in zip(engines, pools, prefetchers, strict=True):
            if call % 4:  # some calls read nothing over PCIe
                engine.add_device_counts(*traffic)
            engine.stats.bytes += host_bytes
            engine.stats.seconds += seconds
            pool.counts += torch.cat((lookups, hits, torch.zeros(2, dtype=torch.int64)))
            prefetch.counts += torch.cat((served, served, served))
        with_prefetch = call % 5 != 0
        # the synchronous path
        stats = engines[0].take_stats()
        sync.record(report, layer, stats.bytes, stats.seconds)
        p = pools[0].take_stats()
        s = prefetchers[0].take_stats()["served"] if with_prefetch else 0
        sync.count_key_pages(p["hits"], s, p["lookups"] - p["hits"] - s)
        # the deferred path
        key_pages = KeyPageCounts(pools[1].take_stats_deferred(),
                                  prefetchers[1].take_stats_deferred() if with_prefetch else None)  # fmt: skip
        deferred.record(report, layer, page_in=engines[1].take_stats_deferred(), key_pages=key_pages)
        if call == 11:  # a flush in the middle changes nothing
            sync.flush()
            deferred.flush()
    sync.flush()
    deferred.flush()
    want, got = samples(sync_registry), samples(deferred_registry)
    assert got == want
    assert want["vllm:cert_head_steps_total{engine=0,rung=4}"] > 0
    assert want["vllm:cert_key_pages_total{engine=0,rank=0,source=prefetch}"] > 0
    assert want["vllm:cert_page_in_bytes_total{engine=0,rank=0}"] > 0
    assert want["vllm:cert_page_in_seconds_count{engine=0,rank=0}"] > 0
    assert sum(v for k, v in want.items() if k.startswith("vllm:cert_layer_fallbacks_total")) > 0


def test_the_folded_values_are_those_of_the_reports(gen):
    """An oracle for the main series, computed from the reports directly."""
    m, registry = metrics("oracle", flush_seconds=3600)
    reports = [synthetic_report(3, 4, gen) for _ in range(5)]
    for i, r in enumerate(reports):
        m.record(r, i % 2, page_in=DeferredStats.of({"bytes": 100 * i, "seconds": 0.001 * i}))
    m.flush()
    got = samples(registry)
    rungs = torch.cat([r.rung.flatten() for r in reports])
    for rung in range(5):
        assert got[f"vllm:cert_head_steps_total{{engine=0,rung={rung}}}"] == int((rungs == rung).sum())
    assert got["vllm:cert_promoted_key_blocks_total{engine=0}"] == sum(int(r.k_star.sum()) for r in reports)
    assert got["vllm:cert_page_in_bytes_total{engine=0,rank=0}"] == 1000
    assert got["vllm:cert_page_in_seconds_count{engine=0,rank=0}"] == 4  # calls with bytes only
    certified = int((rungs <= 2).sum())
    assert got["vllm:cert_e_key_count{engine=0}"] == certified
    assert got["vllm:cert_e_key_bucket{engine=0,le=+Inf}"] == certified


def test_flush_is_exact_while_the_flusher_runs(gen):
    """Calls recorded while the flusher thread folds every millisecond: one ``flush()`` after the last call
    accounts for every call (the flusher's fold in progress included)."""
    m, registry = metrics("busy", flush_seconds=0.001)
    report = synthetic_report(2, 4, gen)
    for i in range(300):
        m.record(report, 0, page_in=DeferredStats.of({"bytes": 1, "seconds": 0.0}))
        if i % 50 == 0:
            time.sleep(0.005)  # let the flusher take some
    m.flush()
    got = samples(registry)
    assert got["vllm:cert_page_in_bytes_total{engine=0,rank=0}"] == 300
    assert sum(got[f"vllm:cert_head_steps_total{{engine=0,rung={r}}}"] for r in range(5)) == 300 * 8


class _Gated(DeferredStats):
    """Counts whose device part lands when ``gate`` is set (a copy still in flight)."""

    def __init__(self, gate: threading.Event, values: dict[str, float]) -> None:
        super().__init__(values)
        self.gate = gate

    def done(self) -> bool:
        return self.gate.is_set()

    def values(self) -> dict[str, float]:
        self.gate.wait()
        return super().values()


def test_flush_waits_for_values_in_flight(gen):
    m, registry = metrics("gated", flush_seconds=0.01)  # the flusher takes the call and waits with it
    gate = threading.Event()
    m.record(synthetic_report(1, 4, gen), 0, page_in=_Gated(gate, {"bytes": 64, "seconds": 0.5}))
    time.sleep(0.05)
    flusher = threading.Thread(target=m.flush)
    flusher.start()
    flusher.join(0.2)
    assert flusher.is_alive()  # flush() does not return with the call unfolded
    gate.set()
    flusher.join(5)
    assert not flusher.is_alive()
    assert samples(registry)["vllm:cert_page_in_bytes_total{engine=0,rank=0}"] == 64


def test_a_failing_fold_does_not_stop_the_flusher(gen, caplog):
    m, registry = metrics("broken", flush_seconds=0.01)
    report = synthetic_report(1, 4, gen)
    m.record(report, 0, key_pages=KeyPageCounts(DeferredStats.of({"hits": 1})))  # no "lookups": the fold fails
    deadline = time.monotonic() + 5
    while "folding the queued attention metrics failed" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "folding the queued attention metrics failed" in caplog.text
    m.record(report, 0, page_in=DeferredStats.of({"bytes": 5, "seconds": 0.0}))
    while samples(registry).get("vllm:cert_page_in_bytes_total{engine=0,rank=0}") != 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert samples(registry)["vllm:cert_page_in_bytes_total{engine=0,rank=0}"] == 5


def test_a_cpu_report_is_queued_as_it_is(gen):
    """On the CPU nothing is deferred: the report is queued without a copy (the caller does not reuse it)."""
    m, _ = metrics("host", flush_seconds=3600)
    report = synthetic_report(2, 4, gen)
    m.record(report, 0)
    assert m._pending[0].report is report


_RANK_WORKER = """
import sys, torch
from certvllm.bounds.report import CertReport
from certvllm.metrics import CertMetrics
rank = sys.argv[1]
m = CertMetrics("tp", "0", flush_seconds=3600, rank=rank)
m.set_host_tier_bytes(1000 * (int(rank) + 1))
m.set_layer_certified("3", True)
m.set_layer_certified("4", False)
report = CertReport.zeros(2, 3)
report.rung[1] = 4
report.canary_fail[1] = True
m.record(report, 7, page_in_bytes=10 * (int(rank) + 1), page_in_seconds=0.001)
m.flush()
"""


def test_worker_ranks_stay_apart_where_they_own_the_resource(tmp_path):
    """Two worker processes (tensor-parallel ranks 0 and 1) record into one ``PROMETHEUS_MULTIPROC_DIR``; the API
    server's collector (prometheus_client's ``MultiProcessCollector``, as vLLM's ``/metrics``) keeps the
    ``PER_RANK`` series apart by ``rank`` (host-tier bytes, page-in bytes and seconds, key-page sources, which
    layers are certified) and sums the rest over the ranks (head-steps, layer fallbacks by layer and reason)."""
    import os
    import subprocess
    import sys

    from prometheus_client.multiprocess import MultiProcessCollector

    from certvllm.metrics.prometheus import PER_RANK

    owned = {"vllm:cert_host_tier_bytes", "vllm:cert_page_in_bytes_total", "vllm:cert_page_in_seconds",
             "vllm:cert_key_pages_total", "vllm:cert_layer_certified"}  # fmt: skip
    assert owned == PER_RANK
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for rank in ("0", "1"):
        subprocess.run([sys.executable, "-c", _RANK_WORKER, rank], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    got = samples(registry)
    for rank, k in (("0", 1), ("1", 2)):
        assert got[f"vllm:cert_host_tier_bytes{{engine=0,rank={rank}}}"] == 1000 * k
        assert got[f"vllm:cert_page_in_bytes_total{{engine=0,rank={rank}}}"] == 10 * k
        assert got[f"vllm:cert_page_in_seconds_count{{engine=0,rank={rank}}}"] == 1
        assert got[f"vllm:cert_key_pages_total{{engine=0,rank={rank},source=host}}"] == 0
        assert got[f"vllm:cert_layer_certified{{engine=0,layer=3,rank={rank}}}"] == 1  # not 2: one per rank
        assert got[f"vllm:cert_layer_certified{{engine=0,layer=4,rank={rank}}}"] == 0
    assert got["vllm:cert_head_steps_total{engine=0,rung=0}"] == 2 * 3  # row 0 of both ranks
    assert got["vllm:cert_head_steps_total{engine=0,rung=4}"] == 2 * 3
    assert got["vllm:cert_layer_fallbacks_total{engine=0,layer=7,reason=canary}"] == 2  # one row on each rank
    assert not any("rank=" in k for k in got if k.startswith(("vllm:cert_head_steps", "vllm:cert_layer_fallbacks")))
