"""The certificate of one request: what certified attention did for it, accumulated in the worker.

A layer call's report is ``[R, H_q]`` over the call's rows; each row is one query token of one request (the engine
maps rows to requests). :class:`RequestLedger` folds the reports into per-request totals, on the device that ran
the call and without reading anything on the host in the layer call (on CUDA a host read would stall the launch
of the next layer): every request holds a *slot*, a row of two small device tensors, and a step's reports are
reduced over layers and heads and added to their rows' slots in stream order. :meth:`RequestLedger.snapshot`
takes the totals of some requests as a :class:`~certvllm.kv.deferred.DeferredRead` (a non-blocking copy behind a
CUDA event), read by whoever consumes it later; on the CPU it is a copy taken at once.

The totals are those of the Prometheus series (``certvllm.metrics.prometheus``), computed from the same reports
with the same definitions, so a request that runs alone moves each series by exactly its own numbers:

* head-steps by rung (``vllm:cert_head_steps_total``);
* rung-4 recomputations, one per row and layer call (a row at rung 4 has every head of the layer at rung 4);
* key and value blocks read unquantized (``vllm:cert_promoted_key_blocks_total``, ``..._value_...``);
* the largest certificate E_key + E_val returned (absolute, units of V) and the largest (E_key + E_val) / V_max
  (``vllm:cert_bound_relative``), over the head-steps served at rungs 0-2;
* audited head-steps and audit violations (``vllm:cert_audits_total``, ``vllm:cert_audit_violations_total``);
* query tokens served exactly by policy, by reason (``vllm:cert_exact_tokens_total``), known on the host.

:func:`certificate` turns totals into the ``certvllm`` object of an API response (documented in
``docs/metrics.md``); :func:`merge_certificates` combines the objects of several engine requests of one response
(several prompts, or ``n`` samples).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from certvllm.bounds.report import RUNG_LAYER_DENSE, RUNG_VALUES, CertReport
from certvllm.kv.deferred import DeferredRead

RUNGS = 5
COUNTS = ("rung_0", "rung_1", "rung_2", "rung_3", "rung_4", "layers_recomputed", "promoted_key_blocks",
          "promoted_value_blocks", "audits", "audit_violations")  # fmt: skip
"""The integer totals of a request, in the columns of the ledger's count tensor."""
MAXES = ("bound_max", "bound_relative_max")
"""The largest certificate returned (absolute, and relative to V_max), in the columns of the ledger's max tensor."""
EXACT_REASONS = ("prefill", "prefill_cached", "dense_mode")
"""The reasons of ``vllm:cert_exact_tokens_total``."""
_AUDITS = COUNTS.index("audits")
NO_REQUEST = 0
"""The slot of rows that belong to no request (padding, dummy runs): accumulated and never read."""


@dataclass
class RequestTotals:
    """One request's totals as read off the device (plain Python values: they travel between processes).

    Attributes:
        counts: the :data:`COUNTS` (ints). maxes: the :data:`MAXES` (floats, 0 when no head-step was certified;
        +inf when a certified bound was not finite). exact: query tokens served exactly, by :data:`EXACT_REASONS`.
    """

    counts: list[int] = field(default_factory=lambda: [0] * len(COUNTS))
    maxes: list[float] = field(default_factory=lambda: [0.0] * len(MAXES))
    exact: list[int] = field(default_factory=lambda: [0] * len(EXACT_REASONS))

    def merge_ranks(self, other: RequestTotals) -> RequestTotals:
        """The totals of one request over two workers of one engine (tensor or pipeline parallel ranks): each
        rank's head-steps and decisions are its own (summed, as the Prometheus series sum over ranks), the
        largest bound is the larger one, and the exact tokens are the same tokens on every rank (the larger
        count: a rank that holds no attention layer of the first stage counts none)."""
        return RequestTotals([a + b for a, b in zip(self.counts, other.counts, strict=True)],
                             [max(a, b) for a, b in zip(self.maxes, other.maxes, strict=True)],
                             [max(a, b) for a, b in zip(self.exact, other.exact, strict=True)])  # fmt: skip


