"""Phase 1 in Gluon (Triton's explicit-layout dialect): the same outputs and the same arithmetic as
``phase1._phase1_kernel``, with the register layout chosen by hand instead of by Triton's layout
propagation.

One layout ``L`` serves every tile of the loop, ``[BLK, 16, DP]`` (blocks, tokens, channels): ``VEC``
contiguous channels per thread (one 16-byte load of key codes per token), the channels of a token over
``DP/VEC`` lanes, the 16 tokens over the remaining lanes (and in registers), one block per warp. So

* the D-term dot products reduce ``VEC`` products in a thread, then over ``DP/VEC`` lanes (3 shuffle
  rounds at D = 128) — any summation order is allowed by the certificate (γ_D, docs/certification.md §5);
* per-block reductions over the tokens stay inside one warp;
* nothing is converted between layouts inside the loop (no shared-memory round trips, no barriers).

Used on CUDA when Gluon is available and the shape fits (``supported``); the Triton kernel remains the
implementation under the interpreter (CPU tests) and the fallback.
"""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

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
    CODE_WORDS: gl.constexpr,
):
    """Every page load of one iteration (masked by ``valid``), as loaded (no conversion, so that a
    prefetched copy holds packed bytes): exponent ``ex`` [BLK] int8, ``η``/``ν`` [BLK] float32,
    ``flags`` [BLK] uint8, key offsets ``off`` [BLK, 1, D] float16, key scale codes ``sc``
    [BLK, 1, D] uint8 and key codes ``codes`` [BLK, N, D] uint8."""
    base = ((bid // M) * H + h) * (M * PAGE_BYTES) + (bid % M) * PAGE_BYTES  # [BLK]
    ex = gl.load(pages_i8 + base + HEADER + 8, mask=valid, other=0)
    e_b = gl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0)
    n_b = gl.load(pages_f32 + (base + HEADER) // 4 + 1, mask=valid, other=0.0)
    flags = gl.load(pages_u8 + base + HEADER + 9, mask=valid, other=1)
    base3 = gl.expand_dims(gl.expand_dims(base, 1), 2)  # [BLK, 1, 1]
    vd = gl.expand_dims(gl.expand_dims(valid, 1), 2) & (dv < D)  # [BLK, 1, D]
    off = gl.load(pages_f16 + (base3 + K_OFFSET) // 2 + dv, mask=vd, other=0.0)
    sc = gl.load(pages_u8 + base3 + K_SCODE + dv, mask=vd, other=0)
    if CODE_WORDS:
        codes = _code_words(pages_f32, base, valid, D, N, BLK, VEC)  # [BLK, N, D/4] words
    else:
        codes = gl.load((pages_u8 + base3) + (nv * D + dv), mask=vd & (nv < N), other=0)  # [BLK, N, D]
    return ex, e_b, n_b, flags, off, sc, codes


@gluon.jit
def _code_words(pages_f32, base, valid, D: gl.constexpr, N: gl.constexpr, BLK: gl.constexpr, VEC: gl.constexpr):
    """The key codes [BLK, N, D] of pages ``base`` as [BLK, N, D/4] words (four codes each, as float32 bits):
    the prefetching kernel carries these across iterations (see :func:`_codes_of_words`)."""
    TD: gl.constexpr = D // VEC
    TN: gl.constexpr = 32 // TD
    W: gl.constexpr = gl.BlockedLayout([1, 1, VEC // 4], [1, TN, TD], [BLK, 1, 1], [2, 1, 0])  # L over words
    W_b: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, W))
    W_n: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, W))
    W_d: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, W))
    nw = gl.expand_dims(gl.expand_dims(gl.arange(0, N, layout=W_n), 0), 2)  # [1, N, 1]
    dw = gl.expand_dims(gl.expand_dims(gl.arange(0, D // 4, layout=W_d), 0), 1)  # [1, 1, D/4]
    base3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(base, W_b), 1), 2)  # same registers as base
    valid3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(valid, W_b), 1), 2)
    return gl.load(pages_f32 + base3 // 4 + (nw * (D // 4) + dw), mask=valid3 & (dw < D // 4) & (nw < N), other=0.0)


@gluon.jit
def _codes_of_words(w, D: gl.constexpr, N: gl.constexpr, BLK: gl.constexpr, VEC: gl.constexpr):
    """The [BLK, N, D] int32 key codes (layout ``L``) of :func:`_code_words`'s words (little-endian)."""
    TD: gl.constexpr = D // VEC
    TN: gl.constexpr = 32 // TD
    L: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, TN, TD], [BLK, 1, 1], [2, 1, 0])
    wi = w.to(gl.int32, bitcast=True)
    b0 = wi & 255
    b1 = (wi >> 8) & 255
    b2 = (wi >> 16) & 255
    b3 = (wi >> 24) & 255
    c = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [BLK, N, D/4, 2, 2]: [.., k, i] = byte 2k + i
    return gl.convert_layout(gl.reshape(c, [BLK, N, D]), L)  # the same registers: no data movement


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
    for g in gl.static_range(G):
        qg = gl.load(qrow + g * D + dv)  # [1, 1, D]
        qa = gl.abs(qg)
        s = gl.sum(khat * qg, axis=2)  # [BLK, N] D-term float32 dot products
        s = gl.where(valid2, s, float("-inf"))
        mb = gl.max(s, axis=1)  # [BLK]
        fin = gl.abs(mb) < float("inf")
        mref = gl.where(fin, mb, 0.0)
        ssum = gl.sum(gl.exp(s - gl.expand_dims(mref, 1)), axis=1)
        lb = gl.where(fin, mref + gl.log(gl.maximum(ssum, 1.0)), mb)  # ssum ≥ 1 when fin
        dl = gl.sum(gl.sum(qa * sigma, axis=2), axis=1) * DELTA_F  # [BLK]
        rb = gl.sum(gl.sum(qa * kmag, axis=2), axis=1) * ROUND_F
        sa = gl.max(gl.where(gl.abs(s) < float("inf"), gl.abs(s), 0.0), axis=1)
        gl.store(srow + g * N, s, mask=smask)
        orow = (rk * G + g) * B + bb
        gl.store(l8 + orow, gl.where(valid, lb, float("-inf")), mask=inb)
        gl.store(m8 + orow, gl.where(valid, mb, float("-inf")), mask=inb)
        gl.store(delta + orow, gl.where(valid, dl, 0.0), mask=inb)
        gl.store(rmax + orow, gl.where(valid, rb, 0.0), mask=inb)
        gl.store(amax + orow, gl.where(valid, sa, 0.0), mask=inb)


