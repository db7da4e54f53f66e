"""The end of a certified layer call in one kernel: combine the attend pass's split-K parts with the trailing
partial block, compute the certificate (E_val, ᾱ_T, Δ_T, E_key with its rounding term), run the rank and
boundary checks and fill the report, for every (row, KV head, query head).

The same arithmetic as the torch epilogue of ``certvllm.attention.gpu._certified_rows`` (the reference,
kept behind ``CERTVLLM_TORCH_GLUE=1``) and the same formulas as ``certvllm.bounds``
(``value_bound``, ``tail_mass_upper``, ``key_sum_bound``, ``key_bound``, ``exp_rounding``) and
``certvllm.attention.checks.rank_and_boundary``, operation for operation in the same precisions
(float64 sums and division for the output and the masses, float32 for the bound terms), compiled without
FMA contraction so that every product and sum rounds as the reference's does; only the summation order
of the float32 tail sums and of the split-K sums differs (covered by γ_n, docs/certification.md §5).
exp/log/expm1/tanh are libdevice's (≤ 2 ulp; the reference's torch CUDA functions have the same
guarantee, and the certificate trusts 4 ulp). It replaces ~200 torch launches per layer call.

Rank check with depth r: the r largest exact log-masses of the promoted set F and the exact log-masses
of the r blocks of F that INT8 ranks highest, found by r rounds of max-and-remove (ties: the lowest block
index first, the trailing partial block last).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from certvllm.bounds.policy import LadderPolicy
from certvllm.bounds.report import RUNG_HEAD_DENSE, RUNG_LAYER_DENSE, RUNG_VALUES, RUNG_WIDEN, CertReport
from certvllm.bounds.rounding import GAMMA_SLACK
from certvllm.bounds.terms import alpha_inflation, exp_factors, round_factor, value_inflation

from .common import (
    GLUE_MAX_BLOCKS,
    exp_f32,
    expm1_f32,
    head_program,
    launch_device_ok,
    log_f32,
    next_pow2,
    precise,
    tail_mass_upper,
    tanh_f32,
)
from .shape_class import JIT_OPTIONS, width_class

MAX_BLOCKS = GLUE_MAX_BLOCKS

_WIDEN = tl.constexpr(RUNG_WIDEN)
_VALUES = tl.constexpr(RUNG_VALUES)
_HEAD = tl.constexpr(RUNG_HEAD_DENSE)
_LAYER = tl.constexpr(RUNG_LAYER_DENSE)


_F64: dict[torch.device, torch.Tensor] = {}


def _f64_constants(dev: torch.device) -> torch.Tensor:
    """alpha_inflation(16), value_inflation(16) as float64 on ``dev`` (made once per device: a host-to-device
    copy inside a CUDA-graph capture would fail)."""
    if dev not in _F64:
        _F64[dev] = torch.tensor([alpha_inflation(16), value_inflation(16)], dtype=torch.float64, device=dev)
    return _F64[dev]


def supported(num_blocks: int) -> bool:
    return num_blocks >= 1 and width_class(num_blocks).glue


@triton.jit
def _fmin(a, b):
    """``torch.fmin``: the smaller, ignoring a NaN operand."""
    return tl.where(a != a, b, tl.where(b != b, a, tl.minimum(a, b)))


@triton.jit
def _finite(x):
    return tl.abs(x) < float("inf")


SPLIT_TILE = tl.constexpr(32)
"""Splits of a (row, KV head) whose split-K sums are loaded and reduced at once: the loop over the splits is
latency-bound at batch 1, where the plan gives each group ~128 splits."""


@triton.jit
def _split_scales(msplit, pid, ss, live, S, mm, PER_SPLIT: tl.constexpr):
    """Factors ``[SPLIT_TILE]`` float64 that bring the splits ``ss``' sums to the row's maximum ``mm``: exp(m_s − mm)
    when the splits carry their own maxima (the resident pass; 0 for a split without blocks or past ``S``, exactly
    1 when m_s = mm), else 1 (0 past ``S``)."""
    if PER_SPLIT:
        ms = tl.load(msplit + pid * S + ss, mask=live, other=float("-inf"))
        return tl.where(ms > float("-inf"), tl.exp((ms - mm).to(tl.float64)), 0.0)
    else:
        return tl.where(live, 1.0, 0.0).to(tl.float64)


@triton.jit
def _combine(acc, den_p, s_tail, tail_v, m, msplit, pid, rk, g, S, G: tl.constexpr, D: tl.constexpr,
             DP: tl.constexpr, PER_SPLIT: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """Σ_splits num + the partial block's Σ w·v (float32, then float64), and the same for the denominator.

    The maximum m is the attend pass's global one, or (``PER_SPLIT``) the largest of the splits' maxima and the
    partial block's scores, each split's float64 sums rescaled to it (``_split_scales``). The splits are read
    ``SPLIT_TILE`` at a time and summed in a tree per tile (any order of the split-K sums is covered by γ_n,
    docs/certification.md §5).

    Returns ``(num [DP] float64, den [1] float64, den_t float32, s_tail row [N], m)``."""
    N: tl.constexpr = 16
    dd = tl.arange(0, DP)
    nn = tl.arange(0, N)
    tt = tl.arange(0, SPLIT_TILE)
    num = tl.zeros([DP], tl.float64)
    den = tl.zeros([1], tl.float64)
    st = tl.load(s_tail + pid * N + nn)
    if PER_SPLIT:
        mm = tl.max(st, 0)
        for s0 in range(0, S, SPLIT_TILE):
            mm = tl.maximum(mm, tl.max(tl.load(msplit + pid * S + s0 + tt, mask=s0 + tt < S, other=float("-inf")), 0))
    else:
        mm = tl.load(m + pid)
    for s0 in range(0, S, SPLIT_TILE):
        ss = s0 + tt
        live = ss < S
        ps = (rk * S + ss) * G + g  # [SPLIT_TILE]
        f = _split_scales(msplit, pid, ss, live, S, mm, PER_SPLIT)
        part = tl.load(acc + ps[:, None] * D + dd[None, :], mask=live[:, None] & (dd[None, :] < D), other=0.0)
        num += tl.sum(part * f[:, None], 0)
        den += tl.sum(tl.load(den_p + ps, mask=live, other=0.0) * f, 0)
    w = exp_f32(st - mm, PRECISE)  # [N]
    den_t = tl.sum(w, 0)
    tv = tl.load(tail_v + (rk * N + nn[:, None]) * D + dd[None, :], mask=dd[None, :] < D, other=0.0)
    num += tl.sum(w[:, None] * tv, 0).to(tl.float64)
    den += den_t.to(tl.float64)
    return num, den, den_t, st, mm


@triton.jit(**JIT_OPTIONS)
def _combine_exact_kernel(
    acc, den_p, s_tail, tail_v, m, msplit, rung, out, S, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PER_SPLIT: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Rungs 3/4 on the device: overwrite ``out`` with the exact re-run's combination where rung ≥ 3."""
    pid = tl.program_id(0).to(tl.int64)
    if tl.load(rung + pid) >= _HEAD:
        dd = tl.arange(0, DP)
        num, den, _, _, _ = _combine(acc, den_p, s_tail, tail_v, m, msplit, pid, pid // G, (pid % G).to(tl.int32),
                                     S, G, D, DP, PER_SPLIT, PRECISE)  # fmt: skip
        tl.store(out + pid * D + dd, (num / den).to(tl.float32), mask=dd < D)


