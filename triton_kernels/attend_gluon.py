"""The attend pass in Gluon (Triton's explicit-layout dialect): the outputs of ``phase2._attend_kernel`` with
the register layout, the staging and the summation order chosen by hand.

A program takes one (row, KV head, split) and one of ``CS`` parts of the value channels (CS = 1 by
default); its ``BLK`` warps take one 16-token block each per iteration. Per block:

1. **Weights once.** In a compact layout ``LC`` over ``[BLK, GP, TN, SN]`` (block, query head, token =
   TN·SN + s) every lane computes about GP/2 of the block's weights w = expf(s − m) (libdevice, ≤ 2 ulp)
   and den_b = Σ_t w (a 16-term float32 sum). The weights go to shared memory, ``[SN, BLK, GP, TN]``.
   (Computing them in the layout of the products instead would evaluate each expf on every lane that
   multiplies it: 16× the work at D = 128.)
2. **Products token by token.** In ``LA`` over ``[BLK, GP, TN, QC, VB]`` (``VB`` consecutive value bytes =
   2·VB channels per lane and token, the ``QC`` chunks over ``TQ`` lanes, the tokens over ``TN`` lanes,
   all query heads in registers), for each of the lane's ``SN`` tokens: one broadcast shared-memory load
   of its GP weights, the token's codes, scales and zeros, v̂ = z + c·s (rounded once) and
   num += w·v̂, a chain of fused multiply-adds (a reduction tree would leave half the products unfused).
3. **Float64 after SN tokens.** Each lane converts its SN-token float32 partial sums exactly to float64 and
   adds them to its own accumulators; the lanes' and the warps' partials are added in float64 once at
   the end.

Value-promoted blocks repeat step 2 over the unquantized values read zero-copy from the shadow. Whether an
iteration has one is bit ``it % 32`` of a mask that the program reduces over the blocks of 32 iterations at a
time, so the common iteration has no reduction across warps (one barrier pair, for the weights).

The float32 sums are thus over SN ≤ 16 of a block's tokens, in order: each is within γ_SN ≤ γ_N of its
exact value, and everything after it is float64, so the error terms of docs/certification.md §5.1 hold
(the float64 sums have at most TN·B + 1 terms, negligible there). Used on CUDA when Gluon is available
and the shape fits (``supported``); the Triton kernel remains the implementation under the interpreter
(CPU tests) and the fallback. ``benchmarks/bench_attend.py`` times and checks each configuration.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra import libdevice

from .gluon_common import reinterpret
from .shape_class import JIT_OPTIONS


def chunks(head_dim: int, parts: int, chunk_bytes: int) -> int:
    """Chunks of ``chunk_bytes`` value bytes per token in one of ``parts`` channel parts (QC)."""
    return head_dim // 2 // parts // chunk_bytes


def supported(head_dim: int, group: int, num_warps: int, blk: int, value_group: int, parts: int = 1,
              chunk_bytes: int = 2) -> bool:  # fmt: skip
    """Shapes the Gluon kernel handles: D a power of two in [32, 256], G ≤ 16, one block per warp, parts and
    chunks powers of two with at least 2 chunks per part, and value groups that a chunk never straddles."""
    dp = 1 << max(0, (head_dim - 1).bit_length())
    qc = chunks(head_dim, parts, chunk_bytes)
    pow2 = all(x > 0 and x & (x - 1) == 0 for x in (parts, chunk_bytes))
    return (
        dp == head_dim and 32 <= head_dim <= 256 and 1 <= group <= 16 and blk == num_warps and pow2
        and qc >= 2 and qc * chunk_bytes * parts * 2 == head_dim and value_group % (2 * chunk_bytes) == 0
    )  # fmt: skip


@gluon.jit
def _expand4(x):
    """[BLK] → [BLK, 1, 1, 1] (x in the innermost slice of a rank-4 layout)."""
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 1), 2), 3)


@gluon.jit
def _bit_or(a, b):
    return a | b


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


@gluon.jit(**JIT_OPTIONS)
def _attend_gluon_kernel(
    scores, mmax, shadow, pages_u8, pages_f16, pages_f32, tables, nfull, bits, active,
    acc, den, aval, atail, exact_lm,
    num_blocks, B, TB_STRIDE, S, BPS,
    H: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, M: gl.constexpr, GRP: gl.constexpr,
    NG: gl.constexpr, BLK: gl.constexpr, PAGE_BYTES: gl.constexpr, V_CODES: gl.constexpr, V_SCALE: gl.constexpr,
    V_ZERO: gl.constexpr, HEADER: gl.constexpr,
    CS: gl.constexpr,  # channel parts (programs per row, head and split)
    VB: gl.constexpr,  # value bytes per lane and token
):  # fmt: skip
    """The arguments of ``phase2._attend_kernel`` (documented there; D a power of two, so no DP, and libdevice
    always), plus ``CS`` and ``VB``. With ``CS`` parts each program writes its part's channels of ``acc``;
    part 0 writes ``den``, ``aval``, ``atail`` and ``exact_lm``."""
    N: gl.constexpr = 16
    DH: gl.constexpr = D // 2  # value bytes per token
    DHC: gl.constexpr = DH // CS  # value bytes per token in this program's part
    QC: gl.constexpr = DHC // VB  # chunks of VB bytes
    TQ: gl.constexpr = QC if QC < 32 else 32  # lanes over the chunks
    TN: gl.constexpr = 32 // TQ  # lanes over the tokens
    SN: gl.constexpr = N // TN  # tokens per lane
    SQ: gl.constexpr = QC // TQ  # chunks per lane
    LA: gl.constexpr = gl.BlockedLayout([1, GP, 1, SQ, VB], [1, 1, TN, TQ, 1], [BLK, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    LV: gl.constexpr = gl.SliceLayout(1, LA)  # [BLK, TN, QC, VB] one token's value bytes per lane
    LWT: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, LA))  # [BLK, GP, TN] one token's weights
    LC: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1], [1, 2, TN, SN], [BLK, 1, 1, 1], [3, 2, 1, 0])  # compact
    LB: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LC))  # [BLK, GP] per (block, head)
    L1: gl.constexpr = gl.SliceLayout(1, LB)  # [BLK]
    LV1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LV)))
    LA1: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LA))))
    WS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])  # [SN, BLK, GP, TN]
    pid = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    rk = pid // CS
    part = pid % CS
    r = rk // H
    h = rk % H
    jb = gl.arange(0, BLK, layout=L1)
    g2 = gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(0, LB)), 0)
    gc = gl.expand_dims(gl.expand_dims(g2, 2), 3)
    tc = gl.arange(0, TN, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LC))))
    tc = gl.expand_dims(gl.expand_dims(gl.expand_dims(tc, 0), 1), 3)
    sc = gl.arange(0, SN, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LC))))
    sc = gl.expand_dims(gl.expand_dims(gl.expand_dims(sc, 0), 1), 2)
    tok_c = tc * SN + sc
    jv = gl.arange(0, BLK, layout=LV1)
    tv = gl.arange(0, TN, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LV))))
    tv = gl.expand_dims(gl.expand_dims(gl.expand_dims(tv, 0), 2), 3)  # [1, TN, 1, 1]
    qv = gl.arange(0, QC, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LV))))
    qv = gl.expand_dims(gl.expand_dims(gl.expand_dims(qv, 0), 1), 3)  # [1, 1, QC, 1]
    xv = gl.arange(0, VB, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV))))
    xv = gl.expand_dims(gl.expand_dims(gl.expand_dims(xv, 0), 1), 2)  # [1, 1, 1, VB]
    kbyte = part * DHC + qv * VB + xv
    gq = (2 * (part * DHC + qv * VB)) // GRP  # [1, 1, QC, 1] value group within the token
    jo = gl.arange(0, BLK, layout=LA1)
    LM: gl.constexpr = gl.BlockedLayout([1], [32], [BLK], [0])  # [32·BLK]: the blocks of 32 iterations
    im = gl.arange(0, 32 * BLK, layout=LM)
    go = gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LA)))))
    go = gl.expand_dims(go, 0)
    act = gl.load(active + rk)
    n_iter = gl.where(act != 0, gl.cdiv(BPS, BLK), 0)
    nf = gl.load(nfull + r)
    nf32 = nf.to(gl.int32)
    bits_row = bits + rk * B
    mg = gl.load(mmax + rk * G + g2, mask=g2 < G, other=0.0)
    mgc = gl.expand_dims(gl.expand_dims(mg, 2), 3)
    wsm = gl.allocate_shared_memory(gl.float32, [SN, BLK, GP, TN], WS)
    WT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])  # the same bytes, indexed by token
    wsx = reinterpret(wsm, gl.float32, [SN, BLK, GP, TN], WT)
    acc_e = gl.zeros([BLK, GP, TN, QC, VB], gl.float64, layout=LA)
    acc_o = gl.zeros([BLK, GP, TN, QC, VB], gl.float64, layout=LA)
    den64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    av64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    at64 = gl.zeros([BLK, GP], gl.float64, layout=LB)
    vmask = act * 0  # int32: bit i set when iteration 32·(it // 32) + i has a value-promoted block
    for it in range(0, n_iter):
        bb, valid, bid, base = _blocks(jb, it, split, BPS, B, nf, tables, r, TB_STRIDE, num_blocks, h, H, M,
                                       PAGE_BYTES, BLK)  # fmt: skip
        bits_b = gl.load(bits + rk * B + bb, mask=valid, other=0)
        eta_b = gl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0).to(gl.float64)
        valid2 = gl.expand_dims(valid, 1)
        sptr = scores + (_expand4(rk * B + bb) * G + gc) * N + tok_c
        sw = gl.load(sptr, mask=_expand4(valid) & (gc < G) & (tok_c < N), other=float("-inf"))
        w_c = libdevice.exp(sw - mgc)  # [BLK, GP, TN, SN] (LC)
        den_b = gl.sum(gl.sum(w_c, axis=3), axis=2)
        wsm.store(gl.permute(w_c, [3, 0, 1, 2]))  # [SN, BLK, GP, TN]; the compiler adds the barriers
        _bb_v, valid_v, bid_v, base_v = _blocks(jv, it, split, BPS, B, nf, tables, r, TB_STRIDE, num_blocks, h, H, M,
                                                PAGE_BYTES, BLK)  # fmt: skip
        base4 = _expand4(base_v)
        vm = _expand4(valid_v) & (tv < TN) & (qv < QC)  # [BLK, TN, QC, 1]
        num_e = gl.zeros([BLK, GP, TN, QC, VB], gl.float32, layout=LA)
        num_o = gl.zeros([BLK, GP, TN, QC, VB], gl.float32, layout=LA)
        for t in gl.static_range(SN):  # the lane's tokens tn·SN + t, one FMA per (head, channel) each
            w5 = gl.expand_dims(gl.expand_dims(wsx.index(t).load(LWT), 3), 4)  # [BLK, GP, TN, 1, 1] broadcast
            tok = tv * SN + t
            grp = (tok * NG + gq).to(gl.int64)
            vsc = gl.load(pages_f16 + (base4 + V_SCALE) // 2 + grp, mask=vm, other=0.0).to(gl.float32)
            vze = gl.load(pages_f16 + (base4 + V_ZERO) // 2 + grp, mask=vm, other=0.0).to(gl.float32)
            byte = gl.load((pages_u8 + base4 + V_CODES) + (tok * DH + kbyte), mask=vm & (xv < VB), other=0)
            byte = byte.to(gl.int32)
            num_e = num_e + w5 * gl.expand_dims(vze + (byte & 15).to(gl.float32) * vsc, 1)
            num_o = num_o + w5 * gl.expand_dims(vze + (byte >> 4).to(gl.float32) * vsc, 1)
        vbits = ((gl.expand_dims(bits_b, 1) >> (G + g2)) & 1) != 0
        # whether any of the iteration's blocks has values promoted: bit it % 32 of a mask that the program's
        # threads reduce once per 32 iterations (a reduction across the warps per iteration costs two barriers)
        if it % 32 == 0:
            ib_m = it * BLK + im
            bb_m = split * BPS + ib_m
            bm = gl.load(bits_row + bb_m, mask=(bb_m < B) & (ib_m < BPS) & (bb_m < nf32), other=0)
            vmask = gl.reduce(gl.where((bm >> G) != 0, 1 << (im // BLK), 0), 0, _bit_or)
        anyv = ((vmask >> (it % 32)) & 1) != 0
        if anyv:  # unquantized values of value-promoted blocks, zero-copy from the shadow
            bits_v = gl.load(bits + rk * B + split * BPS + it * BLK + jv, mask=valid_v, other=0)
            vsel = vm & _expand4((bits_v >> G) != 0) & (xv < VB)
            vbase = _expand4((((bid_v // M) * H + h) * 2 + 1) * (M * N * D) + (bid_v % M) * (N * D))
            nf_e = gl.zeros([BLK, GP, TN, QC, VB], gl.float32, layout=LA)
            nf_o = gl.zeros([BLK, GP, TN, QC, VB], gl.float32, layout=LA)
            for t in gl.static_range(SN):
                w5 = gl.expand_dims(gl.expand_dims(wsx.index(t).load(LWT), 3), 4)
                vrow = shadow + vbase + (tv * SN + t) * D + 2 * kbyte
                nf_e = nf_e + w5 * gl.expand_dims(gl.load(vrow, mask=vsel, other=0.0).to(gl.float32), 1)
                nf_o = nf_o + w5 * gl.expand_dims(gl.load(vrow + 1, mask=vsel, other=0.0).to(gl.float32), 1)
            bo, valid_o, _bid_o, _base_o = _blocks(jo, it, split, BPS, B, nf, tables, r, TB_STRIDE, num_blocks, h,
                                                   H, M, PAGE_BYTES, BLK)  # fmt: skip
            bits_o = gl.load(bits + rk * B + bo, mask=valid_o, other=0)
            vb5 = ((gl.expand_dims(bits_o, 1) >> (G + go)) & 1) != 0
            vb5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(vb5, 2), 3), 4)
            num_e = gl.where(vb5, nf_e, num_e)
            num_o = gl.where(vb5, nf_o, num_o)
        acc_e += num_e.to(gl.float64)
        acc_o += num_o.to(gl.float64)
        d64 = den_b.to(gl.float64)
        den64 += d64
        kb = ((gl.expand_dims(bits_b, 1) >> g2) & 1) != 0
        av64 += gl.where(valid2 & ~vbits, d64 * gl.expand_dims(eta_b, 1), 0.0)
        at64 += gl.where(valid2 & ~kb, d64, 0.0)
        lm = gl.where(den_b > 0, mg + gl.log(gl.where(den_b > 0, den_b, 1.0)), float("-inf"))
        gl.store(exact_lm + (rk * G + g2) * B + gl.expand_dims(bb, 1), lm,
                 mask=kb & valid2 & (g2 < G) & (part == 0))  # fmt: skip
    if act != 0:  # an inactive group (the exact re-run's unescalated ones) writes nothing
        # the lanes' and warps' partial sums, float64
        orow = (rk * S + split) * G + g2
        gm = (g2 < G) & (part == 0)
        gl.store(den + orow, gl.sum(den64, axis=0)[None, :], mask=gm)
        gl.store(aval + orow, gl.sum(av64, axis=0)[None, :], mask=gm)
        gl.store(atail + orow, gl.sum(at64, axis=0)[None, :], mask=gm)
        LO: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, LA))
        gq3 = gl.expand_dims(gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, LO))), 1), 2)
        qo = gl.expand_dims(gl.expand_dims(gl.arange(0, QC, layout=gl.SliceLayout(0, gl.SliceLayout(2, LO))), 0), 2)
        xo = gl.expand_dims(gl.expand_dims(gl.arange(0, VB, layout=gl.SliceLayout(0, gl.SliceLayout(1, LO))), 0), 1)
        optr = acc + ((rk * S + split) * G + gq3) * D + 2 * (part * DHC + qo * VB + xo)
        om = (gq3 < G) & (qo < QC) & (xo < VB)
        gl.store(optr, gl.sum(gl.sum(acc_e, axis=2), axis=0), mask=om)
        gl.store(optr + 1, gl.sum(gl.sum(acc_o, axis=2), axis=0), mask=om)


def launch_constants(geo, num_warps: int) -> dict:
    """The compile-time arguments of :func:`_attend_gluon_kernel` for ``geo`` (a ``phase2.Phase2Geometry``):
    constexprs, ``num_warps``, FMA contraction on, and the register cap."""
    from .common import next_pow2

    lay = geo.layout
    consts = dict(
        H=geo.num_kv_heads, G=geo.group, GP=next_pow2(geo.group), D=lay.head_dim, M=geo.sub_blocks,
        GRP=lay.value_group, NG=lay.groups, BLK=num_warps, PAGE_BYTES=lay.page_bytes, V_CODES=lay.v_codes,
        V_SCALE=lay.v_scale, V_ZERO=lay.v_zero, HEADER=lay.header, CS=geo.tuning.attend_parts,
        VB=geo.tuning.attend_chunk_bytes,
        num_warps=num_warps, enable_fp_fusion=True,  # the FMA chains (Triton 3.10 turns fusion off by default)
    )  # fmt: skip
    # the register cap (4 programs per SM at G ≤ 4) applies at G ≤ 4 only: at G = 8 it would spill hundreds
    # of bytes per thread
    if geo.tuning.attend_maxnreg and geo.group <= 4:
        consts["maxnreg"] = geo.tuning.attend_maxnreg
    return consts


def launch(out, geo, scores, mmax, shadow, pages, tables, nfull, bits, active, exact_lm, num_warps) -> None:
    """Launch the Gluon attend pass into the :class:`phase2.AttendOut` buffers ``out``."""
    from .common import device_arg

    R = scores.shape[0]
    _attend_gluon_kernel[(R * geo.num_kv_heads * geo.tuning.attend_parts, geo.splits)](
        scores, mmax, device_arg(shadow), pages, pages.view(torch.float16), pages.view(torch.float32),
        tables, nfull, bits, active, out.acc, out.den, out.aval, out.atail, exact_lm,
        geo.num_blocks, tables.shape[1], tables.stride(0), geo.splits, geo.blocks_per_split,
        **launch_constants(geo, num_warps),
    )  # fmt: skip
