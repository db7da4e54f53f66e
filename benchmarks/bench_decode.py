"""Decode-attention benchmark on a CUDA GPU: one attention layer at LLaMA-3.1-8B shapes.

Usage: python benchmarks/bench_decode.py [--contexts 8192 32768 65536 131072] [--batches 1 8]
                                         [--iters 30] [--out runs/decode.json]

Per (batch, context) and method — dense SDPA over FP16 K/V in device memory, naive INT8-K/INT4-V, and
certified attention with the ``paper`` and ``default`` presets — it prints the median ms per layer call
(CUDA events; CUDA-graph replays, plus eager for dense and for the certified default with the SDPA
fallback, whose one end-of-layer synchronisation a graph cannot hold; for the certified presets also
``served``: the call as the vLLM backend makes it, a ``LayerCallGraphs`` replay timed with its host work),
the ratio to dense, bytes moved against the floor, the page-in traffic and rate, the rung histogram and
the device bytes per token, and writes everything to JSON.

Synthetic K/V (``synthetic_kv``), per sequence and KV head, with the structure real decode attention
has: a direction u (unit, random) that the group's queries share; keys k_t = n_t + c_t·u with n_t ~ N(0, I)
and four outlier channels scaled ×6 (queries are small there, ×0.1, as in real models); logit offsets c_t
for an attention sink (the first 4 tokens), a recency ramp over the last 256 tokens and 5 retrieval peaks
at random positions; query q_g = √D·(u + 0.5·ε_g) with a per-head unit ε_g, so the diffuse part of the
scores has standard deviation ≈ 1.1 and the heads of a group disagree on it. The offsets are solved so that
a fraction ``diffuse_mass`` (default 2 %) of the attention stays on the diffuse tokens and the rest splits
50/30/20 over sink, recency and peaks. Values are N(0, 1).

``--score-std σ`` draws the other workload instead, the one the served 8B-shaped benchmarks meet
(``--load-format certvllm-peaked-dummy``): no structure, keys and values N(0, I) and each query head a random
direction of norm σ·√D, so every score q·k/√D is N(0, σ²). At σ = 6 the softmax mass sits on a few hundred
tokens scattered over the whole context, and the default preset promotes the keys of about a third of the blocks
(K* ≈ 640 of 2,048 at 32K, the vLLM run's ``cert_promoted_key_blocks_total`` per head-step), against ~15 for the
structured workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests, bench_phase1): its siblings
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from dense_baselines import BASELINES, build_baseline, relative_error, require_fa3  # noqa: E402

HQ, HKV, D = 32, 8, 128
PRESETS = ("naive", "paper", "coverage", "default", "default+resident")
"""Methods: a preset name, ``+resident`` for ``decode_pass: resident`` (certvllm.attention.resident)."""
MULTISTEP = ("coverage", "default", "default+resident")
SCORE_STD_HELP = "the unstructured workload (module docstring): scores N(0, σ²); 6 as the served peaked-dummy model"


def method_config(name: str, kernel_tuning: str = ""):
    """The ``CertConfig`` of a method of :data:`PRESETS`, launched with ``kernel_tuning`` (``CertConfig.kernel_tuning``:
    comma-separated ``FIELD=VALUE`` pairs of ``KernelTuning``; ``""``: the defaults)."""
    from certvllm.config import load_config

    preset, _, variant = name.partition("+")
    return load_config(preset, decode_pass="resident" if variant == "resident" else "two_pass",
                       kernel_tuning=kernel_tuning)  # fmt: skip


def method_residency(cache, cfg):
    """A fresh residency (promotion pool) for a method's config; none outside certified mode."""
    from certvllm.kv.residency import Residency, pool_values

    if cfg.mode != "certified":
        return Residency()
    return Residency.for_layer(cache, cfg.promotion_cache_fraction, pool_values(cfg.decode_pass))


def _tuning(kernel_tuning: str = ""):
    from certvllm.triton_kernels.tuning import parse_tuning

    return parse_tuning(kernel_tuning)


