"""What certified attention returns: the output and a per-query-head certificate report."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

RUNG_NONE, RUNG_WIDEN, RUNG_VALUES, RUNG_HEAD_DENSE, RUNG_LAYER_DENSE = 0, 1, 2, 3, 4


@dataclass
class CertReport:
    """Per query head certificate; every tensor is ``[R, H_q]`` (``[H_q]`` from ``certified_decode``).

    Attributes:
        rung: int8, 0 = certified with no escalation, 1 = coverage widened, 2 = values promoted,
            3 = exact dense for this head, 4 = exact dense for the whole layer (this row).
        e_key: float32, bound on the key-quantization term (includes ``e_round``); 0 if rung ≥ 3.
        e_val: float32, bound on the value term; 0 if rung ≥ 3.
        e_round: float32, the arithmetic rounding term included in ``e_key``.
        k_star: int32, key blocks read with unquantized keys (excluding the trailing partial block).
        v_promoted: int32, value blocks read unquantized (rung 2).
        v_max: float32, V_max (the unit of the relative tolerances).
        delta_tail: float32, Δ_T, the largest score perturbation among INT8-key blocks.
        alpha_tail: float32, ᾱ_T, the certified upper bound on the exact tail mass.
        rank_fail, boundary_fail, bound_fail, canary_fail, precondition: bool, why a head escalated.
    """

    rung: torch.Tensor
    e_key: torch.Tensor
    e_val: torch.Tensor
    e_round: torch.Tensor
    k_star: torch.Tensor
    v_promoted: torch.Tensor
    v_max: torch.Tensor
    delta_tail: torch.Tensor
    alpha_tail: torch.Tensor
    rank_fail: torch.Tensor
    boundary_fail: torch.Tensor
    bound_fail: torch.Tensor
    canary_fail: torch.Tensor
    precondition: torch.Tensor

    @staticmethod
    def zeros(rows: int, heads: int, device: torch.device | str = "cpu") -> CertReport:
        """A report of ``[rows, heads]`` zeros (rung 0, no bounds, no flags) to fill in."""
        dtypes = {"rung": torch.int8, "k_star": torch.int32, "v_promoted": torch.int32}
        flags = {"rank_fail", "boundary_fail", "bound_fail", "canary_fail", "precondition"}
        return CertReport(**{
            f.name: torch.zeros(rows, heads, device=device,
                                dtype=torch.bool if f.name in flags else dtypes.get(f.name, torch.float32))
            for f in fields(CertReport)
        })  # fmt: skip

    @property
    def bound(self) -> torch.Tensor:
        """The certificate E_key + E_val per head (0 where recomputed exactly)."""
        return self.e_key + self.e_val

    def select(self, index: int | slice | torch.Tensor) -> CertReport:
        """The report of some rows."""
        return CertReport(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device: torch.device | str) -> CertReport:
        """The report with every tensor on ``device``."""
        return CertReport(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @staticmethod
    def cat(reports: list[CertReport]) -> CertReport:
        return CertReport(**{f.name: torch.cat([getattr(r, f.name) for r in reports]) for f in fields(CertReport)})


@dataclass
class CertifiedOutput:
    """Attention output ``out`` (float32, ``[H_q, D]`` or ``[R, H_q, D]``) and its ``report``."""

    out: torch.Tensor
    report: CertReport
