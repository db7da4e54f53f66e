"""The terms of the certificate. Every function returns a value that is ≥ the real-number
quantity it names, even though it is evaluated in float32 (inflated by γ factors).

Shapes: ``R`` rows (one query each), ``K`` KV heads, ``G`` query heads per KV head, ``B`` blocks,
``D`` head dim. ``q_abs`` is |q·softmax_scale| as float32 ``[R, K, G, D]``.
"""

from __future__ import annotations

import math

import torch

from certvllm.bounds.rounding import GAMMA_SLACK, UNIT_ROUNDOFF, gamma
from certvllm.formats.keys import P2_RELATIVE_SLACK

SCORE_EXTRA_ROUNDINGS = 6
"""Roundings per score beyond the dot product's γ_D: the query scale (q·λ, ≤ 2: λ is itself
rounded to float32), the key dequantization ℓ + c·σ (≤ 2) and 2 of slack."""
EXP_ROUNDINGS = 8
"""exp in float32 is trusted to 4 ulp = 8u (2 ulp is what the libraries document)."""


def sum_inflation(n_terms: int) -> float:
    """Factor that turns a float32 sum of n non-negative products into an upper bound."""
    return (1.0 + gamma(n_terms + 2)) * GAMMA_SLACK


# -- the constant factors, shared with the compiled kernels (one source of truth) ---------------
def delta_factor(d: int) -> float:
    """Δ_b = delta_factor(D) · Σ_c |q_c·λ|·σ_c."""
    return (0.5 + P2_RELATIVE_SLACK) * sum_inflation(d)


def rounding_factor(d: int) -> float:
    """R_b = rounding_factor(D) · Σ_c |q_c·λ|·(M_c + σ_c)."""
    return (gamma(d) + SCORE_EXTRA_ROUNDINGS * UNIT_ROUNDOFF) * sum_inflation(d)


def exp_factors() -> tuple[float, float]:
    """(c1, c0) with R_exp = c1·max|s| + c0."""
    scale = GAMMA_SLACK * (1 + 2.0**-20)
    return 2.0 * UNIT_ROUNDOFF * scale, EXP_ROUNDINGS * UNIT_ROUNDOFF * scale


def round_factor(block_size: int) -> float:
    """E_round = round_factor(N) · (V_max + η_max)."""
    return (2.0 * gamma(block_size + 2) + 2.0 * UNIT_ROUNDOFF) * GAMMA_SLACK


def value_inflation(block_size: int) -> float:
    """E_val = value_inflation(N) · Σ_b ρ_b η_b (computed masses of N-term float32 sums)."""
    return (1.0 + 3.0 * gamma(block_size + 2)) * GAMMA_SLACK


def alpha_inflation(block_size: int) -> float:
    """Upper bound on the tail mass from computed per-block sums."""
    return 1.0 + 3.0 * gamma(block_size + 2)


