"""``certified_attention``: the one op. It validates its arguments once, chooses the implementation in one
place, and applies rungs 3/4 once.

Implementations (``backend``):

* ``reference``: the torch reference (``reference.py``), any device;
* ``cpu``: the compiled CPU kernel (``cpu_fused.py``), CPU pages, certified and naive mode;
* ``cuda``: the Triton kernels (``gpu.py``), CUDA pages (or CPU tensors under ``TRITON_INTERPRET=1``);
* ``auto``: ``cuda`` for CUDA pages, ``cpu`` for CPU pages when the kernel is built and the mode is
  certified or naive, else ``reference``.

Rungs 3/4 (exact attention for escalated heads, and for every head in ``dense`` mode): on ``cuda`` the
layer call recomputes them on the device without a host synchronisation (``gpu.DeviceRerun``); elsewhere,
or when the caller passes ``exact_rows``, the escalated rows are recomputed by ``exact_rows`` (the engine's
own dense kernel run on the shadow tier) or by ``dense.dense_paged``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from certvllm.attention import cpu_fused, reference
from certvllm.attention.call import LayerCall
from certvllm.attention.dense import dense_paged
from certvllm.bounds.report import RUNG_HEAD_DENSE, RUNG_LAYER_DENSE, CertifiedOutput, CertReport
from certvllm.config import CertConfig
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.pagein import PageInEngine
from certvllm.kv.residency import Residency

Backend = Literal["auto", "reference", "cpu", "cuda"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "cpu", "cuda")
ExactRows = Callable[[list[int]], torch.Tensor]
"""Exact attention for a list of row indices → ``[n, H_q, D]`` (any float dtype)."""


def _precision_knobs() -> list[Any]:
    """The per-backend float32 matmul precision settings of this torch (CUDA's and oneDNN's ``fp32_precision``,
    torch ≥ 2.9); empty for an older torch, which has only the global setting."""
    backends = (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None))
    return [b for b in backends if b is not None and hasattr(b, "fp32_precision")]


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Full-precision float32 matmuls (no TF32/bf16 shortcuts): the rounding terms assume it.

    Per backend where torch has per-backend settings: the global getter raises once a process has set backends
    apart (vLLM's batch-invariant mode sets CUDA matmuls to ``ieee``; a user may set ``tf32``), and every certified
    call would then fail."""
    knobs = _precision_knobs()
    if not knobs:
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)
        return
    saved = [knob.fp32_precision for knob in knobs]
    for knob in knobs:
        knob.fp32_precision = "ieee"
    try:
        yield
    finally:
        for knob, value in zip(knobs, saved, strict=True):
            knob.fp32_precision = value


