"""Run an offline vLLM engine in a fresh process and report tokens, timings and metrics as JSON.

Used by the engine tests, ``benchmarks/bench_e2e.py`` and the evaluation suite: one process per
engine keeps runs independent (vLLM spawns its own workers, and each run gets its own
``PROMETHEUS_MULTIPROC_DIR`` so the worker-side ``vllm:cert_*`` metrics can be read back).

    python -m certvllm.vllm_plugin.harness SPEC.json RESULT.json

SPEC: ``{"model": DIR, "kv_cache_dtype": "auto"|"certified", "cert": {...additional_config...},
"engine": {...LLM kwargs...}, "requests": [{"prompt": str | "prompt_token_ids": [...], "max_tokens": n,
"ignore_eos": bool}], "batch": bool, "repeat": int}``, or several such groups as ``"phases": [...]``.
RESULT: ``{"outputs": [{"token_ids": [...], "text": str}], "seconds": [...], "init_seconds": s,
"metrics": {series: value}}``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
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
            max_tokens=r.get("max_tokens", 32), temperature=0.0, ignore_eos=r.get("ignore_eos", False)
        )

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
                        "prompt_tokens": len(o.prompt_token_ids or [])} for o in got]  # fmt: skip
        return {"outputs": outputs, "seconds": seconds}

    phases = [run_phase(p) for p in spec.get("phases", [spec])]
    time.sleep(1.0)  # let the worker's metric flusher run (every 0.25 s)
    metrics = _read_metrics(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    llm.llm_engine.engine_core.shutdown()
    return {**phases[0], "phases": phases, "init_seconds": init, "metrics": metrics}


def run_engine(spec: dict[str, Any], timeout: float = 900.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``spec`` in a fresh Python process; raises RuntimeError with the log tail on failure."""
    with tempfile.TemporaryDirectory(prefix="certvllm-harness-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        spec_path.write_text(json.dumps(spec))
        child_env = {
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
            **os.environ, **(env or {}), "PROMETHEUS_MULTIPROC_DIR": str(Path(tmp, "metrics")),
        }  # fmt: skip
        Path(tmp, "metrics").mkdir()
        with log_path.open("w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "certvllm.vllm_plugin.harness", str(spec_path), str(out_path)],
                stdout=log, stderr=subprocess.STDOUT, env=child_env, timeout=timeout, start_new_session=True,
            )
        log_text = log_path.read_text()
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"engine run failed (exit {proc.returncode}):\n{log_text[-6000:]}")
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
