"""Adaptive precision: which blocks each query head reads with unquantized keys (top-K*, rung 1)
and with unquantized values (rung 2), decided from the INT8 scoring pass (phase 1).

Shapes: ``[R, K, G, B]`` = rows × KV heads × query heads per KV head × full blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from certvllm.bounds import tail_mass_upper
from certvllm.bounds.policy import VALUE_BUDGET_MARGIN
from certvllm.config import CertConfig


@dataclass
class Phase1:
    """INT8-scored summary of every full block, per query head.

    Attributes:
        log_mass: ``[R, K, G, B]`` ℓ_b = logsumexp of the block's INT8 scores (−inf if invalid).
        mass: ``[R, K, G, B]`` p̂_b, normalized over all blocks including the trailing partial one.
        delta: ``[R, K, G, B]`` Δ_b (0 if invalid).
        rounding: ``[R, K, G]`` R, the largest score rounding over the row's tokens.
        valid: ``[R, 1, 1, B]`` bool, block b is a full block of the row.
        num_full: ``[R, 1, 1]`` int64 number of full blocks.
        v_max: ``[R, K, 1]`` V_max per KV head.
        eta: ``[R, K, 1, B]`` η_b (0 if invalid).
    """

    log_mass: torch.Tensor
    mass: torch.Tensor
    delta: torch.Tensor
    rounding: torch.Tensor
    valid: torch.Tensor
    num_full: torch.Tensor
    v_max: torch.Tensor
    eta: torch.Tensor


def _first_true(cond: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, or ``default`` where none is True."""
    n = cond.shape[-1]
    idx = torch.arange(n, device=cond.device).expand_as(cond)
    first = torch.where(cond, idx, torch.full_like(idx, n)).amin(dim=-1)
    return torch.where(first < n, first, default)


