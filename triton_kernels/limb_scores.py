"""INT8 block scores on the tensor cores with a limb-split query (a prototype for issue 17; not on the serving path).

One program per (row, KV head, split) walks its full blocks and writes, per block and query head, the 16 INT8 scores
ŝ_t = Σ_c q'_c·(ℓ̃_c + code_{t,c}·σ_c) and the block's log-mass (logsumexp of the scores): the part of phase 1 that
reads the key codes. Two arithmetics over the same loads, chosen by ``MMA``:

* ``MMA=True``: the arithmetic of ``certvllm.bounds.int8_scores`` (``docs/certification.md`` §5.2) with K = 4 limbs.
  Per block the scaled query p = fl(q'·σ) ``[D, GP]`` is split into four int8 limbs over a power-of-two scale per
  query head (from the exponent bits: exact); the limbs, laid out as the columns ``k·GP + g`` of a ``[D, 4·GP]`` int8
  matrix, meet the codes (``code ^ 0x80`` reinterpreted as int8 = code − 128: no conversion per element) in one
  ``tl.dot`` with int32 accumulation, exact; each limb's integer sum (+ 128·its column sum) converts to float32
  exactly (< 2^24) and is scaled by its power of two; the K + 1 float32 terms are added. The rounding term is
  ``limb_score_rounding`` with K = 4.
* ``MMA=False``: the float32 path of phase 1 (k̂ = ℓ̃ + code·σ in registers, D-term sums per query head), the
  comparison for ``benchmarks/probe_int8_mma.py``.

Layout of the outputs: scores ``[R, H_kv, B, G, N]`` float32 (full blocks only), log-mass ``[R, H_kv, G, B]``
float32 (−inf past a row's last full block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certvllm.bounds.int8_scores import LIMB_HEADROOM
from certvllm.formats.layout import BLOCK_SIZE, PageLayout

from .common import (
    device_arg,
    key_scale_sigma,
    launch_device_ok,
    next_pow2,
    page_base,
    pow2_f32,
    precise,
    rint,
    split_program,
)
from .shape_class import JIT_OPTIONS

LIMBS = 4
"""Query limbs of the MMA path: four fill the dot's 16 columns at G = 4 and leave a residual ≤ S·2^-25."""


@triton.jit
def _limb(x, PRECISE: tl.constexpr):
    """(nearest integer to x, ties to even; (x − it)·256): one limb and what is left for the next (|x| ≤ 128.5)."""
    a = rint(x, PRECISE)
    return a, (x - a) * 256.0


