"""``benchmarks/bench_serving.py`` and ``benchmarks/plot_serving.py``: the figures' arithmetic, and a CPU smoke run.

The smoke run serves the bundled SmolLM2 (its real weights: with random ones the certified engine promotes
nearly every page, a pathological case) through ``auto`` and ``certified`` engines, one after the other as
the benchmark does on a GPU, at context 64 with concurrency 1 and 2 and 8 output tokens; a second context
(128) exceeds ``--max-model-len 64``, so its cells are skipped without running. The contexts are as short as
the checks allow (a prompt of context − 8 tokens, a warm-up of 32): the BF16 prefill is the costly part of a
cell on this CPU, and what is checked is the benchmark's bookkeeping, not the figures. vLLM's CPU worker
computes on one core (its own binding) and the other is left to the engine's scheduler and the client; the
run's time is mostly the two engine starts.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_serving.py"
PLOT = ROOT / "benchmarks" / "plot_serving.py"
MODEL = ROOT / "models" / "smollm2-135m-instruct"
MAX_TOKENS = 8
CONTEXT = 64  # the measured context; the second one (2 × CONTEXT) is past --max-model-len


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_request_figures_split_merged_chunks() -> None:
    """TTFT is the first chunk's arrival; a chunk of k tokens gives k gaps of a k-th of its wait."""
    bench = _bench()
    r = bench.request_figures(10.0, [(10.5, 1), (10.7, 1), (11.1, 2), (11.2, 0)])
    assert r["output_tokens"] == 4 and r["max_chunk"] == 2
    assert r["ttft_s"] == pytest.approx(0.5) and r["e2e_s"] == pytest.approx(1.1)
    assert r["itl_s"] == pytest.approx([0.2, 0.2, 0.2])
    assert r["tpot_s"] == pytest.approx(0.6 / 3)
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert bench.percentile([5.0], 99) == 5.0


def test_time_split_puts_the_gap_before_and_after_the_last_first_token() -> None:
    """The H100 run of 2026-12-06 at 32K × 8: certified 16.89 s of wall, its last first token at 13.59 s; auto 10.63 s
    and 9.67 s → +3.92 s before the last first token (prefill) and +2.34 s after it (decode)."""
    bench = _bench()

    def cell(dtype: str, wall: float, last_first: float) -> dict:
        return {"dtype": dtype, "context": 32768, "concurrency": 8, "status": "ok", "wall_s": wall,
                "ttft_s": {"max": last_first}}  # fmt: skip

    doc = {"args": {"dtypes": ["certified", "auto"], "requests": None},
           "cells": [cell("certified", 16.89, 13.59), cell("auto", 10.63, 9.67)]}  # fmt: skip
    assert bench.time_split(doc["cells"][0]) == pytest.approx((16.89, 13.59, 3.30))
    table = bench.split_table(doc)
    assert "| 32768 | 8 | 16.89 / 13.59 / 3.30 | 10.63 / 9.67 / 0.96 | +3.92 / +2.34 |" in table
    doc["args"]["requests"] = 16  # several waves per cell: the split would not mean prefill and decode
    assert bench.split_table(doc) == ""


def test_skip_reasons() -> None:
    """A cell runs only when concurrency × (prompt + max_tokens) fits the engine's KV capacity."""
    bench = _bench()
    spec = {"max_tokens": 128}
    engine = {"max_model_len": 131072, "max_num_seqs": 64, "kv_capacity_tokens": 8 * 32768}
    assert bench._skip_reason({"context": 32768, "concurrency": 8}, spec, engine) is None
    assert "capacity" in bench._skip_reason({"context": 32768, "concurrency": 9}, spec, engine)
    assert "max_model_len" in bench._skip_reason({"context": 262144, "concurrency": 1}, spec, engine)
    assert "max_num_seqs" in bench._skip_reason({"context": 1024, "concurrency": 65}, spec, engine)


@pytest.mark.vllm
@pytest.mark.slow
def test_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    command = [sys.executable, str(BENCH), str(MODEL), "--dtypes", "auto", "certified",
               "--contexts", str(CONTEXT), str(2 * CONTEXT), "--concurrency", "1", "2",
               "--max-tokens", str(MAX_TOKENS), "--max-model-len", str(CONTEXT),
               "--max-num-seqs", "4", "--enforce-eager", "--load-format", "auto", "--warmup-tokens", "32",
               "--warmup-max-tokens", "4", "--cell-timeout", "300", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    logs = {d: Path(e["log"]) for d, e in doc["engines"].items()}
    tail = "\n".join(p.read_text()[-2000:] for p in logs.values() if p.exists())
    assert doc["schema"] == "certvllm.bench_serving/1"
    assert doc["environment"]["engine"]["vllm"] and doc["environment"]["engine"]["cpu"]
    for dtype in ("auto", "certified"):
        engine = doc["engines"][dtype]
        assert engine["status"] == "done", (engine, tail)
        assert engine["kv_capacity_tokens"] == engine["num_gpu_blocks"] * engine["block_size"] > 0
        assert engine["start_s"] > 0 and engine["warmup"]["seconds"] > 0
    cells = {(c["dtype"], c["context"], c["concurrency"]): c for c in doc["cells"]}
    assert len(cells) == 2 * 2 * 2
    for (dtype, context, concurrency), cell in cells.items():
        if context > CONTEXT:
            assert cell["status"] == "skipped" and "max_model_len" in cell["reason"], cell
            continue
        assert cell["status"] == "ok", (cell, tail)
        assert cell["output_tokens"] == concurrency * MAX_TOKENS
        assert cell["prompt_tokens"] == context - MAX_TOKENS
        assert cell["ttft_s"]["median"] > 0 and cell["ttft_s"]["p99"] >= cell["ttft_s"]["median"]
        assert cell["itl_s"]["median"] > 0 and cell["itl_s"]["p99"] > 0
        assert cell["output_tok_s"] > 0 and cell["wall_s"] > 0
        assert len(cell["per_request"]) == concurrency
        for request in cell["per_request"]:
            assert request["output_tokens"] == MAX_TOKENS and request["cached_tokens"] == 0
            assert request["e2e_s"] >= request["ttft_s"] > 0
        # the same prompts on both engines
        assert cell["prompts_sha256"] == cells[("auto" if dtype == "certified" else "certified", context,
                                                concurrency)]["prompts_sha256"]  # fmt: skip
        if dtype == "certified":  # the certvllm counters of this cell: every decode step was served
            steps = sum(v for k, v in cell["cert_metrics"]["delta"].items() if k.startswith("vllm:cert_head_steps"))
            assert steps > 0, cell["cert_metrics"]
    assert "cert/auto tok/s" in proc.stdout and "### KV capacity at startup" in proc.stdout
    png = tmp_path / "serving.png"
    subprocess.run([sys.executable, str(PLOT), str(out), str(png)], check=True, timeout=120)
    assert png.stat().st_size > 0