def block_delta(q_abs: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Δ_b per query head: the largest score change key quantization can cause in block b.

    Δ_b = Σ_c |q_c|·scale · σ_{b,c}·(1/2 + slack) (the tight per-channel form).

    Args:
        q_abs: ``[R, K, G, D]`` float32.
        sigma: ``[R, B, K, D]`` float32 key scales of each row's blocks.

    Returns:
        ``[R, K, G, B]`` float32.
    """
    raw = torch.einsum("rkgd,rbkd->rkgb", q_abs, sigma)
    return raw * delta_factor(q_abs.shape[-1])


def score_rounding(q_abs: torch.Tensor, key_mag: torch.Tensor) -> torch.Tensor:
    """R_b: the float32 rounding of a score in block b (query scaling, key dequantization and
    the D-term dot product), from per-channel bounds ``key_mag`` ≥ |k|, |k̂|.

    Args:
        q_abs: ``[R, K, G, D]`` float32.
        key_mag: ``[R, B, K, D]`` float32.

    Returns:
        ``[R, K, G, B]`` float32.
    """
    raw = torch.einsum("rkgd,rbkd->rkgb", q_abs, key_mag)
    return raw * rounding_factor(q_abs.shape[-1])


def exp_rounding(score_abs_max: torch.Tensor) -> torch.Tensor:
    """Score-equivalent perturbation of w = exp(s − m) in float32: the subtraction rounds by
    ≤ u·|s − m| ≤ 2u·max|s| and exp adds ≤ 4 ulp (8u; CPU and CUDA libraries promise ≤ 2 ulp);
    log(1 + θ) ≤ θ(1 + θ). The absolute part (≥ 8u) also absorbs every float32 underflow in the
    evaluation of Δ and R, which is below 2^-100."""
    c1, c0 = exp_factors()
    return score_abs_max * c1 + c0


def tail_mass_upper(alpha_observed: torch.Tensor, delta_tail: torch.Tensor, rounding: torch.Tensor) -> torch.Tensor:
    """ᾱ_T = min(1, e^{2(Δ_T + R)}·α): an upper bound on the exact tail mass from a tail mass α
    measured under scores that differ from the exact ones by ≤ Δ_T + R on the tail and ≤ R elsewhere.
    Evaluated in log space so that a huge Δ gives 1, not inf·0 = NaN."""
    log_alpha = torch.log(alpha_observed * GAMMA_SLACK)
    return torch.exp(torch.clamp(2.0 * (delta_tail + rounding) + log_alpha, max=0.0))


def key_sum_bound(alpha_upper: torch.Tensor, delta_tail: torch.Tensor, rounding: torch.Tensor) -> torch.Tensor:
    """S ≥ Σ_t |a_t − a''_t| (twice the total-variation distance).

    The least of: 2; the full-sequence form 2·tanh((Δ_T + R)/2); and the tail-restricted form
    ᾱ_T·((e^{Δ_T} − 1) + (e^{2Δ_T} − 1)) + R.
    """
    tail_form = alpha_upper * (torch.expm1(delta_tail) + torch.expm1(2.0 * delta_tail)) + rounding
    tail_form = torch.where(alpha_upper > 0, tail_form, rounding)  # 0·inf would be NaN
    full_form = 2.0 * torch.tanh(0.5 * (delta_tail + rounding))
    best = torch.fmin(torch.fmin(tail_form, full_form) * GAMMA_SLACK, torch.full_like(tail_form, 2.0))
    return torch.where(torch.isnan(delta_tail + rounding), torch.full_like(best, float("nan")), best)


def key_bound(
    v_max: torch.Tensor, key_sum: torch.Tensor, eta_max: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """E_key = V_max·S + E_round. Returns ``(e_key, e_round)``.

    E_round = (2γ_{N+2} + 2u)·(V_max + η_max) covers the float32 per-block weighted sums (N terms
    each), the float64 combination across blocks and the final division and cast.
    """
    e_round = round_factor(block_size) * (v_max + eta_max)
    return v_max * key_sum * GAMMA_SLACK + e_round, e_round


def value_bound(block_mass: torch.Tensor, eta: torch.Tensor, block_size: int) -> torch.Tensor:
    """E_val = Σ_b ρ_b η_b over INT4 blocks, with ρ_b the computed block masses of the weights
    actually applied (inflated for their float32 evaluation).

    Args:
        block_mass: ``[..., B]`` float64 or float32 computed block masses (0 for FP16-value blocks).
        eta: ``[..., B]`` η_b (0 where values are FP16).
    """
    total = (block_mass.to(torch.float64) * eta.to(torch.float64)).sum(dim=-1)
    return (total * value_inflation(block_size)).to(torch.float32) * (1 + 2.0**-20)


def softmax_scale(head_dim: int) -> float:
    """The default attention scale 1/√D."""
    return 1.0 / math.sqrt(head_dim)
