"""Engine runs for the evaluation suite: one engine per config for every task and context, resumable.

Configs: ``dense`` (``kv_cache_dtype="auto"``), ``fp8`` (vLLM's own FP8 cache, ``kv_cache_dtype="fp8"``: the
quantized cache operators run today; CUDA only), ``certified`` / ``certified:PRESET_OR_YAML``
(``kv_cache_dtype="certified"``, ``additional_config={"certvllm": {"preset": ...}}``) and ``naive``
(certified with the ``naive`` preset).

* Generation tasks (NIAH, RULER, ``--tasks-file``): greedy decoding, never reading the prefix cache; the
  prompt is prefilled exactly (the paper's protocol: dense prefill, certified decode) unless
  ``--prefill certified``.
* Perplexity needs prefix caching and ``prefill: certified``. Each window is one phase of two requests:
  the prefix (``context - score_tokens`` tokens, one exact prefill chunk, kept in the prefix cache), then
  the whole window with ``prompt_logprobs`` reading that cached prefix, so each scored token is a certified
  row over the quantized cache: one certified head-step per layer and query head, exactly what a
  teacher-forced decode step computes (``docs/evaluation.md``).

Both families share the config's engine (perplexity windows first): prefix caching and ``prefill:
certified`` are engine-wide, so the generation requests skip reading the prefix cache and chunked prefill
is off (each prompt is prefilled whole, with no cached context: the exact path, as in an engine of their
own). Under ``--prefill certified`` generation keeps an engine of its own, chunked at vLLM's default
budget (which perplexity's one-chunk prefixes cannot share).

Results are appended to ``OUT/results/TASK/CONTEXT/CONFIG.jsonl`` as soon as the engine finishes each
phase, with the phase's metric deltas (rungs, fallbacks, bounds) in ``CONFIG.phases.jsonl``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from certvllm.config import load_config, parse_key_values
from certvllm.eval import scoring
from certvllm.eval.tasks import Item, parse_context
from certvllm.vllm_plugin.harness import run_engine

ENGINE_TIMEOUT_S = 12 * 3600.0
KEEP_METRICS = ("vllm:cert_", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


@dataclass(frozen=True)
class EngineConfig:
    """One compared configuration."""

    name: str  # as given: dense, certified:paper, naive
    kv_cache_dtype: str
    cert: dict[str, Any] | None = None

    @property
    def slug(self) -> str:
        return self.name.replace(":", "-").replace("/", "_").replace(".yaml", "")


def parse_config(name: str) -> EngineConfig:
    """``dense`` | ``auto`` | ``fp8`` | ``naive`` | ``certified`` | ``certified:PRESET_OR_YAML``, the certvllm ones
    optionally followed by ``+FIELD=VALUE`` overrides of ``CertConfig`` fields: the stress study's formats are e.g.
    ``naive+value_code_levels=3`` beside ``certified+value_code_levels=3`` (docs/evaluation.md)."""
    head, *extra = name.split("+")
    kind, _, preset = head.partition(":")
    overrides = parse_key_values(extra, f"config {name!r}: each +FIELD=VALUE (e.g. naive+value_code_levels=3)")
    if kind in ("dense", "auto", "fp8") and not preset and not overrides:
        return EngineConfig(name, "fp8" if kind == "fp8" else "auto")
    if kind == "naive" and not preset:
        preset = "naive"
    elif kind != "certified":
        raise ValueError(f"unknown config {name!r}: use dense, fp8, naive, certified or certified:PRESET, certvllm "
                         "ones optionally with +FIELD=VALUE")  # fmt: skip
    load_config(preset or None, **overrides)  # validate now (CertConfigError names the fix)
    cert = ({"preset": preset} if preset else {}) | overrides
    return EngineConfig(name, "certified", cert)


@dataclass
class Store:
    """The JSONL files under ``OUT/results``."""

    out: Path

    def path(self, task: str, context: str, config: EngineConfig, suffix: str = ".jsonl") -> Path:
        return self.out / "results" / task.replace(":", "_") / context / f"{config.slug}{suffix}"

    def done(self, task: str, context: str, config: EngineConfig) -> dict[str, str]:
        path = self.path(task, context, config)
        if not path.exists():
            return {}
        found = {}
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted write
            if scoring.unscored_window(row):
                continue
            found[row["id"]] = row["hash"]
        return found

    def append(self, path: Path, rows: Iterable[dict[str, Any]]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


@dataclass
class Options:
    """Settings shared by every engine run of one ``certvllm eval`` invocation."""

    model: str
    out: Path
    kv_space_gb: float = 2.0
    prefill: str = "exact"
    max_model_len: int = 8192
    batch: int = 16
    engine_args: dict[str, Any] = field(default_factory=dict)  # every engine's extra LLM kwargs (--engine-arg)
    stall_timeout: float | None = None  # seconds without a finished phase before an engine is stopped (its stacks)
    cert_args: dict[str, Any] = field(default_factory=dict)  # every certvllm config's CertConfig fields (--cert)
    deadline: float | None = None  # time.monotonic() at which every engine is stopped (--time-limit)
    progress: Any = None  # a tqdm-like object with update(n) and set_postfix_str(s)
    log: list[dict[str, Any]] = field(default_factory=list)


def _metric_delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    keep = {
        k: v
        for k, v in now.items()
        if k.startswith(KEEP_METRICS) and "_bucket{" not in k and not k.startswith("vllm:cert_host_tier_bytes")
    }
    return {k: v - before.get(k, 0.0) for k, v in keep.items() if v - before.get(k, 0.0)}


def pending(store: Store, items: list[Item], config: EngineConfig) -> list[Item]:
    """Items without a stored result of the same content for ``config``."""
    done: dict[tuple[str, str], dict[str, str]] = {}
    todo = []
    for it in items:
        key = (it["task"], it["context"])
        if key not in done:
            done[key] = store.done(it["task"], it["context"], config)
        if done[key].get(it["id"]) != it["hash"]:
            todo.append(it)
    return todo


def _phases(items: list[Item], kind: str, batch: int) -> list[list[Item]]:
    """Phases in context order, one (task, context) per phase; PPL: one window per phase."""
    groups: dict[tuple[int, str, str], list[Item]] = {}
    for it in items:
        ctx = parse_context(it["context"]) if it["context"] != "file" else 0
        groups.setdefault((ctx, it["context"], it["task"]), []).append(it)
    size = 1 if kind == "ppl" else batch
    return [g[i : i + size] for _, g in sorted(groups.items()) for i in range(0, len(g), size)]


def _requests(phase: list[Item], kind: str) -> dict[str, Any]:
    """One harness phase: a perplexity window's two requests, or a batch of generation items (which never
    read the prefix cache: their prompts are prefilled as if the engine had none)."""
    if kind == "ppl":
        it = phase[0]
        return {"batch": False, "requests": [
            {"prompt_token_ids": it["token_ids"][: it["prefix_len"]], "max_tokens": 1,
             "skip_reading_prefix_cache": True},  # one exact chunk, whatever the cache holds
            {"prompt_token_ids": it["token_ids"], "max_tokens": 1, "prompt_logprobs": True,
             "skip_reading_prefix_cache": False, "detokenize": False},
        ]}  # fmt: skip
    return {"batch": True, "requests": [{"prompt": it["prompt"], "max_tokens": it["max_tokens"],
                                         "skip_reading_prefix_cache": True} for it in phase]}  # fmt: skip


def engine_spec(config: EngineConfig, kinds: str | Collection[str], opts: Options, max_len: int) -> dict[str, Any]:
    """The harness spec (without requests) of one engine run serving the task families ``kinds``
    (``"ppl"``, ``"gen"`` or both)."""
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    engine: dict[str, Any] = {"max_model_len": max_len, "enforce_eager": True, "seed": 0, **opts.engine_args}
    cert = opts.cert_args | config.cert if config.cert is not None else None
    if "ppl" in kinds:
        # a perplexity prefix is one exact prefill chunk, then read back from the prefix cache by its window;
        # generation prompts beside it must not be chunked (their prefill then stays exact)
        if "gen" in kinds and opts.prefill == "certified":
            raise ValueError("--prefill certified generation needs an engine of its own (vLLM's chunking)")
        engine.update(enable_prefix_caching=True, enable_chunked_prefill="gen" not in kinds,
                      max_num_batched_tokens=max(max_len, 2048))  # fmt: skip
    else:
        engine.update(enable_prefix_caching=False)
    if cert is not None and ("ppl" in kinds or opts.prefill == "certified"):
        cert["prefill"] = "certified"
    spec: dict[str, Any] = {"model": opts.model, "kv_cache_dtype": config.kv_cache_dtype, "engine": engine}
    if cert is not None:
        spec["cert"] = cert
    return spec


def _max_len(items: list[Item], kind: str, limit: int) -> int:
    """The engine's ``max_model_len`` for ``items`` of one family (at most ``limit``)."""
    if kind == "ppl":
        return min(limit, max(len(it["token_ids"]) for it in items) + 1)
    lengths = [parse_context(it["context"]) for it in items if it["context"] != "file"]
    lengths += [it["meta"].get("prompt_tokens", 0) + it["max_tokens"] for it in items if it["context"] == "file"]
    return min(limit, max(lengths))


