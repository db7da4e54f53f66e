"""INT4 values: asymmetric, per token, in groups of g elements, FP16 scale and zero.

Per group: zero = largest float16 ≤ min, scale = smallest float16 ≥ (max − zero)/15,
code = round((v − zero)/scale) ∈ [0, 15], v̂ = zero + code·scale. All-equal groups get scale 0.
Two codes per byte, the even element in the low nibble.

Block annotations, computed here in float64 and rounded up to float32:

* η_b = max_t ‖V̂_t − V_t‖₂ + 2u·‖V̂_t‖₂ (absolute; the second term covers the one float32
  rounding of ``zero + code·scale`` on any read path, u = 2^-24);
* ν_b = max_t ‖V_t‖₂.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.formats.layout import VALUE_CODE_MAX
from certvllm.formats.rounding import fp16_round_down, fp16_round_up, fp32_round_up

UNIT_ROUNDOFF_FP32 = 2.0**-24
NORM_SLACK = 1.0 + 2.0**-13


@dataclass
class QuantizedValues:
    """Quantized values of a batch of blocks; ``...`` is any leading batch shape.

    Attributes:
        codes: ``[..., N, D/2]`` uint8, packed nibbles.
        scale: ``[..., N, G]`` float16.
        zero: ``[..., N, G]`` float16.
        eta: ``[...]`` float32, η_b.
        nu: ``[...]`` float32, ν_b.
        violated: ``[...]`` bool, non-finite or out-of-float16-range values.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    eta: torch.Tensor
    nu: torch.Tensor
    violated: torch.Tensor


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` integer codes in 0..15 → ``[..., D/2]`` uint8 (even index in the low nibble)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/2]`` uint8 → ``[..., D]`` uint8 codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def scaled_norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖₂ over the last dim in float32 without underflow: each vector is scaled by a power of two
    near its largest magnitude first (exact), so tiny bfloat16 values do not square to 0. Relative
    error ≤ γ_{D+2} ≤ 2^-16 for D ≤ 256 (covered by NORM_SLACK). Returns float64 ``[...]``."""
    peak = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(peak.clamp_min(torch.finfo(torch.float32).tiny))))
    return torch.linalg.vector_norm(x / scale, dim=-1).double() * scale.squeeze(-1).double()


def quantize_values(v: torch.Tensor, group: int, levels: int = VALUE_CODE_MAX) -> QuantizedValues:
    """Quantize values ``[..., N, D]`` (float16 or bfloat16) in groups of ``group``, to codes ``0..levels`` (15;
    fewer only for the stress study's formats: η is the measured error either way).

    Codes and v̂ are computed in float32 (exactly as the read path does); the differences v̂ − v are
    float32 roundings of exact values (relative u), so η and ν, taken as float64 norms, are inflated by
    NORM_SLACK.
    """
    shape = v.shape
    grouped = v.float().reshape(*shape[:-1], shape[-1] // group, group)
    lo = grouped.amin(dim=-1)
    hi = grouped.amax(dim=-1)
    zero = fp16_round_down(lo)
    scale = fp16_round_up(((hi.double() - zero.double()) / levels).clamp_min(0.0))
    finite = (torch.isfinite(zero) & torch.isfinite(scale) & torch.isfinite(hi)).flatten(-2).all(dim=-1)
    zero = torch.where(torch.isfinite(zero), zero, torch.zeros_like(zero))
    scale = torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))
    zero32, scale32 = zero.float().unsqueeze(-1), scale.float().unsqueeze(-1)

    inv = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    q = torch.round((grouped - zero32) / inv).clamp_(0, levels)
    q = torch.nan_to_num_(q, nan=0.0).masked_fill_(scale32 == 0, 0.0)
    vhat = torch.addcmul(zero32, q, scale32).reshape(shape)  # the read path's arithmetic

    vf = grouped.reshape(shape)
    err = scaled_norm(vhat - vf) + 2 * UNIT_ROUNDOFF_FP32 * scaled_norm(vhat)
    norms = scaled_norm(vf)
    clean = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x)).amax(dim=-1).double()  # noqa: E731
    return QuantizedValues(
        codes=pack_int4(q.reshape(shape)),
        scale=scale,
        zero=zero,
        eta=fp32_round_up(clean(err) * NORM_SLACK),
        nu=fp32_round_up(clean(norms) * NORM_SLACK),
        violated=~finite,
    )


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """v̂ as float32 ``[..., N, D]`` from packed codes ``[..., N, D/2]`` and ``[..., N, G]`` metadata."""
    c = unpack_int4(codes).float()
    groups = scale.shape[-1]
    c = c.unflatten(-1, (groups, -1))
    out = torch.addcmul(zero.float().unsqueeze(-1), c, scale.float().unsqueeze(-1))
    return out.flatten(-2)
