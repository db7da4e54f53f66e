"""Selection in one kernel: top-K* key promotion with rung 1 (widen coverage) and rung 2 (value promotion)
for every (row, KV head, query head), written straight into the phase-2 promotion bitmask.

The same decisions as ``certvllm.attention.selection.select_keys`` / ``select_values`` (the reference;
read it first), without their ~60 torch launches per layer call. One program per (row, KV head, query
head) holds the head's ``B`` blocks in registers (``BP`` = next power of two):

1. p̂_b = exp(ℓ⁸_b − lse) on full blocks (0 elsewhere); a stable descending argsort as one ``tl.sort`` of
   int64 keys ``bits(p̂_b) << 32 | (BP − 1 − b)`` (p̂ ≥ 0, so its float bits sort like the value, and the
   low word puts the lower block first among ties, as ``torch.argsort(stable=True)``);
2. α̂[k] (mass left on INT8 keys after the top k) as a reverse cumulative sum (float64 accumulation, as
   torch's CPU cumsum), Δ suffix maxima, the K* rule (coverage or key-error budget) with the K_min/K_max
   clamps and rung 1, exactly the reference's expressions;
3. rung 2: ρ̄_b·η_b sorted the same way, promoted greedily until the remaining estimate meets the budget;
4. ``bits[r, h, b] |= 1 << g`` for promoted keys (``(1 << G) − 1``, every head of the group, under the
   budget rule) and ``1 << (G + g)`` for promoted values (atomic OR: the G programs of a (row, KV head) share
   the words).

By default (``KernelTuning.select_search``) the counts of steps 1–3 come from ``_search`` instead of the sorts:
each rule (K* with its clamps and rung 1, rung 2's greedy count) is monotone in the number of top positions taken,
so a bisection over the sort keys' bits, one block-wide reduction (count, float64 tail sum, Δ maximum) per step,
finds the threshold whose count is the rule's first; the blocks with keys at or above it are the promoted ones.

Keys (1–2) and values (3) are independent chains of block-wide reductions and sorts: with few heads in the batch
(``PARTS`` = 2, where twice the programs still leave each its own multiprocessor) a second program per head
takes the values, so a small batch waits for the longer chain rather than for both in turn.

Tested against the torch reference under the interpreter (``tests/triton_kernels/test_triton_kernels.py``); the
decisions may only differ where a comparison sits within float rounding of its threshold, and no
certificate depends on them (the bounds are computed from whatever was selected).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certvllm.bounds.policy import VALUE_BUDGET_MARGIN, LadderPolicy
from certvllm.bounds.rounding import GAMMA_SLACK

from .common import (
    GLUE_MAX_BLOCKS,
    exp_f32,
    expm1_f32,
    head_program,
    launch_device_ok,
    multiprocessors,
    next_pow2,
    precise,
    tail_mass_upper,
)
from .shape_class import JIT_OPTIONS, width_class
from .tuning import DEFAULT_TUNING, KernelTuning

MAX_BLOCKS = GLUE_MAX_BLOCKS

WINDOW = 512
"""Positions of the sorted orders the kernel materialises when the table is wider (see ``_top_window``)."""


_COUNT = tl.constexpr(0)  # the rules of ``_search`` (``_search_holds``)
_KEY_BUDGET = tl.constexpr(1)
_VALUES = tl.constexpr(2)
_COVERAGE = tl.constexpr(3)
_RUNG1 = tl.constexpr(4)


def supported(num_blocks: int) -> bool:
    return num_blocks >= 1 and width_class(num_blocks).glue


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _order_keys(x, pos, B, BP: tl.constexpr):
    """int64 keys whose descending order is the stable descending order of non-negative float32 ``x``:
    ``bits(x) << 32 | (BP − 1 − pos)`` at positions < B, −1 past them."""
    key = (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BP - 1 - pos).to(tl.int64)
    return tl.where(pos < B, key, -1)


@triton.jit
def _decode_keys(key, BP: tl.constexpr):
    """(values, block ids) of sorted ``_order_keys`` keys: 0 and a negative id for the −1 padding."""
    idx = (BP - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
    val = tl.where(key >= 0, (key >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    return val, tl.where(key >= 0, idx, -1)


@triton.jit
def _sorted_desc(x, pos, B, BP: tl.constexpr):
    """Stable descending argsort of non-negative float32 ``x`` over positions < B: (values, block ids)."""
    return _decode_keys(tl.sort(_order_keys(x, pos, B, BP), descending=True), BP)


@triton.jit
def _suffix_sum(x):
    """Σ_{j ≥ k} x_j per position, accumulated in float64, rounded to float32."""
    return tl.cumsum(x.to(tl.float64), 0, reverse=True).to(tl.float32)


@triton.jit
def _first(cond, pos, default, BP: tl.constexpr):
    """Smallest position where ``cond`` holds, else ``default``."""
    first = tl.min(tl.where(cond, pos, BP), 0)
    return tl.where(first < BP, first, default)


@triton.jit
def _at(x, pos, k):
    """x[k] (0 when k is past the end)."""
    return tl.sum(tl.where(pos == k, x, 0.0), 0)


@triton.jit
def _bit_candidate(t, one, i, LOG2BP: tl.constexpr):
    """Step ``i`` of a bisection over ``_order_keys`` keys from the top: ``t`` with its next bit set (bits 62 … 32,
    the float's; then LOG2BP − 1 … 0, the block index's; bit 63 and the low word's bits 31 … LOG2BP are always 0)."""
    shift = tl.where(i < 31, 62 - i, 31 + LOG2BP - 1 - i)
    return t | (one << shift.to(tl.int64))


@triton.jit
def _window_threshold(key, LO, W, LOG2BP: tl.constexpr):
    """A threshold t with LO ≤ #{key ≥ t} ≤ W for more than W distinct keys ≥ 0 (padding −1); with at most W keys
    the count is at most W and t may be 0 (all of them).

    Bisection over the key bits from the top (the high word holds the bits of a non-negative float32, bit 63 is 0;
    the low word is < 2^LOG2BP, so its bits 31 … LOG2BP are skipped), keeping #{key ≥ t} > W and stopping at the
    first candidate whose count lands in [LO, W]. It stops by the last bit: otherwise #{key ≥ t} > W and
    #{key ≥ t + 1} < LO, while distinct keys make the two counts differ by at most 1. Each count is one
    block-wide reduction; spread masses settle within their exponent and a few mantissa bits."""
    t = tl.max(key, 0) * 0
    one = t + 1
    found = t * 0
    i = 0
    while (found == 0) & (i < 31 + LOG2BP):
        cand = _bit_candidate(t, one, i, LOG2BP)
        c = tl.sum((key >= cand).to(tl.int32), 0)
        t = tl.where(c >= LO, cand, t)
        found = ((c >= LO) & (c <= W)).to(found.dtype)
        i += 1
    return t


@triton.jit
def _top_window(x, pos, B, scratch, LO, W: tl.constexpr, BP: tl.constexpr, LOG2BP: tl.constexpr):
    """The first ``count`` entries of the stable descending order of ``x`` (non-negative float32 over positions
    < B, more than W of them), LO ≤ count ≤ W, without sorting all BP: a threshold by bisection
    (``_window_threshold``), the keys at or above it compacted through ``scratch`` ([W] int64 of this program)
    and sorted.

    Returns ``(values [W], block ids [W], selected [BP] bool, count)``: window entries past ``count`` are 0 with
    block id < 0."""
    key = _order_keys(x, pos, B, BP)
    sel = key >= _window_threshold(key, LO, W, LOG2BP)
    sel = sel & (pos < B)
    slot = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(scratch + slot, key, mask=sel)
    tl.debug_barrier()
    q = tl.arange(0, W)
    count = tl.sum(sel.to(tl.int32), 0)
    val, idx = _decode_keys(tl.sort(tl.load(scratch + q, mask=q < count, other=-1), descending=True), BP)
    return val, idx, sel, count


@triton.jit
def _promote_values_full(err, pos, B, nf, vbudget, VKMAX, bits_row, bit, BP: tl.constexpr):
    """Rung 2 over the whole order: the greedy count of ``selection.select_values`` (capped by ``VKMAX`` ≥ 0),
    set as bit ``bit`` of the blocks' words in ``bits_row``."""
    serr, vorder = _sorted_desc(err, pos, B, BP)
    remaining = _suffix_sum(serr)
    count = _first((remaining <= vbudget) & (pos < B), pos, B, BP)
    count = tl.where(VKMAX >= 0, tl.minimum(count, VKMAX), count)
    take = (pos < count) & (vorder < nf) & (pos < B)
    tl.atomic_or(bits_row + vorder, (pos * 0 + 1) << bit, mask=take)


@triton.jit
def _head_inputs(l8, lse, delta, rounding, nfull, eta, pid, rk, r, B, GS, BP: tl.constexpr, PRECISE: tl.constexpr):
    """What both selection kernels start from, for query head ``pid``: positions ``[BP]``, the row's full blocks
    ``nf``, ``valid``, p̂_b on full blocks (0 elsewhere), Δ_b, R, max Δ and ρ̄_b·η_b (rung 2's error terms)."""
    pos = tl.arange(0, BP)
    nf = tl.load(nfull + r).to(tl.int32)
    valid = pos < nf
    row = pid * B
    lg = tl.load(l8 + row + pos, mask=pos < B, other=float("-inf"))
    p_hat = exp_f32(lg - tl.load(lse + pid), PRECISE)
    mass = tl.where(valid, p_hat, 0.0)
    dl = tl.load(delta + row + pos, mask=pos < B, other=0.0)
    rr = tl.load(rounding + pid)
    delta_all = tl.max(dl, 0)
    xi = delta_all + 3.0 * rr
    rho = tail_mass_upper(p_hat, xi, 0.0, GS, PRECISE)
    err = tl.where(valid, rho * tl.load(eta + rk * B + pos, mask=pos < B, other=0.0), 0.0)
    return pos, nf, valid, mass, dl, rr, delta_all, err


@triton.jit
def _key_estimate(alpha, dsuf, delta_all, rr, GS, PRECISE: tl.constexpr):
    """``selection.key_tail_estimate`` of one K: the estimated E_key/V_max from the mass α̂ left on INT8 keys and
    the largest Δ among those blocks."""
    abar = tail_mass_upper(alpha, delta_all, rr, GS, PRECISE)
    growth = expm1_f32(dsuf, PRECISE) + expm1_f32(2.0 * dsuf, PRECISE)
    return tl.where(abar > 0, abar * growth, 0.0)


@triton.jit
def _key_choice(alpha, dsuf, q, cnt, nf, g, delta_all, rr, B, GS, TAU1, KMIN, KMAX, KMAX1, THR1, KEY_TOL,
                BUDGET: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, W: tl.constexpr,
                PRECISE: tl.constexpr):  # fmt: skip
    """The K* rule with the K_min/K_max clamps and rung 1 over the first positions ``q`` of the descending order
    (α̂ and the Δ suffix maxima at each): ``(k_star, base, key_bits, resolved)``. ``resolved``: every position the
    rule looked at to decide is one of the first ``cnt`` (a window's entries), so a wider window decides the same."""
    kmin = tl.minimum(nf, KMIN)
    kmax = tl.minimum(nf, KMAX)
    kmax1 = tl.minimum(nf, KMAX1)
    est = _key_estimate(alpha, dsuf, delta_all, rr, GS, PRECISE)
    ok = (est <= KEY_TOL) & (q <= kmax1) & (q < B)
    if BUDGET:  # the fewest blocks (≥ K_min) whose estimated E_key fits key_tol
        found = _first((est <= KEY_TOL) & (q >= kmin) & (q < B), q, -1, BP + W)
        base = tl.maximum(tl.minimum(tl.where(found >= 0, found, kmax), kmax), kmin)
        trigger = _at(est, q, base) > KEY_TOL
        key_bits = ((q * 0 + 1) << G) - 1  # every query head of the KV head reads the union
    else:  # the paper's coverage rule
        found = _first((alpha <= TAU1) & (q < B), q, -1, BP + W)
        base = tl.maximum(tl.minimum(tl.where(found >= 0, found, nf), kmax), kmin)
        trigger = (_at(alpha, q, base) > THR1) | (_at(est, q, base) > KEY_TOL)
        ok = ok & (alpha <= THR1)
        key_bits = (q * 0 + 1) << g
    ok = ok & (q >= base)
    first_ok = _first(ok, q, -1, BP + W)
    k_star = tl.where(trigger, tl.maximum(tl.where(first_ok >= 0, first_ok, kmax1), base), base)
    resolved = (found >= 0) & (found < cnt) & (base < cnt) & ((trigger == 0) | ((first_ok >= 0) & (first_ok < cnt)))
    return k_star, base, key_bits, resolved


@triton.jit
def _window_keys(mass, dl, delta, row, pos, q, B, scratch, LO, W: tl.constexpr, BP: tl.constexpr,
                 LOG2BP: tl.constexpr):  # fmt: skip
    """The first ``cnt`` (LO ≤ cnt ≤ W) positions of the descending mass order (``_top_window``) with α̂ (the mass
    past each position, the rest of the table included) and the Δ suffix maxima: ``(order, alpha, dsuf, cnt)``."""
    smass, order, sel, cnt = _top_window(mass, pos, B, scratch, LO, W, BP, LOG2BP)
    rest = tl.sum(tl.where(sel, 0.0, mass).to(tl.float64), 0)
    alpha = (tl.cumsum(smass.to(tl.float64), 0, reverse=True) + rest).to(tl.float32)
    wdelta = tl.load(delta + row + order, mask=order >= 0, other=0.0)
    dsuf = tl.maximum(tl.associative_scan(wdelta, 0, _max, reverse=True), tl.max(tl.where(sel, 0.0, dl), 0))
    return order, alpha, dsuf, cnt


@triton.jit
def _window_values(err, pos, q, B, vbudget, VKMAX, scratch, LO, W: tl.constexpr, BP: tl.constexpr,
                   LOG2BP: tl.constexpr):  # fmt: skip
    """Rung 2's greedy count over a window of the descending ρ̄·η order: ``(vorder, count)``, count −1 when the
    greedy runs past the window (then a wider one, or the whole order, decides)."""
    serr, vorder, vsel, _ = _top_window(err, pos, B, scratch, LO, W, BP, LOG2BP)
    vrest = tl.sum(tl.where(vsel, 0.0, err).to(tl.float64), 0)
    remaining = (tl.cumsum(serr.to(tl.float64), 0, reverse=True) + vrest).to(tl.float32)
    count = _first((remaining <= vbudget) & (q < B), q, -1, W)
    return vorder, tl.where((count >= 0) & (VKMAX >= 0), tl.minimum(count, VKMAX), count)


@triton.jit
def _tail_combine(c0, s0, m0, c1, s1, m1):
    return c0 + c1, s0 + s1, tl.maximum(m0, m1)


@triton.jit
def _count_sum_combine(c0, s0, c1, s1):
    return c0 + c1, s0 + s1


@triton.jit
def _tail_at(key, x, y, t, MODE: tl.constexpr):
    """At threshold ``t``: ``(#{key ≥ t}, Σ x over key < t accumulated in float64, max y over key < t)`` in one
    block-wide reduction of what rule ``MODE`` reads (the others are 0); the padding's −1 keys are below every
    t ≥ 0, with x = y = 0 there."""
    above = key >= t
    if MODE == _COUNT:
        return tl.sum(above.to(tl.int32), 0), 0.0, 0.0
    elif (MODE == _VALUES) | (MODE == _COVERAGE):
        c, s = tl.reduce((above.to(tl.int32), tl.where(above, 0.0, x).to(tl.float64)), 0, _count_sum_combine)
        return c, s, 0.0
    else:
        below_x = tl.where(above, 0.0, x).to(tl.float64)
        return tl.reduce((above.to(tl.int32), below_x, tl.where(above, 0.0, y)), 0, _tail_combine)


@triton.jit
def _search_holds(c, s, m, target, delta_all, rr, GS, KMIN, KMAX1, TOL, THR, MODE: tl.constexpr,
                  PRECISE: tl.constexpr):  # fmt: skip
    """Whether the rule ``MODE`` holds with the top ``c`` positions taken, the rest summing to ``s`` (float64) with
    largest ``m``; each rule is monotone in c (α̂ and the Δ suffix maximum only shrink as c grows):

    * ``COUNT``: c ≥ ``target``;
    * ``KEY_BUDGET``: (E_key estimate ≤ ``TOL`` and c ≥ ``KMIN``) or c ≥ ``KMAX1``: its first c is the budget
      rule's K* with the K_min clamp and rung 1 up to ``KMAX1``;
    * ``VALUES``: the ρ̄·η left ≤ ``TOL`` (rung 2's budget) or c ≥ ``target`` (``value_k_max``, −1: no cap);
    * ``COVERAGE``: α̂ ≤ ``TOL`` (1 − τ_cov);
    * ``RUNG1``: E_key estimate ≤ ``TOL`` and α̂ ≤ ``THR`` (the coverage rule's rung-1 condition)."""
    if MODE == _COUNT:
        return c >= target
    elif MODE == _KEY_BUDGET:
        est = _key_estimate(s.to(tl.float32), m, delta_all, rr, GS, PRECISE)
        return ((est <= TOL) & (c >= KMIN)) | (c >= KMAX1)
    elif MODE == _VALUES:
        return (s.to(tl.float32) <= TOL) | ((target >= 0) & (c >= target))
    elif MODE == _COVERAGE:
        return s.to(tl.float32) <= TOL
    else:
        alpha = s.to(tl.float32)
        return (_key_estimate(alpha, m, delta_all, rr, GS, PRECISE) <= TOL) & (alpha <= THR)


@triton.jit
def _search(key, x, y, n, target, delta_all, rr, GS, KMIN, KMAX1, TOL, THR, MODE: tl.constexpr,
            LOG2BP: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    """The fewest top positions of the stable descending order of ``key`` (``_order_keys``; ``n`` of them ≥ 0) for
    which the monotone rule ``MODE`` holds (``_search_holds``), without sorting: ``(t, c)``, c = #{key ≥ t}, so the
    chosen blocks are those with key ≥ t. ``n`` when the rule holds nowhere (the reference's default).

    Bisection over the key bits from the top (as ``_window_threshold``), keeping the largest t whose count
    satisfies the rule: one ``_tail_at`` reduction per step. It stops early once [t, hi) holds at most one key,
    hi being the last candidate rejected: the rule holds at c(t) and fails at c(hi) = c(t) − 1, so c(t) is the
    answer (spread masses settle within their exponent and a few mantissa bits; ties go on into the low word)."""
    t = tl.max(key, 0) * 0
    one = t + 1
    c_t = n
    c_hi = n * 0 - 1  # unknown: no candidate rejected yet
    i = 0
    while (c_t - c_hi > 1) & (i < 31 + LOG2BP):
        cand = _bit_candidate(t, one, i, LOG2BP)
        c, s, m = _tail_at(key, x, y, cand, MODE)
        ok = _search_holds(c, s, m, target, delta_all, rr, GS, KMIN, KMAX1, TOL, THR, MODE, PRECISE)
        t = tl.where(ok, cand, t)
        c_t = tl.where(ok, c, c_t)
        c_hi = tl.where(ok, c_hi, c)
        i += 1
    return t, c_t


@triton.jit
def _keys_by_search(mass, dl, pos, nf, B, g, delta_all, rr, GS, TAU1, KMIN, KMAX, KMAX1, THR1, KEY_TOL,
                    BUDGET: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, LOG2BP: tl.constexpr,
                    PRECISE: tl.constexpr):  # fmt: skip
    """``selection.select_keys``' K* and rung 1 by ``_search`` instead of a sort: ``(take [BP] bool, key_bits,
    widened)``. Budget rule: one search (its first c is K*, clamped to [K_min, K_max1]; rung 1 used iff
    K* > K_max). Coverage rule: the first c with α̂ ≤ 1 − τ_cov gives the base (clamped to [K_min, K_max]), the
    first with the rung-1 condition (estimate and tail within their thresholds) says whether and how far rung 1
    widens; a count search then finds K*'s threshold unless one of the two already has it."""
    key = _order_keys(mass, pos, B, BP)
    kmin = tl.minimum(nf, KMIN)
    kmax = tl.minimum(nf, KMAX)
    kmax1 = tl.minimum(nf, KMAX1)
    if BUDGET:
        t, k_star = _search(key, mass, dl, B, 0, delta_all, rr, GS, kmin, kmax1, KEY_TOL, 0.0, _KEY_BUDGET, LOG2BP,
                            PRECISE)  # fmt: skip
        widened = k_star > kmax
        key_bits = ((nf * 0 + 1) << G) - 1  # every query head of the KV head reads the union
    else:
        t_a, f_a = _search(key, mass, dl, B, 0, delta_all, rr, GS, kmin, kmax1, TAU1, 0.0, _COVERAGE, LOG2BP,
                           PRECISE)  # fmt: skip
        t_1, f_1 = _search(key, mass, dl, B, 0, delta_all, rr, GS, kmin, kmax1, KEY_TOL, THR1, _RUNG1, LOG2BP,
                           PRECISE)  # fmt: skip
        base = tl.maximum(tl.minimum(f_a, kmax), kmin)
        widened_to = tl.maximum(tl.minimum(f_1, kmax1), base)
        k_star = tl.where(base < f_1, widened_to, base)  # rung 1 triggers where the base misses its condition
        widened = k_star > base
        t = tl.where(k_star == f_1, t_1, t_a)
        if (k_star != f_1) & (k_star != f_a):
            t, k_star = _search(key, mass, dl, B, k_star, delta_all, rr, GS, kmin, kmax1, KEY_TOL, THR1, _COUNT,
                                LOG2BP, PRECISE)  # fmt: skip
        key_bits = (nf * 0 + 1) << g
    take = (key >= t) & (pos < nf)
    return take, key_bits, widened


@triton.jit
def _values_by_search(err, pos, nf, B, vbudget, VKMAX, BP: tl.constexpr, LOG2BP: tl.constexpr,
                      PRECISE: tl.constexpr):  # fmt: skip
    """``selection.select_values``' greedy count (capped by ``VKMAX`` ≥ 0) by ``_search``: the value-promoted
    blocks ``[BP]`` bool."""
    key = _order_keys(err, pos, B, BP)
    t, unused = _search(key, err, err, B, VKMAX, 0.0, 0.0, 1.0, 0, 0, vbudget, 0.0, _VALUES, LOG2BP, PRECISE)
    return (key >= t) & (pos < nf)


@triton.jit(**JIT_OPTIONS)
def _select_kernel(
    l8,  # [R, H, G, B] float32 block log-mass ℓ⁸_b (−inf past the last full block)
    lse,  # [R, H, G] float32 log of the total INT8 mass (full blocks and the partial one)
    delta,  # [R, H, G, B] float32 Δ_b (0 past the last full block)
    rounding,  # [R, H, G] float32 R
    nfull,  # [R] int64 full blocks per row
    eta,  # [R, H, B] float32 η_b
    v_max,  # [R, H] float32 V_max (rung 2's budget: v_tol·V_max / VALUE_BUDGET_MARGIN)
    bits,  # in/out [R, H, B] int32 promotion bitmask (zeroed by the caller)
    widened,  # out [R, H, G] int8 rung 1 used
    active,  # [R, H] int32: 0 = select nothing for this group (USE_ACTIVE)
    scratch,  # [R·H·G, 2, W] int64 (the windowed path's compaction buffers)
    B,
    GS,  # GAMMA_SLACK
    TAU1,  # 1 − τ_cov
    KMIN,
    KMAX,
    KMAX1,  # ceil(rung1_multiplier · K_max) (< W on the windowed path)
    THR1,  # rung-1 tail threshold
    KEY_TOL,
    V_TOL,  # v_tol (float32)
    MARGIN,  # bounds.policy.VALUE_BUDGET_MARGIN (float32)
    VKMAX,  # value_k_max, or −1 for no cap
    BUDGET: tl.constexpr,  # key_selection: budget (else coverage)
    H: tl.constexpr,
    G: tl.constexpr,
    BP: tl.constexpr,
    W: tl.constexpr,  # window of the sorted order (BP ≤ W: sort everything)
    WS: tl.constexpr,  # a first, smaller window tried before W (0: none; BP > W > WS)
    LOG2BP: tl.constexpr,
    USE_ACTIVE: tl.constexpr,
    PRECISE: tl.constexpr,
    PARTS: tl.constexpr,  # 1: each program selects keys and values; 2: grid axis 1 = 0 keys, 1 values
    SEARCH: tl.constexpr,  # 1: the counts by bisection on the rules themselves (``_search``), no window, no sort
):
    pid, rk, g, r = head_program(G, H)
    part = tl.program_id(1)
    n_go = 1
    if USE_ACTIVE:  # an inactive group's heads select nothing (bits and widened stay the caller's zeros)
        n_go = tl.load(active + rk)
    for _ in range(0, n_go):
        pos, nf, valid, mass, dl, rr, delta_all, err = _head_inputs(l8, lse, delta, rounding, nfull, eta, pid, rk, r,
                                                                    B, GS, BP, PRECISE)  # fmt: skip
        row = pid * B
        vbudget = tl.math.div_rn(tl.load(v_max + rk) * V_TOL, MARGIN)  # as the reference's float32 expression
        bits_row = bits + rk * B
        LO = tl.maximum(KMAX1 + 1, W // 2)  # the fewest sorted positions a wide window holds (K* ≤ KMAX1)

        # ---- keys: top-K*, rung 1 (selection.select_keys); positions q of the descending order
        if part != 0:  # PARTS = 2, the values' program
            pass
        elif SEARCH:
            take, key_bits, widened_here = _keys_by_search(mass, dl, pos, nf, B, g, delta_all, rr, GS, TAU1, KMIN,
                                                           KMAX, KMAX1, THR1, KEY_TOL, BUDGET, G, BP, LOG2BP,
                                                           PRECISE)  # fmt: skip
            tl.store(widened + pid, widened_here.to(tl.int8))
            tl.atomic_or(bits_row + pos, key_bits, mask=take)
        elif BP <= W:
            smass, order = _sorted_desc(mass, pos, B, BP)
            alpha = _suffix_sum(smass)
            dsuf = tl.associative_scan(tl.load(delta + row + order, mask=pos < B, other=0.0), 0, _max, reverse=True)
            k_star, base, key_bits, unused = _key_choice(alpha, dsuf, pos, BP, nf, g, delta_all, rr, B, GS, TAU1, KMIN,
                                                         KMAX, KMAX1, THR1, KEY_TOL, BUDGET, G, BP, W,
                                                         PRECISE)  # fmt: skip
            tl.store(widened + pid, (k_star > base).to(tl.int8))
            tl.atomic_or(bits_row + order, key_bits, mask=(pos < k_star) & (order >= 0) & (order < nf) & (pos < B))
        else:  # only the first W positions can matter: K* ≤ ``policy.k_max_widened`` < W
            done = (nf < 0).to(tl.int32)  # 0
            if WS > 0:  # a first window of WS positions decides where K* falls inside it
                qs = tl.arange(0, WS)
                order_s, alpha_s, dsuf_s, cnt_s = _window_keys(mass, dl, delta, row, pos, qs, B, scratch + pid * 2 * W,
                                                               WS // 2, WS, BP, LOG2BP)  # fmt: skip
                k_star_s, base_s, key_bits_s, resolved = _key_choice(alpha_s, dsuf_s, qs, cnt_s, nf, g, delta_all, rr, B,
                                                                     GS, TAU1, KMIN, KMAX, KMAX1, THR1, KEY_TOL, BUDGET,
                                                                     G, BP, WS, PRECISE)  # fmt: skip
                done = resolved.to(tl.int32)
                if resolved:
                    tl.store(widened + pid, (k_star_s > base_s).to(tl.int8))
                    take_s = (qs < k_star_s) & (order_s >= 0) & (order_s < nf) & (qs < B)
                    tl.atomic_or(bits_row + order_s, key_bits_s, mask=take_s)
            if done == 0:
                q = tl.arange(0, W)
                order, alpha, dsuf, cnt = _window_keys(mass, dl, delta, row, pos, q, B, scratch + pid * 2 * W, LO, W,
                                                       BP, LOG2BP)  # fmt: skip
                k_star, base, key_bits, unused = _key_choice(alpha, dsuf, q, W, nf, g, delta_all, rr, B, GS, TAU1, KMIN,
                                                             KMAX, KMAX1, THR1, KEY_TOL, BUDGET, G, BP, W,
                                                             PRECISE)  # fmt: skip
                tl.store(widened + pid, (k_star > base).to(tl.int8))
                take = (q < k_star) & (order >= 0) & (order < nf) & (q < B)
                tl.atomic_or(bits_row + order, key_bits, mask=take)

        # ---- values: rung 2 (selection.select_values)
        if part != PARTS - 1:  # PARTS = 2, the keys' program
            pass
        elif SEARCH:
            vtake = _values_by_search(err, pos, nf, B, vbudget, VKMAX, BP, LOG2BP, PRECISE)
            tl.atomic_or(bits_row + pos, (pos * 0 + 1) << (G + g), mask=vtake)
        elif BP <= W:
            _promote_values_full(err, pos, B, nf, vbudget, VKMAX, bits_row, G + g, BP)
        else:
            vdone = (nf < 0).to(tl.int32)  # 0
            if WS > 0:
                qs = tl.arange(0, WS)
                vorder_s, count_s = _window_values(err, pos, qs, B, vbudget, VKMAX, scratch + (pid * 2 + 1) * W,
                                                   WS // 2, WS, BP, LOG2BP)  # fmt: skip
                vdone = (count_s >= 0).to(tl.int32)
                if count_s >= 0:
                    take_v_s = (qs < count_s) & (vorder_s >= 0) & (vorder_s < nf)
                    tl.atomic_or(bits_row + vorder_s, (qs * 0 + 1) << (G + g), mask=take_v_s)
            if vdone == 0:
                q = tl.arange(0, W)
                vorder, count = _window_values(err, pos, q, B, vbudget, VKMAX, scratch + (pid * 2 + 1) * W, LO, W, BP,
                                               LOG2BP)  # fmt: skip
                if count >= 0:
                    take_v = (q < count) & (vorder >= 0) & (vorder < nf)
                    tl.atomic_or(bits_row + vorder, (q * 0 + 1) << (G + g), mask=take_v)
                else:  # the greedy runs past the window (many blocks with large ρ̄·η): the full order, as the reference
                    _promote_values_full(err, pos, B, nf, vbudget, VKMAX, bits_row, G + g, BP)


def select_blocks(
    l8: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    rounding: torch.Tensor,
    nfull: torch.Tensor,
    eta: torch.Tensor,
    v_max: torch.Tensor,
    policy: LadderPolicy,
    window: int = WINDOW,
    active: torch.Tensor | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
    bits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rungs 0–2 selection for a layer call.

    Args:
        l8, delta: ``[R, K, G, B]`` float32 phase-1 block log-mass and Δ_b.
        lse: ``[R, K, G]`` float32 log of the total INT8 mass (full blocks and the partial one).
        rounding: ``[R, K, G]`` float32 R.
        nfull: ``[R]`` int64 full blocks per row.
        eta: ``[R, K, B]`` float32 η_b.
        v_max: ``[R, K]`` (or ``[R, K, 1]``) float32 V_max; rung 2's budget is ``policy.v_tol``·V_max /
            ``VALUE_BUDGET_MARGIN`` in float32, as ``selection.select_values`` computes it.
        policy: the ladder's parameters (exploration draws are the caller's).
        window: with ``tuning.select_search`` 0, how much of each sorted order is materialised when the table is
            wider (raised to the next power of two above ``policy.k_max_widened``); the greedy value promotion
            falls back to the full order inside the kernel if it needs more.
        active: ``[R, K]`` int32: the groups to select for (the others get no bits and no rung 1), or None (all).
        tuning: ``select_warps`` (warps per program), ``select_first_window`` (a smaller window tried first on
            the windowed path: where K* and rung 2's count fall inside it, the wide window's sorts are skipped) and
            ``select_parts`` (programs per query head; 0: :func:`select_parts`).
        bits: a zeroed ``[R, K, B]`` int32 buffer to OR the bits into (``prepare.CallState.bits``), or None (a new
            one: one more launch).

    Returns:
        ``bits`` ``[R, K, B]`` int32 (bit g: keys of block b promoted for query head g; bit G + g: its
        values) and ``widened`` ``[R, K, G]`` bool (rung 1 used; a view of the kernel's int8 flags, no copy).
    """
    launch_device_ok(l8)
    R, K, G, B = l8.shape
    if not supported(B):
        raise ValueError(f"select_blocks: {B} block-table columns, the kernel holds at most {MAX_BLOCKS}")
    if 2 * G > 31:
        raise ValueError(f"select_blocks: {G} query heads per KV head, at most 15 fit the int32 bitmask")
    parts = tuning.select_parts or select_parts(R * K * G)
    consts = select_launch_constants(B, K, G, policy.key_budget, policy.k_max_widened, window, active is not None,
                                     tuning, parts)  # fmt: skip
    w = consts["W"]
    if bits is None:
        bits = torch.zeros(R, K, B, dtype=torch.int32, device=l8.device)
    elif bits.shape != (R, K, B) or bits.dtype != torch.int32 or not bits.is_contiguous():
        raise ValueError(f"select_blocks: bits must be a contiguous zeroed [{R}, {K}, {B}] int32 tensor, got "
                         f"{bits.dtype} {tuple(bits.shape)}: pass prepare's CallState.bits or None")  # fmt: skip
    widened = (torch.empty if active is None else torch.zeros)(R, K, G, dtype=torch.int8, device=l8.device)
    windowed = consts["BP"] > w and not consts["SEARCH"]
    scratch = torch.empty(R * K * G * 2 * w if windowed else 1, dtype=torch.int64, device=l8.device)
    l8, lse, delta, rounding = l8.contiguous(), lse.contiguous(), delta.contiguous(), rounding.contiguous()
    eta, v_max = eta.contiguous(), v_max.contiguous()
    _select_kernel[(R * K * G, parts)](
        l8, lse, delta, rounding, nfull, eta, v_max, bits, widened, widened if active is None else active,
        scratch, B, GAMMA_SLACK, 1.0 - policy.tau_cov, policy.k_min, policy.k_max, policy.k_max_widened,
        policy.rung1_tail_threshold, policy.key_tol, policy.v_tol, VALUE_BUDGET_MARGIN, policy.value_k_max, **consts,
    )  # fmt: skip
    return bits, widened.view(torch.bool)  # the kernel stores 0 or 1


def select_parts(heads: int) -> int:
    """Programs per query head for a batch of ``heads`` (row, query head) selections: 2 (keys and values apart)
    while 2·heads programs leave each its own multiprocessor, else 1 (more programs than that would queue behind
    each other, so splitting a head's work would not shorten the launch)."""
    return 2 if 2 * heads <= multiprocessors() else 1


def select_launch_constants(num_blocks: int, num_kv_heads: int, group: int, key_budget: bool, k_max_widened: int,
                            window: int = WINDOW, use_active: bool = False,
                            tuning: KernelTuning = DEFAULT_TUNING, parts: int = 1) -> dict:  # fmt: skip
    """The compile-time arguments of :func:`_select_kernel` (constexprs and ``num_warps``) for a table of
    ``num_blocks`` columns and a ladder's rule (``LadderPolicy.key_budget``, ``.k_max_widened``), for its launch
    and for compiling it offline (``offline_compile``): the window ``W`` (``window`` raised to hold
    ``k_max_widened`` + 1 positions), the first window ``WS`` (``tuning.select_first_window`` where it is smaller
    than ``W``, else 0), the warps (``tuning.select_warps``, else 4, or BP/512 up to 16) and ``PARTS``
    (``parts``: programs per query head, :func:`select_parts`)."""
    if parts not in (1, 2):
        raise ValueError(f"select: parts={parts!r} must be 1 (keys and values in one program) or 2 (apart)")
    cls = width_class(num_blocks)
    w = max(next_pow2(window), next_pow2(k_max_widened + 1))
    return dict(
        BUDGET=key_budget, H=num_kv_heads, G=group, BP=cls.bp, W=w,
        WS=tuning.select_first_window if tuning.select_first_window < w else 0, LOG2BP=cls.log2bp,
        USE_ACTIVE=use_active, PRECISE=precise(), PARTS=parts, SEARCH=tuning.select_search,
        num_warps=tuning.select_warps or min(16, max(4, cls.bp // 512)),
    )  # fmt: skip
