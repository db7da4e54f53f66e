"""``certvllm eval``: perplexity, NIAH and RULER through the engine, dense vs certified vs naive.

    certvllm eval ppl|niah|ruler|file|all[,...] [--model DIR] [--contexts 1k,2k,4k,8k]
                  [--configs dense,certified:paper,naive] [--n N] [--n-ppl N] [--n-niah N] [--n-ruler N]
                  [--tasks-file FILE.jsonl] [--ruler-tasks niah_single,...] [--out DIR] [--cache-dir DIR]
                  [--seed S] [--ppl-score-tokens K] [--prefill exact|certified] [--kv-space-gb G] [--engines N]
                  [--report-only]

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
        help="dense, naive, certified or certified:PRESET_OR_YAML (the first dense one is the reference)",
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
    p.add_argument("--engines", type=int, default=1, help="configs run at the same time, each engine on its "
                   "own share of the CPU cores (CPU runs; default 1: one engine after the other)")  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from stored results")
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
                          max_model_len=max_len, batch=args.batch)  # fmt: skip

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

    total = sum(len(runner.pending(store, items, cfg)) for cfg in configs for items in by_kind.values())
    queue, written = list(configs), threading.Lock()

    def slot(bind: str | None) -> None:
        """Run configs from the queue one after the other, each in one engine serving every task family."""
        while True:
            with written:
                if not queue:
                    return
                cfg = queue.pop(0)
            started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            mine = replace(opts, log=[])
            try:
                runner.run_config(store, by_kind, cfg, mine, cpu_bind=bind)
            finally:
                with written, (out / "runs.jsonl").open("a") as f:
                    for entry in mine.log:
                        f.write(json.dumps({"started": started, **entry}) + "\n")

    with tqdm(total=total, desc="items", unit="item", dynamic_ncols=True) as bar:
        opts.progress = bar
        binds = cpu_binds(args.engines) if args.engines > 1 else [None]
        with ThreadPoolExecutor(len(binds)) as pool:
            for done in [pool.submit(slot, bind) for bind in binds]:
                done.result()  # the first failure, once every engine has finished
    rep = report.build(out)
    print(f"report: {out / 'report.md'} ({len(rep['configs'])} configs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, data.DataUnavailableError) as err:
        print(f"certvllm eval: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
