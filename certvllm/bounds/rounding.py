"""Float32 rounding constants (Higham's γ_n) used by the explicit rounding terms."""

from __future__ import annotations

UNIT_ROUNDOFF = 2.0**-24
"""u for float32 round-to-nearest."""

GAMMA_SLACK = 1.0 + 2.0**-10
"""Multiplier applied to computed bounds so that the float32 evaluation of the bound itself
(a handful of roundings) cannot make it smaller than the real-number bound."""


def gamma(n: int) -> float:
    """γ_n = n·u / (1 − n·u): the relative error bound of any n-term float32 sum or dot product."""
    nu = n * UNIT_ROUNDOFF
    if nu >= 1.0:
        raise ValueError(f"gamma({n}) is undefined: n·u = {nu} ≥ 1")
    return nu / (1.0 - nu)
