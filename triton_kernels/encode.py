"""Write path: quantize full 16-token blocks into tier-1 pages, one Triton program per (block, KV head) of a list,
or, for the blocks a write completes, per (token, KV head) of the write.

The kernel computes the function of ``certvllm.formats.pages.encode_pages`` field for field: the key
offset/scale metadata in float64 with the same directed roundings, codes in float32 with IEEE division
and ties-to-even rounding, INT4 value groups with float16 zero/scale rounded down/up, and the η/ν
annotations as float64 norms inflated by ``NORM_SLACK`` and rounded up to float32. Codes, metadata and
flags are bit-identical to the reference; η and ν are float64 norms where the reference now takes
scaled float32 norms (``formats.values.scaled_norm``): both are upper bounds once inflated by
``NORM_SLACK`` (2^-13) and they agree to ~1e-7 relative, so every guarantee of the reference holds
(P2 with ``P2_RELATIVE_SLACK``, η ≥ ‖V̂ − V‖ + 2u‖V̂‖, ν ≥ max ‖V‖, the precondition flag).

Two deliberate differences, both where the reference is itself at an edge: ⌈log₂ max need⌉ is taken from
the float64 bits (the reference's ``log2`` can round a value just above a power of two down onto it), and
NaN inputs are detected explicitly (GPU min/max ignore NaN); both only matter for pages that are
flagged anyway or that the reference would mis-scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certvllm.formats.keys import KEY_CODE_MAX
from certvllm.formats.layout import FLAG_PRECONDITION, FLAG_VALID, PageLayout, key_scale_lut
from certvllm.formats.values import NORM_SLACK, UNIT_ROUNDOFF_FP32, VALUE_CODE_MAX

from .common import (
    ceil_log2_f64,
    device_arg,
    fp16_round_down,
    fp16_round_up,
    fp32_round_up_nonneg,
    launch_device_ok,
    next_pow2,
    pow2_f64,
    precise,
    rint,
)
from .shape_class import JIT_OPTIONS


@triton.jit(**JIT_OPTIONS)
def _encode_pages_kernel(
    k_ptr,  # keys of the source blocks (float16/bfloat16); element (t, d) of item i at k_ptr + k_off[i] + t*K_ST + d*K_SC
    v_ptr,  # values (same dtype), token-major; element (t, d) of item i at v_ptr + v_off[i] + t*D + d
    k_off,  # [P] int64 element offset of each item's key block (FROM_SLOTS: [T] int64 token slots)
    v_off,  # [P] int64 element offset of each item's value block (unused with FROM_SLOTS)
    dst_off,  # [P] int64 byte offset of each item's page in the output (unused with FROM_SLOTS)
    gen,  # [blocks] int64 write generations of the 16-token blocks (read only with BUMP)
    out_u8,  # the page storage viewed as uint8
    out_f16,  # the same storage viewed as float16 (byte offsets / 2)
    out_f32,  # the same storage viewed as float32 (byte offsets / 4)
    lut64,  # [256] float64 key-scale mantissas (key_scale_lut() in float64)
    K_ST: tl.constexpr,  # key token stride (elements): D token-major, 1 channel-major
    K_SC: tl.constexpr,  # key channel stride (elements): 1 token-major, m·N channel-major
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # next power of two ≥ D
    GRP: tl.constexpr,  # value group size g
    NG: tl.constexpr,  # groups per token D/g
    NGP: tl.constexpr,  # next power of two ≥ NG
    V_CODES: tl.constexpr,  # byte offsets of the page fields (PageLayout)
    V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr,
    K_OFFSET: tl.constexpr,
    K_SCODE: tl.constexpr,
    HEADER: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    PADP: tl.constexpr,  # next power of two ≥ PAGE_BYTES − HEADER − 10 (reserved header bytes + padding)
    PRECISE: tl.constexpr,  # libdevice rint (compiled) or the 2^23 trick (interpreter)
    KL: tl.constexpr = 255.0,  # largest key code (PageLayout.key_levels, as a float)
    VL: tl.constexpr = 15.0,  # largest value code (PageLayout.value_levels)
    FROM_SLOTS: tl.constexpr = False,  # items (token, KV head) of a token-major shadow, offsets from the slots
    H_KV: tl.constexpr = 1,  # FROM_SLOTS: KV heads
    M_SUB: tl.constexpr = 1,  # FROM_SLOTS: 16-token blocks per engine block
    BUMP: tl.constexpr = False,  # FROM_SLOTS: add 1 to each encoded block's generation
    src_k=None,  # FROM_WRITE: the write's keys [T, H_KV, D] on the device (token stride KEY_T, head stride KEY_H)
    src_v=None,  # FROM_WRITE: the write's values (VAL_T, VAL_H)
    KEY_T=0,
    KEY_H=0,
    VAL_T=0,
    VAL_H=0,
    FROM_WRITE: tl.constexpr = False,  # FROM_SLOTS: a block's tokens that are in this write are read from it
    pool_k=None,  # WRITE_POOL: [blocks·H_KV, N, D] the direct-mapped promotion pool's key pages (slot = page)
    pool_tag=None,  # WRITE_POOL: [blocks·H_KV] int64 page id of each slot
    pool_gen=None,  # WRITE_POOL: [blocks·H_KV] int64 write generation of each slot's copy
    WRITE_POOL: tl.constexpr = False,  # FROM_SLOTS and BUMP: copy each encoded block's keys into its pool slot
):
    N: tl.constexpr = 16
    pid = tl.program_id(0)
    if FROM_SLOTS:  # item = token · H_KV + head; a token at its block's last offset completes the block
        head = (pid % H_KV).to(tl.int64)
        ti = (pid // H_KV).to(tl.int64)
        slot = tl.load(k_off + ti)
        if (slot >= 0) & (slot % N == N - 1):  # not padding, and the block is full
            block = slot // N
            run = M_SUB * N * D  # elements of one (engine block, head, k|v) run of the shadow
            run_base = (block // M_SUB * H_KV + head) * 2 * run
            koff = run_base + (block % M_SUB) * N * D
            dst = ((block // M_SUB * H_KV + head) * M_SUB + block % M_SUB) * PAGE_BYTES
            if BUMP:  # once per block (head 0): its pages changed, copies taken before are stale
                old = tl.atomic_add(gen + block, 1, mask=head == 0)
                if WRITE_POOL:  # head 0 tags every head's slot of the block with the generation it just made
                    for hh in tl.static_range(H_KV):
                        tl.store(pool_tag + block * H_KV + hh, block * H_KV + hh, mask=head == 0)
                        tl.store(pool_gen + block * H_KV + hh, old + 1, mask=head == 0)
            _encode_block(k_ptr, v_ptr, koff, koff + run, dst, out_u8, out_f16, out_f32, lut64, K_ST, K_SC, D,
                          DP, GRP, NG, NGP, V_CODES, V_SCALE, V_ZERO, K_OFFSET, K_SCODE, HEADER, PAGE_BYTES,
                          PADP, PRECISE, KL, VL, k_off, ti, slot, head, H_KV, block, src_k, src_v, KEY_T,
                          KEY_H, VAL_T, VAL_H, FROM_WRITE, pool_k, WRITE_POOL)  # fmt: skip
    else:
        dst = tl.load(dst_off + pid)
        if dst >= 0:  # a caller's list may hold -1 where nothing is to be encoded
            _encode_block(k_ptr, v_ptr, tl.load(k_off + pid), tl.load(v_off + pid), dst, out_u8, out_f16, out_f32,
                          lut64, K_ST, K_SC, D, DP, GRP, NG, NGP, V_CODES, V_SCALE, V_ZERO, K_OFFSET, K_SCODE,
                          HEADER, PAGE_BYTES, PADP, PRECISE, KL, VL, k_off, 0, 0, 0, H_KV, 0, src_k, src_v, KEY_T,
                          KEY_H, VAL_T, VAL_H, False, pool_k, False)  # fmt: skip


@triton.jit
def _encode_block(
    k_ptr, v_ptr, koff, voff, dst, out_u8, out_f16, out_f32, lut64,
    K_ST: tl.constexpr, K_SC: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, GRP: tl.constexpr,
    NG: tl.constexpr, NGP: tl.constexpr, V_CODES: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    K_OFFSET: tl.constexpr, K_SCODE: tl.constexpr, HEADER: tl.constexpr, PAGE_BYTES: tl.constexpr,
    PADP: tl.constexpr, PRECISE: tl.constexpr, KL: tl.constexpr, VL: tl.constexpr,
    k_off, ti, slot, head, H_KV: tl.constexpr, block, src_k, src_v, KEY_T, KEY_H, VAL_T, VAL_H,
    FROM_WRITE: tl.constexpr, pool_k, WRITE_POOL: tl.constexpr,
):  # fmt: skip
    """One (16-token block, KV head) page: keys from ``k_ptr + koff``, values from ``v_ptr + voff``, into the page at
    byte ``dst``; with FROM_WRITE the block's tokens that the write holds (its token ``ti`` completes the block
    at ``slot``) come from ``src_k``/``src_v``; with WRITE_POOL the keys also go into the pool slot of
    ``(block, head)``. The kernel's arguments of the same names say the rest."""
    N: tl.constexpr = 16
    HALF: tl.constexpr = GRP // 2
    t = tl.arange(0, N)
    d = tl.arange(0, DP)
    dm = d < D
    from_shadow = dm[None, :]  # [1, DP]: where the shadow is read
    if FROM_WRITE:  # token j of the block is read from the write where the write's token ti − 15 + j has its slot
        first = ti - (N - 1)
        prior = tl.load(k_off + first + t, mask=(first + t) >= 0, other=-1)
        inwrite = ((first + t) >= 0) & (prior == slot - (N - 1) + t)  # [N]
        outside = ~inwrite
        from_shadow = from_shadow & outside[:, None]

    # ---------------- keys: per-channel offset and log-coded scale, INT8 codes
    k_raw = tl.load(k_ptr + koff + t[:, None] * K_ST + d[None, :] * K_SC, mask=from_shadow, other=0.0)
    if FROM_WRITE:
        k_dev = tl.load(src_k + (first + t[:, None]) * KEY_T + head * KEY_H + d[None, :],
                        mask=dm[None, :] & inwrite[:, None], other=0.0)  # fmt: skip
        k_raw = tl.where(inwrite[:, None], k_dev, k_raw)
    if WRITE_POOL:  # the shadow's bytes of this (block, head), token-major, into the page's own slot
        tl.store(pool_k + (block * H_KV + head) * (N * D) + t[:, None] * D + d[None, :], k_raw, mask=dm[None, :])
    k = k_raw.to(tl.float32)
    k_nan = tl.max(tl.where(k != k, 1, 0), axis=0) > 0  # [DP]
    lo = tl.min(tl.where(dm[None, :], k, float("inf")), axis=0)
    hi = tl.max(tl.where(dm[None, :], k, float("-inf")), axis=0)
    lo = tl.where(dm, lo, 0.0)
    hi = tl.where(dm, hi, 0.0)
    off16 = fp16_round_down(lo)
    off32 = off16.to(tl.float32)
    need = (hi.to(tl.float64) - off32.to(tl.float64)) / KL
    fin = (need == need) & (tl.abs(need) < float("inf")) & ~k_nan
    need = tl.where(fin, tl.maximum(need, 0.0), 0.0)
    keys_finite = tl.min(tl.where(dm & ~fin, 0, 1), axis=0) > 0
    smax = tl.max(tl.where(dm, need, 0.0), axis=0)
    expo = ceil_log2_f64(tl.maximum(smax, 1.1754943508222875e-38))  # 2^-126
    in_range = (expo >= -128) & (expo <= 127)
    expo = tl.minimum(tl.maximum(expo, -128), 127)
    ratio = need / pow2_f64(expo)  # exact: a power-of-two scaling
    c_lo = tl.full([DP], 1, tl.int32)
    c_hi = tl.full([DP], 255, tl.int32)
    for _ in tl.static_range(8):  # smallest c ≥ 1 with LUT[c]·2^E ≥ need (255 if none)
        mid = (c_lo + c_hi) >> 1
        ge = tl.load(lut64 + mid) >= ratio
        c_hi = tl.where(ge, mid, c_hi)
        c_lo = tl.where(ge, c_lo, mid + 1)
    code = tl.where(need > 0, c_lo, 0)
    sigma = (tl.load(lut64 + code) * pow2_f64(expo)).to(tl.float32)
    inv = tl.where(sigma > 0, sigma, 1.0)
    x = tl.math.div_rn(k - off32[None, :], inv[None, :])
    qk = rint(tl.minimum(tl.maximum(x, 0.0), KL), PRECISE)
    qk = tl.where(x != x, 0.0, qk)
    tl.store(out_u8 + dst + t[:, None] * D + d[None, :], qk.to(tl.uint8), mask=dm[None, :])
    off_clean = tl.where(tl.abs(off32) < float("inf"), off16, 0.0)
    tl.store(out_f16 + (dst + K_OFFSET) // 2 + d, off_clean.to(tl.float16), mask=dm)
    tl.store(out_u8 + dst + K_SCODE + d, code.to(tl.uint8), mask=dm)

    # ---------------- values: INT4 per token and group; elements split into even / odd (the two nibbles)
    grp = tl.arange(0, NGP)
    j = tl.arange(0, HALF)
    gm = grp < NG
    col = grp[None, :, None] * GRP + 2 * j[None, None, :]  # [1, NGP, HALF] even element of each pair
    vmask = gm[None, :, None] & (t[:, None, None] >= 0)
    vbase = v_ptr + voff + t[:, None, None] * D + col
    vmask_shadow = vmask
    if FROM_WRITE:
        vmask_shadow = vmask & outside[:, None, None]
    ve = tl.load(vbase, mask=vmask_shadow, other=0.0)  # [N, NGP, HALF]
    vo = tl.load(vbase + 1, mask=vmask_shadow, other=0.0)
    if FROM_WRITE:
        vsrc = src_v + (first + t[:, None, None]) * VAL_T + head * VAL_H + col
        vin = vmask & inwrite[:, None, None]
        ve = tl.where(vin, tl.load(vsrc, mask=vin, other=0.0), ve)
        vo = tl.where(vin, tl.load(vsrc + 1, mask=vin, other=0.0), vo)
    ve = ve.to(tl.float32)
    vo = vo.to(tl.float32)
    v_nan = tl.max(tl.max(tl.where((ve != ve) | (vo != vo), 1, 0), axis=2), axis=1) > 0  # [N]
    glo = tl.minimum(
        tl.min(tl.where(vmask, ve, float("inf")), axis=2), tl.min(tl.where(vmask, vo, float("inf")), axis=2)
    )
    ghi = tl.maximum(
        tl.max(tl.where(vmask, ve, float("-inf")), axis=2), tl.max(tl.where(vmask, vo, float("-inf")), axis=2)
    )
    gm2 = gm[None, :] & (t[:, None] >= 0)
    glo = tl.where(gm2, glo, 0.0)
    ghi = tl.where(gm2, ghi, 0.0)
    zero16 = fp16_round_down(glo)  # [N, NGP]
    z64 = zero16.to(tl.float64)
    sneed = (ghi.to(tl.float64) - z64) / VL
    sneed = tl.where(sneed < 0, 0.0, sneed)  # clamp_min(0), NaN kept
    scale16 = fp16_round_up(sneed)
    z_ok = tl.abs(zero16.to(tl.float32)) < float("inf")
    s_ok = tl.abs(scale16.to(tl.float32)) < float("inf")
    h_ok = tl.abs(ghi) < float("inf")
    v_fin = tl.min(tl.min(tl.where(gm2 & ~(z_ok & s_ok & h_ok), 0, 1), axis=1), axis=0) > 0
    v_fin = v_fin & (tl.max(tl.where(v_nan, 1, 0), axis=0) == 0)
    zero16 = tl.where(z_ok, zero16, 0.0).to(tl.float16)
    scale16 = tl.where(s_ok, scale16, 0.0).to(tl.float16)
    z32 = zero16.to(tl.float32)[:, :, None]
    s32 = scale16.to(tl.float32)[:, :, None]
    vinv = tl.where(s32 > 0, s32, 1.0)
    xe = tl.math.div_rn(ve - z32, vinv)
    xo = tl.math.div_rn(vo - z32, vinv)
    qe = rint(tl.minimum(tl.maximum(xe, 0.0), VL), PRECISE)
    qo = rint(tl.minimum(tl.maximum(xo, 0.0), VL), PRECISE)
    qe = tl.where((xe != xe) | (s32 == 0), 0.0, qe)
    qo = tl.where((xo != xo) | (s32 == 0), 0.0, qo)
    he = z32 + qe * s32  # v̂ as the read path forms it (code·scale is exact, one rounding)
    ho = z32 + qo * s32
    packed = qe.to(tl.int32) | (qo.to(tl.int32) << 4)
    tl.store(
        out_u8 + dst + V_CODES + t[:, None, None] * (D // 2) + grp[None, :, None] * HALF + j[None, None, :],
        packed.to(tl.uint8),
        mask=vmask,
    )
    tl.store(out_f16 + (dst + V_SCALE) // 2 + t[:, None] * NG + grp[None, :], scale16, mask=gm2)
    tl.store(out_f16 + (dst + V_ZERO) // 2 + t[:, None] * NG + grp[None, :], zero16, mask=gm2)

    # η, ν: float64 norms per token, max over the block, inflated and rounded up
    de = tl.where(vmask, (he - ve).to(tl.float64), 0.0)
    do = tl.where(vmask, (ho - vo).to(tl.float64), 0.0)
    err2 = tl.sum(tl.sum(de * de + do * do, axis=2), axis=1)
    he64 = tl.where(vmask, he.to(tl.float64), 0.0)
    ho64 = tl.where(vmask, ho.to(tl.float64), 0.0)
    hat2 = tl.sum(tl.sum(he64 * he64 + ho64 * ho64, axis=2), axis=1)
    ve64 = tl.where(vmask, ve.to(tl.float64), 0.0)
    vo64 = tl.where(vmask, vo.to(tl.float64), 0.0)
    nrm2 = tl.sum(tl.sum(ve64 * ve64 + vo64 * vo64, axis=2), axis=1)
    err = tl.sqrt(err2) + 2 * 5.9604644775390625e-08 * tl.sqrt(hat2)  # 2u·‖V̂‖, u = 2^-24
    nrm = tl.sqrt(nrm2)
    err = tl.where(tl.abs(err) < float("inf"), err, 0.0)  # NaN and inf → 0, as the reference's clean()
    nrm = tl.where(tl.abs(nrm) < float("inf"), nrm, 0.0)
    eta = fp32_round_up_nonneg(tl.max(err, axis=0) * 1.0001220703125)  # NORM_SLACK = 1 + 2^-13
    nu = fp32_round_up_nonneg(tl.max(nrm, axis=0) * 1.0001220703125)

    # ---------------- header (η, ν, E, flags), reserved bytes and padding zeroed
    tl.store(out_f32 + (dst + HEADER) // 4, eta)
    tl.store(out_f32 + (dst + HEADER) // 4 + 1, nu)
    tl.store(out_u8 + dst + HEADER + 8, (expo & 255).to(tl.uint8))
    violated = ~(keys_finite & in_range & v_fin)
    flags = tl.where(violated, 3, 1)  # FLAG_VALID | FLAG_PRECONDITION
    tl.store(out_u8 + dst + HEADER + 9, flags.to(tl.uint8))
    pad = tl.arange(0, PADP)
    tl.store(out_u8 + dst + HEADER + 10 + pad, tl.zeros([PADP], tl.uint8), mask=pad < PAGE_BYTES - HEADER - 10)


_LUT64: dict[torch.device, torch.Tensor] = {}


def _lut64(device: torch.device) -> torch.Tensor:
    if device not in _LUT64:
        _LUT64[device] = key_scale_lut().to(torch.float64).to(device)
    return _LUT64[device]


def encode_into(
    pages: torch.Tensor,
    dst_offsets: torch.Tensor,
    k_src: torch.Tensor,
    k_offsets: torch.Tensor,
    v_src: torch.Tensor,
    v_offsets: torch.Tensor,
    layout: PageLayout,
    keys_channel_major_stride: int | None = None,
) -> None:
    """Encode ``P`` full blocks into pages in place.

    Args:
        pages: uint8 storage (any shape, contiguous) that receives the pages.
        dst_offsets: ``[P]`` int64 byte offset of each page inside ``pages``; negative: no page (skipped).
        k_src, v_src: float16/bfloat16 storage holding the originals (may be pinned host memory that the
            device reads through its unified address; on CPU under the interpreter, any tensor).
        k_offsets, v_offsets: ``[P]`` int64 element offsets of each block's keys / values (token-major
            ``[N, D]`` runs, keys channel-major ``[D, ·]`` with token stride 1 and channel stride
            ``keys_channel_major_stride`` when that is given).
        layout: the page layout.
    """
    p = dst_offsets.numel()
    if p == 0:
        return
    launch_device_ok(pages)
    if keys_channel_major_stride is None:
        k_st, k_sc = layout.head_dim, 1
    else:
        k_st, k_sc = 1, int(keys_channel_major_stride)
    _encode_pages_kernel[(p,)](
        device_arg(k_src), device_arg(v_src), k_offsets, v_offsets, dst_offsets, dst_offsets,
        pages, pages.view(torch.float16), pages.view(torch.float32), _lut64(pages.device),
        K_ST=k_st, K_SC=k_sc, **_layout_args(layout), num_warps=4,
    )  # fmt: skip


def _layout_args(layout: PageLayout) -> dict:
    """The encode kernel's compile-time arguments that follow the page layout."""
    d, pad = layout.head_dim, layout.page_bytes - layout.header - 10
    return dict(D=d, DP=next_pow2(d), GRP=layout.value_group, NG=layout.groups, NGP=next_pow2(layout.groups),
                V_CODES=layout.v_codes, V_SCALE=layout.v_scale, V_ZERO=layout.v_zero, K_OFFSET=layout.k_offset,
                K_SCODE=layout.k_scale_code, HEADER=layout.header, PAGE_BYTES=layout.page_bytes,
                PADP=next_pow2(pad), PRECISE=precise(), KL=float(layout.key_levels),
                VL=float(layout.value_levels))  # fmt: skip


def encode_completed_blocks(pages: torch.Tensor, shadow: torch.Tensor, slots: torch.Tensor, layout: PageLayout,
                            num_kv_heads: int, sub_blocks: int, generation: torch.Tensor | None = None,
                            pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            source: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
    """Encode the blocks a write completes, in one launch: for every token slot at the last offset of its 16-token
    block, that block's page of every KV head, from the token-major shadow (what :func:`encode_into` does for a
    list of blocks, with the same bytes; the offsets are formed in the kernel, so the caller runs no glue).

    Args:
        pages: ``[E, H_kv, M·page_bytes]`` uint8 (contiguous) tier-1 pages.
        shadow: ``[E, H_kv, 2, M·16, D]`` token-major originals (pinned host memory the device addresses).
        slots: ``[T]`` int64 token slots of the write (16-token block · 16 + offset), on the pages' device;
            negative: padding.
        num_kv_heads, sub_blocks: ``H_kv`` and ``M`` (16-token blocks per engine block).
        generation: ``[blocks]`` int64 write generations, each encoded block's bumped by 1 (None: not counted).
        pool: a direct-mapped promotion pool's ``(keys [blocks·H_kv, 16, D], tag [blocks·H_kv] int64,
            tag_gen [blocks·H_kv] int64)``, slot = page ``block·H_kv + head``: each encoded (block, head) copies
            its keys from the shadow into its slot, tagged with the block's new generation, so the promotion pass
            finds them in VRAM instead of reading them over PCIe at their first promotion
            (``kv.promotion_cache.PromotionCache.write_through``). Needs ``generation``.
        source: the write's ``(key, value)`` ``[T, H_kv, D]`` on the pages' device (the tokens of ``slots``, in the
            shadow's dtype, channels contiguous), or None. Token j of a completed block whose last token is the
            write's token i is read from the write's token i − 15 + j where that token's slot is the block's
            j-th (a prefill's blocks: all 16; a decode token completing a block: the last; a chunk's first block:
            its tokens from this chunk), the others from the shadow: the same bytes, this write's read in VRAM
            instead of over PCIe, and none of them read back from the shadow this write's scatter stores into.
    """
    t = slots.numel()
    if t == 0:
        return
    launch_device_ok(pages)
    bump = generation is not None
    extra = {}
    if pool is not None:
        keys, tag, tag_gen = pool
        blocks = pages.shape[0] * sub_blocks
        if not bump or keys.shape != (blocks * num_kv_heads, 16, layout.head_dim) or tag.numel() != keys.shape[0]:
            raise ValueError(
                f"encode_completed_blocks: a write-through pool needs the write generations and one slot per "
                f"(16-token block, KV head) page ({blocks} x {num_kv_heads} pages of [16, {layout.head_dim}]), "
                f"got generation={'set' if bump else None} and pool keys {tuple(keys.shape)}; pass pool=None for "
                "a hashed pool (PromotionCache.write_through is False)"
            )
        extra = dict(pool_k=keys, pool_tag=tag, pool_gen=tag_gen, WRITE_POOL=True)
    if source is not None:
        key, value = source
        want = (t, num_kv_heads, layout.head_dim)
        if key.shape != want or value.shape != want or key.dtype != shadow.dtype or value.dtype != shadow.dtype:
            raise ValueError(f"encode_completed_blocks: source keys {tuple(key.shape)} {key.dtype} and values "
                             f"{tuple(value.shape)} {value.dtype} must be {want} in the shadow's dtype {shadow.dtype}, "
                             "the tokens of slots; pass source=None to read every block from the shadow")  # fmt: skip
        if key.stride(2) != 1 or value.stride(2) != 1:
            raise ValueError("encode_completed_blocks: the source's channels must be contiguous (stride 1)")
        extra.update(src_k=key, src_v=value, KEY_T=key.stride(0), KEY_H=key.stride(1), VAL_T=value.stride(0),
                     VAL_H=value.stride(1), FROM_WRITE=True)  # fmt: skip
    _encode_pages_kernel[(t * num_kv_heads,)](
        device_arg(shadow), device_arg(shadow), slots, slots, slots, generation if bump else slots,
        pages, pages.view(torch.float16), pages.view(torch.float32), _lut64(pages.device),
        K_ST=layout.head_dim, K_SC=1, **_layout_args(layout), FROM_SLOTS=True, H_KV=num_kv_heads,
        M_SUB=sub_blocks, BUMP=bump, num_warps=4, **extra,
    )  # fmt: skip


def encode_pages_triton(k: torch.Tensor, v: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Triton counterpart of :func:`certvllm.formats.pages.encode_pages`.

    Args:
        k, v: ``[..., N, D]`` float16/bfloat16 keys (post-RoPE) and values.

    Returns:
        ``[..., page_bytes]`` uint8 pages.
    """
    lead = k.shape[:-2]
    n, d = layout.block_size, layout.head_dim
    kk = k.reshape(-1, n, d).contiguous()
    vv = v.reshape(-1, n, d).contiguous()
    p = kk.shape[0]
    pages = torch.empty(p, layout.page_bytes, dtype=torch.uint8, device=k.device)
    idx = torch.arange(p, device=k.device, dtype=torch.int64)
    encode_into(pages, idx * layout.page_bytes, kk, idx * (n * d), vv, idx * (n * d), layout)
    return pages.view(*lead, layout.page_bytes)


# constants the kernel hard-codes, checked against their sources
assert KEY_CODE_MAX == 255 and VALUE_CODE_MAX == 15
assert NORM_SLACK == 1.0001220703125 and UNIT_ROUNDOFF_FP32 == 5.9604644775390625e-08
assert FLAG_VALID == 1 and FLAG_PRECONDITION == 2
