"""The certified part of ``CertifiedAttentionImpl.forward`` records its report and counters without reading
the device: on the CPU the metrics still count every head-step of every call; on a CUDA GPU (``pytest -m
gpu``) steps of four layers with the promotion pool and the step prefetch run under
``torch.cuda.set_sync_debug_mode("error")`` (any synchronising call raises; the reports are summed on the device,
in the layer's graph where it has one, and read once per step) and ``flush()`` then accounts for every call.
The layer is driven directly (no engine): a bound layer state in a worker runtime, one step's metadata with the
certified rows at scattered token positions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from certvllm.testing import metric_samples

H_Q, H_KV, D = 8, 2, 64
TOKENS = 5
ROWS = [1, 3, 4]  # the certified rows' token positions; tokens 0 and 2 are not this layer call's


def _layers(device: str, n_layers: int, cfg):
    """``(impl, runtime, names, kv tensors, metadata, queries, recorded reports)`` for ``n_layers`` layers
    over one batch of three sequences."""
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.residency import Residency
    from certvllm.metrics import CertMetrics
    from certvllm.testing import make_case, paged_batch
    from certvllm.vllm_plugin.backend import CertifiedAttentionImpl, CertifiedMetadata
    from certvllm.vllm_plugin.runtime import LayerState, WorkerRuntime

    gen = torch.Generator().manual_seed(21)
    cases = [make_case("sink_and_recency", t, H_Q, H_KV, D, torch.bfloat16, gen) for t in (700, 290, 37)]
    host, tables, lens = paged_batch(cases)
    runtime = WorkerRuntime(cfg, "fwd", "0")
    runtime.metrics = CertMetrics("fwd", "0", flush_seconds=3600, registry=CollectorRegistry())
    names, kvs = [], []
    for i in range(n_layers):
        name = f"model.layers.{i}.self_attn.attn"
        if device == "cuda":
            cache = LayerKVCache(host.pages.cuda(), host.shadow.pin_memory(), host.layout, host.keys_channel_major)
            residency = Residency.for_layer(cache, cfg.promotion_cache_fraction)
            if cfg.step_prefetch_fraction > 0:
                if runtime.prefetcher is None:
                    from certvllm.kv.prefetch import StepPrefetcher

                    runtime.prefetcher = StepPrefetcher.for_cache(cache, cfg.step_prefetch_fraction)
                residency.prefetcher = runtime.prefetcher
                residency.prefetch_index = runtime.prefetcher.register(cache)
        else:
            cache = LayerKVCache(host.pages.clone(), host.shadow.clone(), host.layout, host.keys_channel_major)
            residency = Residency()
        runtime.layers[name] = LayerState(name, i, cache, residency)
        e, h, run = cache.pages.shape
        names.append(name)
        kvs.append(cache.pages.view(e, h, 16, run // 16))  # vLLM's [blocks, H_kv, B, 2·D] view of the pages
    impl = CertifiedAttentionImpl.__new__(CertifiedAttentionImpl)  # what __init__ sets, without a vLLM config
    impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads = H_Q, D, 1 / math.sqrt(D), H_KV
    impl.config, impl.runtime, impl.dtype = cfg, runtime, torch.bfloat16
    impl.generator, impl._exact = torch.Generator().manual_seed(0), None
    tables = tables.to(device)
    meta = CertifiedMetadata(num_actual_tokens=TOKENS, row_tokens=torch.tensor(ROWS), row_block_table=tables,
                             row_engine_table=tables, row_seq_lens=lens.to(torch.int64),
                             row_tokens_dev=torch.tensor(ROWS, device=device),
                             row_seq_lens_dev=lens.to(device, torch.int64), exact_tokens=None, exact_plan=None,
                             exact_all=False)  # fmt: skip
    q = torch.zeros(TOKENS, H_Q, D, dtype=torch.bfloat16)
    q[ROWS] = torch.stack([c.q for c in cases]).to(torch.bfloat16)
    runtime.note_layers(dict.fromkeys(names, True))  # as the metadata builder does: the step closes at the last
    reports = []
    record = runtime.record_call

    def spy(state, report, *args, **kwargs):
        # a copy on the device (no synchronisation): a CUDA graph's outputs are rewritten by later replays
        reports.append(report.select(torch.arange(report.rung.shape[0], device=report.rung.device)))
        record(state, report, *args, **kwargs)

    runtime.record_call = spy
    return impl, runtime, names, kvs, meta, q.to(device).view(TOKENS, -1), reports


def _step(impl, runtime, names, kvs, meta, query) -> list[torch.Tensor]:
    """One step's layer calls (the metadata builder starts the step prefetch first); their outputs."""
    runtime.begin_step()
    outs = []
    for name, kv in zip(names, kvs, strict=True):
        out = torch.zeros_like(query)
        impl.forward(SimpleNamespace(layer_name=name), query, query, query, kv, meta, out)
        outs.append(out.view(TOKENS, H_Q, D))
    return outs


def _check(outs, reports, got) -> None:
    others = [t for t in range(TOKENS) if t not in ROWS]
    for out in outs:  # the certified rows went to their tokens, nothing else was written
        assert bool(out[others].eq(0).all()) and bool(out[ROWS].isfinite().all()) and bool(out[ROWS].ne(0).any())
    rungs = torch.cat([r.rung.flatten().cpu() for r in reports]).long()
    assert rungs.numel() == len(reports) * len(ROWS) * H_Q
    for rung, n in enumerate(torch.bincount(rungs, minlength=5).tolist()):
        assert got[f"vllm:cert_head_steps_total{{rung={rung}}}"] == n, rung
    assert got["vllm:cert_promoted_key_blocks_total{}"] == sum(int(r.k_star.sum()) for r in reports)


def test_forward_records_every_call_on_the_cpu():
    pytest.importorskip("vllm")
    from certvllm.config import load_config

    impl, runtime, names, kvs, meta, query, reports = _layers("cpu", 2, load_config("default"))
    outs = []
    for _ in range(2):
        outs += _step(impl, runtime, names, kvs, meta, query)
    runtime.metrics.flush()
    _check(outs, reports, metric_samples(runtime.metrics._registry))
    assert len(reports) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build")
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager_with_prefetch"])
def test_forward_never_synchronises_on_cuda(graphs):
    """Both CUDA modes: the layer calls replayed from CUDA graphs (the default), and eager calls with the step
    prefetch (``cuda_graphs: false``)."""
    pytest.importorskip("vllm")
    from certvllm.config import load_config

    cfg = load_config("default", promotion_cache_fraction=0.05, prefetch_fraction=0.5, cuda_graphs=graphs)
    impl, runtime, names, kvs, meta, query, reports = _layers("cuda", 4, cfg)
    for _ in range(2):  # warm-up: kernels compiled, LUTs cached, grids allocated
        _step(impl, runtime, names, kvs, meta, query)
    runtime.metrics.flush()
    warm, reports[:] = metric_samples(runtime.metrics._registry), []
    outs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            outs += _step(impl, runtime, names, kvs, meta, query)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    runtime.metrics.flush()
    got = {k: v - warm.get(k, 0.0) for k, v in metric_samples(runtime.metrics._registry).items()}
    _check(outs, reports, got)
    assert len(reports) == 12
    assert sum(got[f"vllm:cert_key_pages_total{{rank=0,source={s}}}"] for s in ("pool", "prefetch", "host")) > 0
    assert got["vllm:cert_page_in_bytes_total{rank=0}"] > 0
    graphed = runtime._layer_graphs(query.device)
    assert (graphed is not None and len(graphed) == len(names) and graphed.replays >= 12) == graphs
