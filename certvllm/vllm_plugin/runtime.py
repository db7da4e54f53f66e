"""The certified state of one vLLM worker process: its layers' tiered caches, their device-resident
promotion state, the page-in engine, the step prefetcher, the layer calls' CUDA graphs and the metrics.

One :class:`WorkerRuntime` per worker and run, shared by the backend's layer implementations and its
metadata builder (``WorkerRuntime.of``); one :class:`LayerState` per attention layer, created when the
layer's write path first meets its KV tensor (:meth:`WorkerRuntime.bind`), and again when vLLM replaces
that tensor (profiling → the real cache). A layer's forward only looks its state up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from certvllm.attention import certified_attention
from certvllm.attention.audit import Auditor
from certvllm.bounds.report import RUNG_LAYER_DENSE, CertifiedOutput, CertReport
from certvllm.config import CertConfig
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.deferred import ReadBatch
from certvllm.kv.pagein import PageInEngine, PageInError, engine_for
from certvllm.kv.residency import Residency, pool_values
from certvllm.metrics import CertMetrics, KeyPageCounts
from certvllm.metrics.prometheus import BOUND_BUCKETS, RELATIVE_BUCKETS
from certvllm.metrics.requests import RequestLedger
from certvllm.metrics.tally import DeviceTally
from certvllm.vllm_plugin import settings
from certvllm.vllm_plugin.host_tier import device_blocks_before_cap, layer_cache
from certvllm.vllm_plugin.layer_kinds import layer_index

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
DEFAULT_MAX_DECODE_ROWS = 256
"""Rows of the largest graphed call before :meth:`WorkerRuntime.warm_up` sets it to the engine's ``max_num_seqs``."""
HOST_MEMORY_MARKERS = ("can't allocate memory", "Cannot allocate memory")
"""How the CPU allocator's out-of-memory error reads (a plain ``RuntimeError`` in torch)."""


def host_failure(err: BaseException) -> str | None:
    """``"page_in"`` for a failed page-in (``PageInError``), ``"host_memory"`` for the CPU allocator running out of
    memory anywhere else in a certified call, None for anything else (a bug: it must not be hidden)."""
    if isinstance(err, PageInError):
        return "page_in"
    out_of_memory = isinstance(err, RuntimeError) and any(m in str(err) for m in HOST_MEMORY_MARKERS)
    if isinstance(err, MemoryError) or out_of_memory:
        return "host_memory"
    return None


@dataclass
class LayerState:
    """One attention layer's certified state in this worker."""

    name: str
    index: int
    cache: LayerKVCache
    residency: Residency = field(default_factory=Residency)