def certificate(totals: RequestTotals) -> dict[str, Any]:
    """The ``certvllm`` object of a response for one engine request (JSON values only; ``docs/metrics.md``)."""
    c = dict(zip(COUNTS, totals.counts, strict=True))
    certified = c["rung_0"] + c["rung_1"] + c["rung_2"]

    def largest(value: float) -> float | None:
        return float(value) if certified and math.isfinite(value) else None

    bound, relative = totals.maxes
    return {
        "head_steps": {str(r): int(c[f"rung_{r}"]) for r in range(RUNGS)},
        "certified_head_steps": int(certified),
        "bound_max": largest(bound),
        "bound_relative_max": largest(relative),
        "heads_recomputed": int(c["rung_3"]),
        "layers_recomputed": int(c["layers_recomputed"]),
        "promoted_key_blocks": int(c["promoted_key_blocks"]),
        "promoted_value_blocks": int(c["promoted_value_blocks"]),
        "exact_tokens": {reason: int(n) for reason, n in zip(EXACT_REASONS, totals.exact, strict=True)},
        "audits": int(c["audits"]),
        "audit_violations": int(c["audit_violations"]),
        "audit_flagged": bool(c["audit_violations"]),
        "bound_finite": all(math.isfinite(m) for m in totals.maxes),
        "requests": 1,
    }


