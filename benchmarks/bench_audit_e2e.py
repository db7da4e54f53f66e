"""Audit-mode overhead end to end: decode throughput of the bundled model through vLLM at ``audit_rate`` 0, 0.001
and 0.01 (``--rates``), in one engine, the rates interleaved.

One engine (``--kv-cache-dtype certified``, the ``default`` preset, started with ``audit_rate`` 0.001, the production
default) serves the same batch of ``--batch`` requests again and again: each ~``--prompt-tokens``-token prompt (distinct
per request, prefix-cached after the warm-up, so a phase is almost only decode) decodes ``--max-tokens`` tokens with
``ignore_eos``. Before each phase every worker's audit rate is set (``Auditor.set_rate`` through the harness's
``"audit_rate"`` phase key: same engine, same sampler seed, same check); each repeat runs the rates in a rotated
order so that drift and the other jobs of the machine hit them alike (``--torch-reference`` adds the audited rates
again with the audit's torch float64 reference, ``Auditor.compiled_reference = False``; the default variant is
labelled ``compiled``: the compiled C++ reference on the CPU, the device kernels ``triton_kernels.audit_check`` on
CUDA). Reported per rate: the median over repeats of generated tokens per second, the overhead against rate 0 (from
the medians, and the median of the per-repeat ratios with its bootstrap 95 % interval), and the head-steps audited
in its phases (from ``vllm:cert_audits_total``), with violations. The load average is sampled before and after.

    .venv/bin/python benchmarks/bench_audit_e2e.py    # prints the table, writes benchmarks/results/cpu_audit_e2e.json

On a CUDA machine give the model folder and the engine's settings, e.g. (the H200, through vLLM 0.26):

    python3 -P benchmarks/bench_audit_e2e.py --model /tmp/models/qwen2.5-coder-0.5b-instruct --dtype bfloat16 \
        --engine-arg gpu_memory_utilization=0.5 --out runs/h200_audit_e2e.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from certvllm.config import parse_key_values
from certvllm.models import prepare_default_model
from certvllm.vllm_plugin.harness import phase_deltas, run_engine

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
SENTENCE = "The certified cache keeps every original key and value in host memory while the device holds pages. "
RATES = (0.0, 0.001, 0.01)


def _sum(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1000, help="about this many tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rates", type=float, nargs="+", default=list(RATES),
                   help="audit rates to compare (0 is added: the baseline)")  # fmt: skip
    p.add_argument("--dtype", default="float32", help="activations (certvllm serve picks float32 on AVX2-only CPUs)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--torch-reference",
        action="store_true",
        help="also run the audited rates with the torch float64 reference (the pre-compiled path)",
    )
    p.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2, prepared if needed)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vLLM LLM(...) argument, repeatable (e.g. gpu_memory_utilization=0.5 on a GPU)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu_audit_e2e.json")
    args = p.parse_args(argv)
    try:
        engine_args = parse_key_values(args.engine_arg, "--engine-arg")
    except ValueError as err:
        p.error(str(err))
    model = args.model or MODEL
    if args.model is None:
        prepare_default_model(MODEL)

    sentences = max(1, round(args.prompt_tokens / 19))  # ≈ 19 tokens per sentence
    requests = [{"prompt": f"Document {i}. {SENTENCE * sentences}", "max_tokens": args.max_tokens, "ignore_eos": True}
                for i in range(args.batch)]  # fmt: skip
    rates = sorted({0.0, *args.rates})
    if not all(0.0 <= r <= 1.0 for r in rates):
        p.error(f"--rates {args.rates}: every rate must lie in [0, 1]")
    variants = [(rate, "compiled") for rate in rates]
    if args.torch_reference:
        variants += [(rate, "torch") for rate in rates if rate > 0]
    # the prefix cache filled, then a warm-up phase (every kernel and the audit path loaded)
    phases = [{"requests": [{**r, "max_tokens": 1} for r in requests], "audit_rate": 0.0},
              {"requests": requests, "audit_rate": RATES[1]}]  # fmt: skip
    order: list[tuple[float, str]] = []
    for rep in range(args.repeats):
        rotated = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        order += rotated
        phases += [{"requests": requests, "audit_rate": rate, "audit_reference": ref} for rate, ref in rotated]
    spec = {"model": model, "kv_cache_dtype": "certified", "cert": {"audit_rate": 0.001}, "phases": phases,
            "engine": {"max_model_len": args.max_model_len, "dtype": args.dtype, **engine_args}}  # fmt: skip
    load_before = os.getloadavg()
    started = time.time()
    res = run_engine(spec, timeout=3600.0, env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    load_after = os.getloadavg()
    deltas = phase_deltas(res)[2:]
    measured = res["phases"][2:]
    tokens = args.batch * args.max_tokens
    by_variant: dict[tuple[float, str], list[dict]] = {v: [] for v in variants}
    for v, phase, delta in zip(order, measured, deltas, strict=True):
        head_steps = _sum(delta, "vllm:cert_head_steps_total")
        by_variant[v].append({"seconds": phase["seconds"][0], "tok_s": tokens / phase["seconds"][0],
                              "audits": _sum(delta, "vllm:cert_audits_total"), "head_steps": head_steps,
                              "violations": _sum(delta, "vllm:cert_audit_violations_total")})  # fmt: skip
    reps = args.repeats
    base_runs = [r["tok_s"] for r in by_variant[(0.0, "compiled")]]
    rows = []
    for v in variants:
        runs = by_variant[v]
        tok_s = [r["tok_s"] for r in runs]
        ratios = [base_runs[i] / tok_s[i] - 1.0 for i in range(reps)]  # the same repeat: neighbours in time
        audits, steps = sum(r["audits"] for r in runs), sum(r["head_steps"] for r in runs)
        rows.append({"audit_rate": v[0], "reference": v[1], "median_tok_s": statistics.median(tok_s),
                     "overhead_vs_median": statistics.median(base_runs) / statistics.median(tok_s) - 1.0,
                     "overhead_median_of_repeats": statistics.median(ratios),
                     "overhead_ci95": median_ci(ratios) if v[0] > 0 else [0.0, 0.0], "runs_tok_s": tok_s,
                     "runs_overhead": ratios, "audits": audits, "head_steps": steps,
                     "audited_share": audits / steps if steps else 0.0,
                     "violations": sum(r["violations"] for r in runs)})  # fmt: skip
    print(f"decode through vLLM, {args.batch} requests × ~{args.prompt_tokens}-token prompts (prefix-cached) × "
          f"{args.max_tokens} tokens, {args.dtype}, certified (default preset); {reps} repeats, rates interleaved; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")  # fmt: skip
    print(f"{'audit_rate':>10} {'reference':>9} {'tok/s':>8} {'overhead':>9} {'(per repeat)':>13} "
          f"{'95% CI':>18} {'audits':>8} {'share':>8} {'violations':>10}")  # fmt: skip
    for r in rows:
        lo, hi = r["overhead_ci95"]
        print(f"{r['audit_rate']:>10g} {r['reference']:>9} {r['median_tok_s']:>8.2f} "
              f"{100 * r['overhead_vs_median']:>8.2f}% {100 * r['overhead_median_of_repeats']:>12.2f}% "
              f"{f'[{100 * lo:+.1f}, {100 * hi:+.1f}] %':>18} "
              f"{int(r['audits']):>8d} {r['audited_share']:>8.5f} {int(r['violations']):>10d}")  # fmt: skip
    threads = [line[-300:] for line in res["log"].splitlines() if "thread" in line.lower()]
    meta = {"model": model, "engine_args": engine_args,
            "batch": args.batch, "prompt_tokens": res["phases"][0]["outputs"][0]["prompt_tokens"],
            "max_tokens": args.max_tokens, "repeats": reps, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "order": [list(v) for v in order], "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_before": load_before, "load_average_after": load_after, "started": started,
            "wall_s": time.time() - started, "init_s": res["init_seconds"], "worker_threads_log": threads[:6],
            "workers": res["phases"][0].get("workers")}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def median_ci(values: list[float], resamples: int = 10_000, seed: int = 20261203) -> list[float]:
    """Percentile bootstrap 95 % interval of the median of ``values`` (the paired per-repeat overheads): how far the
    phases' scatter leaves the estimate from resolving a small effect."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


if __name__ == "__main__":
    raise SystemExit(main())
