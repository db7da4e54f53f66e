"""The certificate's torch pieces, written once: the partial block and the phase-1 summary before
selection, and after the attend pass the output combination, the bounds, the checks, the rungs and the
report.

The torch reference (``reference.py``) runs all of them; the CUDA path (``gpu.py``) runs them where its
glue kernels (``triton_kernels.prepare`` / ``finalize``) do not apply, and the CPU kernel
(``cpu_fused.py``) shares :func:`finish_rungs`. Shapes: ``R`` rows, ``K`` KV heads, ``G`` query heads
per KV head, ``B`` full blocks, ``N`` = 16 tokens per block, ``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.attention.checks import rank_and_boundary
from certvllm.bounds import (
    alpha_inflation,
    exp_rounding,
    key_bound,
    key_sum_bound,
    score_rounding,
    tail_mass_upper,
    value_bound,
)
from certvllm.bounds.policy import LadderPolicy
from certvllm.bounds.report import RUNG_HEAD_DENSE, RUNG_LAYER_DENSE, RUNG_VALUES, RUNG_WIDEN, CertReport
from certvllm.bounds.summary import Phase1Summary

NEG_INF = float("-inf")
NORM_ROUND_UP = 1 + 2.0**-20
"""Upward rounding of a float64 norm cast to float32."""


def finite_abs_max(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Largest finite |x| over ``dims`` (0 where none is finite)."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=dims)


def summarize(
    qs: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    ntail: torch.Tensor,
    nu: torch.Tensor,
    eta: torch.Tensor,
    int8_abs_max: torch.Tensor,
    int8_round_max: torch.Tensor,
    l8: torch.Tensor,
) -> Phase1Summary:
    """Score the trailing partial block exactly and reduce the phase-1 terms (``triton_kernels.prepare``
    computes the same in one kernel).

    Args:
        qs: ``[R, K, G, D]`` float32 scaled queries.
        tail_k, tail_v: ``[R, K, N, D]`` the partial block's originals as gathered (any rows past a row's
            ``ntail`` tokens are ignored: a reused block's stale rows must not enter any bound).
        ntail: ``[R]`` int64 tokens in the partial block.
        nu, eta: ``[R, K, B]`` ν_b and η_b (0 on invalid blocks).
        int8_abs_max, int8_round_max: ``[R, K, G]`` the largest finite |s| and R_b over the INT8 blocks.
        l8: ``[R, K, G, B]`` INT8 log-masses.
    """
    n = tail_k.shape[2]
    tok_valid = torch.arange(n, device=qs.device) < ntail.to(qs.device).unsqueeze(1)  # (R, N)
    live = tok_valid[:, None, :, None]
    tail_k = torch.where(live, tail_k.float(), 0.0)
    tail_v = torch.where(live, tail_v.float(), 0.0)
    s_tail = torch.einsum("rkgd,rknd->rkgn", qs, tail_k).masked_fill(~tok_valid[:, None, None, :], NEG_INF)
    tail_round = score_rounding(qs.abs(), tail_k.abs().amax(dim=2).unsqueeze(1)).squeeze(-1)  # (R, K, G)
    tail_vnorm = (torch.linalg.vector_norm(tail_v.double(), dim=-1).amax(dim=-1) * NORM_ROUND_UP).float()
    score_abs1 = torch.maximum(int8_abs_max, finite_abs_max(s_tail, (-1,)))
    base_round = torch.maximum(int8_round_max, tail_round)
    l_tail = torch.logsumexp(s_tail, dim=-1)
    return Phase1Summary(
        s_tail=s_tail, tail_v=tail_v, l_tail=l_tail,
        lse=torch.logsumexp(torch.cat((l8, l_tail.unsqueeze(-1)), dim=-1), dim=-1),
        score_abs1=score_abs1, base_round=base_round, round1=base_round + exp_rounding(score_abs1),
        v_max=torch.maximum(nu.amax(dim=-1), tail_vnorm).unsqueeze(-1), eta_max=eta.amax(dim=-1, keepdim=True),
    )  # fmt: skip


def combine(
    num: torch.Tensor, den: torch.Tensor, s_tail: torch.Tensor, tail_v: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output from the full blocks' float64 sums and the partial block.

    Args:
        num: ``[R, K, G, D]`` float64 Σ_b Σ_t w_t·V_t over full blocks; den: ``[R, K, G]`` float64 Σ w_t.
        s_tail: ``[R, K, G, N]``; tail_v: ``[R, K, N, D]``; m: ``[R, K, G]`` the softmax shift.

    Returns:
        ``(out [R, K·G, D] float32, den [R, K, G] float64 with the partial block, den_t [R, K, G] float32)``.
    """
    R, K, G, D = num.shape
    w_tail = torch.exp(s_tail - m.unsqueeze(-1))
    den_t = w_tail.sum(dim=-1)
    num = num + torch.einsum("rkgn,rknd->rkgd", w_tail, tail_v).double()
    den = den + den_t.double()
    return (num / den.unsqueeze(-1)).float().reshape(R, K * G, D), den, den_t


