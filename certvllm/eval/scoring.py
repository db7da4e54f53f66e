"""Scorers: RULER's string matches, NIAH exact match, and perplexity from prompt log-probabilities."""

from __future__ import annotations

import math
import re
from typing import Any


def string_match_all(text: str, refs: list[str]) -> float:
    """RULER's ``string_match_all``: the fraction of references found (case-insensitive substring)."""
    low = text.lower()
    return sum(r.lower() in low for r in refs) / len(refs) if refs else 0.0


def string_match_part(text: str, refs: list[str]) -> float:
    """RULER's ``string_match_part``: 1 when any reference is found (case-insensitive substring)."""
    low = text.lower()
    return float(any(r.lower() in low for r in refs))


def niah_exact(text: str, refs: list[str]) -> float:
    """1 when the needle's value appears as a whole number in the output (no digit before or after)."""
    return float(all(re.search(rf"(?<!\d){re.escape(r)}(?!\d)", text) for r in refs)) if refs else 0.0


METRICS = {"all": string_match_all, "part": string_match_part, "niah": niah_exact}


def score_generation(item: dict[str, Any], text: str) -> dict[str, Any]:
    """``score`` in [0, 1] (the task's metric) and ``correct`` (score == 1: the paired binary outcome)."""
    score = METRICS[item["metric"]](text, item["answers"])
    return {"score": score, "correct": score >= 1.0}


def unscored_window(row: dict[str, Any]) -> bool:
    """A stored perplexity window without a scored token (stored before that became an error): no measurement, not
    done (a rerun measures it), left out of the report's figures and listed there."""
    return row.get("task") == "ppl" and not row.get("n_tokens", 1)


def score_perplexity(item: dict[str, Any], logprobs: list[float | None], cached_tokens: int) -> dict[str, Any]:
    """Negative log-likelihood of the scored positions (those computed after the cached prefix)."""
    scored = [lp for i, lp in enumerate(logprobs) if lp is not None and i > cached_tokens]
    nll = -sum(scored)
    n = len(scored)
    if n == 0:  # not a measurement: never stored as one
        raise ValueError(
            f"perplexity window {item.get('id')}: the engine returned no prompt log-probability after the "
            f"{cached_tokens} cached tokens ({len(logprobs)} entries for {len(item['token_ids'])} tokens); check "
            "the harness's alignment for this vLLM version (harness.align_prompt_logprobs)"
        )
    return {"nll_sum": nll, "n_tokens": n, "ppl": math.exp(nll / n) if n else math.nan,
            "cached_tokens": cached_tokens, "window_tokens": len(item["token_ids"])}  # fmt: skip
