"""INT4 values: asymmetric, per token, in groups of g elements, FP16 scale and zero.

Per group: zero = largest float16 ≤ min, scale = smallest float16 ≥ (max − zero)/15,
code = round((v − zero)/scale) ∈ [0, 15], v̂ = zero + code·scale. All-equal groups get scale 0.
Two codes per byte, the even element in the low nibble.

Block annotations, computed here in float64 and rounded up to float32:

* η_b = max_t ‖V̂_t − V_t‖₂ + u·‖V̂_t‖₂ (absolute; the second term covers the one float32
  rounding of ``zero + code·scale`` on any read path, u = 2^-24);
* ν_b = max_t ‖V_t‖₂.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.formats.layout import VALUE_CODE_MAX
from certvllm.formats.rounding import fp16_round_down, fp16_round_up, fp32_round_up

UNIT_ROUNDOFF_FP32 = 2.0**-24


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


def quantize_values(v: torch.Tensor, group: int) -> QuantizedValues:
    """Quantize values ``[..., N, D]`` (float16 or bfloat16) in groups of ``group``."""
    shape = v.shape
    vd = v.to(torch.float64)
    grouped = vd.reshape(*shape[:-1], shape[-1] // group, group)
    lo = grouped.amin(dim=-1)
    hi = grouped.amax(dim=-1)
    zero = fp16_round_down(lo)
    zero64 = zero.to(torch.float64)
    scale = fp16_round_up(((hi - zero64) / VALUE_CODE_MAX).clamp_min(0.0))
    scale64 = scale.to(torch.float64)
    finite = (
        torch.isfinite(vd).all(dim=-1).all(dim=-1)
        & torch.isfinite(zero64).all(dim=-1).all(dim=-1)
        & torch.isfinite(scale64).all(dim=-1).all(dim=-1)
    )
    zero = torch.where(torch.isfinite(zero), zero, torch.zeros_like(zero))
    scale = torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))
    zero64, scale64 = zero.to(torch.float64), scale.to(torch.float64)

    safe = torch.where(scale64 > 0, scale64, torch.ones_like(scale64)).unsqueeze(-1)
    q = torch.round((grouped - zero64.unsqueeze(-1)) / safe).clamp(0, VALUE_CODE_MAX)
    q = torch.where(torch.isfinite(q) & (scale64.unsqueeze(-1) > 0), q, torch.zeros_like(q))
    vhat = (zero64.unsqueeze(-1) + q * scale64.unsqueeze(-1)).reshape(shape)

    err = torch.linalg.vector_norm(vhat - vd, dim=-1)
    err = err + UNIT_ROUNDOFF_FP32 * torch.linalg.vector_norm(vhat, dim=-1)
    err = torch.where(torch.isfinite(err), err, torch.zeros_like(err))
    norms = torch.linalg.vector_norm(vd, dim=-1)
    norms = torch.where(torch.isfinite(norms), norms, torch.zeros_like(norms))
    return QuantizedValues(
        codes=pack_int4(q.reshape(shape)),
        scale=scale,
        zero=zero,
        eta=fp32_round_up(err.amax(dim=-1)),
        nu=fp32_round_up(norms.amax(dim=-1)),
        violated=~finite,
    )


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """v̂ as float32 ``[..., N, D]`` from packed codes ``[..., N, D/2]`` and ``[..., N, G]`` metadata."""
    c = unpack_int4(codes).float()
    groups = scale.shape[-1]
    c = c.unflatten(-1, (groups, -1))
    out = torch.addcmul(zero.float().unsqueeze(-1), c, scale.float().unsqueeze(-1))
    return out.flatten(-2)
