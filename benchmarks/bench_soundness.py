"""Soundness benchmark: ≥ 10⁶ head-steps of certified attention against the float64 exact reference.

Every head-step with rung ≤ 2 must satisfy ‖out − exact‖₂ ≤ e_key + e_val (a violation is a bug), and
every head recomputed exactly (rung ≥ 3) must be bit-identical to ``dense_decode``. The families are
those of ``certvllm.testing`` (random and adversarial: outlier channels, near-tied blocks, one-hot and
flat attention, constant channels, tiny and huge norms, sinks and recency, retrieval peaks), over
GQA ratios 1/3/4/8, D = 64/128, float16 and bfloat16, and the default/paper/strict/fast/naive/coverage presets.

Usage: python benchmarks/bench_soundness.py [--head-steps 1000000] [--workers N] [--backend auto|cuda]
                                           [--out runs/soundness.json]
Prints a table (per family and per preset) and writes the JSON summary.

``--phase1-pairs N`` checks instead the CUDA path's phase-1 score arithmetic alone (``bounds.int8_scores.mma_scores``,
the kernels' specification) on N (query head, block) pairs of the families' pages, every score against its float64
value within R_b (minutes on a CPU). ``--backend cuda`` checks the CUDA path (its Triton kernels: compiled on a GPU,
in Triton's interpreter on a CPU, where it runs a few head-steps per second) instead of the op's own choice.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch

from certvllm.config import load_config
from certvllm.testing import FAMILIES, check_soundness, make_case

PRESETS = ("default", "paper", "strict", "fast", "naive", "coverage")
SHAPES = ((8, 8, 64), (9, 3, 64), (32, 8, 128), (16, 2, 128), (24, 6, 64))  # (H_q, H_kv, D): ratios 1,3,4,8,4


def _summary(ratios: list[torch.Tensor], rungs: torch.Tensor, steps: int, violations: int, mismatch: int) -> dict:
    r = torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)
    return {
        "head_steps": steps,
        "violations": violations,
        "dense_mismatches": mismatch,
        "bound_over_error_median": float(r.median()) if r.numel() else None,
        "bound_over_error_p01": float(r.quantile(0.01)) if r.numel() else None,
        "bound_over_error_p99": float(r.quantile(0.99)) if r.numel() else None,
        "rung_histogram": {str(i): int(rungs[i]) for i in range(5)},
    }


def _new_group() -> dict:
    return {"ratios": [], "rungs": torch.zeros(5, dtype=torch.long), "steps": 0, "violations": 0, "mismatch": 0}


def run_shard(
    head_steps: int,
    seed: int,
    rows: int,
    max_len: int,
    worker: int = 0,
    workers: int = 1,
    calls: int = 0,
    backend: str = "auto",
) -> dict:
    """Check ``head_steps`` head-steps (or, with ``calls`` > 0, that many batched calls): iterations
    ``worker, worker + workers, ...`` of the family × preset × shape cycle, drawing from a generator seeded
    with ``(seed, worker)``. Returns the raw per-group accumulators."""
    if workers > 1:
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + worker)
    groups: dict[str, dict] = defaultdict(_new_group)
    total, it, done = 0, worker, 0
    start = time.perf_counter()
    while (done < calls) if calls > 0 else (total < head_steps):
        family = FAMILIES[it % len(FAMILIES)]
        preset = PRESETS[(it // len(FAMILIES)) % len(PRESETS)]
        hq, hkv, d = SHAPES[(it // (len(FAMILIES) * len(PRESETS))) % len(SHAPES)]
        dtype = (torch.float16, torch.bfloat16)[it % 2]
        lengths = torch.randint(1, max_len, (rows,), generator=gen).tolist()
        cases = [make_case(family, t, hq, hkv, d, dtype, gen) for t in lengths]
        res = check_soundness(cases, load_config(preset), backend=backend)
        certified = (res.rung <= 2) & (res.error > 0)
        ratio = (res.bound[certified] / res.error[certified]).double()
        rung_hist = torch.bincount(res.rung.flatten().long(), minlength=5)
        for key in ("all", f"family:{family}", f"preset:{preset}", f"shape:{hq}/{hkv}/{d}"):
            g = groups[key]
            g["ratios"].append(ratio)
            g["rungs"] += rung_hist
            g["steps"] += res.rung.numel()
            g["violations"] += res.violations
            g["mismatch"] += res.dense_mismatch
        total += res.rung.numel()
        it += workers
        done += 1
        if done % 50 == 0:
            rate = total / (time.perf_counter() - start)
            print(f"  [worker {worker}] {total:>9,} head-steps, {groups['all']['violations']} violations, "
                  f"{rate:,.0f}/s", flush=True)  # fmt: skip
    return dict(groups)


def phase1_arithmetic(pairs: int, seed: int) -> dict:
    """The phase-1 INT8-MMA arithmetic (``mma_scores``) against float64 on ``pairs`` (query head, block) pairs of the
    families' pages (D = 64/128, GQA 4/8/8, float16 and bfloat16): violations (|s − ŝ| > R_b), heads out of the
    kernel's range (R_b = inf) and the largest error over R_b."""
    import math

    from certvllm.bounds.int8_scores import mma_scores
    from certvllm.formats.layout import key_scale_lut
    from certvllm.testing import exact_int8_scores, paged_batch

    gen = torch.Generator().manual_seed(seed)
    lut = key_scale_lut()
    out = {"pairs": 0, "violations": 0, "out_of_range": 0, "worst_error_over_bound": 0.0}
    it = 0
    start = time.perf_counter()
    while out["pairs"] < pairs:
        family = FAMILIES[it % len(FAMILIES)]
        d = (64, 128)[(it // len(FAMILIES)) % 2]
        hq, hkv = ((32, 8), (8, 1), (24, 3))[it % 3]
        dtype = (torch.float16, torch.bfloat16)[it % 2]
        cases = [make_case(family, t, hq, hkv, d, dtype, gen) for t in (400, 977)]
        cache, tables, lens = paged_batch(cases)
        lay = cache.layout
        g = hq // hkv
        for r, case in enumerate(cases):
            ids = tables[r, : int(lens[r]) // 16].long()
            pages = cache.pages[ids]
            n = pages.shape[0]
            q = (case.q.float() * (1 / math.sqrt(d))).view(1, hkv, g, d).expand(n, hkv, g, d)
            mant = lut[pages[:, :, lay.k_scale_code : lay.k_scale_code + d].long()][:, :, None].expand(n, hkv, g, d)
            off = pages[:, :, lay.k_offset : lay.k_offset + 2 * d].contiguous().view(torch.float16).float()
            ex = pages[:, :, lay.header + 8].view(torch.int8).long()[:, :, None].expand(n, hkv, g)
            codes = pages[:, :, : 16 * d].reshape(n, hkv, 1, 16, d).expand(n, hkv, g, 16, d)
            score, bound = mma_scores(q, off[:, :, None].expand(n, hkv, g, d), mant, ex, codes)
            exact = exact_int8_scores(case.q.float() * (1 / math.sqrt(d)), cache, ids).permute(1, 0, 2, 3)
            err = (score.double() - exact).abs()
            fin = torch.isfinite(bound)
            out["violations"] += int((err > bound.double()[..., None])[fin].sum())
            out["out_of_range"] += int((~fin).sum())
            ratio = (err / bound.double()[..., None])[fin]
            out["worst_error_over_bound"] = max(
                out["worst_error_over_bound"], float(ratio.max()) if ratio.numel() else 0
            )
            out["pairs"] += bound.numel()
        it += 1
    out["seconds"] = time.perf_counter() - start
    return out


def _shard_entry(args: tuple) -> dict:
    return run_shard(*args)


def run(head_steps: int, seed: int, rows: int, max_len: int, workers: int = 1, backend: str = "auto") -> dict:
    """Run the benchmark over ``workers`` processes (each single-threaded when ``workers > 1``) and merge."""
    start = time.perf_counter()
    share = -(-head_steps // workers)
    jobs = [(share, seed, rows, max_len, w, workers, 0, backend) for w in range(workers)]
    if workers == 1:
        shards = [run_shard(*jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            shards = pool.map(_shard_entry, jobs)
    groups: dict[str, dict] = defaultdict(_new_group)
    for shard in shards:
        for key, part in shard.items():
            g = groups[key]
            g["ratios"].extend(part["ratios"])
            g["rungs"] += part["rungs"]
            for field in ("steps", "violations", "mismatch"):
                g[field] += part[field]
    elapsed = time.perf_counter() - start
    return {
        "config": {"head_steps": head_steps, "seed": seed, "rows_per_call": rows, "max_len": max_len,
                   "workers": workers, "backend": backend, "families": FAMILIES, "presets": PRESETS, "shapes": SHAPES},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "cpus": os.cpu_count(),
                        "threads": 1 if workers > 1 else torch.get_num_threads()},
        "seconds": elapsed,
        "groups": {k: _summary(g["ratios"], g["rungs"], g["steps"], g["violations"], g["mismatch"])
                   for k, g in sorted(groups.items())},
    }  # fmt: skip


def print_table(result: dict) -> None:
    head = f"{'group':<28}{'head-steps':>12}{'viol':>6}{'bound/err med':>15}{'p99':>10}  rungs 0/1/2/3/4"
    print(head)
    print("-" * len(head))
    for name, g in result["groups"].items():
        med = g["bound_over_error_median"]
        p99 = g["bound_over_error_p99"]
        rungs = "/".join(str(g["rung_histogram"][str(i)]) for i in range(5))
        med_s = "-" if med is None else f"{med:.3g}"
        p99_s = "-" if p99 is None else f"{p99:.3g}"
        print(f"{name:<28}{g['head_steps']:>12,}{g['violations']:>6}{med_s:>15}{p99_s:>10}  {rungs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-steps", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=24, help="sequences per batched call")
    parser.add_argument("--max-len", type=int, default=900, help="context lengths are drawn from [1, max-len)")
    parser.add_argument("--workers", type=int, default=1, help="processes, each single-threaded when > 1")
    parser.add_argument(
        "--backend",
        choices=("auto", "cuda"),
        default="auto",
        help="the op's backend: auto (its choice for the machine) or cuda (the Triton kernels)",
    )
    parser.add_argument(
        "--phase1-pairs",
        type=int,
        default=0,
        help="check phase 1's INT8-MMA arithmetic alone on this many (query head, block) pairs",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/soundness.json"))
    args = parser.parse_args()
    if args.phase1_pairs > 0:
        result = phase1_arithmetic(args.phase1_pairs, args.seed)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"{result['pairs']:,} (query head, block) pairs × 16 scores in {result['seconds']:.0f} s: "
              f"{result['violations']} violations, {result['out_of_range']} out of range (R_b = inf), "
              f"largest error / R_b {result['worst_error_over_bound']:.4f} → {args.out}")  # fmt: skip
        raise SystemExit(1 if result["violations"] else 0)
    if args.workers < 1:
        parser.error(f"--workers must be ≥ 1, got {args.workers}")
    if args.backend == "cuda" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (the workers inherit it)
    result = run(args.head_steps, args.seed, args.rows, args.max_len, args.workers, args.backend)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    total = result["groups"]["all"]
    print(f"\n{total['head_steps']:,} head-steps in {result['seconds']:.0f} s: {total['violations']} violations, "
          f"{total['dense_mismatches']} dense mismatches → {args.out}")  # fmt: skip
    if total["violations"] or total["dense_mismatches"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
