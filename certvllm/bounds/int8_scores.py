"""INT8 tensor-core key scores: the arithmetic of phase 1 (``triton_kernels/phase1_mma.py``, its Gluon twin) as a
float64-checkable specification, and its rounding term R_b (derivation: ``docs/certification.md`` §5.2).

For one query head and one 16-token block the INT8 score is, in real arithmetic,

    ŝ_t = Σ_c q'_c·(ℓ̃_c + code_{t,c}·σ_c) = Σ_c q'_c·(ℓ̃_c + 128σ_c) + Σ_c p_c·(code_{t,c} − 128),   p_c = q'_c·σ_c,

with q' = fl(q·λ) (float32, the query every path uses), ℓ̃ the block's fp16 channel offsets, σ = LUT[j]·2^E the
channel scales (exact float32) and codes in 0..255. An int8 × int8 → int32 product is exact, so the codes are
multiplied exactly once the query is an integer: p̃ = fl(q'·σ) is put on the fixed-point grid 2^(e−24), e = E_b + e_q
(e_q from the head's max|q'|, so that |p̃|·2^(24−e) ≤ 126·2^24 with no reduction over the block),
X_c = rint(p̃_c·2^(24−e)) < 2^31, whose four bytes biased by 0x808080 are int8 limbs a_0…a_3 with
X = Σ_k a_k·256^(3−k). The kernel forms J_{k,t} = Σ_c a_{k,c}·(code_{t,c} − 128) in int32 (an MMA against the codes
XOR 0x80), |J| ≤ 2^14·D < 2^24, and

    ℓ'_c = fl(ℓ̃_c + 128σ_c),   L″ = fl(Σ_c q'_c·ℓ'_c),   s_t = fl(L″ + Σ_k J_{k,t}·2^(e−8k))  (any order)

Bound (``mma_score_rounding_factors``): |s_t − ŝ_t| ≤ c_W·Σ_c|q'_cℓ'_c| + c_P·Σ_c|p̃_c| + c_S·2^e, at least the float32
path's R_b on the same block. ``mma_scores`` emulates the kernel for the tests.
"""

from __future__ import annotations

from functools import cache

import torch

from certvllm.bounds.rounding import GAMMA_SLACK, UNIT_ROUNDOFF, gamma
from certvllm.bounds.terms import rounding_factor, sum_inflation

MMA_HEADROOM = 126
"""|x_c| ≤ 126·2^24: e_q from the head's max|q'| (σ ≤ 2^E_b), never from a reduction over the block; the top limb
stays in [−126, 126] after the bias."""
MMA_E_MIN = -100
MMA_E_MAX = 100
"""The clamp of e_q (a larger e_q only coarsens the grid; e_q above MMA_E_MAX would need max|q'| > 2^106)."""
MMA_GRID_MIN = -102
MMA_GRID_MAX = 105
MMA_EXPONENT_MAX = 120
"""The range of e = E_b + e_q (and of E_b) in which every power-of-two factor of the kernel is a normal float32 and
|J_k|·2^(e−8k) < 2^127 for D ≤ 512; outside it (tiny queries on tiny keys, or keys above 2^120) the block's scores are
0 and its R_b is +inf, which escalates the head (rung 3; finite scores keep the canary quiet). A zero query head is
always in range (all its terms are 0)."""
MMA_LIMB_MAGNITUDE = 1.004
"""Σ_k |a_k|·256^(3−k) ≤ |X| + 1.004·2^24 for the biased byte split (|a_1..3| ≤ 128: 2·128·65793 < 1.004·2^24)."""
KEY_MAGNITUDE_SLACK = 4 * UNIT_ROUNDOFF
"""The float32 key magnitude fl(max(|ℓ̃|, |fl(ℓ̃ + 255σ)|) + σ) is within 4u of the real M_c."""


@cache
def mma_score_rounding_factors(d: int) -> tuple[float, float, float]:
    """(c_W, c_P, c_S): R_b = c_W·W + c_P·P + c_S·2^e bounds |s_t − ŝ_t| for every token of the block, where W and P are
    the kernel's float32 sums Σ_c|q'_c·ℓ'_c| (ℓ' = fl(ℓ̃ + 128σ), the block's mid-offset) and Σ_c|p̃_c| (c_W, c_P carry
    the inflation of those sums) and e the block's grid exponent (docs §5.2).

    R_b also bounds the float32 path's scores of the same block (the promotion pass's exact ones, within
    ``rounding_factor(d)``·Σ|q'|·M_c, with M_c ≤ (1 + 2u)|ℓ'_c| + 129σ_c and the float32 M_c within 4u of it): c_W and
    c_P are at least that path's factors on those terms."""
    u = UNIT_ROUNDOFF
    g_dot, g4 = gamma(d), gamma(4)
    query = 2.0 * u * (1.0 + 3.0 * u) * (1.0 + 2.0 * u)  # fl(q·λ) against λq, on Σ|q'||k̂| ≤ (1+2u)(W + 129(1+2u)P)
    limb_w = g_dot + u * (1.0 + 2.0 * u) + g4 * (1.0 + g_dot) + query
    limb_p = 128.0 * u * (1.0 + 2.0 * u) + 128.0 * g4 + 129.0 * (1.0 + 2.0 * u) * query
    float32_path = (g_dot + 6.0 * u) * (1.0 + KEY_MAGNITUDE_SLACK)  # ``rounding_factor`` before its sum inflation
    inflate = sum_inflation(d)
    c_w = max(limb_w, float32_path * (1.0 + 2.0 * u)) * inflate
    c_p = max(limb_p, float32_path * 129.0 * (1.0 + 2.0 * u) ** 2) * inflate
    c_s = (128.0 * 2.0**-25 + 128.0 * 2.0**-174 + 128.0 * g4 * (2.0**-25 + MMA_LIMB_MAGNITUDE)) * d * GAMMA_SLACK
    assert c_w >= rounding_factor(d)
    return c_w, c_p, c_s


