"""Audit checks on the device: exact float64 attention of sampled (row, query head) pairs from the shadow, and
the verdict against what the certified call returned, in two launches and no host synchronisation.

What :func:`certvllm.attention.audit.reference_heads` and ``Auditor._check`` compute with some seventy torch
ops per audited call (each a launch from the layer call's thread), here in two kernels:

* ``_audit_partial_kernel``, grid ``(groups, S)``: a group is the checked pairs of one (row, KV head), at most one
  per query head of the KV head; its program reads the shadow pages (tier 2: pinned host memory read zero-copy
  over PCIe, or device memory) of that KV head once, block-table columns ``[s·C, (s+1)·C)`` cut at the row's
  length, and keeps in float64, per checked query head, an online softmax (running max ``m``, sum ``l``,
  weighted values ``acc``), the largest value norm and the largest score bound λΣ_c|q_c||k_tc| over the valid
  tokens. An audited row checks every query head, so one read of a KV head's pages serves its ``G`` heads (the
  pages over PCIe are a 1/G of one read per pair);
* ``_audit_verdict_kernel``, grid ``(n,)``: merges pair ``i``'s ``S`` partials into the exact output, compares it
  with the returned one and writes the verdict row.

Partial row ``[n, S, 4 + D]`` float64: ``m, l, v_max, s_max, acc[0:D]``. Verdict row ``[n, 10]`` float64 (every
integer below 2⁵³, exact): ``row, head, rung, error, allowed, ratio, violated, len, key_block, key_column``, the
order of ``AuditOutcome``. Pairs are checked sorted by (row, KV head); the verdict rows come back in the caller's
order. The allowance is the audit's: ``bound·BOUND_SUM_SLACK + F64_SLACK·v_max`` for rungs
0–2, ``v_max·(tol_a + tol_b·s_max)`` for rungs 3/4 (``exact_tolerance`` is affine in ``s_max``; the caller
passes its two coefficients).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_arg, launch_device_ok, load_shadow_tile, next_pow2
from .shape_class import JIT_OPTIONS

VERDICT_COLUMNS = ("row", "head", "rung", "error", "allowed", "ratio", "violated", "len", "key_block", "key_column")
COLUMNS_PER_SPLIT = 16
"""Block-table columns (16-token blocks) one partial program reads: 256 tokens, so that a pair's PCIe reads are
spread over many programs in flight."""
MERGE_CHUNK = 16
"""Partials merged per iteration of the verdict kernel."""
HEADS_PER_GROUP = 4
"""Query heads one partial program checks at most (a GQA group of 8 is read as two groups of 4): with 16 warps, a
[4, 16, 128] float64 product fits 128 registers per thread with 16 bytes spilled (sm_90, Triton 3.6, offline);
8 heads spill 536 bytes."""
PARTIAL_BYTES = 64 << 20
"""Largest partials buffer of one launch (pairs are checked in chunks that fit it)."""


@triton.jit(**JIT_OPTIONS)
def _audit_partial_kernel(
    src,  # shadow [E, H, 2, M*16, D] (float16/bfloat16), host-pinned or device
    partial,  # [n, S, 4 + D] float64, row p − PSTART for the sorted pair p
    groups,  # [n_groups, 2 + GP] int64: row·H + KV head, its first query head g0, then per query head g0 + j the
    #         sorted pair p or −1
    q,  # [R, HQ, D] queries (any float dtype, contiguous)
    tables,  # [R, B] int block ids (last dim contiguous)
    TB_STRIDE,  # its row stride
    lens,  # [R] int context lengths (contiguous)
    consts,  # [6] float64: scale, tol_a, tol_b, bound_slack, f64_slack, padding
    num_blocks,  # 16-token blocks of the cache (ids are clamped into [0, num_blocks))
    B,  # block-table width
    S,  # partials per pair
    GSTART,  # this launch's first group
    PSTART,  # the sorted position of its first pair
    HQ: tl.constexpr,
    G: tl.constexpr,  # query heads, query heads per KV head
    GP: tl.constexpr,  # query heads per group: next power of two ≥ G, at most HEADS_PER_GROUP
    H: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
    C: tl.constexpr,  # columns per partial
):
    i = GSTART + tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    entry = groups + i * (2 + GP)
    rk = tl.load(entry)
    row = rk // H
    kvh = rk % H
    g = tl.load(entry + 1) + tl.arange(0, GP)
    slot = tl.load(entry + 2 + tl.arange(0, GP))  # [GP] sorted pair of query head g, −1: not checked
    have = slot >= 0
    length = tl.minimum(tl.load(lens + row).to(tl.int64), B * 16)
    c_lo = s * C
    c_hi = tl.minimum(c_lo + C, (length + 15) // 16)
    d = tl.arange(0, DP)
    t = tl.arange(0, 16)
    qrow = row * HQ + kvh * G + g
    qv = tl.load(q + qrow[:, None] * D + d[None, :], mask=have[:, None] & (d[None, :] < D), other=0.0).to(tl.float64)
    qa = tl.abs(qv)  # [GP, DP]
    sc64 = tl.load(consts)
    m = tl.full((GP,), float("-inf"), tl.float64)
    l_sum = tl.zeros((GP,), tl.float64)
    v_max = tl.zeros((), tl.float64)
    s_max = tl.zeros((GP,), tl.float64)
    acc = tl.zeros((GP, DP), tl.float64)
    for c in range(c_lo, c_hi):
        bid = tl.load(tables + row * TB_STRIDE + c).to(tl.int64)
        bid = tl.minimum(tl.maximum(bid, 0), num_blocks - 1)
        k = load_shadow_tile(src, bid, kvh, 0, H, M, D, DP, CHANNEL_MAJOR).to(tl.float64)
        valid = c * 16 + t < length
        v = load_shadow_tile(src, bid, kvh, 1, H, M, D, DP, CHANNEL_MAJOR).to(tl.float64)
        v = tl.where(valid[:, None], v, 0.0)  # free slots past the length may hold anything, NaN included
        score = tl.where(valid[None, :], tl.sum(k[None, :, :] * qv[:, None, :], axis=2) * sc64, float("-inf"))
        lam = tl.sum(tl.abs(k)[None, :, :] * qa[:, None, :], axis=2) * tl.abs(sc64)  # [GP, 16]
        s_max = tl.maximum(s_max, tl.max(tl.where(valid[None, :], lam, 0.0), axis=1))
        v_max = tl.maximum(v_max, tl.max(tl.where(valid, tl.sqrt(tl.sum(v * v, axis=1)), 0.0)))
        m_new = tl.maximum(m, tl.max(score, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new[:, None])  # [GP, 16]
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    base = partial + ((slot - PSTART) * S + s) * (4 + D)  # [GP]
    tl.store(base, m, mask=have)
    tl.store(base + 1, l_sum, mask=have)
    tl.store(base + 2, v_max + tl.zeros((GP,), tl.float64), mask=have)
    tl.store(base + 3, s_max, mask=have)
    tl.store(base[:, None] + 4 + d[None, :], acc, mask=have[:, None] & (d[None, :] < D))


@triton.jit(**JIT_OPTIONS)
def _audit_verdict_kernel(
    partial,  # [n, S, 4 + D] float64: this launch's pairs' partials
    verdict,  # [n, 10] float64, in the sorted order
    pairs,  # [n] int64 sorted pairs
    out,  # [R, HQ, D] float32 returned outputs (contiguous)
    rung,  # [R, HQ] int8 (contiguous)
    bound,  # [R, HQ] float32 E_key + E_val (contiguous)
    tables,  # [R, B] int block ids
    TB_STRIDE,  # its row stride
    lens,  # [R] int
    B,
    S,
    consts,  # [5] float64: scale, then rungs 3/4 allowed = v_max·(tol_a + tol_b·s_max), then rungs 0–2
    #          allowed = bound·bound_slack + f64_slack·v_max
    PSTART,  # this launch's first sorted pair (partial row 0)
    HQ: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    RUNG_VALUES: tl.constexpr,
    CHUNK: tl.constexpr,
):
    li = tl.program_id(0).to(tl.int64)
    i = PSTART + li
    flat = tl.load(pairs + i)
    row = flat // HQ
    head = flat % HQ
    d = tl.arange(0, DP)
    j = tl.arange(0, CHUNK)
    m = tl.full((), float("-inf"), tl.float64)
    for c0 in range(0, S, CHUNK):  # the largest running max over every partial
        ok = c0 + j < S
        m = tl.maximum(m, tl.max(tl.load(partial + (li * S + c0 + j) * (4 + D), mask=ok, other=float("-inf"))))
    l_sum = tl.zeros((), tl.float64)
    v_max = tl.zeros((), tl.float64)
    s_max = tl.zeros((), tl.float64)
    acc = tl.zeros((DP,), tl.float64)
    for c0 in range(0, S, CHUNK):
        ok = c0 + j < S
        at = partial + (li * S + c0 + j) * (4 + D)
        mj = tl.load(at, mask=ok, other=float("-inf"))
        w = tl.where(mj > float("-inf"), tl.exp(mj - m), 0.0)  # empty partials (m = −inf) weigh nothing
        l_sum += tl.sum(w * tl.load(at + 1, mask=ok, other=0.0))
        v_max = tl.maximum(v_max, tl.max(tl.load(at + 2, mask=ok, other=0.0)))
        s_max = tl.maximum(s_max, tl.max(tl.load(at + 3, mask=ok, other=0.0)))
        a = tl.load(at[:, None] + 4 + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    exact = acc / l_sum
    returned = tl.load(out + flat * D + d, mask=d < D, other=0.0).to(tl.float64)
    diff = tl.where(d < D, returned - exact, 0.0)
    error = tl.sqrt(tl.sum(diff * diff))
    r = tl.load(rung + flat).to(tl.int64)
    b = tl.load(bound + flat).to(tl.float64)
    tol_a, tol_b = tl.load(consts + 1), tl.load(consts + 2)
    bound_slack, f64_slack = tl.load(consts + 3), tl.load(consts + 4)
    allowed = tl.where(r <= RUNG_VALUES, b * bound_slack + f64_slack * v_max, v_max * (tol_a + tol_b * s_max))
    violated = ~(error <= allowed)  # NaN errors are violations
    ratio = tl.where(allowed > 0, error / allowed, tl.where(error > 0, float("inf"), 0.0))
    ratio = tl.where(error != error, float("inf"), ratio)
    length = tl.load(lens + row).to(tl.int64)
    column = (length - 1) // 16
    key_block = tl.load(tables + row * TB_STRIDE + tl.minimum(tl.maximum(column, 0), B - 1)).to(tl.int64)
    o = verdict + i * 10
    tl.store(o, row.to(tl.float64))
    tl.store(o + 1, head.to(tl.float64))
    tl.store(o + 2, r.to(tl.float64))
    tl.store(o + 3, error)
    tl.store(o + 4, allowed)
    tl.store(o + 5, ratio)
    tl.store(o + 6, violated.to(tl.float64))
    tl.store(o + 7, length.to(tl.float64))
    tl.store(o + 8, key_block.to(tl.float64))
    tl.store(o + 9, column.to(tl.float64))


def group_pairs(pairs: list[int], per: int, gp: int) -> tuple[list[int], list[list[int]]]:
    """The checked pairs (``row·H_q + head``) sorted by (row, KV head, query head), and the groups the partial
    kernel reads: per (row, KV head) and run of ``gp`` of its ``per`` query heads, ``[row·H_kv + KV head, g0,
    p_0 … p_{gp−1}]`` with ``p_j`` the sorted position of query head ``g0 + j``'s pair, −1 where that head is not
    checked. A pair listed twice opens a second group. Returns ``(order, groups)``: ``order[p]`` is the caller's
    index of the ``p``-th sorted pair; each group's pairs are consecutive in that order."""
    order = sorted(range(len(pairs)), key=lambda j: (pairs[j], j))
    groups: list[list[int]] = []
    for p, j in enumerate(order):
        key, g = divmod(pairs[j], per)
        g0, at = g - g % gp, 2 + g % gp
        if not groups or groups[-1][:2] != [key, g0] or groups[-1][at] >= 0:
            groups.append([key, g0] + [-1] * gp)
        groups[-1][at] = p
    return order, groups


