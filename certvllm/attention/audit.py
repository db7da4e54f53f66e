"""Audit mode: re-check a sampled fraction of certified head-steps against exact attention over the shadow.

The certificate is computed from the device pages, so it is only as good as those pages and the kernels that
read them. certvllm also holds the unquantized originals (tier 2), so it can check its own outputs: for a
head-step drawn with probability ``CertConfig.audit_rate`` (drawn by batch row, below), the :class:`Auditor`
recomputes attention for that query head exactly, in float64, from the shadow pages of the row's context and
compares the output the op returned (``res.out``, float32, before the engine's cast to the model dtype):

* **rungs 0–2**: ``‖O_returned − O_exact‖₂ ≤ (E_key + E_val)·(1 + 2⁻²⁰) + F64_SLACK·V_max``. The certificate
  bounds the distance to exact real-number attention with no slack (``docs/certification.md`` §1); the audit's
  reference is that attention evaluated in float64 (relative rounding ≈ T·2⁻⁵³), which ``F64_SLACK`` = 2⁻³⁰ of
  V_max covers with a wide margin (E_round alone is ≈ 2.3·10⁻⁶·V_max). The factor (1 + 2⁻²⁰) absorbs the
  float32 rounding of the sum E_key + E_val.
* **rungs 3/4**: equal to exact within the rounding of the exact path, :func:`exact_tolerance`.

Every audited head-step is reported (:class:`AuditOutcome`: counted by the metrics as
``vllm:cert_audits_total``, ``vllm:cert_audit_violations_total`` and ``vllm:cert_audit_error_ratio``); a
violation is logged with its layer, query head, batch row, request key and step, and ``audit_policy`` applies:

* ``log``: nothing more;
* ``fallback``: the layer runs exact (rung 4, via ``certified_attention(force_exact=...)``) for that request's
  rows until the request ends; on the CPU the violating row of the current call is recomputed exactly too;
* ``abort``: as ``fallback`` for every layer, and the request is listed in :meth:`Auditor.take_aborts` and
  logged at ERROR as to be aborted (vLLM 0.32 gives a worker no per-request abort: docs/reliability.md).

**Requests.** The op sees rows, not requests. A request is recognised by the 16-token block it was writing when
the violation happened: ``(block id, block-table column, context length)``. The block being written is never
shared with another live request, a request's rows keep that block at that column while it lives and only get
longer. A row matches an entry when ``tables[row, column] == block`` and its length is at least the recorded
one; an entry that no row of a call of its layer matches is dropped (the request ended, or was preempted and
lost its blocks), so entries live exactly as long as the request keeps being scheduled.

**Off the critical path.** The audit draws batch rows, not single head-steps: each row of each layer call is
drawn with probability ``audit_rate`` and a drawn row is checked at every query head, so every head-step is
audited with probability ``audit_rate`` (as independent draws would give) while the audited calls, whose cost
on the host is per call (the check launches, the deferred read, the outcome), are ``H_q`` times rarer. Sampling
is a geometric skip counter over rows (:class:`AuditSampler`): a call with no audited row costs one subtraction
and draws nothing. The draws come from the audit's own
``random.Random`` seeded from ``CertConfig.seed``; the op's exploration generator is never touched. The
audit's device work is queued in stream order right after the call (the shadow pages it reads are exactly
those the call read) and its results are taken as a :class:`~certvllm.kv.deferred.DeferredRead`: on CUDA a
non-blocking copy behind an event, read once the event has completed (by the next step's first layer call,
or the metrics' flusher via :meth:`Auditor.resolve`), never a host synchronisation in the layer call. The
fallback mask of a call is computed on the device too. On the CPU everything is read at once.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from certvllm.attention.op import ExactRows, _recompute_rows, dense_rows
from certvllm.bounds.report import RUNG_LAYER_DENSE, RUNG_VALUES, CertifiedOutput
from certvllm.bounds.rounding import GAMMA_SLACK, UNIT_ROUNDOFF, gamma
from certvllm.config import CertConfig
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.deferred import DeferredRead
from certvllm.kv.pagein import PageInEngine, engine_for

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers in a worker

F64_SLACK = 2.0**-30
"""Rungs 0–2: allowance for the float64 evaluation of the exact reference, as a fraction of V_max."""
BOUND_SUM_SLACK = 1.0 + 2.0**-20
"""Rungs 0–2: the float32 sum E_key + E_val may round down by one ulp; the bound is compared ×(1 + 2⁻²⁰)."""
ALL_LAYERS = -1
"""Layer key of an ``abort`` entry: it forces exact attention in every layer."""
PAIR_CHUNK_ELEMENTS = 1 << 22
"""Audited head-steps are referenced in chunks so that the float64 context copy stays near 32 MiB."""
POLICIES = ("log", "fallback", "abort")


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of ``dtype`` (float32 2⁻²⁴, float16 2⁻¹¹, bfloat16 2⁻⁸)."""
    return float(torch.finfo(dtype).eps) / 2.0


