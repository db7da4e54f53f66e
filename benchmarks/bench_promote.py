"""The promotion pass alone, on the inputs of a real layer call, with parts of its work taken away (CUDA only).

Usage: python benchmarks/bench_promote.py [--points 8x32768 8x131072] [--preset default] [--out runs/promote.json]

For each point (batch × context, the synthetic K/V of ``bench_decode``) one certified call runs with the ``preset``
and a warm promotion pool (two calls first, as in serving), and the arguments of its main promotion pass are kept
(``certvllm.testing.capture_pass_args``). It then reports what the pass had to do (needed blocks per (row, KV head),
the most in one split program, and how many of their key pages the pool did not hold, which the pass reads over
PCIe from the pinned shadow) and times the pass (median of CUDA-event timings of ``--iters`` replays) as called
and in variants that each remove one part of the work:

* ``as_called``: the captured arguments;
* ``no_canary``: without the canary (value-only promoted blocks are then not visited);
* ``keys_only``: the value bits cleared (the canary still runs on the key-promoted blocks);
* ``nothing_needed``: every bit cleared: the bitmask and block-maximum scan alone;
* ``shadow_keys``: no pool: every needed key page read over PCIe from the pinned shadow;
* ``cuda_w2``, ``cuda_w4``: as called, by the CUDA promotion kernel (``KernelTuning.promote_cuda``) with 2 and 4
  warps per CUDA block (where it builds; the Triton kernel otherwise, and the row says so).

Each variant's replay rewrites the scores of the blocks it promotes with the same exact scores, so replays are
idempotent. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from bench_decode import SCORE_STD_HELP, build_cache, median_ms, release_cache, synthetic_kv


def capture(
    batch: int, ctx: int, preset: str, score_std: float | None = None, pool_fraction: float | None = None
) -> tuple[tuple, object]:
    """The synthetic cache, two warm-up calls, then the arguments of a third call's main promotion pass
    (``pool_fraction``: the pool's share of the pages, default the preset's; 1.0 is the served pool)."""
    from certvllm.attention import certified_attention
    from certvllm.config import load_config
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.residency import Residency
    from certvllm.testing import capture_pass_args

    q, k, v = synthetic_kv(batch, ctx, seed=ctx + batch, score_std=score_std)
    lens = [ctx - 7] * batch
    cache, tables = build_cache(k, v, lens)
    del k, v
    seq = torch.tensor(lens, device="cuda")
    cfg = load_config(preset)
    fraction = cfg.promotion_cache_fraction if pool_fraction is None else pool_fraction
    residency = Residency.for_layer(cache, fraction)

    def call():
        return certified_attention(q, cache, tables, seq, cfg, 1.0 / math.sqrt(q.shape[-1]),
                                   pagein=CudaPageInEngine(torch.device("cuda")), residency=residency)  # fmt: skip

    call()
    call()
    args = capture_pass_args("promote", call)
    torch.cuda.synchronize()
    return args, cache


def workload(args: tuple) -> dict:
    """Needed blocks of the captured pass: per (row, KV head) and in the busiest split program, and those whose key
    page the pool does not hold (``kslot`` < 0: read over PCIe)."""
    geo, bits, active, run_canary, kslot = args[0], args[5], args[6], args[12], args[14]
    nfull = args[4]
    B = bits.shape[-1]
    full = torch.arange(B, device=bits.device)[None, :] < nfull[:, None]
    mask = -1 if run_canary else (1 << geo.group) - 1
    need = ((bits & mask) != 0) & full[:, None, :] & (active[..., None] != 0)  # [R, K, B]
    per_split = torch.nn.functional.pad(need, (0, geo.splits * geo.blocks_per_split - B)).view(
        *need.shape[:2], geo.splits, geo.blocks_per_split).sum(-1)  # fmt: skip
    out = {"needed_per_group_mean": float(need.sum(-1).float().mean()), "needed_total": int(need.sum()),
           "needed_max_per_program": int(per_split.max()), "splits": geo.splits}  # fmt: skip
    if kslot is not None:
        out["needed_over_pcie"] = int((need & (kslot < 0)).sum())
    return out


def variants(args: tuple) -> dict[str, tuple]:
    """The argument tuples of the variants (module docstring). ``args`` are ``phase2.promote``'s, in order: geo,
    qs, shadow, tables, nfull, bits (5), active, scores, m8, delta, round1, canary (11), run_canary (12), pool,
    kslot, stage (13–15)."""
    import dataclasses

    geo = args[0]
    key_bits = (1 << geo.group) - 1
    bits = args[5]

    def with_(changes: dict[int, object]) -> tuple:  # positions in promote's arguments
        return tuple(changes.get(i, x) for i, x in enumerate(args))

    return {
        "as_called": args,
        "no_canary": with_({12: False}),
        "keys_only": with_({5: bits & key_bits}),
        "nothing_needed": with_({5: torch.zeros_like(bits)}),
        "shadow_keys": with_({13: None, 14: None, 15: None}),
        **{
            f"cuda_w{w}": with_({0: dataclasses.replace(geo, tuning=dataclasses.replace(geo.tuning, promote_cuda=w))})
            for w in (2, 4)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=["8x32768", "8x131072"])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--score-std", type=float, default=None, help=SCORE_STD_HELP)
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=None,
        help="the promotion pool's share of the pages (default: the preset's; 1.0: one slot per page, as served)",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/promote.json"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_promote.py needs a CUDA device")
    from certvllm.triton_kernels.phase2 import promote, use_cuda_promote

    results = []
    for point in a.points:
        batch, ctx = (int(x) for x in point.split("x"))
        args, cache = capture(batch, ctx, a.preset, a.score_std, a.pool_fraction)
        work = workload(args)
        print(f"{point}: {work}", flush=True)
        row = {"point": point, "workload": work, "ms": {}}
        for name, vargs in variants(args).items():
            canary = vargs[11].clone()

            def run(vargs=vargs, canary=canary):
                return promote(*vargs[:11], canary, *vargs[12:])

            run()
            torch.cuda.synchronize()
            row["ms"][name] = median_ms(run, a.iters)
            kernel = "CUDA" if use_cuda_promote(vargs[0], vargs[1].device) else "Triton"
            row.setdefault("kernel", {})[name] = kernel
            print(f"{point:>10} {name:>15} {row['ms'][name]:8.4f} ms  ({kernel})", flush=True)
        results.append(row)
        del args
        release_cache(cache)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"preset": a.preset, "results": results}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
