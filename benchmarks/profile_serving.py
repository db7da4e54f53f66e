"""Where a served decode step's time goes: one engine per KV-cache dtype, its step loop under cProfile.

Each engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its worker share the
client's thread, so cProfile sees the scheduler, the model runner, the attention backend and the metrics alike)
with vLLM's default compilation and CUDA graphs. For each ``--batch`` size in turn (one engine serves them all: an
engine start costs minutes on a fresh machine) it serves that many prompts of ``--context`` random tokens three
times: a warm-up phase (prefill, graph captures, the prefix cache filled), a timed phase (decode only, no
profiler: the step time to compare the profile against), and a profiled phase. Per dtype and batch it prints the
milliseconds per decode step of the timed and the profiled phase, and the functions with the most own time and
the most time including callees; the JSON holds both tables, the ``vllm:cert_*`` counters the profiled phase
added, and the engine's log tail.

    python3 -P benchmarks/profile_serving.py .device/llama8b-dummy --dtypes certified auto --context 8192 \\
        --batch 1 8 --engine-arg load_format=certvllm-peaked-dummy --out runs/h200_profile_serving.json

A ``--dtypes`` entry may carry certvllm settings of its own after a ``+``, so that two settings of the certified
path are profiled in one run, each in its own engine, on top of ``--cert``:

    python3 -P benchmarks/profile_serving.py .device/llama8b-dummy --dtypes certified certified+cuda_graphs=false \
        --batch 1 8 --engine-arg load_format=certvllm-peaked-dummy --engine-arg max_num_seqs=64

cProfile adds a fixed cost to every Python call, so the profiled step is slower than the timed one; the ranking,
and the share of a step each part takes, is what it is for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from certvllm.config import parse_key_values
from certvllm.vllm_plugin.harness import metric_delta, run_engine

# this folder (never the repository root) for bench_serving's prompt draws: run with -P, Python leaves it out
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import prompt_ids, vocabulary  # noqa: E402

PHASES = ("warm-up", "timed", "profiled")


def prompts(model: str, batch: int, context: int, seed: int = 0) -> list[list[int]]:
    """``batch`` distinct prompts of ``context`` token ids, drawn as ``bench_serving`` draws its prompts."""
    pool = vocabulary(model)
    return [prompt_ids(pool, context, seed, f"profile-{i}") for i in range(batch)]


def variant(entry: str, cert: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ``--dtypes`` entry as (KV-cache dtype, certvllm settings): ``certified+KEY=VALUE,KEY=VALUE`` adds its own
    settings to ``cert`` (``--cert``); any other entry is a dtype with ``cert`` as it is."""
    dtype, _, extra = entry.partition("+")
    if not extra:
        return dtype, cert
    if dtype != "certified":
        raise ValueError(f"--dtypes {entry!r}: only certified takes settings after '+' (e.g. certified+KEY=VALUE)")
    return dtype, {**cert, **parse_key_values(extra.split(","), "--dtypes")}


def phase_names(kernels: int) -> tuple[str, ...]:
    """The phases of one batch size: :data:`PHASES`, and with ``--kernels`` a last one, ``prefill``: new prompts
    of the same length, one output token each, their kernels recorded (what a step with prefill costs)."""
    return PHASES + (("prefill",) if kernels else ())


