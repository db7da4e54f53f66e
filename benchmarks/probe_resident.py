"""The resident decode pass on a GPU, checked and timed in one short run (a lease's worth of device time).

Usage: python benchmarks/probe_resident.py [--points 8x32768 8x131072 1x8192] [--steps 4] [--maxnreg 168 128]
                                          [--kernels gluon triton] [--out runs/probe.json]

Per point (batch × context, LLaMA-3.1-8B shapes, ``bench_decode.synthetic_kv``): a paged cache with its pool;
``steps`` decode calls of the resident pass (default preset, drifting queries: q ← q + 0.05·N(0, 1) per
coordinate; then the last query again, the steady state) with the Gluon kernel and, on a second pool, with the
Triton kernel; each call's top-up is recorded (groups it ran for, and why: heads at rung 3, over ``key_tol``, over
``v_tol`` after the first pass). Every call is checked: each
certified head's error against float64 attention over the originals is at most its bound (no slack), rung
3/4 heads within 1e-4·V_max of it; the Gluon and Triton calls agree on rungs for ≥ 95 % of heads. Then the
median of CUDA-graph replays of one call (warm pool, the last query) for: the resident pass (Gluon, Triton),
the two-pass ``coverage`` and ``default`` presets, ``naive`` and dense SDPA, printed as a table and written
as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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


def exact64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Float64 attention ``[R, H_q, D]`` of q over the first ``lens[r]`` tokens of k/v ``[R, T, H_kv, D]``."""
    R, Hq, D = q.shape
    K = k.shape[2]
    out = torch.empty(R, Hq, D, dtype=torch.float64, device=q.device)
    for r in range(R):
        kk, vv = k[r, : lens[r]].double(), v[r, : lens[r]].double()  # [T, K, D]
        s = torch.einsum("kgd,tkd->kgt", q[r].double().view(K, Hq // K, D), kk) / math.sqrt(D)
        out[r] = torch.einsum("kgt,tkd->kgd", torch.softmax(s, dim=-1), vv).reshape(Hq, D)
    return out


def check(res, ref: torch.Tensor) -> dict:
    """Soundness of one call against float64 ``ref``: violations and the worst error / bound."""
    err = torch.linalg.vector_norm(res.out.double() - ref, dim=-1)
    rung = res.report.rung
    cert = rung <= 2
    bound = res.report.bound.double()
    viol = int((cert & ~(err <= bound)).sum())
    exact_bad = int(((rung >= 3) & (err > 1e-4 * res.report.v_max.double())).sum())
    ratio = float((err / bound.clamp_min(1e-30))[cert].max()) if bool(cert.any()) else 0.0
    return {"violations": viol, "exact_mismatch": exact_bad, "worst_err_over_bound": ratio,
            "rungs": [int(x) for x in torch.bincount(rung.flatten().long().cpu(), minlength=5)]}  # fmt: skip


def top_up_reasons(records: list[dict]):
    """A context that records, for every resident call's top-up, the groups it ran for and why the first pass
    sent them (heads at rung 3, over ``key_tol``, over ``v_tol``; read before the top-up overwrites them)."""
    import contextlib

    import certvllm.attention.resident as resident

    original = resident._top_up

    def spy(state, first, done, need, generator):
        r, cfg = done.report, state.call.cfg
        vm = r.v_max
        records.append({
            "groups": int((need != 0).sum()), "of": need.numel(), "rung3_heads": int((r.rung == 3).sum()),
            "over_key_tol": int((r.e_key > cfg.key_tol * vm).sum()),
            "over_v_tol": int((r.e_val > cfg.v_tol * vm).sum()),
        })  # fmt: skip
        return original(state, first, done, need, generator)

    @contextlib.contextmanager
    def patched():
        resident._top_up = spy
        try:
            yield
        finally:
            resident._top_up = original

    return patched()


def point(batch: int, ctx: int, steps: int, iters: int, deadline: float, maxnregs: tuple[int, ...] = (),
          kernels: tuple[str, ...] = ("gluon", "triton")) -> dict:  # fmt: skip
    bench = _bench()
    from certvllm.triton_kernels.fused import FUSED_GLUON_GATE
    from certvllm.triton_kernels.tuning import KernelTuning

    from certvllm.attention import certified_attention
    from certvllm.attention.gpu import CudaOptions
    from certvllm.kv.cuda_pagein import CudaPageInEngine

    q0, k, v = bench.synthetic_kv(batch, ctx, seed=ctx + batch)
    lens = [ctx - 7] * batch
    cache, tables = bench.build_cache(k, v, lens)
    seq = torch.tensor(lens, device="cuda")
    scale = 1 / math.sqrt(bench.D)
    rec: dict = {"batch": batch, "context": ctx}
    gen = torch.Generator(device="cuda").manual_seed(3)
    qs = [q0]
    for _ in range(steps - 1):
        qs.append((qs[-1].float() + 0.05 * torch.randn(q0.shape, generator=gen, device="cuda")).to(q0.dtype))
    methods = {f"resident_{k}": ("default+resident", "auto" if k == "gluon" else "triton") for k in kernels}
    calls = {}
    for name, (method, dialect) in methods.items():
        cfg = bench.method_config(method)
        residency = bench.method_residency(cache, cfg)
        eng = CudaPageInEngine("cuda")
        opts = CudaOptions(tuning=KernelTuning(dialect=dialect))
        checks: list[dict] = []
        why: list[dict] = []
        t0 = time.time()
        for i, q in enumerate([*qs, qs[-1]]):  # the last query twice: the second call shows the steady state
            with top_up_reasons(why):
                res = certified_attention(q, cache, tables, seq, cfg, scale, pagein=eng, residency=residency,
                                          cuda_options=opts)  # fmt: skip
            torch.cuda.synchronize()
            c = check(res, exact64(q, k, v, lens))
            c["ms_first"] = round((time.time() - t0) * 1e3, 1) if i == 0 else None
            c["top_up"] = why[-1] if len(why) > i else None
            checks.append(c)
            t0 = time.time()
        rec[name] = {"steps": checks}
        calls[name] = (cfg, residency, eng, opts, res)
        text = "; ".join(f"rungs {c['rungs']} viol {c['violations']} exact≠ {c['exact_mismatch']} "
                         f"err/bound {c['worst_err_over_bound']:.3f} top-up {c['top_up']}" for c in checks)  # fmt: skip
        print(f"  b={batch} ctx={ctx} {name}: {text}", flush=True)
    rec["gluon_launched"] = bool(FUSED_GLUON_GATE.launched)
    rec["gluon_failure"] = FUSED_GLUON_GATE.failure
    if len(calls) == 2:
        ga, tr = calls["resident_gluon"][4], calls["resident_triton"][4]
        rec["rung_agreement"] = float((ga.report.rung == tr.report.rung).float().mean())
        both = (ga.report.rung <= 2) & (tr.report.rung <= 2)
        vmax = float(tr.report.v_max.max())
        rec["gluon_vs_triton_max_abs_over_vmax"] = (
            float((ga.out - tr.out).abs()[both].max()) / vmax if bool(both.any()) else None
        )
    q = qs[-1]
    times: dict = {}
    for cap in maxnregs:  # the Gluon kernel under register caps (KernelTuning.resident_maxnreg), warm pool as above
        if time.time() > deadline or "resident_gluon" not in calls:
            break
        cfg, residency, eng, _, _ = calls["resident_gluon"]
        opts = CudaOptions(tuning=KernelTuning(resident_maxnreg=cap))
        fn = lambda cfg=cfg, residency=residency, eng=eng, opts=opts: certified_attention(  # noqa: E731
            q, cache, tables, seq, cfg, scale, pagein=eng, residency=residency, cuda_options=opts
        )
        res = fn()
        torch.cuda.synchronize()
        rec[f"resident_gluon_maxnreg{cap}_check"] = check(res, exact64(q, k, v, lens))
        times[f"resident_gluon_maxnreg{cap}"] = bench.time_graph(fn, iters)
        print(f"    resident_gluon, maxnreg {cap}: {times[f'resident_gluon_maxnreg{cap}']} ms, "
              f"{rec[f'resident_gluon_maxnreg{cap}_check']}", flush=True)  # fmt: skip
    for name in (*calls, "coverage", "default", "naive"):
        if time.time() > deadline:
            print("  (deadline: remaining timings skipped)", flush=True)
            break
        if name in calls:
            cfg, residency, eng, opts, _ = calls[name]
        else:
            cfg = bench.method_config(name)
            residency, eng, opts = bench.method_residency(cache, cfg), CudaPageInEngine("cuda"), CudaOptions()
        fn = lambda cfg=cfg, residency=residency, eng=eng, opts=opts: certified_attention(  # noqa: E731
            q, cache, tables, seq, cfg, scale, pagein=eng, residency=residency, cuda_options=opts
        )
        if residency.pool is not None:
            residency.pool.take_stats()
        times[name] = bench.time_graph(fn, iters)
        per_call = {}
        if residency.pool is not None:  # pool counters per replay: pages looked up, hits, fills and bypass (PCIe)
            per_call = {k: round(v / (iters + 3), 1) for k, v in residency.pool.take_stats().items()}
        rec.setdefault("pool_per_call", {})[name] = per_call
        print(f"    {name:16s} {times[name]} ms, pool per call {per_call}", flush=True)
        if name == "resident_gluon":  # the first pass alone: no target can send a group to the top-up
            alone = cfg.model_copy(
                update={
                    "key_selection": "coverage",
                    "key_tol": math.inf,
                    "v_tol": math.inf,
                    "bound_tol": math.inf,
                    "rank_check": False,
                    "rung1_tail_threshold": 1.0,
                }
            )
            fa = lambda alone=alone, residency=residency, eng=eng, opts=opts: certified_attention(  # noqa: E731
                q, cache, tables, seq, alone, scale, pagein=eng, residency=residency, cuda_options=opts
            )
            times["resident_first_pass_only"] = bench.time_graph(fa, iters)
            print(f"    first pass only  {times['resident_first_pass_only']} ms", flush=True)
    kd = k[:, : lens[0]].permute(0, 2, 1, 3).contiguous()
    vd = v[:, : lens[0]].permute(0, 2, 1, 3).contiguous()
    times["dense"] = bench.time_graph(lambda: torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, scale=scale, enable_gqa=True), iters)  # fmt: skip
    print(f"    dense            {times['dense']} ms", flush=True)
    rec["ms"] = times
    bench.release_cache(cache)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=["8x32768", "1x8192", "8x131072"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting timings after this many seconds")
    ap.add_argument(
        "--maxnreg",
        type=int,
        nargs="*",
        default=[],
        help="also time the Gluon resident kernel under these register caps (resident_maxnreg)",
    )
    ap.add_argument(
        "--kernels",
        nargs="+",
        choices=("gluon", "triton"),
        default=["gluon", "triton"],
        help="resident-pass kernels to check and time (the Triton one compiles for minutes)",
    )
    ap.add_argument("--out", type=Path, default=Path("runs/probe_resident.json"))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    deadline = time.time() + args.budget_s
    results = []
    for p in args.points:
        if time.time() > deadline:
            break
        b, c = (int(x) for x in p.split("x"))
        results.append(point(b, c, args.steps, args.iters, deadline, tuple(args.maxnreg), tuple(args.kernels)))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    print("\n| batch | context | resident Gluon | resident Triton | coverage | default | naive | dense | violations |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r["ms"]
        cells = [f"{t[k]:.3f}" if t.get(k) else "—" for k in
                 ("resident_gluon", "resident_triton", "coverage", "default", "naive", "dense")]  # fmt: skip
        viol = sum(s["violations"] + s["exact_mismatch"] for m in ("resident_gluon", "resident_triton") if m in r
                   for s in r[m]["steps"])  # fmt: skip
        print(f"| {r['batch']} | {r['context'] // 1024}K | {' | '.join(cells)} | {viol} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
