"""The resident decode pass in Gluon (Triton's explicit-layout dialect): the outputs and the arithmetic of
``fused._fused_kernel`` with register layouts chosen by hand: one for the keys, then a compact one for the weights and
one for the values.

One program per (row, KV head, split); its ``BLK`` warps take one 16-token block each per iteration:

1. **Keys** in the layout ``L`` over ``[BLK, 16, D]`` (``VEC`` key-code bytes per thread, the channels of a token
   over ``D/VEC`` lanes, the tokens over the other lanes and registers; the block ids of iteration ``it + 1`` loaded
   during iteration ``it``):
   INT8 scores, ℓ⁸_b, max |s̃⁸|, Δ_b and R_b of every head (Δ_b, R_b with the heads on the token lanes), and,
   on blocks of F, the exact scores from the pool's or the shadow's keys with the canary. Each head's final
   scores go to shared memory, ``[GP, BLK, 16]``.
2. **Weights** in a compact layout ``LC`` over ``[BLK, GP, TN, SN]`` (block, query head, token = TN·SN + s: the
   weights computed once per (head, token), not on every lane whose value channels they multiply): the
   scores read back, the running maximum per head (float64 rescaling of the accumulators when it grows, as
   the Triton kernel), w = expf(s − m) (libdevice), den_b, and the weights to shared memory.
3. **Values** in the layout ``LA`` over ``[BLK, GP, TN, QC, VB]`` (``VB`` consecutive value bytes per lane and token,
   the ``QC`` chunks of a token over ``TQ`` lanes, the tokens over ``TN`` lanes, all query heads in registers), token
   by token (FMA chains over each lane's SN tokens,
   float32 partial sums over ≤ 16 tokens of one block converted exactly to float64), INT4 v̂ = z + c·s, or the
   originals (pool or shadow) on blocks whose values are read exactly.

The summation structure is the Triton kernel's (16-term float32 per-block sums, float64 across blocks), so
docs/certification.md §5.1 applies unchanged; the D-term dot products reduce in another order (γ_D is
order-free). Used on CUDA when Gluon is available and the shape fits (:func:`supported`); the Triton kernel
remains the implementation under the interpreter (CPU tests) and the fallback.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra import libdevice

from certvllm.formats.pool_slots import HASH_MUL

from .gluon_common import reinterpret
from .shape_class import JIT_OPTIONS

_HASH_MUL = gl.constexpr(HASH_MUL)
VB = 2
"""Value bytes per lane and token in the value layout ``LA``."""
VEC = 16
"""Key-code bytes per thread and token in the key layout ``L``."""


def supported(head_dim: int, group: int, value_group: int, channel_major: bool, blk: int, num_warps: int) -> bool:
    """Shapes the Gluon kernel handles: D a power of two in [32, 256], 1 ≤ G ≤ 16, value groups a chunk never
    straddles, token-major shadow keys (the CUDA layout), one block per warp."""
    dp = 1 << max(0, (head_dim - 1).bit_length())
    return (
        dp == head_dim and 32 <= head_dim <= 256 and 1 <= group <= 16 and value_group % (2 * VB) == 0
        and not channel_major and blk == num_warps and head_dim // 2 // VB >= 2
    )  # fmt: skip


@gluon.jit
def _setup(qs, nfull, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLK: gl.constexpr, VEC: gl.constexpr):
    """Program indices and the index tensors of the layout ``L`` (module docstring)."""
    N: gl.constexpr = 16
    TD: gl.constexpr = D // VEC  # lanes over the channels
    TN: gl.constexpr = 32 // TD  # lanes over the tokens
    L: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, TN, TD], [BLK, 1, 1], [2, 1, 0])
    L_b: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L))
    L_n: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L))
    L_d: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L))
    rk = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    r = rk // H
    h = rk % H
    # per-block values live in 1-D tensors (one register per thread) and are expanded only where they
    # meet a tile: a [BLK, 1, 1] tensor in L would hold VEC copies per thread
    jb = gl.arange(0, BLK, layout=L_b)  # [BLK]
    n1 = gl.arange(0, N, layout=L_n)
    n2 = gl.expand_dims(n1, 0)  # [1, N] (scores)
    nv = gl.expand_dims(n2, 2)  # [1, N, 1]
    dv = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=L_d), 0), 1)  # [1, 1, D]
    nf = gl.load(nfull + r)
    qrow = qs + (r * (H * G) + h * G) * D
    return rk, split, r, h, jb, n2, nv, dv, nf, qrow


@gluon.jit
def _cols(it, jb, split, BPS, B, nf, BLK: gl.constexpr):
    """Iteration ``it``'s block columns ``bb`` [BLK], in range (``inb``) and full (``valid``)."""
    ib = it * BLK + jb
    bb = split * BPS + ib  # [BLK] block column
    inb = (bb < B) & (ib < BPS)
    valid = inb & (bb < nf)
    return bb, inb, valid