def spec_for(args: argparse.Namespace, dtype: str, engine_args: dict[str, Any], cert: dict[str, Any]) -> dict:
    """The harness spec of one engine: per batch size, three phases over the same requests, the last one profiled
    (with ``--kernels``, its device kernels recorded too), then with ``--kernels`` the ``prefill`` phase."""
    phases = []
    for batch in args.batch:
        requests = [{"prompt_token_ids": ids, "max_tokens": args.max_tokens, "ignore_eos": True, "detokenize": False}
                    for ids in prompts(args.model, batch, args.context, seed=batch)]  # fmt: skip
        profiled: dict[str, Any] = {"requests": requests, "profile": args.top}
        if args.kernels:
            profiled["kernels"] = args.kernels
        phases += [{"requests": requests}, {"requests": requests}, profiled]
        if args.kernels:
            fresh = [{"prompt_token_ids": ids, "max_tokens": 1, "ignore_eos": True, "detokenize": False}
                     for ids in prompts(args.model, batch, args.context, seed=batch + 1000)]  # fmt: skip
            phases.append({"requests": fresh, "kernels": args.kernels})
    length = -(-(args.context + args.max_tokens + 16) // 1024) * 1024
    engine = {"enforce_eager": False, "max_model_len": length, "dtype": args.dtype, **engine_args}
    spec: dict[str, Any] = {"model": args.model, "kv_cache_dtype": dtype, "engine": engine, "phases": phases}
    if dtype == "certified" and cert:
        spec["cert"] = cert
    return spec


def summarize(dtype: str, batch: int, result: dict[str, Any], phases: list[dict], max_tokens: int) -> dict[str, Any]:
    """One engine's figures at one batch size (its phases, :func:`phase_names`): ms per decode step of the first
    three, the profile and the certified counters of the profiled phase, and with ``--kernels`` the recorded kernels
    of the profiled phase (per decode step) and of the prefill phase (with its wall seconds)."""
    step_ms = {name: 1e3 * sum(p["seconds"]) / max_tokens for name, p in zip(PHASES, phases, strict=False)}
    profiled = phases[len(PHASES) - 1]
    delta = metric_delta(profiled)
    cert = {k: v for k, v in delta.items() if k.startswith("vllm:cert_") and v and not k.endswith("_created")}
    out = {"dtype": dtype, "batch": batch, "init_seconds": result["init_seconds"], "step_ms": step_ms,
           "kv_cache_tokens": result.get("kv_cache_tokens"), "engine_config": result.get("engine_config"),
           "profile": profiled["profile"], "cert_counters": cert, "log_tail": result["log"][-20000:]}  # fmt: skip
    if "kernels" in profiled:
        out["decode_kernels"] = {**profiled["kernels"], "steps": max_tokens}
    if len(phases) > len(PHASES):
        prefill = phases[len(PHASES)]
        out["prefill_kernels"] = {**prefill["kernels"], "seconds": sum(prefill["seconds"])}
    return out


def print_summary(s: dict[str, Any], rows: int) -> None:
    ms = s["step_ms"]
    print(f"\n== {s['dtype']}, batch {s['batch']}: engine start {s['init_seconds']:.1f} s; ms per decode step: timed "
          f"{ms['timed']:.2f}, profiled {ms['profiled']:.2f} (warm-up phase {ms['warm-up']:.2f})")  # fmt: skip
    for key in ("tottime", "cumtime"):
        print(f"-- by {key} (s over the profiled phase)")
        for r in s["profile"][key][:rows]:
            print(f"{r[key]:9.3f} {r['calls']:9d}  {r['function'][:130]}")
    for key, per, unit in (("decode_kernels", s.get("decode_kernels", {}).get("steps", 1), "per decode step"),
                           ("prefill_kernels", 1, "over the prefill phase")):  # fmt: skip
        k = s.get(key)
        if not k:
            continue
        extra = f", {k['seconds']:.3f} s wall" if "seconds" in k else ""
        print(f"-- {key}: {k['total_us'] / per / 1e3:.2f} ms of kernels {unit} ({k['launches']} launches{extra})")
        for r in k["kernels"][:rows]:
            t = r.get("launch_us")
            each = f"  [launch µs p50 {t['p50']:.0f} / p90 {t['p90']:.0f} / max {t['max']:.0f}]" if t else ""
            print(f"{r['total_us'] / per / 1e3:9.3f} ms {r['launches'] / per:9.1f}  {r['kernel'][:110]}{each}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model folder (config.json + tokenizer; weights or a dummy load format)")
    p.add_argument("--dtypes", nargs="+", default=["certified", "auto"])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes, served in turn by one engine")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=60, help="functions kept per table")
    p.add_argument("--print-rows", type=int, default=40)
    p.add_argument("--kernels", type=int, default=0,
                   help="record the device kernels (torch.profiler) of the profiled phase and of a prefill phase of "
                        "new prompts; keep this many kernels of each (0: off)")  # fmt: skip
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cert", action="append", default=[], metavar="KEY=VALUE", help="certvllm settings")
    p.add_argument("--timeout", type=float, default=580.0, help="seconds per engine")
    p.add_argument("--out", type=Path, default=Path("runs/profile_serving.json"))
    args = p.parse_args(argv)
    try:
        engine_args = parse_key_values(args.engine_arg, "--engine-arg")
        cert = parse_key_values(args.cert, "--cert")
        variants = [(entry, *variant(entry, cert)) for entry in args.dtypes]
    except ValueError as err:
        p.error(str(err))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": args.model, "context": args.context, "batches": args.batch,
                              "max_tokens": args.max_tokens, "engines": []}  # fmt: skip
    for label, dtype, settings in variants:
        result = run_engine(spec_for(args, dtype, engine_args, settings), timeout=args.timeout,
                            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
        n = len(phase_names(args.kernels))
        for i, batch in enumerate(args.batch):
            summary = summarize(label, batch, result, result["phases"][n * i : n * i + n], args.max_tokens)
            report["engines"].append(summary)
            print_summary(summary, args.print_rows)
        args.out.write_text(json.dumps(report, indent=1))  # engine by engine: a cut run keeps what it finished
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
