"""Directed rounding helpers for metadata that must bound what it describes."""

from __future__ import annotations

import torch

_NEG_INF16 = float("-inf")


def fp16_round_down(x: torch.Tensor) -> torch.Tensor:
    """Largest float16 value ``≤ x`` (elementwise); ``x`` is float32 or float64. Returns float16."""
    y = x.to(torch.float16)
    too_big = y.to(x.dtype) > x
    return torch.where(too_big, torch.nextafter(y, torch.full_like(y, _NEG_INF16)), y)


def fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 value ``≥ x`` (elementwise); ``x`` is float64. Returns float16."""
    y = x.to(torch.float16)
    too_small = y.to(torch.float64) < x
    return torch.where(too_small, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def fp32_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest float32 value ``≥ x`` (elementwise); ``x`` is float64. Returns float32."""
    y = x.to(torch.float32)
    too_small = y.to(torch.float64) < x
    return torch.where(too_small, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