# ----------------------------------------------------------------------------------------------- data
def _solve_ramp(target: float, n: int) -> float:
    """A with Σ_{i<n} exp(A·i/(n−1)) = target (bisection)."""
    lo, hi = 0.0, 60.0
    i = torch.arange(n, dtype=torch.float64) / max(1, n - 1)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if float(torch.exp(mid * i).sum()) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def synthetic_kv(
    batch: int,
    t: int,
    hq: int = HQ,
    hkv: int = HKV,
    d: int = D,
    diffuse_mass: float = 0.02,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cuda",
    seed: int = 0,
    score_std: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[batch, hq, d]`` and keys/values ``[batch, t, hkv, d]`` (see the module docstring): the
    structured workload, or with ``score_std`` the unstructured one whose scores are N(0, score_std²)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if score_std is not None:
        q = torch.randn(batch, hq, d, generator=g, device=device)
        q = q * (score_std * math.sqrt(d) / q.norm(dim=-1, keepdim=True))
        k = torch.randn(batch, t, hkv, d, generator=g, device=device)
        v = torch.randn(batch, t, hkv, d, generator=g, device=device)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    group = hq // hkv
    u = torch.randn(batch, hkv, d, generator=g, device=device)
    u = u / u.norm(dim=-1, keepdim=True)
    eps = torch.randn(batch, hkv, group, d, generator=g, device=device)
    eps = eps / eps.norm(dim=-1, keepdim=True)
    q = math.sqrt(d) * (u.unsqueeze(2) + 0.5 * eps)
    outliers = torch.arange(4, device=device) * (d // 4) + 3
    q[..., outliers] *= 0.1
    z_diffuse = t * math.exp(0.5 * 1.25)
    z_struct = z_diffuse * (1.0 - diffuse_mass) / diffuse_mass
    c = torch.zeros(batch, t, device=device)
    c[:, : min(4, t)] = math.log(0.5 * z_struct / min(4, t))
    nrec = min(256, t)
    a_rec = _solve_ramp(0.3 * z_struct, nrec)
    c[:, t - nrec :] = torch.maximum(c[:, t - nrec :], a_rec * torch.linspace(0, 1, nrec, device=device))
    peaks = torch.randint(4, max(5, t - nrec), (batch, 5), generator=g, device=device)
    c.scatter_(1, peaks.clamp(max=t - 1), math.log(0.2 * z_struct / 5))
    k = torch.randn(batch, t, hkv, d, generator=g, device=device)
    k[..., outliers] *= 6.0
    k = k + c[:, :, None, None] * u[:, None]
    v = torch.randn(batch, t, hkv, d, generator=g, device=device)
    return q.reshape(batch, hq, d).to(dtype), k.to(dtype), v.to(dtype)


def build_cache(k: torch.Tensor, v: torch.Tensor, lens: list[int], seed: int = 0):
    """A paged cache holding the first ``lens[b]`` tokens of each sequence: pages on the device (written by
    the Triton write kernel), shadow in pinned host memory; blocks in shuffled order, block 0 unused.

    Returns ``(cache, block_tables [batch, nb] int64 on the device)``."""
    from certvllm.triton_kernels.encode import encode_into

    from certvllm.formats.layout import BLOCK_SIZE, PageLayout
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.host import allocate_host

    batch, t, hkv, d = k.shape
    dev = k.device
    nb = -(-max(lens) // BLOCK_SIZE)
    lay = PageLayout(d)
    e = batch * nb + 1
    perm = torch.randperm(batch * nb, generator=torch.Generator().manual_seed(seed)) + 1
    tables = perm.view(batch, nb).to(dev)
    pad = nb * BLOCK_SIZE - t
    kk = F.pad(k, (0, 0, 0, 0, 0, pad)) if pad > 0 else k[:, : nb * BLOCK_SIZE]
    vv = F.pad(v, (0, 0, 0, 0, 0, pad)) if pad > 0 else v[:, : nb * BLOCK_SIZE]
    staging = torch.zeros(e, hkv, 2, BLOCK_SIZE, d, dtype=k.dtype, device=dev)
    blocks_k = kk.view(batch, nb, BLOCK_SIZE, hkv, d).permute(0, 1, 3, 2, 4).reshape(batch * nb, hkv, BLOCK_SIZE, d)
    blocks_v = vv.view(batch, nb, BLOCK_SIZE, hkv, d).permute(0, 1, 3, 2, 4).reshape(batch * nb, hkv, BLOCK_SIZE, d)
    ids = tables.reshape(-1)
    staging[ids, :, 0] = blocks_k
    staging[ids, :, 1] = blocks_v
    for b, n in enumerate(lens):  # tokens past a row's length are not part of its context
        tail = n % BLOCK_SIZE
        if tail:
            staging[tables[b, n // BLOCK_SIZE], :, :, tail:] = 0
    shadow = allocate_host((e, hkv, 2, BLOCK_SIZE, d), k.dtype, pin=True)  # cudaHostRegister: exact size
    shadow.copy_(staging)
    pages = torch.zeros(e, hkv, lay.page_bytes, dtype=torch.uint8, device=dev)
    full = torch.cat([tables[b, : n // BLOCK_SIZE] for b, n in enumerate(lens)])
    item = full.repeat_interleave(hkv)
    heads = torch.arange(hkv, device=dev).repeat(full.numel())
    run = BLOCK_SIZE * d
    base = ((item * hkv + heads) * 2) * run
    encode_into(pages, (item * hkv + heads) * lay.page_bytes, staging, base, staging, base + run, lay)
    del staging
    return LayerKVCache(pages, shadow, lay), tables


def append_tokens(cache, tables, seq_lens, k, v) -> None:
    """Append one token to every row through the CUDA write path: its originals (taken from ``k``/``v`` at
    the row's current length) into the shadow, the pages of the blocks this completes encoded on the device
    (both bump the blocks' write generations); ``seq_lens`` (device) grows by one in place."""
    from certvllm.kv.cuda_pagein import encode_blocks_from_shadow

    rows = torch.arange(k.shape[0], device=k.device)
    pos = seq_lens.to(torch.int64)
    slots = tables[rows, pos // 16] * 16 + pos % 16
    full = cache.write_shadow(k[rows, pos], v[rows, pos], slots.cpu())
    if full.numel():
        encode_blocks_from_shadow(cache, full.to(k.device))
    seq_lens += 1


def release_cache(cache) -> None:
    """Unregister the pinned shadow before it is freed (the allocator may hand its address out again)."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(cache.shadow.data_ptr())


# ----------------------------------------------------------------------------------------------- timing
def median_ms(run, iters: int) -> float:
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def time_eager(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    return median_ms(fn, iters)


def capture_graph(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` run ``warmup`` times (allocations, compiles, pools), then captured into a CUDA graph."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn, iters: int) -> float | None:
    """Median ms of CUDA-graph replays of ``fn`` (None if it cannot be captured)."""
    for _ in range(2):
        fn()
    try:
        graph = capture_graph(fn, warmup=0)
    except Exception as err:  # noqa: BLE001 - report and fall back to eager numbers
        print(f"    (graph capture failed: {type(err).__name__}: {str(err)[:160]})", flush=True)
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    ms = median_ms(graph.replay, iters)
    del graph
    return ms


# ----------------------------------------------------------------------------------------------- main
def run_point(batch: int, ctx: int, args, results: list[dict]) -> None:
    from certvllm.triton_kernels.gather import gather_pages

    from certvllm.attention import certified_attention
    from certvllm.attention.gpu import stage_times
    from certvllm.attention.graphs import LayerCallGraphs
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.residency import Residency

    dev = torch.device("cuda")
    t0 = time.time()
    q, k, v = synthetic_kv(batch, ctx, diffuse_mass=args.diffuse_mass, seed=ctx + batch, score_std=args.score_std)
    lens = [ctx - 7] * batch  # a 9-token partial block at the end of every row
    cache, tables = build_cache(k, v, lens)
    seq_lens = torch.tensor(lens, device=dev)
    scale = 1.0 / math.sqrt(D)
    setup_s = time.time() - t0
    tokens = batch * lens[0]
    fp16_bytes = tokens * HKV * D * 2 * 2
    page_bytes = batch * (lens[0] // 16) * HKV * cache.layout.page_bytes
    rec: dict = {"batch": batch, "context": ctx, "seq_len": lens[0], "setup_s": round(setup_s, 2)}

    dense = build_baseline("sdpa", q, k, v, lens[0], scale)
    rec["dense_eager_ms"] = time_eager(dense, args.iters)
    rec["dense_ms"] = time_graph(dense, args.iters) or rec["dense_eager_ms"]
    rec["dense_GBps"] = fp16_bytes / (rec["dense_ms"] * 1e-3) / 1e9
    rec["fp16_bytes"] = fp16_bytes
    rec["page_bytes"] = page_bytes
    print(f"  b={batch} ctx={ctx}: setup {setup_s:.1f}s, dense {rec['dense_ms']:.3f} ms "
          f"(eager {rec['dense_eager_ms']:.3f})", flush=True)  # fmt: skip
    reference = dense()
    for name in args.baselines:
        if name == "sdpa":
            continue
        run = build_baseline(name, q, k, v, lens[0], scale)
        b = {"eager_ms": time_eager(run, args.iters), "graph_ms": time_graph(run, args.iters)}
        b["ms"] = b["graph_ms"] or b["eager_ms"]
        b["ratio_to_dense"] = b["ms"] / rec["dense_ms"]
        b["max_rel_err_vs_sdpa"] = relative_error(run(), reference)
        rec[name] = b
        print(f"    {name:8s} graph {_fmt(b['graph_ms'])} ms, eager {b['eager_ms']:.3f} ms, "
              f"×{b['ratio_to_dense']:.2f} dense, max rel. error vs SDPA {b['max_rel_err_vs_sdpa']:.2e}",
              flush=True)  # fmt: skip
        del run
    del reference

    default_pool = None
    for preset in args.methods:
        cfg = method_config(preset, args.kernel_tuning)
        eng = CudaPageInEngine(dev)
        certified = cfg.mode == "certified"
        residency = method_residency(cache, cfg)

        def call(cfg=cfg, eng=eng, residency=residency):  # what the vLLM backend calls
            return certified_attention(q, cache, tables, seq_lens, cfg, scale, pagein=eng, residency=residency)

        timings: dict = {}
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        res = certified_attention(q, cache, tables, seq_lens, cfg, scale, pagein=eng, residency=residency,
                                  timings=timings)  # fmt: skip
        torch.cuda.synchronize()
        workspace = torch.cuda.max_memory_allocated() - base_mem
        stages = stage_times(timings)
        stats = eng.take_stats()
        r = {"preset": preset}
        pool = residency.pool
        if preset == "default":
            default_pool = pool
        if pool is not None:
            pool.take_stats()
        r["eager_ms"] = time_eager(call, args.iters)
        r["graph_ms"] = time_graph(call, args.iters)  # warm: the same step replayed, the pool holds its pages
        r["ms"] = r["graph_ms"] or r["eager_ms"]
        if certified:  # the call as the vLLM backend serves it: a LayerCallGraphs replay, host work included
            graphs = LayerCallGraphs(dev, max_rows=batch)
            served = Residency(pool=residency.pool)
            r["served_ms"] = time_eager(lambda cfg=cfg, eng=eng, graphs=graphs, served=served: graphs.run(
                "bench", q, cache, tables, seq_lens, cfg, scale, pagein=eng, residency=served), args.iters)  # fmt: skip
            del graphs
        if pool is not None and cfg.decode_pass == "resident":
            st = pool.take_stats()
            r["pool_topup_lookups_per_call"] = st["lookups"] / max(1, args.iters)
        elif pool is not None:
            st = pool.take_stats()
            r["pool_repeat_hit_rate"] = st["hits"] / max(1, st["lookups"])
            off = cfg.model_copy(update={"promotion_cache_fraction": 0.0})
            r["nocache_ms"] = time_graph(lambda off=off: call(cfg=off, residency=Residency()), args.iters)

            def cold(cfg=cfg, pool=pool):  # every slot emptied first: each page misses (and is filled)
                pool.tag.fill_(-1)
                return call(cfg=cfg)

            r["cold_ms"] = time_graph(cold, args.iters)
            pool.take_stats()
        r["ratio_to_dense"] = r["ms"] / rec["dense_ms"]
        for name in args.baselines:
            if name in rec:
                r[f"ratio_to_{name}"] = r["ms"] / rec[name]["ms"]
        r["stages_ms"] = {k_: round(v_, 4) for k_, v_ in stages.items()}
        rungs = torch.bincount(res.report.rung.flatten().long().cpu(), minlength=5)
        r["rung_histogram"] = [int(x) for x in rungs]
        r["k_star_mean"] = float(res.report.k_star.float().mean())
        r["v_promoted_mean"] = float(res.report.v_promoted.float().mean())
        cert = res.report.rung <= 2
        rel = (res.report.bound / res.report.v_max)[cert]
        r["bound_over_vmax_median"] = float(rel.median()) if rel.numel() else None
        r["pagein_bytes"] = int(stats.bytes)  # fused promotions + the trailing partial block
        r["pagein_key_blocks"] = int(stats.key_blocks)
        ph2 = stages.get("promote", 0.0) + stages.get("attend", 0.0)
        r["pagein_GBps_fused"] = stats.bytes / (ph2 * 1e-3) / 1e9 if ph2 > 0 else None
        r["workspace_bytes"] = int(workspace)
        r["workspace_bytes_per_token"] = workspace / max(1, tokens) / HKV
        # modeled HBM traffic of the kernels (bytes per (block, KV head) page): phase 1 reads the key part
        # and writes scores + per-block terms, the promotion pass reads bits and block maxima, the attend
        # pass reads scores and the value part
        g = HQ // HKV
        per_page = (2048 + 256 + 128 + 16) + (g * 64 + 3 * g * 4 + 8) + (4 + g * 4) + (g * 64 + 1024 + 512 + 8)
        r["hbm_bytes_model"] = per_page * (page_bytes // cache.layout.page_bytes)
        r["hbm_over_page_floor"] = r["hbm_bytes_model"] / page_bytes
        rec[preset] = r
        gms = f"{r['graph_ms']:.3f}" if r["graph_ms"] else "n/a"
        served_text = f", served {r['served_ms']:.3f} ms" if "served_ms" in r else ""
        print(f"    {preset:8s} graph {gms} ms, eager {r['eager_ms']:.3f} ms{served_text}, "
              f"×{r['ratio_to_dense']:.2f} dense, "
              f"K* {r['k_star_mean']:.0f}, rungs {r['rung_histogram']}, page-in {stats.bytes / 1e6:.1f} MB, "
              f"stages {r['stages_ms']}", flush=True)  # fmt: skip
        if "nocache_ms" in r:
            print(f"             promotion cache: no cache {_fmt(r['nocache_ms'])} ms, cold {_fmt(r['cold_ms'])} ms, "
                  f"warm (same step) {gms} ms, hit rate {r['pool_repeat_hit_rate']:.3f}", flush=True)  # fmt: skip
        del res
    if args.steps > 0:
        rec["multistep"] = multistep(cache, tables, q, k, v, lens, args)
        if args.layers > 0:
            rec["pipeline"] = pipeline(cache, tables, q, k, v, lens, args)

    # zero-copy gather rate for as many pages as the default preset promoted (at least 4096)
    npages = max(4096, rec.get("default", {}).get("pagein_bytes", 0) // (2 * 16 * D * 2))
    ids = torch.randint(1, cache.num_blocks, (npages,), device=dev)
    heads = torch.randint(0, HKV, (npages,), device=dev)
    out = torch.empty(npages, 2, 16, D, dtype=cache.shadow.dtype, device=dev)
    ms = time_eager(lambda: gather_pages(cache.shadow, ids, heads, dev, out=out), 10)
    rec["zero_copy_gather_GBps"] = out.numel() * 2 / (ms * 1e-3) / 1e9
    rec["device_bytes_per_token_ratio"] = cache.layout.page_bytes / 16 / cache.layout.fp16_bytes_per_token()
    pool = default_pool
    pool_per_token = pool.nbytes / (cache.num_blocks * 16 * HKV) if pool is not None else 0.0
    rec["pool_bytes"] = pool.nbytes if pool is not None else 0
    rec["pool_slots"] = pool.slots if pool is not None else 0
    rec["device_bytes_per_token_ratio_with_pool"] = (
        cache.layout.page_bytes / 16 + pool_per_token
    ) / cache.layout.fp16_bytes_per_token()
    results.append(rec)
    release_cache(cache)


def pipeline(cache, tables, q, k, v, lens, args) -> dict:
    """Whole decode steps over ``args.layers`` layers, one CUDA graph per step, without and with the step
    prefetch (``certvllm.kv.prefetch``). The layers are views of the same tokens, each with its own pool,
    write generations, appended tokens and walking query (the ``walk`` regime of :func:`multistep`, drawn
    per layer), so they select different pages. Per step: one token appended to every row of every layer,
    the queries move, the step's graph replays; reported per layer (step time / layers)."""
    from certvllm.attention import certified_attention
    from certvllm.config import load_config
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.prefetch import StepPrefetcher
    from certvllm.kv.residency import Residency

    dev = q.device
    n = args.layers
    scale = 1.0 / math.sqrt(D)
    start = [x - 32 for x in lens]
    cfg = load_config("default")
    out: dict = {"layers": n, "steps": args.steps, "prefetch_fraction": cfg.prefetch_fraction}
    for use in (False, True):
        views = [LayerKVCache(cache.pages, cache.shadow, cache.layout) for _ in range(n)]
        pf = StepPrefetcher.for_cache(views[0], cfg.prefetch_fraction) if use else None
        residencies = [Residency.for_layer(view, cfg.promotion_cache_fraction) for view in views]
        for res_, view in zip(residencies, views, strict=True) if pf is not None else ():
            res_.prefetcher, res_.prefetch_index = pf, pf.register(view)
        seqs = [torch.tensor(start, device=dev, dtype=torch.int64) for _ in range(n)]
        gen = torch.Generator(device=dev).manual_seed(2)
        qs = [(q.float() + 0.1 * torch.randn(q.shape, generator=gen, device=dev)).to(q.dtype) for _ in range(n)]
        eng = CudaPageInEngine(dev)

        def step(views=views, pf=pf, seqs=seqs, qs=qs, eng=eng, residencies=residencies):
            if pf is not None:
                pf.begin_step()
            for i in range(n):
                certified_attention(qs[i], views[i], tables, seqs[i], cfg, scale, pagein=eng,
                                    residency=residencies[i])  # fmt: skip
            if pf is not None:
                pf.end_step()

        graph = capture_graph(step)
        for res_ in residencies:
            res_.pool.take_stats()
        if pf is not None:
            pf.take_stats()
        times, hits, looks, served, cand = [], 0, 0, 0, 0
        for _ in range(args.steps):
            for i in range(n):
                append_tokens(views[i], tables, seqs[i], k, v)
                qs[i].copy_(qs[i].float() + 0.1 * torch.randn(q.shape, generator=gen, device=dev))
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / n)
            for res_ in residencies:
                st = res_.pool.take_stats()
                hits, looks = hits + st["hits"], looks + st["lookups"]
            if pf is not None:
                st = pf.take_stats()
                served, cand = served + st["served"], cand + st["candidates"]
        del graph
        key = "prefetch" if use else "pool"
        out[key] = {"median_ms_per_layer": statistics.median(times), "ms_per_layer": times,
                    "pool_hit_rate": hits / max(1, looks),
                    "lookups_per_layer_step": looks / args.steps / n}  # fmt: skip
        msg = ""
        if pf is not None:
            out[key].update(served=served / max(1, cand), ring_bytes=pf.nbytes,
                            served_per_layer_step=served / args.steps / n)  # fmt: skip
            msg = f", staged pages served {served / max(1, cand):.3f} of the pool's misses"
        print(f"    {n} layers/step, {key:8s} median {out[key]['median_ms_per_layer']:.3f} ms per layer "
              f"(pool hits {hits / max(1, looks):.3f}{msg})", flush=True)  # fmt: skip
        del views, pf, residencies
        torch.cuda.empty_cache()
    return out


def _fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.3f}"


def multistep(cache, tables, q, k, v, lens, args) -> dict:
    """Decode steps that differ: before each CUDA-graph replay one token is appended to every row (CUDA write
    path; a block that fills is encoded and its generation bumped) and the queries move. Two query regimes:
    ``walk`` (q ← q + 0.1·N(0, 1) per coordinate each step: the direction drifts ~9 % per step) and
    ``fresh`` (the per-head part ε of q = √D(u + 0.5ε) drawn anew each step: only the shared direction u, which
    carries the sink / recency / peak structure, persists). Each regime runs without the promotion cache
    and with it (a fresh pool; the graph's two warm-up calls and its capture run step 0's query first).
    Rows start 32 tokens shorter than the main case, so the appended tokens are the context's own."""
    from certvllm.attention import certified_attention
    from certvllm.config import load_config
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.cuda_pagein import CudaPageInEngine

    dev = q.device
    batch = q.shape[0]
    scale = 1.0 / math.sqrt(D)
    start = [n - 32 for n in lens]
    base = load_config("default")
    out: dict = {"steps": args.steps, "start_len": start[0], "fraction": base.promotion_cache_fraction}
    g = HQ // HKV
    variants = [("default", 0.0)] + [(m, base.promotion_cache_fraction) for m in MULTISTEP if m in args.methods]
    for regime in ("walk", "fresh"):
        for method, fraction in variants:
            cfg = method_config(method, args.kernel_tuning).model_copy(update={"promotion_cache_fraction": fraction})
            view = LayerKVCache(cache.pages, cache.shadow, cache.layout)  # a fresh pool, its own generations
            seq = torch.tensor(start, device=dev, dtype=torch.int64)
            gen = torch.Generator(device=dev).manual_seed(1)
            static_q = q.clone()
            eng = CudaPageInEngine(dev)
            residency = method_residency(view, cfg)
            rungs = torch.zeros(5, dtype=torch.int64)
            held: dict = {}  # the captured call's output tensors, rewritten by every replay

            def call(view=view, cfg=cfg, seq=seq, static_q=static_q, eng=eng, residency=residency, held=held):
                held["res"] = certified_attention(static_q, view, tables, seq, cfg, scale, pagein=eng,
                                                  residency=residency)  # fmt: skip
                return held["res"]

            graph = capture_graph(call)
            pool = residency.pool
            if pool is not None:
                pool.take_stats()
            times, hits, looks, fills, bypass = [], 0, 0, 0, 0
            u = None
            if regime == "fresh":  # recover u from the group's mean query direction (q = √D(u + 0.5ε))
                u = q.float().view(batch, HKV, g, D).mean(dim=2, keepdim=True) / math.sqrt(D)
            for _ in range(args.steps):
                append_tokens(view, tables, seq, k, v)
                if regime == "walk":
                    static_q.copy_(static_q.float() + 0.1 * torch.randn(q.shape, generator=gen, device=dev))
                else:
                    eps = torch.randn(batch, HKV, g, D, generator=gen, device=dev)
                    eps = eps / eps.norm(dim=-1, keepdim=True)
                    eps[..., torch.arange(4, device=dev) * (D // 4) + 3] *= 0.1  # as synthetic_kv's outliers
                    static_q.copy_((math.sqrt(D) * (u + 0.5 * eps)).reshape(q.shape))
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
                rungs += torch.bincount(held["res"].report.rung.flatten().long().cpu(), minlength=5)
                if pool is not None:
                    st = pool.take_stats()
                    hits, looks = hits + st["hits"], looks + st["lookups"]
                    fills, bypass = fills + st["fills"], bypass + st["bypass"]
            del graph
            key = f"{regime}_{'pool' if fraction > 0 else 'nocache'}"
            if "+" in method:
                key = f"{regime}_{method}"
            out[key] = {"median_ms": statistics.median(times), "first_ms": times[0], "ms": times,
                        "rung_histogram": [int(x) for x in rungs]}  # fmt: skip
            if pool is not None:
                out[key].update(hit_rate=hits / max(1, looks), lookups_per_step=looks / args.steps,
                                fills_per_step=fills / args.steps, bypass_per_step=bypass / args.steps)  # fmt: skip
            msg = f"hit rate {hits / max(1, looks):.3f}, {looks / args.steps:.0f} pages/step" if pool else ""
            print(f"    multi-step {key:22s} median {out[key]['median_ms']:.3f} ms (first {times[0]:.3f}) {msg} "
                  f"rungs {out[key]['rung_histogram']}", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--diffuse-mass", type=float, default=0.02)
    ap.add_argument("--score-std", type=float, default=None, help=SCORE_STD_HELP)
    ap.add_argument("--steps", type=int, default=16, help="multi-step case: decode steps per regime (0: skip)")
    ap.add_argument("--layers", type=int, default=8, help="whole-step case: layers per step (0: skip)")
    ap.add_argument("--methods", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--baselines", nargs="+", default=["sdpa"], choices=BASELINES,
                    help="dense baselines timed in the same run (sdpa always; fa3 and fa3-fp8 need vLLM)")  # fmt: skip
    ap.add_argument("--kernel-tuning", default="", metavar="FIELD=VALUE,...",
                    help="KernelTuning fields of all methods (CertConfig.kernel_tuning): promote_cuda=4")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("runs/decode.json"))
    args = ap.parse_args()
    try:
        _tuning(args.kernel_tuning)
    except ValueError as err:  # names the entry and the fix
        raise SystemExit(f"--kernel-tuning: {err}") from err
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA GPU")
    if any(b.startswith("fa3") for b in args.baselines):
        require_fa3()
    torch.backends.cuda.matmul.allow_tf32 = False
    results: list[dict] = []
    t0 = time.time()
    for batch in args.batches:
        for ctx in args.contexts:
            run_point(batch, ctx, args, results)
            torch.cuda.empty_cache()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"results": results}, indent=1))
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "shapes": {"H_q": HQ, "H_kv": HKV, "D": D}, "iters": args.iters, "diffuse_mass": args.diffuse_mass,
        "score_std": args.score_std,
        "wall_s": round(time.time() - t0, 1),
        "tuning": dataclasses.asdict(_tuning(args.kernel_tuning)),  # every launch choice (split plans, warps, dialect)
    }  # fmt: skip
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    extra = [b for b in args.baselines if b != "sdpa"]
    heads = " | ".join([f"{b} ms (×SDPA)" for b in extra] + [f"{m} ms (×SDPA{''.join(f', ×{b}' for b in extra)})"
                                                             for m in args.methods])  # fmt: skip
    print(f"\n| batch | context | SDPA ms | {heads} | rungs 0-4 per method |")
    print("|---|---|---|" + "---|" * (len(extra) + len(args.methods)) + "---|")
    for r in results:
        cells = [f"{r[b]['ms']:.3f} ({r[b]['ratio_to_dense']:.2f}×)" for b in extra]
        for p in args.methods:
            ratios = ", ".join(f"{r[p][f'ratio_to_{x}']:.2f}×" for x in ["dense"] + extra)
            cells.append(f"{r[p]['ms']:.3f} ({ratios})")
        hist = "; ".join(f"{p}: {r[p]['rung_histogram']}" for p in args.methods)
        print(f"| {r['batch']} | {r['context'] // 1024}K | {r['dense_ms']:.3f} | {' | '.join(cells)} | {hist} |")
    print("\nPromotion cache, default preset (ms per layer call, ×dense; hit rates of the pool):")
    print("| batch | context | no cache | cold (pool emptied) | warm (same step) | walk: no cache / pool (hits) | "
          "fresh: no cache / pool (hits) | VRAM/FP16 with pool |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        d, dm = r["default"], r["dense_ms"]
        x = lambda ms, dm=dm: "n/a" if ms is None else f"{ms:.3f} ({ms / dm:.2f}×)"  # noqa: E731
        mst = r.get("multistep", {})
        cells = []
        for regime in ("walk", "fresh"):
            a, b = mst.get(f"{regime}_nocache"), mst.get(f"{regime}_pool")
            cells.append(f"{x(a['median_ms'])} / {x(b['median_ms'])} ({b['hit_rate']:.2f})" if a and b else "n/a")
        print(f"| {r['batch']} | {r['context'] // 1024}K | {x(d.get('nocache_ms'))} | {x(d.get('cold_ms'))} | "
              f"{x(d['ms'])} ({d.get('pool_repeat_hit_rate', 0):.2f}) | {' | '.join(cells)} | "
              f"{r['device_bytes_per_token_ratio_with_pool']:.3f} |")  # fmt: skip
    piped = [r for r in results if "pipeline" in r]
    if piped:
        print(f"\nWhole steps of {piped[0]['pipeline']['layers']} layers (walk regime; ms per layer, ×dense; "
              "pool hit rate; share of the pool's misses served from the step prefetch):")  # fmt: skip
        print("| batch | context | pool | pool + step prefetch | served |")
        print("|---|---|---|---|---|")
        for r in piped:
            a, b, dm = r["pipeline"]["pool"], r["pipeline"]["prefetch"], r["dense_ms"]
            ma, mb = a["median_ms_per_layer"], b["median_ms_per_layer"]
            print(f"| {r['batch']} | {r['context'] // 1024}K | {ma:.3f} ({ma / dm:.2f}×, {a['pool_hit_rate']:.2f}) | "
                  f"{mb:.3f} ({mb / dm:.2f}×, {b['pool_hit_rate']:.2f}) | {b['served']:.2f} |")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
