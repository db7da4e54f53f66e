"""The attend pass alone, in each of its kernel configurations, on the inputs of a real layer call (CUDA only).

Usage: python benchmarks/bench_attend.py [--points 1x8192 8x131072] [--configs triton cuda2 cuda4 cuda8]
                                         [--preset default] [--out runs/attend.json]

For each point (batch × context, the synthetic K/V of ``bench_decode``) one certified call runs with the
``preset`` and the arguments of its attend pass are kept (phase-2 scores, global maxima, promotion bits,
pages, shadow). The pass is then replayed in each configuration: ``triton`` (the Triton kernel) or
``cudaW`` (the CUDA kernel, ``csrc/cuda/attend_kernel.cuh``, with W warps per CUDA block; ``cuda``: 4). Each
configuration is timed (median of CUDA-event timings of ``--iters`` replays) and checked
against the Triton kernel within float32 rounding (``certvllm.testing.attend_deviation``: each deviation
over its allowance, ≤ 1 is agreement). It prints a table and writes JSON; the ratio column is against the
first configuration (the Triton kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path

import torch
from bench_decode import build_cache, median_ms, release_cache, synthetic_kv


def parse_config(name: str) -> dict:
    """The ``KernelTuning`` fields of a configuration: ``triton`` → the Triton kernel; ``cudaW`` → the CUDA
    kernel with W warps per CUDA block (``cuda``: 4)."""
    if name == "triton":
        return {"dialect": "triton"}
    c = re.fullmatch(r"cuda(\d*)", name)
    if c is None:
        raise SystemExit(f"unknown configuration {name!r}: use triton or cudaW, e.g. cuda4")
    return {"attend_warps": int(c.group(1) or 4)}


def capture(batch: int, ctx: int, preset: str) -> tuple[tuple, object, float]:
    """Build the synthetic cache, run one certified call and return the arguments of its attend pass, the
    cache and max |v|."""
    from certvllm.attention import certified_attention
    from certvllm.config import load_config
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.residency import Residency
    from certvllm.testing import capture_attend_args

    q, k, v = synthetic_kv(batch, ctx, seed=ctx + batch)
    lens = [ctx - 7] * batch
    cache, tables = build_cache(k, v, lens)
    vabs_max = float(v.abs().max())
    del k, v
    seq = torch.tensor(lens, device="cuda")
    cfg = load_config(preset)
    residency = Residency.for_layer(cache, cfg.promotion_cache_fraction)
    args = capture_attend_args(lambda: certified_attention(
        q, cache, tables, seq, cfg, 1.0 / math.sqrt(q.shape[-1]), pagein=CudaPageInEngine(torch.device("cuda")),
        residency=residency))  # fmt: skip
    torch.cuda.synchronize()
    return args, cache, vabs_max


def run_config(args: tuple, cfg: dict, iters: int):
    """Time the attend pass in configuration ``cfg`` (``KernelTuning`` fields); returns (median ms,
    AttendOut, exact_lm), or Nones where the CUDA kernel does not take the configuration (its shape, its warps or
    this device; ``phase2.use_cuda_attend``)."""
    from certvllm.triton_kernels import phase2

    geo = dataclasses.replace(args[0], tuning=dataclasses.replace(args[0].tuning, **cfg))
    if geo.tuning.dialect != "triton" and not phase2.use_cuda_attend(geo, args[1].device):
        return None, None, None
    lm = args[-1].clone()

    def call():
        return phase2.attend(geo, *args[1:-1], lm)

    out = call()
    torch.cuda.synchronize()
    return median_ms(call, iters), out, lm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x8192", "8x131072"])
    ap.add_argument("--configs", nargs="+", default=["triton", "cuda2", "cuda4", "cuda8"])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("runs/attend.json"))
    a = ap.parse_args()
    from certvllm.testing import attend_deviation

    results = []
    print(f"{'point':>10} {'config':>8} {'ms':>8} {'×first':>7}  check", flush=True)
    for point in a.points:
        batch, ctx = (int(x) for x in point.split("x"))
        args, cache, vabs_max = capture(batch, ctx, a.preset)
        bits = args[7]
        vabs_max *= 1.5  # covers |v̂| ≤ |v| + η as well (η ≪ max|v|)
        ref = ref_lm = None
        first = None
        for name in ["triton"] + [c for c in a.configs if c != "triton"]:
            ms, out, lm = run_config(args, parse_config(name), a.iters)
            if ms is None:
                print(f"{point:>10} {name:>8} {'n/a':>8}  (shape not supported)", flush=True)
                continue
            if ref is None:
                ref, ref_lm = out, lm
                chk = {"ok": True}
            else:
                chk = attend_deviation(out, lm, ref, ref_lm, vabs_max)
            first = first or ms
            row = {"batch": batch, "context": ctx, "config": name, "ms": ms, "ratio_to_first": ms / first,
                   "value_promoted_blocks": int(((bits >> args[0].group) != 0).sum()), **chk}  # fmt: skip
            results.append(row)
            print(f"{point:>10} {name:>8} {ms:8.3f} {ms / first:7.2f}  {'ok' if chk['ok'] else 'MISMATCH'} "
                  + " ".join(f"{k}={v:.2e}" for k, v in chk.items() if k != "ok"), flush=True)  # fmt: skip
        del args
        release_cache(cache)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"preset": a.preset, "results": results}, indent=1))
    print(f"wrote {a.out}")
    if not all(r["ok"] for r in results):
        raise SystemExit("a configuration disagrees with the Triton attend kernel beyond rounding")


if __name__ == "__main__":
    main()