@gluon.jit
def _block_ids(tables, r, TB_STRIDE, bb, inb, num_blocks):
    """The block ids of columns ``bb`` [BLK], clamped to ``[0, num_blocks)`` (0 where not ``inb``)."""
    bid = gl.load(tables + r * TB_STRIDE + bb, mask=inb, other=0)
    return gl.minimum(gl.maximum(bid, 0), num_blocks - 1)


@gluon.jit
def _page_loads(
    pages_u8,
    pages_i8,
    pages_f16,
    pages_f32,
    bid,
    valid,
    h,
    nv,
    dv,
    H: gl.constexpr,
    D: gl.constexpr,
    N: gl.constexpr,
    M: gl.constexpr,
    PAGE_BYTES: gl.constexpr,
    K_OFFSET: gl.constexpr,
    K_SCODE: gl.constexpr,
    HEADER: gl.constexpr,
    BLK: gl.constexpr,
    VEC: gl.constexpr,
):
    """Every page load of one iteration (masked by ``valid``), as loaded: exponent ``ex`` [BLK] int8,
    ``η``/``ν`` [BLK] float32, ``flags`` [BLK] uint8, key offsets ``off`` [BLK, 1, D] float16, key scale
    codes ``sc`` [BLK, 1, D] uint8 and key codes ``codes`` [BLK, N, D] uint8."""
    base = ((bid // M) * H + h) * (M * PAGE_BYTES) + (bid % M) * PAGE_BYTES  # [BLK]
    ex = gl.load(pages_i8 + base + HEADER + 8, mask=valid, other=0)
    e_b = gl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0)
    n_b = gl.load(pages_f32 + (base + HEADER) // 4 + 1, mask=valid, other=0.0)
    flags = gl.load(pages_u8 + base + HEADER + 9, mask=valid, other=1)
    base3 = gl.expand_dims(gl.expand_dims(base, 1), 2)  # [BLK, 1, 1]
    vd = gl.expand_dims(gl.expand_dims(valid, 1), 2) & (dv < D)  # [BLK, 1, D]
    off = gl.load(pages_f16 + (base3 + K_OFFSET) // 2 + dv, mask=vd, other=0.0)
    sc = gl.load(pages_u8 + base3 + K_SCODE + dv, mask=vd, other=0)
    codes = gl.load((pages_u8 + base3) + (nv * D + dv), mask=vd & (nv < N), other=0)  # [BLK, N, D]
    return ex, e_b, n_b, flags, off, sc, codes


@gluon.jit
def _x4(x):
    """[BLK] → [BLK, 1, 1, 1]."""
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 1), 2), 3)


