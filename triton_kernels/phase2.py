"""Phase 2: promotion pass and attend pass, split over the sequence (split-K), zero-copy page-in.

Selection hands the kernels one int32 bitmask per (row, KV head, block): bit g = keys of query head g
promoted, bit G + g = its values promoted. Promoted pages are read straight from the pinned host
shadow through its device address (no staging buffer, no host synchronisation); everything else comes
from the tier-1 page and the phase-1 scores.

* :func:`promote` — for every block of the union it loads the unquantized keys, computes exact scores
  (D-term float32 reductions), runs the canary against the INT8 scores (rung 4), writes the exact scores
  over the INT8 ones where the head promoted the keys, and reduces per split the maximum phase-2 score
  and the largest |exact score|.
* :func:`attend` — with the global maximum m per head, w = exp(s − m) in float32 (libdevice ``expf``),
  per block den_b = Σ w (16 terms, float32) and num_b = Σ w·Ṽ (16-term float32 dot products, INT4 values
  dequantized in registers or unquantized values read zero-copy), then **float64** accumulation across
  blocks and splits: the summation structure the certificate assumes (docs/certification.md §5), so no
  new γ is needed. Alongside it accumulates Σ den_b·η_b over INT4-value blocks (E_val), Σ den_b over
  INT8-key blocks (the tail mass) and writes m + log den_b of key-promoted blocks (the rank test).

Programs of an (row, KV head) group whose ``active`` flag is 0 do nothing and write nothing (their outputs
are left as allocated): the exact-only re-run used for rungs 3/4 on the device sets it for the escalated
groups only, and reads back only those.

The promotion pass scans the bitmasks ``PB`` blocks at a time, listing each split's needed blocks in ascending order
with their key pages' sources (table entry and pool slot resolved in the scan; a scratch list per program, 16 bytes
per block column), then visits the listed blocks only, one per iteration, scoring a block's 16 tokens one query head
at a time while the next block's page is in flight (pipelined by hand: no load waits on another issued in the same
iteration). The attend pass takes ``BLK`` blocks per iteration ([BLK, 16, ·] tiles, the tokens of a block in
registers); on CUDA Hopper its CUDA C++ version (``attend_cuda``: ``cp.async`` page streaming, the same
sums and bounds) runs where it builds and supports the shape, otherwise this Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from certvllm.formats.layout import PageLayout

from .common import (
    device_arg,
    exp_f32,
    launch_device_ok,
    next_pow2,
    page_base,
    precise,
    split_columns,
    split_program,
    store_split_sums,
)
from .shape_class import JIT_OPTIONS
from .tuning import DEFAULT_TUNING, KernelTuning


@triton.jit
def _load_key_page(shadow, pool, stage, nslots, src, mask, n, d, N: tl.constexpr, D: tl.constexpr,
                   M: tl.constexpr, CHANNEL_MAJOR: tl.constexpr, USE_POOL: tl.constexpr):  # fmt: skip
    """One block's [N, DP] key page (shadow dtype) from its listed source: ``src`` ≥ 0 the page's offset in the
    shadow in units of N elements (channel-major or token-major as stored), < 0 slot −1 − src of the pool (slots
    ≥ ``nslots``: the step prefetch's staging pages), token-major. Every base is a multiple of N elements and the
    token-major strides are constants, so the loads are 16-byte vectors. Masked-off lanes are not read."""
    ptr = shadow + src * N
    if USE_POOL:
        ks = -1 - src
        ptr = tl.where(ks >= nslots, stage + (ks - nslots) * (N * D), tl.where(src < 0, pool + ks * (N * D), ptr))
    if CHANNEL_MAJOR:
        sn = 1
        sd = M * N
        if USE_POOL:
            sn = tl.where(src < 0, D, sn)
            sd = tl.where(src < 0, 1, sd)
        offs = n[:, None] * sn + d[None, :] * sd
    else:
        offs = n[:, None] * D + d[None, :]
    return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _score_block(kt, bb, b, rk, r, q, r1, g, gm, n, scores, delta, canary, run_max, run_abs, B, G: tl.constexpr,
                 GP: tl.constexpr, N: tl.constexpr, CANARY: tl.constexpr):  # fmt: skip
    """One listed block of the promotion pass: its exact-key scores from the key page ``kt`` [N, DP], the canary,
    the scores written where bitmask word ``bb`` promotes the keys, and the running maxima returned."""
    kb = (((bb >> g) & 1) != 0) & gm
    srow = ((rk * B + b) * G + g[:, None]) * N + n[None, :]
    if CANARY:
        s8 = tl.load(scores + srow, mask=gm[:, None], other=0.0)
        dl = tl.load(delta + (rk * G + g) * B + b, mask=gm, other=0.0)
    ktf = kt.to(tl.float32)
    # the exact-key scores [GP, N], one query head at a time: [N, DP] products rather than one [GP, N, DP] tile,
    # which took 96 registers against 64 in the unpipelined pass and twice its time where it waits on latency
    se = tl.zeros([GP, N], tl.float32)
    for gg in tl.static_range(G):
        qg = tl.sum(tl.where(g[:, None] == gg, q, 0.0), axis=0)  # [DP] query head gg (the others add 0)
        se = tl.where(g[:, None] == gg, tl.sum(ktf * qg[None, :], axis=1)[None, :], se)
    if CANARY:
        allowed = (dl + 2.0 * r1) * (1.0 + 2.0**-10)
        diff = tl.abs(se - s8)
        viol = ((diff > allowed[:, None]) | ~(diff < float("inf"))) & gm[:, None]
        nviol = tl.sum(tl.sum(viol.to(tl.int32), axis=1), axis=0)
        tl.atomic_max(canary + r, (nviol > 0).to(tl.int32))
    tl.store(scores + srow, se, mask=kb[:, None])
    run_max = tl.maximum(run_max, tl.where(kb, tl.max(se, axis=1), float("-inf")))
    sa = tl.max(tl.where(tl.abs(se) < float("inf"), tl.abs(se), 0.0), axis=1)
    run_abs = tl.maximum(run_abs, tl.where(kb, sa, 0.0))
    return run_max, run_abs


@triton.jit(**JIT_OPTIONS)
def _promote_kernel(
    qs,  # [R, H_q, D] float32 scaled queries
    shadow,  # [E, H_kv, 2, m·N, D] float16/bfloat16 originals (pinned host, read through its device address)
    tables,  # [R, ≥B] int64 block ids (row stride TB_STRIDE)
    nfull,  # [R] int64 full blocks per row
    bits,  # [R, H_kv, B] int32 promotion bitmask (bit g keys, bit G+g values)
    active,  # [R, H_kv] int32: 0 = skip this group
    scores,  # in/out [R, H_kv, B, G, N] float32: INT8 scores in, phase-2 scores out
    m8,  # [R, H_kv, G, B] float32 block max of the INT8 scores
    delta,  # [R, H_kv, G, B] float32 Δ_b
    round1,  # [R, H_kv, G] float32 phase-1 rounding R (canary tolerance)
    canary,  # out [R] int32, set to 1 when a promoted block breaks |s − s̃⁸| ≤ Δ_b + 2R
    smax,  # out [R, H_kv, G, S] float32 per-split max phase-2 score
    sabs,  # out [R, H_kv, G, S] float32 per-split max finite |exact score| on key-promoted blocks
    pool,  # [P, N, D] promotion-cache key pages (device; read when USE_POOL and the slot is ≥ 0)
    kslot,  # [R, H_kv, B] int32 pool slot of each needed key page, −1: read the shadow (USE_POOL only)
    stage,  # [Q, N, D] prefetched key pages (device): slot nslots + i reads stage[i] (USE_POOL only)
    nslots,  # pool slots: kslot values ≥ nslots index the staging pages
    needed,  # scratch [R·H_kv·S, 2·BPS] int64: the split's needed blocks listed by the scan (entry, source)
    num_blocks, B, TB_STRIDE, S, BPS,  # the split-K arguments (``common``)
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, M: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,  # shadow keys stored [D, m·N] (the CPU layout)
    CANARY: tl.constexpr,  # run the canary (loads keys of value-only promoted blocks too)
    PB: tl.constexpr,  # blocks per tile of the bitmask scan
    USE_POOL: tl.constexpr,  # read key pages from the promotion cache where kslot ≥ 0
):  # fmt: skip
    N: tl.constexpr = 16
    rk, split, r, h = split_program(H)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    n = tl.arange(0, N)
    gm = g < G
    dm = d < D
    act = tl.load(active + rk)
    if act == 0:  # an inactive group (most of a re-run's): the maxima of no block, before any other load
        tl.store(smax + (rk * G + g) * S + split, tl.full([GP], float("-inf"), tl.float32), mask=gm)
        tl.store(sabs + (rk * G + g) * S + split, tl.zeros([GP], tl.float32), mask=gm)
        return
    n_tiles = tl.cdiv(BPS, PB)
    q = tl.load(qs + (r * (H * G) + h * G + g[:, None]) * D + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    r1 = tl.load(round1 + rk * G + g, mask=gm, other=0.0)
    nf = tl.load(nfull + r)
    run_max = tl.full([GP], float("-inf"), tl.float32)
    run_abs = tl.zeros([GP], tl.float32)
    key_bits = (1 << G) - 1
    tl.static_assert(PB <= 64, "PB: a tile's needed blocks are the bits of one int64")
    jt = tl.arange(0, PB)
    listed = needed + (rk * S + split) * (2 * BPS)
    count = 0
    for t in range(0, n_tiles):
        # PB blocks at once: bitmasks and INT8 block maxima (the common case: nothing promoted)
        it = t * PB + jt
        bt = split * BPS + it
        vt = (bt < B) & (it < BPS) & (bt < nf)
        bbt = tl.load(bits + rk * B + bt, mask=vt, other=0)  # [PB]
        kbt = (((bbt[None, :] >> g[:, None]) & 1) != 0) & gm[:, None]  # [GP, PB]
        m8t = tl.load(m8 + (rk * G + g[:, None]) * B + bt[None, :], mask=vt[None, :] & gm[:, None], other=float("-inf"))
        run_max = tl.maximum(run_max, tl.max(tl.where(kbt, float("-inf"), m8t), axis=1))
        if CANARY:
            need_t = bbt != 0
        else:
            need_t = (bbt & key_bits) != 0
        slot = tl.cumsum(need_t.to(tl.int32), axis=0) - 1
        # the needed blocks' key-page sources, resolved here for the whole tile at once (independent loads), so
        # the visit loop waits on no table or slot lookup: ≥ 0 a shadow offset in units of N elements, < 0 pool
        # or staging slot −1 − source; listed as (bits · 2³² + in-split position, source) pairs after the earlier
        # tiles', ascending
        bid = tl.load(tables + r * TB_STRIDE + bt, mask=need_t, other=0)
        bid = tl.minimum(tl.maximum(bid, 0), num_blocks - 1)
        src_t = (((bid // M) * H + h) * 2) * (M * D) + (bid % M) * (1 if CHANNEL_MAJOR else D)  # units of N
        if USE_POOL:
            kst = tl.load(kslot + rk * B + bt, mask=need_t, other=-1).to(tl.int64)
            src_t = tl.where(kst >= 0, -1 - kst, src_t)
        entry_t = it.to(tl.int64) + (bbt.to(tl.int64) << 32)  # 0 ≤ position < 2³¹
        tl.store(listed + 2 * (count + slot), entry_t, mask=need_t)
        tl.store(listed + 2 * (count + slot) + 1, src_t, mask=need_t)
        count += tl.sum(need_t.to(tl.int32), axis=0)
    tl.debug_barrier()  # the list written by this program's threads is read by all of them
    # The needed blocks, one per iteration, software-pipelined by hand: iteration i scores block i's key page
    # (loaded during iteration i − 1), issues the load of block i + 1's page (its source listed at i − 1) and
    # loads the list entries of block i + 2, so no load is used in the iteration that issues it (the unpipelined
    # loop it replaced waited on four dependent loads per block and gave the same scores bit for bit). Pages past
    # the list are masked off (no read, over PCIe least of all).
    cnt_v = n * 0 + count  # [N]: the count as a vector (masks built from it, not from a scalar)
    e1 = tl.load(listed + 2, mask=count > 1, other=0)
    s1 = tl.load(listed + 3, mask=count > 1, other=0)
    e0 = tl.load(listed, mask=count > 0, other=0)
    s0 = tl.load(listed + 1, mask=count > 0, other=0)
    kt = _load_key_page(shadow, pool, stage, nslots, s0, (n * 0 < cnt_v)[:, None] & dm[None, :], n, d,
                        N, D, M, CHANNEL_MAJOR, USE_POOL)  # fmt: skip
    for i in tl.range(0, count, num_stages=1):  # pipelined by hand (above), not by the compiler
        # list entries of block i + 2 (this program's own stores: L1/L2; the last entry past the list's end),
        # used in the next iteration
        nxt = tl.minimum(i + 2, count - 1)
        e2 = tl.load(listed + 2 * nxt)
        s2 = tl.load(listed + 2 * nxt + 1)
        # block i + 1's key page, issued now and used in the next iteration
        kt_next = _load_key_page(shadow, pool, stage, nslots, s1,
                                 (n * 0 + i + 1 < cnt_v)[:, None] & dm[None, :], n, d, N, D, M, CHANNEL_MAJOR,
                                 USE_POOL)  # fmt: skip
        bb64 = e0 >> 32
        b = split * BPS + (e0 - (bb64 << 32))
        run_max, run_abs = _score_block(kt, bb64.to(tl.int32), b, rk, r, q, r1, g, gm, n, scores, delta, canary,
                                        run_max, run_abs, B, G, GP, N, CANARY)  # fmt: skip
        kt = kt_next
        e0 = e1
        e1 = e2
        s1 = s2
    tl.store(smax + (rk * G + g) * S + split, run_max, mask=gm)
    tl.store(sabs + (rk * G + g) * S + split, run_abs, mask=gm)


@triton.jit(**JIT_OPTIONS)
def _attend_kernel(
    scores,  # [R, H_kv, B, G, N] float32 phase-2 scores
    mmax,  # [R, H_kv, G] float32 global max score m per query head
    shadow,  # [E, H_kv, 2, m·N, D] originals (pinned host; values token-major)
    pages_u8,  # cache.pages as uint8
    pages_f16,  # as float16 (value scales and zeros)
    pages_f32,  # as float32 (η)
    tables,  # [R, ≥B] int64 block ids
    nfull,  # [R] int64 full blocks per row
    bits,  # [R, H_kv, B] int32 promotion bitmask
    active,  # [R, H_kv] int32: 0 = skip this group
    acc,  # out [R, H_kv, S, G, D] float64 Σ_b num_b
    den,  # out [R, H_kv, S, G] float64 Σ_b den_b
    aval,  # out [R, H_kv, S, G] float64 Σ den_b·η_b over INT4-value blocks
    atail,  # out [R, H_kv, S, G] float64 Σ den_b over INT8-key blocks
    exact_lm,  # out [R, H_kv, G, B] float32 m + log den_b on key-promoted blocks (others untouched)
    num_blocks, B, TB_STRIDE, S, BPS,  # the split-K arguments (``common``)
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, M: tl.constexpr,
    GRP: tl.constexpr,  # value group size g
    NG: tl.constexpr,  # value groups per token
    BLK: tl.constexpr,  # blocks per loop iteration (power of two)
    PAGE_BYTES: tl.constexpr,  # page size
    V_CODES: tl.constexpr,  # byte offsets of the value fields
    V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr,
    HEADER: tl.constexpr,
    PRECISE: tl.constexpr,  # libdevice expf (compiled) / NumPy exp (interpreter)
):  # fmt: skip
    # Tiles [BLK, N, DP/2] over the value bytes (blocks, tokens, byte k = channels 2k and 2k+1): the 16 tokens
    # of a block sit in each thread's registers, so den_b and num_b (16-term float32 sums over the block's
    # tokens) need no data exchange; even and odd channels (low and high nibbles) are kept as two tiles.
    # Per query head g the block sums are converted to float64 and added into [BLK, GP, ·] accumulators
    # (row g only: the other rows add an exact 0), reduced over BLK once at the end.
    N: tl.constexpr = 16
    DH: tl.constexpr = DP // 2
    rk, split, r, h = split_program(H)
    kk = tl.arange(0, DH)
    k2 = kk % 2 + (kk // 2) * 2  # = kk, seen by the compiler as runs of 2 bytes
    kv = k2[None, None, :]  # [1, 1, DH]
    km = kv < D // 2
    nv = tl.arange(0, N)[None, :, None]  # [1, N, 1]
    jv = tl.arange(0, BLK)[:, None, None]  # [BLK, 1, 1]
    gv = tl.arange(0, GP)[None, :, None]  # [1, GP, 1]
    act = tl.load(active + rk)
    n_iter = tl.where(act != 0, tl.cdiv(BPS, BLK), 0)
    nf = tl.load(nfull + r)
    acc_e = tl.zeros([BLK, GP, DH], tl.float64)
    acc_o = tl.zeros([BLK, GP, DH], tl.float64)
    den64 = tl.zeros([BLK, GP, 1], tl.float64)
    av64 = tl.zeros([BLK, GP, 1], tl.float64)
    at64 = tl.zeros([BLK, GP, 1], tl.float64)
    for it in range(0, n_iter):
        bv, _, valid = split_columns(it, jv, split, BPS, B, nf, BLK)  # [BLK, 1, 1]
        bb = tl.load(bits + rk * B + bv, mask=valid, other=0)
        bid, base = page_base(tables, r, TB_STRIDE, bv, valid, num_blocks, h, H, M, PAGE_BYTES)  # [BLK, 1, 1]
        eta_b = tl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0).to(tl.float64)
        vm = valid & km
        anyv = tl.max(tl.max(tl.max(bb >> G, axis=2), axis=1), axis=0) != 0
        # unquantized values of value-promoted blocks, zero-copy from the shadow (rare: only if any)
        f_e = tl.zeros([BLK, N, DH], tl.float32)
        f_o = tl.zeros([BLK, N, DH], tl.float32)
        if anyv:
            vbase = (((bid // M) * H + h) * 2 + 1) * (M * N * D) + (bid % M) * (N * D)
            vrow = shadow + vbase + nv * D + 2 * kv
            vsel = valid & (((bb >> G) & ((1 << G) - 1)) != 0) & km
            f_e = tl.load(vrow, mask=vsel, other=0.0).to(tl.float32)
            f_o = tl.load(vrow + 1, mask=vsel, other=0.0).to(tl.float32)
        # scales and zeros: one [BLK, N, NG] load each, expanded to the channel pairs of each group
        gi = tl.arange(0, NG)[None, None, :]
        gm_ = valid & (gi < NG)
        vsc = tl.load(pages_f16 + (base + V_SCALE) // 2 + nv * NG + gi, mask=gm_, other=0.0).to(tl.float32)
        vze = tl.load(pages_f16 + (base + V_ZERO) // 2 + nv * NG + gi, mask=gm_, other=0.0).to(tl.float32)
        vsc = tl.reshape(tl.broadcast_to(vsc[:, :, :, None], [BLK, N, NG, GRP // 2]), [BLK, N, DH])
        vze = tl.reshape(tl.broadcast_to(vze[:, :, :, None], [BLK, N, NG, GRP // 2]), [BLK, N, DH])
        # the value codes last: the layout of the last large load decides the layout of the arithmetic
        byte = tl.load((pages_u8 + base + V_CODES) + (nv * (D // 2) + kv), mask=vm, other=0).to(tl.int32)
        v_e = vze + (byte & 15).to(tl.float32) * vsc  # [BLK, N, DH] channels 2k
        v_o = vze + (byte >> 4).to(tl.float32) * vsc  # channels 2k + 1
        # per query head: the block sums, gathered into [BLK, GP, ·] tiles (row g only), then converted to
        # float64 and accumulated once per iteration
        ne_all = tl.zeros([BLK, GP, DH], tl.float32)
        no_all = tl.zeros([BLK, GP, DH], tl.float32)
        den_all = tl.zeros([BLK, GP, 1], tl.float32)
        for g in tl.static_range(G):
            mg = tl.load(mmax + rk * G + g)
            s = tl.load(scores + ((rk * B + bv) * G + g) * N + nv, mask=valid, other=float("-inf"))  # [BLK, N, 1]
            w = exp_f32(s - mg, PRECISE)
            den_b = tl.sum(w, axis=1, keep_dims=True)  # [BLK, 1, 1]
            num_e = tl.sum(w * v_e, axis=1, keep_dims=True)  # [BLK, 1, DH]
            num_o = tl.sum(w * v_o, axis=1, keep_dims=True)
            if anyv:
                vb = ((bb >> (G + g)) & 1) != 0
                num_e = tl.where(vb, tl.sum(w * f_e, axis=1, keep_dims=True), num_e)
                num_o = tl.where(vb, tl.sum(w * f_o, axis=1, keep_dims=True), num_o)
            rowg = gv == g
            ne_all = tl.where(rowg, num_e, ne_all)
            no_all = tl.where(rowg, num_o, no_all)
            den_all = tl.where(rowg, den_b, den_all)
        acc_e += ne_all.to(tl.float64)
        acc_o += no_all.to(tl.float64)
        d64 = den_all.to(tl.float64)  # [BLK, GP, 1]
        den64 += d64
        kb = ((bb >> gv) & 1) != 0  # [BLK, GP, 1]
        vb = ((bb >> (G + gv)) & 1) != 0
        av64 += tl.where(valid & ~vb, d64 * eta_b, 0.0)
        at64 += tl.where(valid & ~kb, d64, 0.0)
        mg_all = tl.load(mmax + rk * G + gv, mask=gv < G, other=0.0)  # [1, GP, 1]
        lm = tl.where(den_all > 0, mg_all + tl.log(tl.where(den_all > 0, den_all, 1.0)), float("-inf"))
        tl.store(exact_lm + (rk * G + gv) * B + bv, lm, mask=kb & valid & (gv < G))
    if act != 0:  # an inactive group writes nothing
        store_split_sums(acc, den, aval, atail, rk, split, S, acc_e, acc_o, den64, av64, at64, G, GP, D, DH)


@dataclass
class Phase2Geometry:
    """Static launch parameters shared by both phase-2 kernels; ``tuning`` holds the attend pass's tile and
    warps, the promotion pass's warps and the kernel dialect (``tuning.KernelTuning``)."""

    layout: PageLayout
    num_kv_heads: int
    group: int
    sub_blocks: int
    num_blocks: int
    splits: int
    blocks_per_split: int
    channel_major: bool = False
    tuning: KernelTuning = DEFAULT_TUNING


def use_cuda_attend(geo: Phase2Geometry, device: torch.device) -> bool:
    """Whether :func:`attend` runs the CUDA kernel (``attend_cuda``): ``geo.tuning`` allows it (dialect not
    ``"triton"``) and the kernel takes the shape on ``device``."""
    tun = geo.tuning
    if tun.dialect == "triton":
        return False
    from . import attend_cuda

    return attend_cuda.supported(geo.layout, geo.group, tun.attend_warps, device)


def promote(
    geo: Phase2Geometry,
    qs: torch.Tensor,
    shadow: torch.Tensor,
    tables: torch.Tensor,
    nfull: torch.Tensor,
    bits: torch.Tensor,
    active: torch.Tensor,
    scores: torch.Tensor,
    m8: torch.Tensor,
    delta: torch.Tensor,
    round1: torch.Tensor,
    canary: torch.Tensor,
    run_canary: bool,
    pool: torch.Tensor | None = None,
    kslot: torch.Tensor | None = None,
    stage: torch.Tensor | None = None,
    *,
    exact_rerun: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the promotion pass (shapes as in the kernel's parameter comments).

    ``pool``/``kslot``: the promotion cache's key pages and the step's slot map
    (``certvllm.kv.promotion_cache``); None reads every key page from the shadow. ``stage``: the step
    prefetch's pages of this layer (``certvllm.kv.prefetch``); slot ``len(pool) + i`` reads ``stage[i]``.
    ``exact_rerun``: the rung-3/4 recompute, which always runs the Triton kernel. Its exact scores are tree sums
    of the D products, which keep rungs 3/4 within the dense path's rounding. The CUDA kernel's two FMA chains per
    half row are covered by γ_D for the certified rungs, but at huge norms they are less accurate than the dense
    reference that the exact rungs are held to.

    Returns:
        ``(smax, sabs)`` each ``[R, H_kv, G, S]`` float32.
    """
    launch_device_ok(scores)
    R = qs.shape[0]
    K, G, S = geo.num_kv_heads, geo.group, geo.splits
    B = tables.shape[1]
    smax = torch.empty(R, K, G, S, dtype=torch.float32, device=qs.device)
    sabs = torch.empty(R, K, G, S, dtype=torch.float32, device=qs.device)
    D = geo.layout.head_dim
    use_pool = pool is not None and kslot is not None
    if not use_pool:
        pool, kslot = smax, bits  # placeholders, never read
    nslots = pool.shape[0] if use_pool else 0
    if stage is None:
        stage = pool  # placeholder: no slot reaches past the pool

    def launch_triton():
        # the scan's lists of (entry, source) pairs
        needed = torch.empty(R * K * S * 2 * geo.blocks_per_split, dtype=torch.int64, device=qs.device)
        _promote_kernel[(R * K, S)](
            qs, device_arg(shadow), tables, nfull, bits, active, scores, m8, delta, round1, canary, smax, sabs,
            pool, kslot, stage, nslots, needed, geo.num_blocks, B, tables.stride(0), S, geo.blocks_per_split,
            **promote_launch_constants(K, G, D, geo.sub_blocks, geo.channel_major, run_canary, use_pool, geo.tuning),
        )  # fmt: skip

    if not exact_rerun and use_cuda_promote(geo, qs.device):
        from . import attend_cuda

        attend_cuda.PROMOTE_CUDA_GATE.run(
            lambda: attend_cuda.launch_promote(geo, qs, shadow, tables, nfull, bits, active, scores, m8, delta, round1,
                                               canary, run_canary, pool if use_pool else None,
                                               kslot if use_pool else None, stage if use_pool else None, smax, sabs,
                                               geo.tuning.promote_cuda),
            launch_triton,
        )  # fmt: skip
    else:
        launch_triton()
    return smax, sabs


def use_cuda_promote(geo: Phase2Geometry, device: torch.device) -> bool:
    """Whether :func:`promote` runs the CUDA kernel (``attend_cuda``): ``geo.tuning.promote_cuda`` asks for it (and
    ``dialect`` is not ``"triton"``) and the kernel takes the shape on ``device``."""
    tun = geo.tuning
    if tun.dialect == "triton" or tun.promote_cuda == 0:
        return False
    from . import attend_cuda

    return attend_cuda.promote_supported(geo.layout.head_dim, geo.group, geo.channel_major, tun.promote_cuda, device)


def promote_launch_constants(num_kv_heads: int, group: int, head_dim: int, sub_blocks: int, channel_major: bool,
                             run_canary: bool, use_pool: bool, tuning: KernelTuning = DEFAULT_TUNING) -> dict:  # fmt: skip
    """The compile-time arguments of :func:`_promote_kernel` (constexprs and ``num_warps``), for its launch and for
    compiling it offline (``offline_compile``). Warps: ``tuning.promote_warps``, else 2 for G ≤ 4 (more programs
    in flight per multiprocessor, measured faster on an H100) and 8 for larger groups."""
    return dict(
        H=num_kv_heads, G=group, GP=next_pow2(group), D=head_dim, DP=next_pow2(head_dim), M=sub_blocks,
        CHANNEL_MAJOR=channel_major, CANARY=run_canary, PB=64, USE_POOL=use_pool,
        num_warps=tuning.promote_warps or (2 if group <= 4 else 8),
    )  # fmt: skip


@dataclass
class AttendOut:
    """Per-split partial sums of the attend pass (reduce with ``.sum(dim=2)``)."""

    acc: torch.Tensor
    den: torch.Tensor
    aval: torch.Tensor
    atail: torch.Tensor


def attend(
    geo: Phase2Geometry,
    scores: torch.Tensor,
    mmax: torch.Tensor,
    shadow: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    nfull: torch.Tensor,
    bits: torch.Tensor,
    active: torch.Tensor,
    exact_lm: torch.Tensor,
) -> AttendOut:
    """Launch the attend pass.

    Returns:
        :class:`AttendOut`: acc ``[R, H_kv, S, G, D]``, den/aval/atail ``[R, H_kv, S, G]``, all float64; a
        group whose ``active`` is 0 is left unwritten (uninitialised memory).
    """
    launch_device_ok(scores)
    R = scores.shape[0]
    K, G, S = geo.num_kv_heads, geo.group, geo.splits
    B = tables.shape[1]
    lay = geo.layout
    D = lay.head_dim
    f64 = dict(dtype=torch.float64, device=scores.device)
    out = AttendOut(
        acc=torch.empty(R, K, S, G, D, **f64),
        den=torch.empty(R, K, S, G, **f64),
        aval=torch.empty(R, K, S, G, **f64),
        atail=torch.empty(R, K, S, G, **f64),
    )

    def launch_triton():
        _attend_kernel[(R * K, S)](
            scores, mmax, device_arg(shadow), pages, pages.view(torch.float16), pages.view(torch.float32),
            tables, nfull, bits, active, out.acc, out.den, out.aval, out.atail, exact_lm,
            geo.num_blocks, B, tables.stride(0), S, geo.blocks_per_split,
            H=K, G=G, GP=next_pow2(G), D=D, DP=next_pow2(D), M=geo.sub_blocks, GRP=lay.value_group, NG=lay.groups,
            BLK=geo.tuning.attend_blk, PAGE_BYTES=lay.page_bytes, V_CODES=lay.v_codes, V_SCALE=lay.v_scale,
            V_ZERO=lay.v_zero, HEADER=lay.header, PRECISE=precise(), num_warps=geo.tuning.attend_warps,
        )  # fmt: skip

    if use_cuda_attend(geo, scores.device):
        from . import attend_cuda

        attend_cuda.ATTEND_CUDA_GATE.run(
            lambda: attend_cuda.launch(out, geo, scores, mmax, shadow, pages, tables, nfull, bits, active, exact_lm,
                                       geo.tuning.attend_warps),
            launch_triton,
        )  # fmt: skip
    else:
        launch_triton()
    return out
