"""Audit-mode overhead on the CPU: the certified layer call with its audit (``Auditor.run``, what the vLLM worker
runs per layer and step) at ``audit_rate`` 0, 0.001 and 0.01, in one run.

One "call" is one layer's decode step for ``--rows`` sequences of ``--context`` tokens (SmolLM2-135M's head layout
by default: 9 query heads, 3 KV heads, D = 64, bfloat16). Each of ``--rounds`` rounds times a block of ``--block``
consecutive calls per variant, the order rotated every round, so that the machine's drift (tens of % over seconds on
a shared VM) hits every variant alike; the table gives the mean time per call over all rounds, the overhead against
rate 0, and how many head-steps were audited. A rare event (one audited call every 1 / (rate × rows) calls: 125 at
0.001 with 8 rows) needs the mean, not a median. It also times one audited row (the audit's unit: a drawn row is
checked at every query head) on its own right after a decode call (``--single`` times per reference) and gives the
overhead that cost implies (``expected``: rate × rows per call × that median / the rate-0 call), a figure that the
machine's drift does not blur. A decode step of an L-layer model is L
such calls, so the relative overhead per call is the relative overhead per decode step of the attention part (the
rest of the model, which audits do not touch, makes the end-to-end share smaller still;
``benchmarks/bench_audit_e2e.py`` measures that through vLLM).

The audit's exact reference runs in the compiled routine (``csrc/cpu/audit_reference.cpp``) when it is built;
``--torch-reference`` adds the rates again with the torch float64 path (what every CPU audit ran before), in the same
interleaved run, with the same sampler seed (so the same head-steps are audited by both).

    .venv/bin/python benchmarks/bench_audit.py            # prints the table, writes benchmarks/results/cpu_audit.json
    .venv/bin/python benchmarks/bench_audit.py --torch-reference --out benchmarks/results/cpu_audit_paths.json

``--device cuda`` runs the same interleaved measurement on a GPU (the CUDA path of the op: pages on the device
written by the Triton encoder, shadow pinned, page-in by ``CudaPageInEngine``; the audit's checks queued on the
device in its two kernels, ``certvllm.triton_kernels.audit_check``, and read back later, as in serving), timing each
block with a device synchronisation at its end; defaults to LLaMA-3.1-8B's head layout there (32 query heads, 8 KV
heads, D = 128, 8 × 8K). There ``--torch-reference`` times the torch float64 path beside the kernels:

    python3 -P benchmarks/bench_audit.py --device cuda --torch-reference --out runs/h200_audit.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from certvllm.attention.audit import Auditor
from certvllm.attention.op import certified_attention
from certvllm.config import load_config
from certvllm.testing import make_case, paged_batch

RATES = (0.0, 0.001, 0.01)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=None, help="tokens per row (default 2048; 8192 on cuda)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 9; 32 on cuda)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 3; 8 on cuda)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 64; 128 on cuda)")
    p.add_argument("--block", type=int, default=10, help="consecutive calls of one variant")
    p.add_argument("--rounds", type=int, default=60, help="rounds of one block per variant")
    p.add_argument("--single", type=int, default=200, help="timed single audits per reference")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default="default")
    p.add_argument("--torch-reference", action="store_true", help="also time the rates with the torch reference")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/{device}_audit.json")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    for name, on_cpu, on_cuda in (("context", 2048, 8192), ("heads", 9, 32), ("kv_heads", 3, 8), ("head_dim", 64, 128)):
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    out = args.out or Path(__file__).parent / "results" / f"{args.device}_audit.json"
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    cases = [make_case("sink_and_recency", args.context, args.heads, args.kv_heads, args.head_dim, torch.bfloat16, gen)
             for _ in range(args.rows)]  # fmt: skip
    q = torch.stack([c.q for c in cases])
    op_args: dict = {}
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def reference_name(torch_ref: bool) -> str:
        """The audit's checks: the torch float64 path, or the default (the device kernels on CUDA pages, the
        compiled C++ reference on CPU pages)."""
        return "torch" if torch_ref else ("device" if cuda else "compiled")

    if cuda:  # the serving layout: pages on the device, shadow pinned, the CUDA page-in engine
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's decode benchmark, also under -P
        from bench_decode import build_cache

        from certvllm.kv.cuda_pagein import CudaPageInEngine

        dev = torch.device("cuda")
        k, v = (torch.stack([getattr(c, name) for c in cases]).to(dev) for name in ("k", "v"))
        cache, tables = build_cache(k, v, [args.context] * args.rows)
        lens = torch.full((args.rows,), args.context, dtype=torch.int64, device=dev)
        q = q.to(dev)
        op_args = {"backend": "cuda", "pagein": CudaPageInEngine(dev)}
        del k, v
    else:
        cache, tables, lens = paged_batch(cases)
    scale = 1 / math.sqrt(args.head_dim)
    configs = {rate: load_config(args.preset, audit_rate=rate) for rate in RATES}
    variants = [(rate, False) for rate in RATES]
    if args.torch_reference:
        variants += [(rate, True) for rate in RATES if rate > 0]
    auditors = {v: Auditor(configs[v[0]]) for v in variants}
    for (_, torch_ref), auditor in auditors.items():
        auditor.compiled_reference = False if torch_ref else None

    def one(variant: tuple[float, bool]) -> None:
        cfg = configs[variant[0]]

        def call(force: torch.Tensor | None):
            return certified_attention(q, cache, tables, lens, cfg, scale, force_exact=force, **op_args)

        auditors[variant].run(0, q, cache, tables, lens, scale, call)

    for v in variants:  # warm-up: kernels loaded, allocator warm
        for _ in range(5):
            one(v)
    sync()
    full_audit = {}
    for torch_ref in sorted({v[1] for v in variants}):
        warm = Auditor(load_config(args.preset, audit_rate=1.0))  # the first float64 SDPA call initialises torch's
        warm.compiled_reference = False if torch_ref else None  # dispatch (about a second): not timed
        for _ in range(3):  # the last one is timed
            start = time.perf_counter()
            warm.run(0, q, cache, tables, lens, scale,
                     lambda f: certified_attention(q, cache, tables, lens, configs[0.0], scale,
                                                   force_exact=f, **op_args))  # fmt: skip
            warm.resolve(wait=True)
            full_audit[reference_name(torch_ref)] = time.perf_counter() - start
    # one audited row (every query head) on its own, right after a decode call (the situation of a sampled audit)
    single: dict[str, list[float]] = {}
    for torch_ref in sorted({v[1] for v in variants}):
        auditor = Auditor(configs[0.0])
        auditor.compiled_reference = False if torch_ref else None
        times = []
        for i in range(args.single):
            res = certified_attention(q, cache, tables, lens, configs[0.0], scale, **op_args)
            row = i % args.rows
            sync()
            start = time.perf_counter()
            auditor.queue_checks(
                q, cache, tables, lens, scale, res, [row * args.heads + h for h in range(args.heads)], torch.float32
            )
            sync()
            times.append(time.perf_counter() - start)
        single[reference_name(torch_ref)] = times

    load_before = os.getloadavg()
    blocks: dict[tuple[float, bool], list[float]] = {v: [] for v in variants}  # seconds per block, by round
    for rnd in range(args.rounds):  # variants interleaved block by block, the order rotated every round
        for v in variants[rnd % len(variants) :] + variants[: rnd % len(variants)]:
            start = time.perf_counter()
            for _ in range(args.block):
                one(v)
            sync()
            blocks[v].append(time.perf_counter() - start)
    load_after = os.getloadavg()
    for auditor in auditors.values():  # the device's queued checks, counted
        auditor.resolve(wait=True)

    base_blocks = blocks[(0.0, False)]
    base = sum(base_blocks) / (args.rounds * args.block)
    head_steps = args.rows * args.heads * (args.rounds * args.block + 5)
    rows = []
    for v in variants:
        rate, torch_ref = v
        mean = sum(blocks[v]) / (args.rounds * args.block)
        ref = reference_name(torch_ref)
        a = auditors[v]
        expected = rate * args.rows * statistics.median(single[ref]) / base
        rows.append({"audit_rate": rate, "reference": ref, "mean_ms_per_call": mean * 1e3,
                     "overhead": mean / base - 1.0,
                     "median_block_ms_per_call": statistics.median(blocks[v]) / args.block * 1e3,
                     "expected_overhead": expected, "blocks_ms_per_call": [t / args.block * 1e3 for t in blocks[v]],
                     "audited_head_steps": a.audited, "audited_share": a.audited / head_steps,
                     "violations": a.violations})  # fmt: skip
    where = torch.cuda.get_device_name() if cuda else f"CPU, {args.threads} threads"
    print(f"certified layer call, {where}, {args.rows} rows × {args.context} tokens, H_q={args.heads}, "
          f"H_kv={args.kv_heads}, D={args.head_dim}, bf16; {args.rounds} rounds × "
          f"{args.block} calls per variant, interleaved; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")  # fmt: skip
    for name, seconds in full_audit.items():
        print(f"one call at audit_rate 1 ({args.rows * args.heads} head-steps audited, {name} reference): "
              f"{seconds * 1e3:.1f} ms (rate 0: {base * 1e3:.2f} ms)")  # fmt: skip
    for name, times in single.items():
        print(
            f"one audited row ({args.heads} head-steps) right after a decode call, {name} reference: median "
            f"{statistics.median(times) * 1e3:.3f} ms, p90 {sorted(times)[int(0.9 * len(times))] * 1e3:.3f} ms"
        )
    print(f"{'audit_rate':>10} {'reference':>9} {'ms/call':>9} {'overhead':>9} {'expected':>9} {'audited':>8} "
          f"{'share':>8} {'violations':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['audit_rate']:>10g} {r['reference']:>9} {r['mean_ms_per_call']:>9.3f} "
              f"{100 * r['overhead']:>8.2f}% {100 * r['expected_overhead']:>8.2f}% {r['audited_head_steps']:>8d} "
              f"{r['audited_share']:>8.4f} {r['violations']:>10d}")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": where, "rows": args.rows, "context": args.context, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "block": args.block, "rounds": args.rounds, "threads": args.threads,
            "preset": args.preset, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "ms_per_call_at_rate_1": {k: t * 1e3 for k, t in full_audit.items()},
            "load_average_before": load_before, "load_average_after": load_after,
            "single_audit_ms": {k: [t * 1e3 for t in v] for k, v in single.items()}}  # fmt: skip
    out.write_text(json.dumps({"config": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
