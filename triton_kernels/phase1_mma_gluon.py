"""Phase 1 with the INT8 scores on the tensor cores, in Gluon: the arithmetic of ``phase1_mma._phase1_mma_kernel``
(read its docstring and ``docs/certification.md`` §5.2 first) with the register layouts and the operand staging
chosen by hand.

One program per (row, KV head, split); its ``BLK`` warps take one 16-token block each per iteration:

1. **Query side** in ``LQ`` over ``[BLK, GP, D]`` (one block per warp, the GP heads over GP lanes, ``VQ``
   contiguous channels per lane): x = q''·LUT[j] (the fixed-point scaled query, no σ formed), the block's sums
   P = Σ|p̃|, L″ = Σ q'ℓ' over the mid-offsets ℓ' = fl(ℓ̃ + 128σ) and W = Σ|q'ℓ'| (``VQ`` terms in a thread, then a
   shuffle tree over the 32/GP channel lanes),
   Δ_b and R_b; X = rint(x) as four int8 limbs: the biased word (X + 0x808080) ^ 0x808080 holds them as bytes, and
   a 4×4 byte transpose (eight ``prmt``) over four consecutive channels gives one word of four channels per limb,
   stored to shared memory as the ``[C, D]`` int8 limb matrix of the block (row k·GP + g, channels contiguous).
2. **Codes** in ``LK`` as int32 words ``[BLK, 16, D/4]`` (16-byte loads), XOR 0x80808080, to shared memory (read
   back as int8 bytes: the two views of each buffer have the same rows and 16-byte chunks, so the same swizzle).
3. **MMA**: both operands loaded from shared memory in the mma layouts (``ldmatrix``), one ``mma.sync``
   m16n8k32 int8 chain per block (M = the 16 tokens, N = the C limb columns, K = D), int32 exact.
4. **Epilogue** in the accumulator's layout: J·2^(e−8k) (exact), the four limbs summed, L″ added, ℓ⁸_b, the
   block maximum and max|s|, and the stores.

Used on CUDA when Gluon is available and the shape fits (:func:`supported`); the Triton kernel remains the
implementation under the interpreter (CPU tests) and the fallback.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra import libdevice

from certvllm.bounds.int8_scores import (
    MMA_E_MAX,
    MMA_E_MIN,
    MMA_EXPONENT_MAX,
    MMA_GRID_MAX,
    MMA_GRID_MIN,
    MMA_HEADROOM,
    mma_score_rounding_factors,
)

from .gluon_common import pow2, reinterpret
from .phase1_mma import head_pad
from .shape_class import JIT_OPTIONS

_TRANSPOSE_4X4 = gl.constexpr(
    "{ .reg .b32 t0, t1, t2, t3;"
    " prmt.b32 t0, $4, $5, 0x5140; prmt.b32 t1, $4, $5, 0x7362;"
    " prmt.b32 t2, $6, $7, 0x5140; prmt.b32 t3, $6, $7, 0x7362;"
    " prmt.b32 $0, t1, t3, 0x7632; prmt.b32 $1, t1, t3, 0x5410;"
    " prmt.b32 $2, t0, t2, 0x7632; prmt.b32 $3, t0, t2, 0x5410; }"
)
"""Four words of four bytes [a3, a2, a1, a0] (channels c … c+3) → four words [a_k(c) … a_k(c+3)], k = 0 … 3."""


def supported(head_dim: int, group: int, num_warps: int, blk: int) -> bool:
    """Shapes the kernel handles: D a power of two in [64, 256], G ≤ 8 (C = 4·GP ≤ 32 limb columns), one block per
    warp."""
    dp = 1 << max(0, (head_dim - 1).bit_length())
    return dp == head_dim and 64 <= head_dim <= 256 and 1 <= group <= 8 and blk == num_warps


@gluon.jit
def _ceil_log2_pos(x):
    """⌈log₂ x⌉ (int32) of a float32 x > 0 from its bits (a subnormal gives −126: an upper bound)."""
    bits = x.to(gl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 127
    return gl.where((bits & 8388607) != 0, e + 1, e)


@gluon.jit
def _limb_words(x, BLK: gl.constexpr, GP: gl.constexpr, D: gl.constexpr):
    """x ``[BLK, GP, D]`` (fixed point, |x| ≤ 126·2^24) → ``[BLK, 4·GP, D/4]`` int32: word (k·GP + g, i) holds limb k
    of X = rint(x) for the channels 4i … 4i+3 of head g, one byte each (int8, channel order)."""
    xi = libdevice.rint(x).to(gl.int32)
    z = (xi + 8421504) ^ 8421504  # bytes [a3, a2, a1, a0] as int8: X = Σ_k a_k·256^(3−k)
    z4 = gl.reshape(z, [BLK, GP, D // 4, 2, 2])
    z01, z23 = gl.split(z4)  # [BLK, GP, D/4, 2]: channels 4i + (0, 1) and 4i + (2, 3)
    z0, z1 = gl.split(z01)
    z2, z3 = gl.split(z23)
    w0, w1, w2, w3 = gl.inline_asm_elementwise(
        _TRANSPOSE_4X4, "=r,=r,=r,=r,r,r,r,r", [z0, z2, z1, z3], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=1,
    )  # fmt: skip
    words = gl.join(gl.join(w0, w1), gl.join(w2, w3))  # [BLK, GP, D/4, i, o]: limb 2·o + i
    return gl.reshape(gl.permute(words, [0, 4, 3, 1, 2]), [BLK, 4 * GP, D // 4])


@gluon.jit
def _block_loads(it, split, BPS, B, nf, jb_q, tables, r, TB_STRIDE, num_blocks, h, pages_u8, pages_i8, pages_f16,
                 pages_f32, pages_i32, nk, dk, dq, H: gl.constexpr, M: gl.constexpr, D: gl.constexpr, PAGE_BYTES: gl.constexpr,
                 K_OFFSET: gl.constexpr, K_SCODE: gl.constexpr, HEADER: gl.constexpr, LK_b: gl.constexpr):  # fmt: skip
    """Every global load of iteration ``it``:
    block columns ``bb`` [BLK] in and past the table (``inb``, ``valid``), the codes ``[BLK, 16, D/4]`` int32 words
    (in ``LK``), η, ν, flags, the exponent E_b (clamped to [−126, 127]) ``[BLK]``, the offsets ``[BLK, 1, D]`` float16 and
    the scale codes ``[BLK, 1, D]`` uint8 (in ``LQ``)."""
    ib = it * jb_q.shape[0] + jb_q
    bb = split * BPS + ib
    inb = (bb < B) & (ib < BPS)
    valid = inb & (bb < nf)
    bid = gl.minimum(gl.maximum(gl.load(tables + r * TB_STRIDE + bb, mask=inb, other=0), 0), num_blocks - 1)
    base = ((bid // M) * H + h) * (M * PAGE_BYTES) + (bid % M) * PAGE_BYTES  # [BLK]
    base_k = gl.expand_dims(gl.expand_dims(gl.convert_layout(base // 4, LK_b), 1), 2)
    valid_k = gl.expand_dims(gl.expand_dims(gl.convert_layout(valid, LK_b), 1), 2)
    # the codes as int32 words (four channels each; 0x80808080 where masked: code − 128 = 0 after the XOR)
    codes = gl.load((pages_i32 + base_k) + (nk * (D // 4) + dk), mask=valid_k & (dk < D // 4), other=-2139062144)
    e_b = gl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0)
    n_b = gl.load(pages_f32 + (base + HEADER) // 4 + 1, mask=valid, other=0.0)
    flags = gl.load(pages_u8 + base + HEADER + 9, mask=valid, other=1).to(gl.int32)
    ex = gl.minimum(gl.maximum(gl.load(pages_i8 + base + HEADER + 8, mask=valid, other=0).to(gl.int32), -126), 127)
    base3 = gl.expand_dims(gl.expand_dims(base, 1), 2)  # [BLK, 1, 1]
    vd = gl.expand_dims(gl.expand_dims(valid, 1), 2) & (dq < D)
    off = gl.load(pages_f16 + (base3 + K_OFFSET) // 2 + dq, mask=vd, other=0.0)
    sc = gl.load(pages_u8 + base3 + K_SCODE + dq, mask=vd, other=0)
    return bb, inb, valid, codes, e_b, n_b, flags, ex, off, sc


@gluon.jit(**JIT_OPTIONS)
def _phase1_mma_gluon_kernel(
    qs, pages_u8, pages_i8, pages_f16, pages_f32, pages_i32, tables, nfull, lut,
    scores, l8, m8, delta, eta, nu, rmax, amax, bad,
    num_blocks, B, TB_STRIDE, BPS, DELTA_F, ROUND_W, ROUND_P, ROUND_S,
    H: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, M: gl.constexpr, BLK: gl.constexpr,
    PAGE_BYTES: gl.constexpr, K_OFFSET: gl.constexpr, K_SCODE: gl.constexpr, HEADER: gl.constexpr,
    HEADROOM: gl.constexpr, E_MIN: gl.constexpr, E_MAX: gl.constexpr, GRID_MIN: gl.constexpr,
    GRID_MAX: gl.constexpr, EXP_MAX: gl.constexpr,
):  # fmt: skip
    """The arguments of ``phase1_mma._phase1_mma_kernel`` (documented there; libdevice always), and ``pages_i32`` (the
    pages as int32 words: the codes are loaded four at a time)."""
    N: gl.constexpr = 16
    C: gl.constexpr = 4 * GP
    TQ: gl.constexpr = 32 // GP  # lanes over the channels of the query side
    VQ: gl.constexpr = D // TQ  # contiguous channels per lane
    TD: gl.constexpr = D // 16  # lanes over the channels of the codes (16 bytes each)
    TN: gl.constexpr = 32 // TD
    LQ: gl.constexpr = gl.BlockedLayout([1, 1, VQ], [1, GP, TQ], [BLK, 1, 1], [2, 1, 0])
    LK: gl.constexpr = gl.BlockedLayout([1, N // TN, 4], [1, TN, TD], [BLK, 1, 1], [2, 1, 0])  # code words
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[BLK, 1, 1], instr_shape=[1, 16, 8])
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    PHASES: gl.constexpr = 8 if D // 16 > 8 else D // 16  # 16-byte chunks per row, at most 8 swizzle phases
    S8: gl.constexpr = gl.SwizzledSharedLayout(16, 1, PHASES, [2, 1, 0])  # int8 [BLK, rows, D], 16-byte chunks
    # the limb matrix is written as int32 [BLK, C, D/4] and read as int8 [BLK, C, D]: the same rows, the same
    # 16-byte chunks, so the same swizzle on both views
    S32: gl.constexpr = gl.SwizzledSharedLayout(4, 1, PHASES, [2, 1, 0])
    LQ_b: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LQ))
    LQ_g: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, LQ))
    LQ_d: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LQ))
    LK_b: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LK))
    LK_n: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, LK))
    LK_d: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LK))
    LM_b: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, MMA))
    LM_c: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, MMA))

    rk = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    r = rk // H
    h = rk % H
    nf = gl.load(nfull + r)
    # ---- the query, once: q'' = q'·2^(24 − e_q) ([1, GP, D] in LQ); e_q per head ([1, GP]) and per limb column
    gq = gl.expand_dims(gl.expand_dims(gl.arange(0, GP, layout=LQ_g), 0), 2)  # [1, GP, 1]
    dq = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=LQ_d), 0), 1)  # [1, 1, D]
    q = gl.load(qs + (r * (H * G) + h * G + gq) * D + dq, mask=(gq < G) & (dq < D), other=0.0)
    qa = gl.abs(q)
    qmax = gl.max(gl.where(qa < float("inf"), qa, 0.0), axis=2)  # [1, GP]
    e_raw = gl.where(qmax > 0, _ceil_log2_pos(qmax * ((1.0 + 2.0**-20) / HEADROOM)), E_MIN)
    e_q = gl.minimum(gl.maximum(e_raw, E_MIN), E_MAX)
    zero_head = qmax == 0
    qx = q * gl.expand_dims(pow2(24 - e_q), 2)  # [1, GP, D]
    unit = pow2(e_q - 24)  # [1, GP]: L″ and A are summed in units of 2^(e_q − 24)
    gq2 = gl.expand_dims(gl.arange(0, GP, layout=LQ_g), 0)  # [1, GP]
    cm = gl.arange(0, C, layout=LM_c)  # limb columns k·GP + g
    g_c = cm % GP
    k_c = cm // GP
    e_raw_c = cm * 0
    zero_c = cm < 0
    for g in gl.static_range(GP):  # the per-head values spread over the columns (exact: integers and flags)
        e_raw_c = gl.where(g_c == g, gl.sum(gl.sum(gl.where(gq2 == g, e_raw, 0), axis=1), axis=0), e_raw_c)
        zero_c = zero_c | ((g_c == g) & (gl.sum(gl.sum(gl.where(gq2 == g, zero_head.to(gl.int32), 0), axis=1),
                                                axis=0) > 0))  # fmt: skip
    e_q_c = gl.expand_dims(gl.expand_dims(gl.minimum(gl.maximum(e_raw_c, E_MIN), E_MAX), 0), 1)  # [1, 1, C]
    e_raw_c = gl.expand_dims(gl.expand_dims(e_raw_c, 0), 1)
    zero_c = gl.expand_dims(gl.expand_dims(zero_c, 0), 1)
    k_c = gl.expand_dims(gl.expand_dims(k_c, 0), 1)

    sa32 = gl.allocate_shared_memory(gl.int32, [BLK, N, D // 4], S32)  # written as words, read as bytes
    sa = reinterpret(sa32, gl.int8, [BLK, N, D], S8)
    sb32 = gl.allocate_shared_memory(gl.int32, [BLK, C, D // 4], S32)
    sb = reinterpret(sb32, gl.int8, [BLK, C, D], S8)

    jb_q = gl.arange(0, BLK, layout=LQ_b)
    nk = gl.expand_dims(gl.expand_dims(gl.arange(0, N, layout=LK_n), 0), 2)  # [1, N, 1]
    dk = gl.expand_dims(gl.expand_dims(gl.arange(0, D // 4, layout=LK_d), 0), 1)  # [1, 1, D/4] code words
    # (the next iteration's loads are not prefetched into registers: on the H200 that cost 50 registers and was
    # slower, docs/performance.md)
    for it in range(0, gl.cdiv(BPS, BLK)):
        bb_q, inb_q, valid_q, codes, e_b, n_b, flags, ex, off, sc = _block_loads(
            it, split, BPS, B, nf, jb_q, tables, r, TB_STRIDE, num_blocks, h, pages_u8, pages_i8, pages_f16, pages_f32,
            pages_i32, nk, dk, dq, H, M, D, PAGE_BYTES, K_OFFSET, K_SCODE, HEADER, LK_b,
        )  # fmt: skip
        # ---- codes → shared memory (XOR 0x80: code − 128 as int8)
        sa32.store(codes ^ -2139062144)  # each byte XOR 0x80
        # ---- page header and key metadata
        pb = rk * B + bb_q  # [BLK]
        gl.store(eta + pb, gl.where(valid_q, e_b, 0.0), mask=inb_q)
        gl.store(nu + pb, gl.where(valid_q, n_b, 0.0), mask=inb_q)
        gl.store(bad + pb, (valid_q & (((flags & 2) != 0) | ((flags & 1) == 0))).to(gl.int32), mask=inb_q)
        off = off.to(gl.float32)  # [BLK, 1, D]
        mant = gl.load(lut + sc.to(gl.int32))  # LUT[j]
        # ---- the query side: x, the block's sums, Δ_b and R_b, the limbs → shared memory
        ex2 = gl.expand_dims(ex, 1)  # [BLK, 1]
        e = ex2 + e_q  # [BLK, GP]
        in_range = zero_head | ((e_raw <= E_MAX) & (e >= GRID_MIN) & (e <= GRID_MAX) & (ex2 <= EXP_MAX))
        e = gl.minimum(gl.maximum(e, GRID_MIN), GRID_MAX)
        x = qx * mant  # [BLK, GP, D] p̃·2^(24 − e)
        p_sum = gl.sum(gl.abs(x), axis=2) * pow2(e - 24)  # [BLK, GP] P = Σ|p̃|
        # L″ = Σ q'ℓ' over the block's mid-offsets ℓ' = fl(ℓ̃ + 128σ), in units of 2^(e_q − 24); W = Σ|q'ℓ'|
        mid = off + 128.0 * (mant * gl.expand_dims(pow2(ex2), 2))  # [BLK, 1, D]
        w = qx * mid
        lo = gl.sum(w, axis=2) * unit  # L″
        w_sum = gl.sum(gl.abs(w), axis=2) * unit
        rb = gl.where(in_range, w_sum * ROUND_W + p_sum * ROUND_P + ROUND_S * pow2(e), float("inf"))
        grow = (rk * G + gq2) * B + gl.expand_dims(bb_q, 1)  # [BLK, GP]
        gmask = gl.expand_dims(inb_q, 1) & (gq2 < G)
        valid2 = gl.expand_dims(valid_q, 1)
        gl.store(delta + grow, gl.where(valid2, p_sum * DELTA_F, 0.0), mask=gmask)
        gl.store(rmax + grow, gl.where(valid2, rb, 0.0), mask=gmask)
        sb32.store(_limb_words(x, BLK, GP, D))
        # ---- the MMA: codes [BLK, N, D] × limbs [BLK, D, C] → [BLK, N, C] int32, exact
        jk = mma_v2(sa.load(DA), sb.permute([0, 2, 1]).load(DB), gl.zeros([BLK, N, C], gl.int32, layout=MMA))
        # ---- the epilogue in the accumulator's layout
        ex_m = gl.expand_dims(gl.expand_dims(gl.convert_layout(ex, LM_b), 1), 2)  # [BLK, 1, 1]
        e_c = ex_m + e_q_c  # [BLK, 1, C]
        range_c = zero_c | ((e_raw_c <= E_MAX) & (e_c >= GRID_MIN) & (e_c <= GRID_MAX) & (ex_m <= EXP_MAX))
        e_c = gl.minimum(gl.maximum(e_c, GRID_MIN), GRID_MAX)
        terms = gl.where(range_c, jk.to(gl.float32) * pow2(e_c - 8 * k_c), 0.0)  # exact products (out of range: 0)
        s = gl.sum(gl.reshape(terms, [BLK, N, 4, GP]), axis=2)  # [BLK, N, GP]
        LS: gl.constexpr = s.type.layout
        LS_b: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LS))
        LS_n: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, LS))
        LS_g: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LS))
        s = s + gl.expand_dims(gl.convert_layout(lo, gl.SliceLayout(1, LS)), 1)
        valid_s = gl.convert_layout(valid_q, LS_b)
        valid_s3 = gl.expand_dims(gl.expand_dims(valid_s, 1), 2)
        s = gl.where(valid_s3, s, float("-inf"))
        mb = gl.max(s, axis=1)  # [BLK, GP]
        fin = gl.abs(mb) < float("inf")
        mref = gl.where(fin, mb, 0.0)
        ssum = gl.sum(gl.exp(s - gl.expand_dims(mref, 1)), axis=1)
        lb = gl.where(fin, mref + gl.log(gl.maximum(ssum, 1.0)), mb)
        smax = gl.max(gl.where(gl.abs(s) < float("inf"), gl.abs(s), 0.0), axis=1)
        bb_s = gl.convert_layout(bb_q, LS_b)
        pb_s = gl.expand_dims(gl.expand_dims(rk * B + bb_s, 1), 2)  # [BLK, 1, 1]
        n_s = gl.expand_dims(gl.expand_dims(gl.arange(0, N, layout=LS_n), 0), 2)  # [1, N, 1]
        g_s = gl.expand_dims(gl.expand_dims(gl.arange(0, GP, layout=LS_g), 0), 1)  # [1, 1, GP]
        gl.store((scores + pb_s * (G * N)) + (g_s * N + n_s), s, mask=valid_s3 & (g_s < G) & (n_s < N))
        LO: gl.constexpr = gl.SliceLayout(1, LS)  # [BLK, GP]: the per-(block, head) results
        g_o = gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(0, LO)), 0)  # [1, GP]
        bb_o = gl.expand_dims(gl.convert_layout(bb_q, gl.SliceLayout(1, LO)), 1)  # [BLK, 1]
        orow = (rk * G + g_o) * B + bb_o
        om = gl.expand_dims(gl.convert_layout(inb_q, gl.SliceLayout(1, LO)), 1) & (g_o < G)
        valid_o = gl.expand_dims(gl.convert_layout(valid_q, gl.SliceLayout(1, LO)), 1)
        gl.store(l8 + orow, gl.where(valid_o, lb, float("-inf")), mask=om)
        gl.store(m8 + orow, gl.where(valid_o, mb, float("-inf")), mask=om)
        gl.store(amax + orow, gl.where(valid_o, smax, 0.0), mask=om)


def launch_constants(layout, K: int, G: int, sub_blocks: int, num_warps: int) -> dict:
    """The compile-time arguments of :func:`_phase1_mma_gluon_kernel`: constexprs and ``num_warps``."""
    return dict(
        H=K, G=G, GP=head_pad(G), D=layout.head_dim, M=sub_blocks, BLK=num_warps, PAGE_BYTES=layout.page_bytes,
        K_OFFSET=layout.k_offset, K_SCODE=layout.k_scale_code, HEADER=layout.header, HEADROOM=float(MMA_HEADROOM),
        E_MIN=MMA_E_MIN, E_MAX=MMA_E_MAX, GRID_MIN=MMA_GRID_MIN, GRID_MAX=MMA_GRID_MAX, EXP_MAX=MMA_EXPONENT_MAX,
        num_warps=num_warps,
    )  # fmt: skip


def launch(out, qs: torch.Tensor, pages: torch.Tensor, tables, nfull, lut, layout, K, sub_blocks, delta_factor,
           splits, blocks_per_split, num_warps) -> None:  # fmt: skip
    """Launch into the :class:`phase1.Phase1Out` buffers ``out``."""
    R, Hq, D = qs.shape
    c_w, c_p, c_s = mma_score_rounding_factors(D)
    _phase1_mma_gluon_kernel[(R * K, splits)](
        qs, pages, pages.view(torch.int8), pages.view(torch.float16), pages.view(torch.float32), pages.view(torch.int32),
        tables, nfull, lut, out.scores, out.l8, out.m8, out.delta, out.eta, out.nu, out.rmax, out.amax, out.bad,
        pages.shape[0] * sub_blocks, tables.shape[1], tables.stride(0), blocks_per_split, delta_factor, c_w, c_p, c_s,
        **launch_constants(layout, K, Hq // K, sub_blocks, num_warps),
    )  # fmt: skip
