"""Per-layer metric totals kept on the device and read once per decode step (the CUDA path).

Each certified layer call adds its ``[R, H_q]`` report to its layer's row of a :class:`DeviceTally` with one kernel
(``certvllm.triton_kernels.report_tally``: the row layout is there), inside the call's CUDA graph where it has one,
so a call costs the host nothing for its metrics. Once per step the worker takes the rows in use (a snapshot copied
to pinned memory, then zeroed, in stream order: :class:`~certvllm.kv.deferred.ReadBatch`) and the metrics' flusher
folds the host copy into the Prometheus series (:meth:`CertMetrics.record_step`). The CPU path keeps recording each
call's report on the host (``CertMetrics.record``); both give the same counts and buckets (tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from certvllm.bounds.report import CertReport
from certvllm.kv.deferred import BatchedRead, ReadBatch

MAX_LAYERS = 1024
"""Rows a tally holds: layers are given rows in the order they first record, and a step reads only the rows in use."""


@dataclass(frozen=True)
class TallyRead:
    """One step's taken tally: the pending host copy of rows ``[0, len(layers))`` and the layer index of each row."""

    read: BatchedRead
    layers: tuple[int, ...]

    def values(self) -> torch.Tensor:
        """``[len(layers), columns]`` float64 on the host (waits for the copy if needed)."""
        return self.read.values()[0]


class DeviceTally:
    """The running per-layer totals of one worker's certified calls on one CUDA device.

    Args:
        device: the calls' device (the CPU only under Triton's interpreter, for tests).
        edges: the three histograms' bucket bounds (e_key, e_val, relative bound), each of the same length.
        max_layers: rows (layers) the tally can hold.
    """

    def __init__(self, device: torch.device | str, edges: tuple[tuple[float, ...], ...],
                 max_layers: int = MAX_LAYERS) -> None:  # fmt: skip
        from certvllm.triton_kernels.report_tally import tally_columns

        if len(edges) != 3 or len({len(e) for e in edges}) != 1:
            raise ValueError(f"a tally takes three histograms of as many edges each, got {[len(e) for e in edges]}")
        self.device = torch.device(device)
        self.edges = torch.tensor(edges, dtype=torch.float64, device=self.device)  # [3, NE]
        self.totals = torch.zeros(max_layers, tally_columns(len(edges[0])), dtype=torch.float64, device=self.device)
        self._row_of: dict[int, int] = {}

    def row(self, layer: int) -> int:
        """The tally row of layer ``layer`` (given on first use; fixed afterwards, so a CUDA graph may hold it)."""
        row = self._row_of.get(layer)
        if row is None:
            if len(self._row_of) == self.totals.shape[0]:
                raise RuntimeError(f"certvllm: the device tally holds {self.totals.shape[0]} layers; layer {layer} "
                                   "is one more (raise certvllm.metrics.tally.MAX_LAYERS)")  # fmt: skip
            row = self._row_of[layer] = len(self._row_of)
        return row

    def add(self, report: CertReport, layer: int, rows: torch.Tensor | None = None) -> None:
        """Add a call's report (``[R, H_q]`` on this device) to the row of ``layer``: its first ``rows`` rows
        (``[1]`` int64 on the device, e.g. a graph's padded call) or all of them. One launch, in stream order."""
        from certvllm.triton_kernels.report_tally import tally_report

        tally_report({f.name: getattr(report, f.name) for f in fields(CertReport)}, self.totals, self.row(layer),
                     self.edges, rows)  # fmt: skip

    def take(self, batch: ReadBatch) -> TallyRead | None:
        """Join ``batch`` with the rows in use (read, then zeroed when the batch is issued); None when no layer has
        recorded yet."""
        if not self._row_of:
            return None
        layers = tuple(sorted(self._row_of, key=self._row_of.__getitem__))
        return TallyRead(batch.add_take(self.totals[: len(layers)]), layers)

    def warm(self, num_q_heads: int) -> None:
        """Compile the fold's two variants for ``num_q_heads`` heads (the server's warm-up), leaving the totals as
        they were."""
        scratch = DeviceTally(self.device, tuple(tuple(e) for e in self.edges.tolist()), max_layers=1)
        report = CertReport.zeros(1, num_q_heads, self.device)
        scratch.add(report, 0)
        scratch.add(report, 0, torch.ones(1, dtype=torch.int64, device=self.device))
