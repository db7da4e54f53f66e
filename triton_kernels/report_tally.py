"""A layer call's certificate report folded into per-layer totals on the device: one launch, no host work.

The metrics count every head-step (``certvllm.metrics``), and reading each call's ``[R, H_q]`` report to the host
cost a pack, a pinned copy and an event per layer call. Instead each call adds its report to its layer's row of a
tally on the device (inside the call's CUDA graph where it has one), and the metrics read the whole tally once per
decode step.

The row layout is ``certvllm.bounds.tally_layout``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certvllm.bounds.tally_layout import HEAD_COLUMNS, tally_columns

from .common import launch_device_ok, next_pow2
from .shape_class import JIT_OPTIONS

TALLY_HEAD: tl.constexpr = tl.constexpr(HEAD_COLUMNS)
ROWS_PER_ITERATION = 16


@triton.jit
def _add_at(acc, cols, at, value):
    return acc + tl.where(cols == at, value, 0.0)


@triton.jit
def _histogram(acc, cols, base, v, ok, edges, NE: tl.constexpr):
    """Add the float64 values ``v`` where ``ok`` into buckets ``base + #{edges < v}`` (non-finite: the last)."""
    finite = (v == v) & (tl.abs(v) < float("inf"))
    bucket = tl.zeros(v.shape, tl.int32)
    for i in tl.static_range(NE):
        bucket += (v > tl.load(edges + i)).to(tl.int32)
    bucket = tl.where(finite, bucket, NE)
    for b in tl.static_range(NE + 1):
        acc = _add_at(acc, cols, base + b, tl.sum(tl.sum((ok & (bucket == b)).to(tl.float64), 1), 0))
    return acc, tl.sum(tl.sum(tl.where(ok & finite, v, 0.0), 1), 0)


