"""INT8 tensor-core scores (``certvllm.bounds.int8_scores``, the arithmetic of phase 1, docs/certification.md §5.2):
the emulated kernel scores stay within R_b of the real-number INT8 score ŝ_t = Σ_c q'_c(ℓ̃_c + code·σ_c), evaluated in
float64, on keys quantized by the product's quantizer (with and without outlier channels) and on inputs built to make
every rounding of the arithmetic as large as it can be; R_b is never below the float32 path's and, on keys centred in
their block, within a few per cent of it. Tolerance: the float64 reference's own error, ≤ 2^-45·Σ_c|terms|, is taken off
the bound's margin (10^6 times smaller than the bound)."""

from __future__ import annotations

import math

import pytest
import torch

from certvllm.bounds import rounding_factor
from certvllm.bounds.int8_scores import (
    MMA_E_MIN,
    MMA_HEADROOM,
    mma_query_exponents,
    mma_score_rounding_factors,
    mma_scores,
)
from certvllm.formats.keys import key_magnitude, key_sigma, quantize_keys
from certvllm.formats.layout import key_scale_lut

REF_SLACK = 2.0**-45


def exact_scores(q, offsets, sigma, codes) -> torch.Tensor:
    """Σ_c q'_c (ℓ̃_c + code_{t,c}·σ_c) in float64 ``[..., N]``."""
    k_hat = offsets.double()[..., None, :] + codes.double() * sigma.double()[..., None, :]
    return (q.double()[..., None, :] * k_hat).sum(-1)


def check(q, offsets, mant, exponent, codes) -> torch.Tensor:
    """Assert |kernel score − ŝ| ≤ R_b for every token (finite R_b); returns R_b ``[...]``."""
    sigma = mant * torch.pow(2.0, exponent.double()).float()[..., None]
    scores, bound = mma_scores(q, offsets, mant, exponent, codes)
    err = (scores.double() - exact_scores(q, offsets, sigma, codes)).abs()
    magnitude = (q.double().abs()[..., None, :] * (offsets.double().abs()[..., None, :]
                 + codes.double() * sigma.double()[..., None, :])).sum(-1)  # fmt: skip
    fin = torch.isfinite(bound)
    ok = err <= bound.double()[..., None] - REF_SLACK * magnitude
    assert bool(ok[fin].all()), float((err / bound[..., None]).max())
    return bound