def exact_tolerance(
    v_max: torch.Tensor, score_max: torch.Tensor, head_dim: int, tokens: int, exact_dtype: torch.dtype
) -> torch.Tensor:
    """How far a rung-3/4 output may be from exact attention (float64 ``[n]``, absolute, units of V).

    The exact path is float32 attention over the originals (``dense_decode``'s SDPA, the CUDA device rerun), or
    on the CPU plugin vLLM's own kernel in the model dtype (``exact_dtype`` = bfloat16/float16). With S the
    largest |score| bound λΣ_c|q_c||k_tc| over the context and u = 2⁻²⁴:

    * float32 arithmetic: scores within γ_{D+8}·S, exp within 4u·S + 16u (log units) so that the weights move by
      at most that in total variation (Lemma A), plus the T-term weight and value sums (γ_{T+2} each) —
      ``f32 = 2γ_{D+8}·S + 4u·S + 16u + 2γ_{T+2}``, taken twice (the kernel's reduction order is unknown);
    * a model-dtype kernel (unit roundoff u_lp): its query scaled in u_lp (scores within u_lp·S), its
      probabilities and its output rounded to u_lp — ``u_lp·(2S + 3)``.

    ``tolerance = V_max·GAMMA_SLACK·(2·f32 + lowp)``, affine in S (:func:`exact_tolerance_coefficients`). Args:
    ``v_max``, ``score_max`` ``[n]`` float64 (the audited heads' V_max and S over their valid tokens); ``tokens``
    an upper bound on the context length."""
    a, b = exact_tolerance_coefficients(head_dim, tokens, exact_dtype)
    return v_max * (a + b * score_max)


def exact_tolerance_coefficients(head_dim: int, tokens: int, exact_dtype: torch.dtype) -> tuple[float, float]:
    """``(a, b)`` with :func:`exact_tolerance` ``= V_max·(a + b·S)``: its terms grouped by their factor of S
    (host floats, handed to the device check's kernel as they are)."""
    u, u_lp = UNIT_ROUNDOFF, unit_roundoff(exact_dtype)
    lp = u_lp if u_lp > u else 0.0
    a = 2.0 * (16.0 * u + 2.0 * gamma(tokens + 2)) + 3.0 * lp
    b = 2.0 * (2.0 * gamma(head_dim + 8) + 4.0 * u) + 2.0 * lp
    return GAMMA_SLACK * a, GAMMA_SLACK * b


class AuditSampler:
    """Bernoulli(``rate``) per item (the auditor's items are the batch rows of its layer calls), drawn as
    geometric gaps: the number of items skipped before the next audited one. A call of ``n`` items that audits
    none costs one comparison and no draw.

    Args:
        rate: the audit probability in [0, 1] (0: never, 1: every item).
        seed: the stream's seed (``CertConfig.seed``); the stream is the sampler's own ``random.Random``.
    """

    def __init__(self, rate: float, seed: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"audit_rate={rate!r} is outside [0, 1]; pass a probability (0 turns audits off)")
        self.rate = float(rate)
        self._rng = random.Random(f"certvllm-audit-{seed}")
        self._log_miss = math.log1p(-self.rate) if 0.0 < self.rate < 1.0 else 0.0
        self._gap = self._draw()

    def _draw(self) -> float:
        if self.rate >= 1.0:
            return 0
        if self.rate <= 0.0:
            return math.inf
        return math.floor(math.log1p(-self._rng.random()) / self._log_miss)

    def sample(self, n: int) -> list[int]:
        """The indices in ``[0, n)`` of the next ``n`` items that are audited (ascending)."""
        if self._gap >= n:
            self._gap -= n
            return []
        picked, at = [], self._gap
        while at < n:
            picked.append(int(at))
            at += 1 + self._draw()
        self._gap = at - n
        return picked


