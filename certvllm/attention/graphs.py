"""CUDA graphs of certified layer calls: each layer's decode call is captured once per (row bucket, width
bucket) and replayed, so serving pays one graph launch per layer instead of the ~70 kernel launches and the
Python between them.

Why here and not in vLLM's own graphs: vLLM's piecewise CUDA graphs (what the plugin lowers full graphs to,
``vllm_plugin.routing``) run attention eagerly between the captured pieces, and its full graphs are keyed by
batch size alone, while a certified call's grids follow the block-table width as well. So the op's caller
captures it itself: :class:`LayerCallGraphs` holds, per layer, a graph that reads static inputs of a padded
shape (shared by the layers' graphs of that shape: a step's tables and lengths are written once, the query per
call).

Padding (``row_bucket``, ``width_bucket``):

* rows: ``R`` → the next power of two up to 8, then the next multiple of 8. Padding rows have the query 0,
  length 1 (their own token only) and block 0 as their table: they read one page, their outputs and reports
  are dropped;
* width: ``B`` 16-token columns → the next multiple of ``next_pow2(B) / 8`` (at least 1), never past
  ``next_pow2(B)``, so the compile class (``triton_kernels.shape_class.width_class``) of a padded call is the
  class of the call itself and startup warm-up covers it. Padding columns name block 0 and lie past every
  row's length (no row reads them).

A padded call is a certified call over the same rows (the split plan follows the padded shape, so its
floating-point sums may be ordered differently from an unpadded call's; its certificate is computed for
what it returned). A replay returns exactly what an eager call on the padded inputs returns (tests compare
them bit for bit).

What a graph cannot carry, and how it is handled:

* host-side traffic accounting: the page-in engine's counts of a captured call are recorded at capture
  (:meth:`CudaPageInEngine.recording`) and added again after each replay;
* the step prefetch issues other layers' stagings on a side stream from inside a call, which a per-layer
  graph cannot hold: the caller passes a residency without it (the promotion pool is graph-safe);
* capture allocates in one memory pool shared by every graph of the worker. A graph's outputs may occupy
  memory that another graph uses as scratch, so a replay's outputs are read (copied, queued for the
  metrics) before any other graph replays: :meth:`LayerCallGraphs.run` returns views the caller consumes
  at once, in stream order.

The first call of a key runs eagerly on the padded inputs (that is its answer) and is then captured; at most
``max_graphs`` graphs are kept (least recently used first out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch

from certvllm.attention.op import certified_attention
from certvllm.bounds.report import CertifiedOutput
from certvllm.config import CertConfig
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.cuda_pagein import CudaPageInEngine, RecordedTraffic
from certvllm.kv.graph_capture import GraphStore
from certvllm.kv.residency import Residency
from certvllm.triton_kernels.common import next_pow2

logger = logging.getLogger("certvllm")
Epilogue = Callable[[CertifiedOutput, torch.Tensor], None]
"""Device work a graphed call runs on its padded result (:meth:`LayerCallGraphs.run`)."""
MAX_GRAPHS = 1024
"""Graphs a worker keeps (each holds its outputs, ~1 MiB at 64 rows and 32 heads of 128; the graphs of one shape
share their inputs)."""


def row_bucket(rows: int) -> int:
    """Padded row count of a call of ``rows`` rows (≥ 1): powers of two to 8, then multiples of 8."""
    if rows < 1:
        raise ValueError(f"a call needs at least one row, got {rows}")
    return next_pow2(rows) if rows <= 8 else -(-rows // 8) * 8


def width_bucket(columns: int) -> int:
    """Padded block-table width of a call with ``columns`` 16-token columns (≥ 1): the next multiple of
    ``next_pow2(columns) / 8`` (at least 1), so never past ``next_pow2(columns)`` (module docstring)."""
    if columns < 1:
        raise ValueError(f"a block table needs at least one column, got {columns}")
    step = max(1, next_pow2(columns) // 8)
    return -(-columns // step) * step


class _Inputs:
    """The static inputs of every graph of one (query dtype and heads, row bucket, width bucket): the graphs of all
    layers read the same buffers, written before each replay. A step's block tables and lengths are the same for
    every layer, so with a ``step`` token (:meth:`LayerCallGraphs.run`) they are written once per token; only the
    query is written per call."""

    def __init__(self, rows: int, width: int, q_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.q = torch.zeros(rows, *q_shape, dtype=dtype, device=device)  # [R_b, H_q, D] the model dtype
        self.tables = torch.zeros(rows, width, dtype=torch.int64, device=device)  # [R_b, W_b]
        self.lens = torch.ones(rows, dtype=torch.int64, device=device)  # [R_b]
        self.rows = torch.full((1,), rows, dtype=torch.int64, device=device)  # [1] the call's real rows
        self._step: object | None = None  # the step token whose tables and lengths are written

    def load(self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, step: object | None = None) -> None:
        """Write a call's inputs; padding rows get query 0, length 1 and block 0, padding columns block 0. The
        tables and lengths are written unless ``step`` is the token of the last write (None: always written)."""
        R, B = tables.shape
        if step is None or step is not self._step:
            self.tables[:R, :B].copy_(tables)
            self.lens[:R].copy_(lens)
            if self.tables.shape[1] > B:
                self.tables[:R, B:].zero_()
            if self.q.shape[0] > R:
                self.q[R:].zero_()
                self.tables[R:].zero_()
                self.lens[R:].fill_(1)
            self.rows.fill_(R)
            self._step = step
        self.q[:R].copy_(q)


@dataclass
class _Graph:
    """One captured call: its inputs, and the outputs each replay rewrites."""

    graph: torch.cuda.CUDAGraph
    inputs: _Inputs
    result: CertifiedOutput  # out [R_b, H_q, D] float32, report [R_b, H_q]
    traffic: RecordedTraffic


class LayerCallGraphs(GraphStore[_Graph, _Inputs]):
    """The captured certified calls of one worker's layers on one CUDA device (see the module docstring).

    Args:
        device: the layers' device.
        max_rows: calls with more rows than this run eagerly (the engine's largest decode batch).
        max_graphs: graphs kept, least recently used evicted first.
    """

    def __init__(self, device: torch.device | str, max_rows: int, max_graphs: int = MAX_GRAPHS) -> None:
        # inputs shared by the graphs of every layer with one (dtype, heads, row bucket, width bucket)
        super().__init__(device, "max_rows", max_rows, max_graphs, "certified layer calls")
        self.max_rows = int(max_rows)
        self.capture_seconds = 0.0  # wall time of the captures (their eager first runs included)

    def handles(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows is graphed (else the caller runs it eagerly)."""
        return self.disabled is None and 1 <= rows <= self.max_rows and not torch.cuda.is_current_stream_capturing()

    def run(self, layer: Hashable, q: torch.Tensor, cache: LayerKVCache, tables: torch.Tensor, lens: torch.Tensor,
            config: CertConfig, scale: float, *, pagein: CudaPageInEngine, residency: Residency,
            generator: torch.Generator | None = None, step: object | None = None,
            epilogue: Epilogue | None = None) -> CertifiedOutput:  # fmt: skip
        """``certified_attention`` of one layer's decode rows, replayed from (or captured into) a graph.

        Args:
            layer: the layer's identity (with its cache and residency, fixed per key).
            q: ``[R, H_q, D]`` queries on the device; tables: ``[R, B]`` int64 16-token block ids on the
                device; lens: ``[R]`` int64 lengths on the device.
            config, scale, pagein, residency, generator: as ``certified_attention`` (``residency`` without a
                step prefetch).
            step: a token that stands for ``tables`` and ``lens`` (the caller's per-step metadata): every call
                with the same token (compared by identity) must pass the same values, and then the graphs of
                the layers share one write of them per step. None: written at every call.
            epilogue: device work on the padded call's result, ``epilogue(result, rows)`` with ``rows`` ``[1]``
                int64 on the device, the call's real row count (e.g. adding the report of those rows to a tally).
                It is part of the graph: it runs at every replay, and once with the eager first call. Fixed per
                ``layer`` (the first call's is captured).

        Returns:
            views of the replay's ``[R, ...]`` outputs, valid until the next replay of any graph of this
            worker: consume them (copy, queue for the metrics) before the next call.
        """
        if residency.prefetch_slot() is not None:
            raise ValueError("a graphed layer call cannot run the step prefetch: pass the residency's pool only")
        R, B = tables.shape
        key = (layer, q.dtype, row_bucket(R), width_bucket(B))
        entry = self._lookup(key)
        if entry is None:
            return self._first_call(key, q, cache, tables, lens, config, scale, pagein, residency, generator, step,
                                    epilogue)  # fmt: skip
        entry.inputs.load(q, tables, lens, step)
        entry.graph.replay()
        pagein.add_recorded(entry.traffic)
        self.replays += 1
        return _rows(entry.result, R)

    # -- internals ---------------------------------------------------------------------------------------
    def _first_call(self, key: tuple, q: torch.Tensor, cache: LayerKVCache, tables: torch.Tensor,
                    lens: torch.Tensor, config: CertConfig, scale: float, pagein: CudaPageInEngine,
                    residency: Residency, generator: torch.Generator | None, step: object | None = None,
                    epilogue: Epilogue | None = None) -> CertifiedOutput:  # fmt: skip
        """Run the padded call eagerly (this call's answer), then capture it under ``key``."""
        _, _, rows, width = key
        q_shape = tuple(q.shape[1:])  # (H_q, D)
        inputs = self._shared_inputs(
            (q.dtype, q_shape, rows, width), lambda: _Inputs(rows, width, q_shape, q.dtype, self.device)
        )
        inputs.load(q, tables, lens, step)

        def call() -> CertifiedOutput:
            res = certified_attention(inputs.q, cache, inputs.tables, inputs.lens, config, scale, pagein=pagein,
                                      generator=generator, residency=residency, backend="cuda")  # fmt: skip
            if epilogue is not None:
                epilogue(res, inputs.rows)
            return res

        started = time.perf_counter()
        answer = call()
        captured = self._capture(call, pagein.recording())
        if captured is None:  # the eager answer stands; this worker's calls stay eager from now on
            return _rows(answer, q.shape[0])
        graph, result, traffic = captured
        self._keep(key, _Graph(graph, inputs, result, traffic))
        self.capture_seconds += time.perf_counter() - started
        if self.captures & (self.captures - 1) == 0:  # the 1st, 2nd, 4th … capture: where a slow start went
            logger.info("certvllm: %d certified layer calls captured in CUDA graphs (%.2f s, eager first runs "
                        "included)", self.captures, self.capture_seconds)  # fmt: skip
        return _rows(answer, q.shape[0])


def _rows(result: CertifiedOutput, rows: int) -> CertifiedOutput:
    """The first ``rows`` rows of a padded call's output and report (new objects over the same tensors when no row
    was padded: a caller that rebinds a field never touches the graph's own result)."""
    if rows == result.out.shape[0]:
        return CertifiedOutput(result.out, replace(result.report))
    return CertifiedOutput(result.out[:rows], result.report.select(slice(0, rows)))