def mma_query_exponents(q_scaled: torch.Tensor) -> torch.Tensor:
    """e_q per query head (``q_scaled`` float32 ``[..., D]`` → int64 ``[...]``), as the kernel forms it: ⌈log₂⌉ of the
    float32 product max|q'|·fl((1 + 2^-20)/126) from its bits, MMA_E_MIN for a zero head, clamped to
    [MMA_E_MIN, MMA_E_MAX] (the raw value is returned too, for the range check)."""
    qa = q_scaled.abs()
    qmax = torch.where(torch.isfinite(qa), qa, torch.zeros_like(qa)).amax(dim=-1)
    need = qmax * torch.tensor((1.0 + 2.0**-20) / MMA_HEADROOM, dtype=torch.float32)
    bits = need.view(torch.int32).to(torch.int64)
    raw = ((bits >> 23) & 255) - 127 + ((bits & 8388607) != 0).to(torch.int64)
    raw = torch.where(qmax > 0, raw, torch.full_like(raw, MMA_E_MIN))
    return raw


def mma_scores(q_scaled: torch.Tensor, offsets: torch.Tensor, mantissa: torch.Tensor, exponent: torch.Tensor,
               codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The MMA kernel's arithmetic for one query head and block, emulated in float32/int64 (any leading dims): scores
    float32 ``[..., N]`` and R_b ``[...]`` (outside the kernel's range 0 and +inf, as the kernel writes them).

    Args:
        q_scaled: q' float32 ``[..., D]``; offsets: ℓ̃ float32 ``[..., D]``; mantissa: LUT[j_c] float32 ``[..., D]``;
        exponent: E_b int ``[...]``; codes: uint8 ``[..., N, D]``.
    """
    d = q_scaled.shape[-1]
    raw = mma_query_exponents(q_scaled)
    e_q = raw.clamp(MMA_E_MIN, MMA_E_MAX)
    ex = exponent.to(torch.int64).clamp(-126, 127)
    e = ex + e_q
    zero = q_scaled.abs().amax(dim=-1) == 0
    in_range = zero | ((raw <= MMA_E_MAX) & (e >= MMA_GRID_MIN) & (e <= MMA_GRID_MAX) & (ex <= MMA_EXPONENT_MAX))
    e = e.clamp(MMA_GRID_MIN, MMA_GRID_MAX)

    def pow2(k: torch.Tensor) -> torch.Tensor:
        return torch.pow(2.0, k.double()).float()

    qx = q_scaled * pow2(24 - e_q)[..., None]  # q'' (exact)
    x = qx * mantissa  # p̃·2^(24 − e)
    x_int = torch.round(x.double()).to(torch.int64)
    biased = x_int + 8421504
    limbs = torch.stack([biased >> 24, ((biased >> 16) & 255) - 128, ((biased >> 8) & 255) - 128, (biased & 255) - 128])
    j = ((codes.to(torch.int64) - 128)[None] * limbs[..., None, :]).sum(-1)  # [4, ..., N] exact
    sigma = mantissa * pow2(ex)[..., None]
    mid = offsets + 128.0 * sigma  # ℓ' = fl(ℓ̃ + 128σ)
    w = qx * mid
    unit = pow2(e_q - 24)
    lo = w.sum(-1) * unit  # L″ = Σ q'ℓ'
    w_sum = w.abs().sum(-1) * unit
    p_sum = x.abs().sum(-1) * pow2(e - 24)
    terms = sum(j[k].to(torch.float32) * pow2(e - 8 * k)[..., None] for k in range(4))
    score = terms + lo[..., None]
    c_w, c_p, c_s = mma_score_rounding_factors(d)
    bound = w_sum * c_w + p_sum * c_p + c_s * pow2(e)
    return torch.where(in_range[..., None], score, 0.0), torch.where(in_range, bound, float("inf"))
