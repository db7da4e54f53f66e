"""Probe of the resident decode pass on a GPU: compile and run time of each of its kernels, one at a time
(synchronised), at LLaMA-3.1-8B shapes. Usage: python benchmarks/probe_resident.py [--context 32768] [--batch 8]"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

import torch


def _bench():
    path = Path(__file__).resolve().parent / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(label, fn, reps=1):
    torch.cuda.synchronize()
    t = time.time()
    out = fn()
    torch.cuda.synchronize()
    first = time.time() - t
    t = time.time()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    print(f"{label:28s} first {first:8.2f} s, then {(time.time() - t) / reps * 1e3:8.3f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--preset", default="budget")
    args = ap.parse_args()
    bench = _bench()
    from certvllm.triton_kernels.common import split_plan
    from certvllm.triton_kernels.fused import FusedGeometry, fused_pass

    from certvllm.attention import certified_attention
    from certvllm.bounds import delta_factor, rounding_factor
    from certvllm.config import load_config
    from certvllm.kv.cuda_pagein import CudaPageInEngine

    q, k, v = bench.synthetic_kv(args.batch, args.context, seed=1)
    lens = [args.context - 7] * args.batch
    cache, tables = bench.build_cache(k, v, lens)
    seq = torch.tensor(lens, device="cuda")
    cfg = load_config(args.preset, decode_pass="resident")
    res = bench.method_residency(cache, cfg)
    R, K, D = args.batch, 8, 128
    B = tables.shape[1]
    splits, bps = split_plan(B, R * K)
    print(f"B={B} splits={splits} bps={bps}", flush=True)
    geo = FusedGeometry(cache.layout, K, 4, cache.sub_blocks, cache.num_blocks, splits, bps, False)
    qs = (q.float() / math.sqrt(D)).contiguous()
    nfull = (seq // 16).to(torch.int64)
    pool = res.pool
    pargs = (pool.pool, pool.values, pool.tag, pool.tag_gen, pool.generation)
    timed(
        "fused (pool, no bits)",
        lambda: fused_pass(
            geo, qs, cache.pages, cache.shadow, tables, nfull, delta_factor(D), rounding_factor(D), pool=pargs
        ),
        10,
    )
    eng = CudaPageInEngine("cuda")
    call = lambda: certified_attention(q, cache, tables, seq, cfg, 1 / math.sqrt(D), pagein=eng, residency=res)  # noqa: E731
    out = timed("resident call (eager)", call, 5)
    print(
        "rungs",
        torch.bincount(out.report.rung.flatten().long().cpu(), minlength=5).tolist(),
        "k*",
        float(out.report.k_star.float().mean()),
        flush=True,
    )
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    timed("resident call (graph)", g.replay, 20)
    naive = load_config("naive")
    timed(
        "naive two-pass (eager)",
        lambda: certified_attention(q, cache, tables, seq, naive, 1 / math.sqrt(D), pagein=eng),
        5,
    )
    kd = k[:, : lens[0]].permute(0, 2, 1, 3).contiguous()
    vd = v[:, : lens[0]].permute(0, 2, 1, 3).contiguous()
    timed(
        "dense sdpa",
        lambda: torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, enable_gqa=True),
        20,
    )


if __name__ == "__main__":
    main()
