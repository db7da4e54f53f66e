"""Every certvllm Prometheus metric, declared in one place.

Metrics are created lazily in the process that records them (the vLLM worker) and, when
``PROMETHEUS_MULTIPROC_DIR`` is set (``certvllm serve`` sets it), aggregated by the API server's
``/metrics``. Names follow vLLM's conventions (``vllm:`` prefix, ``_total`` counters, ``_seconds``,
``_bytes``) and every series carries ``model_name`` and ``engine`` labels so dashboards join with
vLLM's own metrics. The series of a worker's own resources (its shadow tier's host memory, its page-in
traffic and time, where its promoted key pages came from, which of its layers are certified: :data:`PER_RANK`)
also carry ``rank``, the
worker's rank in its engine (``"0"`` with one worker): with tensor parallelism every rank is a process with
its own shadow, host link and promotion pool, and its series stay apart in ``/metrics``; the other series
count head-steps and decisions, summed over the ranks. Counts are reduced first (with torch on the host, or by the
device tally), then added to the counters and histogram buckets in bulk.

Nothing here synchronises a layer call with the GPU. A CUDA worker sums its calls' reports on the device
(``certvllm.metrics.tally``) and :meth:`CertMetrics.record_step` queues, once per decode step, the sums with the
page-in, pool and prefetch counters as one non-blocking copy into pinned host memory (``certvllm.kv.deferred``);
:meth:`CertMetrics.record` queues one call's report (the CPU path, and any caller with a report in hand). The
flusher thread folds what is queued once its CUDA events have completed (it waits on events and reads host memory;
it never launches work on the device).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from certvllm.bounds.report import CertReport
from certvllm.bounds.tally_layout import HEAD_COLUMNS
from certvllm.kv.deferred import BatchedRead, DeferredRead, DeferredStats, ReadBatch
from certvllm.metrics.tally import TallyRead

logger = logging.getLogger("certvllm")

BOUND_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
RELATIVE_BUCKETS = (1e-4, 1e-3, 0.003, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
SECONDS_BUCKETS = (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
RUNG_NAMES = ("0", "1", "2", "3", "4")
HEAD_REASONS = ("rank", "boundary", "bound_tol")
LAYER_REASONS = ("canary", "precondition")
KEY_PAGE_SOURCES = ("pool", "prefetch", "host")
AUDIT_RATIO_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 0.5, 0.8, 1.0, 2.0, 10.0)
"""Observed error / allowed error of audited head-steps: ≤ 1 is within the certificate, > 1 a violation."""
AUDIT_FALLBACK_REASON = "audit"
"""The ``reason`` of ``vllm:cert_layer_fallbacks_total`` for rows an audit violation sent to exact attention."""


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


SPECS = (
    MetricSpec("vllm:cert_head_steps_total", "counter",
               "Query-head decode steps served by certified attention, by the highest fallback rung used "
               "(0 certified as is, 1 coverage widened, 2 values promoted, 3 head exact, 4 layer exact).",
               ("rung",)),
    MetricSpec("vllm:cert_head_fallbacks_total", "counter",
               "Rung-3 fallbacks (one query head recomputed exactly), by trigger.", ("reason",)),
    MetricSpec("vllm:cert_layer_fallbacks_total", "counter",
               "Rung-4 fallbacks (all heads of a layer recomputed exactly for one sequence), by trigger and layer.",
               ("reason", "layer")),
    MetricSpec("vllm:cert_canary_violations_total", "counter",
               "Score-consistency canary violations (a page disagreeing with its shadow); each forces rung 4."),
    MetricSpec("vllm:cert_e_key", "histogram", "Returned E_key bound per certified head-step (absolute).",
               buckets=BOUND_BUCKETS),
    MetricSpec("vllm:cert_e_val", "histogram", "Returned E_val bound per certified head-step (absolute).",
               buckets=BOUND_BUCKETS),
    MetricSpec("vllm:cert_bound_relative", "histogram",
               "Returned certificate (E_key + E_val) / V_max per certified head-step.", buckets=RELATIVE_BUCKETS),
    MetricSpec("vllm:cert_promoted_key_blocks_total", "counter",
               "(block, KV head) pages read with unquantized keys, summed over query heads and steps."),
    MetricSpec("vllm:cert_promoted_value_blocks_total", "counter",
               "(block, KV head) pages read with unquantized values (rung 2), summed over query heads and steps."),
    MetricSpec("vllm:cert_page_in_bytes_total", "counter", "Bytes paged in from the host shadow tier, by worker rank.",
               ("rank",)),
    MetricSpec("vllm:cert_key_pages_total", "counter",
               "CUDA path: unquantized key pages the promotion pass read, by where they came from (pool = the "
               "device-resident promotion cache, prefetch = the step prefetch's ring, host = over PCIe), by worker "
               "rank.", ("source", "rank")),
    MetricSpec("vllm:cert_page_in_seconds", "histogram",
               "Page-in time per attention call (CPU) or decode step (CUDA), by worker rank.",
               ("rank",), buckets=SECONDS_BUCKETS),
    MetricSpec("vllm:cert_exact_tokens_total", "counter",
               "Query tokens served by exact attention by policy, not by a fallback "
               "(prefill = no cached context; prefill_cached = prefill reading cached blocks with prefill: exact; "
               "dense_mode = mode: dense).", ("reason",)),
    MetricSpec("vllm:cert_host_tier_bytes", "gauge", "Host memory held by shadow pages (tier 2), by worker rank.",
               ("rank",)),
    MetricSpec("vllm:cert_layer_certified", "gauge",
               "Attention layers of the worker by KV cache: 1 = certified pages (INT8 keys, INT4 values, host shadow), "
               "0 = native pages in the model's dtype served by vLLM's own attention (sliding-window layers of a "
               "hybrid model, --kv-cache-dtype-skip-layers), by layer and worker rank.", ("layer", "rank")),
    MetricSpec("vllm:cert_audits_total", "counter",
               "Head-steps re-checked by audit mode against exact attention over the shadow originals, by the "
               "rung they were served at.", ("rung",)),
    MetricSpec("vllm:cert_audit_violations_total", "counter",
               "Audited head-steps whose output was farther from exact attention than allowed (rungs 0-2: "
               "E_key + E_val; rungs 3/4: float rounding), by rung.", ("rung",)),
    MetricSpec("vllm:cert_audit_error_ratio", "histogram",
               "Observed error / allowed error per audited head-step (> 1: a violation).",
               buckets=AUDIT_RATIO_BUCKETS),
)  # fmt: skip


RANK_LABEL = "rank"
PER_RANK = frozenset(s.name for s in SPECS if RANK_LABEL in s.labels)
"""The series labelled by the recording worker's rank (the module docstring)."""


