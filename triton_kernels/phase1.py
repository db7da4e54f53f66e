"""Phase 1: INT8 scoring of every full block, split over the sequence (split-K).

One program per (row, KV head, split) walks its blocks and, per block and query head of the GQA group:
dequantizes the INT8 keys in registers (k̂ = ℓ̃ + code·σ, σ = LUT[code]·2^E), forms the float32 scores
s̃⁸ = ⟨q·λ, k̂⟩ (elementwise products and a D-term reduction: no TF32, no tensor cores), and writes

* the scores themselves (phase 2 reuses them instead of reading the keys again),
* ℓ⁸_b = logsumexp of the block's scores and their maximum,
* Δ_b = delta_factor · Σ_c |q_c·λ| σ_c (``bounds.block_delta``),
* η_b, ν_b from the page header,

and per block the score rounding R_b (``bounds.score_rounding``), the largest finite |s̃⁸| and whether the
page carries a precondition flag or lacks ``FLAG_VALID`` (the caller reduces them over the blocks). Blocks
past a row's last full block get the reference's neutral values (ℓ = −inf, Δ = η = ν = R = 0).

Each loop iteration takes ``BLK`` blocks as one [BLK, 16, D] tile, one block per warp. On CUDA the Gluon
kernel (``phase1_gluon``: the same arithmetic with a hand-chosen register layout) runs when it supports
the shape; the Triton kernel below runs under the interpreter and otherwise. Both form σ exactly as
``LUT[code]·2^E`` (the Triton kernel without a gather, ``common.key_scale_sigma``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from certvllm.formats.layout import PageLayout

from .common import (
    GluonGate,
    interpreting,
    launch_device_ok,
    load_key_terms,
    next_pow2,
    page_base,
    split_columns,
    split_program,
)
from .shape_class import JIT_OPTIONS
from .tuning import DEFAULT_TUNING, KernelTuning


@triton.jit(**JIT_OPTIONS)
def _phase1_kernel(
    qs,  # [R, H_q, D] float32 scaled queries fl(q·λ)
    pages_u8,  # cache.pages [E, H_kv, m·page_bytes] viewed as uint8
    pages_i8,  # the same storage as int8 (the exponent byte)
    pages_f16,  # the same storage as float16 (key offsets)
    pages_f32,  # the same storage as float32 (η, ν)
    tables,  # [R, ≥B] int64 16-token block ids (row stride TB_STRIDE)
    nfull,  # [R] int64 full blocks per row
    lut,  # [256] float32 key-scale mantissas (unused: σ comes from ``key_scale_sigma``, the same values)
    scores,  # out [R, H_kv, B, G, N] float32 INT8 scores (valid blocks only)
    l8,  # out [R, H_kv, G, B] float32 block log-mass (−inf past the last full block)
    m8,  # out [R, H_kv, G, B] float32 block max score (−inf past the last full block)
    delta,  # out [R, H_kv, G, B] float32 Δ_b (0 past the last full block)
    eta,  # out [R, H_kv, B] float32 η_b (0 past the last full block)
    nu,  # out [R, H_kv, B] float32 ν_b (0 past the last full block)
    rmax,  # out [R, H_kv, G, B] float32 per-block score rounding R_b (0 past the last full block)
    amax,  # out [R, H_kv, G, B] float32 per-block max finite |s̃⁸| (0 past the last full block)
    bad,  # out [R, H_kv, B] int32 per block: a valid page is flagged or invalid
    num_blocks, B, TB_STRIDE, BPS,  # the split-K arguments (``common``; no S: the grid has it)
    DELTA_F,  # float32 factor of Δ_b
    ROUND_F,  # float32 factor of R_b
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, M: tl.constexpr,
    BLK: tl.constexpr,  # blocks per loop iteration (power of two)
    PAGE_BYTES: tl.constexpr,  # bytes of one page
    K_OFFSET: tl.constexpr,  # byte offset of the key offsets ℓ̃ (float16 [D])
    K_SCODE: tl.constexpr,  # byte offset of the key scale codes (uint8 [D])
    HEADER: tl.constexpr,  # byte offset of the 16-byte header
):  # fmt: skip
    # The tile is [BLK, N, D] (blocks, tokens, channels). Every load and product of the loop is meant to
    # share one layout: D over the 32 lanes of a warp, 4 channels per thread (the loads see runs of 4
    # contiguous channels only, ``d4``), BLK over the warps, the 16 tokens of a block in each thread's
    # registers; per-block reductions over tokens stay in a thread and the D-term dot products reduce over
    # the lanes of one warp. The key codes are loaded last: Triton's layout propagation lets the last
    # large load of the loop decide the layout of the arithmetic that consumes it.
    N: tl.constexpr = 16
    rk, split, r, h = split_program(H)
    dd = tl.arange(0, DP)
    d4 = dd % 4 + (dd // 4) * 4  # = dd, seen by the compiler as runs of 4
    dv = d4[None, None, :]  # [1, 1, DP]
    dmv = dv < D
    nv = tl.arange(0, N)[None, :, None]  # [1, N, 1]
    jv = tl.arange(0, BLK)[:, None, None]  # [BLK, 1, 1]
    gq = tl.arange(0, GP)[:, None]
    gs = tl.arange(0, GP)[None, None, :]  # [1, 1, GP]
    gr = tl.arange(0, GP)[None, :, None]  # [1, GP, 1]
    dq = tl.arange(0, DP)[None, :]
    q2 = tl.load(qs + (r * (H * G) + h * G + gq) * D + dq, mask=(gq < G) & (dq < D), other=0.0)  # [GP, DP]
    nf = tl.load(nfull + r)
    for it in range(0, tl.cdiv(BPS, BLK)):
        bv, inb, valid = split_columns(it, jv, split, BPS, B, nf, BLK)  # [BLK, 1, 1] block columns
        _, base = page_base(tables, r, TB_STRIDE, bv, inb, num_blocks, h, H, M, PAGE_BYTES)  # [BLK, 1, 1]
        vm = valid & dmv
        e_b, n_b, flags, ex, off, sigma = load_key_terms(
            pages_u8, pages_i8, pages_f16, pages_f32, base, valid, vm, dv, HEADER, K_OFFSET, K_SCODE
        )  # [BLK, 1, DP] ℓ̃ and σ
        codes = tl.load((pages_u8 + base) + (nv * D + dv), mask=vm, other=0)  # [BLK, N, DP]
        khat = off + codes.to(tl.float32) * sigma  # [BLK, N, DP]
        kmag = tl.maximum(tl.abs(off), tl.abs(off + 255.0 * sigma)) + sigma  # [BLK, 1, DP]
        badb = (valid & (((flags & 2) != 0) | ((flags & 1) == 0))).to(tl.int32)
        pb = rk * B + bv  # [BLK, 1, 1]
        tl.store(eta + pb, tl.where(valid, e_b, 0.0), mask=inb)
        tl.store(nu + pb, tl.where(valid, n_b, 0.0), mask=inb)
        tl.store(bad + pb, badb, mask=inb)
        # per query head: scores and block statistics, gathered into [BLK, N, GP] / [BLK, GP, 1] tiles
        # (row g only) so that each output is stored once per iteration
        s_all = tl.zeros([BLK, N, GP], tl.float32)
        l_all = tl.zeros([BLK, GP, 1], tl.float32)
        m_all = tl.zeros([BLK, GP, 1], tl.float32)
        d_all = tl.zeros([BLK, GP, 1], tl.float32)
        r_all = tl.zeros([BLK, GP, 1], tl.float32)
        a_all = tl.zeros([BLK, GP, 1], tl.float32)
        for g in tl.static_range(G):
            qg = tl.sum(tl.where(gq == g, q2, 0.0), axis=0)[None, None, :]  # [1, 1, DP] row g of q (exact)
            qa = tl.abs(qg)
            s = tl.sum(khat * qg, axis=2, keep_dims=True)  # [BLK, N, 1] D-term float32 dot products
            s = tl.where(valid, s, float("-inf"))
            mb = tl.max(s, axis=1, keep_dims=True)  # [BLK, 1, 1]
            fin = tl.abs(mb) < float("inf")
            mref = tl.where(fin, mb, 0.0)
            ssum = tl.sum(tl.exp(s - mref), axis=1, keep_dims=True)
            lb = tl.where(fin, mref + tl.log(tl.maximum(ssum, 1.0)), mb)  # ssum ≥ 1 when fin
            dl = tl.sum(qa * sigma, axis=2, keep_dims=True) * DELTA_F  # [BLK, 1, 1]
            rb = tl.sum(qa * kmag, axis=2, keep_dims=True) * ROUND_F
            sa = tl.max(tl.where(tl.abs(s) < float("inf"), tl.abs(s), 0.0), axis=1, keep_dims=True)
            s_all = tl.where(gs == g, s, s_all)
            rowg = gr == g
            l_all = tl.where(rowg, lb, l_all)
            m_all = tl.where(rowg, mb, m_all)
            d_all = tl.where(rowg, dl, d_all)
            r_all = tl.where(rowg, rb, r_all)
            a_all = tl.where(rowg, sa, a_all)
        tl.store((scores + pb * (G * N)) + (gs * N + nv), s_all, mask=valid & (gs < G))
        orow = (rk * G + gr) * B + bv  # [BLK, GP, 1]
        om = inb & (gr < G)
        tl.store(l8 + orow, tl.where(valid, l_all, float("-inf")), mask=om)
        tl.store(m8 + orow, tl.where(valid, m_all, float("-inf")), mask=om)
        tl.store(delta + orow, tl.where(valid, d_all, 0.0), mask=om)
        tl.store(rmax + orow, tl.where(valid, r_all, 0.0), mask=om)
        tl.store(amax + orow, tl.where(valid, a_all, 0.0), mask=om)


PHASE1_GLUON_GATE = GluonGate("phase-1")


def use_gluon(head_dim: int, group: int, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether :func:`phase1` runs the Gluon kernel (``phase1_gluon``): compiled (not the interpreter),
    ``tuning.dialect`` not ``"triton"``, Gluon importable and compiling (``PHASE1_GLUON_GATE``) and a
    supported shape (one block per warp: ``tuning.phase1_warps`` blocks per iteration)."""
    if interpreting() or tuning.dialect == "triton" or PHASE1_GLUON_GATE.failure is not None:
        return False
    try:
        from . import phase1_gluon
    except ImportError:  # a Triton without Gluon
        return False
    return phase1_gluon.supported(head_dim, group, tuning.phase1_warps, tuning.phase1_warps)