@dataclass(frozen=True)
class FallbackEntry:
    """One request whose rows a layer (or every layer: ``layer == ALL_LAYERS``) computes exactly.

    Attributes: ``block`` the 16-token block id the request was writing at the violation, ``column`` its
    block-table column, ``min_len`` the row's context length then; ``step`` and ``where`` for the log."""

    layer: int
    block: int
    column: int
    min_len: int
    step: int
    where: str


@dataclass
class AuditOutcome:
    """The audited head-steps of one layer call, on the host (every tensor ``[n]``).

    Attributes:
        layer, step: the layer index and its call count (the engine step among steps with certified rows).
        rows, heads: int64 batch row and query head of each audited head-step.
        rung: int64 the rung the head-step was served at.
        error: float64 ‖O_returned − O_exact‖₂.
        allowed: float64 the allowance (the certificate for rungs 0–2, :func:`exact_tolerance` for 3/4).
        ratio: float64 error / allowed (> 1 exactly for violations; non-finite output: inf).
        violated: bool.
        lens, key_block, key_column: int64 the row's context length and its request key (module docstring).
    """

    layer: int
    step: int
    rows: torch.Tensor
    heads: torch.Tensor
    rung: torch.Tensor
    error: torch.Tensor
    allowed: torch.Tensor
    ratio: torch.Tensor
    violated: torch.Tensor
    lens: torch.Tensor
    key_block: torch.Tensor
    key_column: torch.Tensor


@dataclass
class _Pending:
    layer: int
    step: int
    read: DeferredRead