def metric_names() -> list[str]:
    """Names of every series family as exposed (counters get ``_total`` once)."""
    return [s.name for s in SPECS]


@dataclass(frozen=True)
class KeyPageCounts:
    """Where one CUDA call's promoted key pages came from, read off the hot path.

    Attributes:
        pool: the layer's promotion-pool counters (``PromotionCache.take_stats_deferred``: ``lookups``,
            ``hits``, ...).
        prefetch: the step prefetcher's counters (``StepPrefetcher.take_stats_deferred``: ``served``, ...),
            None when the layer takes no part in a step prefetch.
    """

    pool: DeferredStats
    prefetch: DeferredStats | None = None

    def sources(self) -> tuple[int, int, int]:
        """``(pool, prefetch, host)``: pool hits, pages served from the prefetch staging, and the rest
        (lookups − hits − served), read over PCIe. Waits for the device counts if needed."""
        pool = self.pool.values()
        served = int(self.prefetch["served"]) if self.prefetch is not None else 0
        hits = int(pool["hits"])
        return hits, served, int(pool["lookups"]) - hits - served


@dataclass
class _Queued:
    """One attention call waiting for the flusher: its report (a host report, or the pending host copy of
    a device one, in ``fields(CertReport)`` order) and its counters."""

    report: CertReport | DeferredRead | BatchedRead | TallyRead
    layer: int
    page_in_bytes: int = 0
    page_in_seconds: float = 0.0
    page_in: DeferredStats | None = None
    key_pages: tuple[KeyPageCounts, ...] = ()

    def host_report(self) -> CertReport:
        """The report on the host (waits for its copy if needed); not for a step's tally."""
        if isinstance(self.report, CertReport):
            return self.report
        if isinstance(self.report, TallyRead):
            raise TypeError("a queued step carries a tally, not a report")
        return CertReport(**{f.name: t for f, t in zip(fields(CertReport), self.report.values(), strict=True)})

    def page_in_totals(self) -> tuple[int, float]:
        """``(bytes, seconds)`` of the call's page-in (waits for the device counts if needed)."""
        if self.page_in is None:
            return self.page_in_bytes, self.page_in_seconds
        stats = self.page_in.values()
        return self.page_in_bytes + int(stats.get("bytes", 0)), self.page_in_seconds + stats.get("seconds", 0.0)


