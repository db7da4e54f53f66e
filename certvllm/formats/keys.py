"""INT8 keys: asymmetric, per channel, with scale and offset local to one full 16-token block.

For a block with channel minimum ℓ_c and maximum u_c:

* offset  ℓ̃_c = largest float16 ≤ ℓ_c;
* scale   σ_c = smallest grid value LUT[code]·2^E ≥ (u_c − ℓ̃_c)/255, E = ⌈log2 max_c σ⌉ per block;
* codes   q = round((k − ℓ̃_c)/σ_c) ∈ [0, 255], never clipped;  k̂ = ℓ̃_c + q·σ_c.

Then |k − k̂| ≤ σ_c/2 exactly (P2). A constant channel gets σ = 0 and reconstructs exactly.
The quantizer works in float64 and checks P2 itself; a block that violates it (non-finite values,
keys beyond the float16 range) is flagged so that readers escalate instead of trusting it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.formats.layout import KEY_CODE_MAX, SCALE_LUT_STEPS_PER_OCTAVE, key_scale_lut
from certvllm.formats.rounding import fp16_round_down

P2_RELATIVE_SLACK = 2.0**-14
"""The key error bound used everywhere is σ·(1/2 + P2_RELATIVE_SLACK). Codes are computed in float32:
t = fl(fl(k − ℓ̃)/σ) differs from the exact (k − ℓ̃)/σ ∈ [0, 255] by ≤ 2·255·u < 2^-15, so the
nearest code to t is within 1/2 + 2^-15 steps of k."""

_MIN_EXPONENT, _MAX_EXPONENT = -126, 126


@dataclass
class QuantizedKeys:
    """Quantized keys of a batch of full blocks; ``...`` is any leading batch shape.

    Attributes:
        codes: ``[..., N, D]`` uint8.
        offset: ``[..., D]`` float16, ℓ̃_c.
        scale_code: ``[..., D]`` uint8, index into :func:`key_scale_lut`.
        exponent: ``[...]`` int8, E.
        violated: ``[...]`` bool, True where precondition P2 could not be established.
    """

    codes: torch.Tensor
    offset: torch.Tensor
    scale_code: torch.Tensor
    exponent: torch.Tensor
    violated: torch.Tensor


def key_sigma(scale_code: torch.Tensor, exponent: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """σ as float32 ``[..., D]`` from codes ``[..., D]`` uint8 and exponents ``[...]`` int8.

    ``lut`` is :func:`key_scale_lut` on the same device. The product with 2^E is exact.
    """
    mant = lut[scale_code.long()]
    return torch.ldexp(mant, exponent.to(torch.int32).unsqueeze(-1).expand_as(mant))


def quantize_keys(k: torch.Tensor, levels: int = KEY_CODE_MAX) -> QuantizedKeys:
    """Quantize full blocks of keys ``[..., N, D]`` (float16 or bfloat16) to codes ``0..levels`` (255; fewer only
    for the stress study's formats: σ then covers the channel's range in ``levels`` steps, and P2 holds as ever).

    Per-channel metadata is chosen in float64 (small tensors); the codes are computed in float32,
    which the slack in :data:`P2_RELATIVE_SLACK` accounts for, so P2 holds by construction for every
    block whose originals are finite and whose minimum fits in float16.
    """
    kf = k.float()
    lo = kf.amin(dim=-2)
    hi = kf.amax(dim=-2)
    offset = fp16_round_down(lo)
    off64 = offset.double()
    need = (hi.double() - off64) / levels  # σ that covers [ℓ̃, u] in `levels` steps (255)
    finite = torch.isfinite(need).all(dim=-1)  # NaN/inf in k reach lo or hi; ℓ < −65504 makes ℓ̃ = −inf
    need = torch.where(torch.isfinite(need), need.clamp_min(0.0), torch.zeros_like(need))

    smax = need.amax(dim=-1)
    exponent = torch.ceil(torch.log2(smax.clamp_min(2.0**_MIN_EXPONENT)))
    in_range = (exponent >= -128) & (exponent <= 127)
    exponent = exponent.clamp(-128, 127)
    lut64 = key_scale_lut().to(device=k.device, dtype=torch.float64)
    scale_of = torch.ldexp(torch.ones_like(smax), exponent.to(torch.int32)).unsqueeze(-1)

    # smallest code c ≥ 1 with LUT[c]·2^E ≥ need; the log2 guess is corrected by one step either way
    ratio = (need / scale_of).clamp_min(2.0**-200)
    guess = torch.ceil(KEY_CODE_MAX + SCALE_LUT_STEPS_PER_OCTAVE * torch.log2(ratio))
    code = guess.clamp(1, KEY_CODE_MAX).long()
    lower = (code - 1).clamp_min(1)
    code = torch.where(lut64[lower] * scale_of >= need, lower, code)
    code = torch.where(lut64[code] * scale_of < need, (code + 1).clamp_max(KEY_CODE_MAX), code)
    code = torch.where(need > 0, code, torch.zeros_like(code))
    sigma = (lut64[code] * scale_of).float()  # exact: a float32 mantissa times a power of two

    inv = torch.where(sigma > 0, sigma, torch.ones_like(sigma)).unsqueeze(-2)
    q = torch.round((kf - offset.float().unsqueeze(-2)) / inv).clamp_(0, levels)
    q = torch.nan_to_num_(q, nan=0.0)
    return QuantizedKeys(
        codes=q.to(torch.uint8),
        offset=torch.where(torch.isfinite(offset), offset, torch.zeros_like(offset)),
        scale_code=code.to(torch.uint8),
        exponent=exponent.to(torch.int8),
        violated=~(finite & in_range),
    )


def dequantize_keys(codes: torch.Tensor, offset: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """k̂ = ℓ̃ + code·σ as float32 ``[..., N, D]``; ``offset``/``sigma`` are ``[..., D]``."""
    return torch.addcmul(offset.float().unsqueeze(-2), codes.float(), sigma.unsqueeze(-2))


def key_magnitude(offset: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Per-channel bound M_c + σ_c ≥ max(|k|, |k̂|) over the block, float32 ``[..., D]``."""
    off = offset.float()
    return torch.maximum(off.abs(), (off + KEY_CODE_MAX * sigma).abs()) + sigma