def audit_check(
    shadow: torch.Tensor,
    pairs: list[int],
    q: torch.Tensor,
    out: torch.Tensor,
    rung: torch.Tensor,
    bound: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    *,
    num_kv_heads: int,
    num_blocks: int,
    channel_major: bool,
    tol_a: float,
    tol_b: float,
    bound_slack: float,
    f64_slack: float,
    rung_values: int,
    heads_per_group: int = HEADS_PER_GROUP,
) -> torch.Tensor:
    """The audit's verdicts on the (row, head) pairs ``pairs`` of one call, queued on the current stream of
    ``q``'s device (nothing is read on the host; one host-to-device copy, from pinned memory, two launches).

    Args:
        shadow: ``[E, H_kv, 2, m·16, D]`` float16/bfloat16 (pinned host memory readable by the device, or device
            memory); pairs: host list of ``row·H_q + head``; q ``[R, H_q, D]``; out ``[R, H_q, D]`` float32 (the
            call's returned output); rung ``[R, H_q]`` int8 and bound ``[R, H_q]`` float32 (its report);
            tables ``[R, W]`` int; lens ``[R]`` int; scale the softmax scale (used in float64).
        num_kv_heads, num_blocks, channel_major: the cache's (keys stored ``[D, m·16]`` when ``channel_major``).
        tol_a, tol_b: rungs 3/4 allow ``v_max·(tol_a + tol_b·s_max)``; bound_slack, f64_slack: rungs 0–2 allow
            ``bound·bound_slack + f64_slack·v_max``; rung_values: the last rung judged by the certificate.
        heads_per_group: query heads of one KV head that one partial program checks (a power of two ≤
            ``HEADS_PER_GROUP``; 1 reads a KV head's pages once per checked pair, for ``bench_audit_check.py``'s A/B).

    Returns:
        ``verdict [n, 10]`` float64 (:data:`VERDICT_COLUMNS`) on the device.
    """
    n = len(pairs)
    R, hq, d = q.shape
    W = tables.shape[1]
    dev = q.device
    g_per = hq // num_kv_heads
    if not 1 <= heads_per_group <= HEADS_PER_GROUP or heads_per_group & (heads_per_group - 1):
        raise ValueError(f"audit_check: heads_per_group={heads_per_group} must be a power of two in [1, "
                         f"{HEADS_PER_GROUP}]; pass the default ({HEADS_PER_GROUP})")  # fmt: skip
    gp = min(next_pow2(g_per), heads_per_group)
    order, table = group_pairs(pairs, g_per, gp)
    # the float64 constants (as their bit patterns, padded to 48 bytes so that what follows stays 16-byte aligned:
    # one compiled variant whatever n), the sorted pairs, the groups and the way back to the caller's order travel
    # in one copy
    consts = torch.tensor([scale, tol_a, tol_b, bound_slack, f64_slack, 0.0], dtype=torch.float64).view(torch.int64)
    back = [0] * n
    for p, j in enumerate(order):
        back[j] = p
    sorted_pairs = [pairs[j] for j in order]
    host = torch.cat([consts, torch.tensor(sorted_pairs + back, dtype=torch.int64),
                      torch.tensor(table, dtype=torch.int64).flatten()])  # fmt: skip
    staged = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.to(dev)
    consts_d, pairs_d, back_d = staged[:6].view(torch.float64), staged[6 : 6 + n], staged[6 + n : 6 + 2 * n]
    groups_d = staged[6 + 2 * n :]
    verdict = torch.empty(n, len(VERDICT_COLUMNS), dtype=torch.float64, device=dev)
    if n == 0:
        return verdict
    launch_device_ok(verdict)
    q, out, rung, bound, lens = (t.contiguous() for t in (q, out, rung, bound, lens))
    tables = tables if tables.stride(-1) == 1 else tables.contiguous()
    splits = max(1, triton.cdiv(W, COLUMNS_PER_SPLIT))
    # pairs per launch: the partials stay within PARTIAL_BYTES (an audit of every head-step of a large batch at 128K
    # would otherwise allocate gigabytes), and a launch takes whole groups (at least one)
    cap = max(gp, PARTIAL_BYTES // (splits * (4 + d) * 8))
    partial = torch.empty(min(n, cap), splits, 4 + d, dtype=torch.float64, device=dev)
    _, h, _, mn, _ = shadow.shape
    dp = next_pow2(d)
    # group k holds the sorted pairs [firsts[k], ends[k])
    firsts = [min(slot for slot in entry[2:] if slot >= 0) for entry in table]
    ends = firsts[1:] + [n]
    g0 = 0
    while g0 < len(table):  # stream-ordered: each launch's verdict kernel reads the partials before the next
        p0, g1 = firsts[g0], g0 + 1
        while g1 < len(table) and ends[g1] - p0 <= cap:
            g1 += 1
        p1 = ends[g1 - 1]
        _audit_partial_kernel[(g1 - g0, splits)](
            device_arg(shadow), partial, groups_d, q, tables, tables.stride(0), lens, consts_d, int(num_blocks), W,
            splits, g0, p0,
            HQ=hq, G=g_per, GP=gp, H=h, M=mn // 16, D=d, DP=dp, CHANNEL_MAJOR=channel_major, C=COLUMNS_PER_SPLIT,
            num_warps=16,
        )  # fmt: skip
        _audit_verdict_kernel[(p1 - p0,)](
            partial, verdict, pairs_d, out, rung, bound, tables, tables.stride(0), lens, W, splits, consts_d, p0,
            HQ=hq, D=d, DP=dp, RUNG_VALUES=rung_values, CHUNK=MERGE_CHUNK, num_warps=4,
        )  # fmt: skip
        g0 = g1
    if order != list(range(n)):
        verdict = verdict[back_d]  # the caller's order
    return verdict