@gluon.jit
def _residency(bid, valid, h, tag, tag_gen, gen, slot_of, nslots, H: gl.constexpr, USE_POOL: gl.constexpr,
               EXPLICIT: gl.constexpr):  # fmt: skip
    """Whether the pool holds block ``bid``'s KV-head-h page under its current generation, and the slot."""
    if USE_POOL and EXPLICIT:  # the slot the pool assigned (``ResidentPool``), checked by its tag
        page = bid * H + h
        gb = gl.load(gen + bid, mask=valid, other=-2)
        slot = gl.load(slot_of + page, mask=valid, other=-1).to(gl.int64)
        has = valid & (slot >= 0)
        slot = gl.where(has, slot, 0)
        res = has & (gl.load(tag + slot, mask=has, other=-1) == page)
        return res & (gl.load(tag_gen + slot, mask=has, other=-1) == gb), slot
    elif USE_POOL:
        page = bid * H + h
        s1 = page % nslots
        s2 = ((page * _HASH_MUL) >> 7) % nslots
        gb = gl.load(gen + bid, mask=valid, other=-2)
        hit1 = valid & (gl.load(tag + s1, mask=valid, other=-1) == page)
        hit1 = hit1 & (gl.load(tag_gen + s1, mask=valid, other=-1) == gb)
        hit2 = valid & ~hit1 & (gl.load(tag + s2, mask=valid, other=-1) == page)
        hit2 = hit2 & (gl.load(tag_gen + s2, mask=valid, other=-1) == gb)
        return hit1 | hit2, gl.where(hit1, s1, s2)
    else:
        return valid & (bid < 0), bid