def validate_shapes(q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Shape checks of a certified call (no tensor values are read)."""
    if q.dim() != 3 or q.shape[-1] != cache.layout.head_dim:
        raise ValueError(f"Invalid shape of q: expected [R, H_q, {cache.layout.head_dim}], got {list(q.shape)}")
    if q.shape[1] % cache.num_kv_heads != 0:
        raise ValueError(f"H_q={q.shape[1]} is not a multiple of H_kv={cache.num_kv_heads}; GQA needs whole groups")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(
            f"Invalid block_tables {list(block_tables.shape)} / seq_lens {list(seq_lens.shape)} for {q.shape[0]} rows"
        )


def validate_lengths(cache: LayerKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Value checks of host ``seq_lens`` (the CUDA path skips them: they would synchronise)."""
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError("every row needs seq_len ≥ 1 (a query attends to at least itself)")
    need = -(-int(seq_lens.max()) // cache.layout.block_size) if seq_lens.numel() else 0
    if need > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns but a row needs {need} blocks")


def resolve_backend(backend: str, cache: LayerKVCache, config: CertConfig) -> str:
    """The implementation a call runs (the rule of the module docstring); raises naming the fix."""
    on_cuda = cache.pages.device.type == "cuda"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if on_cuda:
            return "cuda"
        return "cpu" if cpu_fused.supported(cache, config) else "reference"
    if backend == "cpu" and not cpu_fused.supported(cache, config):
        raise ValueError(
            "backend='cpu' needs CPU pages, mode certified or naive and the built CPU kernel "
            "(python -m certvllm.kernels.cpu); use backend='reference' or 'auto'"
        )
    return backend


def certified_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    config: CertConfig,
    scale: float | None = None,
    *,
    pagein: PageInEngine | None = None,
    generator: torch.Generator | None = None,
    residency: Residency | None = None,
    exact_rows: ExactRows | None = None,
    backend: Backend = "auto",
    cuda_options: object | None = None,
    timings: dict | None = None,
    force_exact: torch.Tensor | None = None,
) -> CertifiedOutput:
    """Certified attention for a batch of rows over one layer's paged cache.

    Args:
        q: ``[R, H_q, D]`` queries (any float dtype; post-RoPE).
        cache: the layer's tiered cache.
        block_tables: ``[R, max_blocks]`` int physical 16-token block ids per row.
        seq_lens: ``[R]`` int context length per row (tokens ``[0, seq_len)``, the query's own included).
        config: tolerances and mode.
        scale: softmax scale, default ``1/√D``.
        pagein: the page-in engine (counts traffic); one for the pages' device is made if omitted.
        generator: random source for exploration draws.
        residency: the layer's device-resident state (promotion pool, step prefetch; ``cuda`` only).
        exact_rows: the engine's exact attention for rungs 3/4 and the dense mode (see the module docstring).
        backend: the implementation (module docstring).
        cuda_options: ``gpu.CudaOptions`` (tests and benchmarks); default: ``config.kernel_tuning``'s.
        timings: a dict to record CUDA events at stage boundaries in (``cuda`` only; ``gpu.stage_times``).
        force_exact: ``[R]`` bool on the pages' device, or None: rows recomputed exactly (rung 4) whatever the
            ladder decided (the audit's fallback, ``certvllm.attention.audit``); read without a synchronisation
            on ``cuda``.

    Returns:
        ``out`` ``[R, H_q, D]`` float32 and a ``[R, H_q]`` :class:`CertReport`. For every head with rung ≤ 2,
        ‖out − exact‖₂ ≤ e_key + e_val; heads with rung ≥ 3 are exact (bounds 0).
    """
    validate_shapes(q, cache, block_tables, seq_lens)
    chosen = resolve_backend(backend, cache, config)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if chosen != "cuda":
        seq_lens = seq_lens.to("cpu", torch.int64)
        block_tables = block_tables.to("cpu", torch.int64)
        validate_lengths(cache, block_tables, seq_lens)
    if pagein is None:
        pagein = _default_pagein(chosen, cache)
    host_rows = exact_rows or dense_rows(q, cache, block_tables, seq_lens, scale, pagein, config.dense_backend)
    R, Hq, _ = q.shape
    dev = cache.pages.device
    with exact_float32():
        if config.mode == "dense":
            report = CertReport.zeros(R, Hq, dev)
            report.rung.fill_(RUNG_LAYER_DENSE)
            return CertifiedOutput(host_rows(list(range(R))).float().to(dev), report)
        call = LayerCall(q, cache, block_tables, seq_lens, config, scale, pagein, generator)
        rerun = None
        if chosen == "cuda":
            from certvllm.attention import gpu

            res = residency or Residency()
            options = cuda_options or gpu.options_for(config.kernel_tuning)
            if config.decode_pass == "resident" and resident_supported(block_tables.shape[1]):
                from certvllm.attention.resident import resident_rows

                out, report, rerun = resident_rows(call, res.pool, options, timings)
            else:
                out, report, rerun = gpu.certified_rows(call, res.pool, res.prefetch_slot(), options, timings)
        elif chosen == "cpu":
            out, report = cpu_fused.certified_rows(call)
        else:
            out, report = reference.certified_rows(call)
        if force_exact is not None:
            report.rung.masked_fill_(force_exact.to(dev, torch.bool).view(R, 1), RUNG_LAYER_DENSE)
        on_device = rerun is not None and exact_rows is None
        if on_device:
            rerun.apply(report.rung, out, forced=force_exact is not None)  # on the device, no synchronisation
            gpu.mark(timings, "fallback")
            if rerun.bounds_zeroed and force_exact is None:  # the device epilogue wrote them: no launches
                return CertifiedOutput(out, report)
        exact = report.rung >= RUNG_HEAD_DENSE
        if not on_device:
            _recompute_rows(out, exact, host_rows)
        for t in (report.e_key, report.e_val, report.e_round):  # recomputed exactly: no error to bound
            t.masked_fill_(exact, 0.0)
    return CertifiedOutput(out, report)


def resident_supported(table_width: int) -> bool:
    """Whether ``decode_pass: resident`` runs for a block table this wide: its glue kernels hold at most
    ``GLUE_MAX_BLOCKS`` columns (8192: 128K tokens); wider tables take the two-pass path with the torch glue."""
    from certvllm.triton_kernels.common import GLUE_MAX_BLOCKS

    return table_width <= GLUE_MAX_BLOCKS


def _default_pagein(backend: str, cache: LayerKVCache) -> PageInEngine:
    if backend == "cuda":
        from certvllm.kv.cuda_pagein import CudaPageInEngine

        return CudaPageInEngine(cache.pages.device)
    return PageInEngine(cache.pages.device)


def dense_rows(
    q: torch.Tensor,
    cache: LayerKVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    pagein: PageInEngine,
    backend: str,
) -> ExactRows:
    """Exact attention of listed rows over the originals (``dense.dense_paged``); reads the lengths on the
    host only when called."""

    def rows_fn(rows: list[int]) -> torch.Tensor:
        dev = cache.pages.device
        tables = block_tables.to(dev, torch.int64)
        return dense_paged(q.to(dev), cache, tables, seq_lens.tolist(), rows, scale, pagein, backend)

    return rows_fn


def _recompute_rows(out: torch.Tensor, exact: torch.Tensor, rows_fn: ExactRows) -> None:
    """Rungs 3/4 on the host's row list: replace the escalated heads of ``out`` by ``rows_fn``'s."""
    rows = exact.any(dim=1).nonzero().flatten().tolist()  # the one synchronisation (end of the call)
    if not rows:
        return
    dense = rows_fn(rows).float().to(out.device)
    idx = torch.tensor(rows, device=out.device)
    out[idx] = torch.where(exact[idx].unsqueeze(-1), dense, out[idx])
