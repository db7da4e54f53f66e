"""Phase 1 (INT8 scores on the tensor cores) on a CUDA GPU at LLaMA-3.1-8B shapes, with dense SDPA in the same run.

Usage: python benchmarks/bench_phase1.py [--points 1x8192 1x32768 8x8192 8x32768 8x131072] [--iters 30]
                                         [--out runs/phase1.json]

Per point (batch × context; synthetic K/V of ``bench_decode.py``, pages written by the Triton write kernel):

* phase 1 alone, CUDA-graph replays, median ms and the rate on the key bytes it must read (codes, offsets, scale
  codes and header: 2,448 B per page at D = 128): ``mma`` (the Gluon kernel, what the CUDA path runs) and
  ``mma-triton`` (its Triton twin, the interpreter's);
* the whole certified call (``naive`` and ``default`` with a warm promotion pool), graph replays;
* checks, on every point: both kernels' scores of the first row within R_b of the float64 INT8 scores, the Gluon R_b
  equal to the Triton twin's to float32 rounding; the default call's rungs and median bound over V_max, and its
  certified heads of row 0 against float64 attention over the originals (violations must be 0).

The float32 phase 1 it replaced was measured against it in the same runs (``benchmarks/results/h200_phase1_mma.json``,
docs/performance.md).

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_decode", _HERE / "bench_decode.py")
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)

KEY_BYTES_PER_PAGE = 2048 + 256 + 128 + 16
"""What phase 1 must read of a D = 128 page: codes, fp16 offsets, scale codes, header."""


def parse_point(text: str) -> tuple[int, int]:
    b, _, c = text.partition("x")
    return int(b), int(c)


def phase1_call(q, cache, tables, nfull, tuning):
    from certvllm.triton_kernels.common import split_plan
    from certvllm.triton_kernels.phase1 import phase1

    from certvllm.attention.gpu import _lut
    from certvllm.bounds import delta_factor

    R, Hq, D = q.shape
    K = cache.num_kv_heads
    splits, bps = split_plan(tables.shape[1], R * K, tuning=tuning)
    lut = _lut(q.device)
    return lambda: phase1(q, cache.pages, tables, nfull, lut, cache.layout, K, cache.sub_blocks, delta_factor(D),
                          splits, bps, tuning=tuning)  # fmt: skip


def run_point(batch: int, ctx: int, iters: int) -> dict:
    from certvllm.triton_kernels.tuning import KernelTuning

    from certvllm.attention import certified_attention
    from certvllm.attention.gpu import CudaOptions
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.testing import exact_int8_scores

    dev = torch.device("cuda")
    t0 = time.time()
    q, k, v = bd.synthetic_kv(batch, ctx, seed=ctx + batch)
    lens = [ctx - 7] * batch
    cache, tables = bd.build_cache(k, v, lens)
    seq_lens = torch.tensor(lens, device=dev)
    nfull = (seq_lens // 16).long()
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    qs = (q.float() * scale).contiguous()
    rec: dict = {"batch": batch, "context": ctx, "setup_s": round(time.time() - t0, 1)}
    kd = k[:, : lens[0]].permute(0, 2, 1, 3).contiguous()
    vd = v[:, : lens[0]].permute(0, 2, 1, 3).contiguous()
    qd = q.unsqueeze(2)
    rec["dense_ms"] = bd.time_graph(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True),
                                    iters)  # fmt: skip
    pages = batch * (lens[0] // 16) * cache.num_kv_heads
    variants = {"mma": KernelTuning(), "mma-triton": KernelTuning(dialect="triton")}
    outs = {}
    for name, tun in variants.items():
        fn = phase1_call(qs, cache, tables, nfull, tun)
        outs[name] = fn()
        torch.cuda.synchronize()
        ms = bd.time_graph(fn, iters)
        rec[f"phase1_{name}_ms"] = ms
        rec[f"phase1_{name}_GBps"] = pages * KEY_BYTES_PER_PAGE / (ms * 1e-3) / 1e9 if ms else None
    # ---- checks of the MMA kernel on row 0
    got, twin = outs["mma"], outs["mma-triton"]
    n0 = int(nfull[0])
    exact = exact_int8_scores(qs[0], cache, tables[0, :n0])  # [K, n, G, 16]
    for name in ("mma", "mma-triton"):
        o = outs[name]
        err = (o.scores[0, :, :n0].double() - exact).abs()
        bound = o.rmax[0, :, :, :n0].double().permute(0, 2, 1).unsqueeze(-1)
        rec[f"{name}_score_violations"] = int((err > bound).sum())
        rec[f"{name}_err_over_bound_max"] = float((err / bound).max())
    rec["mma_gluon_vs_triton_rmax_max_rel_diff"] = float(
        ((got.rmax - twin.rmax).abs() / twin.rmax.abs().clamp_min(1e-30)).nan_to_num(0.0).max()
    )
    # ---- the whole certified call with each arithmetic
    for preset in ("naive", "default"):
        cfg = bd.method_config(preset)
        for name in ("mma",):
            residency = bd.method_residency(cache, cfg)
            eng = CudaPageInEngine(dev)
            opts = CudaOptions(tuning=variants[name])

            def call(cfg=cfg, eng=eng, residency=residency, opts=opts):
                return certified_attention(q, cache, tables, seq_lens, cfg, scale, pagein=eng, residency=residency,
                                           cuda_options=opts)  # fmt: skip

            res = call()
            torch.cuda.synchronize()
            rec[f"{preset}_{name}_ms"] = bd.time_graph(call, iters)
            rungs = torch.bincount(res.report.rung.flatten().long().cpu(), minlength=5)
            rec[f"{preset}_{name}_rungs"] = [int(x) for x in rungs]
            if preset == "default":
                cert = res.report.rung <= 2
                rel = (res.report.bound / res.report.v_max)[cert]
                rec[f"default_{name}_bound_over_vmax_median"] = float(rel.median()) if rel.numel() else None
                errs = torch.linalg.vector_norm(res.out[0].double() - _exact_row(q, k, v, lens[0], scale, 0), dim=-1)
                rec[f"default_{name}_row0_violations"] = int(((errs > res.report.bound[0].double()) & cert[0]).sum())
            del res
    bd.release_cache(cache)
    return rec


def _exact_row(q, k, v, n, scale, row):
    from certvllm.testing import exact_attention

    return exact_attention(q[row], k[row, :n], v[row, :n], scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x8192", "1x32768", "8x8192", "8x32768", "8x131072"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("runs/phase1.json"))
    a = ap.parse_args()
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}  # fmt: skip
    results = []
    t0 = time.time()
    for text in a.points:
        b, c = parse_point(text)
        rec = run_point(b, c, a.iters)
        results.append(rec)
        print(json.dumps(rec), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    meta["wall_s"] = round(time.time() - t0, 1)
    a.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\n{'point':>10} {'dense':>7} {'phase 1':>8} {'GB/s':>6} {'triton':>7} {'naive':>7} {'default':>8} "
          f"{'rungs (default)':>22} {'viol':>4}")  # fmt: skip
    for r in results:

        def f(x):
            return f"{x:.3f}" if isinstance(x, float) else "n/a"

        viol = r["mma_score_violations"] + r["mma-triton_score_violations"] + r["default_mma_row0_violations"]
        print(f"{r['batch']}x{r['context']:>7} {f(r['dense_ms']):>7} {f(r['phase1_mma_ms']):>8} "
              f"{r['phase1_mma_GBps'] or 0:6.0f} {f(r['phase1_mma-triton_ms']):>7} {f(r['naive_mma_ms']):>7} "
              f"{f(r['default_mma_ms']):>8} {str(r['default_mma_rungs']):>22} {viol:>4}")  # fmt: skip


if __name__ == "__main__":
    main()
