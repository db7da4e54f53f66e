"""The resident decode pass: scores, softmax, values and the bound accumulators in one kernel, split over the
sequence (split-K), with the promoted set F taken from what is already in device memory.

One program per (row, KV head, split) walks its blocks ``BLK`` at a time and, for the G query heads of the
KV head, reads each tier-1 page once:

* **keys**: INT8 scores s̃⁸ = ⟨q·λ, k̂⟩ for every full block (k̂ = ℓ̃ + code·σ dequantized in registers, as
  phase 1), and, for the blocks of F, exact scores from unquantized keys. A block is in F when the layer's
  promotion pool holds its keys under the block's current write generation (a *hit*: the same two-choice
  slots and tags as ``certvllm.kv.promotion_cache``, checked here, so a rewritten block is never served) or
  when the caller's bitmask promotes it (keys then come from the pool on a hit, else zero-copy from the
  pinned shadow). F is decided per (row, KV head, block): every query head of the group reads it exactly.
* **per-block terms** as phase 1 writes them (ℓ⁸_b, Δ_b, R_b, max |s̃⁸|, η_b, ν_b, page flags), the exact
  log-mass m + log den_b of F blocks, and the bitmask of what was read exactly: selection, the prepare
  kernel and the finalize kernel read these as they read phase 1's and phase 2's.
* **canary** on F blocks: |s̃^exact − s̃⁸| ≤ (Δ_b + 2R_b)(1 + 2⁻¹⁰), which P2 guarantees (R_b bounds the
  rounding of either score: docs/certification.md §6 with the block's own R_b); a violation sets the row's
  flag (rung 4).
* **values**: INT4 v̂ = z + c·s in registers, or unquantized values zero-copy from the shadow for blocks
  whose value bit is set for that query head (rung 2 of a top-up pass).
* **softmax without a global maximum**: each program keeps a running maximum m per query head. A tile's
  weights are w = fl(exp(fl(s − m))) (libdevice ``expf``) with m the running maximum after the tile, its
  per-block sums den_b and num_b are 16-term float32 sums, converted exactly to float64 and added to float64
  accumulators, which are multiplied by the float64 exp(m_old − m_new) when the maximum grows. A token's
  weight relative to the final maximum is therefore its float32 weight times float64 factors: the same
  float32 rounding as the two-pass kernels (|fl(s − m) − (s − m)| ≤ 2u·max|s̃| and exp within 8u, the
  R_exp term) plus float64 rescalings far below the certificate's 2⁻²⁰ margins (docs/certification.md §5.1).
  Each split writes its maximum; ``finalize`` rescales the splits to the row's maximum in float64.

Programs of a group whose ``active`` flag is 0 do nothing and write neither partial sums nor per-block terms:
the top-up pass and the exact re-run cover only the groups that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from certvllm.formats.layout import PageLayout, key_scale_lut
from certvllm.formats.pool_slots import HASH_MUL

from .common import (
    GluonGate,
    device_arg,
    exp_f32,
    holds_copy,
    interpreting,
    launch_device_ok,
    load_key_terms,
    log_f32,
    next_pow2,
    page_base,
    precise,
    split_columns,
    split_program,
    store_split_sums,
)
from .shape_class import JIT_OPTIONS

_HASH_MUL = tl.constexpr(HASH_MUL)
CANARY_SLACK = 1.0 + 2.0**-10
"""Margin of the canary's comparison: its own float32 evaluation (docs/certification.md §6)."""


@triton.jit
def _pick(x, sel, axis: tl.constexpr):
    """The entry of ``x`` where ``sel`` holds along ``axis`` (exact: the other entries add 0; an infinite entry
    stays infinite)."""
    return tl.sum(tl.where(sel, x, 0.0), axis=axis, keep_dims=True)