@dataclass
class Measured:
    """What phases 1–2 measured, for the certificate. ``[R, K, G]`` unless stated.

    Attributes:
        value_error_mass: float64 Σ_b ρ_b·η_b over the blocks read with INT4 values (ρ_b: computed block
            masses of the weights actually applied).
        tail_mass: float64 Σ_b ρ_b over the full blocks read with INT8 keys.
        score_abs2: float32, ≥ the largest finite |s| of the scores phase 2 applied.
        exact_log_mass: ``[R, K, G, B]`` float32 exact log-masses (meaningful on promoted blocks).
        exact_tail_log_mass: float32 exact log-mass of the partial block.
        key_mask, value_mask: ``[R, K, G, B]`` bool, blocks read with unquantized keys / values.
        widened: bool, rung 1 used.
        delta: ``[R, K, G, B]`` float32 Δ_b (0 on invalid blocks).
        l8: ``[R, K, G, B]`` float32 INT8 log-masses.
        valid: ``[R, 1, 1, B]`` bool, full block of the row.
        has_tail: ``[R]`` bool, the row has a partial block.
        canary: ``[R]`` bool, the canary fired on the row.
        bad_page: ``[R]`` bool, a page of the row broke a precondition.
    """

    value_error_mass: torch.Tensor
    tail_mass: torch.Tensor
    score_abs2: torch.Tensor
    exact_log_mass: torch.Tensor
    exact_tail_log_mass: torch.Tensor
    key_mask: torch.Tensor
    value_mask: torch.Tensor
    widened: torch.Tensor
    delta: torch.Tensor
    l8: torch.Tensor
    valid: torch.Tensor
    has_tail: torch.Tensor
    canary: torch.Tensor
    bad_page: torch.Tensor


def certify(measured: Measured, summary: Phase1Summary, policy: LadderPolicy, block_size: int) -> CertReport:
    """Bounds on the output actually computed, the rank and boundary checks, the rungs: the report
    (``triton_kernels.finalize`` computes the same in one kernel). Bounds of exact heads are zeroed by
    the caller that recomputes them."""
    ms = measured
    R, K, G, B = ms.l8.shape
    N = block_size
    dev = ms.l8.device
    flat = lambda x: x.reshape(R, K * G)  # noqa: E731
    ones = torch.ones_like(ms.value_error_mass).unsqueeze(-1)
    e_val = value_bound(ms.value_error_mass.unsqueeze(-1), ones, N)
    in_tail = ms.valid & ~ms.key_mask
    alpha = (ms.tail_mass * alpha_inflation(N)).float()
    delta_tail = torch.where(in_tail, ms.delta, 0.0).amax(dim=-1)
    round2 = summary.base_round + exp_rounding(ms.score_abs2)
    alpha_up = tail_mass_upper(alpha, delta_tail, round2)
    e_key, e_round = key_bound(summary.v_max, key_sum_bound(alpha_up, delta_tail, round2), summary.eta_max, N)

    report = CertReport.zeros(R, K * G, dev)
    if policy.checks_rank:
        tail_col = ms.has_tail.to(dev)[:, None, None, None]
        rank_fail, boundary_fail = rank_and_boundary(
            torch.cat((ms.l8, summary.l_tail.unsqueeze(-1)), dim=-1),
            torch.cat((ms.exact_log_mass, ms.exact_tail_log_mass.unsqueeze(-1)), dim=-1),
            torch.cat((ms.key_mask, tail_col.expand(R, K, G, 1)), dim=-1),
            torch.cat((ms.valid, tail_col), dim=-1),
            torch.cat((ms.delta, torch.zeros_like(ms.delta[..., :1])), dim=-1),
            round2, policy.rank_depth, policy.eps_guard,
        )  # fmt: skip
        report.rank_fail, report.boundary_fail = flat(rank_fail), flat(boundary_fail)
    v_max_h = summary.v_max.expand(R, K, G)
    bound = e_key + e_val
    report.e_key, report.e_val, report.e_round = flat(e_key), flat(e_val), flat(e_round.expand(R, K, G)).contiguous()
    report.k_star = flat(ms.key_mask.sum(dim=-1).to(torch.int32))
    report.v_promoted = flat(ms.value_mask.sum(dim=-1).to(torch.int32))
    report.v_max = flat(v_max_h).contiguous()
    report.delta_tail = flat(delta_tail)
    report.alpha_tail = flat(alpha_up)
    report.precondition = ms.bad_page.to(dev).view(R, 1).expand(R, K * G).clone()
    rung = torch.zeros(R, K * G, dtype=torch.int8, device=dev)
    rung = torch.where(flat(ms.widened), RUNG_WIDEN, rung)
    rung = torch.where(report.v_promoted > 0, RUNG_VALUES, rung)
    if policy.certified:
        report.bound_fail = flat(~(bound <= policy.bound_tol * v_max_h) | ~torch.isfinite(bound))  # NaN escalates
        report.canary_fail = ms.canary.to(dev).view(R, 1).expand(R, K * G).clone()
        rung = torch.where(report.rank_fail | report.boundary_fail | report.bound_fail, RUNG_HEAD_DENSE, rung)
    report.rung, report.e_key = finish_rungs(rung.to(torch.int8), report, policy)
    return report


def finish_rungs(rung: torch.Tensor, report: CertReport, policy: LadderPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-wide end of the ladder, on a report whose head-level rungs (0–3) are set: rung 4 where the
    canary fired or a precondition broke, the forced rung of tests and audits, and in naive mode (which
    never falls back) an infinite E_key where the output has no bound. Returns ``(rung, e_key)``."""
    if policy.certified:
        rung = torch.where(report.canary_fail | report.precondition, RUNG_LAYER_DENSE, rung)
        if policy.forced_rung:
            rung = torch.full_like(rung, policy.forced_rung)
        return rung.to(torch.int8), report.e_key
    unbounded = report.precondition | ~torch.isfinite(report.e_key + report.e_val)
    return rung, torch.where(unbounded, float("inf"), report.e_key)
