"""Phase 1's kernel: the INT8 scores from an int8 MMA of the key codes against a fixed-point split of the scaled query
(``docs/certification.md`` §5.2), with the per-block terms of ``phase1.Phase1Out``.

Per block and query head the INT8 score is, in real arithmetic, ŝ_t = Σ_c q'_c·(ℓ̃_c + code_{t,c}·σ_c). The kernel
never forms k̂; per (block, query head) it rounds p̃_c = fl(q'_c·σ_c) to the fixed-point grid of a power of two
S = 2^e (``e = E_b + e_q``: the block's scale exponent plus a per-head exponent from max|q'|, so that
|p̃/S| ≤ 126 without a reduction), X_c = rint(p̃_c·2^(24−e)), an integer below 2^31 whose four bytes, biased by
0x808080, are four int8 limbs a_0…a_3 with X = Σ_k a_k·256^(3−k). One batched int8 ``tl.dot`` per iteration
multiplies the codes shifted to int8 (code − 128, a byte XOR) by the limbs, exactly in int32:
J_{k,t} = Σ_c a_{k,c}·(code_{t,c} − 128), |J| ≤ 2^14·D < 2^24. The shift is folded into the block's mid-offsets:

    ℓ'_c = fl(ℓ̃_c + 128·σ_c),   L″ = fl(Σ_c q'_c·ℓ'_c)      (a D-term float32 sum)
    s_t  = fl(L″ + Σ_k J_{k,t}·2^(e−8k))                       (five float32 terms, products exact)

and |s_t − ŝ_t| ≤ c_W·Σ_c|q'_c·ℓ'_c| + c_P·Σ_c|p̃_c| + c_S·2^e (``bounds.int8_scores.mma_score_rounding_factors``),
which is written as R_b. The coefficients are at least the float32 path's on the same sums, so R_b also bounds the
rounding of the exact scores the promotion pass computes for the block (every consumer reads R_b as "the rounding
of either score of this block"); for keys centred in their block it is within a few per cent of that path's R_b.

Everything else phase 1 writes: Δ_b = delta_factor·Σ_c|p̃_c| (the products |fl(q'·σ)|, scaled by a power of two),
ℓ⁸_b and the block maximum from the scores, η_b, ν_b and the page flags. The key scale σ = LUT[j]·2^E is never
formed per (head, channel): x = q''·LUT[j] with q'' = q'·2^(24 − e_q) is p̃·2^(24 − e) exactly.

Layout: ``BLK`` blocks per iteration as ``[BLK, 16, D]`` key tiles and ``[BLK, GP, D]`` query-side tiles, one block
per warp; the dot is batched over the blocks (each block has its own limbs). Runs under Triton's interpreter
(the CPU tests) and compiled; the byte XOR is one 32-bit operation per four codes when compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
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
from certvllm.formats.layout import PageLayout

from .common import launch_device_ok, next_pow2, page_base, pow2_f32, precise, split_columns, split_program
from .shape_class import JIT_OPTIONS
from .tuning import DEFAULT_TUNING, KernelTuning


def head_pad(group: int) -> int:
    """GP: query heads padded to a power of two ≥ 4 (the dot takes ≥ 16 columns: 4 limbs × GP)."""
    return max(4, next_pow2(group))


@triton.jit
def _ceil_log2_pos(x):
    """⌈log₂ x⌉ (int32) of a float32 x > 0 from its bits (a subnormal gives −126: an upper bound)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 127
    return tl.where((bits & 8388607) != 0, e + 1, e)


@triton.jit
def _rint_wide(x, PRECISE: tl.constexpr):
    """Round to nearest, ties to even, for any |x| < 2^31 (libdevice; the interpreter rounds through float64's
    magic number 1.5·2^52, exact below 2^51)."""
    if PRECISE:
        return libdevice.rint(x)
    else:
        return ((x.to(tl.float64) + 6755399441055744.0) - 6755399441055744.0).to(tl.float32)


@triton.jit
def _xor_sign_bits(codes, PRECISE: tl.constexpr):
    """code − 128 as int8: the byte XOR 0x80, four codes per 32-bit operation when compiled."""
    if PRECISE:
        flipped = tl.inline_asm_elementwise(
            "xor.b32 $0, $1, 0x80808080;", "=r,r", [codes], dtype=tl.uint8, is_pure=True, pack=4
        )
    else:
        flipped = codes ^ 0x80
    return flipped.to(tl.int8, bitcast=True)


