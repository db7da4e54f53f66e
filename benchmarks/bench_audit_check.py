"""What one audited row costs on the GPU: the device checks (``triton_kernels.audit_check``) of every query head of
one row, reading the shadow (pinned host memory, zero-copy over PCIe) at Llama-3.1-8B shapes (CUDA only).

Usage: python benchmarks/bench_audit_check.py [--contexts 8192 32768 131072] [--rows 1] [--heads-per-group 1 4]
                                              [--iters 10] [--out runs/audit_check.json]

An audit draws a batch row and checks all its query heads against exact float64 attention over the originals.
``--heads-per-group 1`` reads a KV head's pages once per checked query head (what the kernel did before it took
a KV head's checked heads together); 4 (the default kernel) once per group of up to 4 heads. Both run in the same
process on the same cache, so their ratio is this machine's. Prints a table (median ms per audited call, pages
read over PCIe, GB/s) and writes the rows as JSON. (``bench_audit.py`` measures the audit's share of whole layer
calls at given rates; this times the checks of one draw.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_decode import HKV, HQ, D, build_cache, release_cache, synthetic_kv, time_eager


def bench_point(ctx: int, rows: int, groups: list[int], iters: int) -> list[dict]:
    from certvllm.triton_kernels.audit_check import audit_check

    from certvllm.kv.cuda_pagein import ensure_device_readable

    dev = torch.device("cuda")
    q, k, v = synthetic_kv(rows, ctx, seed=ctx)
    lens = [ctx - 7] * rows
    cache, tables = build_cache(k, v, lens)
    shadow = ensure_device_readable(cache)
    lens_d = torch.tensor(lens, device=dev)
    out = torch.zeros(rows, HQ, D, dtype=torch.float32, device=dev)  # verdicts are not read: only the time counts
    rung = torch.zeros(rows, HQ, dtype=torch.int8, device=dev)
    bound = torch.ones(rows, HQ, dtype=torch.float32, device=dev)
    pairs = list(range(rows * HQ))
    result = []
    for per in groups:

        def run(per=per):
            audit_check(shadow, pairs, q, out, rung, bound, tables, lens_d, D**-0.5, num_kv_heads=HKV,
                        num_blocks=cache.num_blocks, channel_major=cache.keys_channel_major, tol_a=0.0, tol_b=0.0,
                        bound_slack=1.0, f64_slack=0.0, rung_values=2, heads_per_group=per)  # fmt: skip

        ms = time_eager(run, iters)
        reads = rows * HQ // min(per, HQ // HKV)  # each group reads its KV head's keys and values once
        nbytes = reads * (ctx - 7) * 2 * D * q.element_size()
        result.append({"context": ctx, "rows": rows, "heads_per_group": per, "ms": ms, "shadow_bytes": nbytes,
                       "gb_per_s": nbytes / ms / 1e6})  # fmt: skip
        print(f"ctx={ctx} rows={rows} heads/group={per}: {ms:.3f} ms, {nbytes / 2**20:.0f} MiB of shadow, "
              f"{nbytes / ms / 1e6:.1f} GB/s", flush=True)  # fmt: skip
    release_cache(cache)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768, 131072])
    ap.add_argument("--rows", type=int, default=1, help="audited rows per call (each checks all its query heads)")
    ap.add_argument("--heads-per-group", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("runs/audit_check.json"))
    args = ap.parse_args()
    rows = [r for ctx in args.contexts for r in bench_point(ctx, args.rows, args.heads_per_group, args.iters)]
    print("\n| context | audited rows | heads per group | median ms | MiB of shadow read | GB/s | × 1 head per group |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(
            x for x in rows if x["context"] == r["context"] and x["heads_per_group"] == min(args.heads_per_group)
        )
        print(f"| {r['context']} | {r['rows']} | {r['heads_per_group']} | {r['ms']:.3f} | "
              f"{r['shadow_bytes'] / 2**20:.0f} | {r['gb_per_s']:.1f} | {r['ms'] / base['ms']:.2f} |")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
