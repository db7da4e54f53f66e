"""Certified error bounds (pure torch). Derivations: ``docs/certification.md``.

Notation per query head: a = exact softmax weights from the unquantized keys, a'' = the weights
our arithmetic actually applies, V_t exact values, Ṽ_t the values actually used (FP16 or INT4),
T = the blocks still read with INT8 keys, F = the blocks read with unquantized keys.

    ‖Õ − O‖ ≤ E_key + E_val
    E_val   = Σ_b ρ''_b η_b                         (ρ'' = block masses of a'', INT4 blocks only)
    E_key   = V_max · S + E_round
    S       = min(2, 2·tanh((Δ_T + R)/2), ᾱ_T·((e^{Δ_T} − 1) + (e^{2Δ_T} − 1)) + R)    ≥ Σ_t |a_t − a''_t|
    ᾱ_T     = min(1, e^{2(Δ_T + R)} · α''_T)         ≥ exact tail mass
    E_round = (2γ_{N+2} + 2u) · (V_max + η_max)     (float32 accumulation of the weighted sum)
"""

from certvllm.bounds.rounding import GAMMA_SLACK, UNIT_ROUNDOFF, gamma
from certvllm.bounds.terms import (
    alpha_inflation,
    block_delta,
    delta_factor,
    exp_factors,
    exp_rounding,
    key_bound,
    key_sum_bound,
    round_factor,
    rounding_factor,
    score_rounding,
    tail_mass_upper,
    value_bound,
    value_inflation,
)

__all__ = [
    "alpha_inflation",
    "delta_factor",
    "exp_factors",
    "round_factor",
    "rounding_factor",
    "value_inflation",
    "GAMMA_SLACK",
    "UNIT_ROUNDOFF",
    "block_delta",
    "exp_rounding",
    "gamma",
    "key_bound",
    "key_sum_bound",
    "score_rounding",
    "tail_mass_upper",
    "value_bound",
]
