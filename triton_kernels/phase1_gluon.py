"""Phase 1 in Gluon (Triton's explicit-layout dialect): the same outputs and the same arithmetic as
``phase1._phase1_kernel``, with the register layout chosen by hand instead of by Triton's layout
propagation.

One layout ``L`` serves every tile of the loop, ``[BLK, 16, DP]`` (blocks, tokens, channels): ``VEC``
contiguous channels per thread (one 16-byte load of key codes per token), the channels of a token over
``DP/VEC`` lanes, the 16 tokens over the remaining lanes (and in registers), one block per warp. So

* the D-term dot products (scores, and the Σ|q|σ, Σ|q|·k_max of Δ_b and R_b) reduce ``VEC`` products in
  a thread (``gl.sum``'s tree), then over ``DP/VEC`` lanes (3 shuffle rounds at D = 128) — any summation
  order is allowed by the certificate (γ_D, docs/certification.md §5);
* per-block reductions over the tokens stay inside one warp;
* nothing is converted between layouts inside the loop (no shared-memory round trips, no barriers).

The block ids of iteration ``it + 1`` are loaded during iteration ``it``, so a page's loads do not wait on a
load of ``tables`` first.

Δ_b and R_b do not depend on the token: they are computed for all heads at once with the heads on the token
lanes ([BLK, GP, D], the same reduction tree as a [BLK, 1, D] dot product, one store each), so each product
is formed once instead of on every token lane.

Used on CUDA when Gluon is available and the shape fits (``supported``); the Triton kernel remains the
implementation under the interpreter (CPU tests) and the fallback.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .shape_class import JIT_OPTIONS

VEC = 16  # key-code bytes per thread and token


def supported(head_dim: int, group: int, num_warps: int, blk: int) -> bool:
    """Shapes the Gluon kernel handles: 32 ≤ D (a power of two ≤ 512) and one block per warp."""
    dp = 1 << max(0, (head_dim - 1).bit_length())
    return dp == head_dim and 32 <= head_dim <= 512 and blk == num_warps and group >= 1


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
def _block_compute(
    ex,
    e_b,
    n_b,
    flags,
    off,
    sc,
    codes,
    bb,
    inb,
    valid,
    rk,
    qrow,
    lut,
    scores,
    l8,
    m8,
    delta,
    eta,
    nu,
    rmax,
    amax,
    bad,
    B,
    DELTA_F,
    ROUND_F,
    n2,
    dv,
    G: gl.constexpr,
    GP: gl.constexpr,
    N: gl.constexpr,
    D: gl.constexpr,
):
    """One iteration's arithmetic and stores, from the values :func:`_page_loads` returned."""
    ex = gl.minimum(gl.maximum(ex.to(gl.int32), -126), 127)
    two_e = ((ex + 127) << 23).to(gl.float32, bitcast=True)  # 2^E exactly
    flags = flags.to(gl.int32)
    badb = (valid & (((flags & 2) != 0) | ((flags & 1) == 0))).to(gl.int32)
    pb = rk * B + bb  # [BLK]
    gl.store(eta + pb, gl.where(valid, e_b, 0.0), mask=inb)
    gl.store(nu + pb, gl.where(valid, n_b, 0.0), mask=inb)
    gl.store(bad + pb, badb, mask=inb)
    valid2 = gl.expand_dims(valid, 1)  # [BLK, 1]
    off = off.to(gl.float32)
    sigma = gl.load(lut + sc.to(gl.int32)) * gl.expand_dims(gl.expand_dims(two_e, 1), 2)  # [BLK, 1, D] LUT[code]·2^E
    khat = off + codes.to(gl.float32) * sigma  # [BLK, N, D]
    kmag = gl.maximum(gl.abs(off), gl.abs(off + 255.0 * sigma)) + sigma  # [BLK, 1, D]
    srow = (scores + gl.expand_dims(pb, 1) * (G * N)) + n2  # [BLK, N]
    smask = valid2 & (n2 < N)
    # Δ_b and R_b of all heads at once, the heads on the token lanes: [BLK, GP, D] in the same layout, so each
    # product is formed once instead of on every token lane, with the same D-term reduction as a [BLK, 1, D]
    # dot product (bit for bit), and one store per quantity
    gi = gl.arange(0, GP, layout=gl.SliceLayout(0, n2.type.layout))  # [GP]
    g2 = gl.expand_dims(gi, 0)  # [1, GP]
    g3 = gl.expand_dims(g2, 2)  # [1, GP, 1]
    qa = gl.abs(gl.load(qrow + g3 * D + dv, mask=(g3 < G) & (dv < D), other=0.0))  # [1, GP, D]
    orow = (rk * G + g2) * B + gl.expand_dims(bb, 1)  # [BLK, GP]
    gmask = gl.expand_dims(inb, 1) & (g2 < G)
    gl.store(delta + orow, gl.where(valid2, gl.sum(sigma * qa, axis=2) * DELTA_F, 0.0), mask=gmask)
    gl.store(rmax + orow, gl.where(valid2, gl.sum(kmag * qa, axis=2) * ROUND_F, 0.0), mask=gmask)
    for g in gl.static_range(G):
        qg = gl.load(qrow + g * D + dv)  # [1, 1, D]
        s = gl.sum(khat * qg, axis=2)  # [BLK, N] D-term float32 dot products
        s = gl.where(valid2, s, float("-inf"))
        mb = gl.max(s, axis=1)  # [BLK]
        fin = gl.abs(mb) < float("inf")
        mref = gl.where(fin, mb, 0.0)
        ssum = gl.sum(gl.exp(s - gl.expand_dims(mref, 1)), axis=1)
        lb = gl.where(fin, mref + gl.log(gl.maximum(ssum, 1.0)), mb)  # ssum ≥ 1 when fin
        sa = gl.max(gl.where(gl.abs(s) < float("inf"), gl.abs(s), 0.0), axis=1)
        gl.store(srow + g * N, s, mask=smask)
        orow = (rk * G + g) * B + bb
        gl.store(l8 + orow, gl.where(valid, lb, float("-inf")), mask=inb)
        gl.store(m8 + orow, gl.where(valid, mb, float("-inf")), mask=inb)
        gl.store(amax + orow, gl.where(valid, sa, 0.0), mask=inb)


