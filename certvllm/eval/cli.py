"""``certvllm eval``: perplexity, NIAH and RULER through the engine, dense vs certified vs naive.

    certvllm eval ppl|niah|ruler|file|all[,...] [--model DIR] [--contexts 1k,2k,4k,8k]
                  [--configs dense,certified:paper,naive] [--n N] [--n-ppl N] [--n-niah N] [--n-ruler N]
                  [--tasks-file FILE.jsonl] [--ruler-tasks niah_single,...] [--out DIR] [--cache-dir DIR]
                  [--seed S] [--ppl-score-tokens K] [--prefill exact|certified] [--kv-space-gb G] [--engines N]
                  [--device cpu|cuda] [--stall-timeout S] [--time-limit S]
                  [--engine-arg KEY=VALUE ...] [--cert KEY=VALUE ...]
                  [--report-only] [--items-only]

Results are appended per (task, context, config) under ``--out/results``; rerunning skips every item
already there (same content), so an interrupted run resumes. The report (``report.json``,
``report.md``, plots) is rebuilt from everything under ``--out`` at the end. See ``docs/evaluation.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from certvllm.config import load_config, parse_key_values
from certvllm.eval import data, report, runner, tasks
from certvllm.vllm_plugin.harness import cpu_binds

DEFAULT_MODEL = "models/smollm2-135m-instruct"
FAMILIES = ("ppl", "niah", "ruler", "file")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="certvllm eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("tasks", help="ppl, niah, ruler, file or all (comma-separated for several)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF model folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--contexts", default="1k,2k,4k,8k", help="context lengths in tokens (1k = 1024)")
    p.add_argument(
        "--configs",
        default="dense,certified:paper,naive",
        help="dense, fp8 (CUDA), naive, certified or certified:PRESET_OR_YAML, the certvllm ones optionally with "
        "+FIELD=VALUE (dense is the reference)",
    )
    p.add_argument("--n", type=int, default=10, help="items per task and context (default 10)")
    p.add_argument("--n-ppl", type=int, help="perplexity windows per context (default --n)")
    p.add_argument("--n-niah", type=int, help="NIAH trials per context (default --n)")
    p.add_argument("--n-ruler", type=int, help="RULER samples per task and context (default --n)")
    p.add_argument("--ruler-tasks", default=",".join(tasks.RULER_TASKS), help="RULER tasks to run")
    p.add_argument("--tasks-file", type=Path, help='JSONL of {"prompt": ..., "answers": [...]} (task "file")')
    p.add_argument("--out", type=Path, default=Path("runs/eval"), help="results and report folder")
    p.add_argument("--cache-dir", type=Path, default=None, help="downloads and generated tasks "
                   "(default $CERTVLLM_EVAL_CACHE or ~/.cache/certvllm/eval)")  # fmt: skip
    p.add_argument("--seed", type=int, default=20260416, help="seed of every generated item (paired across configs)")
    p.add_argument(
        "--ppl-score-tokens",
        type=int,
        default=128,
        help="tokens scored at the end of each perplexity window (each a certified row)",
    )
    p.add_argument(
        "--prefill",
        choices=("exact", "certified"),
        default="exact",
        help="generation tasks: prefill exactly (default, the paper's protocol) or certified",
    )
    p.add_argument("--kv-space-gb", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE for each engine")
    p.add_argument("--batch", type=int, default=16, help="generation requests per phase (a resumable unit)")
    p.add_argument("--engines", type=int, default=1, help="configs run at the same time (default 1: one engine "
                   "after the other); on the CPU each engine gets its own share of the cores")  # fmt: skip
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engines run: on cuda --engines N share the GPU (give each a share with "
        "--engine-arg gpu_memory_utilization=F)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=3600.0,
        help="seconds an engine may go without finishing a phase (startup included) before it is stopped with "
        "its processes' stacks in the error (default 3600; 0 = no limit)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="seconds for the whole invocation: engines still running then are stopped (their finished phases "
        "are kept, a rerun resumes) and no further config starts; for a machine lent by the hour (0 = no limit)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vLLM LLM(...) argument for every engine, repeatable (e.g. gpu_memory_utilization=0.2)",
    )
    p.add_argument(
        "--cert",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="CertConfig field for every certvllm config (certified, naive), repeatable (e.g. host_memory_gb=12)",
    )
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from stored results")
    p.add_argument(
        "--items-only",
        action="store_true",
        help="only build (and cache) every item, start no engine: run where the package registry is reachable, "
        "then carry --cache-dir to an offline GPU machine",
    )
    return p


def _families(spec: str, tasks_file: Path | None) -> list[str]:
    chosen: list[str] = []
    for name in spec.split(","):
        name = name.strip()
        if name == "all":
            chosen += ["ppl", "niah", "ruler"] + (["file"] if tasks_file else [])
        elif name in FAMILIES:
            chosen.append(name)
        else:
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(FAMILIES)} or all")
    if "file" in chosen and tasks_file is None:
        raise ValueError("task 'file' needs --tasks-file FILE.jsonl")
    return list(dict.fromkeys(chosen))


def _model_max_len(model: str) -> int:
    config = json.loads(Path(model, "config.json").read_text())
    return int(config.get("max_position_embeddings", 8192))


def _engine_settings(args: argparse.Namespace, configs: list[runner.EngineConfig]) -> dict[str, Any]:
    """``engine_args`` / ``cert_args`` of :class:`runner.Options` from ``--engine-arg`` / ``--cert``, checked here
    (before any engine starts): the CertConfig fields against the config model, the device settings against
    ``--device``."""
    engine_args = parse_key_values(args.engine_arg, "--engine-arg")
    cert_args = parse_key_values(args.cert, "--cert")
    if cert_args:
        load_config(None, **cert_args)  # CertConfigError names the field and its range
    if args.engines < 1:
        raise ValueError(f"--engines {args.engines}: give at least 1")
    if args.device == "cpu" and any(c.kv_cache_dtype == "fp8" for c in configs):
        raise ValueError("config fp8 (vLLM's FP8 KV cache) runs on CUDA only: pass --device cuda on a GPU machine")
    if args.device == "cuda" and args.engines > 1 and "gpu_memory_utilization" not in engine_args:
        share = 0.9 / args.engines
        raise ValueError(
            f"--engines {args.engines} on one GPU: each engine would take vLLM's default 90 % of its memory; "
            f"pass --engine-arg gpu_memory_utilization=F with F <= {share:.2f}"
        )
    if args.stall_timeout < 0:
        raise ValueError(f"--stall-timeout {args.stall_timeout:g}: give seconds > 0, or 0 for no limit")
    if args.time_limit < 0:
        raise ValueError(f"--time-limit {args.time_limit:g}: give seconds > 0, or 0 for no limit")
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    return {"engine_args": engine_args, "cert_args": cert_args, "stall_timeout": args.stall_timeout or None,
            "deadline": deadline}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        report.build(out)
        print(f"report: {out / 'report.md'}")
        return 0
    families = _families(args.tasks, args.tasks_file)
    contexts = [c.strip() for c in args.contexts.split(",") if c.strip()]
    configs = [runner.parse_config(c.strip()) for c in args.configs.split(",") if c.strip()]
    cache = args.cache_dir or data.default_cache_dir()
    max_len = _model_max_len(args.model)
    too_long = [c for c in contexts if tasks.parse_context(c) > max_len]
    if too_long:
        raise ValueError(f"contexts {too_long} exceed the model's {max_len} tokens")
    with (out / "commands.jsonl").open("a") as f:
        f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                            "argv": ["certvllm", "eval", *sys.argv[2:]] if sys.argv[1:2] == ["eval"] else sys.argv,
                            "seed": args.seed}) + "\n")  # fmt: skip
    n = {f: getattr(args, f"n_{f}", None) or args.n for f in ("ppl", "niah", "ruler")}
    store = runner.Store(out)
    opts = runner.Options(model=args.model, out=out, kv_space_gb=args.kv_space_gb, prefill=args.prefill,
                          max_model_len=max_len, batch=args.batch, **_engine_settings(args, configs))  # fmt: skip

    print("preparing items ...", flush=True)
    by_kind: dict[str, list[tasks.Item]] = {"ppl": [], "gen": []}
    if "ppl" in families:
        for c in contexts:
            by_kind["ppl"] += tasks.build_ppl(args.model, cache, c, n["ppl"], args.seed, args.ppl_score_tokens, max_len)
    if "niah" in families:
        for c in contexts:
            by_kind["gen"] += tasks.build_niah(args.model, cache, c, n["niah"], args.seed)
    if "ruler" in families:
        names = [t.strip() for t in args.ruler_tasks.split(",") if t.strip()]
        built = tasks.build_ruler(args.model, cache, [(t, c) for c in contexts for t in names], n["ruler"], args.seed)
        for items in built.values():
            by_kind["gen"] += items
    if "file" in families:
        tok = tasks.load_tokenizer(args.model)
        for it in tasks.load_tasks_file(args.tasks_file, args.n):
            it["meta"]["prompt_tokens"] = len(tok(it["prompt"])["input_ids"])
            by_kind["gen"].append(it)

    if args.items_only:
        counts = {kind: len(items) for kind, items in by_kind.items()}
        print(f"items ready in {cache}: {counts['ppl']} perplexity windows, {counts['gen']} generation items")
        return 0
    total = sum(len(runner.pending(store, items, cfg)) for cfg in configs for items in by_kind.values())
    queue, written = list(configs), threading.Lock()

    failed: dict[str, str] = {}

    def slot(bind: str | None) -> None:
        """Run configs from the queue one after the other, each in one engine serving every task family. A config
        whose engine fails is reported at once (stderr and ``runs.jsonl``), and the slot goes on with the next one:
        beside other engines, a failure must not wait unseen until every other config has finished."""
        while True:
            with written:
                if not queue:
                    return
                if opts.deadline is not None and time.monotonic() >= opts.deadline:
                    failed.update((c.name, "not started: --time-limit reached") for c in queue)
                    queue.clear()
                    return
                cfg = queue.pop(0)
            started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            mine = replace(opts, log=[])
            try:
                runner.run_config(store, by_kind, cfg, mine, cpu_bind=bind)
            except Exception as err:  # noqa: BLE001 - any engine failure: report it, keep the others going
                failed[cfg.name] = str(err)
                mine.log.append({"config": cfg.name, "error": str(err)[-4000:],
                                 "failed": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})  # fmt: skip
                print(f"certvllm eval: config {cfg.name} failed; its finished phases are kept, rerun the same command "
                      f"to resume it:\n{str(err)[-2000:]}", file=sys.stderr, flush=True)  # fmt: skip
            finally:
                with written, (out / "runs.jsonl").open("a") as f:
                    for entry in mine.log:
                        f.write(json.dumps({"started": started, **entry}) + "\n")

    with tqdm(total=total, desc="items", unit="item", dynamic_ncols=True) as bar:
        opts.progress = bar
        binds = cpu_binds(args.engines) if args.engines > 1 and args.device == "cpu" else [None] * args.engines
        with ThreadPoolExecutor(len(binds)) as pool:
            for done in [pool.submit(slot, bind) for bind in binds]:
                done.result()
    status = 0
    if failed:
        print(f"certvllm eval: {len(failed)} config(s) failed: {', '.join(failed)} (errors above and in "
              f"{out / 'runs.jsonl'}); the report covers what finished", file=sys.stderr)  # fmt: skip
        status = 1
    try:
        rep = report.build(out)
    except ImportError as err:  # a GPU machine without the eval extra: the results are stored, the report waits
        print(f"report not built ({err}): install the eval extra (pip install 'certvllm[eval]') where the results "
              f"are, then run: certvllm eval all --report-only --out {out}")  # fmt: skip
        return status
    except ValueError as err:  # nothing finished at all
        print(f"report not built: {err}", file=sys.stderr)
        return status or 2
    print(f"report: {out / 'report.md'} ({len(rep['configs'])} configs)")
    return status


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, data.DataUnavailableError) as err:
        print(f"certvllm eval: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
