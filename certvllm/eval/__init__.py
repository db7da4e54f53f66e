"""Evaluation suite through the engine: perplexity, needle-in-a-haystack and RULER tasks, dense vs
certified vs naive KV caches, with paired statistics and a report.

    certvllm eval ppl|niah|ruler|file|all [--contexts 1k,2k,4k,8k] [--configs dense,certified:paper,naive] ...

Every engine run goes through :func:`certvllm.vllm_plugin.harness.run_engine` (a fresh process per
engine; this package never imports vLLM). Results are appended phase by phase to one JSONL per
(task, context, config) under ``--out``, so an interrupted run resumes where it stopped. See
``docs/evaluation.md``.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``certvllm eval ...`` (see :mod:`certvllm.eval.cli`)."""
    from certvllm.eval.cli import main as cli_main

    return cli_main(argv)