@dataclass
class _PendingHits:
    entries: list[FallbackEntry]
    read: DeferredRead  # [E] bool hits, [1] int64 forced rows
    layer: int


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 index on ``device`` (from pinned memory without waiting on CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def reference_heads(
    q: torch.Tensor,
    cache: LayerKVCache,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    heads: torch.Tensor,
    scale: float,
    pagein: PageInEngine,
    compiled: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact attention of single (row, query head) pairs over the shadow originals, in float64.

    The pair's KV head's pages of every block-table column are gathered through ``pagein`` (the interface the
    exact fallbacks use) and tokens at or past the row's length are masked, so nothing is read on the host
    (``lens`` may stay on the device). The attention itself is torch SDPA, as ``dense_backend.sdpa_decode``,
    evaluated in float64.

    Args:
        q: ``[R, H_q, D]`` the call's queries; cache: the layer's cache; tables ``[R, W]`` int 16-token block
            ids; lens ``[R]`` int context lengths (both on any device); rows, heads ``[n]`` int64 on the pages'
            device; scale: the softmax scale.

        compiled: on CPU pages, use the compiled reference (``csrc/cpu/audit_reference.cpp``: the same float64
            attention, one pass in the calling thread, only the block-table columns that hold the row's tokens
            gathered); None: when it is built. False: the torch path (any device).

    Returns:
        ``(out [n, D], v_max [n], score_max [n])`` float64: the exact output, the largest value norm and the
        largest |score| bound λΣ_c|q_c||k_tc| over each pair's valid tokens.
    """
    dev = cache.pages.device
    if dev.type == "cpu" and compiled is not False:
        ext = _audit_extension(required=bool(compiled))
        if ext is not None:
            return _reference_heads_compiled(ext, q, cache, tables, lens, rows, heads, scale, pagein)
    n_pairs = rows.shape[0]
    W, N, D = tables.shape[1], cache.layout.block_size, cache.layout.head_dim
    T = W * N
    group = q.shape[1] // cache.num_kv_heads
    tables_d = tables.to(dev, torch.int64).clamp(0, cache.num_blocks - 1)
    lens_d = lens.to(dev, torch.int64)
    step = max(1, PAIR_CHUNK_ELEMENTS // (T * D))
    outs, vmaxes, smaxes = [], [], []
    for start in range(0, n_pairs, step):
        r, h = rows[start : start + step], heads[start : start + step]
        c = r.shape[0]
        ids = tables_d[r]  # (c, W)
        kv = pagein.gather_kv(cache, ids.reshape(-1), (h // group).repeat_interleave(W)).to(dev)
        kv = kv.view(c, W, 2, N, D).double()
        k, v = kv[:, :, 0].reshape(c, T, D), kv[:, :, 1].reshape(c, T, D)
        valid = torch.arange(T, device=dev) < lens_d[r].unsqueeze(1)  # (c, T)
        qd = q.to(dev)[r, h].double()  # (c, D)
        out = F.scaled_dot_product_attention(qd[:, None, None, :], k[:, None], v[:, None],
                                             attn_mask=valid[:, None, None, :], scale=scale)  # fmt: skip
        outs.append(out[:, 0, 0])
        vmaxes.append(torch.where(valid, v.norm(dim=-1), 0.0).amax(dim=-1))
        s_abs = torch.einsum("cd,ctd->ct", qd.abs(), k.abs()) * abs(scale)
        smaxes.append(torch.where(valid, s_abs, 0.0).amax(dim=-1))
    return torch.cat(outs), torch.cat(vmaxes), torch.cat(smaxes)


def _audit_extension(required: bool) -> Any:
    """The compiled reference's module, or None when it cannot be built (``required``: raise instead)."""
    from certvllm.kernels import cpu as cpu_kernels

    try:
        return cpu_kernels.load_audit()
    except RuntimeError:
        if required:
            raise
        return None


def _reference_heads_compiled(
    ext: Any,
    q: torch.Tensor,
    cache: LayerKVCache,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    heads: torch.Tensor,
    scale: float,
    pagein: PageInEngine,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`reference_heads` on CPU pages, in the compiled routine (same arguments and results).

    Only the block-table columns ``[0, ⌈len/N⌉)`` of each pair are read (the table is as wide as the longest
    context the engine allows). With the stock host page-in engine (``engine_for("cpu")``, whose gather is a plain
    copy of the shadow's bytes) the routine reads the pages in place, as the compiled decode kernel does: no copy,
    no torch op that could open a parallel region right after the decode kernel's (on a busy 2-core machine
    such a gather waited ≈ 30 ms for the pool's threads, for 0.3 ms of work). Any other engine (the fault
    injection's) is asked for the pages, in chunks of at most :data:`PAIR_CHUNK_ELEMENTS` shadow elements."""
    N, W = cache.layout.block_size, tables.shape[1]
    group = q.shape[1] // cache.num_kv_heads
    lens_p = lens.to(torch.int64)[rows].clamp(0, W * N).contiguous()  # (n,) tokens each pair reads
    blocks = tables.to(torch.int64)[rows].clamp(0, cache.num_blocks - 1).contiguous()  # (n, W)
    kv_heads = (heads // group).contiguous()
    qd = q[rows, heads].double().contiguous()  # (n, D)
    if type(pagein) is PageInEngine and cache.shadow.is_contiguous():
        out, vmax, smax = ext.audit_reference_shadow_cpu(cache.shadow, cache.keys_channel_major, blocks, kv_heads,
                                                         lens_p, qd, scale, N)  # fmt: skip
        return out, vmax, smax
    counts = (lens_p + N - 1) // N  # (n,) pages
    per_page = 2 * N * cache.layout.head_dim
    outs, vmaxes, smaxes = [], [], []
    start, n, count_list = 0, rows.shape[0], counts.tolist()
    while start < n:
        end, pages = start + 1, count_list[start]
        while end < n and (pages + count_list[end]) * per_page <= PAIR_CHUNK_ELEMENTS:
            pages += count_list[end]
            end += 1
        c = counts[start:end]
        ids = blocks[start:end][torch.arange(W) < c[:, None]]  # (pages,) row-major: each pair's pages consecutive
        if pages:
            kv = pagein.gather_kv(cache, ids, kv_heads[start:end].repeat_interleave(c)).contiguous()
        else:
            kv = torch.empty(0, 2, N, cache.layout.head_dim, dtype=cache.shadow.dtype)
        out, vmax, smax = ext.audit_reference_cpu(kv, torch.cumsum(c, 0) - c, lens_p[start:end].contiguous(),
                                                  qd[start:end].contiguous(), scale)  # fmt: skip
        outs.append(out)
        vmaxes.append(vmax)
        smaxes.append(smax)
        start = end
    return torch.cat(outs), torch.cat(vmaxes), torch.cat(smaxes)


class Auditor:
    """Audit mode of one worker (see the module docstring): sampling, the checks, the fallback entries.

    Args:
        config: ``audit_rate``, ``audit_policy`` and ``seed`` are read.
        on_outcome: called with every resolved :class:`AuditOutcome` (the runtime records the metrics there).
        on_forced: called with ``(layer, rows)`` for the rows a fallback entry forced to exact attention.
        defer: act on a call's checks only once they are resolved later, never inside the call (None: on CUDA
            pages only, as there the values land after the call; True on the CPU reproduces that behaviour).
        on_checked: called in the layer call, once its checks are queued, with ``(rows, violated, tag)``: the
            audited head-steps' ``[n]`` int64 batch rows and ``[n]`` bool verdicts, still on the pages' device (device
            work only: nothing is read), and the ``tag`` the call was run with (the engine's per-request accounting:
            ``certvllm.metrics.requests``). Not called for calls run without a tag.
    """

    def __init__(self, config: CertConfig, on_outcome: Callable[[AuditOutcome], None] | None = None,
                 on_forced: Callable[[int, int], None] | None = None, defer: bool | None = None,
                 on_checked: Callable[[torch.Tensor, torch.Tensor, Any], None] | None = None) -> None:  # fmt: skip
        if config.audit_policy not in POLICIES:
            raise ValueError(f"audit_policy={config.audit_policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy = config.audit_policy
        self.sampler = AuditSampler(config.audit_rate, config.seed)
        self._seed = config.seed
        # the exact reference's implementation on CPU pages (reference_heads' ``compiled``): None the compiled
        # routine where built, False the torch path (benchmarks compare them), True the compiled one or an error
        self.compiled_reference: bool | None = None
        # the checks' implementation (_check_on_device): None the device kernels on CUDA pages unless
        # compiled_reference is False (the torch path, for benchmarks); True always (Triton's interpreter on the
        # CPU, in tests); False never
        self.device_reference: bool | None = None
        self._device_launched = False
        self._device_failure: str | None = None
        self.on_outcome = on_outcome
        self.on_forced = on_forced
        self.on_checked = on_checked
        self.defer = defer
        self.audited = 0  # head-steps audited and resolved so far
        self.violations = 0
        self._steps: dict[int, int] = {}
        self._first_layer: int | None = None  # the lowest layer index audited: where a step's calls start
        self._pending: list[_Pending] = []
        self._hits: list[_PendingHits] = []
        self._entries: dict[int, list[FallbackEntry]] = {}
        self._aborts: list[FallbackEntry] = []
        self._lock = threading.RLock()
        self._pageins: dict[torch.device, PageInEngine] = {}

    @property
    def enabled(self) -> bool:
        return self.sampler.rate > 0.0

    def set_rate(self, rate: float) -> None:
        """Draw from now on with probability ``rate`` (a fresh sampler on the same seed; counts, pending checks and
        fallback entries are kept). For benchmarks that compare rates inside one running engine."""
        self.sampler = AuditSampler(rate, self._seed)

    # -- one layer call -----------------------------------------------------------------------------------
    def run(
        self,
        layer: int,
        q: torch.Tensor,
        cache: LayerKVCache,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        call: Callable[[torch.Tensor | None], CertifiedOutput],
        *,
        exact_rows: ExactRows | None = None,
        dense_backend: str = "auto",
        tag: Any = None,
    ) -> CertifiedOutput:
        """One audited layer call: ``call(force_exact)`` runs the op (``force_exact`` ``[R]`` bool on the pages'
        device, or None when no fallback entry concerns this layer), then the sampled head-steps are checked.

        Args:
            layer: the layer index; q ``[R, H_q, D]``, cache, tables ``[R, W]``, lens ``[R]``, scale: the call's
                arguments (as ``certified_attention``'s).
            exact_rows: the engine's exact kernel for listed rows (the CPU plugin's vLLM kernel in the model
                dtype), or None (the op's float32 path). It sets the rung-3/4 tolerance's dtype and, on the
                CPU, recomputes a violating row at once under ``fallback``/``abort``.
            dense_backend: ``CertConfig.dense_backend``, for that recompute when ``exact_rows`` is None.
            tag: handed to ``on_checked`` with the call's checks (None: ``on_checked`` is not called).

        Returns:
            the call's output (violating rows recomputed exactly on the CPU unless the policy is ``log``).
        """
        step = self._steps.get(layer, 0)
        self._steps[layer] = step + 1
        dev = cache.pages.device
        deferred = self.defer or (self.defer is None and dev.type == "cuda")
        self._first_layer = layer if self._first_layer is None else min(self._first_layer, layer)
        if not deferred or layer == self._first_layer:
            # deferred checks land after their call: reading the landed ones once per step (at the first layer)
            # starts their fallbacks from the next step, as reading them at every layer would, for one pass over
            # the queue instead of one per layer
            self.resolve()
        force = self.forced_rows(layer, tables, lens)
        res = call(force)
        R, Hq = q.shape[0], q.shape[1]
        rows = self.sampler.sample(R) if R else []
        if not rows:
            return res
        picked = [r * Hq + h for r in rows for h in range(Hq)]  # a drawn row is checked at every query head
        exact_dtype = cache.dtype if exact_rows is not None else torch.float32
        read = DeferredRead(self.queue_checks(q, cache, tables, lens, scale, res, picked, exact_dtype, tag))
        with self._lock:
            self._pending.append(_Pending(layer, step, read))
        if deferred:
            return res  # read by the next step's first call (resolve()) or by the metrics' flush
        for outcome in self.resolve():
            here = outcome.layer == layer and outcome.step == step
            if here and self.policy != "log" and bool(outcome.violated.any()):
                bad = sorted(set(outcome.rows[outcome.violated].tolist()))
                rows_fn = exact_rows or dense_rows(q, cache, tables, lens, scale, self._pagein(dev), dense_backend)
                recompute_exact(res, bad, rows_fn)
        return res

    def queue_checks(self, q: torch.Tensor, cache: LayerKVCache, tables: torch.Tensor, lens: torch.Tensor,
                     scale: float, res: CertifiedOutput, picked: list[int], exact_dtype: torch.dtype,
                     tag: Any = None) -> list[torch.Tensor]:  # fmt: skip
        """Queue the checks of the flat pairs ``picked`` (``row·H_q + head``) of a call (device work only) and hand
        their rows and verdicts to ``on_checked`` (with a ``tag``). Returns what :meth:`_outcome` reads: the device
        kernels' ``[n, 10]`` verdict rows, or :meth:`_check`'s ten tensors."""
        verdict = self._check_on_device(q, cache, tables, lens, scale, res, picked, exact_dtype)
        if verdict is not None:
            if self.on_checked is not None and tag is not None:
                self.on_checked(verdict[:, 0].long(), verdict[:, 6] > 0, tag)
            return [verdict]
        dev, hq = cache.pages.device, q.shape[1]
        rows = _index([i // hq for i in picked], dev)
        heads = _index([i % hq for i in picked], dev)
        checked = self._check(q, cache, tables, lens, scale, res, rows, heads, exact_dtype)
        if self.on_checked is not None and tag is not None:
            self.on_checked(checked[0], checked[6], tag)
        return checked

    def _check(self, q: torch.Tensor, cache: LayerKVCache, tables: torch.Tensor, lens: torch.Tensor, scale: float,
               res: CertifiedOutput, rows: torch.Tensor, heads: torch.Tensor,
               exact_dtype: torch.dtype) -> list[torch.Tensor]:  # fmt: skip
        """Queue the checks of the pairs ``rows``/``heads`` (device work only); their results, on the device, in
        :meth:`_outcome`'s order (rows, heads, rung, error, allowed, ratio, violated, lens, key block, column)."""
        dev = cache.pages.device
        N = cache.layout.block_size
        rep = res.report
        returned = res.out[rows, heads].double()  # copies: a CUDA graph's buffers may be reused after the call
        rung = rep.rung[rows, heads].long()
        bound = rep.bound[rows, heads].double()
        exact, v_max, s_max = reference_heads(q, cache, tables, lens, rows, heads, scale, self._pagein(dev),
                                              self.compiled_reference)  # fmt: skip
        error = (returned - exact).norm(dim=-1)
        tol = exact_tolerance(v_max, s_max, cache.layout.head_dim, tables.shape[1] * N, exact_dtype)
        allowed = torch.where(rung <= RUNG_VALUES, bound * BOUND_SUM_SLACK + F64_SLACK * v_max, tol)
        violated = ~(error <= allowed)  # NaN errors are violations
        ratio = torch.where(allowed > 0, error / allowed, torch.where(error > 0, math.inf, 0.0))
        ratio = torch.where(torch.isnan(error), math.inf, ratio)
        lens_d = lens.to(dev, torch.int64)[rows]
        column = (lens_d - 1) // N
        key_block = tables.to(dev, torch.int64)[rows, column]
        return [rows, heads, rung, error, allowed, ratio, violated, lens_d, key_block, column]

    def _check_on_device(self, q: torch.Tensor, cache: LayerKVCache, tables: torch.Tensor, lens: torch.Tensor,
                         scale: float, res: CertifiedOutput, picked: list[int],
                         exact_dtype: torch.dtype) -> torch.Tensor | None:  # fmt: skip
        """The checks of the flat pairs ``picked`` (``row·H_q + head``) in the device kernels
        (``certvllm.triton_kernels.audit_check``: two launches, one small copy, where :meth:`_check` issues some
        seventy torch ops), as the ``[n, 10]`` float64 verdict rows on the pages' device; None where they do not
        run (:attr:`device_reference`), or when they failed to compile at their first launch in this process
        (warned once; the torch path serves from then on)."""
        dev = cache.pages.device
        use = self.device_reference
        if use is False or self._device_failure is not None:
            return None
        if use is None and (dev.type != "cuda" or self.compiled_reference is False):
            return None
        from certvllm.kv.cuda_pagein import ensure_device_readable
        from certvllm.triton_kernels.audit_check import audit_check

        a, b = exact_tolerance_coefficients(cache.layout.head_dim, tables.shape[1] * cache.layout.block_size,
                                            exact_dtype)  # fmt: skip
        rep = res.report
        try:
            verdict = audit_check(ensure_device_readable(cache), picked, q.to(dev), res.out, rep.rung, rep.bound,
                                     tables.to(dev), lens.to(dev), scale, num_kv_heads=cache.num_kv_heads,
                                     num_blocks=cache.num_blocks, channel_major=cache.keys_channel_major, tol_a=a,
                                     tol_b=b, bound_slack=BOUND_SUM_SLACK, f64_slack=F64_SLACK,
                                     rung_values=RUNG_VALUES)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - only a first launch's (compile) failure is forgiven
            if self._device_launched:
                raise
            self._device_failure = f"{type(err).__name__}: {str(err)[:400]}"
            logger.warning("certvllm audit: the device check kernels failed to compile (%s); audits use the torch "
                           "float64 path for the rest of this process (same checks, more launches per audited "
                           "call)", self._device_failure)  # fmt: skip
            return None
        self._device_launched = True
        return verdict

    def _pagein(self, device: torch.device) -> PageInEngine:
        """The audit's own page-in engine (its traffic is not the call's: it is not exported)."""
        if device not in self._pageins:
            self._pageins[device] = engine_for(device)
        return self._pageins[device]

    # -- results ------------------------------------------------------------------------------------------
    def resolve(self, wait: bool = False) -> list[AuditOutcome]:
        """Read every queued check whose device values have landed (with ``wait``, every one queued when it was
        called: it waits for them without holding the auditor's lock, so it blocks this thread only, never a layer
        call), count, log and apply the policy; returns the outcomes (also given to ``on_outcome``).
        Also folds the fallback entries' hit reads (entries no row matched are dropped)."""
        if not self._pending and not self._hits:  # the common case: nothing queued
            return []
        if wait:  # wait outside the lock: the layer calls take it, and must never wait on the device through it
            with self._lock:
                queued = [p.read for p in self._pending] + [h.read for h in self._hits]
            for read in queued:
                read.wait()
        with self._lock:
            ready = [p for p in self._pending if p.read.done()]
            self._pending = [p for p in self._pending if p not in ready]
            hits = [h for h in self._hits if h.read.done()]
            self._hits = [h for h in self._hits if h not in hits]
            for h in hits:
                matched, forced = h.read.values()
                for entry, hit in zip(h.entries, matched.tolist(), strict=True):
                    if not hit:
                        self._drop(entry)
                if self.on_forced is not None and int(forced[0]):
                    self.on_forced(h.layer, int(forced[0]))
            outcomes = [self._outcome(p) for p in ready]
        for outcome in outcomes:
            if self.on_outcome is not None:
                self.on_outcome(outcome)
        return outcomes

    def _outcome(self, p: _Pending) -> AuditOutcome:
        values = p.read.values()
        if len(values) == 1:  # the device kernels' verdict rows (triton_kernels.audit_check.VERDICT_COLUMNS)
            v = values[0]
            values = [v[:, 0].long(), v[:, 1].long(), v[:, 2].long(), v[:, 3], v[:, 4], v[:, 5], v[:, 6] > 0,
                      v[:, 7].long(), v[:, 8].long(), v[:, 9].long()]  # fmt: skip
        rows, heads, rung, error, allowed, ratio, violated, lens, key_block, column = values
        outcome = AuditOutcome(p.layer, p.step, rows, heads, rung, error, allowed, ratio, violated, lens,
                               key_block, column)  # fmt: skip
        self.audited += rows.numel()
        bad = violated.nonzero().flatten().tolist()
        self.violations += len(bad)
        for i in bad:
            self._violation(outcome, i)
        return outcome

    def _violation(self, o: AuditOutcome, i: int) -> None:
        row, block, column, length = (int(t[i]) for t in (o.rows, o.key_block, o.key_column, o.lens))
        where = (f"batch row {row} (request key: block {block} at block-table column {column}, context {length} "
                 f"tokens)")  # fmt: skip
        action = {"log": "logged only (audit_policy: log)",
                  "fallback": f"layer {o.layer} runs exact for the rest of this request (audit_policy: fallback)",
                  "abort": "every layer runs exact for the rest of this request, which must be aborted "
                           "(audit_policy: abort)"}[self.policy]  # fmt: skip
        log = logger.error if self.policy == "abort" else logger.warning
        log("certvllm audit violation: layer %d, query head %d, %s, step %d: rung %d output is %.6g from exact "
            "attention, allowed %.6g (ratio %.4g); %s", o.layer, int(o.heads[i]), where, o.step, int(o.rung[i]),
            float(o.error[i]), float(o.allowed[i]), float(o.ratio[i]), action)  # fmt: skip
        if self.policy == "log":
            return
        layer = o.layer if self.policy == "fallback" else ALL_LAYERS
        entry = FallbackEntry(layer, block, column, length, o.step, where)
        entries = self._entries.setdefault(layer, [])
        if not any((e.block, e.column) == (block, column) for e in entries):
            entries.append(entry)
            if self.policy == "abort":
                self._aborts.append(entry)

    def _drop(self, entry: FallbackEntry) -> None:
        entries = self._entries.get(entry.layer, [])
        if entry in entries:
            entries.remove(entry)
            logger.info("certvllm audit: the request of %s no longer runs in layer %s; its exact fallback ends",
                        entry.where, "calls" if entry.layer == ALL_LAYERS else entry.layer)  # fmt: skip
        if not entries:
            self._entries.pop(entry.layer, None)

    # -- fallback entries -----------------------------------------------------------------------------------
    def forced_rows(self, layer: int, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """``[R]`` bool on the pages' device: the rows a fallback entry of ``layer`` (or an ``abort`` entry)
        sends to exact attention; None when there is no entry (the common case: no device work, no graph
        given up). Computed on the device; which entries matched is read later (:meth:`resolve`)."""
        if not self._entries:
            return None
        with self._lock:
            entries = self._entries.get(layer, []) + self._entries.get(ALL_LAYERS, [])
        if not entries:
            return None
        dev = tables.device
        blocks = _index([e.block for e in entries], dev)
        columns = _index([min(e.column, tables.shape[1] - 1) for e in entries], dev)
        fits = _index([int(e.column < tables.shape[1]) for e in entries], dev).bool()
        mins = _index([e.min_len for e in entries], dev)
        match = (tables.to(torch.int64)[:, columns] == blocks) & (lens.to(dev, torch.int64)[:, None] >= mins) & fits
        force = match.any(dim=1)
        read = DeferredRead([match.any(dim=0), force.sum().view(1)])
        with self._lock:
            self._hits.append(_PendingHits(entries, read, layer))
        return force

    def take_aborts(self) -> list[FallbackEntry]:
        """The requests an ``abort`` violation marked since the last call (for a component that can end them;
        none in vLLM 0.32 — docs/reliability.md)."""
        with self._lock:
            aborts, self._aborts = self._aborts, []
        return aborts

    def fallback_entries(self) -> list[FallbackEntry]:
        """Every active fallback entry (every layer's, abort entries included)."""
        with self._lock:
            return [e for entries in self._entries.values() for e in entries]


def recompute_exact(res: CertifiedOutput, rows: list[int], rows_fn: ExactRows) -> None:
    """Recompute ``rows`` of a call exactly in place: rung 4 and zero bounds in the report, ``rows_fn``'s output
    (the op's own rung-3/4 recompute, ``op._recompute_rows``) in ``res.out``. Host row list: CPU use only."""
    if not rows:
        return
    report = res.report
    mask = torch.zeros_like(report.rung, dtype=torch.bool)
    mask[torch.tensor(rows, device=mask.device)] = True
    report.rung.masked_fill_(mask, RUNG_LAYER_DENSE)
    _recompute_rows(res.out, mask, rows_fn)
    for t in (report.e_key, report.e_val, report.e_round):
        t.masked_fill_(mask, 0.0)