def run_config(store: Store, items: dict[str, list[Item]], config: EngineConfig, opts: Options,
               cpu_bind: str | None = None) -> int:  # fmt: skip
    """Run every pending item of every family (``{"ppl": [...], "gen": [...]}``) for ``config``: in one
    engine, or under ``--prefill certified`` one per family (see :func:`engine_spec`); each engine's worker
    on the cores ``cpu_bind`` (``VLLM_CPU_OMP_THREADS_BIND``) when given. Returns the items run."""
    todo = {kind: found for kind, its in items.items() if (found := pending(store, its, config))}
    kinds = sorted(todo, key=lambda k: k != "ppl")  # perplexity windows first
    groups = [kinds] if opts.prefill == "exact" else [[kind] for kind in kinds]
    return sum(_run_engine(store, {k: todo[k] for k in group}, config, opts, cpu_bind) for group in groups if group)


def _run_engine(store: Store, todo: dict[str, list[Item]], config: EngineConfig, opts: Options,
                cpu_bind: str | None) -> int:  # fmt: skip
    """One engine for the pending items ``todo`` of one or more families."""
    kinds = list(todo)
    phases = [(kind, p) for kind in kinds for p in _phases(todo[kind], kind, opts.batch)]
    max_len = max(_max_len(todo[kind], kind, opts.max_model_len) for kind in kinds)
    spec = engine_spec(config, kinds, opts, max_len)
    spec["phases"] = [_requests(p, kind) for kind, p in phases]
    state: dict[str, Any] = {"t": time.perf_counter()}
    if opts.progress is not None:
        opts.progress.set_postfix_str(f"{config.name}: starting engine")

    def on_phase(record: dict[str, Any]) -> None:
        kind, phase = phases[record["phase"]]
        delta = _metric_delta(record["metrics"], record["metrics_before"])
        rows = []
        outputs = record["outputs"][-1:] if kind == "ppl" else record["outputs"]
        for it, out in zip(phase, outputs, strict=True):
            row = {"id": it["id"], "hash": it["hash"], "task": it["task"], "context": it["context"],
                   "config": config.name, "meta": it.get("meta", {})}  # fmt: skip
            if kind == "ppl":
                row.update(scoring.score_perplexity(it, out["prompt_logprobs"], out["cached_tokens"]))
            else:
                row.update(scoring.score_generation(it, out["text"]))
                row.update(output=out["text"][:400], answers=it["answers"], prompt_tokens=out["prompt_tokens"],
                           generated_tokens=len(out["token_ids"]))  # fmt: skip
            rows.append(row)
        first = phase[0]
        store.append(store.path(first["task"], first["context"], config), rows)
        now = time.perf_counter()
        store.append(store.path(first["task"], first["context"], config, ".phases.jsonl"), [{
            "task": first["task"], "ids": [it["id"] for it in phase], "seconds": sum(record["seconds"]),
            "wall_seconds": now - state["t"],
            "metrics": delta,
        }])  # fmt: skip
        state["t"] = now
        if opts.progress is not None:
            opts.progress.update(len(phase))
            opts.progress.set_postfix_str(f"{config.name} {first['task']} {first['context']}")

    env = {"VLLM_CPU_KVCACHE_SPACE": f"{opts.kv_space_gb:g}"}
    if cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    start = time.perf_counter()
    timeout = ENGINE_TIMEOUT_S if opts.deadline is None else max(1.0, opts.deadline - time.monotonic())
    result = run_engine(spec, timeout=timeout, env=env, on_phase=on_phase, stall_timeout=opts.stall_timeout)
    count = sum(len(its) for its in todo.values())
    opts.log.append({"kind": "+".join(kinds), "config": config.name,
                     "items": count, "phases": len(phases), "init_seconds": result["init_seconds"],
                     "wall_seconds": time.perf_counter() - start, "kv_cache_tokens": result.get("kv_cache_tokens"),
                     "max_model_len": max_len})  # fmt: skip
    return count
