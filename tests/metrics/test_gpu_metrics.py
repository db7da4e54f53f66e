"""Deferred metrics on a CUDA GPU (``pytest -m gpu``): device reads land in pinned memory behind an event,
counters are read and reset in stream order, and N certified layer calls (promotion pool and step prefetch
on) with their reports and counters recorded run under ``torch.cuda.set_sync_debug_mode("error")`` (any
synchronising call raises), after which ``flush()`` gives the exact counts."""

from __future__ import annotations

import pytest
import torch

from certvllm.testing import metric_samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class no_sync:
    """Within the block, a call that synchronises the host with the GPU raises."""

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")


def test_a_cuda_read_lands_in_pinned_memory_behind_its_event():
    from certvllm.kv.deferred import DeferredRead

    x = torch.arange(6, device="cuda", dtype=torch.int64)
    # pinned blocks of these sizes cached first: under pytest-xdist, a fresh cudaHostAlloc can wait behind
    # other processes pinning gigabytes for longer than the sleep below
    DeferredRead([x, (x * 0.5).view(2, 3), x > 2, x[:1].to(torch.int8)]).values()
    with no_sync():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the copy
        read = DeferredRead([x, (x * 0.5).view(2, 3), x > 2, x[:1].to(torch.int8)])
        assert not read.done()  # queued behind the sleep: nothing waited for it
    assert read.pinned
    got = read.values()  # waits on the event
    assert read.done()
    assert got[0].tolist() == list(range(6)) and got[1].tolist() == [[0, 0.5, 1], [1.5, 2, 2.5]]
    assert got[2].tolist() == [False, False, False, True, True, True] and got[3].tolist() == [0]
    assert all(t.device.type == "cpu" for t in got)


def test_counters_are_read_and_reset_in_stream_order():
    from certvllm.kv.deferred import DeferredRead

    counts = torch.zeros(3, dtype=torch.int64, device="cuda")
    with no_sync():
        counts += torch.arange(3, device="cuda") * 2 + 1  # made on the device (a host list would be copied)
        torch.cuda._sleep(100_000_000)
        first = DeferredRead.take(counts)
        counts += 1
        second = DeferredRead.take(counts)
    assert first.values()[0].tolist() == [1, 3, 5] and second.values()[0].tolist() == [1, 1, 1]
    assert counts.tolist() == [0, 0, 0]


def test_layer_calls_with_deferred_records_never_synchronise():
    """Steps of four layers over one batch, as the vLLM backend runs them: the certified op (pool and step
    prefetch on, rungs 3/4 on the device), then the page-in, pool and prefetch counters taken deferred and
    the report recorded. None of it synchronises; the flushed series equal the reports' counts and the
    counters' sums (accumulated on the device beside them)."""
    from prometheus_client import CollectorRegistry

    from certvllm.attention import certified_attention
    from certvllm.config import load_config
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.prefetch import StepPrefetcher
    from certvllm.kv.residency import Residency
    from certvllm.metrics import CertMetrics, KeyPageCounts
    from certvllm.testing import make_case, paged_batch

    gen = torch.Generator().manual_seed(11)
    cfg = load_config("default", promotion_cache_fraction=0.05, prefetch_fraction=0.5)
    cases = [make_case("sink_and_recency", t, 32, 8, 128, torch.bfloat16, gen) for t in (3000, 900, 77)]
    host, tables, lens = paged_batch(cases)
    tables, lens = tables.cuda(), lens.cuda()
    layers = [LayerKVCache(host.pages.cuda(), host.shadow.pin_memory(), host.layout, host.keys_channel_major)
              for _ in range(4)]  # fmt: skip
    prefetcher = StepPrefetcher.for_cache(layers[0], cfg.prefetch_fraction)
    residencies = [Residency.for_layer(lay, cfg.promotion_cache_fraction) for lay in layers]
    for lay, res in zip(layers, residencies, strict=True):
        res.prefetcher, res.prefetch_index = prefetcher, prefetcher.register(lay)
    engine = CudaPageInEngine("cuda")
    metrics = CertMetrics("gpu", "0", flush_seconds=3600, registry=CollectorRegistry())
    q0 = torch.stack([c.q for c in cases]).cuda()
    noise = [torch.randn(q0.shape, generator=gen).cuda() for _ in range(4)]

    totals = {"pool": torch.zeros(4, dtype=torch.int64, device="cuda"),
              "prefetch": torch.zeros(3, dtype=torch.int64, device="cuda"),
              "device": torch.zeros(3, dtype=torch.int64, device="cuda")}  # fmt: skip
    reports, host_bytes = [], 0

    def step(s: int, count: bool) -> None:
        nonlocal host_bytes
        prefetcher.begin_step()
        for i, (cache, res) in enumerate(zip(layers, residencies, strict=True)):
            q = (q0.float() + 0.05 * ((s + i) % 3) * noise[i]).to(q0.dtype)
            out = certified_attention(q, cache, tables, lens, cfg, pagein=engine, residency=res)
            if count:
                totals["pool"] += res.pool.counts
                totals["prefetch"] += prefetcher.counts
                if engine._device_counts is not None:
                    totals["device"] += engine._device_counts
                host_bytes += engine.stats.bytes
                reports.append(out.report)
            key_pages = KeyPageCounts(res.pool.take_stats_deferred(), prefetcher.take_stats_deferred())
            metrics.record(out.report, i, page_in=engine.take_stats_deferred(), key_pages=key_pages)

    for s in range(2):  # warm-up: kernels compiled, LUTs cached, the shadows registered, grids allocated
        step(s, count=False)
    metrics.flush()
    warm = metric_samples(metrics._registry)
    with no_sync():
        for s in range(2, 8):
            step(s, count=True)
    metrics.flush()
    got = {k: v - warm.get(k, 0.0) for k, v in metric_samples(metrics._registry).items()}

    rungs = torch.cat([r.rung.flatten() for r in reports]).long()
    for rung, n in enumerate(torch.bincount(rungs, minlength=5).tolist()):
        assert got[f"vllm:cert_head_steps_total{{rung={rung}}}"] == n, rung
    assert got["vllm:cert_promoted_key_blocks_total{}"] == sum(int(r.k_star.sum()) for r in reports)
    assert got["vllm:cert_promoted_value_blocks_total{}"] == sum(int(r.v_promoted.sum()) for r in reports)
    lookups, hits = totals["pool"][:2].tolist()
    served = int(totals["prefetch"][2])
    assert got["vllm:cert_key_pages_total{rank=0,source=pool}"] == hits
    assert got["vllm:cert_key_pages_total{rank=0,source=prefetch}"] == served
    assert got["vllm:cert_key_pages_total{rank=0,source=host}"] == lookups - hits - served
    assert got["vllm:cert_page_in_bytes_total{rank=0}"] == host_bytes + int(totals["device"][2])
    assert lookups > 0 and host_bytes > 0 and rungs.numel() == 6 * 4 * 3 * 32
    print(f"24 layer calls without a synchronisation: {lookups} key pages, {hits} pool hits, {served} staged")