@triton.jit(**JIT_OPTIONS)
def _finalize_kernel(
    acc,  # [R, H, S, G, D] float64 attend parts: Σ w·v
    den_p,  # [R, H, S, G] float64 Σ w
    aval_p,  # [R, H, S, G] float64 Σ over INT4-value blocks of block weight · η_b
    atail_p,  # [R, H, S, G] float64 weight on INT8-key blocks
    s_tail,  # [R, H, G, N] float32 exact scores of the trailing partial block (−inf past its tokens)
    tail_v,  # [R, H, N, D] float32 its values (0 past its tokens)
    l_tail,  # [R, H, G] float32 logsumexp of s_tail
    m,  # [R, H, G] float32 the global max used by the attend pass (not PER_SPLIT)
    msplit,  # [R, H, G, S] float32 each split's own max (PER_SPLIT: the resident pass)
    sabs,  # [R, H, G, S2] float32 max |s| of the promotion pass
    score_abs1,  # [R, H, G] float32 max |s| of phase 1 and the tail
    base_round,  # [R, H, G] float32 R without the exp term
    v_max,  # [R, H] float32
    eta_max,  # [R, H] float32
    bits,  # [R, H, B] int32 promotion bitmask (bit g keys, bit G + g values)
    l8,  # [R, H, G, B] float32 INT8 block log-mass
    exact_lm,  # [R, H, G, B] float32 exact block log-mass (where promoted)
    delta,  # [R, H, G, B] float32 Δ_b
    nfull,  # [R] int64
    lens,  # [R] int64
    widened,  # [R, H, G] int8
    canary,  # [R] int32
    page_flags,  # [R, H] int32: a row with a nonzero flag broke a precondition (prepare's CallState)
    out,  # out [R, H·G, D] float32
    f_out,  # out [6, R·H·G] float32: e_key, e_val, e_round, v_max, delta_tail, alpha_tail
    i_out,  # out [2, R·H·G] int32: k_star, v_promoted
    b_out,  # out [6, R·H·G] int8: rung, rank, boundary, bound, canary, precondition
    active,  # [R, H] int32: 0 = leave this group's outputs as they are (USE_ACTIVE)
    need_out,  # in/out [R, H] int32: set to 1 for a group with a head that needs a top-up (NEED)
    escalated,  # out [1] int8: set to 1 when a head is at rung ≥ 3 (FLAG_ESCALATED)
    counts,  # in/out [3] int64: += key blocks, value blocks, page-in bytes (COUNT)
    key_paged,  # 0-dim int64: key pages read over PCIe (COUNT and HAS_PAGED)
    f64c,  # [2] float64: alpha_inflation(N), value_inflation(N) (a float argument would be float32)
    B,
    S,
    S2,
    GS,
    VOUT,  # 1 + 2^-20
    C1,  # exp_rounding: score_abs·C1 + C0
    C0,
    RF,  # round_factor(N)
    BOUND_TOL,
    EPS,
    FORCE_RUNG,
    KEY_TOL,  # the top-up targets (NEED): key_tol, v_tol and, with COVERAGE, the rung-1 tail threshold
    V_TOL,
    THR1,
    H: tl.constexpr,
    HP: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BP: tl.constexpr,
    DEPTH: tl.constexpr,
    CERTIFIED: tl.constexpr,
    RANK: tl.constexpr,
    PER_SPLIT: tl.constexpr,
    USE_ACTIVE: tl.constexpr,
    NEED: tl.constexpr,
    COVERAGE: tl.constexpr,
    FLAG_ESCALATED: tl.constexpr,
    COUNT: tl.constexpr,  # the call's promotion counts (TrafficCount)
    HAS_PAGED: tl.constexpr,  # the paged key pages from key_paged, else the words with a PAGED_MASK bit
    PAGED_MASK: tl.constexpr,
    PAGE_HALF: tl.constexpr,  # bytes of a page's keys (or values)
    PRECISE: tl.constexpr,
):
    pid, rk, g, r = head_program(G, H)
    n_go = 1
    if USE_ACTIVE:  # an inactive group keeps what an earlier pass wrote
        n_go = tl.load(active + rk)
    for _ in range(0, n_go):
        _finalize_head(acc, den_p, aval_p, atail_p, s_tail, tail_v, l_tail, m, msplit, sabs, score_abs1, base_round,
                       v_max, eta_max, bits, l8, exact_lm, delta, nfull, lens, widened, canary, page_flags, out, f_out,
                       i_out, b_out, need_out, escalated, counts, key_paged, f64c, B, S, S2, GS, VOUT, C1, C0, RF,
                       BOUND_TOL, EPS, FORCE_RUNG, KEY_TOL, V_TOL, THR1, pid, rk, g, r, H, HP, G, D, DP, BP, DEPTH,
                       CERTIFIED, RANK, PER_SPLIT, NEED, COVERAGE, FLAG_ESCALATED, COUNT, HAS_PAGED, PAGED_MASK,
                       PAGE_HALF, PRECISE)  # fmt: skip