PHASE1_MMA_GLUON_GATE = GluonGate("phase-1 MMA")


def use_gluon_mma(head_dim: int, group: int, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether the ``mma`` phase 1 runs its Gluon kernel (``phase1_mma_gluon``), under the same conditions as
    :func:`use_gluon`."""
    if interpreting() or tuning.dialect == "triton" or PHASE1_MMA_GLUON_GATE.failure is not None:
        return False
    try:
        from . import phase1_mma_gluon
    except ImportError:  # a Triton without Gluon or its mma_v2
        return False
    return phase1_mma_gluon.supported(head_dim, group, tuning.phase1_warps, tuning.phase1_warps)


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
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
) -> Phase1Out:
    """Launch phase 1.

    Args:
        qs: ``[R, H_q, D]`` float32 scaled queries.
        pages: ``[E, H_kv, m·page_bytes]`` uint8 tier-1 pages.
        tables: ``[R, B]`` int64 block ids; nfull: ``[R]`` int64 full blocks per row.
        lut: ``[256]`` float32 :func:`~certvllm.formats.layout.key_scale_lut` on the device.
        splits, blocks_per_split: the split-K plan (``splits·blocks_per_split ≥ B``).
        tuning: blocks per loop iteration (``phase1_blk``; the Gluon kernels: one block per warp), warps per
            program (``phase1_warps``), the score arithmetic (``phase1_scores``: the ``mma`` kernels write their own
            R_b, ``rounding_factor`` is then unused) and the kernel dialect.

    Returns:
        :class:`Phase1Out` with scores ``[R, H_kv, B, G, 16]``, l8/m8/delta ``[R, H_kv, G, B]``,
        eta/nu ``[R, H_kv, B]``, rmax/amax ``[R, H_kv, G, B]`` float32 and bad ``[R, H_kv, B]`` int32
        (per block: reduce over the last axis).
    """
    launch_device_ok(pages)
    blk, num_warps = tuning.phase1_blk, tuning.phase1_warps
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
        rmax=torch.empty(R, K, G, B, **f32),
        amax=torch.empty(R, K, G, B, **f32),
        bad=torch.empty(R, K, B, dtype=torch.int32, device=dev),
    )
    num_blocks = pages.shape[0] * sub_blocks

    def launch_triton():
        _phase1_kernel[(R * K, splits)](
            qs, pages, pages.view(torch.int8), pages.view(torch.float16), pages.view(torch.float32),
            tables, nfull, lut,
            out.scores, out.l8, out.m8, out.delta, out.eta, out.nu, out.rmax, out.amax, out.bad,
            num_blocks, B, tables.stride(0), blocks_per_split, delta_factor, rounding_factor,
            H=K, G=G, GP=next_pow2(G), D=D, DP=next_pow2(D), M=sub_blocks, BLK=blk, PAGE_BYTES=layout.page_bytes,
            K_OFFSET=layout.k_offset, K_SCODE=layout.k_scale_code, HEADER=layout.header,
            num_warps=num_warps,
        )  # fmt: skip

    if tuning.phase1_scores == "mma":
        from . import phase1_mma

        def launch_mma_triton():
            phase1_mma.launch(out, qs, pages, tables, nfull, lut, layout, K, sub_blocks, delta_factor, splits,
                              blocks_per_split, tuning)  # fmt: skip

        if use_gluon_mma(D, G, tuning):
            from . import phase1_mma_gluon

            PHASE1_MMA_GLUON_GATE.run(
                lambda: phase1_mma_gluon.launch(out, qs, pages, tables, nfull, lut, layout, K, sub_blocks,
                                                delta_factor, splits, blocks_per_split, num_warps),
                launch_mma_triton,
            )  # fmt: skip
        else:
            launch_mma_triton()
    elif use_gluon(D, G, tuning):
        from . import phase1_gluon

        PHASE1_GLUON_GATE.run(
            lambda: phase1_gluon.launch(out, qs, pages, tables, nfull, lut, layout, K, sub_blocks, delta_factor,
                                        rounding_factor, splits, blocks_per_split, num_warps, num_warps),
            launch_triton,
        )  # fmt: skip
    else:
        launch_triton()
    return out