@triton.jit(**JIT_OPTIONS)
def _fused_kernel(
    qs,  # [R, H_q, D] float32 scaled queries fl(q·λ)
    pages_u8,  # cache.pages [E, H_kv, m·page_bytes] as uint8
    pages_i8,  # the same storage as int8 (the exponent byte)
    pages_f16,  # as float16 (key offsets, value scales and zeros)
    pages_f32,  # as float32 (η, ν)
    shadow,  # [E, H_kv, 2, m·N, D] originals (pinned host, read through its device address)
    pool,  # [P, N, D] promotion-pool key pages (USE_POOL)
    vpool,  # [P, N, D] its value pages (POOL_VALUES)
    tag,  # [P] int64 page id of each slot (USE_POOL)
    tag_gen,  # [P] int64 write generation of each slot's copy (USE_POOL)
    gen,  # [num_blocks] int64 current write generations (USE_POOL)
    slot_of,  # [num_blocks·H_kv] int32 slot of each page, −1 none (EXPLICIT)
    tables,  # [R, ≥B] int64 16-token block ids (row stride TB_STRIDE)
    nfull,  # [R] int64 full blocks per row
    bits,  # [R, H_kv, B] int32 caller's bitmask: bit g keys (any g: the whole group), bit G + g values (USE_BITS)
    active,  # [R, H_kv] int32: 0 = skip this group (USE_ACTIVE)
    acc,  # out [R, H_kv, S, G, D] float64 Σ_b num_b relative to the split's maximum
    den,  # out [R, H_kv, S, G] float64 Σ_b den_b
    aval,  # out [R, H_kv, S, G] float64 Σ den_b·η_b over INT4-value blocks
    atail,  # out [R, H_kv, S, G] float64 Σ den_b over INT8-key blocks
    msplit,  # out [R, H_kv, G, S] float32 the split's maximum phase-2 score (−inf: no block)
    sabs,  # out [R, H_kv, G, S] float32 largest finite |exact score| on F blocks
    l8,  # out [R, H_kv, G, B] float32 INT8 block log-mass (−inf past the last full block)
    delta,  # out [R, H_kv, G, B] float32 Δ_b (0 past the last full block)
    rmax,  # out [R, H_kv, G, B] float32 R_b
    amax,  # out [R, H_kv, G, B] float32 largest finite |s̃⁸| of the block
    exact_lm,  # out [R, H_kv, G, B] float32 m + log den_b on F blocks (others untouched)
    eta,  # out [R, H_kv, B] float32 η_b
    nu,  # out [R, H_kv, B] float32 ν_b
    bad,  # out [R, H_kv, B] int32: a valid page is flagged or invalid
    fbits,  # out [R, H_kv, B] int32 what was read exactly: every key bit on F blocks, the caller's value bits
    canary,  # in/out [R] int32, set to 1 when an F block breaks the canary
    nslots,  # P (USE_POOL)
    num_blocks, B, TB_STRIDE, S, BPS,  # the split-K arguments (``common``)
    DELTA_F,  # float32 factor of Δ_b
    ROUND_F,  # float32 factor of R_b
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, M: tl.constexpr,
    GRP: tl.constexpr,  # value group size g
    NG: tl.constexpr,  # value groups per token
    BLK: tl.constexpr,  # blocks per loop iteration (power of two)
    VEC: tl.constexpr,  # contiguous key-code bytes per thread (the layout hint of the key tiles)
    PAGE_BYTES: tl.constexpr,
    K_OFFSET: tl.constexpr,
    K_SCODE: tl.constexpr,
    V_CODES: tl.constexpr,
    V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr,
    HEADER: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,  # shadow keys stored [D, m·N] (the CPU layout)
    USE_POOL: tl.constexpr,
    POOL_VALUES: tl.constexpr,  # a hit's values are read unquantized from ``vpool`` too
    EXPLICIT: tl.constexpr,  # the pool's slots are explicitly allocated (``slot_of``), else two-choice hashed
    USE_BITS: tl.constexpr,
    USE_ACTIVE: tl.constexpr,
    EXACT_ALL: tl.constexpr,  # every block of an active group read unquantized (rungs 3/4)
    CANARY: tl.constexpr,
    CANARY_F: tl.constexpr,
    PRECISE: tl.constexpr,
):  # fmt: skip
    N: tl.constexpr = 16
    DH: tl.constexpr = DP // 2
    rk, split, r, h = split_program(H)
    # key tiles [BLK, N, DP] (phase 1's layout), value tiles [BLK, N, DH] (the attend pass's)
    dd = tl.arange(0, DP)
    d4 = tl.max_contiguous(tl.multiple_of(dd, VEC), VEC)
    dv = d4[None, None, :]
    dmv = dv < D
    nv = tl.arange(0, N)[None, :, None]
    jv = tl.arange(0, BLK)[:, None, None]
    gs = tl.arange(0, GP)[None, None, :]  # [1, 1, GP]
    gr = tl.arange(0, GP)[None, :, None]  # [1, GP, 1]
    kk = tl.arange(0, DH)
    k2 = kk % 2 + (kk // 2) * 2
    kv = k2[None, None, :]
    km = kv < D // 2
    gq = tl.arange(0, GP)[:, None]
    dq = tl.arange(0, DP)[None, :]
    q2 = tl.load(qs + (r * (H * G) + h * G + gq) * D + dq, mask=(gq < G) & (dq < D), other=0.0)  # [GP, DP]
    nf = tl.load(nfull + r)
    n_iter = tl.cdiv(BPS, BLK)
    if USE_ACTIVE:
        n_iter = tl.where(tl.load(active + rk) != 0, n_iter, 0)
    key_bits = (1 << G) - 1
    acc_e = tl.zeros([BLK, GP, DH], tl.float64)
    acc_o = tl.zeros([BLK, GP, DH], tl.float64)
    den64 = tl.zeros([BLK, GP, 1], tl.float64)
    av64 = tl.zeros([BLK, GP, 1], tl.float64)
    at64 = tl.zeros([BLK, GP, 1], tl.float64)
    m_run = tl.full([1, GP, 1], float("-inf"), tl.float32)
    sabs_run = tl.zeros([1, GP, 1], tl.float32)
    viol = tl.zeros([1, 1, 1], tl.int32)
    for it in range(0, n_iter):
        bv, inb, valid = split_columns(it, jv, split, BPS, B, nf, BLK)  # [BLK, 1, 1]
        bid, base = page_base(tables, r, TB_STRIDE, bv, inb, num_blocks, h, H, M, PAGE_BYTES)
        vm = valid & dmv
        # ---- page metadata (as phase 1)
        e_b, n_b, flags, ex, off, sigma = load_key_terms(
            pages_u8, pages_i8, pages_f16, pages_f32, base, valid, vm, dv, HEADER, K_OFFSET, K_SCODE
        )  # [BLK, 1, DP] ℓ̃ and σ
        kmag = tl.maximum(tl.abs(off), tl.abs(off + 255.0 * sigma)) + sigma
        badb = (valid & (((flags & 2) != 0) | ((flags & 1) == 0))).to(tl.int32)
        # ---- F: pool hits under the current generation, or the caller's key bits
        if USE_BITS:
            bb = tl.load(bits + rk * B + bv, mask=valid, other=0)
        else:
            bb = tl.zeros([BLK, 1, 1], tl.int32)
        if USE_POOL:
            page = bid * H + h
            gb = tl.load(gen + bid, mask=valid, other=-2)
            if EXPLICIT:  # the slot the pool assigned (``ResidentPool``), checked by its tag
                slot = tl.load(slot_of + page, mask=valid, other=-1).to(tl.int64)
                has = valid & (slot >= 0)
                slot = tl.where(has, slot, 0)
                res = holds_copy(tag, tag_gen, slot, page, gb, has)
            else:  # the two candidate slots of the hashed pool
                s1 = page % nslots
                s2 = ((page * _HASH_MUL) >> 7) % nslots
                hit1 = holds_copy(tag, tag_gen, s1, page, gb, valid)
                hit2 = holds_copy(tag, tag_gen, s2, page, gb, valid & ~hit1)
                res = hit1 | hit2
                slot = tl.where(hit1, s1, s2)
        else:
            res = valid & (bid < 0)
            slot = bid
        if EXACT_ALL:
            fk = valid
        else:
            fk = valid & (res | ((bb & key_bits) != 0))  # [BLK, 1, 1]
        # ---- INT8 scores and the per-block terms of every head (k̂ dies after this loop)
        codes = tl.load((pages_u8 + base) + (nv * D + dv), mask=vm, other=0)
        khat = off + codes.to(tl.float32) * sigma  # [BLK, N, DP]
        s_all = tl.zeros([BLK, N, GP], tl.float32)
        l_all = tl.zeros([BLK, GP, 1], tl.float32)
        d_all = tl.zeros([BLK, GP, 1], tl.float32)
        r_all = tl.zeros([BLK, GP, 1], tl.float32)
        a_all = tl.zeros([BLK, GP, 1], tl.float32)
        for g in tl.static_range(G):
            qg = tl.sum(tl.where(gq == g, q2, 0.0), axis=0)[None, None, :]  # [1, 1, DP] row g (exact)
            qa = tl.abs(qg)
            s8 = tl.where(valid, tl.sum(khat * qg, axis=2, keep_dims=True), float("-inf"))  # [BLK, N, 1]
            rowg = gr == g
            s_all = tl.where(gs == g, s8, s_all)
            d_all = tl.where(rowg, tl.sum(qa * sigma, axis=2, keep_dims=True) * DELTA_F, d_all)
            r_all = tl.where(rowg, tl.sum(qa * kmag, axis=2, keep_dims=True) * ROUND_F, r_all)
            a_all = tl.where(rowg, tl.max(tl.where(tl.abs(s8) < float("inf"), tl.abs(s8), 0.0), axis=1,
                                          keep_dims=True), a_all)  # fmt: skip
        # ---- exact scores of F blocks (from the pool or the shadow), the canary, F's scores in s_all
        any_f = tl.max(tl.max(tl.max(fk.to(tl.int32), axis=2), axis=1), axis=0) > 0
        if any_f:
            kbase = (((bid // M) * H + h) * 2) * (M * N * D)
            if CHANNEL_MAJOR:
                koffs = dv * (M * N) + (bid % M) * N + nv
            else:
                koffs = ((bid % M) * N + nv) * D + dv
            kx = tl.load(shadow + kbase + koffs, mask=fk & ~res & dmv, other=0.0).to(tl.float32)
            if USE_POOL:
                kp = tl.load(pool + slot * (N * D) + nv * D + dv, mask=res & dmv, other=0.0).to(tl.float32)
                kx = tl.where(res, kp, kx)
            for g in tl.static_range(G):
                qg = tl.sum(tl.where(gq == g, q2, 0.0), axis=0)[None, None, :]
                sx = tl.where(valid, tl.sum(kx * qg, axis=2, keep_dims=True), float("-inf"))  # [BLK, N, 1]
                s8 = _pick(s_all, gs == g, 2)
                mb = tl.max(s8, axis=1, keep_dims=True)  # ℓ⁸_b of F blocks (T blocks': their phase-2 log-mass)
                fin = tl.abs(mb) < float("inf")
                mref = tl.where(fin, mb, 0.0)
                lb = tl.where(fin, mref + tl.log(tl.maximum(tl.sum(tl.exp(s8 - mref), axis=1, keep_dims=True), 1.0)),
                              mb)  # fmt: skip
                l_all = tl.where(gr == g, lb, l_all)
                if CANARY:  # |s̃^exact − s̃⁸| ≤ (Δ_b + 2R_b)(1 + 2⁻¹⁰) under P2
                    tol = (_pick(d_all, gr == g, 1) + 2.0 * _pick(r_all, gr == g, 1)) * CANARY_F  # [BLK, 1, 1]
                    diff = tl.abs(sx - s8)
                    bad_t = fk & ((diff > tol) | ~(diff < float("inf")))
                    viol = tl.maximum(viol, tl.max(tl.max(tl.max(bad_t.to(tl.int32), axis=2), axis=1), axis=0))
                xa = tl.max(tl.where(fk & (tl.abs(sx) < float("inf")), tl.abs(sx), 0.0), axis=1, keep_dims=True)
                sabs_run = tl.where(gr == g, tl.maximum(sabs_run, tl.max(xa, axis=0, keep_dims=True)), sabs_run)
                s_all = tl.where((gs == g) & fk, sx, s_all)
        # ---- values: INT4 in registers, replaced by the originals on blocks read exactly (resident values, or
        # the caller's value bits: for every query head of the group, whose E_val they can only lower)
        gi = tl.arange(0, NG)[None, None, :]
        gm_ = valid & (gi < NG)
        vsc = tl.load(pages_f16 + (base + V_SCALE) // 2 + nv * NG + gi, mask=gm_, other=0.0).to(tl.float32)
        vze = tl.load(pages_f16 + (base + V_ZERO) // 2 + nv * NG + gi, mask=gm_, other=0.0).to(tl.float32)
        vsc = tl.reshape(tl.broadcast_to(vsc[:, :, :, None], [BLK, N, NG, GRP // 2]), [BLK, N, DH])
        vze = tl.reshape(tl.broadcast_to(vze[:, :, :, None], [BLK, N, NG, GRP // 2]), [BLK, N, DH])
        byte = tl.load((pages_u8 + base + V_CODES) + (nv * (D // 2) + kv), mask=valid & km, other=0).to(tl.int32)
        v_e = vze + (byte & 15).to(tl.float32) * vsc  # [BLK, N, DH] channels 2k
        v_o = vze + (byte >> 4).to(tl.float32) * vsc  # channels 2k + 1
        if POOL_VALUES:
            res_v = res
        else:
            res_v = valid & (bid < 0)
        if EXACT_ALL:
            vx = valid
        else:
            vx = valid & ((((bb >> G) & key_bits) != 0) | res_v)  # [BLK, 1, 1] values read unquantized
        if tl.max(tl.max(tl.max(vx.to(tl.int32), axis=2), axis=1), axis=0) > 0:
            vbase = (((bid // M) * H + h) * 2 + 1) * (M * N * D) + (bid % M) * (N * D)
            vrow = shadow + vbase + nv * D + 2 * kv
            vsel = vx & ~res_v & km
            v_e = tl.where(vsel, tl.load(vrow, mask=vsel, other=0.0).to(tl.float32), v_e)
            v_o = tl.where(vsel, tl.load(vrow + 1, mask=vsel, other=0.0).to(tl.float32), v_o)
            if POOL_VALUES:
                prow = vpool + slot * (N * D) + nv * D + 2 * kv
                psel = res_v & km
                v_e = tl.where(psel, tl.load(prow, mask=psel, other=0.0).to(tl.float32), v_e)
                v_o = tl.where(psel, tl.load(prow + 1, mask=psel, other=0.0).to(tl.float32), v_o)
        # ---- the running maximum per query head, then the weights and the block sums
        m_tile = tl.reshape(tl.max(tl.max(s_all, axis=1, keep_dims=True), axis=0, keep_dims=True), [1, GP, 1])
        m_new = tl.maximum(m_run, m_tile)
        ne_all = tl.zeros([BLK, GP, DH], tl.float32)
        no_all = tl.zeros([BLK, GP, DH], tl.float32)
        den_all = tl.zeros([BLK, GP, 1], tl.float32)
        for g in tl.static_range(G):
            s = _pick(s_all, gs == g, 2)  # [BLK, N, 1]
            mg = tl.sum(tl.where(gr == g, m_new, 0.0))
            mg0 = tl.where(mg == float("-inf"), 0.0, mg)
            w = exp_f32(s - mg0, PRECISE)  # [BLK, N, 1]
            rowg = gr == g
            ne_all = tl.where(rowg, tl.sum(w * v_e, axis=1, keep_dims=True), ne_all)  # [BLK, 1, DH] per head
            no_all = tl.where(rowg, tl.sum(w * v_o, axis=1, keep_dims=True), no_all)
            den_all = tl.where(rowg, tl.sum(w, axis=1, keep_dims=True), den_all)
        grow = m_new > m_run
        if tl.max(tl.max(tl.max(grow.to(tl.int32), axis=2), axis=1), axis=0) > 0:
            fac = tl.where(grow & (m_run > float("-inf")), tl.exp((m_run - m_new).to(tl.float64)), 1.0)
            fac = tl.where(m_run == float("-inf"), 0.0, fac)  # nothing accumulated yet (exact 0 sums)
            acc_e = acc_e * fac
            acc_o = acc_o * fac
            den64 = den64 * fac
            av64 = av64 * fac
            at64 = at64 * fac
        m_run = m_new
        acc_e += ne_all.to(tl.float64)
        acc_o += no_all.to(tl.float64)
        d64 = den_all.to(tl.float64)
        den64 += d64
        av64 += tl.where(valid & ~vx, d64 * e_b.to(tl.float64), 0.0)
        at64 += tl.where(valid & ~fk, d64, 0.0)
        # ---- per-block terms
        pb = rk * B + bv  # [BLK, 1, 1]
        tl.store(eta + pb, tl.where(valid, e_b, 0.0), mask=inb)
        tl.store(nu + pb, tl.where(valid, n_b, 0.0), mask=inb)
        tl.store(bad + pb, badb, mask=inb)
        tl.store(fbits + pb, tl.where(fk, key_bits, 0) | tl.where(vx, key_bits << G, 0), mask=inb)
        orow = (rk * G + gr) * B + bv  # [BLK, GP, 1]
        om = inb & (gr < G)

        tl.store(delta + orow, tl.where(valid, d_all, 0.0), mask=om)
        tl.store(rmax + orow, tl.where(valid, r_all, 0.0), mask=om)
        tl.store(amax + orow, tl.where(valid, a_all, 0.0), mask=om)
        m0 = tl.where(m_new == float("-inf"), 0.0, m_new)
        lm = tl.where(den_all > 0, m0 + log_f32(tl.where(den_all > 0, den_all, 1.0), PRECISE), float("-inf"))
        tl.store(exact_lm + orow, lm, mask=om & fk)
        # ℓ⁸_b: F blocks' from their INT8 scores, the others' = their phase-2 log-mass (the same scores)
        tl.store(l8 + orow, tl.where(valid, tl.where(fk, l_all, lm), float("-inf")), mask=om)
    if CANARY:  # one atomic per program (0 or 1)
        tl.atomic_max(canary + r, tl.max(tl.max(tl.max(viol, axis=2), axis=1), axis=0))
    store_split_sums(acc, den, aval, atail, rk, split, S, acc_e, acc_o, den64, av64, at64, G, GP, D, DH)
    gm = gr < G
    tl.store(msplit + (rk * G + gr) * S + split, m_run, mask=gm)
    tl.store(sabs + (rk * G + gr) * S + split, sabs_run, mask=gm)


@dataclass
class FusedOut:
    """What one resident pass wrote (shapes in ``_fused_kernel``'s argument comments). ``acc``, ``den``,
    ``aval``, ``atail`` are the attend pass's split-K parts (``phase2.AttendOut``'s fields), each split relative
    to its own maximum ``msplit``; ``l8`` … ``bad`` are phase 1's per-block terms (``phase1.Phase1Out``'s
    fields, read by ``prepare`` and ``select_blocks``)."""

    acc: torch.Tensor
    den: torch.Tensor
    aval: torch.Tensor
    atail: torch.Tensor
    msplit: torch.Tensor
    sabs: torch.Tensor
    l8: torch.Tensor
    delta: torch.Tensor
    rmax: torch.Tensor
    amax: torch.Tensor
    exact_lm: torch.Tensor
    eta: torch.Tensor
    nu: torch.Tensor
    bad: torch.Tensor
    fbits: torch.Tensor
    canary: torch.Tensor


@dataclass(frozen=True)
class FusedGeometry:
    """Static launch parameters of the resident pass."""

    layout: PageLayout
    num_kv_heads: int
    group: int
    sub_blocks: int
    num_blocks: int
    splits: int
    blocks_per_split: int
    channel_major: bool = False
    blk: int = 1
    warps: int = 1
    vec: int = 16
    gluon_warps: int = 4
    gluon_maxnreg: int = 0
    dialect: str = "auto"


def fused_pass(
    geo: FusedGeometry,
    qs: torch.Tensor,
    pages: torch.Tensor,
    shadow: torch.Tensor,
    tables: torch.Tensor,
    nfull: torch.Tensor,
    delta_factor: float,
    rounding_factor: float,
    *,
    pool: tuple | None = None,
    bits: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
    run_canary: bool = True,
    canary: torch.Tensor | None = None,
    exact_all: bool = False,
) -> FusedOut:
    """Launch the resident pass.

    Args:
        geo: heads, page layout, split plan and tile.
        qs: ``[R, H_q, D]`` float32 scaled queries.
        pages: ``[E, H_kv, m·page_bytes]`` uint8 tier-1 pages; shadow: the pinned originals.
        tables: ``[R, B]`` int64 block ids; nfull: ``[R]`` int64 full blocks per row.
        pool: ``(keys [P, N, D], values [P, N, D] or None, tag [P], tag_gen [P], generation [num_blocks], slot_of
            [num_blocks·H_kv] or None)`` of the layer's pool (``slot_of``: explicitly allocated slots, else the
            hashed pool's two candidates), or None (F is then only what ``bits`` promotes).
        bits: ``[R, H_kv, B]`` int32 caller's promotions (bit g keys, G + g values), or None.
        active: ``[R, H_kv]`` int32 groups to compute, or None (all).
        exact_all: read every block of the computed groups unquantized (keys and values: rungs 3/4).
        canary: ``[R]`` int32 flags to set (a new zeroed tensor when None).

    Returns:
        :class:`FusedOut`. With ``active``, the per-block terms of inactive groups are left unwritten.
    """
    launch_device_ok(pages)
    R, Hq, D = qs.shape
    K, G, S = geo.num_kv_heads, geo.group, geo.splits
    B = tables.shape[1]
    dev = qs.device
    f32 = dict(dtype=torch.float32, device=dev)
    f64 = dict(dtype=torch.float64, device=dev)
    out = FusedOut(
        acc=torch.empty(R, K, S, G, D, **f64), den=torch.empty(R, K, S, G, **f64),
        aval=torch.empty(R, K, S, G, **f64), atail=torch.empty(R, K, S, G, **f64),
        msplit=torch.empty(R, K, G, S, **f32), sabs=torch.empty(R, K, G, S, **f32),
        l8=torch.empty(R, K, G, B, **f32), delta=torch.empty(R, K, G, B, **f32), rmax=torch.empty(R, K, G, B, **f32),
        amax=torch.empty(R, K, G, B, **f32), exact_lm=torch.empty(R, K, G, B, **f32),
        eta=torch.empty(R, K, B, **f32), nu=torch.empty(R, K, B, **f32),
        bad=torch.empty(R, K, B, dtype=torch.int32, device=dev), fbits=torch.empty(R, K, B, dtype=torch.int32, device=dev),
        canary=torch.zeros(R, dtype=torch.int32, device=dev) if canary is None else canary,
    )  # fmt: skip
    if R * B == 0:
        return out
    lay = geo.layout
    use_pool = pool is not None and pool[0].shape[0] > 0
    pool_pages, pool_values, tag, tag_gen, gen, slot_of = pool if use_pool else (out.sabs, None, *(out.bad,) * 4)
    pool_v = pool_values is not None
    explicit = use_pool and slot_of is not None
    args = (
        qs, pages, pages.view(torch.int8), pages.view(torch.float16), pages.view(torch.float32), device_arg(shadow),
        pool_pages, pool_values if pool_v else pool_pages, tag, tag_gen, gen, slot_of if explicit else out.bad, tables,
        nfull,
        out.bad if bits is None else bits, out.bad if active is None else active,
        out.acc, out.den, out.aval, out.atail, out.msplit, out.sabs, out.l8, out.delta, out.rmax, out.amax,
        out.exact_lm, out.eta, out.nu, out.bad, out.fbits, out.canary,
        pool_pages.shape[0] if use_pool else 1, geo.num_blocks, B, tables.stride(0), S, geo.blocks_per_split,
        delta_factor, rounding_factor,
    )  # fmt: skip
    flags = dict(use_pool=use_pool, pool_values=pool_v, explicit=explicit, use_bits=bits is not None, use_active=active is not None,
                 run_canary=run_canary, exact_all=exact_all)  # fmt: skip

    def launch_triton():
        _fused_kernel[(R * K, S)](
            *args,
            H=K, G=G, GP=next_pow2(G), D=D, DP=next_pow2(D), M=geo.sub_blocks, GRP=lay.value_group, NG=lay.groups,
            BLK=geo.blk, VEC=geo.vec, PAGE_BYTES=lay.page_bytes, K_OFFSET=lay.k_offset, K_SCODE=lay.k_scale_code,
            V_CODES=lay.v_codes, V_SCALE=lay.v_scale, V_ZERO=lay.v_zero, HEADER=lay.header,
            CHANNEL_MAJOR=geo.channel_major, USE_POOL=use_pool, POOL_VALUES=pool_v, EXPLICIT=explicit,
            USE_BITS=bits is not None,
            USE_ACTIVE=active is not None, EXACT_ALL=exact_all, CANARY=run_canary, CANARY_F=CANARY_SLACK, PRECISE=precise(),
            num_warps=geo.warps,
        )  # fmt: skip

    if use_gluon(geo):
        from . import fused_gluon

        consts = fused_gluon.launch_constants(geo, geo.gluon_warps, CANARY_SLACK, **flags)
        if geo.gluon_maxnreg:
            consts["maxnreg"] = geo.gluon_maxnreg
        FUSED_GLUON_GATE.run(lambda: fused_gluon.launch(args, (R * K, S), _lut(qs.device), consts), launch_triton)
    else:
        launch_triton()
    return out


FUSED_GLUON_GATE = GluonGate("resident-pass")
_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    """The key-scale table on ``device`` (made once per device, outside any CUDA-graph capture's first call)."""
    if device not in _LUTS:
        _LUTS[device] = key_scale_lut().to(device)
    return _LUTS[device]


def use_gluon(geo: FusedGeometry) -> bool:
    """Whether :func:`fused_pass` runs the Gluon kernel (``fused_gluon``): compiled (not the interpreter), ``geo.dialect``
    not ``"triton"``, Gluon importable and compiling (``FUSED_GLUON_GATE``) and a supported shape."""
    if interpreting() or geo.dialect == "triton" or FUSED_GLUON_GATE.failure is not None:
        return False
    try:
        from . import fused_gluon
    except ImportError:  # a Triton without Gluon
        return False
    lay = geo.layout
    return fused_gluon.supported(lay.head_dim, geo.group, lay.value_group, geo.channel_major, geo.gluon_warps,
                                 geo.gluon_warps)  # fmt: skip
