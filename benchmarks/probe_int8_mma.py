"""Probe for issue 17: INT8 block scores on the tensor cores (limb-split query) against the float32 dequantize-and-sum
arithmetic, the same loads and outputs (``triton_kernels/limb_scores.py``), beside the shipping phase 1 (scores plus
every bound term, Gluon where it supports the shape) and dense SDPA on FP16 keys and values of the same shape.
Prints a table, writes JSON.

Per point (batch × context, LLaMA-3.1-8B's 32 query / 8 KV heads, D = 128): CUDA-graph replays of each kernel over
every full block (medians), the key bytes they read per call (codes, offsets, scale codes, exponent: 2,449 B per
block and KV head at D = 128) and the rate that makes, and whether the limb scores stay within their rounding term
of float64 (every block of the first row, every query head). The splits per (row, KV head) fill the GPU's
multiprocessors about four times over. Run on the H200 (``source benchmarks/gpu_env.sh`` first):

    python3 -P benchmarks/probe_int8_mma.py --points 1x32768 8x32768 8x131072 --out runs/h200_int8_mma.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import build_cache, release_cache, time_graph  # noqa: E402
from certvllm.triton_kernels.limb_scores import LIMBS, block_scores  # noqa: E402
from certvllm.triton_kernels.phase1 import phase1  # noqa: E402

from certvllm.bounds import delta_factor, rounding_factor  # noqa: E402
from certvllm.bounds.int8_scores import limb_score_rounding, split_query_limbs  # noqa: E402
from certvllm.formats.keys import key_sigma  # noqa: E402
from certvllm.formats.layout import key_scale_lut  # noqa: E402
from certvllm.formats.pages import _field  # noqa: E402

HQ, HKV, D = 32, 8, 128


def key_bytes(layout) -> int:
    """Bytes of one page that the score kernels read: codes, offsets, scale codes and the exponent byte."""
    return layout.block_size * layout.head_dim + 2 * layout.head_dim + layout.head_dim + 1


def check_first_row(q, cache, tables, nfull, scores) -> float:
    """Largest |limb score − float64 INT8 score| / its bound over row 0's blocks (≤ 1 is sound)."""
    lay, g, worst = cache.layout, HQ // HKV, 0.0
    lut = key_scale_lut().to(q.device)
    for b in range(int(nfull[0])):
        page = cache.pages[int(tables[0, b])]
        codes = _field(page, lay.k_codes, 16 * D, torch.uint8).unflatten(-1, (16, D))
        offsets = _field(page, lay.k_offset, 2 * D, torch.float16).float()
        sigma = key_sigma(_field(page, lay.k_scale_code, D, torch.uint8), page[:, lay.header + 8].view(torch.int8), lut)
        qh = q[0].view(HKV, g, D)
        exact = (qh.double()[:, :, None, :] * (offsets.double()[:, None, None, :] + codes.double()[:, None]
                 * sigma.double()[:, None, None, :])).sum(-1)  # [H_kv, G, N]  # fmt: skip
        split = split_query_limbs(qh * sigma[:, None, :], LIMBS)
        bound = limb_score_rounding(qh, offsets[:, None, :].expand_as(qh), sigma[:, None, :].expand_as(qh), split)
        err = (scores[0, :, b].double() - exact).abs() / bound.double()[..., None]
        worst = max(worst, float(err.max()))
    return worst


def run_point(batch: int, ctx: int, iters: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(batch * ctx)
    k = torch.randn(batch, ctx, HKV, D, generator=gen, device=dev, dtype=torch.float16)
    v = torch.randn(batch, ctx, HKV, D, generator=gen, device=dev, dtype=torch.float16)
    q = torch.randn(batch, HQ, D, generator=gen, device=dev, dtype=torch.float32) * (1 / math.sqrt(D))
    cache, tables = build_cache(k, v, [ctx] * batch)
    nfull = torch.full((batch,), ctx // 16, dtype=torch.int64, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = max(1, min(tables.shape[1], -(-4 * sms // (batch * HKV))))
    out: dict = {"batch": batch, "context": ctx, "splits": splits}
    for name, mma in (("limbs_mma", True), ("float32", False)):
        out[name] = time_graph(lambda mma=mma: block_scores(q, cache.pages, cache.layout, tables, nfull, mma=mma,
                                                            splits=splits), iters)  # fmt: skip
    lut, bps = key_scale_lut().to(dev), -(-tables.shape[1] // splits)
    factors = (delta_factor(D), rounding_factor(D))
    out["phase1_shipping"] = time_graph(
        lambda: phase1(q, cache.pages, tables, nfull, lut, cache.layout, HKV, 1, *factors, splits, bps), iters
    )
    scores, _ = block_scores(q, cache.pages, cache.layout, tables, nfull, mma=True, splits=splits)
    out["limb_error_over_bound_max"] = check_first_row(q, cache, tables, nfull, scores)
    qd, kd, vd = q.half()[:, :, None], k.transpose(1, 2), v.transpose(1, 2)
    out["dense_sdpa"] = time_graph(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), iters)
    nbytes = batch * HKV * (ctx // 16) * key_bytes(cache.layout)
    out["key_bytes"] = nbytes
    for name in ("limbs_mma", "float32"):
        out[f"{name}_tb_s"] = nbytes / (out[name] * 1e-3) / 1e12 if out[name] else None
    release_cache(cache)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", nargs="+", default=["1x32768", "8x32768", "8x131072"], help="BATCHxCONTEXT")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/int8_mma.json"))
    args = p.parse_args()
    rows = []
    print(f"{'point':>10} {'splits':>6} {'limbs+MMA ms':>13} {'float32 ms':>11} {'phase 1 ms':>11} {'MMA TB/s':>9} "
          f"{'f32 TB/s':>9} {'dense ms':>9} {'err/bound':>10}", flush=True)  # fmt: skip
    for point in args.points:
        batch, ctx = (int(x) for x in point.split("x"))
        r = run_point(batch, ctx, args.iters)
        rows.append(r)
        print(f"{point:>10} {r['splits']:>6} {r['limbs_mma']:>13.3f} {r['float32']:>11.3f} "
              f"{r['phase1_shipping']:>11.3f} {r['limbs_mma_tb_s']:>9.2f} {r['float32_tb_s']:>9.2f} "
              f"{r['dense_sdpa']:>9.3f} {r['limb_error_over_bound_max']:>10.3f}", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "points": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
