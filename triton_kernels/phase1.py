"""Phase 1: INT8 scoring of every full block, split over the sequence (split-K).

One program per (row, KV head, split) walks its blocks and, per block and query head of the GQA group:
dequantizes the INT8 keys in registers (k̂ = ℓ̃ + code·σ, σ = LUT[code]·2^E), forms the float32 scores
s̃⁸ = ⟨q·λ, k̂⟩ (elementwise products and a D-term reduction: no TF32, no tensor cores), and writes

* the scores themselves (phase 2 reuses them instead of reading the keys again),
* ℓ⁸_b = logsumexp of the block's scores and their maximum,
* Δ_b = delta_factor · Σ_c |q_c·λ| σ_c (``bounds.block_delta``),
* η_b, ν_b from the page header,

and per split the largest score rounding R_b (``bounds.score_rounding``), the largest finite |s̃⁸| and
whether any valid page carries a precondition flag or lacks ``FLAG_VALID``. Blocks past a row's last
full block get the reference's neutral values (ℓ = −inf, Δ = η = ν = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from certvllm.formats.layout import PageLayout

from .common import as_mask, launch_device_ok, next_pow2, pow2_f32


@triton.jit
def _phase1_kernel(
    qs,  # [R, H_q, D] float32 scaled queries fl(q·λ)
    pages_u8,  # cache.pages [E, H_kv, m·page_bytes] viewed as uint8
    pages_i8,  # the same storage as int8 (the exponent byte)
    pages_f16,  # the same storage as float16 (key offsets)
    pages_f32,  # the same storage as float32 (η, ν)
    tables,  # [R, ≥B] int64 16-token block ids (row stride TB_STRIDE)
    nfull,  # [R] int64 full blocks per row
    lut,  # [256] float32 key-scale mantissas
    scores,  # out [R, H_kv, B, G, N] float32 INT8 scores (valid blocks only)
    l8,  # out [R, H_kv, G, B] float32 block log-mass (−inf past the last full block)
    m8,  # out [R, H_kv, G, B] float32 block max score (−inf past the last full block)
    delta,  # out [R, H_kv, G, B] float32 Δ_b (0 past the last full block)
    eta,  # out [R, H_kv, B] float32 η_b (0 past the last full block)
    nu,  # out [R, H_kv, B] float32 ν_b (0 past the last full block)
    rmax,  # out [R, H_kv, G, S] float32 per-split max R_b
    amax,  # out [R, H_kv, G, S] float32 per-split max finite |s̃⁸|
    bad,  # out [R, H_kv, S] int32 per-split: a valid page is flagged or invalid
    num_blocks,  # total 16-token blocks in the cache (ids are clamped to it, as the reference does)
    B,  # blocks per row in the outputs (block-table columns)
    TB_STRIDE,  # row stride of ``tables``
    S,  # number of splits
    BPS,  # blocks per split
    DELTA_F,  # float32 factor of Δ_b
    ROUND_F,  # float32 factor of R_b
    H: tl.constexpr,  # KV heads
    G: tl.constexpr,  # query heads per KV head
    GP: tl.constexpr,  # next power of two ≥ G
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # next power of two ≥ D
    M: tl.constexpr,  # 16-token blocks per engine block
    PAGE_BYTES: tl.constexpr,  # bytes of one page
    K_OFFSET: tl.constexpr,  # byte offset of the key offsets ℓ̃ (float16 [D])
    K_SCODE: tl.constexpr,  # byte offset of the key scale codes (uint8 [D])
    HEADER: tl.constexpr,  # byte offset of the 16-byte header
):
    N: tl.constexpr = 16
    rk = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    r = rk // H
    h = rk % H
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    n = tl.arange(0, N)
    gm = g < G
    dm = d < D
    q = tl.load(qs + (r * (H * G) + h * G + g[:, None]) * D + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    qa = tl.abs(q)
    nf = tl.load(nfull + r)
    rm = tl.zeros([GP], tl.float32)
    am = tl.zeros([GP], tl.float32)
    badv = tl.zeros([1], tl.int32)
    for i in range(0, BPS):
        b = split * BPS + i
        inb = b < B
        valid = inb & (b < nf)
        bid = tl.load(tables + r * TB_STRIDE + b, mask=inb, other=0)
        bid = tl.minimum(tl.maximum(bid, 0), num_blocks - 1)
        base = ((bid // M) * H + h) * (M * PAGE_BYTES) + (bid % M) * PAGE_BYTES
        codes = tl.load(pages_u8 + base + n[:, None] * D + d[None, :], mask=as_mask(valid & dm[None, :]), other=0)
        off = tl.load(pages_f16 + (base + K_OFFSET) // 2 + d, mask=as_mask(valid & dm), other=0.0).to(tl.float32)
        sc = tl.load(pages_u8 + base + K_SCODE + d, mask=as_mask(valid & dm), other=0).to(tl.int32)
        ex = tl.load(pages_i8 + base + HEADER + 8, mask=valid, other=0).to(tl.int32)
        sigma = tl.load(lut + sc) * pow2_f32(tl.minimum(tl.maximum(ex, -126), 127))
        khat = off[None, :] + codes.to(tl.float32) * sigma[None, :]
        s = tl.sum(q[:, None, :] * khat[None, :, :], axis=2)  # [GP, N]
        s = tl.where(valid & gm[:, None], s, float("-inf"))
        mb = tl.max(s, axis=1)
        fin = tl.abs(mb) < float("inf")
        mref = tl.where(fin, mb, 0.0)
        lb = tl.where(
            fin, mref + tl.log(tl.maximum(tl.sum(tl.exp(s - mref[:, None]), axis=1), 1.0)), mb
        )  # sum ≥ 1 when fin
        dl = tl.sum(qa * sigma[None, :], axis=1) * DELTA_F
        kmag = tl.maximum(tl.abs(off), tl.abs(off + 255.0 * sigma)) + sigma
        rb = tl.sum(qa * kmag[None, :], axis=1) * ROUND_F
        e_b = tl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0)
        n_b = tl.load(pages_f32 + (base + HEADER) // 4 + 1, mask=valid, other=0.0)
        flags = tl.load(pages_u8 + base + HEADER + 9, mask=valid, other=1).to(tl.int32)
        badv = badv | (valid & (((flags & 2) != 0) | ((flags & 1) == 0))).to(tl.int32)
        srow = ((rk * B + b) * G + g[:, None]) * N + n[None, :]
        tl.store(scores + srow, s, mask=as_mask(valid & gm[:, None]))
        orow = (rk * G + g) * B + b
        tl.store(l8 + orow, tl.where(valid, lb, float("-inf")), mask=as_mask(gm & inb))
        tl.store(m8 + orow, tl.where(valid, mb, float("-inf")), mask=as_mask(gm & inb))
        tl.store(delta + orow, tl.where(valid, dl, 0.0), mask=as_mask(gm & inb))
        tl.store(eta + rk * B + b, tl.where(valid, e_b, 0.0), mask=inb)
        tl.store(nu + rk * B + b, tl.where(valid, n_b, 0.0), mask=inb)
        rm = tl.maximum(rm, tl.where(valid, rb, 0.0))
        sa = tl.max(tl.where(tl.abs(s) < float("inf"), tl.abs(s), 0.0), axis=1)
        am = tl.maximum(am, tl.where(valid, sa, 0.0))
    tl.store(rmax + (rk * G + g) * S + split, rm, mask=gm)
    tl.store(amax + (rk * G + g) * S + split, am, mask=gm)
    tl.store(bad + rk * S + split + tl.arange(0, 1), badv)


@dataclass
class Phase1Out:
    """Phase-1 results (shapes as in :func:`phase1`)."""

    scores: torch.Tensor
    l8: torch.Tensor
    m8: torch.Tensor
    delta: torch.Tensor
    eta: torch.Tensor
    nu: torch.Tensor
    rmax: torch.Tensor
    amax: torch.Tensor
    bad: torch.Tensor


def phase1(
    qs: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    nfull: torch.Tensor,
    lut: torch.Tensor,
    layout: PageLayout,
    num_kv_heads: int,
    sub_blocks: int,
    delta_factor: float,
    rounding_factor: float,
    splits: int,
    blocks_per_split: int,
) -> Phase1Out:
    """Launch phase 1.

    Args:
        qs: ``[R, H_q, D]`` float32 scaled queries.
        pages: ``[E, H_kv, m·page_bytes]`` uint8 tier-1 pages.
        tables: ``[R, B]`` int64 block ids; nfull: ``[R]`` int64 full blocks per row.
        lut: ``[256]`` float32 :func:`~certvllm.formats.layout.key_scale_lut` on the device.
        splits, blocks_per_split: the split-K plan (``splits·blocks_per_split ≥ B``).

    Returns:
        :class:`Phase1Out` with scores ``[R, H_kv, B, G, 16]``, l8/m8/delta ``[R, H_kv, G, B]``,
        eta/nu ``[R, H_kv, B]``, rmax/amax ``[R, H_kv, G, S]`` float32 and bad ``[R, H_kv, S]`` int32.
    """
    launch_device_ok(pages)
    R, Hq, D = qs.shape
    K = num_kv_heads
    G = Hq // K
    B = tables.shape[1]
    dev = qs.device
    f32 = dict(dtype=torch.float32, device=dev)
    out = Phase1Out(
        scores=torch.empty(R, K, B, G, 16, **f32),
        l8=torch.empty(R, K, G, B, **f32),
        m8=torch.empty(R, K, G, B, **f32),
        delta=torch.empty(R, K, G, B, **f32),
        eta=torch.empty(R, K, B, **f32),
        nu=torch.empty(R, K, B, **f32),
        rmax=torch.empty(R, K, G, splits, **f32),
        amax=torch.empty(R, K, G, splits, **f32),
        bad=torch.empty(R, K, splits, dtype=torch.int32, device=dev),
    )
    num_blocks = pages.shape[0] * sub_blocks
    _phase1_kernel[(R * K, splits)](
        qs, pages, pages.view(torch.int8), pages.view(torch.float16), pages.view(torch.float32),
        tables, nfull, lut,
        out.scores, out.l8, out.m8, out.delta, out.eta, out.nu, out.rmax, out.amax, out.bad,
        num_blocks, B, tables.stride(0), splits, blocks_per_split, delta_factor, rounding_factor,
        H=K, G=G, GP=next_pow2(G), D=D, DP=next_pow2(D), M=sub_blocks, PAGE_BYTES=layout.page_bytes,
        K_OFFSET=layout.k_offset, K_SCODE=layout.k_scale_code, HEADER=layout.header,
        num_warps=4 if G <= 4 else 8,
    )  # fmt: skip
    return out