@gluon.jit
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
    D: gl.constexpr,
    M: gl.constexpr,
    BLK: gl.constexpr,
    PAGE_BYTES: gl.constexpr,
    K_OFFSET: gl.constexpr,
    K_SCODE: gl.constexpr,
    HEADER: gl.constexpr,
    VEC: gl.constexpr,
):
    N: gl.constexpr = 16
    rk, split, r, h, jb, n2, nv, dv, nf, qrow = _setup(qs, nfull, H, G, D, BLK, VEC)
    for it in range(0, gl.cdiv(BPS, BLK)):
        bb, inb, valid = _cols(it, jb, split, BPS, B, nf, BLK)
        bid = _block_ids(tables, r, TB_STRIDE, bb, inb, num_blocks)
        ex, e_b, n_b, flags, off, sc, codes = _page_loads(
            pages_u8, pages_i8, pages_f16, pages_f32, bid, valid, h, nv, dv, H, D, N, M, PAGE_BYTES, K_OFFSET, K_SCODE,
            HEADER, BLK, VEC, False,
        )  # fmt: skip
        _block_compute(
            ex, e_b, n_b, flags, off, sc, codes, bb, inb, valid, rk, qrow, lut,
            scores, l8, m8, delta, eta, nu, rmax, amax, bad, B, DELTA_F, ROUND_F, n2, dv, G, N, D,
        )  # fmt: skip


