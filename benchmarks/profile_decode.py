"""Where the time of one certified decode-attention layer call goes, kernel by kernel (CUDA only).

Usage: python benchmarks/profile_decode.py [--points 1x8192 8x131072] [--presets naive default]
                                           [--tunings "" attend_warps=8] [--rounds 3] [--out runs/profile.json]

For each point (batch × context, the synthetic K/V of ``bench_decode``) and preset it times CUDA-graph
replays of the call (what the table of ``bench_decode`` reports), then profiles eager calls with
``torch.profiler`` and prints, per call: the number of kernels, the sum of their device times, and the
kernels ranked by device time. The gap between the graph time and the kernel sum is launch and dependency
latency (one graph node after another); the ranking shows which kernels are worth fusing or speeding up.
With a promotion pool it also records the pool's pages per profiled call (``pool_pages_per_call``: looked up,
hits, fills, and bypasses, the pages read over PCIe because another page held their slot). Each preset
runs once per ``--tunings`` entry (comma-separated ``KernelTuning`` fields, "" the defaults), labelled
``preset[tuning]``, so two kernel choices are compared in one run. ``--rounds N`` runs the whole list N times,
one round after another, so the variants alternate (a variant measured right after another can read a few percent
slower or faster: order matters at this size); each label then reports the median of its rounds and keeps every
round's figures. Last, the registers and spills per thread of every compiled certvllm kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from bench_decode import SCORE_STD_HELP, D, build_cache, release_cache, synthetic_kv, time_graph
from torch.profiler import ProfilerActivity, profile


def _kernel_table(prof, calls: int) -> tuple[list[dict], int, float]:
    """Per-call kernel count, summed device µs and the per-name breakdown (µs per call)."""
    per_name: dict[str, list[float]] = defaultdict(list)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_name[evt.name].append(evt.device_time)
    rows = []
    for name, t in per_name.items():
        row = {"kernel": name[:90], "count_per_call": len(t) / calls, "us_per_call": sum(t) / calls}
        k = len(t) // calls
        if k > 1 and len(t) == k * calls:  # a kernel launched k times per call: each launch's mean, in call order
            row["us_per_launch"] = [sum(t[i::k]) / calls for i in range(k)]
        rows.append(row)
    rows.sort(key=lambda r: -r["us_per_call"])
    count = sum(len(t) for t in per_name.values()) // calls
    total = sum(sum(t) for t in per_name.values()) / calls
    return rows, count, total


def profile_point(batch: int, ctx: int, presets: list[str], calls: int, top: int, tunings: list[str],
                  score_std: float | None = None, pool_fraction: float | None = None,
                  rounds: int = 1) -> dict:  # fmt: skip
    from certvllm.triton_kernels.tuning import parse_tuning

    from certvllm.attention import certified_attention
    from certvllm.attention.gpu import CudaOptions
    from certvllm.config import load_config
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.residency import Residency

    dev = torch.device("cuda")
    q, k, v = synthetic_kv(batch, ctx, seed=ctx + batch, score_std=score_std)
    lens = [ctx - 7] * batch
    cache, tables = build_cache(k, v, lens)
    seq_lens = torch.tensor(lens, device=dev)
    scale = 1.0 / math.sqrt(D)
    out: dict = {"batch": batch, "context": ctx, "score_std": score_std, "pool_fraction": pool_fraction}
    measured: dict[str, list[dict]] = defaultdict(list)  # label → one entry per time it ran
    for preset, tuning in [(p, t) for _ in range(rounds) for p in presets for t in tunings]:
        cfg = load_config(preset)
        eng = CudaPageInEngine(dev)
        fraction = cfg.promotion_cache_fraction if pool_fraction is None else pool_fraction
        residency = Residency.for_layer(cache, fraction if cfg.mode == "certified" else 0.0)
        options = CudaOptions(tuning=parse_tuning(tuning))
        if tuning:
            preset = f"{preset}[{tuning}]"

        def call(cfg=cfg, eng=eng, residency=residency, options=options):  # what the vLLM backend calls
            return certified_attention(q, cache, tables, seq_lens, cfg, scale, pagein=eng, residency=residency,
                                       cuda_options=options)  # fmt: skip

        graph_ms = time_graph(call, 20)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        pool = residency.pool
        if pool is not None:
            pool.take_stats()  # from here on: the profiled calls' page lookups
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        rows, count, total_us = _kernel_table(prof, calls)
        run = {"graph_ms": graph_ms, "kernels_per_call": count, "kernel_us_per_call": total_us, "kernels": rows}
        if pool is not None:  # pages per call: looked up, served from a slot, filled, read over PCIe past the pool
            run["pool_pages_per_call"] = {k: v / calls for k, v in pool.take_stats().items()}
        measured[preset].append(run)
        print(f"b={batch} ctx={ctx} {preset}: graph {graph_ms:.3f} ms, {count} kernels/call, "
              f"kernel sum {total_us / 1e3:.3f} ms, pool pages per call "
              f"{run.get('pool_pages_per_call')}", flush=True)  # fmt: skip
        for r in rows[:top]:
            each = " (" + " + ".join(f"{u:.1f}" for u in r["us_per_launch"]) + ")" if "us_per_launch" in r else ""
            print(f"    {r['us_per_call']:9.1f} us  x{r['count_per_call']:5.1f}  {r['kernel']}{each}", flush=True)
    release_cache(cache)
    for label, runs in measured.items():  # the first run's record, its times the medians of all runs
        out[label] = {**runs[0], "graph_ms": statistics.median(r["graph_ms"] for r in runs),
                      "kernel_us_per_call": statistics.median(r["kernel_us_per_call"] for r in runs),
                      "runs": runs}  # fmt: skip
    if any(len(runs) > 1 for runs in measured.values()):
        print(f"b={batch} ctx={ctx}, medians over the runs of each label:")
        for label, runs in measured.items():
            graphs = ", ".join(f"{r['graph_ms']:.3f}" for r in runs)
            print(f"    {label:48s} graph {out[label]['graph_ms']:.3f} ms ({graphs}), "
                  f"kernel sum {out[label]['kernel_us_per_call'] / 1e3:.3f} ms", flush=True)  # fmt: skip
    return out


def compiled_kernel_resources() -> list[dict]:
    """Registers and spilled bytes per thread of every certvllm kernel compiled in this process (read from
    Triton's per-device caches; empty where this Triton keeps them elsewhere)."""
    import importlib
    import pkgutil

    import certvllm.triton_kernels as tk

    rows = []
    for info in pkgutil.iter_modules(tk.__path__):
        try:
            mod = importlib.import_module(f"certvllm.triton_kernels.{info.name}")
        except ImportError:
            continue
        for name, fn in vars(mod).items():
            for entry in getattr(fn, "device_caches", {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for ck in getattr(cache, "values", list)():
                    regs, spills = getattr(ck, "n_regs", None), getattr(ck, "n_spills", None)
                    if regs is not None:
                        rows.append({"kernel": name, "registers": regs, "spill_bytes": spills})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x8192", "1x131072", "8x131072"])
    ap.add_argument("--presets", nargs="+", default=["naive", "default"])
    ap.add_argument("--tunings", nargs="+", default=[""],
                    help='KernelTuning overrides per run, e.g. "" attend_warps=8')  # fmt: skip
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="run the presets x tunings list this many times, in turn")
    ap.add_argument("--score-std", type=float, default=None, help=SCORE_STD_HELP)
    ap.add_argument("--pool-fraction", type=float, default=None,
                    help="promotion pool slots per (block, KV head) page instead of the preset's "
                         "promotion_cache_fraction; 1.0 gives every page its own slot, the write-through pool of a "
                         "host-capped vLLM cache, where every key page is read from VRAM after its first lookup "
                         "(the served regime)")  # fmt: skip
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("runs/profile.json"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: it must be at least 1 (1 runs each preset and tuning once)")
    from certvllm.triton_kernels.tuning import parse_tuning

    for tuning in args.tunings:  # every entry checked before the first run
        try:
            parse_tuning(tuning)
        except ValueError as err:
            ap.error(f"--tunings {tuning!r}: {err}")
    results = []
    for p in args.points:
        b, c = (int(x) for x in p.split("x"))
        results.append(
            profile_point(
                b, c, args.presets, args.calls, args.top, args.tunings, args.score_std, args.pool_fraction, args.rounds
            )
        )
    resources = compiled_kernel_resources()
    for r in resources:
        print(f"    {r['kernel']:32s} {r['registers']:4d} registers/thread, {r['spill_bytes']} bytes spilled")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"points": results, "kernels": resources}, indent=1))


if __name__ == "__main__":
    main()
