"""Run an offline vLLM engine in a fresh process and report tokens, timings and metrics as JSON.

Used by the engine tests, ``benchmarks/bench_e2e.py`` and the evaluation suite: one process per
engine keeps runs independent (vLLM spawns its own workers, and each run gets its own
``PROMETHEUS_MULTIPROC_DIR`` so the worker-side ``vllm:cert_*`` metrics can be read back).

    python -m certvllm.vllm_plugin.harness SPEC.json RESULT.json

SPEC: ``{"model": DIR, "kv_cache_dtype": "auto"|"certified", "cert": {...additional_config...},
"engine": {...LLM kwargs...}, "requests": [{"prompt": str | "prompt_token_ids": [...], "max_tokens": n,
"ignore_eos": bool, "prompt_logprobs": bool, "skip_reading_prefix_cache": bool, "detokenize": bool}],
"batch": bool,
"repeat": int}``, or several such groups as ``"phases": [...]``.
RESULT: ``{"outputs": [{"token_ids": [...], "text": str}], "seconds": [...], "init_seconds": s,
"metrics": {series: value}}``. A request with ``"prompt_logprobs": true`` also gets
``"prompt_logprobs": [None, lp_1, ...]``: the log-probability of each actual prompt token given the
tokens before it (vLLM's ``SamplingParams(prompt_logprobs=0)``), ``None`` for the first. vLLM skips the
prefix cache for such requests unless ``"skip_reading_prefix_cache": false``; then only the positions
after the cached prefix are computed, and the earlier entries are ``None`` (pass ``"detokenize": false``:
vLLM would otherwise detokenize the uncomputed entries' token ids).

``run_engine(spec, on_phase=callback)`` streams: after each phase the child appends
``{"phase": i, "outputs", "seconds", "metrics"}`` (metrics: a cumulative snapshot) to a progress file
and the parent calls ``callback(record)`` while the engine keeps running, so a caller can save results
phase by phase (the evaluation suite's resumable runs).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_ENGINE = {"enforce_eager": True, "max_model_len": 2048, "dtype": "bfloat16", "seed": 0}


def _read_metrics(path: str) -> dict[str, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    values: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine"))
            values[f"{sample.name}{{{labels}}}"] = values.get(f"{sample.name}{{{labels}}}", 0.0) + sample.value
    return values


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    engine = {**DEFAULT_ENGINE, **spec.get("engine", {})}
    if spec.get("cert") is not None:
        engine["additional_config"] = {"certvllm": spec["cert"]}
    start = time.perf_counter()
    llm = LLM(spec["model"], kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), disable_log_stats=False, **engine)
    init = time.perf_counter() - start

    def params(r: dict[str, Any]) -> Any:
        return SamplingParams(
            max_tokens=r.get("max_tokens", 32), temperature=0.0, ignore_eos=r.get("ignore_eos", False),
            prompt_logprobs=0 if r.get("prompt_logprobs") else None,
            skip_reading_prefix_cache=r.get("skip_reading_prefix_cache"), detokenize=r.get("detokenize", True),
        )  # fmt: skip

    def prompt_logprobs(o: Any) -> list[float | None]:
        """Log-probability of each actual prompt token (vLLM's dict also holds the top-0 entries)."""
        ids, per_pos = list(o.prompt_token_ids or []), o.prompt_logprobs or []
        # with a prefix-cache hit of c tokens, rows 0..c-1 were not computed: positions 1..c have no entry
        cached = o.num_cached_tokens or 0
        return [None if lp is None or i <= cached or ids[i] not in lp else float(lp[ids[i]].logprob)
                for i, lp in enumerate(per_pos)]  # fmt: skip

    def prompt(r: dict[str, Any]) -> Any:
        return {"prompt_token_ids": r["prompt_token_ids"]} if "prompt_token_ids" in r else r["prompt"]

    def run_phase(phase: dict[str, Any]) -> dict[str, Any]:
        requests = phase["requests"]
        seconds, outputs = [], []
        for _ in range(phase.get("repeat", 1)):
            if phase.get("batch", True):
                t = time.perf_counter()
                got = llm.generate([prompt(r) for r in requests], [params(r) for r in requests], use_tqdm=False)
                seconds.append(time.perf_counter() - t)
            else:
                got = []
                for r in requests:
                    t = time.perf_counter()
                    got += llm.generate([prompt(r)], [params(r)], use_tqdm=False)
                    seconds.append(time.perf_counter() - t)
            outputs = [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                        "prompt_tokens": len(o.prompt_token_ids or []),
                        "cached_tokens": o.num_cached_tokens or 0} for o in got]  # fmt: skip
            for out, r, o in zip(outputs, requests, got, strict=True):
                if r.get("prompt_logprobs"):
                    out["prompt_logprobs"] = prompt_logprobs(o)
        return {"outputs": outputs, "seconds": seconds}

    progress = spec.get("progress")
    phases = []
    for i, phase in enumerate(spec.get("phases", [spec])):
        phases.append(run_phase(phase))
        if progress:  # stream this phase with a metrics snapshot (the flusher runs every 0.25 s)
            time.sleep(0.6)
            snapshot = _read_metrics(os.environ["PROMETHEUS_MULTIPROC_DIR"])
            with open(progress, "a") as f:
                f.write(json.dumps({"phase": i, **phases[-1], "metrics": snapshot}) + "\n")
    time.sleep(1.0)  # let the worker's metric flusher run (every 0.25 s)
    metrics = _read_metrics(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    llm.llm_engine.engine_core.shutdown()
    return {**phases[0], "phases": phases, "init_seconds": init, "metrics": metrics}


def _follow(proc: subprocess.Popen, progress: Path, on_phase: Callable[[dict[str, Any]], None], timeout: float) -> int:
    """Wait for ``proc``, handing every complete line appended to ``progress`` to ``on_phase``."""
    deadline, offset = time.monotonic() + timeout, 0

    def drain() -> None:
        nonlocal offset
        if not progress.exists():
            return
        with progress.open() as f:
            f.seek(offset)
            while (line := f.readline()).endswith("\n"):
                offset = f.tell()
                on_phase(json.loads(line))

    try:
        while True:
            try:
                code = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                drain()
                if time.monotonic() > deadline:
                    raise
                continue
            drain()
            return code
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine and its workers share the child's session
        proc.wait()
        raise


def run_engine(
    spec: dict[str, Any], timeout: float = 900.0, env: dict[str, str] | None = None,
    on_phase: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run ``spec`` in a fresh Python process; raises RuntimeError with the log tail on failure.

    With ``on_phase``, each finished phase is handed over as soon as the engine completes it (see the
    module docstring); ``timeout`` then bounds the whole run as well.
    """
    with tempfile.TemporaryDirectory(prefix="certvllm-harness-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        if on_phase is not None:
            spec = {**spec, "progress": str(Path(tmp, "progress.jsonl"))}
        spec_path.write_text(json.dumps(spec))
        child_env = {
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
            **os.environ, **(env or {}), "PROMETHEUS_MULTIPROC_DIR": str(Path(tmp, "metrics")),
        }  # fmt: skip
        Path(tmp, "metrics").mkdir()
        command = [sys.executable, "-m", "certvllm.vllm_plugin.harness", str(spec_path), str(out_path)]
        with log_path.open("w") as log:
            if on_phase is None:
                returncode = subprocess.run(
                    command, stdout=log, stderr=subprocess.STDOUT, env=child_env, timeout=timeout,
                    start_new_session=True,
                ).returncode  # fmt: skip
            else:
                proc = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
                )
                returncode = _follow(proc, Path(spec["progress"]), on_phase, timeout)
        log_text = log_path.read_text()
        if returncode != 0 or not out_path.exists():
            raise RuntimeError(f"engine run failed (exit {returncode}):\n{log_text[-6000:]}")
        result = json.loads(out_path.read_text())
        capacity = re.search(r"KV cache size: ([\d,]+) tokens", log_text)
        result["kv_cache_tokens"] = int(capacity.group(1).replace(",", "")) if capacity else None
        return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = _run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