def merge_certificates(certs: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """One ``certvllm`` object for several engine requests (prompts or samples of one response): counts add up,
    the largest bounds are the largest of any, an audit flag of any flags the whole. None for no objects."""
    certs = list(certs)
    if not certs:
        return None
    if len(certs) == 1:
        return dict(certs[0])
    out: dict[str, Any] = {}
    for key, value in certs[0].items():
        values = [c[key] for c in certs]
        if isinstance(value, dict):
            out[key] = {k: sum(v[k] for v in values) for k in value}
        elif isinstance(value, bool):
            out[key] = all(values) if key == "bound_finite" else any(values)
        elif key in ("bound_max", "bound_relative_max"):
            present = [v for v in values if v is not None]
            out[key] = max(present) if present else None
        else:
            out[key] = sum(values)
    return out


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``: from pinned memory without waiting on CUDA (a copy from pageable memory
    would wait for the stream), itself elsewhere."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class LedgerSnapshot:
    """Some requests' totals, taken in stream order and read later (:meth:`totals` waits for the copy if needed)."""

    def __init__(self, ids: list[str], read: DeferredRead | None, exact: list[list[int]]) -> None:
        self._ids = ids
        self._read = read
        self._exact = exact
        self._totals: dict[str, RequestTotals] | None = None

    def done(self) -> bool:
        return self._read is None or self._read.done()

    def totals(self) -> dict[str, RequestTotals]:
        if self._totals is None:
            totals: dict[str, RequestTotals] = {}
            if self._read is not None:
                counts, maxes = self._read.values()
                for i, rid in enumerate(self._ids):
                    totals[rid] = RequestTotals(counts[i].tolist(), maxes[i].tolist(), self._exact[i])
            self._totals, self._read = totals, None
        return self._totals


class RequestLedger:
    """Per-request totals of certified attention in one worker (see the module docstring).

    The engine side calls, per step: :meth:`slots` (host: the slot of each certified row's request), then per layer
    call :meth:`record` (kept; the step's calls are reduced together by :meth:`fold`, so a step costs a fixed number
    of small device ops whatever its layer count), :meth:`record_exact` and :meth:`record_audit`; once the step's
    forward is launched, :meth:`snapshot` of the requests that want their totals (it folds first); :meth:`release`
    once requests are finished (their slots are zeroed and reused).

    Args:
        capacity: slots allocated at first use (grown by doubling as requests arrive).
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = max(2, int(capacity))
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 1  # slot 0 is NO_REQUEST
        self.counts: torch.Tensor | None = None  # [capacity, len(COUNTS)] int64
        self.maxes: torch.Tensor | None = None  # [capacity, len(MAXES)] float32
        self._exact: dict[str, list[int]] = {}
        self._stash: list[tuple[torch.Tensor, ...]] = []
        self._stash_slots: torch.Tensor | None = None

    # -- per step, host side ------------------------------------------------------------------------------------
    def slots(self, requests: Sequence[str | None], device: torch.device | str) -> torch.Tensor:
        """``[len(requests)]`` int64 on the host: each row's slot (new requests get one; None → no request).
        Allocates or grows the device tensors on ``device`` (in stream order, without a synchronisation)."""
        out = []
        for rid in requests:
            if rid is None:
                out.append(NO_REQUEST)
                continue
            slot = self._slot_of.get(rid)
            if slot is None:
                slot = self._free.pop() if self._free else self._take_new()
                self._slot_of[rid] = slot
            out.append(slot)
        self._allocate(torch.device(device))
        return torch.tensor(out, dtype=torch.int64)

    def _take_new(self) -> int:
        slot = self._next
        self._next += 1
        while self._next > self._capacity:
            self._capacity *= 2
        return slot

    def _allocate(self, device: torch.device) -> None:
        if self.counts is not None and self.counts.device == device and self.counts.shape[0] >= self._capacity:
            return
        counts = torch.zeros(self._capacity, len(COUNTS), dtype=torch.int64, device=device)
        maxes = torch.zeros(self._capacity, len(MAXES), dtype=torch.float32, device=device)
        if self.counts is not None:  # grown: keep every slot's totals (a device copy, in stream order)
            self.fold()
            n = min(self.counts.shape[0], self._capacity)
            counts[:n] = self.counts[:n].to(device)
            maxes[:n] = self.maxes[:n].to(device)
        self.counts, self.maxes = counts, maxes

    def record_exact(self, request: str | None, reason: str, tokens: int) -> None:
        """``tokens`` query tokens of ``request`` served exactly for ``reason`` (one of :data:`EXACT_REASONS`)."""
        if request is None or not tokens:
            return
        self._exact.setdefault(request, [0] * len(EXACT_REASONS))[EXACT_REASONS.index(reason)] += int(tokens)

    # -- per layer call, device side ----------------------------------------------------------------------------
    def record(self, report: CertReport, slots: torch.Tensor) -> None:
        """A layer call's ``[R, H_q]`` report for rows whose slots are ``slots`` (``[R]`` int64 on the report's
        device: the tensor :meth:`slots` gave, moved there once per step and shared by the step's calls).

        Kept for :meth:`fold`, which reduces a whole step's calls at once. A CPU report is kept as it is (the call's
        own tensors; the metrics keep them too: the caller must not modify them); of a CUDA report the six fields
        the fold reads are copied on the device, in stream order (a CUDA graph's outputs are rewritten by later
        replays). Nothing is read on the host."""
        if self.counts is None or report.rung.numel() == 0:
            return
        fields = (report.rung, report.e_key, report.e_val, report.v_max, report.k_star, report.v_promoted)
        if report.rung.device.type != "cpu":
            fields = tuple(t.clone() for t in fields)
        if self._stash and (slots is not self._stash_slots or fields[0].shape != self._stash[0][0].shape):
            self.fold()
        self._stash.append(fields)
        self._stash_slots = slots

    def fold(self) -> None:
        """Add the kept calls to their slots: about fifteen small device ops for all the calls of a step."""
        if not self._stash:
            return
        stash, slots = self._stash, self._stash_slots
        self._stash, self._stash_slots = [], None
        rung, e_key, e_val, v_max, k_star, v_promoted = (torch.stack(f) for f in zip(*stash, strict=True))
        rung = rung.long()  # [L, R, H]
        # [R, 5] (not F.one_hot: on CUDA it reads its input's range on the host)
        by_rung = (rung.unsqueeze(-1) == torch.arange(RUNGS, device=rung.device)).sum(dim=(0, 2))
        layers = (rung == RUNG_LAYER_DENSE).any(dim=2).sum(dim=0, keepdim=True).T  # [R, 1]: rows at rung 4, per call
        promoted = torch.stack([t.sum(dim=(0, 2), dtype=torch.int64) for t in (k_star, v_promoted)], dim=1)  # [R, 2]
        add = torch.cat((by_rung, layers, promoted, torch.zeros_like(promoted)), dim=1)  # audits: record_audit
        self.counts.index_add_(0, slots, add)
        bound = torch.where(rung <= RUNG_VALUES, e_key + e_val, 0.0)  # certified head-steps only
        both = torch.stack((bound.amax(dim=(0, 2)), (bound / v_max.clamp_min(1e-30)).amax(dim=(0, 2))), dim=1)
        both = both.nan_to_num(nan=math.inf)  # relative: the histogram's own quotient
        self.maxes.scatter_reduce_(0, slots.unsqueeze(1).expand(-1, len(MAXES)), both, "amax")

    def record_audit(self, slots: torch.Tensor, violated: torch.Tensor) -> None:
        """Audited head-steps (``[n]`` slots of their rows and ``[n]`` bool violated, on the ledger's device)."""
        if self.counts is None or slots.numel() == 0:
            return
        add = torch.stack((torch.ones_like(slots), violated.to(torch.int64)), dim=1)
        self.counts[:, _AUDITS : _AUDITS + 2].index_add_(0, slots.to(self.counts.device), add.to(self.counts.device))

    # -- reads --------------------------------------------------------------------------------------------------
    def snapshot(self, requests: Iterable[str]) -> LedgerSnapshot:
        """The totals of ``requests`` (those this ledger has seen), taken in stream order after every call recorded
        so far; read later through :meth:`LedgerSnapshot.totals`."""
        self.fold()
        ids = [r for r in dict.fromkeys(requests) if r in self._slot_of or r in self._exact]
        exact = [list(self._exact.get(r, [0] * len(EXACT_REASONS))) for r in ids]
        if not ids:
            return LedgerSnapshot([], None, [])
        if self.counts is None:  # exact tokens only: no certified row ever ran
            read = DeferredRead([torch.zeros(len(ids), len(COUNTS), dtype=torch.int64),
                                 torch.zeros(len(ids), len(MAXES))])  # fmt: skip
            return LedgerSnapshot(ids, read, exact)
        device = self.counts.device
        index = to_device(torch.tensor([self._slot_of.get(r, NO_REQUEST) for r in ids], dtype=torch.int64), device)
        counts, maxes = self.counts.index_select(0, index), self.maxes.index_select(0, index)
        if any(r not in self._slot_of for r in ids):  # exact tokens only (no certified row yet): zeros
            seen = to_device(torch.tensor([[r in self._slot_of] for r in ids]), device)
            counts, maxes = torch.where(seen, counts, 0), torch.where(seen, maxes, 0.0)
        return LedgerSnapshot(ids, DeferredRead([counts, maxes]), exact)

    def release(self, requests: Iterable[str]) -> None:
        """Forget finished requests: their slots are zeroed (in stream order) and reused."""
        self.fold()
        freed = []
        for rid in requests:
            self._exact.pop(rid, None)
            slot = self._slot_of.pop(rid, None)
            if slot is not None:
                freed.append(slot)
        if not freed:
            return
        self._free.extend(freed)
        if self.counts is not None:
            index = to_device(torch.tensor(freed, dtype=torch.int64), self.counts.device)
            self.counts.index_fill_(0, index, 0)
            self.maxes.index_fill_(0, index, 0.0)

    @property
    def requests(self) -> int:
        """Requests holding a slot or exact counts."""
        return len(set(self._slot_of) | set(self._exact))