class WorkerRuntime:
    """Everything this worker holds for ``--kv-cache-dtype certified`` (see the module docstring).

    Args:
        config: the run's settings.
        model_name, engine: the metrics' labels.
        rank: this worker's rank in its engine (the ``rank`` label of its host-tier and page-in series).
    """

    def __init__(self, config: CertConfig, model_name: str, engine: str, rank: str = "0") -> None:
        self.config = config
        self.metrics = CertMetrics(model_name, engine, rank=rank)
        # per-request certificates (certificates.py): None unless the engine returns them to its clients
        self.ledger: RequestLedger | None = None
        self.step_requests: list[str] = []  # the requests of the step being run (the metadata builder's batch)
        # audit mode: sampled head-steps re-checked against exact attention (certvllm.attention.audit); its
        # checks are read when their device values land, at the latest by the metrics' flush
        self.audit = Auditor(config, on_outcome=self._audited, on_forced=self.metrics.count_audit_fallback,
                             on_checked=self._audit_checked)  # fmt: skip
        self.metrics.add_drain(lambda: self.audit.resolve(wait=True))
        self.layers: dict[str, LayerState] = {}
        self.prefetcher: Any = None  # certvllm.kv.prefetch.StepPrefetcher of the CUDA layers
        self._prefetch_blocks = 0  # the 16-token blocks per layer the prefetcher was sized for
        self._prefetch_index: dict[str, int] = {}  # layer name → its entry in the current prefetcher
        self._pageins: dict[torch.device, PageInEngine] = {}
        self._warmed: set[tuple[Any, ...]] = set()
        self._graphs: dict[torch.device, Any] = {}  # device → certvllm.attention.graphs.LayerCallGraphs
        self._write_graphs: dict[torch.device, Any] = {}  # device → certvllm.kv.write_graphs.WriteGraphs
        # shadow_writes: copy_engine: the device's copier, and per layer the step's runs of full engine blocks
        # (set by the metadata builder of the layer's group when it builds the step)
        self._copiers: dict[torch.device, Any] = {}  # device → certvllm.kv.shadow_copy.ShadowCopier
        self._shadow_runs: dict[str, tuple[Any, ...]] = {}
        self.max_decode_rows = DEFAULT_MAX_DECODE_ROWS  # the engine's max_num_seqs once warm_up has run
        # the layer whose calls count the step's exact tokens (once per step): the model's first certified layer
        # (:meth:`note_layers`; layer 0 until then, and in a model without native layers)
        self.counting_layer = 0
        # CUDA: every certified call adds its report to the device's tally (in its graph where it has one); the
        # step's tallies and counters are read once, after the step's last certified layer (:meth:`end_step`)
        self._tallies: dict[torch.device, DeviceTally] = {}
        self.closing_layer: int | None = None  # the worker's last certified layer (:meth:`note_layers`)
        self._open_layer = -1  # the last layer recorded in the step not yet read (-1: none)
        self._pool_growth_logged = False

    # -- one per worker and run ---------------------------------------------------------------------
    _current: WorkerRuntime | None = None

    @classmethod
    def of(cls, vllm_config: Any) -> WorkerRuntime:
        """This process's runtime for the run ``vllm_config`` describes (created on first use; a run with
        other settings in the same process gets a new one)."""
        config = settings.cert_config(vllm_config)
        current = cls._current
        if current is None or current.config != config:
            name = vllm_config.model_config.served_model_name
            name = name[0] if isinstance(name, list | tuple) else name
            parallel = vllm_config.parallel_config  # rank: set by vLLM's worker before the model is built
            current = cls(config, str(name), str(parallel.data_parallel_rank), str(getattr(parallel, "rank", 0)))
            cls._current = current
        if current.ledger is None and settings.certificate_mode(vllm_config) is not None:
            max_seqs = getattr(vllm_config.scheduler_config, "max_num_seqs", 0) or 0
            current.ledger = RequestLedger(capacity=2 * max_seqs + 1)
        return current

    @classmethod
    def current(cls) -> WorkerRuntime | None:
        """This process's runtime, if one was made (the certificate connector's worker side reads it)."""
        return cls._current

    # -- layers -------------------------------------------------------------------------------------
    def bind(self, name: str, kv_cache: torch.Tensor, head_dim: int, dtype: torch.dtype) -> LayerState:
        """The state of layer ``name`` over vLLM's KV tensor: the existing one while the tensor is the same,
        else a new tiered cache (shadow allocated here), promotion pool and step-prefetch entry."""
        state = self.layers.get(name)
        if (
            state is not None
            and state.cache.pages.data_ptr() == kv_cache.data_ptr()
            and (state.cache.pages.shape[0] == kv_cache.shape[0])
        ):
            return state
        self.layers.pop(name, None)
        start = time.perf_counter()
        shared = self._shadow_of_same_memory(kv_cache, dtype)
        cache = layer_cache(name, kv_cache, head_dim, dtype, self.config.value_group_size,
                            shadow=shared.cache.shadow if shared is not None else None,
                            code_levels=self.config.code_levels)  # fmt: skip
        if shared is not None:
            logger.debug("certvllm: %s shares the shadow of %s (the same KV memory, another KV cache group)", name,
                         shared.name)  # fmt: skip
        allocated = time.perf_counter()
        state = LayerState(name, layer_index(name), cache, self._residency(name, cache))
        self.layers[name] = state
        self.metrics.set_host_tier_bytes(self.host_bytes)
        # startup cost, per layer: the shadow (allocated, pinned on CUDA) and the device-resident state; at info
        # level for the 1st, 2nd, 4th, 8th … layer, so that a slow start shows where its time went
        n = len(self.layers)
        log = logger.info if n & (n - 1) == 0 else logger.debug
        log("certvllm: %s bound: %.2f GiB of shadow in %.2f s, promotion pool and prefetch in %.2f s (%d layers "
            "bound, %.1f GiB of shadow)", name, cache.shadow.numel() * cache.shadow.element_size() / 2**30,
            allocated - start, time.perf_counter() - allocated, len(self.layers), self.host_bytes / 2**30)  # fmt: skip
        return state

    def _shadow_of_same_memory(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> LayerState | None:
        """A bound layer whose KV tensor is ``kv_cache``'s memory (same start, shape and shadow dtype), if any.

        vLLM's hybrid KV cache manager lays its KV cache groups over the same tensors (layer ``k`` of each group)
        and hands every block id to one group at a time, so certified layers of different groups never hold the
        same block at once: like their device pages, they share one shadow, indexed by block id (a block's pages and
        shadow are rewritten by each new owner before it reads them). Within a group every layer has memory of its
        own."""
        for state in self.layers.values():
            pages = state.cache.pages
            if (pages.data_ptr() == kv_cache.data_ptr() and pages.device == kv_cache.device
                    and pages.shape[0] == kv_cache.shape[0] and state.cache.shadow.dtype == dtype
                    and pages.numel() == kv_cache.numel()):  # fmt: skip
                return state
        return None

    def layer(self, name: str) -> LayerState:
        """The bound state of layer ``name`` (its write path binds it before any forward reads it)."""
        state = self.layers.get(name)
        if state is None:
            raise RuntimeError(f"certvllm: layer {name} has no certified cache yet (its KV write path binds it)")
        return state

    def _residency(self, name: str, cache: LayerKVCache) -> Residency:
        """CUDA: the layer's promotion pool and step-prefetch entry (none while a CUDA graph is captured:
        allocations there would live in the graph's pool)."""
        fraction = self.config.promotion_cache_fraction
        if cache.pages.device.type != "cuda" or fraction <= 0 or torch.cuda.is_current_stream_capturing():
            return Residency()
        planned = device_blocks_before_cap(cache.pages.shape[0])  # vLLM blocks before the host tier's cap
        sub_blocks = cache.num_blocks // cache.pages.shape[0]
        residency = Residency.for_layer(cache, fraction, pool_values(self.config.decode_pass),
                                        planned_blocks=planned * sub_blocks if planned else None)  # fmt: skip
        log = logger.info if planned and not self._pool_growth_logged else logger.debug
        if planned:
            self._pool_growth_logged = True
        log("certvllm: %s promotion cache %d slots, %.1f MiB%s", name, residency.pool.slots,
            residency.pool.nbytes / 2**20, f" (sized for the {planned} blocks the device budget planned: the host "
            f"tier capped the cache at {cache.pages.shape[0]}, leaving the others' pool room and page memory unused)"
            if planned else "")  # fmt: skip
        if self.config.step_prefetch_fraction > 0:
            from certvllm.kv.prefetch import StepPrefetcher
            from certvllm.triton_kernels.tuning import parse_tuning

            if self.prefetcher is None or self._prefetch_blocks != cache.num_blocks:  # the real cache: a new one
                self.prefetcher = StepPrefetcher.for_cache(cache, self.config.step_prefetch_fraction,
                                                           tuning=parse_tuning(self.config.kernel_tuning))  # fmt: skip
                self._prefetch_blocks = cache.num_blocks
                self._prefetch_index = {}
            index = self.prefetcher.register(cache, self._prefetch_index.get(name))  # forward order
            self._prefetch_index[name] = index
            residency.prefetcher, residency.prefetch_index = self.prefetcher, index
        return residency

    @property
    def host_bytes(self) -> int:
        """Bytes of shadow pages this worker holds (a shadow shared by several layers counted once)."""
        shadows = {s.cache.shadow.data_ptr(): s.cache.shadow for s in self.layers.values()}
        return sum(t.numel() * t.element_size() for t in shadows.values())

    def note_layers(self, kinds: dict[str, bool]) -> None:
        """Which attention layers of this worker are certified (``{layer name: certified}``, every attention layer
        this worker holds): ``vllm:cert_layer_certified`` (1 certified, 0 native pages in the model's dtype), and
        :attr:`counting_layer`, the first certified one where this worker holds the model's first layers (a hybrid
        model's layer 0 may slide: its calls never reach certvllm). A later pipeline stage counts nothing (-1):
        the first stage counts every step's exact tokens once."""
        if not kinds:
            return
        indices = {name: layer_index(name) for name in kinds}
        for name, certified in kinds.items():
            index = indices[name]
            self.metrics.set_layer_certified(str(index) if index >= 0 else name, certified)
        certified_indices = [indices[n] for n, c in kinds.items() if c and indices[n] >= 0]
        first_stage = min(indices.values()) <= 0
        self.counting_layer = min(certified_indices) if first_stage and certified_indices else -1
        self.closing_layer = max(certified_indices) if certified_indices else None

    # -- startup ------------------------------------------------------------------------------------
    def warm_up(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_model_len: int,
                max_num_seqs: int, block_size: int, device: torch.device) -> None:  # fmt: skip
        """Compile every kernel variant this worker's certified calls can meet, once per head layout, before
        the engine reports ready (``certvllm.attention.warmup``; nothing to do on the CPU). Logged with its
        time; the memory it used is returned to the device."""
        key = (num_q_heads, num_kv_heads, head_dim, dtype, max_model_len, max_num_seqs, block_size, str(device))
        self.max_decode_rows = max_num_seqs
        if key in self._warmed:
            return
        from certvllm.attention.warmup import warm_up

        report = warm_up(num_q_heads, num_kv_heads, head_dim, dtype, max_model_len, max_num_seqs, self.config,
                         device, block_size_tokens=block_size)  # fmt: skip
        if torch.device(device).type == "cuda":
            self._tally(torch.device(device)).warm(num_q_heads)
        self._warmed.add(key)
        logger.info("%s", report.summary())
        for line in report.lines():
            logger.debug("certvllm warm-up: %s", line)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()

    # -- per step -----------------------------------------------------------------------------------
    def write_on_device(self, state: LayerState, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """One layer's new tokens by the device write path (``write_tokens_on_device``: the shadow scatter and the
        encoding of the blocks they complete, whose keys also fill the layer's pool where it is write-through),
        replayed from the layer's write graph where this worker graphs its writes (``CertConfig.cuda_graphs``, at
        most ``max_decode_rows`` tokens: decode steps),
        else launched directly. ``key``/``value`` ``[T, H_kv, D]`` in the shadow's dtype and ``slots`` ``[T]``
        on the device."""
        if state.index == self.counting_layer:  # the step's first certified layer, on the forward's stream: the
            self.fence_shadow_copies()  # last step's copies land before this step's stores (a block may be reused)
            # and before its layers read the shadow (each layer's write precedes its forward on this stream)
        runs = self._shadow_runs.get(state.name, ())
        # a prefill's full blocks by the copy engines (never under a capture: the copies are host calls)
        if runs and key.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            from certvllm.kv.cuda_pagein import write_tokens_on_device

            write_tokens_on_device(state.cache, key, value, slots, state.residency.pool, runs=runs,
                                   copier=self._copier(key.device))  # fmt: skip
            return
        writes = self._device_write_graphs(key.device)
        if writes is None:
            from certvllm.kv.cuda_pagein import write_tokens_on_device

            write_tokens_on_device(state.cache, key, value, slots, state.residency.pool)
        else:
            writes.write((state.name, state.cache.pages.data_ptr()), state.cache, key, value,
                         slots.to(torch.int64), state.residency.pool)  # fmt: skip

    def certified(self, state: LayerState, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
                  generator: torch.Generator | None, exact_rows: Any = None, slots: torch.Tensor | None = None,
                  step: object | None = None) -> CertifiedOutput:  # fmt: skip
        """One layer's certified rows (``certified_attention``'s arguments): replayed from the layer's CUDA graph
        where this worker graphs its calls (``CertConfig.cuda_graphs``, CUDA, at most ``max_decode_rows`` rows,
        rungs 3/4 on the device, no step prefetch, no audit fallback active for the layer), else the op called
        directly. Audited (``self.audit``: sampled head-steps checked against exact attention, audit fallbacks
        applied) and, with ``slots`` (``[R]`` the rows' request slots on the device, :meth:`RequestLedger.slots`),
        added to the rows' per-request totals. ``step``: the step's metadata object, which stands for ``tables``
        and ``lens`` in every layer of the step (the graphs write them once per step). Consume the result before
        the next call."""
        pagein = self.pagein(q.device)
        graphs = self._layer_graphs(q.device) if exact_rows is None else None
        tally = self._tally(q.device) if q.device.type == "cuda" else None

        def call(force_exact: torch.Tensor | None) -> CertifiedOutput:
            if (force_exact is None and graphs is not None and graphs.handles(q.shape[0])
                    and state.residency.prefetch_slot() is None):  # fmt: skip
                return graphs.run((state.name, state.cache.pages.data_ptr()), q, state.cache, tables, lens,
                                  self.config, scale, pagein=pagein, residency=state.residency,
                                  generator=generator, step=step,
                                  epilogue=lambda out, rows: tally.add(out.report, state.index, rows))  # fmt: skip
            res = certified_attention(q, state.cache, tables, lens, self.config, scale, pagein=pagein,
                                      generator=generator, residency=state.residency, exact_rows=exact_rows,
                                      force_exact=force_exact)  # fmt: skip
            if tally is not None:
                tally.add(res.report, state.index)
            return res

        tag = slots if self.ledger is not None else None
        try:
            res = self.audit.run(state.index, q, state.cache, tables, lens, scale, call, exact_rows=exact_rows,
                                 dense_backend=self.config.dense_backend, tag=tag)  # fmt: skip
        except Exception as err:
            reason = host_failure(err)
            if reason is None or exact_rows is None:
                raise  # a bug, or no exact path that avoids the host copies (CUDA): the error ends the step
            res = self._exact_after_failure(state, q, exact_rows, reason, err)
        if tag is not None:
            self.ledger.record(res.report, tag)
        return res

    def record_call(self, state: LayerState, report: CertReport, pagein: PageInEngine) -> None:
        """Account for one certified layer call of :meth:`certified` in the metrics, without a host synchronisation.

        CUDA: its report is in the device tally already; after the step's last certified layer
        (:attr:`closing_layer`) the step's tally and counters are taken as one read (:meth:`end_step`). CPU: the
        report and the page-in counters are queued as they are (``CertMetrics.record``)."""
        if report.rung.device.type != "cuda":
            self.metrics.record(report, state.index, page_in=pagein.take_stats_deferred())
            return
        if state.index <= self._open_layer:  # a new step began before the last one was read (no closing layer)
            self.end_step()
        self._open_layer = state.index
        if state.index == self.closing_layer:
            self.end_step()

    def end_step(self) -> None:
        """Queue the read of the step's CUDA tallies and counters (one copy and one event per device), if any call
        recorded since the last read. Called after the closing layer and at each step's start."""
        if self._open_layer < 0:
            return
        self._open_layer = -1
        for device, tally in self._tallies.items():
            batch = ReadBatch()
            taken = tally.take(batch)
            page_in = self._pageins[device].take_stats_deferred(batch) if device in self._pageins else None
            self.metrics.record_step(taken, page_in, self._key_pages(device, batch), batch)

    def _key_pages(self, device: torch.device, batch: ReadBatch) -> tuple[KeyPageCounts, ...]:
        """Where the step's promoted key pages came from, per layer with a promotion pool on ``device``: pool hits,
        pages the step prefetch served (its counters are the worker's, taken once) and the rest, over PCIe. The
        counters join ``batch`` (snapshotted and zeroed in stream order when it is issued)."""
        counts, prefetch_taken = [], False
        for state in self.layers.values():
            pool = state.residency.pool
            if pool is None or state.cache.pages.device != device:
                continue
            slot = state.residency.prefetch_slot()
            prefetch = None
            if slot is not None and not prefetch_taken:
                prefetch, prefetch_taken = slot[0].take_stats_deferred(batch), True
            counts.append(KeyPageCounts(pool.take_stats_deferred(batch), prefetch))
        return tuple(counts)

    def _tally(self, device: torch.device) -> DeviceTally:
        """The device's report tally (made on first use)."""
        if device not in self._tallies:
            self._tallies[device] = DeviceTally(device, (BOUND_BUCKETS, BOUND_BUCKETS, RELATIVE_BUCKETS))
        return self._tallies[device]

    def _exact_after_failure(self, state: LayerState, q: torch.Tensor, exact_rows: Any, reason: str,
                             err: BaseException) -> CertifiedOutput:  # fmt: skip
        """The call's rows recomputed exactly after a page-in failure or exhausted host memory (the CPU plugin's
        exact kernel reads the shadow in place: no page-in copies), counted as layer fallbacks with ``reason``. If
        that fails too, the original error is raised."""
        rows = list(range(q.shape[0]))
        try:
            out = exact_rows(rows).float()
        except Exception as again:
            raise err from again
        report = CertReport.zeros(q.shape[0], q.shape[1], out.device)
        report.rung.fill_(RUNG_LAYER_DENSE)
        self.metrics.count_layer_fallback(state.index, len(rows), reason)
        logger.error("certvllm: layer %d: %s; its %d rows of this step were recomputed exactly from the shadow "
                     "(vllm:cert_layer_fallbacks_total reason=%s)", state.index, err, len(rows), reason)  # fmt: skip
        return CertifiedOutput(out, report)

    def _audit_checked(self, rows: torch.Tensor, violated: torch.Tensor, slots: torch.Tensor) -> None:
        """A call's audited head-steps (device tensors) into their requests' totals."""
        if self.ledger is not None:
            self.ledger.record_audit(slots[rows], violated)

    def _audited(self, outcome: Any) -> None:
        """An audit outcome (``certvllm.attention.audit.AuditOutcome``) into the metrics."""
        self.metrics.record_audit(outcome.rung, outcome.ratio, outcome.violated)

    def _layer_graphs(self, device: torch.device) -> Any:
        """The device's ``LayerCallGraphs`` (made on first use), or None off CUDA or with ``cuda_graphs`` off."""
        if not self.config.cuda_graphs or device.type != "cuda":
            return None
        if device not in self._graphs:
            from certvllm.attention.graphs import LayerCallGraphs

            self._graphs[device] = LayerCallGraphs(device, self.max_decode_rows)
            logger.info("certvllm: certified decode calls of up to %d rows replay CUDA graphs, one per layer and "
                        "(row, width) bucket (cuda_graphs: true; the step prefetch is off with them)",
                        self.max_decode_rows)  # fmt: skip
        return self._graphs[device]

    def _device_write_graphs(self, device: torch.device) -> Any:
        """The device's ``WriteGraphs`` (made on first use), or None off CUDA or with ``cuda_graphs`` off."""
        if not self.config.cuda_graphs or device.type != "cuda":
            return None
        if device not in self._write_graphs:
            from certvllm.kv.write_graphs import WriteGraphs

            self._write_graphs[device] = WriteGraphs(device, self.max_decode_rows)
        return self._write_graphs[device]

    def _copier(self, device: torch.device) -> Any:
        """The device's ``ShadowCopier`` (made on first use)."""
        if device not in self._copiers:
            from certvllm.kv.shadow_copy import ShadowCopier

            self._copiers[device] = ShadowCopier(device)
        return self._copiers[device]

    def fence_shadow_copies(self) -> None:
        """Order the current stream after every copy-engine shadow write queued so far (``ShadowCopier.fence``)."""
        for copier in self._copiers.values():
            copier.fence()

    def set_shadow_runs(self, layer_names: list[str], runs: tuple[Any, ...]) -> None:
        """The step's runs of full engine blocks (``shadow_copy.full_block_runs``, in the step's token order) that
        the writes of ``layer_names`` send to the shadow by the copy engines (empty: SM stores only)."""
        for name in layer_names:
            self._shadow_runs[name] = runs

    def pagein(self, device: torch.device) -> PageInEngine:
        """The page-in engine of ``device`` (zero-copy gathers on a side stream on CUDA)."""
        if device not in self._pageins:
            self._pageins[device] = engine_for(device)
        return self._pageins[device]

    def begin_step(self) -> None:
        """The batch of a step is built: read what the last step left unread (:meth:`end_step`), and start
        staging the first layers' pages (CUDA step prefetch)."""
        self.fence_shadow_copies()  # the last step's copies land before this step's staging reads the shadow
        self.end_step()
        if self.prefetcher is not None:
            self.prefetcher.begin_step()