def _mask_from_order(order: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the first ``count`` entries of ``order`` (per leading index)."""
    rank = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    chosen = rank < count.unsqueeze(-1)
    return torch.zeros_like(chosen).scatter(-1, order, chosen)


def key_tail_estimate(ph1: Phase1, alpha_hat: torch.Tensor, delta_suffix: torch.Tensor) -> torch.Tensor:
    """Pre-phase-2 estimate of E_key / V_max for each candidate K (``[..., B + 1]``), from the
    INT8 tail mass ``alpha_hat`` and the largest Δ left in the tail ``delta_suffix``."""
    delta_all = ph1.delta.amax(dim=-1, keepdim=True)
    abar = tail_mass_upper(alpha_hat, delta_all, ph1.rounding.unsqueeze(-1))
    growth = torch.expm1(delta_suffix) + torch.expm1(2.0 * delta_suffix)
    return torch.where(abar > 0, abar * growth, torch.zeros_like(abar))


def select_keys(
    ph1: Phase1, cfg: CertConfig, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K* key promotion with K_min/K_max clamps, then rung 1 (widen coverage).

    ``key_selection: coverage`` (the paper): K* is the fewest top blocks whose estimated mass covers
    ``tau_cov``; rung 1 widens up to ``rung1_multiplier·k_max`` when the tail mass or the estimated E_key is
    still over its threshold. ``key_selection: budget``: K* is the fewest top blocks (at least ``k_min``)
    whose estimated E_key (:func:`key_tail_estimate`) fits ``key_tol``, rung 1 the same search past
    ``k_max``; then each query head reads the union of its KV head's blocks (they are fetched for the group
    anyway, and every extra unquantized key only tightens a head's certificate: docs/certification.md §6).

    Returns:
        ``key_mask`` ``[R, K, G, B]`` bool and ``widened`` ``[R, K, G]`` bool (rung 1 used).
    """
    mass = torch.where(ph1.valid, ph1.mass, torch.zeros_like(ph1.mass))
    order = torch.argsort(mass, dim=-1, descending=True, stable=True)
    sorted_mass = mass.gather(-1, order)
    zero = torch.zeros_like(sorted_mass[..., :1])
    # alpha_hat[k]: estimated mass left on INT8 keys if the top k blocks are promoted
    alpha_hat = torch.cat((sorted_mass.flip(-1).cumsum(-1).flip(-1), zero), dim=-1)
    delta_sorted = ph1.delta.gather(-1, order)
    delta_suffix = torch.cat((delta_sorted.flip(-1).cummax(-1).values.flip(-1), zero), dim=-1)

    nfull = ph1.num_full.expand(mass.shape[:-1])
    kmin = torch.clamp(nfull, max=cfg.k_min)
    kmax = torch.clamp(nfull, max=cfg.k_max)
    est = key_tail_estimate(ph1, alpha_hat, delta_suffix)
    ks = torch.arange(alpha_hat.shape[-1], device=mass.device)
    budget = cfg.key_selection == "budget"
    if budget:
        base = _first_true((est <= cfg.key_tol) & (ks >= kmin.unsqueeze(-1)), kmax)
    else:
        base = _first_true(alpha_hat <= (1.0 - cfg.tau_cov), nfull)
    base = torch.maximum(torch.minimum(base, kmax), kmin)

    base_est = est.gather(-1, base.unsqueeze(-1)).squeeze(-1)
    kmax1 = torch.clamp(nfull, max=math.ceil(cfg.rung1_multiplier * cfg.k_max))
    ok = (est <= cfg.key_tol) & (ks >= base.unsqueeze(-1)) & (ks <= kmax1.unsqueeze(-1))
    if budget:
        trigger = base_est > cfg.key_tol
    else:
        base_alpha = alpha_hat.gather(-1, base.unsqueeze(-1)).squeeze(-1)
        trigger = (base_alpha > cfg.rung1_tail_threshold) | (base_est > cfg.key_tol)
        ok = ok & (alpha_hat <= cfg.rung1_tail_threshold)
    widened_k = _first_true(ok, kmax1)
    k_star = torch.where(trigger, torch.maximum(widened_k, base), base)
    key_mask = _mask_from_order(order, k_star) & ph1.valid
    if budget:  # the union over the query heads of each KV head
        key_mask = key_mask.any(dim=2, keepdim=True).expand_as(key_mask) & ph1.valid
    if cfg.exploration_rate > 0:
        draw = torch.rand(key_mask.shape, generator=generator, device="cpu").to(mass.device)
        key_mask = key_mask | ((draw < cfg.exploration_rate) & ph1.valid)
    return key_mask, k_star > base


def select_values(ph1: Phase1, key_mask: torch.Tensor, cfg: CertConfig) -> torch.Tensor:
    """Rung 2: promote FP16 values, greedily by ρ̄_b·η_b, until the E_val upper estimate is
    ≤ v_tol·V_max. ρ̄_b = min(1, e^{2ξ}·p̂_b) bounds the mass phase 2 will give the block, with ξ
    the largest score change between the phases (so the final E_val meets v_tol).

    Returns:
        ``value_mask`` ``[R, K, G, B]`` bool.
    """
    xi = ph1.delta.amax(dim=-1, keepdim=True) + 3.0 * ph1.rounding.unsqueeze(-1)
    rho_up = tail_mass_upper(ph1.mass, xi, torch.zeros_like(xi))
    err = torch.where(ph1.valid, rho_up * ph1.eta, torch.zeros_like(rho_up))
    order = torch.argsort(err, dim=-1, descending=True, stable=True)
    sorted_err = err.gather(-1, order)
    remaining = torch.cat((sorted_err.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(sorted_err[..., :1])), -1)
    budget = (cfg.v_tol * ph1.v_max).unsqueeze(-1) / VALUE_BUDGET_MARGIN  # [R, K, 1, 1]
    count = _first_true(remaining <= budget, torch.full_like(remaining[..., 0], err.shape[-1]).long())
    if cfg.value_k_max is not None:
        count = torch.clamp(count, max=cfg.value_k_max)
    return _mask_from_order(order, count) & ph1.valid