class CertMetrics:
    """Lazily created Prometheus metrics with fixed ``model_name``/``engine`` labels.

    :meth:`record` only queues a call's report and counters (the decode step is hot: on CUDA they are
    non-blocking host copies behind an event); a daemon thread folds the queue into the Prometheus series
    every ``flush_seconds``, and :meth:`flush` does it on demand, exactly (it waits for the queued copies).

    Args:
        model_name, engine: the fixed labels.
        flush_seconds: the flusher thread's period.
        registry: the ``prometheus_client`` registry the series are declared in (default: the global one).
        rank: the ``rank`` label of the :data:`PER_RANK` series (the worker's rank in its engine).
    """

    def __init__(self, model_name: str, engine: str = "0", flush_seconds: float = 0.25,
                 registry: Any = None, rank: str = "0") -> None:  # fmt: skip
        self.base = {"model_name": model_name, "engine": engine}
        self.rank = str(rank)
        self._metrics: dict[str, object] | None = None
        self._registry = registry
        self._lock = threading.Lock()
        self._pending: list[_Queued] = []
        self._pending_lock = threading.Lock()
        self._fold_lock = threading.Lock()  # one fold at a time: flush() returns only once all is folded
        self._flush_seconds = flush_seconds
        self._flusher: threading.Thread | None = None
        self._drains: list[Callable[[], None]] = []

    def _get(self) -> dict[str, object]:
        if self._metrics is None:
            with self._lock:
                if self._metrics is None:
                    self._metrics = self._create()
        return self._metrics

    def _create(self) -> dict[str, object]:
        made = self._declare()
        # series with known label values start at 0, so dashboards show 0 rather than "no data"
        for rung in RUNG_NAMES:
            made["vllm:cert_head_steps_total"].labels(**self.base, rung=rung)
        for reason in HEAD_REASONS:
            made["vllm:cert_head_fallbacks_total"].labels(**self.base, reason=reason)
        for source in KEY_PAGE_SOURCES:
            made["vllm:cert_key_pages_total"].labels(**self._labels("vllm:cert_key_pages_total", source=source))
        for rung in RUNG_NAMES:
            made["vllm:cert_audits_total"].labels(**self.base, rung=rung)
            made["vllm:cert_audit_violations_total"].labels(**self.base, rung=rung)
        made["vllm:cert_audit_error_ratio"].labels(**self.base)
        for name in ("vllm:cert_canary_violations_total", "vllm:cert_promoted_key_blocks_total",
                     "vllm:cert_promoted_value_blocks_total", "vllm:cert_page_in_bytes_total"):  # fmt: skip
            made[name].labels(**self._labels(name))
        return made

    def _declare(self) -> dict[str, object]:
        import prometheus_client as prom

        made: dict[str, object] = {}
        labels = ("model_name", "engine")
        registry = prom.REGISTRY if self._registry is None else self._registry
        for spec in SPECS:
            name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
            if spec.kind == "counter":
                made[spec.name] = prom.Counter(name, spec.doc, labels + spec.labels, registry=registry)
            elif spec.kind == "histogram":
                made[spec.name] = prom.Histogram(name, spec.doc, labels + spec.labels, buckets=spec.buckets,
                                                 registry=registry)  # fmt: skip
            else:
                made[spec.name] = prom.Gauge(name, spec.doc, labels + spec.labels, multiprocess_mode="livesum",
                                             registry=registry)  # fmt: skip
        return made

    def _labels(self, name: str, **labels: str) -> dict[str, str]:
        """Every label of a series of ``name``: the fixed ones, ``labels``, and ``rank`` where it has one."""
        return {**self.base, **labels, **({RANK_LABEL: self.rank} if name in PER_RANK else {})}

    def _child(self, name: str, **labels: str):
        return self._get()[name].labels(**self._labels(name, **labels))

    def set_host_tier_bytes(self, nbytes: int) -> None:
        self._child("vllm:cert_host_tier_bytes").set(nbytes)

    def set_layer_certified(self, layer: str, certified: bool) -> None:
        """Whether attention layer ``layer`` (its number) holds certified pages (1) or native ones (0)."""
        self._child("vllm:cert_layer_certified", layer=layer).set(1 if certified else 0)

    def count_key_pages(self, pool: int, prefetch: int, host: int) -> None:
        """Key pages the promotion pass read from the pool, the step prefetch's ring and over PCIe."""
        for source, n in zip(KEY_PAGE_SOURCES, (pool, prefetch, host), strict=True):
            if n:
                self._child("vllm:cert_key_pages_total", source=source).inc(n)

    def record_audit(self, rung: torch.Tensor, ratio: torch.Tensor, violated: torch.Tensor) -> None:
        """Count audited head-steps (host tensors ``[n]``: int rung, float observed/allowed error ratio, bool
        violated), at once: they arrive already read off the device (``certvllm.attention.audit``)."""
        if rung.numel() == 0:
            return
        audits = torch.bincount(rung.long().flatten(), minlength=5).tolist()
        bad = torch.bincount(rung.long().flatten()[violated.flatten()], minlength=5).tolist()
        for i, (n, v) in enumerate(zip(audits, bad, strict=True)):
            if n:
                self._child("vllm:cert_audits_total", rung=RUNG_NAMES[i]).inc(n)
            if v:
                self._child("vllm:cert_audit_violations_total", rung=RUNG_NAMES[i]).inc(v)
        self._observe_many("vllm:cert_audit_error_ratio", ratio, AUDIT_RATIO_BUCKETS)

    def count_audit_fallback(self, layer: int, rows: int) -> None:
        """Rows of one layer call sent to exact attention by an audit violation's fallback entry (rung 4)."""
        self.count_layer_fallback(layer, rows, AUDIT_FALLBACK_REASON)

    def count_layer_fallback(self, layer: int, rows: int, reason: str) -> None:
        """Rows of one layer call recomputed exactly (rung 4) for ``reason``, at once (the canary's and the
        precondition's are counted from the report instead)."""
        if rows:
            self._child("vllm:cert_layer_fallbacks_total", reason=reason, layer=str(layer)).inc(rows)

    def add_drain(self, drain: Callable[[], None]) -> None:
        """Run ``drain`` at the start of every :meth:`flush` (the audit's queued checks: they are read there,
        waiting for their device values, so a flush is exact for them too)."""
        self._drains.append(drain)

    def count_exact_tokens(self, reason: str, n: int) -> None:
        if n:
            self._child("vllm:cert_exact_tokens_total", reason=reason).inc(n)

    def record(self, report: CertReport, layer: int, page_in_bytes: int = 0, page_in_seconds: float = 0.0, *,
               page_in: DeferredStats | None = None, key_pages: KeyPageCounts | None = None,
               batch: ReadBatch | None = None) -> None:  # fmt: skip
        """Queue one attention call for the next flush, without a host synchronisation.

        Args:
            report: the call's ``[R, H_q]`` report, any device. A CUDA report is queued as a non-blocking copy
                into pinned host memory behind a CUDA event on the current stream (its tensors may be reused
                after this returns); a CPU report is kept as it is (the caller must not modify it).
            layer: the layer index (the ``layer`` label of rung-4 fallbacks).
            page_in_bytes, page_in_seconds: page-in traffic known on the host.
            page_in: the page-in engine's counters (``take_stats_deferred``), added to the two above.
            key_pages: where the call's promoted key pages came from (CUDA path with a promotion pool).
            batch: the read the call's counters joined (``take_stats_deferred(batch)``); a CUDA report joins it
                too, and it is issued here: one copy and one event for the whole call.
        """
        device = report.rung.device
        if device.type == "cuda":
            tensors = [getattr(report, f.name) for f in fields(CertReport)]
            queued: CertReport | DeferredRead | BatchedRead = (
                batch.add(tensors) if batch is not None else DeferredRead(tensors)
            )
        else:
            queued = report if device.type == "cpu" else report.to("cpu")
        if batch is not None:
            batch.issue()
        self._queue(
            _Queued(
                queued, layer, page_in_bytes, page_in_seconds, page_in, (key_pages,) if key_pages is not None else ()
            )
        )

    def record_step(self, tally: TallyRead | None, page_in: DeferredStats | None = None,
                    key_pages: tuple[KeyPageCounts, ...] = (), batch: ReadBatch | None = None) -> None:  # fmt: skip
        """Queue one decode step's worth of CUDA calls for the next flush, without a host synchronisation: the
        step's tally (``DeviceTally.take``: every call's report, summed per layer on the device), the page-in
        engine's counters and each layer's key-page sources, all members of ``batch``, which is issued here (one
        copy and one event per step)."""
        if batch is not None:
            batch.issue()
        if tally is None and page_in is None and not key_pages:
            return
        self._queue(_Queued(tally, -1, page_in=page_in, key_pages=key_pages))

    def _queue(self, item: _Queued) -> None:
        with self._pending_lock:
            self._pending.append(item)
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="certvllm-metrics", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            time.sleep(self._flush_seconds)
            try:
                self.flush()
            except Exception:  # a fold that fails must not stop the series for good
                logger.exception("certvllm: folding the queued attention metrics failed; they are dropped")

    def flush(self) -> None:
        """Fold every queued call into the Prometheus series (one batch per layer). Waits for the device
        values of the queued calls (their CUDA events) and for a fold already under way, so the series are
        complete and exact for every call recorded before this one started."""
        for drain in list(self._drains):
            drain()
        with self._fold_lock:
            with self._pending_lock:
                pending, self._pending = self._pending, []
            by_layer: dict[int, list[CertReport]] = {}
            sources, nbytes, seconds = [0, 0, 0], 0, []
            tallies: list[TallyRead] = []
            for item in pending:  # in recording order: each read waits for its own event
                b, sec = item.page_in_totals()
                nbytes += b
                if b:
                    seconds.append(sec)
                if isinstance(item.report, TallyRead):
                    tallies.append(item.report)
                elif item.report is not None:
                    by_layer.setdefault(item.layer, []).append(item.host_report())
                for pages in item.key_pages:
                    sources = [a + b for a, b in zip(sources, pages.sources(), strict=True)]
            for layer, reports in by_layer.items():
                self._record_now(CertReport.cat(reports), layer)
            for tally in tallies:
                self._record_tally(tally.values(), tally.layers)
            self._count_page_in(nbytes, seconds)
            self.count_key_pages(*sources)

    def _record_now(self, report: CertReport, layer: int) -> None:
        rungs = torch.bincount(report.rung.flatten().long(), minlength=5).tolist()
        for i, n in enumerate(rungs):
            if n:
                self._child("vllm:cert_head_steps_total", rung=RUNG_NAMES[i]).inc(n)
        head_exact = report.rung == 3
        for reason, mask in zip(HEAD_REASONS, (report.rank_fail, report.boundary_fail, report.bound_fail),
                                strict=True):  # fmt: skip
            n = int((mask & head_exact).sum())
            if n:
                self._child("vllm:cert_head_fallbacks_total", reason=reason).inc(n)
        rows4 = report.rung[:, 0] == 4 if report.rung.numel() else report.rung.new_zeros(0, dtype=torch.bool)
        for reason, mask in zip(LAYER_REASONS, (report.canary_fail, report.precondition), strict=True):
            n = int((mask[:, 0] & rows4).sum()) if mask.numel() else 0
            if n:
                self._child("vllm:cert_layer_fallbacks_total", reason=reason, layer=str(layer)).inc(n)
        canary = int(report.canary_fail[:, 0].sum()) if report.canary_fail.numel() else 0
        if canary:
            self._child("vllm:cert_canary_violations_total").inc(canary)
        certified = report.rung <= 2
        v_max = report.v_max[certified].clamp_min(1e-30)
        self._observe_many("vllm:cert_e_key", report.e_key[certified], BOUND_BUCKETS)
        self._observe_many("vllm:cert_e_val", report.e_val[certified], BOUND_BUCKETS)
        self._observe_many("vllm:cert_bound_relative", report.bound[certified] / v_max, RELATIVE_BUCKETS)
        keys, values = int(report.k_star.sum()), int(report.v_promoted.sum())
        if keys:
            self._child("vllm:cert_promoted_key_blocks_total").inc(keys)
        if values:
            self._child("vllm:cert_promoted_value_blocks_total").inc(values)

    def _record_tally(self, totals: torch.Tensor, layers: tuple[int, ...]) -> None:
        """Fold a step's per-layer totals (``[len(layers), columns]`` float64 on the host, the layout of
        ``certvllm.triton_kernels.report_tally``) into the series: the same counts and buckets as
        :meth:`_record_now` of the step's reports."""
        summed = totals.sum(dim=0).tolist()
        for i, n in enumerate(summed[:5]):
            if n:
                self._child("vllm:cert_head_steps_total", rung=RUNG_NAMES[i]).inc(n)
        for reason, n in zip(HEAD_REASONS, summed[5:8], strict=True):
            if n:
                self._child("vllm:cert_head_fallbacks_total", reason=reason).inc(n)
        for layer, row in zip(layers, totals[:, 8:10].tolist(), strict=True):
            for reason, n in zip(LAYER_REASONS, row, strict=True):
                if n:
                    self._child("vllm:cert_layer_fallbacks_total", reason=reason, layer=str(layer)).inc(n)
        for name, n in zip(("vllm:cert_canary_violations_total", "vllm:cert_promoted_key_blocks_total",
                            "vllm:cert_promoted_value_blocks_total"), summed[10:13], strict=True):  # fmt: skip
            if n:
                self._child(name).inc(n)
        buckets = (len(summed) - HEAD_COLUMNS - 3) // 3
        sums = summed[-3:]
        for k, (name, edges) in enumerate(
            zip(
                ("vllm:cert_e_key", "vllm:cert_e_val", "vllm:cert_bound_relative"),
                (BOUND_BUCKETS, RELATIVE_BUCKETS, RELATIVE_BUCKETS),
                strict=True,
            )
        ):
            if buckets != len(edges) + 1:
                raise ValueError(f"a tally of {buckets} buckets for {name}, which has {len(edges) + 1}")
            at = HEAD_COLUMNS + k * buckets
            self._add_buckets(name, [int(n) for n in summed[at : at + buckets]], sums[k])

    def _count_page_in(self, nbytes: int, seconds: list[float]) -> None:
        """Page-in traffic: bytes, and one observation per recorded item that moved any."""
        if nbytes:
            self._child("vllm:cert_page_in_bytes_total").inc(nbytes)
        if seconds:
            self._observe_many("vllm:cert_page_in_seconds", torch.tensor(seconds), SECONDS_BUCKETS)

    def _observe_many(self, name: str, values: torch.Tensor, buckets: tuple[float, ...]) -> None:
        """Add many observations at once (bucket counts are computed with torch)."""
        if values.numel() == 0:
            return
        v = values.double().flatten()
        finite = torch.isfinite(v)
        edges = torch.tensor(buckets, dtype=torch.float64)
        idx = torch.bucketize(v[finite], edges, right=False)  # bucket i: v ≤ buckets[i]
        counts = torch.bincount(idx, minlength=len(buckets) + 1).tolist()
        counts[-1] += int((~finite).sum())
        self._add_buckets(name, counts, float(v[finite].sum()), values=v)

    def _add_buckets(self, name: str, counts: list[int], total: float, values: torch.Tensor | None = None) -> None:
        """Add ``counts[i]`` observations to bucket ``i`` of histogram ``name`` (the last: above every bound) and
        ``total`` to its sum. Where the client library's buckets are not reachable, ``values`` are observed one
        by one (without them, each bucket's count is observed at its bound)."""
        child = self._child(name)
        inner = getattr(child, "_buckets", None)
        if inner is None or len(inner) != len(counts):  # defensive: public API only
            if values is not None:
                for x in values.tolist():
                    child.observe(x)
                return
            raise RuntimeError(f"prometheus_client's histogram {name} exposes no buckets to add counts to")
        for bucket, n in zip(inner, counts, strict=True):
            if n:
                bucket.inc(n)
        if total:
            child._sum.inc(total)