@triton.jit(**JIT_OPTIONS)
def _block_scores_kernel(
    qs,  # [R, H_q, D] float32 scaled queries fl(q·λ)
    pages_u8,  # cache.pages [E, H_kv, m·page_bytes] viewed as uint8
    pages_i8,  # the same storage as int8 (the exponent byte)
    pages_f16,  # the same storage as float16 (key offsets)
    tables,  # [R, ≥B] int64 16-token block ids (row stride TB_STRIDE)
    nfull,  # [R] int64 full blocks per row
    scores,  # out [R, H_kv, B, G, N] float32
    lmass,  # out [R, H_kv, G, B] float32
    num_blocks, B, TB_STRIDE, BPS,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
    PAGE_BYTES: tl.constexpr, K_OFFSET: tl.constexpr, K_SCODE: tl.constexpr, HEADER: tl.constexpr,
    MMA: tl.constexpr, PRECISE: tl.constexpr, STAGES: tl.constexpr,
    HEADROOM: tl.constexpr,  # |p / S| ≤ HEADROOM (``bounds.int8_scores.LIMB_HEADROOM``)
):  # fmt: skip
    N: tl.constexpr = 16
    C: tl.constexpr = 4 * GP  # the dot's columns: limb-major, k·GP + g
    rk, split, r, h = split_program(H)
    n = tl.arange(0, N)
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    q = tl.load(qs + (r * (H * G) + h * G + g[None, :]) * D + d[:, None], mask=g[None, :] < G, other=0.0)  # [D, GP]
    nf = tl.load(nfull + r)
    for it in tl.range(0, BPS, num_stages=STAGES):
        bv = split * BPS + it + tl.arange(0, 1)  # [1]: masks stay tensors (the interpreter wants them so)
        inb = bv < B
        valid = inb & (bv < nf)
        _, base = page_base(tables, r, TB_STRIDE, bv, inb, num_blocks, h, H, M, PAGE_BYTES)  # [1]
        vd = valid & (d < D)  # [D]
        ex = tl.sum(tl.load(pages_i8 + base + HEADER + 8, mask=valid, other=0).to(tl.int32), axis=0)
        off = tl.load(pages_f16 + (base + K_OFFSET) // 2 + d, mask=vd, other=0.0).to(tl.float32)  # [D]
        sc = tl.load(pages_u8 + base + K_SCODE + d, mask=vd, other=0).to(tl.int32)
        sigma = key_scale_sigma(sc, ex)  # [D]
        codes = tl.load(pages_u8 + base + n[:, None] * D + d[None, :], mask=vd[None, :] & (n[:, None] < N),
                        other=0)  # [N, D] uint8  # fmt: skip
        offset_dot = tl.sum(q * off[:, None], axis=0)  # [GP]: L̃, a D-term float32 dot product
        if MMA:
            p = q * sigma[:, None]  # [D, GP]: fl(q'·σ)
            need = tl.max(tl.abs(p), axis=0) / HEADROOM  # [GP]
            bits = need.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 255) - 127 + ((bits & 8388607) != 0).to(tl.int32)  # ⌈log2⌉ of a normal float
            e = tl.where(need > 0, tl.minimum(tl.maximum(e, -126), 127), 0)
            x = p * pow2_f32(-e)[None, :]  # exact: a power of two
            a0, x = _limb(x, PRECISE)
            a1, x = _limb(x, PRECISE)
            a2, x = _limb(x, PRECISE)
            a3, x = _limb(x, PRECISE)
            carry = (a3 == 128.0).to(tl.float32)  # +128 is not an int8: carry it up, −128 left behind
            a3, a2 = a3 - 256.0 * carry, a2 + carry
            carry = (a2 == 128.0).to(tl.float32)
            a2, a1 = a2 - 256.0 * carry, a1 + carry
            carry = (a1 == 128.0).to(tl.float32)
            a1, a0 = a1 - 256.0 * carry, a0 + carry
            w = tl.reshape(tl.permute(tl.join(tl.join(a0, a1), tl.join(a2, a3)), (0, 3, 2, 1)), (D, C))  # [D, C]
            wi = w.to(tl.int32)
            codes8 = (codes ^ 0x80).to(tl.int8, bitcast=True)  # code − 128, reinterpreted
            isum = tl.dot(codes8, wi.to(tl.int8), out_dtype=tl.int32) + 128 * tl.sum(wi, axis=0)[None, :]  # [N, C]
            col = tl.arange(0, C)
            weight = pow2_f32(tl.reshape(tl.broadcast_to(e[None, :], (4, GP)), (C,)) - 8 * (col // GP))  # S·256^-k
            terms = tl.reshape(isum.to(tl.float32) * weight[None, :], (N, 4, GP))  # exact products
            s = offset_dot[None, :] + tl.sum(terms, axis=1)  # [N, GP]: K + 1 float32 terms, any order
        else:
            khat = off[None, :] + codes.to(tl.float32) * sigma[None, :]  # [N, D]
            s = tl.zeros([N, GP], tl.float32)
            for gg in tl.static_range(GP):
                qg = tl.sum(tl.where(g[None, :] == gg, q, 0.0), axis=1)  # [D]: column gg of q (exact)
                s = tl.where(g[None, :] == gg, tl.sum(khat * qg[None, :], axis=1)[:, None], s)
        mx = tl.max(s, axis=0)  # [GP]
        lse = mx + tl.log(tl.sum(tl.exp(s - mx[None, :]), axis=0))
        row = (rk * B + bv) * G + g  # [GP]
        tl.store(scores + row[None, :] * N + n[:, None], s, mask=valid[None, :] & (g[None, :] < G) & (n[:, None] < N))
        tl.store(lmass + (rk * G + g) * B + bv, tl.where(valid, lse, float("-inf")), mask=inb & (g < G))


def block_scores(q_scaled: torch.Tensor, pages: torch.Tensor, layout: PageLayout, tables: torch.Tensor,
                 nfull: torch.Tensor, *, mma: bool = True, splits: int = 1, stages: int = 2,
                 num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """INT8 scores and block log-masses of every full block.

    Args:
        q_scaled: q' = fl(q·λ), float32 ``[R, H_q, D]``.
        pages: ``cache.pages`` ``[E, H_kv, page_bytes]`` uint8 (one 16-token block per page row).
        layout: the pages' :class:`PageLayout`.
        tables: ``[R, B]`` int64 block ids; nfull: ``[R]`` int64 full blocks per row.
        mma: the limb-split tensor-core arithmetic (True) or the float32 one (False).
        splits: programs per (row, KV head) along the blocks.

    Returns:
        scores ``[R, H_kv, B, G, 16]`` float32 and log-masses ``[R, H_kv, G, B]`` float32.
    """
    r, hq, d = q_scaled.shape
    _, hkv, page_bytes = pages.shape
    if pages.shape[2] != layout.page_bytes or layout.block_size != BLOCK_SIZE:
        raise ValueError(f"pages of {pages.shape[2]} bytes per block and head; the layout says {layout.page_bytes}")
    g = hq // hkv
    gp = max(4, next_pow2(g))  # the dot needs ≥ 16 columns: 4 limbs × ≥ 4 heads
    b = tables.shape[1]
    launch_device_ok(pages)
    scores = torch.zeros(r, hkv, b, g, BLOCK_SIZE, dtype=torch.float32, device=pages.device)
    lmass = torch.full((r, hkv, g, b), float("-inf"), dtype=torch.float32, device=pages.device)
    bps = -(-b // splits)
    u8 = pages.view(torch.uint8)
    _block_scores_kernel[(r * hkv, splits)](
        device_arg(q_scaled.contiguous()), device_arg(u8), device_arg(u8.view(torch.int8)),
        device_arg(u8.view(torch.float16)), device_arg(tables.contiguous()), device_arg(nfull.contiguous()),
        device_arg(scores), device_arg(lmass), pages.shape[0], b, tables.stride(0), bps,
        H=hkv, G=g, GP=gp, D=d, M=1, PAGE_BYTES=page_bytes, K_OFFSET=layout.k_offset,
        K_SCODE=layout.k_scale_code, HEADER=layout.header, MMA=mma, PRECISE=precise(), STAGES=stages, HEADROOM=float(LIMB_HEADROOM),
        num_warps=num_warps,
    )  # fmt: skip
    return scores, lmass
