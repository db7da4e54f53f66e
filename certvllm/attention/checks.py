"""Runtime checks that escalate a head (rung 3) or a whole layer (rung 4).

* Rank consistency (rung 3): inside the promoted set F, the blocks INT8 ranks in the top r must
  also be the top r by their exact (phase-2, unquantized-key) log-mass, up to ``eps_guard``.
* Boundary (rung 3): no INT8-key block may possibly outrank the r-th exact log-mass of F:
  ℓ^int8_b + Δ_b + 2R ≤ ℓ^exact_(r) for every b ∉ F.
* Canary (rung 4): on every promoted block both the INT8 and the exact scores exist, and they
  must differ by at most Δ_b + 2R (precondition P2 in action); a violation means the page and
  its shadow disagree, so nothing read from this layer's pages is trusted.

Shapes as in ``selection.py``; log-masses include the trailing partial block at index B.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def rank_and_boundary(
    int8_log_mass: torch.Tensor,
    exact_log_mass: torch.Tensor,
    in_f: torch.Tensor,
    valid: torch.Tensor,
    delta: torch.Tensor,
    rounding: torch.Tensor,
    depth: int,
    eps_guard: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-consistency and boundary failures per query head.

    Args:
        int8_log_mass: ``[R, K, G, B + 1]`` phase-1 log-masses (exact for the partial block).
        exact_log_mass: ``[R, K, G, B + 1]`` phase-2 log-masses; meaningful where ``in_f``.
        in_f: ``[R, K, G, B + 1]`` bool, block read with unquantized keys.
        valid: ``[R, 1, 1, B + 1]`` bool, block exists in the row.
        delta: ``[R, K, G, B + 1]`` Δ_b (0 for the partial block).
        rounding: ``[R, K, G]`` R.
        depth: r.
        eps_guard: tie tolerance in log-mass units.

    Returns:
        ``(rank_fail, boundary_fail)``, each ``[R, K, G]`` bool.
    """
    exact_f = torch.where(in_f, exact_log_mass, torch.full_like(exact_log_mass, NEG_INF))
    int8_f = torch.where(in_f, int8_log_mass, torch.full_like(int8_log_mass, NEG_INF))
    r = min(depth, exact_f.shape[-1])
    top_exact = exact_f.topk(r, dim=-1).values
    by_int8 = exact_f.gather(-1, int8_f.topk(r, dim=-1).indices)
    finite = torch.isfinite(top_exact)
    rank_fail = (finite & (by_int8 < top_exact - eps_guard)).any(dim=-1)

    # r-th largest exact log-mass of F (or the smallest one if F has fewer than r blocks)
    threshold = torch.where(finite, top_exact, torch.full_like(top_exact, float("inf"))).amin(dim=-1)
    outside = valid & ~in_f
    reach = int8_log_mass + delta + 2.0 * rounding.unsqueeze(-1)
    boundary_fail = (outside & (reach > threshold.unsqueeze(-1)) & torch.isfinite(threshold).unsqueeze(-1)).any(-1)
    return rank_fail, boundary_fail


def canary_violations(
    exact_scores: torch.Tensor, int8_scores: torch.Tensor, delta: torch.Tensor, rounding: torch.Tensor
) -> torch.Tensor:
    """Per promoted (row, KV head, block) item: does any score break |s − s̃| ≤ Δ_b + 2R?

    Args:
        exact_scores, int8_scores: ``[n, G, N]`` scores of the same tokens.
        delta: ``[n, G]`` Δ_b of each item's block; rounding: ``[n, G]`` R of its row.

    Returns:
        ``[n]`` bool.
    """
    allowed = (delta + 2.0 * rounding).unsqueeze(-1) * (1 + 2.0**-10)
    diff = (exact_scores - int8_scores).abs()
    return ((diff > allowed) | ~torch.isfinite(diff)).flatten(1).any(dim=-1)