def quantized_blocks(gen, blocks: int, d: int, outliers: float, centre: float = 3.0):
    """``blocks`` 16-token key blocks through the product's quantizer (some channels ``outliers`` times wider, a
    per-channel offset of ``centre``·N(0, 1)) and a query per block: (q', ℓ̃, LUT[j], E, codes, σ, M)."""
    k = torch.randn(blocks, 16, d, generator=gen)
    k[..., : d // 16] *= outliers
    k = (k + centre * torch.randn(blocks, 1, d, generator=gen)).half()
    qk = quantize_keys(k)
    lut = key_scale_lut()
    sigma = key_sigma(qk.scale_code, qk.exponent, lut)
    q = (torch.randn(blocks, d, generator=gen) * (1 / math.sqrt(d))).float()
    q[..., : d // 16] *= outliers
    mant = lut[qk.scale_code.long()]
    return q, qk.offset.float(), mant, qk.exponent.long(), qk.codes, sigma, key_magnitude(qk.offset, sigma)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("outliers,centre", [(1.0, 0.0), (20.0, 0.0), (1.0, 3.0), (20.0, 30.0)])
def test_scores_stay_within_r_b_on_quantized_keys(d, outliers, centre):
    gen = torch.Generator().manual_seed(d + int(outliers) + int(centre))
    q, off, mant, ex, codes, sigma, mag = quantized_blocks(gen, 256, d, outliers, centre)
    bound = check(q, off, mant, ex, codes)
    float32_path = rounding_factor(d) * (q.abs() * mag).sum(-1)  # the float32 scores' R_b on the same blocks
    assert bool((bound >= float32_path * (1 - 2.0**-20)).all())  # R_b covers the promotion pass's scores too
    if centre == 0.0:  # keys centred in their block: the mid-offsets are small, R_b close to the float32 path's
        assert float((bound / float32_path).max()) < 1.1


def test_adversarial_roundings_ties_bytes_and_extreme_codes():
    """Every head has one channel at 100 (so e_q = 0 with E_b = 0: x = q'·2^24) and the others built to stress one
    rounding: exactly at rint's ties (x = m + ½), at the byte boundaries of the biased split (X = ±255, ±256, ±65535,
    ±65536, ±(2^24 − 1), ±2^24: carries through every byte), at the headroom (|x| just below 126·2^24), all of one
    sign; every code 255, 0, 128 or a ramp; offsets that cancel the mid-shift (−128σ), fall half-way, or are large;
    and an all-zero head."""
    d = 128
    m = torch.arange(d - 1, dtype=torch.float64)
    ties = ((2 * (m * 977 % 2**20) + 1) * 2.0**-25).float()  # x = m' + 0.5 exactly
    marks = torch.tensor([255, 256, 65535, 65536, 2**24 - 1, 2**24], dtype=torch.float64)
    bytes_ = (marks.repeat(d // 6 + 1)[: d - 1] * (1 - 2 * (m % 2)) * 2.0**-24).float()
    edge = torch.full((d - 1,), 126.0 * (1 - 2.0**-19), dtype=torch.float32) * (1 - 2 * (m % 3 == 0)).float()
    rows = [ties, bytes_, edge, -ties, torch.zeros(d - 1)]
    q = torch.stack([torch.cat([torch.tensor([100.0 if i < 4 else 0.0]), r.float()]) for i, r in enumerate(rows)])
    n = q.shape[0]
    assert bool((mma_query_exponents(q[:4]) == 0).all())
    e = torch.zeros(n, dtype=torch.long)  # E_b = 0 and LUT[255] = 1: σ = 1, p = q'
    mant = torch.ones(n, d)
    offsets = torch.stack([torch.full((d,), v) for v in (-128.0, -127.5, 2.25, 30000.0, 7.0)]).float()
    codes = torch.full((n, 16, d), 255, dtype=torch.uint8)
    codes[:, 1] = 0
    codes[:, 2, ::2] = 128
    codes[:, 3] = (torch.arange(d) * 37 % 256).to(torch.uint8)
    bound = check(q, offsets, mant, e, codes)
    assert bool(torch.isfinite(bound).all())
    scores, _ = mma_scores(q[4:], offsets[4:], mant[4:], e[4:], codes[4:])
    assert bool((scores == 0).all())  # an all-zero head: exactly 0 (Σ 0·ℓ', no limb term)


def test_integer_sums_are_exact_in_float32_up_to_d_512():
    """The largest limbs against the largest shifted codes: |J| < 2^24, so each conversion to float32 is exact (the
    emulation computes J in int64 and the kernel in int32; equal below 2^31)."""
    d = 512
    q = torch.full((1, d), float(MMA_HEADROOM), dtype=torch.float32)
    q[:, ::2] *= -1.0
    codes = torch.zeros(1, 16, d, dtype=torch.uint8)  # code − 128 = −128 everywhere
    c_w, c_p, c_s = mma_score_rounding_factors(d)
    assert c_w > 0 and c_p > 0 and c_s > 0
    bound = check(q, torch.zeros(1, d), torch.ones(1, d), torch.zeros(1, dtype=torch.long), codes)
    assert bool(torch.isfinite(bound).all())
    assert 128 * 128 * d < 2**24


def test_out_of_range_heads_get_an_infinite_bound():
    """A tiny head on tiny keys: e = E_b + e_q below the kernel's range, scores 0 and R_b = +inf (the head escalates);
    a zero head stays in range with exact scores."""
    d = 64
    q = torch.full((2, d), 2.0**-110)
    q[1] = 0.0
    mant = torch.ones(2, d)
    ex = torch.full((2,), -30, dtype=torch.long)
    codes = torch.full((2, 16, d), 200, dtype=torch.uint8)
    scores, bound = mma_scores(q, torch.zeros(2, d), mant, ex, codes)
    assert int(mma_query_exponents(q[0])) < MMA_E_MIN
    assert bool(torch.isinf(bound[0])) and bool((scores[0] == 0).all())
    assert bool(torch.isfinite(bound[1])) and bool((scores[1] == 0).all())