@gluon.jit(**JIT_OPTIONS)
def _phase1_gluon_kernel(
    qs,  # [R, H_q, D] float32 scaled queries fl(q·λ)
    pages_u8,  # cache.pages viewed as uint8
    pages_i8,  # as int8 (the exponent byte)
    pages_f16,  # as float16 (key offsets)
    pages_f32,  # as float32 (η, ν)
    tables,  # [R, ≥B] int64 block ids (row stride TB_STRIDE)
    nfull,  # [R] int64 full blocks per row
    lut,  # [256] float32 key-scale mantissas
    scores,  # out [R, H_kv, B, G, N] float32
    l8,  # out [R, H_kv, G, B]
    m8,  # out [R, H_kv, G, B]
    delta,  # out [R, H_kv, G, B]
    eta,  # out [R, H_kv, B]
    nu,  # out [R, H_kv, B]
    rmax,  # out [R, H_kv, G, B]
    amax,  # out [R, H_kv, G, B]
    bad,  # out [R, H_kv, B] int32
    num_blocks,
    B,
    TB_STRIDE,
    BPS,
    DELTA_F,
    ROUND_F,
    H: gl.constexpr,
    G: gl.constexpr,
    GP: gl.constexpr,  # next power of two ≥ G
    D: gl.constexpr,
    M: gl.constexpr,
    BLK: gl.constexpr,
    PAGE_BYTES: gl.constexpr,
    K_OFFSET: gl.constexpr,
    K_SCODE: gl.constexpr,
    HEADER: gl.constexpr,
    VEC: gl.constexpr,
):
    """One program per (row, KV head, split): per iteration the page loads of ``BLK`` blocks (their ids loaded
    one iteration ahead), then the arithmetic and stores (``_block_compute``)."""
    N: gl.constexpr = 16
    rk, split, r, h, jb, n2, nv, dv, nf, qrow = _setup(qs, nfull, H, G, D, BLK, VEC)
    bb, inb, valid = _cols(0, jb, split, BPS, B, nf, BLK)
    bid = _block_ids(tables, r, TB_STRIDE, bb, inb, num_blocks)
    for it in range(0, gl.cdiv(BPS, BLK)):
        bb, inb, valid = _cols(it, jb, split, BPS, B, nf, BLK)
        ex, e_b, n_b, flags, off, sc, codes = _page_loads(
            pages_u8, pages_i8, pages_f16, pages_f32, bid, valid, h, nv, dv, H, D, N, M, PAGE_BYTES, K_OFFSET, K_SCODE,
            HEADER, BLK, VEC,
        )  # fmt: skip
        bb1, inb1, valid1 = _cols(it + 1, jb, split, BPS, B, nf, BLK)
        bid = _block_ids(tables, r, TB_STRIDE, bb1, inb1, num_blocks)  # iteration it + 1's (0 past the end)
        _block_compute(
            ex, e_b, n_b, flags, off, sc, codes, bb, inb, valid, rk, qrow, lut,
            scores, l8, m8, delta, eta, nu, rmax, amax, bad, B, DELTA_F, ROUND_F, n2, dv, G, GP, N, D,
        )  # fmt: skip


def launch_constants(layout, K: int, G: int, sub_blocks: int, blk: int, num_warps: int) -> dict:
    """The compile-time arguments of :func:`_phase1_gluon_kernel`: constexprs, ``num_warps``, FMA contraction."""
    return dict(
        H=K, G=G, GP=1 << max(0, (G - 1).bit_length()), D=layout.head_dim, M=sub_blocks, BLK=blk, PAGE_BYTES=layout.page_bytes, K_OFFSET=layout.k_offset,
        K_SCODE=layout.k_scale_code, HEADER=layout.header, VEC=VEC, num_warps=num_warps,
        enable_fp_fusion=True,  # fused dequantization and dot products (Triton 3.10 turns fusion off by default)
    )  # fmt: skip


def launch(out, qs: torch.Tensor, pages: torch.Tensor, tables, nfull, lut, layout, K, sub_blocks, delta_factor,
           rounding_factor, splits, blocks_per_split, blk, num_warps) -> None:  # fmt: skip
    """Launch the Gluon kernel into the :class:`phase1.Phase1Out` buffers ``out``."""
    R, Hq, D = qs.shape
    _phase1_gluon_kernel[(R * K, splits)](
        qs, pages, pages.view(torch.int8), pages.view(torch.float16), pages.view(torch.float32),
        tables, nfull, lut,
        out.scores, out.l8, out.m8, out.delta, out.eta, out.nu, out.rmax, out.amax, out.bad,
        pages.shape[0] * sub_blocks, tables.shape[1], tables.stride(0), blocks_per_split, delta_factor,
        rounding_factor, **launch_constants(layout, K, Hq // K, sub_blocks, blk, num_warps),
    )  # fmt: skip