@gluon.jit
def _value_tokens(wsx, pages_f16, pages_u8, base4, vm, tv, kbyte, gq, xpool, xshadow, vx4, res4,
                  G: gl.constexpr, GP: gl.constexpr, N: gl.constexpr, D: gl.constexpr, DH: gl.constexpr,
                  NG: gl.constexpr, SN: gl.constexpr, V_SCALE: gl.constexpr, V_ZERO: gl.constexpr,
                  V_CODES: gl.constexpr, LA: gl.constexpr, LWT: gl.constexpr, EXACT: gl.constexpr):  # fmt: skip
    """Σ over the lane's SN tokens of w·v (float32 FMA chains), even and odd channels: ``[BLK, GP, TN, QC, VB]``.
    With ``EXACT``, blocks ``vx4`` read the originals (``xpool`` where ``res4``, else ``xshadow``)."""
    for t in gl.static_range(SN):
        w5 = gl.expand_dims(gl.expand_dims(wsx.index(t).load(LWT), 3), 4)  # [BLK, GP, TN, 1, 1]
        tok = tv * SN + t
        grp = (tok * NG + gq).to(gl.int64)
        vsc = gl.load(pages_f16 + (base4 + V_SCALE) // 2 + grp, mask=vm, other=0.0).to(gl.float32)
        vze = gl.load(pages_f16 + (base4 + V_ZERO) // 2 + grp, mask=vm, other=0.0).to(gl.float32)
        byte = gl.load((pages_u8 + base4 + V_CODES) + (tok * DH + kbyte), mask=vm, other=0).to(gl.int32)
        ve = vze + (byte & 15).to(gl.float32) * vsc
        vo = vze + (byte >> 4).to(gl.float32) * vsc
        if EXACT:
            off = tok * D + 2 * kbyte
            mp = vm & vx4 & res4
            ms = vm & vx4 & ~res4
            xe = gl.load(xpool + off, mask=mp, other=0.0).to(gl.float32) + gl.load(
                xshadow + off, mask=ms, other=0.0).to(gl.float32)  # fmt: skip
            xo = gl.load(xpool + off + 1, mask=mp, other=0.0).to(gl.float32) + gl.load(
                xshadow + off + 1, mask=ms, other=0.0).to(gl.float32)  # fmt: skip
            ve = gl.where(vx4, xe, ve)
            vo = gl.where(vx4, xo, vo)
        if t == 0:
            num_e = w5 * gl.expand_dims(ve, 1)
            num_o = w5 * gl.expand_dims(vo, 1)
        else:
            num_e = num_e + w5 * gl.expand_dims(ve, 1)
            num_o = num_o + w5 * gl.expand_dims(vo, 1)
    return num_e, num_o


@gluon.jit(**JIT_OPTIONS)
def _fused_gluon_kernel(
    qs, pages_u8, pages_i8, pages_f16, pages_f32, shadow, pool, vpool, tag, tag_gen, gen, slot_of, tables, nfull, bits,
    active, acc, den, aval, atail, msplit, sabs, l8, delta, rmax, amax, exact_lm, eta, nu, bad, fbits, canary, lut,
    nslots, num_blocks, B, TB_STRIDE, S, BPS, DELTA_F, ROUND_F,
    H: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, M: gl.constexpr, GRP: gl.constexpr,
    NG: gl.constexpr, BLK: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFFSET: gl.constexpr, K_SCODE: gl.constexpr,
    V_CODES: gl.constexpr, V_SCALE: gl.constexpr, V_ZERO: gl.constexpr, HEADER: gl.constexpr, VEC: gl.constexpr,
    VB: gl.constexpr, USE_POOL: gl.constexpr, POOL_VALUES: gl.constexpr, EXPLICIT: gl.constexpr,
    USE_BITS: gl.constexpr,
    USE_ACTIVE: gl.constexpr, EXACT_ALL: gl.constexpr, CANARY: gl.constexpr, CANARY_F: gl.constexpr,
):  # fmt: skip
    """The arguments of ``fused._fused_kernel`` (documented there; D a power of two, token-major shadow keys,
    libdevice always), plus ``lut`` (the key-scale table), ``VEC`` and ``VB``."""
    N: gl.constexpr = 16
    DH: gl.constexpr = D // 2
    QC: gl.constexpr = DH // VB
    TQ: gl.constexpr = QC if QC < 32 else 32
    TN: gl.constexpr = 32 // TQ
    SN: gl.constexpr = N // TN
    SQ: gl.constexpr = QC // TQ
    LA: gl.constexpr = gl.BlockedLayout([1, GP, 1, SQ, VB], [1, 1, TN, TQ, 1], [BLK, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    LV: gl.constexpr = gl.SliceLayout(1, LA)  # [BLK, TN, QC, VB]
    LWT: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, LA))  # [BLK, GP, TN]
    LC: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1], [1, 2, TN, SN], [BLK, 1, 1, 1], [3, 2, 1, 0])
    LCG: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1], [2, 1, TN, SN], [1, BLK, 1, 1], [3, 2, 0, 1])  # LC, G first
    LB: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LC))  # [BLK, GP]
    LG: gl.constexpr = gl.SliceLayout(0, LB)  # [GP]
    LV1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LV)))  # [BLK] of the value tiles
    LB1: gl.constexpr = gl.SliceLayout(1, LB)  # [BLK] of the weights
    LA1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LA))))  # [GP]
    WS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])  # [SN, BLK, GP, TN]
    WT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    SS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # scores [GP, BLK, N], indexed by head
    S4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])  # the same bytes as [GP, BLK, TN, SN]

    rk, split, r, h, jb, n2, nv, dv, nf, qrow = _setup(qs, nfull, H, G, D, BLK, VEC)
    key_bits = (1 << G) - 1
    # ---- index tensors of the value layouts
    tv = gl.arange(0, TN, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LV))))
    tv = gl.expand_dims(gl.expand_dims(gl.expand_dims(tv, 0), 2), 3)  # [1, TN, 1, 1]
    qv = gl.arange(0, QC, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LV))))
    qv = gl.expand_dims(gl.expand_dims(gl.expand_dims(qv, 0), 1), 3)  # [1, 1, QC, 1]
    xv = gl.arange(0, VB, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV))))
    xv = gl.expand_dims(gl.expand_dims(gl.expand_dims(xv, 0), 1), 2)  # [1, 1, 1, VB]
    kbyte = qv * VB + xv
    gq = (2 * qv * VB) // GRP
    g2 = gl.expand_dims(gl.arange(0, GP, layout=LG), 0)  # [1, GP] (LB)
    gvec = gl.arange(0, GP, layout=LG)
    # ---- shared buffers
    ssm = gl.allocate_shared_memory(gl.float32, [GP, BLK, N], SS)
    ss4 = reinterpret(ssm, gl.float32, [GP, BLK, TN, SN], S4)
    for g in gl.static_range(G, GP):  # padding heads (G not a power of two): no tokens, weight 0
        ssm.index(g).store(gl.full([BLK, N], float("-inf"), gl.float32, layout=n2.type.layout))
    wsm = gl.allocate_shared_memory(gl.float32, [SN, BLK, GP, TN], WS)
    wsx = reinterpret(wsm, gl.float32, [SN, BLK, GP, TN], WT)
    # ---- accumulators
    acc_e = gl.zeros([BLK, GP, TN, QC, VB], gl.float64, layout=LA)
    acc_o = gl.zeros([BLK, GP, TN, QC, VB], gl.float64, layout=LA)
    den64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    av64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    at64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    m_run = gl.full([GP], float("-inf"), gl.float32, layout=LG)
    sabs_run = gl.zeros([GP], gl.float32, layout=LG)
    viol = nf * 0
    # ---- Δ_b / R_b operands: heads on the token lanes of L ([1, GP, D])
    gi = gl.arange(0, GP, layout=gl.SliceLayout(0, n2.type.layout))
    gk2 = gl.expand_dims(gi, 0)  # [1, GP]
    gk3 = gl.expand_dims(gk2, 2)  # [1, GP, 1]
    qa = gl.abs(gl.load(qrow + gk3 * D + dv, mask=(gk3 < G) & (dv < D), other=0.0))  # [1, GP, D]

    n_iter = gl.cdiv(BPS, BLK)
    if USE_ACTIVE:
        n_iter = gl.where(gl.load(active + rk) != 0, n_iter, 0)
    bb, inb, valid = _cols(0, jb, split, BPS, B, nf, BLK)
    bid = _block_ids(tables, r, TB_STRIDE, bb, inb, num_blocks)
    for it in range(0, n_iter):
        bb, inb, valid = _cols(it, jb, split, BPS, B, nf, BLK)
        ex, e_b, n_b, flags, off, sc, codes = _page_loads(
            pages_u8, pages_i8, pages_f16, pages_f32, bid, valid, h, nv, dv, H, D, N, M, PAGE_BYTES, K_OFFSET, K_SCODE,
            HEADER, BLK, VEC,
        )  # fmt: skip
        bid_k = bid
        bb1, inb1, valid1 = _cols(it + 1, jb, split, BPS, B, nf, BLK)
        bid = _block_ids(tables, r, TB_STRIDE, bb1, inb1, num_blocks)  # iteration it + 1's
        # ---- page terms (phase 1)
        ex = gl.minimum(gl.maximum(ex.to(gl.int32), -126), 127)
        two_e = ((ex + 127) << 23).to(gl.float32, bitcast=True)
        flags = flags.to(gl.int32)
        pb = rk * B + bb
        gl.store(eta + pb, gl.where(valid, e_b, 0.0), mask=inb)
        gl.store(nu + pb, gl.where(valid, n_b, 0.0), mask=inb)
        gl.store(bad + pb, (valid & (((flags & 2) != 0) | ((flags & 1) == 0))).to(gl.int32), mask=inb)
        valid2 = gl.expand_dims(valid, 1)  # [BLK, 1]
        off = off.to(gl.float32)
        sigma = gl.load(lut + sc.to(gl.int32)) * gl.expand_dims(gl.expand_dims(two_e, 1), 2)  # [BLK, 1, D]
        khat = off + codes.to(gl.float32) * sigma  # [BLK, N, D]
        kmag = gl.maximum(gl.abs(off), gl.abs(off + 255.0 * sigma)) + sigma
        d_all = gl.sum(sigma * qa, axis=2) * DELTA_F  # [BLK, GP]
        r_all = gl.sum(kmag * qa, axis=2) * ROUND_F
        orow = (rk * G + gk2) * B + gl.expand_dims(bb, 1)  # [BLK, GP]
        gmask = gl.expand_dims(inb, 1) & (gk2 < G)
        gl.store(delta + orow, gl.where(valid2, d_all, 0.0), mask=gmask)
        gl.store(rmax + orow, gl.where(valid2, r_all, 0.0), mask=gmask)
        # ---- F: pool hits under the current generation, or the caller's key bits
        res, slot = _residency(bid_k, valid, h, tag, tag_gen, gen, slot_of, nslots, H, USE_POOL, EXPLICIT)
        if USE_BITS:
            bbits = gl.load(bits + rk * B + bb, mask=valid, other=0)
        else:
            bbits = (bid_k * 0).to(gl.int32)
        if EXACT_ALL:
            fk = valid
        else:
            fk = valid & (res | ((bbits & key_bits) != 0))  # [BLK]
        any_f = gl.max(fk.to(gl.int32), axis=0) > 0
        if POOL_VALUES:
            res_v = res
        else:
            res_v = valid & (bid_k < 0)
        if EXACT_ALL:
            vx = valid
        else:
            vx = valid & ((((bbits >> G) & key_bits) != 0) | res_v)
        gl.store(fbits + pb, gl.where(fk, key_bits, 0) | gl.where(vx, key_bits << G, 0), mask=inb)
        # ---- INT8 scores, block terms, exact scores of F (canary) → shared memory per head
        fk2 = gl.expand_dims(fk, 1)  # [BLK, 1]
        for g in gl.static_range(G):
            qg = gl.load(qrow + g * D + dv)  # [1, 1, D]
            s8 = gl.where(valid2, gl.sum(khat * qg, axis=2), float("-inf"))  # [BLK, N]
            sa = gl.max(gl.where(gl.abs(s8) < float("inf"), gl.abs(s8), 0.0), axis=1)
            gl.store(amax + (rk * G + g) * B + bb, gl.where(valid, sa, 0.0), mask=inb)
            ssm.index(g).store(s8)
        if any_f:  # exact scores of F from the pool's or the shadow's keys, the canary, and F's scores in ssm
            fk3 = gl.expand_dims(fk2, 2)
            res3 = gl.expand_dims(gl.expand_dims(res, 1), 2)
            kbase = (((bid_k // M) * H + h) * 2) * (M * N * D) + (bid_k % M) * (N * D)
            kbase = gl.expand_dims(gl.expand_dims(kbase, 1), 2)
            kx = gl.load(shadow + kbase + nv * D + dv, mask=fk3 & ~res3 & (dv < D), other=0.0).to(gl.float32)
            if USE_POOL:
                pslot = gl.expand_dims(gl.expand_dims(slot, 1), 2)
                kp = gl.load(pool + pslot * (N * D) + nv * D + dv, mask=res3 & (dv < D), other=0.0).to(gl.float32)
                kx = gl.where(res3, kp, kx)
            for g in gl.static_range(G):
                qg = gl.load(qrow + g * D + dv)
                sx = gl.where(valid2, gl.sum(kx * qg, axis=2), float("-inf"))  # [BLK, N]
                s8 = ssm.index(g).load(sx.type.layout)
                mb = gl.max(s8, axis=1)  # ℓ⁸_b of F blocks (T blocks': from their phase-2 sums, below)
                fin = gl.abs(mb) < float("inf")
                mref = gl.where(fin, mb, 0.0)
                lb = gl.where(fin, mref + gl.log(gl.maximum(gl.sum(gl.exp(s8 - gl.expand_dims(mref, 1)), axis=1),
                                                            1.0)), mb)  # fmt: skip
                gl.store(l8 + (rk * G + g) * B + bb, lb, mask=fk)
                if CANARY:  # |s̃^exact − s̃⁸| ≤ (Δ_b + 2R_b)(1 + 2⁻¹⁰) under P2
                    dg = gl.convert_layout(gl.sum(gl.where(gk2 == g, d_all, 0.0), axis=1), valid.type.layout)
                    rg = gl.convert_layout(gl.sum(gl.where(gk2 == g, r_all, 0.0), axis=1), valid.type.layout)
                    tol = gl.expand_dims((dg + 2.0 * rg) * CANARY_F, 1)
                    diff = gl.abs(sx - s8)
                    bad_t = fk2 & ((diff > tol) | ~(diff < float("inf")))
                    viol = gl.maximum(viol, gl.max(gl.max(bad_t.to(gl.int32), axis=1), axis=0).to(viol.dtype))
                xa = gl.max(gl.max(gl.where(fk2 & (gl.abs(sx) < float("inf")), gl.abs(sx), 0.0), axis=1), axis=0)
                sabs_run = gl.where(gvec == g, gl.maximum(sabs_run, xa), sabs_run)
                ssm.index(g).store(gl.where(fk2, sx, s8))
        # ---- the running maximum, weights and block sums (compact layout)
        s_c = gl.convert_layout(gl.permute(ss4.load(LCG), [1, 0, 2, 3]), LC)  # [BLK, GP, TN, SN] (no-op convert)
        m_tile = gl.max(gl.max(gl.max(s_c, axis=3), axis=2), axis=0)  # [GP]
        m_new = gl.maximum(m_run, m_tile)
        grow = m_new > m_run
        if gl.max(grow.to(gl.int32), axis=0) > 0:
            fac = gl.where(grow & (m_run > float("-inf")), gl.exp((m_run - m_new).to(gl.float64)), 1.0)
            fac = gl.where(m_run == float("-inf"), 0.0, fac)
            fb = gl.expand_dims(fac, 0)  # [1, GP] (LB)
            den64 = den64 * fb
            av64 = av64 * fb
            at64 = at64 * fb
            fa = gl.convert_layout(fac, LA1)
            fa = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(fa, 0), 2), 3), 4)
            acc_e = acc_e * fa
            acc_o = acc_o * fa
        m_run = m_new
        m0 = gl.where(m_new == float("-inf"), 0.0, m_new)
        mgc = gl.expand_dims(gl.expand_dims(gl.expand_dims(m0, 0), 2), 3)  # [1, GP, 1, 1]
        w_c = libdevice.exp(s_c - mgc)
        den_b = gl.sum(gl.sum(w_c, axis=3), axis=2)  # [BLK, GP]
        wsm.store(gl.permute(w_c, [3, 0, 1, 2]))
        # ---- values
        bid_v = gl.convert_layout(bid_k, LV1)
        valid_v = gl.convert_layout(valid, LV1)
        base_v = ((bid_v // M) * H + h) * (M * PAGE_BYTES) + (bid_v % M) * PAGE_BYTES
        base4 = _x4(base_v)
        vm = _x4(valid_v) & (tv < TN) & (qv < QC) & (xv < VB)
        vx_v = gl.convert_layout(vx, LV1)
        if gl.max(vx_v.to(gl.int32), axis=0) > 0:
            res_vv = gl.convert_layout(res_v, LV1)
            slot_v = gl.convert_layout(slot, LV1)
            xshadow = shadow + _x4((((bid_v // M) * H + h) * 2 + 1) * (M * N * D) + (bid_v % M) * (N * D))
            if POOL_VALUES:
                xpool = vpool + _x4(slot_v * (N * D))
            else:
                xpool = xshadow
            num_e, num_o = _value_tokens(wsx, pages_f16, pages_u8, base4, vm, tv, kbyte, gq, xpool, xshadow,
                                         _x4(vx_v), _x4(res_vv), G, GP, N, D, DH, NG, SN, V_SCALE, V_ZERO, V_CODES,
                                         LA, LWT, True)  # fmt: skip
        else:
            num_e, num_o = _value_tokens(wsx, pages_f16, pages_u8, base4, vm, tv, kbyte, gq, shadow, shadow,
                                         _x4(vx_v), _x4(vx_v), G, GP, N, D, DH, NG, SN, V_SCALE, V_ZERO, V_CODES,
                                         LA, LWT, False)  # fmt: skip
        acc_e += num_e.to(gl.float64)
        acc_o += num_o.to(gl.float64)
        d64 = den_b.to(gl.float64)
        den64 += d64
        valid_w = gl.expand_dims(gl.convert_layout(valid, LB1), 1)
        vx_w = gl.expand_dims(gl.convert_layout(vx, LB1), 1)
        fk_w = gl.expand_dims(gl.convert_layout(fk, LB1), 1)
        eta_w = gl.expand_dims(gl.convert_layout(e_b, LB1), 1).to(gl.float64)
        av64 += gl.where(valid_w & ~vx_w, d64 * eta_w, 0.0)
        at64 += gl.where(valid_w & ~fk_w, d64, 0.0)
        lm = gl.where(den_b > 0, gl.expand_dims(m0, 0) + gl.log(gl.where(den_b > 0, den_b, 1.0)), float("-inf"))
        bb_w = gl.expand_dims(gl.convert_layout(bb, LB1), 1)
        inb_w = gl.expand_dims(gl.convert_layout(inb, LB1), 1)
        lrow = (rk * G + g2) * B + bb_w
        gl.store(exact_lm + lrow, lm, mask=fk_w & (g2 < G))
        # ℓ⁸_b of the INT8-key blocks is their phase-2 log-mass (the same scores); −inf past the last full block
        gl.store(l8 + lrow, gl.where(valid_w, lm, float("-inf")), mask=inb_w & ~fk_w & (g2 < G))
    if CANARY:
        gl.atomic_max(canary + r, viol.to(gl.int32))
    # ---- the warps' partial sums, float64
    orow2 = (rk * S + split) * G + g2
    gm = g2 < G
    gl.store(den + orow2, gl.sum(den64, axis=0)[None, :], mask=gm)
    gl.store(aval + orow2, gl.sum(av64, axis=0)[None, :], mask=gm)
    gl.store(atail + orow2, gl.sum(at64, axis=0)[None, :], mask=gm)
    gl.store(msplit + (rk * G + gvec) * S + split, m_run, mask=gvec < G)
    gl.store(sabs + (rk * G + gvec) * S + split, sabs_run, mask=gvec < G)
    LO: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, LA))
    gq3 = gl.expand_dims(gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, LO))), 1), 2)
    qo = gl.expand_dims(gl.expand_dims(gl.arange(0, QC, layout=gl.SliceLayout(0, gl.SliceLayout(2, LO))), 0), 2)
    xo = gl.expand_dims(gl.expand_dims(gl.arange(0, VB, layout=gl.SliceLayout(0, gl.SliceLayout(1, LO))), 0), 1)
    optr = acc + ((rk * S + split) * G + gq3) * D + 2 * (qo * VB + xo)
    om = (gq3 < G) & (qo < QC) & (xo < VB)
    gl.store(optr, gl.sum(gl.sum(acc_e, axis=2), axis=0), mask=om)
    gl.store(optr + 1, gl.sum(gl.sum(acc_o, axis=2), axis=0), mask=om)


