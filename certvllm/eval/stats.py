"""Paired statistics: exact McNemar tests and bootstrap confidence intervals (scipy / statsmodels)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

N_RESAMPLES = 10_000


def mcnemar_exact(reference: Sequence[bool], other: Sequence[bool]) -> dict[str, Any]:
    """Exact McNemar test on paired binary outcomes.

    ``b``: reference right and other wrong (the paper's "critical" trials); ``c``: the reverse.
    ``p`` is the two-sided exact binomial p-value (1.0 when there are no discordant pairs).
    """
    from statsmodels.stats.contingency_tables import mcnemar

    ref, oth = np.asarray(reference, bool), np.asarray(other, bool)
    a, b = int(np.sum(ref & oth)), int(np.sum(ref & ~oth))
    c, d = int(np.sum(~ref & oth)), int(np.sum(~ref & ~oth))
    p = 1.0 if b + c == 0 else float(mcnemar([[a, b], [c, d]], exact=True).pvalue)
    return {"both": a, "b": b, "c": c, "neither": d, "p": p}


def _ci(samples: tuple[np.ndarray, ...], statistic: Any, seed: int, paired: bool) -> list[float] | None:
    from scipy.stats import bootstrap

    n = len(samples[0])
    if n < 2:
        return None
    value = float(statistic(*samples))
    if all(np.all(s == s[0]) for s in samples) or (paired and len(samples) == 2 and np.all(samples[0] == samples[1])):
        return [value, value]  # degenerate: every resample gives the same statistic
    res = bootstrap(samples, statistic, n_resamples=N_RESAMPLES, method="percentile", paired=paired,
                    vectorized=False, rng=np.random.default_rng(seed))  # fmt: skip
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isnan(lo) or math.isnan(hi):
        return [value, value]
    return [lo, hi]


def mean_ci(values: Sequence[float], seed: int) -> list[float] | None:
    """95 % percentile-bootstrap CI of the mean (``None`` below two values)."""
    return _ci((np.asarray(values, float),), np.mean, seed, paired=False)


def paired_delta_ci(other: Sequence[float], reference: Sequence[float], seed: int) -> list[float] | None:
    """95 % bootstrap CI of mean(other − reference) over paired items."""
    x, y = np.asarray(other, float), np.asarray(reference, float)
    return _ci((x, y), lambda a, b: float(np.mean(a) - np.mean(b)), seed, paired=True)


def ppl_delta_ci(nll_other: Sequence[float], nll_ref: Sequence[float], tokens: Sequence[float],
                 seed: int) -> list[float] | None:  # fmt: skip
    """95 % bootstrap CI (windows resampled, paired) of ppl(other) − ppl(reference), where
    ppl = exp(Σ nll / Σ tokens) over the resampled windows."""

    def stat(a: np.ndarray, b: np.ndarray, n: np.ndarray) -> float:
        return float(np.exp(a.sum() / n.sum()) - np.exp(b.sum() / n.sum()))

    arrays = tuple(np.asarray(v, float) for v in (nll_other, nll_ref, tokens))
    return _ci(arrays, stat, seed, paired=True)