@triton.jit
def _query_limbs(x, GP: tl.constexpr, PRECISE: tl.constexpr):
    """The limb matrix ``[BLK, D, 4·GP]`` int8 of x ``[BLK, GP, D]`` float32 (|x| ≤ 126·2^24, the fixed-point
    query): column k·GP + g holds limb k of head g (k = 0 most significant) of X = rint(x), X = Σ_k a_k·256^(3−k)."""
    xi = _rint_wide(x, PRECISE).to(tl.int32) + 8421504  # + 0x808080: the three low bytes biased to unsigned
    a0 = (xi >> 24).to(tl.int8)  # the signed top byte (arithmetic shift)
    a1 = (((xi >> 16) & 255) - 128).to(tl.int8)
    a2 = (((xi >> 8) & 255) - 128).to(tl.int8)
    a3 = ((xi & 255) - 128).to(tl.int8)
    pairs = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [BLK, GP, D, i, o]: limb 2·o + i
    BLK: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[2]
    return tl.reshape(tl.permute(pairs, (0, 2, 4, 3, 1)), (BLK, D, 4 * GP))


@triton.jit(**JIT_OPTIONS)
def _phase1_mma_kernel(
    qs,  # [R, H_q, D] float32 scaled queries fl(q·λ)
    pages_u8,  # cache.pages [E, H_kv, m·page_bytes] viewed as uint8
    pages_i8,  # the same storage as int8 (the exponent byte)
    pages_f16,  # the same storage as float16 (key offsets)
    pages_f32,  # the same storage as float32 (η, ν)
    tables,  # [R, ≥B] int64 16-token block ids (row stride TB_STRIDE)
    nfull,  # [R] int64 full blocks per row
    lut,  # [256] float32 key-scale mantissas (``formats.layout.key_scale_lut``)
    scores,  # out [R, H_kv, B, G, N] float32 INT8 scores (valid blocks only)
    l8,  # out [R, H_kv, G, B] float32 block log-mass (−inf past the last full block)
    m8,  # out [R, H_kv, G, B] float32 block max score (−inf past the last full block)
    delta,  # out [R, H_kv, G, B] float32 Δ_b (0 past the last full block)
    eta,  # out [R, H_kv, B] float32 η_b (0 past the last full block)
    nu,  # out [R, H_kv, B] float32 ν_b (0 past the last full block)
    rmax,  # out [R, H_kv, G, B] float32 R_b (0 past the last full block)
    amax,  # out [R, H_kv, G, B] float32 per-block max finite |s̃⁸| (0 past the last full block)
    bad,  # out [R, H_kv, B] int32 per block: a valid page is flagged or invalid
    num_blocks, B, TB_STRIDE, BPS,  # the split-K arguments (``common``)
    DELTA_F,  # float32 factor of Δ_b (on Σ|p̃|)
    ROUND_W,  # float32 factor of W = Σ|q'ℓ'| in R_b
    ROUND_P,  # float32 factor of P = Σ|p̃| in R_b
    ROUND_S,  # float32 factor of 2^e in R_b
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
    BLK: tl.constexpr,  # blocks per loop iteration (power of two)
    PAGE_BYTES: tl.constexpr, K_OFFSET: tl.constexpr, K_SCODE: tl.constexpr, HEADER: tl.constexpr,
    HEADROOM: tl.constexpr,  # |x| ≤ HEADROOM·2^24 (float)
    E_MIN: tl.constexpr, E_MAX: tl.constexpr,  # the clamp of e_q
    GRID_MIN: tl.constexpr, GRID_MAX: tl.constexpr, EXP_MAX: tl.constexpr,  # the kernel's range of e and E_b
    PRECISE: tl.constexpr,
):  # fmt: skip
    N: tl.constexpr = 16
    C: tl.constexpr = 4 * GP
    rk, split, r, h = split_program(H)
    jv = tl.arange(0, BLK)[:, None, None]  # [BLK, 1, 1]
    nv = tl.arange(0, N)[None, :, None]  # [1, N, 1]
    gv = tl.arange(0, GP)[None, :, None]  # [1, GP, 1]
    dv = tl.arange(0, D)[None, None, :]  # [1, 1, D]
    gs = tl.arange(0, GP)[None, None, :]  # [1, 1, GP]
    cs = tl.arange(0, C)[None, None, :]  # [1, 1, C]
    q = tl.load(qs + (r * (H * G) + h * G + gv) * D + dv, mask=gv < G, other=0.0)  # [1, GP, D]
    # e_q per head: 2^(E_b + e_q) ≥ max_c|q'_c|·2^E_b·(1 + 2^-20)/HEADROOM ≥ max_c|p̃_c|/HEADROOM (σ ≤ 2^E_b)
    qa = tl.abs(q)
    qmax = tl.max(tl.where(qa < float("inf"), qa, 0.0), axis=2, keep_dims=True)  # [1, GP, 1]
    e_raw = tl.where(qmax > 0, _ceil_log2_pos(qmax * ((1.0 + 2.0**-20) / HEADROOM)), E_MIN)
    e_q = tl.minimum(tl.maximum(e_raw, E_MIN), E_MAX)
    zero_head = qmax == 0
    qx = q * pow2_f32(24 - e_q)  # q'' = q'·2^(24 − e_q), exact: x = q''·LUT[j] is p̃·2^(24 − e), e = E_b + e_q
    nf = tl.load(nfull + r)
    for it in range(0, tl.cdiv(BPS, BLK)):
        bv, inb, valid = split_columns(it, jv, split, BPS, B, nf, BLK)  # [BLK, 1, 1]
        _, base = page_base(tables, r, TB_STRIDE, bv, inb, num_blocks, h, H, M, PAGE_BYTES)
        vm = valid & (dv < D)
        e_b = tl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0)
        n_b = tl.load(pages_f32 + (base + HEADER) // 4 + 1, mask=valid, other=0.0)
        flags = tl.load(pages_u8 + base + HEADER + 9, mask=valid, other=1).to(tl.int32)
        ex = tl.minimum(tl.maximum(tl.load(pages_i8 + base + HEADER + 8, mask=valid, other=0).to(tl.int32), -126), 127)
        off = tl.load(pages_f16 + (base + K_OFFSET) // 2 + dv, mask=vm, other=0.0).to(tl.float32)  # [BLK, 1, D]
        mant = tl.load(lut + tl.load(pages_u8 + base + K_SCODE + dv, mask=vm, other=0).to(tl.int32))  # LUT[j]
        codes = tl.load((pages_u8 + base) + (nv * D + dv), mask=vm, other=128)  # [BLK, N, D]
        badb = (valid & (((flags & 2) != 0) | ((flags & 1) == 0))).to(tl.int32)
        pb = rk * B + bv  # [BLK, 1, 1]
        tl.store(eta + pb, tl.where(valid, e_b, 0.0), mask=inb)
        tl.store(nu + pb, tl.where(valid, n_b, 0.0), mask=inb)
        tl.store(bad + pb, badb, mask=inb)
        # ---- the query side, all heads at once ([BLK, GP, D]): x = p̃·2^(24 − e) and the block's sums
        e = ex + e_q  # [BLK, GP, 1]
        in_range = zero_head | ((e_raw <= E_MAX) & (e >= GRID_MIN) & (e <= GRID_MAX) & (ex <= EXP_MAX))
        e = tl.minimum(tl.maximum(e, GRID_MIN), GRID_MAX)
        x = qx * mant
        p_sum = tl.sum(tl.abs(x), axis=2, keep_dims=True) * pow2_f32(e - 24)  # P = Σ|p̃|
        # L″ = Σ_c q'_c·ℓ'_c with the block's mid-offsets ℓ' = fl(ℓ̃ + 128σ) (the codes' shift folded in), summed in
        # units of 2^(e_q − 24); W = Σ|q'ℓ'| bounds its rounding and, with P, the key magnitudes
        mid = off + 128.0 * (mant * pow2_f32(ex))  # [BLK, 1, D]
        w = qx * mid
        unit = pow2_f32(e_q - 24)
        lo = tl.sum(w, axis=2, keep_dims=True) * unit
        w_sum = tl.sum(tl.abs(w), axis=2, keep_dims=True) * unit
        tl.store(delta + (rk * G + gv) * B + bv, tl.where(valid, p_sum * DELTA_F, 0.0), mask=inb & (gv < G))
        rb = tl.where(in_range, w_sum * ROUND_W + p_sum * ROUND_P + ROUND_S * pow2_f32(e), float("inf"))
        tl.store(rmax + (rk * G + gv) * B + bv, tl.where(valid, rb, 0.0), mask=inb & (gv < G))
        # ---- the codes against the limbs: exact int32, then five float32 terms per score
        jk = tl.dot(_xor_sign_bits(codes, PRECISE), _query_limbs(x, GP, PRECISE), out_dtype=tl.int32)  # [BLK, N, C]
        e_c = tl.reshape(tl.broadcast_to(tl.reshape(e, (BLK, 1, 1, GP)), (BLK, 1, 4, GP)), (BLK, 1, C))
        terms = jk.to(tl.float32) * pow2_f32(e_c - 8 * (cs // GP))  # exact: |J| < 2^24 times a power of two
        s = tl.sum(tl.reshape(terms, (BLK, N, 4, GP)), axis=2) + tl.reshape(lo, (BLK, 1, GP))  # [BLK, N, GP]
        s = tl.where(tl.reshape(in_range, (BLK, 1, GP)), s, 0.0)  # out of range: R_b = inf escalates the head
        s = tl.where(valid, s, float("-inf"))
        mb = tl.max(s, axis=1, keep_dims=True)  # [BLK, 1, GP]
        fin = tl.abs(mb) < float("inf")
        mref = tl.where(fin, mb, 0.0)
        ssum = tl.sum(tl.exp(s - mref), axis=1, keep_dims=True)
        lb = tl.where(fin, mref + tl.log(tl.maximum(ssum, 1.0)), mb)
        sa = tl.max(tl.where(tl.abs(s) < float("inf"), tl.abs(s), 0.0), axis=1, keep_dims=True)
        tl.store((scores + pb * (G * N)) + (gs * N + nv), s, mask=valid & (gs < G))
        orow = (rk * G + gs) * B + bv  # [BLK, 1, GP]
        om = inb & (gs < G)
        tl.store(l8 + orow, tl.where(valid, lb, float("-inf")), mask=om)
        tl.store(m8 + orow, tl.where(valid, mb, float("-inf")), mask=om)
        tl.store(amax + orow, tl.where(valid, sa, 0.0), mask=om)


def launch(out, qs: torch.Tensor, pages: torch.Tensor, tables: torch.Tensor, nfull: torch.Tensor, lut: torch.Tensor,
           layout: PageLayout, num_kv_heads: int, sub_blocks: int, delta_factor: float, splits: int,
           blocks_per_split: int, tuning: KernelTuning = DEFAULT_TUNING) -> None:  # fmt: skip
    """Launch into the :class:`phase1.Phase1Out` buffers ``out`` (shapes there; ``lut`` the key-scale table on the
    device). R_b is this kernel's own (``bounds.int8_scores.mma_score_rounding_factors``)."""
    launch_device_ok(pages)
    R, Hq, D = qs.shape
    K = num_kv_heads
    G = Hq // K
    c_w, c_p, c_s = mma_score_rounding_factors(D)
    _phase1_mma_kernel[(R * K, splits)](
        qs, pages, pages.view(torch.int8), pages.view(torch.float16), pages.view(torch.float32), tables, nfull, lut,
        out.scores, out.l8, out.m8, out.delta, out.eta, out.nu, out.rmax, out.amax, out.bad,
        pages.shape[0] * sub_blocks, tables.shape[1], tables.stride(0), blocks_per_split, delta_factor, c_w, c_p, c_s,
        H=K, G=G, GP=head_pad(G), D=D, M=sub_blocks, BLK=tuning.phase1_blk, PAGE_BYTES=layout.page_bytes,
        K_OFFSET=layout.k_offset, K_SCODE=layout.k_scale_code, HEADER=layout.header, HEADROOM=float(MMA_HEADROOM),
        E_MIN=MMA_E_MIN, E_MAX=MMA_E_MAX, GRID_MIN=MMA_GRID_MIN, GRID_MAX=MMA_GRID_MAX, EXP_MAX=MMA_EXPONENT_MAX,
        PRECISE=precise(), num_warps=tuning.phase1_warps,
    )  # fmt: skip
