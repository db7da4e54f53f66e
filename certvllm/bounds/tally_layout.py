"""The layout of a per-layer tally of certificate reports: what ``certvllm.triton_kernels.report_tally`` adds a
layer call's report to on the device, and what the metrics fold into their series once per step.

Tally row (``[L, tally_columns(NE)]`` float64, one row per layer; every count below 2⁵³, so exact)::

    column              what (over the call's first ``rows`` rows, every query head)
    0 .. 4              head-steps by rung 0..4
    5, 6, 7             rung-3 head-steps whose trigger was rank_fail, boundary_fail, bound_fail
    8, 9                rows at rung 4 (head 0) with canary_fail, precondition (head 0)
    10                  rows with canary_fail (head 0)
    11, 12              Σ k_star, Σ v_promoted
    13 + b              e_key histogram: certified head-steps (rung ≤ 2) in bucket b = #{edges < value}
                        (b = 0..NE), a non-finite value in bucket NE
    13 + (NE+1) + b     e_val histogram, same
    13 + 2(NE+1) + b    (e_key + e_val) / max(v_max, 1e-30) histogram (float32 quotient, as the host fold)
    13 + 3(NE+1) + k    Σ of the finite values of histogram k = 0, 1, 2

``edges`` ``[3, NE]`` float64: the three histograms' bucket upper bounds (Prometheus ``le``), ascending. A value ``v``
falls in bucket ``#{e < v}``: the ``torch.bucketize(right=False)`` rule of the host fold.
"""

from __future__ import annotations

HEAD_COLUMNS = 13
"""Columns before the first histogram (rungs, triggers, layer fallbacks, canaries, promoted blocks)."""
HISTOGRAMS = 3
"""e_key, e_val, relative bound."""


def tally_columns(num_edges: int) -> int:
    """Columns of a tally row whose histograms have ``num_edges`` edges each."""
    return HEAD_COLUMNS + HISTOGRAMS * (num_edges + 1) + HISTOGRAMS