@gluon.jit
def _phase1_gluon_prefetch_kernel(
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
    D: gl.constexpr,
    M: gl.constexpr,
    BLK: gl.constexpr,
    PAGE_BYTES: gl.constexpr,
    K_OFFSET: gl.constexpr,
    K_SCODE: gl.constexpr,
    HEADER: gl.constexpr,
    VEC: gl.constexpr,
):
    """:func:`_phase1_gluon_kernel` with the loads software-pipelined: the page loads of iteration ``it + 1``
    and the block ids of iteration ``it + 2`` are issued before the arithmetic of iteration ``it``."""
    N: gl.constexpr = 16
    rk, split, r, h, jb, n2, nv, dv, nf, qrow = _setup(qs, nfull, H, G, D, BLK, VEC)
    # prologue: the block ids of iterations 0 and 1, the pages of iteration 0
    bb, inb, valid = _cols(0, jb, split, BPS, B, nf, BLK)
    bid = _block_ids(tables, r, TB_STRIDE, bb, inb, num_blocks)
    ex, e_b, n_b, flags, off, sc, codes = _page_loads(
        pages_u8, pages_i8, pages_f16, pages_f32, bid, valid, h, nv, dv, H, D, N, M, PAGE_BYTES, K_OFFSET, K_SCODE,
        HEADER, BLK, VEC, True,
    )  # fmt: skip
    bb1, inb1, valid1 = _cols(1, jb, split, BPS, B, nf, BLK)
    bid1 = _block_ids(tables, r, TB_STRIDE, bb1, inb1, num_blocks)  # iteration it + 1's block ids
    for it in range(0, gl.cdiv(BPS, BLK)):
        # issue iteration it + 1's page loads (all masked off past the end) and iteration it + 2's block ids
        bb1, inb1, valid1 = _cols(it + 1, jb, split, BPS, B, nf, BLK)
        ex1, e_b1, n_b1, flags1, off1, sc1, codes1 = _page_loads(
            pages_u8, pages_i8, pages_f16, pages_f32, bid1, valid1, h, nv, dv, H, D, N, M, PAGE_BYTES, K_OFFSET,
            K_SCODE, HEADER, BLK, VEC, True,
        )  # fmt: skip
        bb2, inb2, valid2 = _cols(it + 2, jb, split, BPS, B, nf, BLK)
        bid1 = _block_ids(tables, r, TB_STRIDE, bb2, inb2, num_blocks)
        # then compute iteration it from the values loaded one iteration earlier
        bb, inb, valid = _cols(it, jb, split, BPS, B, nf, BLK)
        _block_compute(
            ex, e_b, n_b, flags, off, sc, _codes_of_words(codes, D, N, BLK, VEC), bb, inb, valid, rk, qrow, lut,
            scores, l8, m8, delta, eta, nu, rmax, amax, bad, B, DELTA_F, ROUND_F, n2, dv, G, N, D,
        )  # fmt: skip
        ex = ex1
        e_b = e_b1
        n_b = n_b1
        flags = flags1
        off = off1
        sc = sc1
        codes = codes1


def launch(out, qs: torch.Tensor, pages: torch.Tensor, tables, nfull, lut, layout, K, sub_blocks, delta_factor,
           rounding_factor, splits, blocks_per_split, blk, num_warps) -> None:  # fmt: skip
    """Launch the Gluon kernel into the :class:`phase1.Phase1Out` buffers ``out`` (the prefetching variant when
    ``CERTVLLM_P1_PREFETCH=1``)."""
    R, Hq, D = qs.shape
    kernel = (
        _phase1_gluon_prefetch_kernel if os.environ.get("CERTVLLM_P1_PREFETCH", "0") == "1" else _phase1_gluon_kernel
    )
    kernel[(R * K, splits)](
        qs, pages, pages.view(torch.int8), pages.view(torch.float16), pages.view(torch.float32),
        tables, nfull, lut,
        out.scores, out.l8, out.m8, out.delta, out.eta, out.nu, out.rmax, out.amax, out.bad,
        pages.shape[0] * sub_blocks, tables.shape[1], tables.stride(0), blocks_per_split, delta_factor,
        rounding_factor,
        H=K, G=Hq // K, D=D, M=sub_blocks, BLK=blk, PAGE_BYTES=layout.page_bytes, K_OFFSET=layout.k_offset,
        K_SCODE=layout.k_scale_code, HEADER=layout.header, VEC=VEC, num_warps=num_warps,
    )  # fmt: skip
