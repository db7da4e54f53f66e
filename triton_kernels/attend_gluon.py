"""The attend pass in Gluon (Triton's explicit-layout dialect): the same outputs and the same arithmetic as
``phase2._attend_kernel``, with the register layout chosen by hand.

One 5-D layout ``L`` over ``[BLK, GP, 16, Q, 4]`` (blocks, query heads, tokens, quads of value bytes, byte
in quad) serves the loop: one block per warp, the quads over ``TQ`` lanes, the tokens over the remaining
``TN`` lanes and ``SN`` registers, all query heads of the group in registers. Per block:

* weights w = expf(s − m) (libdevice, ≤ 2 ulp) for every (g, token) of the thread;
* den_b = Σ_t w and num_b = Σ_t w·v̂ (16-term float32 sums over the block's tokens: ``SN`` in a thread,
  then ``TN`` lanes; any order, docs/certification.md §5.1), v̂ = z + c·s rounded once;
* the block sums are converted to float64 and added to per-warp float64 accumulators; the warps' partial
  sums are added in float64 once at the end (the across-block sum is float64 in any order).

Nothing is converted between layouts inside the loop. Used on CUDA when Gluon is available and the shape
fits (``supported``); the Triton kernel remains the implementation under the interpreter (CPU tests) and
the fallback.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra import libdevice


def supported(head_dim: int, group: int, num_warps: int, blk: int, value_group: int) -> bool:
    """Shapes the Gluon kernel handles: D a power of two in [32, 256], G ≤ 16, one block per warp, value
    groups of a multiple of 8 channels (a quad of code bytes never straddles two groups)."""
    dp = 1 << max(0, (head_dim - 1).bit_length())
    return dp == head_dim and 32 <= head_dim <= 256 and 1 <= group <= 16 and blk == num_warps and value_group % 8 == 0


@gluon.jit
def _blocks(jb, it, split, BPS, B, nf, tables, r, TB_STRIDE, num_blocks, h, H: gl.constexpr, M: gl.constexpr,
            PAGE_BYTES: gl.constexpr, BLK: gl.constexpr):  # fmt: skip
    """Block columns, validity, ids and page offsets of iteration ``it`` (in the layout of ``jb``)."""
    ib = it * BLK + jb
    bb = split * BPS + ib
    valid = (bb < B) & (ib < BPS) & (bb < nf)
    bid = gl.load(tables + r * TB_STRIDE + bb, mask=valid, other=0)
    bid = gl.minimum(gl.maximum(bid, 0), num_blocks - 1)
    base = ((bid // M) * H + h) * (M * PAGE_BYTES) + (bid % M) * PAGE_BYTES
    return bb, valid, bid, base


@gluon.jit
def _attend_gluon_kernel(
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
    num_blocks,
    B,
    TB_STRIDE,
    S,
    BPS,
    H: gl.constexpr,
    G: gl.constexpr,
    GP: gl.constexpr,
    D: gl.constexpr,
    M: gl.constexpr,
    GRP: gl.constexpr,
    NG: gl.constexpr,
    BLK: gl.constexpr,
    PAGE_BYTES: gl.constexpr,
    V_CODES: gl.constexpr,
    V_SCALE: gl.constexpr,
    V_ZERO: gl.constexpr,
    HEADER: gl.constexpr,
):
    N: gl.constexpr = 16
    DH: gl.constexpr = D // 2  # value bytes per token
    Q: gl.constexpr = DH // 4  # quads of bytes per token
    TQ: gl.constexpr = Q if Q < 32 else 32  # lanes over the quads
    TN: gl.constexpr = 32 // TQ  # lanes over the tokens
    SN: gl.constexpr = N // TN  # tokens per thread
    SQ: gl.constexpr = Q // TQ  # quads per thread
    L: gl.constexpr = gl.BlockedLayout([1, GP, SN, SQ, 4], [1, 1, TN, TQ, 1], [BLK, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    LV: gl.constexpr = gl.SliceLayout(1, L)  # [BLK, N, Q, 4] value tiles
    LW: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, L))  # [BLK, GP, N] weights
    LO: gl.constexpr = gl.SliceLayout(2, L)  # [BLK, GP, Q, 4] block sums and accumulators
    LB: gl.constexpr = gl.SliceLayout(2, LW)  # [BLK, GP] per (block, head)
    L1: gl.constexpr = gl.SliceLayout(1, LB)  # [BLK]
    LBO: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LO))  # [BLK, GP] beside the block sums
    LV1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LV)))  # [BLK] beside values
    rk = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    r = rk // H
    h = rk % H
    # index tensors, one per layout they are used in (per-block values are recomputed in each layout
    # family instead of converted: a few scalar loads that hit L1, and no shared-memory round trip)
    jb = gl.arange(0, BLK, layout=L1)  # [BLK]
    jv = gl.arange(0, BLK, layout=LV1)
    jo = gl.arange(0, BLK, layout=gl.SliceLayout(1, LBO))
    g2 = gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(0, LB)), 0)  # [1, GP] (LB)
    go2 = gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(0, LBO)), 0)  # [1, GP] (LBO)
    gw = gl.expand_dims(g2, 2)  # [1, GP, 1] (LW)
    nw = gl.expand_dims(gl.expand_dims(gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW))), 0), 1)
    nv = gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LV))))
    nv = gl.expand_dims(gl.expand_dims(gl.expand_dims(nv, 0), 2), 3)  # [1, N, 1, 1] (LV)
    qv = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LV))))
    qv = gl.expand_dims(gl.expand_dims(gl.expand_dims(qv, 0), 1), 3)  # [1, 1, Q, 1] (LV)
    xv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV))))
    xv = gl.expand_dims(gl.expand_dims(gl.expand_dims(xv, 0), 1), 2)  # [1, 1, 1, 4] (LV)
    act = gl.load(active + rk)
    n_iter = gl.where(act != 0, gl.cdiv(BPS, BLK), 0)
    nf = gl.load(nfull + r)
    mg = gl.load(mmax + rk * G + g2, mask=g2 < G, other=0.0)  # [1, GP]
    mgw = gl.expand_dims(mg, 2)  # [1, GP, 1]
    acc_e = gl.zeros([BLK, GP, Q, 4], gl.float64, layout=LO)
    acc_o = gl.zeros([BLK, GP, Q, 4], gl.float64, layout=LO)
    den64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    av64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    at64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    for it in range(0, n_iter):
        bb, valid, bid, base = _blocks(jb, it, split, BPS, B, nf, tables, r, TB_STRIDE, num_blocks, h, H, M,
                                       PAGE_BYTES, BLK)  # fmt: skip
        bits_b = gl.load(bits + rk * B + bb, mask=valid, other=0)
        eta_b = gl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0).to(gl.float64)
        # weights for every (block, head, token)
        valid2 = gl.expand_dims(valid, 1)  # [BLK, 1]
        pb2 = gl.expand_dims(rk * B + bb, 1)  # [BLK, 1]
        sw = gl.load((scores + gl.expand_dims(pb2 * (G * N), 2)) + (gw * N + nw),
                     mask=gl.expand_dims(valid2 & (g2 < G), 2) & (nw < N), other=float("-inf"))  # fmt: skip
        w = libdevice.exp(sw - mgw)  # [BLK, GP, N]
        den_b = gl.sum(w, axis=2)  # [BLK, GP]
        # INT4 values, dequantized once per block: v̂ = z + c·s (channels 8q + 2x and 8q + 2x + 1)
        _bb_v, valid_v, bid_v, base_v = _blocks(jv, it, split, BPS, B, nf, tables, r, TB_STRIDE, num_blocks, h, H, M,
                                            PAGE_BYTES, BLK)  # fmt: skip
        base4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(base_v, 1), 2), 3)  # [BLK, 1, 1, 1]
        valid4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(valid_v, 1), 2), 3)
        grp = (nv * NG + (8 * qv) // GRP).to(gl.int64)  # [1, N, Q, 1]: the value group of the quad
        vm1 = valid4 & (nv < N) & (qv < Q)
        vsc = gl.load(pages_f16 + (base4 + V_SCALE) // 2 + grp, mask=vm1, other=0.0).to(gl.float32)
        vze = gl.load(pages_f16 + (base4 + V_ZERO) // 2 + grp, mask=vm1, other=0.0).to(gl.float32)
        byte = gl.load((pages_u8 + base4 + V_CODES) + (nv * DH + qv * 4 + xv), mask=vm1 & (xv < 4), other=0)
        byte = byte.to(gl.int32)
        v_e = vze + (byte & 15).to(gl.float32) * vsc  # [BLK, N, Q, 4]
        v_o = vze + (byte >> 4).to(gl.float32) * vsc
        w5 = gl.expand_dims(gl.expand_dims(w, 3), 4)  # [BLK, GP, N, 1, 1]
        num_e = gl.sum(w5 * gl.expand_dims(v_e, 1), axis=2)  # [BLK, GP, Q, 4]
        num_o = gl.sum(w5 * gl.expand_dims(v_o, 1), axis=2)
        vbits = ((gl.expand_dims(bits_b, 1) >> (G + g2)) & 1) != 0  # [BLK, GP] values promoted
        anyv = gl.max(gl.max(vbits.to(gl.int32), axis=1), axis=0) != 0
        if anyv:
            # unquantized values of value-promoted blocks, zero-copy from the shadow
            bits_v = gl.load(bits + rk * B + split * BPS + it * BLK + jv, mask=valid_v, other=0)
            vany = gl.expand_dims(gl.expand_dims(gl.expand_dims((bits_v >> G) != 0, 1), 2), 3)
            vbase = (((bid_v // M) * H + h) * 2 + 1) * (M * N * D) + (bid_v % M) * (N * D)
            vrow = shadow + gl.expand_dims(gl.expand_dims(gl.expand_dims(vbase, 1), 2), 3) + nv * D + qv * 8 + xv * 2
            vsel = vm1 & vany & (xv < 4)
            f_e = gl.load(vrow, mask=vsel, other=0.0).to(gl.float32)
            f_o = gl.load(vrow + 1, mask=vsel, other=0.0).to(gl.float32)
            bo, valid_o, _bid_o, _base_o = _blocks(jo, it, split, BPS, B, nf, tables, r, TB_STRIDE, num_blocks, h, H, M,
                                        PAGE_BYTES, BLK)  # fmt: skip
            bits_o = gl.load(bits + rk * B + bo, mask=valid_o, other=0)
            vb4 = ((gl.expand_dims(bits_o, 1) >> (G + go2)) & 1) != 0  # [BLK, GP] (LBO)
            vb4 = gl.expand_dims(gl.expand_dims(vb4, 2), 3)  # [BLK, GP, 1, 1] (LO)
            num_e = gl.where(vb4, gl.sum(w5 * gl.expand_dims(f_e, 1), axis=2), num_e)
            num_o = gl.where(vb4, gl.sum(w5 * gl.expand_dims(f_o, 1), axis=2), num_o)
        acc_e += num_e.to(gl.float64)
        acc_o += num_o.to(gl.float64)
        d64 = den_b.to(gl.float64)
        den64 += d64
        kb = ((gl.expand_dims(bits_b, 1) >> g2) & 1) != 0  # [BLK, GP] keys promoted
        av64 += gl.where(valid2 & ~vbits, d64 * gl.expand_dims(eta_b, 1), 0.0)
        at64 += gl.where(valid2 & ~kb, d64, 0.0)
        lm = gl.where(den_b > 0, mg + gl.log(gl.where(den_b > 0, den_b, 1.0)), float("-inf"))
        gl.store(exact_lm + (rk * G + g2) * B + gl.expand_dims(bb, 1), lm, mask=kb & valid2 & (g2 < G))
    # the warps' partial sums, float64
    orow = (rk * S + split) * G + g2  # [1, GP] (LB)
    gm = g2 < G
    gl.store(den + orow, gl.sum(den64, axis=0)[None, :], mask=gm)
    gl.store(aval + orow, gl.sum(av64, axis=0)[None, :], mask=gm)
    gl.store(atail + orow, gl.sum(at64, axis=0)[None, :], mask=gm)
    LA: gl.constexpr = gl.SliceLayout(0, LO)  # [GP, Q, 4]
    go = gl.expand_dims(gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, LA))), 1), 2)
    qo = gl.expand_dims(gl.expand_dims(gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA))), 0), 2)
    xo = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LA))), 0), 1)
    optr = acc + ((rk * S + split) * G + go) * D + qo * 8 + xo * 2  # [GP, Q, 4]
    om = (go < G) & (qo < Q) & (xo < 4)
    gl.store(optr, gl.sum(acc_e, axis=0), mask=om)
    gl.store(optr + 1, gl.sum(acc_o, axis=0), mask=om)


def launch(out, geo, scores, mmax, shadow, pages, tables, nfull, bits, active, exact_lm, num_warps) -> None:
    """Launch the Gluon attend pass into the :class:`phase2.AttendOut` buffers ``out``."""
    from .common import device_arg, next_pow2

    R = scores.shape[0]
    lay = geo.layout
    _attend_gluon_kernel[(R * geo.num_kv_heads, geo.splits)](
        scores, mmax, device_arg(shadow), pages, pages.view(torch.float16), pages.view(torch.float32),
        tables, nfull, bits, active, out.acc, out.den, out.aval, out.atail, exact_lm,
        geo.num_blocks, tables.shape[1], tables.stride(0), geo.splits, geo.blocks_per_split,
        H=geo.num_kv_heads, G=geo.group, GP=next_pow2(geo.group), D=lay.head_dim, M=geo.sub_blocks,
        GRP=lay.value_group, NG=lay.groups, BLK=num_warps, PAGE_BYTES=lay.page_bytes, V_CODES=lay.v_codes,
        V_SCALE=lay.v_scale, V_ZERO=lay.v_zero, HEADER=lay.header, num_warps=num_warps,
    )  # fmt: skip