@triton.jit
def _finalize_head(acc, den_p, aval_p, atail_p, s_tail, tail_v, l_tail, m, msplit, sabs, score_abs1, base_round,
                   v_max, eta_max, bits, l8, exact_lm, delta, nfull, lens, widened, canary, page_flags, out, f_out,
                   i_out, b_out, need_out, escalated, counts, key_paged, f64c, B, S, S2, GS, VOUT, C1, C0, RF,
                   BOUND_TOL, EPS, FORCE_RUNG, KEY_TOL, V_TOL, THR1, pid, rk, g, r, H: tl.constexpr, HP: tl.constexpr,
                   G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BP: tl.constexpr, DEPTH: tl.constexpr,
                   CERTIFIED: tl.constexpr, RANK: tl.constexpr,
                   PER_SPLIT: tl.constexpr, NEED: tl.constexpr, COVERAGE: tl.constexpr,
                   FLAG_ESCALATED: tl.constexpr, COUNT: tl.constexpr, HAS_PAGED: tl.constexpr,
                   PAGED_MASK: tl.constexpr, PAGE_HALF: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """One (row, KV head, query head): output, certificate, checks and report (``_finalize_kernel``)."""
    N: tl.constexpr = 16
    dd = tl.arange(0, DP)
    pos = tl.arange(0, BP)
    RHG = tl.num_programs(0)
    AINF = tl.load(f64c)
    VINF = tl.load(f64c + 1)

    # ---- output: split-K parts + the trailing partial block (float64 combination, as the reference)
    num, den, den_t, st, mm = _combine(acc, den_p, s_tail, tail_v, m, msplit, pid, rk, g, S, G, D, DP, PER_SPLIT,
                                       PRECISE)  # fmt: skip
    tl.store(out + pid * D + dd, (num / den).to(tl.float32), mask=dd < D)
    aval = tl.zeros([1], tl.float64)
    atail = tl.zeros([1], tl.float64)
    tt = tl.arange(0, SPLIT_TILE)
    for s0 in range(0, S, SPLIT_TILE):
        ss = s0 + tt
        live = ss < S
        ps = (rk * S + ss) * G + g
        f = _split_scales(msplit, pid, ss, live, S, mm, PER_SPLIT)
        aval += tl.sum(tl.load(aval_p + ps, mask=live, other=0.0) * f, 0)
        atail += tl.sum(tl.load(atail_p + ps, mask=live, other=0.0) * f, 0)

    # ---- certificate terms
    e_val = tl.sum((((aval / den) * 1.0) * VINF).to(tl.float32), 0) * VOUT
    alpha = tl.sum(((atail / den) * AINF).to(tl.float32), 0)
    nf = tl.load(nfull + r).to(tl.int32)
    valid = pos < nf
    word = tl.load(bits + rk * B + pos, mask=pos < B, other=0)
    if COUNT:  # noqa: SIM102 - a constexpr branch around a runtime one (Triton)
        if g == 0:  # once per (row, KV head): its words, as the torch sums over the bitmask count them
            nvalues = tl.sum(((word >> G) != 0).to(tl.int64), 0)
            if HAS_PAGED:
                paged = tl.where(pid == 0, tl.load(key_paged).to(tl.int64), 0)
            else:
                paged = tl.sum(((word & PAGED_MASK) != 0).to(tl.int64), 0)
            tl.atomic_add(counts, tl.sum(((word & ((1 << G) - 1)) != 0).to(tl.int64), 0))
            tl.atomic_add(counts + 1, nvalues)
            tl.atomic_add(counts + 2, (paged + nvalues) * PAGE_HALF)
    keyb = ((word >> g) & 1) != 0
    valb = ((word >> (G + g)) & 1) != 0
    dl = tl.load(delta + pid * B + pos, mask=pos < B, other=0.0)
    in_tail = valid & ~keyb
    dt = tl.max(tl.where(in_tail, dl, 0.0), 0)
    dt = tl.where(tl.max((in_tail & (dl != dl)).to(tl.int32), 0) > 0, float("nan"), dt)  # amax keeps NaN
    k_star = tl.sum(keyb.to(tl.int32), 0)
    v_prom = tl.sum(valb.to(tl.int32), 0)
    score_abs2 = tl.load(score_abs1 + pid)
    for s2 in range(0, S2):
        score_abs2 = tl.maximum(score_abs2, tl.load(sabs + pid * S2 + s2), propagate_nan=tl.PropagateNan.ALL)
    score_abs2 = tl.maximum(score_abs2, tl.max(tl.where(_finite(st), tl.abs(st), 0.0), 0))
    round2 = tl.load(base_round + pid) + (score_abs2 * C1 + C0)
    alpha_up = tail_mass_upper(alpha, dt, round2, GS, PRECISE)
    tail_form = alpha_up * (expm1_f32(dt, PRECISE) + expm1_f32(2.0 * dt, PRECISE)) + round2
    tail_form = tl.where(alpha_up > 0, tail_form, round2)
    full_form = 2.0 * tanh_f32(0.5 * (dt + round2), PRECISE)
    key_sum = _fmin(_fmin(tail_form, full_form) * GS, 2.0)
    key_sum = tl.where((dt + round2) != (dt + round2), float("nan"), key_sum)
    vm = tl.load(v_max + rk)
    e_round = RF * (vm + tl.load(eta_max + rk))
    e_key = vm * key_sum * GS + e_round

    # ---- rank and boundary checks (checks.rank_and_boundary), block index B = the partial block
    has_tail = (tl.load(lens + r) % N) != 0
    false = nf < 0
    rank_fail = false
    boundary_fail = false
    if CERTIFIED and RANK:
        ex_f = tl.where(keyb & valid, tl.load(exact_lm + pid * B + pos, mask=pos < B, other=0.0), float("-inf"))
        ex_t = tl.where(has_tail, mm + log_f32(den_t, PRECISE), float("-inf"))
        l8b = tl.load(l8 + pid * B + pos, mask=pos < B, other=float("-inf"))
        lt = tl.load(l_tail + pid)
        i8_f = tl.where(keyb & valid, l8b, float("-inf"))
        i8_t = tl.where(has_tail, lt, float("-inf"))
        left_e = pos < B  # entries not yet taken, exact ranking
        left_et = has_tail | ~has_tail
        left_i = pos < B  # INT8 ranking
        left_it = left_et
        thr = tl.full([], float("inf"), tl.float32)
        # rounds past the B + 1 entries find only −inf, which neither check counts (as topk's r = min(r, B + 1))
        for _ in tl.static_range(DEPTH):
            ce = tl.where(left_e, ex_f, float("-inf"))
            top_b = tl.max(ce, 0)
            at_b = tl.min(tl.where(left_e & (ce == top_b), pos, BP), 0)
            take_tail = left_et & ((ex_t > top_b) | (at_b >= BP))
            top = tl.where(take_tail, ex_t, top_b)
            left_e = left_e & ~((pos == at_b) & ~take_tail)
            left_et = left_et & ~take_tail
            ci = tl.where(left_i, i8_f, float("-inf"))
            topi_b = tl.max(ci, 0)
            ati_b = tl.min(tl.where(left_i & (ci == topi_b), pos, BP), 0)
            tail_i = left_it & ((i8_t > topi_b) | (ati_b >= BP))
            by_i8 = tl.where(tail_i, ex_t, tl.sum(tl.where(pos == ati_b, ex_f, 0.0), 0))
            by_i8 = tl.where(tail_i | (ati_b < BP), by_i8, float("-inf"))
            left_i = left_i & ~((pos == ati_b) & ~tail_i)
            left_it = left_it & ~tail_i
            rank_fail = rank_fail | (_finite(top) & (by_i8 < top - EPS))
            thr = tl.where(_finite(top), tl.minimum(thr, top), thr)
        reach = (l8b + dl) + 2.0 * round2
        outside = valid & ~keyb
        boundary_fail = (tl.max((outside & (reach > thr)).to(tl.int32), 0) > 0) & _finite(thr)

    # ---- report
    bound = e_key + e_val
    hh = tl.arange(0, HP)
    precondition = tl.max(tl.load(page_flags + r * H + hh, mask=hh < H, other=0), 0) != 0
    rung = tl.where(tl.load(widened + pid) != 0, _WIDEN, 0)
    rung = tl.where(v_prom > 0, _VALUES, rung)
    bound_fail = false
    canary_fail = false
    if CERTIFIED:
        bound_fail = ~(bound <= BOUND_TOL * vm) | ~_finite(bound)
        canary_fail = tl.load(canary + r) > 0
        rung = tl.where(rank_fail | boundary_fail | bound_fail, _HEAD, rung)
        rung = tl.where(canary_fail | precondition, _LAYER, rung)
        rung = tl.where(FORCE_RUNG > 0, FORCE_RUNG, rung)
    else:
        e_key = tl.where(precondition | ~_finite(bound), float("inf"), e_key)
    exact = rung >= _HEAD  # recomputed exactly: no error to bound
    tl.store(f_out + pid, tl.where(exact, 0.0, e_key))
    tl.store(f_out + RHG + pid, tl.where(exact, 0.0, e_val))
    tl.store(f_out + 2 * RHG + pid, tl.where(exact, 0.0, e_round))
    tl.store(f_out + 3 * RHG + pid, vm)
    tl.store(f_out + 4 * RHG + pid, dt)
    tl.store(f_out + 5 * RHG + pid, alpha_up)
    tl.store(i_out + pid, k_star)
    tl.store(i_out + RHG + pid, v_prom)
    tl.store(b_out + pid, rung.to(tl.int8))
    tl.store(b_out + RHG + pid, rank_fail.to(tl.int8))
    tl.store(b_out + 2 * RHG + pid, boundary_fail.to(tl.int8))
    tl.store(b_out + 3 * RHG + pid, bound_fail.to(tl.int8))
    tl.store(b_out + 4 * RHG + pid, canary_fail.to(tl.int8))
    tl.store(b_out + 5 * RHG + pid, precondition.to(tl.int8))
    if FLAG_ESCALATED:  # every escalated head stores the same 1: no atomics needed
        tl.store(escalated, tl.full([], 1, tl.int8), mask=exact)
    if NEED:  # the resident pass's top-up: a head outside its targets (certvllm.attention.resident)
        miss = (rung == _HEAD) | (e_key > KEY_TOL * vm) | (e_val > V_TOL * vm)
        if COVERAGE:
            miss = miss | (alpha_up > THR1)
        tl.atomic_or(need_out + rk, (miss & (rung < _LAYER)).to(tl.int32))


@dataclass(frozen=True)
class TrafficCount:
    """What :func:`finalize` adds to ``counts`` (``[3]`` int64, zeroed by ``prepare``), the call's promotion traffic
    for ``CudaPageInEngine.add_device_count_vector``: the words of the ``[R, K, B]`` bitmask with a key bit, those with
    a value bit, and (paged key pages + value blocks)·``page_half`` bytes, where the paged key pages are the 0-dim
    ``key_paged`` (the pool's count, read once) or, when None, the words with a ``paged_mask`` bit (every key page
    the promotion pass read came over PCIe)."""

    counts: torch.Tensor
    key_paged: torch.Tensor | None
    paged_mask: int
    page_half: int


@dataclass
class Finalized:
    """What :func:`finalize` wrote: ``out`` ``[R, H_q, D]`` float32, the ``report`` (views of the buffers
    below) and the kernel's raw output buffers, which a later call with ``active`` writes into."""

    out: torch.Tensor
    report: CertReport
    f_out: torch.Tensor
    i_out: torch.Tensor
    b_out: torch.Tensor


def finalize(
    parts,
    s_tail: torch.Tensor,
    tail_v: torch.Tensor,
    l_tail: torch.Tensor,
    m: torch.Tensor,
    sabs: torch.Tensor,
    score_abs1: torch.Tensor,
    base_round: torch.Tensor,
    v_max: torch.Tensor,
    eta_max: torch.Tensor,
    bits: torch.Tensor,
    l8: torch.Tensor,
    exact_lm: torch.Tensor,
    delta: torch.Tensor,
    nfull: torch.Tensor,
    lens: torch.Tensor,
    widened: torch.Tensor,
    canary: torch.Tensor,
    page_flags: torch.Tensor,
    policy: LadderPolicy,
    msplit: torch.Tensor | None = None,
    *,
    into: Finalized | None = None,
    active: torch.Tensor | None = None,
    need: torch.Tensor | None = None,
    escalated: torch.Tensor | None = None,
    traffic: TrafficCount | None = None,
) -> Finalized:
    """Output ``[R, H_q, D]`` float32 and the report of a layer call (shapes in ``_finalize_kernel``'s argument
    comments; ``v_max``/``eta_max`` may carry a trailing 1, ``widened`` is bool, ``page_flags`` is
    ``prepare.CallState.page_flags``), as :class:`Finalized`.

    The resident pass's options: ``msplit`` (the splits' own maxima; ``m`` is then not read), ``into`` (write into
    an earlier call's buffers), ``active`` (``[R, K]`` int32: only these groups' heads are computed and written)
    and ``need`` (``[R, K]`` int32, zeroed by the caller: set to 1 where a head of the group misses ``policy``'s
    key_tol or v_tol, the rung-1 tail threshold under coverage selection, or the rung-3 checks, and is not at
    rung 4). ``escalated``: a zeroed ``[1]`` int8 flag set to 1 when a head ends at rung 3 or 4
    (``prepare.CallState.escalated``). ``traffic``: also add the call's promotion counts (:class:`TrafficCount`)."""
    launch_device_ok(l8)
    R, K, G, B = l8.shape
    D = tail_v.shape[-1]
    if not supported(B):
        raise ValueError(f"finalize: {B} block-table columns, the kernel holds at most {MAX_BLOCKS}")
    dev = l8.device
    rhg = R * K * G
    if into is None:
        out = torch.empty(R, K * G, D, dtype=torch.float32, device=dev)
        f_out = torch.empty(6, rhg, dtype=torch.float32, device=dev)
        i_out = torch.empty(2, rhg, dtype=torch.int32, device=dev)
        b_out = torch.empty(6, rhg, dtype=torch.int8, device=dev)
    else:
        out, f_out, i_out, b_out = into.out, into.f_out, into.i_out, into.b_out
    c1, c0 = exp_factors()
    _finalize_kernel[(rhg,)](
        parts.acc, parts.den, parts.aval, parts.atail, s_tail.contiguous(), tail_v.contiguous(),
        l_tail.contiguous(), m.contiguous(), (m if msplit is None else msplit).contiguous(), sabs.contiguous(),
        score_abs1.contiguous(), base_round.contiguous(), v_max.contiguous(), eta_max.contiguous(), bits,
        l8.contiguous(), exact_lm, delta.contiguous(), nfull, lens, widened.contiguous().view(torch.int8), canary,
        page_flags.contiguous(), out, f_out, i_out, b_out,
        b_out if active is None else active, b_out if need is None else need,
        b_out if escalated is None else escalated, i_out if traffic is None else traffic.counts,
        i_out if traffic is None or traffic.key_paged is None else traffic.key_paged, _f64_constants(dev), B,
        parts.den.shape[2], sabs.shape[-1], GAMMA_SLACK, 1 + 2.0**-20, c1, c0, round_factor(16), policy.bound_tol,
        policy.eps_guard, policy.forced_rung, policy.key_tol, policy.v_tol, policy.rung1_tail_threshold,
        H=K, HP=next_pow2(K), G=G, D=D, DP=next_pow2(D), BP=width_class(B).bp, DEPTH=policy.rank_depth,
        CERTIFIED=policy.certified, RANK=policy.checks_rank, PER_SPLIT=msplit is not None,
        USE_ACTIVE=active is not None, NEED=need is not None, COVERAGE=not policy.key_budget,
        FLAG_ESCALATED=escalated is not None, COUNT=traffic is not None,
        HAS_PAGED=traffic is not None and traffic.key_paged is not None,
        PAGED_MASK=0 if traffic is None else traffic.paged_mask, PAGE_HALF=0 if traffic is None else traffic.page_half,
        PRECISE=precise(), num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    if into is not None:
        return into
    shape = (R, K * G)
    f = [t.view(shape) for t in f_out]
    flags = [t.view(shape) for t in b_out.view(torch.bool)]
    report = CertReport(
        rung=b_out[0].view(shape), e_key=f[0], e_val=f[1], e_round=f[2], k_star=i_out[0].view(shape),
        v_promoted=i_out[1].view(shape), v_max=f[3], delta_tail=f[4], alpha_tail=f[5], rank_fail=flags[1],
        boundary_fail=flags[2], bound_fail=flags[3], canary_fail=flags[4], precondition=flags[5],
    )  # fmt: skip
    return Finalized(out, report, f_out, i_out, b_out)


def combine_exact(parts, s_tail: torch.Tensor, tail_v: torch.Tensor, m: torch.Tensor, rung: torch.Tensor,
                  out: torch.Tensor, msplit: torch.Tensor | None = None) -> None:  # fmt: skip
    """Overwrite ``out`` ``[R, H_q, D]`` in place with the exact re-run's output (attend ``parts`` over
    unquantized blocks, plus the partial block) on the heads whose ``rung`` ``[R, H_q]`` is ≥ 3. ``msplit``: the
    splits' own maxima (a resident pass; ``m`` is then not read)."""
    R, K, G, _ = s_tail.shape
    D = tail_v.shape[-1]
    _combine_exact_kernel[(R * K * G,)](
        parts.acc, parts.den, s_tail.contiguous(), tail_v.contiguous(), m.contiguous(),
        (m if msplit is None else msplit).contiguous(), rung.contiguous(), out, parts.den.shape[2], G=G, D=D,
        DP=next_pow2(D), PER_SPLIT=msplit is not None, PRECISE=precise(), num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
