"""The fallback ladder's decision parameters, as the kernels and the torch epilogue take them.

``certvllm.config.CertConfig`` is what users write; :class:`LadderPolicy` is the part of it that a
layer call decides with, resolved to plain numbers (``CertConfig.ladder``), so that the kernel layer
needs neither the configuration object nor its validation.
"""

from __future__ import annotations

from dataclasses import dataclass

from certvllm.bounds.report import RUNG_HEAD_DENSE, RUNG_LAYER_DENSE, RUNG_NONE

FORCED_RUNGS = {"none": RUNG_NONE, "head": RUNG_HEAD_DENSE, "layer": RUNG_LAYER_DENSE}

VALUE_BUDGET_MARGIN = 1.01
"""Rung 2 aims 1 % under v_tol so the final E_val (computed from phase-2 masses, with its rounding
inflation) lands at or under v_tol·V_max."""


@dataclass(frozen=True)
class LadderPolicy:
    """What a layer call selects and checks with.

    Attributes:
        certified: the full ladder (``False``: naive mode, no promotion, checks or fallback).
        key_selection: ``coverage`` (the paper's rule: the top blocks covering ``tau_cov`` of the estimated
            mass) or ``budget`` (the fewest top blocks whose estimated E_key fits ``key_tol``, and every query
            head of a KV head reads the union of its group's blocks with unquantized keys).
        tau_cov: mass coverage target of the unquantized-key set (``coverage`` only).
        k_min, k_max: clamp on the promoted key blocks per query head before rung 1.
        k_max_widened: the clamp after rung 1 (``ceil(rung1_multiplier · k_max)``).
        rung1_tail_threshold: rung 1 fires when the estimated tail mass exceeds it.
        key_tol, v_tol, bound_tol: tolerances relative to V_max (``inf``: off).
        value_k_max: most value blocks promoted per head; −1 for no cap.
        rank_check, rank_depth, eps_guard: the rank-consistency and boundary tests (rung 3).
        canary: the score-consistency canary (rung 4).
        forced_rung: 0, or 3 / 4 to escalate every head / row after the certified computation.
        exploration_rate: probability of promoting an extra key block.
    """

    certified: bool
    key_selection: str
    tau_cov: float
    k_min: int
    k_max: int
    k_max_widened: int
    rung1_tail_threshold: float
    key_tol: float
    v_tol: float
    bound_tol: float
    value_k_max: int
    rank_check: bool
    rank_depth: int
    eps_guard: float
    canary: bool
    forced_rung: int
    exploration_rate: float

    @property
    def checks_rank(self) -> bool:
        """Whether the rank and boundary tests run."""
        return self.certified and self.rank_check

    @property
    def checks_canary(self) -> bool:
        """Whether the canary runs."""
        return self.certified and self.canary

    @property
    def key_budget(self) -> bool:
        """Whether keys are selected by the key-error budget (with the union over each KV head's group)."""
        return self.key_selection == "budget"
