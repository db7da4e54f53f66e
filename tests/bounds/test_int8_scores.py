"""INT8 tensor-core scores with a two-limb query (``certvllm.bounds.int8_scores``): the emulated kernel scores stay
within the stated rounding term of the real-number INT8 score ŝ_t = Σ_c q'_c (ℓ̃_c + code·σ_c), evaluated in float64,
on keys quantized by the product's quantizer (two and three limbs) and on inputs built to make the split's residuals
and the conversions as large as they can be. Tolerance: the float64 reference's own error, ≤ 2^-45 · Σ_c |terms|, is
taken off the bound's margin (it is 10^6 times smaller than the bound)."""

from __future__ import annotations

import math

import pytest
import torch

from certvllm.bounds import delta_factor, rounding_factor
from certvllm.bounds.int8_scores import (
    LIMB_HEADROOM,
    limb_integer_scores,
    limb_score_rounding,
    limb_scores,
    split_query_limbs,
)
from certvllm.formats.keys import key_sigma, quantize_keys
from certvllm.formats.layout import key_scale_lut

REF_SLACK = 2.0**-45


def exact_scores(q: torch.Tensor, offsets: torch.Tensor, sigma: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Σ_c q'_c (ℓ̃_c + code_{t,c}·σ_c) in float64 ``[..., N]``."""
    k_hat = offsets.double()[..., None, :] + codes.double() * sigma.double()[..., None, :]
    return (q.double()[..., None, :] * k_hat).sum(-1)


def check(q, offsets, sigma, codes, count: int) -> torch.Tensor:
    """Assert |kernel score − ŝ| ≤ bound for every token; returns the bound ``[...]``."""
    scores, split = limb_scores(q, offsets, sigma, codes, count)
    bound = limb_score_rounding(q, offsets, sigma, split)
    err = (scores.double() - exact_scores(q, offsets, sigma, codes)).abs()
    magnitude = (q.double().abs()[..., None, :] * (offsets.double().abs()[..., None, :]
                 + codes.double() * sigma.double()[..., None, :])).sum(-1)  # fmt: skip
    assert bool((err <= bound.double()[..., None] - REF_SLACK * magnitude).all()), float((err / bound[..., None]).max())
    assert bool((split.residual.abs() <= split.scale.double()[..., None] * 256.0 ** (1 - count) / 2).all())
    assert int(split.limbs.max()) <= 127 and int(split.limbs.min()) >= -128
    return bound


def quantized_blocks(gen: torch.Generator, heads: int, d: int, outliers: float) -> tuple:
    """Keys of ``heads`` 16-token blocks (some channels ``outliers`` times wider) through the product's quantizer,
    and a query per block: (q' float32, ℓ̃ float32, σ float32, codes uint8)."""
    k = torch.randn(heads, 16, d, generator=gen)
    k[..., : d // 16] *= outliers
    k = (k + 3.0 * torch.randn(heads, 1, d, generator=gen)).half()
    qk = quantize_keys(k)
    sigma = key_sigma(qk.scale_code, qk.exponent, key_scale_lut())
    q = (torch.randn(heads, d, generator=gen) * (1 / math.sqrt(d))).float()
    q[..., : d // 16] *= outliers
    return q, qk.offset.float(), sigma, qk.codes


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("outliers", [1.0, 20.0])
def test_limb_scores_stay_within_their_rounding_term_on_quantized_keys(d, outliers, count):
    gen = torch.Generator().manual_seed(d + int(outliers))
    q, offsets, sigma, codes = quantized_blocks(gen, 256, d, outliers)
    bound = check(q, offsets, sigma, codes, count)
    # the price of the split next to the key-quantization term Δ_b (docs/certification.md §5.2 has the sizes):
    # with three limbs it is below the float32 path's rounding term, whatever the outliers
    delta = delta_factor(d) * (q.abs() * sigma).sum(-1)
    if count == 3:
        float32_path = rounding_factor(d) * (q.abs() * (offsets.abs() + 256 * sigma)).sum(-1)
        assert float((bound / float32_path).max()) < 1.0  # smaller than the float32 path's own
        assert float((bound / delta).max()) < 0.05


@pytest.mark.parametrize("count", [2, 3])
def test_adversarial_splits_ties_carries_and_saturated_codes(count):
    """Residuals all at their largest with one sign, every code 255, ties at the split's rounding points, carries
    through the limbs, an all-zero query, and a query at the headroom's edge."""
    d = 128
    s = 2.0**-6
    lead = torch.arange(d, dtype=torch.float64) % 200 - 100  # leading limbs within ±100
    low = 1.0 / 256.0**count  # the last limb's unit, in units of S
    # just below a tie of the last limb: every residual near its largest, all of one sign
    near = ((lead + (37 + 0.5 - 2.0**-6) * low * 256) * s).float()
    # exactly at ties: rne picks the even neighbour
    ties = ((lead + (torch.arange(d) % 255 - 127 + 0.5) * low * 256) * s).float()
    # the second limb rounds to +128 and carries into the first: ±100 + 127.9/256
    carry = ((100.0 - 200.0 * (torch.arange(d) % 2) + 127.9 / 256) * s).float()
    edge = torch.full((d,), LIMB_HEADROOM * s, dtype=torch.float32)
    edge[1::2] *= -1
    zeros = torch.zeros(d, dtype=torch.float32)
    sigma = torch.ones(5, d, dtype=torch.float32)  # p = q'·1: the split sees the query itself
    q = torch.stack([near, ties, carry, edge, zeros])
    offsets = torch.stack([torch.full((d,), v) for v in (-1.5, 0.0, 2.25, 0.0, 7.0)]).float()
    codes = torch.full((5, 16, d), 255, dtype=torch.uint8)
    codes[:, 1] = 0
    codes[:, 2, ::2] = 128
    split = split_query_limbs(q * sigma, count)
    assert bool((split.limbs[1, 2] == -128).any())  # carried
    if count == 2:  # float32 keeps the sub-tie offset only where the last limb is within its 24 bits
        share = float(split.residual[0].abs().sum() / (d * split.scale[0].double() * 256.0 ** (1 - count) / 2))
        assert share > 0.9, share  # every residual at (nearly) its largest
    bound = check(q, offsets, sigma, codes, count)
    assert float(bound[4]) == 0.0  # an all-zero query scores exactly 0 with no rounding at all
    assert bool((limb_scores(q, offsets, sigma, codes, count)[0][4] == 0).all())


def test_integer_scores_are_exact_in_float32_up_to_d_512():
    d = 512
    q = torch.full((1, d), LIMB_HEADROOM * 2.0**3, dtype=torch.float32)  # leading limbs at their largest
    q[:, ::2] *= -1.0 + 2.0**-10  # and lower limbs that are not zero
    codes = torch.full((1, 16, d), 255, dtype=torch.uint8)
    split = split_query_limbs(q, 3)
    sums = limb_integer_scores(codes, split)
    want = (split.limbs.long()[..., None, :] * codes.long()).sum(-1)
    assert torch.equal(sums, want) and int(sums.abs().max()) < 2**24
    with pytest.raises(TypeError, match="float32"):
        split_query_limbs(q.double())
    with pytest.raises(ValueError, match="1 to 4 limbs"):
        split_query_limbs(q, 5)