@triton.jit(**JIT_OPTIONS)
def _tally_kernel(
    rung,  # [R_b, H] int8
    e_key,  # [R_b, H] float32
    e_val,  # [R_b, H] float32
    v_max,  # [R_b, H] float32
    k_star,  # [R_b, H] int32
    v_promoted,  # [R_b, H] int32
    rank_fail,  # [R_b, H] bool (the five flags)
    boundary_fail,
    bound_fail,
    canary_fail,
    precondition,
    rows_ptr,  # [1] int64 rows to count (with ROWS_FROM_PTR), else unused
    ROWS,  # rows of the report (the count without ROWS_FROM_PTR, the loop bound with it)
    edges,  # [3, NE] float64
    tally,  # [L, NC] float64, this layer's row added to
    TALLY_ROW,  # the row
    H: tl.constexpr,
    HP: tl.constexpr,
    NE: tl.constexpr,
    NC: tl.constexpr,
    NCP: tl.constexpr,
    RB: tl.constexpr,
    ROWS_FROM_PTR: tl.constexpr,
):
    n_rows = ROWS
    if ROWS_FROM_PTR:
        n_rows = tl.minimum(tl.load(rows_ptr).to(tl.int32), ROWS)
    cols = tl.arange(0, NCP)
    acc = tl.zeros((NCP,), tl.float64)
    sums0 = tl.zeros((), tl.float64)
    sums1 = tl.zeros((), tl.float64)
    sums2 = tl.zeros((), tl.float64)
    h = tl.arange(0, HP)
    r_off = tl.arange(0, RB)
    hist = TALLY_HEAD
    for r0 in range(0, n_rows, RB):
        r = r0 + r_off
        rm = r < n_rows
        m = rm[:, None] & (h[None, :] < H)
        at = r[:, None] * H + h[None, :]
        g = tl.load(rung + at, mask=m, other=-1).to(tl.int32)
        for k in tl.static_range(5):
            acc = _add_at(acc, cols, k, tl.sum(tl.sum((g == k).to(tl.float64), 1), 0))
        exact_head = g == 3
        f0 = tl.load(rank_fail + at, mask=m, other=0) != 0
        f1 = tl.load(boundary_fail + at, mask=m, other=0) != 0
        f2 = tl.load(bound_fail + at, mask=m, other=0) != 0
        acc = _add_at(acc, cols, 5, tl.sum(tl.sum((exact_head & f0).to(tl.float64), 1), 0))
        acc = _add_at(acc, cols, 6, tl.sum(tl.sum((exact_head & f1).to(tl.float64), 1), 0))
        acc = _add_at(acc, cols, 7, tl.sum(tl.sum((exact_head & f2).to(tl.float64), 1), 0))
        # per row, at head 0
        g0 = tl.load(rung + r * H, mask=rm, other=-1).to(tl.int32)
        canary0 = tl.load(canary_fail + r * H, mask=rm, other=0) != 0
        pre0 = tl.load(precondition + r * H, mask=rm, other=0) != 0
        acc = _add_at(acc, cols, 8, tl.sum(((g0 == 4) & canary0).to(tl.float64), 0))
        acc = _add_at(acc, cols, 9, tl.sum(((g0 == 4) & pre0).to(tl.float64), 0))
        acc = _add_at(acc, cols, 10, tl.sum(canary0.to(tl.float64), 0))
        ks = tl.load(k_star + at, mask=m, other=0).to(tl.float64)
        vp = tl.load(v_promoted + at, mask=m, other=0).to(tl.float64)
        acc = _add_at(acc, cols, 11, tl.sum(tl.sum(ks, 1), 0))
        acc = _add_at(acc, cols, 12, tl.sum(tl.sum(vp, 1), 0))
        certified = m & (g <= 2)
        ek = tl.load(e_key + at, mask=m, other=0.0)
        ev = tl.load(e_val + at, mask=m, other=0.0)
        vm = tl.load(v_max + at, mask=m, other=1.0)
        relative = tl.math.div_rn(ek + ev, tl.maximum(vm, 1e-30))
        acc, s = _histogram(acc, cols, hist, ek.to(tl.float64), certified, edges, NE)
        sums0 += s
        acc, s = _histogram(acc, cols, hist + (NE + 1), ev.to(tl.float64), certified, edges + NE, NE)
        sums1 += s
        acc, s = _histogram(acc, cols, hist + 2 * (NE + 1), relative.to(tl.float64), certified, edges + 2 * NE, NE)
        sums2 += s
    base = hist + 3 * (NE + 1)
    acc = _add_at(acc, cols, base, sums0)
    acc = _add_at(acc, cols, base + 1, sums1)
    acc = _add_at(acc, cols, base + 2, sums2)
    row = tally + TALLY_ROW.to(tl.int64) * NC + cols
    cm = cols < NC
    tl.store(row, tl.load(row, mask=cm, other=0.0) + acc, mask=cm)


def tally_report(fields: dict[str, torch.Tensor], tally: torch.Tensor, layer: int, edges: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:  # fmt: skip
    """Add one call's report to row ``layer`` of ``tally`` (``certvllm.bounds.tally_layout``), in stream order.

    Args:
        fields: the report's ``[R_b, H]`` tensors by ``CertReport`` field name (contiguous).
        tally: ``[L, tally_columns(NE)]`` float64 on the report's device.
        layer: the row, ``0 ≤ layer < L``.
        edges: ``[3, NE]`` float64 bucket bounds on the device.
        rows: ``[1]`` int64 on the device, the number of leading rows to count (a graph's padded call: written per
            step), or None to count all ``R_b``.
    """
    rung = fields["rung"]
    launch_device_ok(rung)
    R, H = rung.shape
    NE = edges.shape[1]
    NC = tally_columns(NE)
    if tally.shape[1] != NC or not 0 <= layer < tally.shape[0]:
        raise ValueError(f"tally {tuple(tally.shape)} has no row {layer} of {NC} columns (NE={NE})")
    if R == 0:
        return
    names = ("rung", "e_key", "e_val", "v_max", "k_star", "v_promoted", "rank_fail", "boundary_fail", "bound_fail",
             "canary_fail", "precondition")  # fmt: skip
    args = [fields[n].contiguous() for n in names]
    _tally_kernel[(1,)](*args, rows if rows is not None else tally, R, edges, tally, layer, H=H, HP=next_pow2(H),
                        NE=NE, NC=NC, NCP=next_pow2(NC), RB=ROWS_PER_ITERATION,
                        ROWS_FROM_PTR=rows is not None)  # fmt: skip