def launch_constants(geo, num_warps: int, canary_factor: float, use_pool: bool, pool_values: bool, use_bits: bool,
                     use_active: bool, run_canary: bool, exact_all: bool = False, explicit: bool = True) -> dict:  # fmt: skip
    """The compile-time arguments of :func:`_fused_gluon_kernel` for ``geo`` (a ``fused.FusedGeometry``)."""
    lay = geo.layout
    G = geo.group
    return dict(
        H=geo.num_kv_heads, G=G, GP=1 << max(0, (G - 1).bit_length()), D=lay.head_dim, M=geo.sub_blocks,
        GRP=lay.value_group, NG=lay.groups, BLK=num_warps, PAGE_BYTES=lay.page_bytes, K_OFFSET=lay.k_offset,
        K_SCODE=lay.k_scale_code, V_CODES=lay.v_codes, V_SCALE=lay.v_scale, V_ZERO=lay.v_zero, HEADER=lay.header,
        VEC=VEC, VB=VB, USE_POOL=use_pool, POOL_VALUES=pool_values, EXPLICIT=explicit, USE_BITS=use_bits,
        USE_ACTIVE=use_active,
        EXACT_ALL=exact_all, CANARY=run_canary, CANARY_F=canary_factor, num_warps=num_warps, enable_fp_fusion=True,
    )  # fmt: skip


def launch(args: tuple, grid: tuple, lut: torch.Tensor, constants: dict) -> None:
    """Launch with the Triton kernel's positional arguments ``args`` (``fused._fused_kernel`` order, without
    ``lut``), the key-scale table appended after ``canary``."""
    head, tail = args[:32], args[32:]
    _fused_gluon_kernel[grid](*head, lut, *tail, **constants)
