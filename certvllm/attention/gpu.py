"""Certified attention on CUDA: Triton kernels for every pass, and no host synchronisation between them.

The same algorithm, certificate and report as the torch reference (``reference.py``; read it first); what
differs is where each step runs:

1. trailing partial block: gathered zero-copy from the pinned shadow (``CudaPageInEngine``, side stream),
   overlapping phase 1;
2. phase 1 (``triton_kernels.phase1``): INT8 scores, ℓ⁸_b, Δ_b, R_b, η_b, ν_b, page flags, split-K;
3. the phase-1 summary (``triton_kernels.prepare``, or its torch reference ``epilogue.summarize``);
4. selection (``triton_kernels.select``, or the torch reference ``selection.py``): the promotion bitmask,
   with exploration draws on the device;
5. phase 2 (``triton_kernels.phase2``): the promotion pass (exact scores of promoted blocks read from the
   layer's promotion pool, the step prefetch's staging, or zero-copy from the shadow; canary), then one
   attend pass mixing unquantized and INT8/INT4 blocks with float64 accumulation, plus the bound
   accumulators;
6. the output, bounds, checks and report (``triton_kernels.finalize``, or ``epilogue.certify``).

Rungs 3/4 are recomputed on the device (:class:`DeviceRerun`): phase 2 again with every block of the
escalated (row, KV head) groups read unquantized, exact float32 attention over the originals with the
reference's summation structure, so the whole layer call stays free of host synchronisation and can be
captured in a CUDA graph. The number of blocks per row is taken from the block table's width, never from
the lengths, so the host never reads ``seq_lens``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from certvllm.attention.call import LayerCall
from certvllm.attention.epilogue import Measured, certify, combine, finite_abs_max, summarize
from certvllm.attention.selection import Phase1, select_keys, select_values
from certvllm.bounds import delta_factor
from certvllm.bounds.report import RUNG_HEAD_DENSE, CertReport
from certvllm.bounds.summary import Phase1Summary
from certvllm.config import CertConfig
from certvllm.formats.layout import key_scale_lut
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.cuda_pagein import CudaPageInEngine, ensure_device_readable
from certvllm.kv.graph_capture import if_node
from certvllm.kv.pagein import PageInEngine
from certvllm.kv.promotion_cache import PromotionCache
from certvllm.triton_kernels.call_inputs import call_inputs
from certvllm.triton_kernels.common import split_plan
from certvllm.triton_kernels.finalize import TrafficCount, combine_exact, finalize
from certvllm.triton_kernels.phase1 import Phase1Out, phase1
from certvllm.triton_kernels.phase2 import AttendOut, Phase2Geometry, attend, promote
from certvllm.triton_kernels.phase2_glue import global_max, rerun_inputs
from certvllm.triton_kernels.prepare import CallState, prepare
from certvllm.triton_kernels.select import select_blocks
from certvllm.triton_kernels.shape_class import width_class
from certvllm.triton_kernels.tuning import DEFAULT_TUNING, KernelTuning, parse_tuning

Glue = Literal["auto", "torch"]
MAX_GROUP = 15
"""Query heads per KV head the int32 promotion bitmask holds (two bits each)."""
_LUTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class CudaOptions:
    """Test and benchmark hooks of the CUDA path (production uses the defaults).

    Attributes:
        glue: ``auto``: the glue between the heavy passes runs as kernels (``prepare``, ``select``,
            ``finalize``) where the block table fits them, else as their torch references; ``torch``: always
            the references (tests compare the two).
        blocks_per_split: override of the split-K plan.
        tuning: the kernels' tiles, warps, split plan and dialect (``triton_kernels.tuning``).
    """

    glue: Glue = "auto"
    blocks_per_split: int | None = None
    tuning: KernelTuning = DEFAULT_TUNING


DEFAULT_OPTIONS = CudaOptions()


@functools.lru_cache(maxsize=16)
def options_for(kernel_tuning: str) -> CudaOptions:
    """The options a served call runs with: the defaults, with ``CertConfig.kernel_tuning``'s launch parameters."""
    return CudaOptions(tuning=parse_tuning(kernel_tuning)) if kernel_tuning.strip() else DEFAULT_OPTIONS


def _lut(device: torch.device) -> torch.Tensor:
    if device not in _LUTS:
        _LUTS[device] = key_scale_lut().to(device)
    return _LUTS[device]


def mark(timings: dict | None, name: str) -> None:
    """Record a CUDA event named ``name`` in ``timings`` (a no-op when ``timings`` is None)."""
    if timings is not None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        timings.setdefault("_events", []).append((name, ev))


def stage_times(timings: dict) -> dict[str, float]:
    """Milliseconds between consecutive marks (call after synchronising)."""
    evs = timings.get("_events", [])
    return {evs[i][0]: evs[i - 1][1].elapsed_time(evs[i][1]) for i in range(1, len(evs))}


def check_group(num_heads: int, num_kv_heads: int) -> None:
    """The CUDA path's limit on query heads per KV head (raises with the limit)."""
    if num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(
            f"{num_heads // num_kv_heads} query heads per KV head: the CUDA path supports at most {MAX_GROUP} "
            "(int32 promotion bitmask); serve this model with --kv-cache-dtype auto"
        )


def _glue_kernels(options: CudaOptions, num_blocks: int) -> bool:
    """Whether the glue between the heavy passes runs as kernels: ``auto`` glue and a table of ``num_blocks``
    columns in a glue width class (``triton_kernels.shape_class``, what warm-up enumerates)."""
    return options.glue == "auto" and width_class(num_blocks).glue


@dataclass
class _Call:
    """One layer call's tensors on the device, shared by its stages."""

    cache: LayerKVCache
    cfg: CertConfig
    qs: torch.Tensor  # [R, H_q, D] float32 scaled queries
    tables: torch.Tensor  # [R, B] int64
    lens: torch.Tensor  # [R] int64
    nfull: torch.Tensor  # [R] int64
    bvalid: torch.Tensor  # [R, B] bool
    glue_kernels: bool

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        R, Hq, D = self.qs.shape
        K = self.cache.num_kv_heads
        return R, K, Hq // K, self.tables.shape[1], D


@dataclass
class DeviceRerun:
    """Rungs 3/4 on the device: what the exact recompute needs from the main pass."""

    call: _Call
    geo: Phase2Geometry
    p1: Phase1Out
    summary: Phase1Summary
    pool: PromotionCache | None = None
    escalated: torch.Tensor | None = None  # [1] int8 set by finalize (KernelTuning.rerun_if_node), else None

    @property
    def bounds_zeroed(self) -> bool:
        """Whether the report already carries zero bounds on its rung-3/4 heads (``finalize`` writes them so)."""
        return self.call.glue_kernels

    def apply(self, rung: torch.Tensor, out: torch.Tensor, forced: bool = False) -> None:
        """Overwrite ``out`` ``[R, H_q, D]`` on the heads whose ``rung`` ``[R, H_q]`` (int8) is ≥ 3 with exact
        attention over the originals. When none escalated the kernels exit at once (no host synchronisation); in
        a CUDA-graph capture with ``KernelTuning.rerun_if_node`` they are the body of a conditional node on the
        epilogue's escalation flag, which a replay skips when no head escalated (``forced``: the caller raised
        rungs after the epilogue, so the flag may miss heads: the launches stay unconditional). With a
        write-through pool (``PromotionCache.write_through``) the keys it holds under their current generation
        are read from it, the shadow's bytes in VRAM, and only the rest over PCIe."""
        if self.escalated is None or forced:
            self._recompute(rung, out)
            return
        with if_node(self.escalated.view(torch.bool)[0]):
            self._recompute(rung, out)

    def _recompute(self, rung: torch.Tensor, out: torch.Tensor) -> None:
        c, s = self.call, self.summary
        R, K, G, B, D = c.shape
        kslot = None
        if c.glue_kernels:
            held = self.pool.direct_keys() if self.pool is not None else None
            direct = None if held is None else (c.tables, *held[1:], c.cache.num_blocks)
            bits, active_i, canary, kslot = rerun_inputs(rung, c.nfull, K, B, direct)
        else:
            exact = rung >= RUNG_HEAD_DENSE
            active = exact.view(R, K, G).any(dim=-1)
            full = (1 << (2 * G)) - 1
            bits = torch.where(active[:, :, None] & c.bvalid[:, None, :], full, 0).to(torch.int32).contiguous()
            active_i = active.to(torch.int32).contiguous()
            canary = torch.zeros(R, dtype=torch.int32, device=c.qs.device)
        smax, _ = promote(self.geo, c.qs, c.cache.shadow, c.tables, c.nfull, bits, active_i, self.p1.scores,
                          self.p1.m8, self.p1.delta, s.round1.contiguous(), canary, False,
                          None if kslot is None else self.pool.pool, kslot, exact_rerun=True)  # fmt: skip
        m = _global_max(c, smax, s.s_tail)
        exact_lm = torch.empty(R, K, G, c.tables.shape[1], dtype=torch.float32, device=c.qs.device)
        parts = attend(self.geo, self.p1.scores, m, c.cache.shadow, c.cache.pages, c.tables, c.nfull, bits,
                       active_i, exact_lm)  # fmt: skip
        if c.glue_kernels:
            combine_exact(parts, s.s_tail, s.tail_v, m, rung, out)
            return
        exact_out, _, _ = combine(parts.acc.sum(dim=2), parts.den.sum(dim=2), s.s_tail, s.tail_v, m)
        out.copy_(torch.where((rung >= RUNG_HEAD_DENSE).unsqueeze(-1), exact_out, out))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` where its last dimension is contiguous (what ``call_inputs`` reads), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def begin_call(layer_call: LayerCall, glue_kernels, tail_fork: bool = False) -> tuple[_Call, torch.Tensor, object]:
    """What every CUDA layer call starts with: the checks, the call's tensors on the pages' device (scaled
    float32 queries, int64 tables and lengths, full-block counts and masks, in one launch: ``call_inputs``;
    ``glue_kernels(width)`` says whether the glue runs as kernels), and the gather of each row's trailing
    partial block from the shadow, on the side stream where the page-in engine has one (in a graph capture too with
    ``tail_fork``, ``KernelTuning.tail_fork``): ``(call, tail_raw [R, H_kv, 2, N, D], event or None)``."""
    q, cache, pagein = layer_call.q, layer_call.cache, layer_call.pagein
    check_group(q.shape[1], cache.num_kv_heads)
    dev = cache.pages.device
    ensure_device_readable(cache)
    qs, tables, lens, nfull, bvalid, tail_ids = call_inputs(
        _last_dim_contiguous(q.to(dev)), _last_dim_contiguous(layer_call.tables.to(dev)),
        layer_call.lens.to(dev), layer_call.scale, cache.layout.block_size, cache.num_blocks,
    )  # fmt: skip
    call = _Call(cache, layer_call.cfg, qs, tables, lens, nfull, bvalid, glue_kernels(tables.shape[1]))
    if isinstance(pagein, CudaPageInEngine):
        tail_raw, tail_event = pagein.gather_blocks_async(cache, tail_ids, fork_in_capture=tail_fork)
    else:
        tail_raw, tail_event = pagein.gather_blocks(cache, tail_ids.cpu()).to(dev), None
    return call, tail_raw, tail_event


def certified_rows(
    layer_call: LayerCall,
    pool: PromotionCache | None,
    prefetch: tuple | None,
    options: CudaOptions = DEFAULT_OPTIONS,
    timings: dict | None = None,
) -> tuple[torch.Tensor, CertReport, DeviceRerun]:
    """The call's rows over the cache on its device → ``(out [R, H_q, D] float32, report, rerun)``; rungs 3/4
    are left to ``rerun.apply``. ``pool`` is the layer's promotion pool and ``prefetch`` its
    ``(StepPrefetcher, layer index)`` (either may be None). Runs on CPU tensors under ``TRITON_INTERPRET=1``."""
    cache, pagein, generator = layer_call.cache, layer_call.pagein, layer_call.generator
    mark(timings, "start")
    call, tail_raw, tail_event = begin_call(layer_call, lambda width: _glue_kernels(options, width),
                                            bool(options.tuning.tail_fork))  # fmt: skip
    R, K, G, B, D = call.shape
    dev, tables, nfull, lens = call.qs.device, call.tables, call.nfull, call.lens
    splits, bps = split_plan(B, R * K, options.blocks_per_split, tuning=options.tuning)
    p1 = phase1(call.qs, cache.pages, tables, nfull, _lut(dev), cache.layout, K, cache.sub_blocks,
                delta_factor(D), splits, bps, tuning=options.tuning)  # fmt: skip
    mark(timings, "phase1")
    CudaPageInEngine.wait(tail_event)
    if call.glue_kernels:
        summary, state = prepare(call.qs, tail_raw, lens, p1)
    else:
        summary = summarize(call.qs.view(R, K, G, D), tail_raw[:, :, 0], tail_raw[:, :, 1],
                            lens % cache.layout.block_size, p1.nu, p1.eta, p1.amax.amax(dim=-1),
                            p1.rmax.amax(dim=-1), p1.l8)  # fmt: skip
        i32 = dict(dtype=torch.int32, device=dev)
        state = CallState(bits=torch.zeros(R, K, B, **i32), active=torch.ones(R, K, **i32),
                          canary=torch.zeros(R, **i32), page_flags=p1.bad.amax(dim=2),
                          widened=torch.zeros(R, K, G, dtype=torch.bool, device=dev))  # fmt: skip

    bits, widened = _select(call, p1, summary, state, generator, options.tuning)
    mark(timings, "selection")
    splits2, bps2 = split_plan(B, R * K, options.blocks_per_split, tuning=options.tuning, phase2=True)
    geo = Phase2Geometry(cache.layout, K, G, cache.sub_blocks, cache.num_blocks, splits2, bps2,
                         cache.keys_channel_major, tuning=options.tuning)  # fmt: skip
    parts, m, sabs, exact_lm, key_paged = _phase2(call, geo, p1, summary, state, bits, pagein, pool, prefetch,
                                                  timings)  # fmt: skip
    escalated = state.escalated if call.glue_kernels and options.tuning.rerun_if_node else None
    traffic = _traffic(call, state, pagein, key_paged)
    out, report = _finish(call, p1, summary, state, parts, m, sabs, exact_lm, bits, widened, escalated, traffic)
    if traffic is not None and isinstance(pagein, CudaPageInEngine):  # counted by the epilogue
        pagein.add_device_count_vector(traffic.counts)
    mark(timings, "bounds")
    return out, report, DeviceRerun(call, geo, p1, summary, pool, escalated)


def _select(
    call: _Call,
    p1: Phase1Out,
    summary: Phase1Summary,
    state: CallState,
    generator: torch.Generator | None,
    tuning: KernelTuning,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rungs 0–2: the ``[R, K, B]`` int32 promotion bitmask (bit g: keys for query head g, bit G + g: values;
    ``state.bits``, the torch path's own in certified mode) and the ``[R, K, G]`` bool rung-1 flags."""
    cfg = call.cfg
    R, K, G, B, _ = call.shape
    dev = call.qs.device
    valid4 = call.bvalid[:, None, None, :]
    gen = generator if generator is not None and generator.device.type == dev.type else None
    if cfg.mode != "certified":  # nothing promoted, no rung 1: the state as initialised
        return state.bits, state.widened

    def shifts() -> torch.Tensor:
        return torch.arange(G, device=dev, dtype=torch.int32).view(1, 1, G, 1)

    if call.glue_kernels:
        bits, widened = select_blocks(p1.l8, summary.lse, p1.delta, summary.round1, call.nfull, p1.eta, summary.v_max,
                                      cfg.ladder, tuning=tuning, bits=state.bits)  # fmt: skip
        if cfg.exploration_rate > 0:
            draw = torch.rand((R, K, G, B), generator=gen, device=dev)
            bits |= (((draw < cfg.exploration_rate) & valid4).to(torch.int32) << shifts()).sum(dim=2, dtype=torch.int32)
        return bits, widened
    ph1 = Phase1(
        log_mass=p1.l8, mass=torch.exp(p1.l8 - summary.lse.unsqueeze(-1)), delta=p1.delta, rounding=summary.round1,
        valid=valid4, num_full=call.nfull.view(R, 1, 1), v_max=summary.v_max, eta=p1.eta.unsqueeze(2),
    )  # fmt: skip
    key_mask, widened = select_keys(ph1, cfg.model_copy(update={"exploration_rate": 0.0}), None)
    if cfg.exploration_rate > 0:
        draw = torch.rand(key_mask.shape, generator=gen, device=dev)
        key_mask = key_mask | ((draw < cfg.exploration_rate) & valid4)
    value_mask = select_values(ph1, key_mask, cfg)
    sh = shifts()
    bits = ((key_mask.to(torch.int32) << sh) | (value_mask.to(torch.int32) << (sh + G))).sum(dim=2)
    return bits.to(torch.int32).contiguous(), widened


def _phase2(
    call: _Call,
    geo: Phase2Geometry,
    p1: Phase1Out,
    summary: Phase1Summary,
    state: CallState,
    bits: torch.Tensor,
    pagein: PageInEngine,
    pool: PromotionCache | None,
    prefetch: tuple | None,
    timings: dict | None,
) -> tuple[AttendOut, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The promotion pass (keys from the pool, the staging or the shadow; canary into ``state.canary``) and the
    attend pass over every group (``state.active``). Returns ``(parts, m, sabs, exact_lm, key_paged)``: the last
    the 0-dim count of key pages read over PCIe where a pool counted them, else None (the torch glue counts the
    call's traffic here; the kernels' epilogue counts it, ``_traffic``)."""
    cache, cfg = call.cache, call.cfg
    R, K, G, B, D = call.shape
    dev = call.qs.device
    active, canary = state.active, state.canary
    run_canary = cfg.ladder.checks_canary
    kslot = key_paged = stage = None
    if pool is not None:  # hits are read from VRAM, not over PCIe
        need_mask = -1 if run_canary else (1 << G) - 1  # the bits for which the promotion pass reads keys
        kslot, key_paged = pool.lookup(cache, call.tables, call.nfull, bits, need_mask)
        if prefetch is not None:  # pages staged while the previous layers ran
            stage, served = prefetch[0].serve(prefetch[1], call.tables, call.nfull, bits, need_mask, kslot,
                                              pool.slots)  # fmt: skip
            key_paged = key_paged - served
        mark(timings, "pool")
    else:
        prefetch = None
    smax, sabs = promote(geo, call.qs, cache.shadow, call.tables, call.nfull, bits, active, p1.scores, p1.m8,
                         p1.delta, summary.round1.contiguous(), canary, run_canary, None if pool is None else pool.pool,
                         kslot, stage)  # fmt: skip
    if prefetch is not None:
        prefetch[0].after_promote(prefetch[1])
    m = _global_max(call, smax, summary.s_tail)
    exact_lm = torch.empty(R, K, G, B, dtype=torch.float32, device=dev)
    mark(timings, "promote")
    parts = attend(geo, p1.scores, m, cache.shadow, cache.pages, call.tables, call.nfull, bits, active, exact_lm)
    mark(timings, "attend")
    if isinstance(pagein, CudaPageInEngine) and not call.glue_kernels:
        key_bits = (1 << G) - 1
        value_loads = ((bits >> G) != 0).sum()
        paged = key_paged if key_paged is not None else ((bits & _paged_mask(call)) != 0).sum()
        pagein.add_device_counts(((bits & key_bits) != 0).sum(), value_loads, (paged + value_loads) * _page_half(call))
    return parts, m, sabs, exact_lm, key_paged


def _paged_mask(call: _Call) -> int:
    """The bitmask bits whose blocks the promotion pass read keys for: any bit with the canary (it checks the
    value-promoted blocks too), else the key bits."""
    return -1 if call.cfg.ladder.checks_canary else (1 << call.shape[2]) - 1


def _page_half(call: _Call) -> int:
    """Bytes of one 16-token block's keys (or values) in the shadow."""
    cache = call.cache
    return cache.layout.block_size * cache.layout.head_dim * cache.shadow.element_size()


def _traffic(
    call: _Call, state: CallState, pagein: PageInEngine, key_paged: torch.Tensor | None
) -> TrafficCount | None:
    """What the kernels' epilogue counts of the call's promotion traffic for a CUDA page-in engine (its counters,
    zeroed by ``prepare``), or None (the torch glue counted it in ``_phase2``; a host engine counts its own)."""
    if not call.glue_kernels or not isinstance(pagein, CudaPageInEngine) or state.counts is None:
        return None
    return TrafficCount(state.counts, key_paged, _paged_mask(call), _page_half(call))


def _global_max(call: _Call, smax: torch.Tensor, s_tail: torch.Tensor) -> torch.Tensor:
    """The attend pass's ``[R, K, G]`` global maxima: the promotion pass's split maxima and the partial block's."""
    if call.glue_kernels:
        return global_max(smax, s_tail)
    return torch.maximum(smax.amax(dim=-1), s_tail.amax(dim=-1)).contiguous()


def _finish(
    call: _Call,
    p1: Phase1Out,
    summary: Phase1Summary,
    state: CallState,
    parts: AttendOut,
    m: torch.Tensor,
    sabs: torch.Tensor,
    exact_lm: torch.Tensor,
    bits: torch.Tensor,
    widened: torch.Tensor,
    escalated: torch.Tensor | None = None,
    traffic: TrafficCount | None = None,
) -> tuple[torch.Tensor, CertReport]:
    """Output, bounds on the output actually computed, checks and report: one kernel (which also sets
    ``escalated`` and counts ``traffic`` when given), or the torch epilogue."""
    R, K, G, B, D = call.shape
    dev = call.qs.device
    s, canary = summary, state.canary
    if call.glue_kernels:
        done = finalize(parts, s.s_tail, s.tail_v, s.l_tail, m, sabs, s.score_abs1, s.base_round, s.v_max,
                        s.eta_max, bits, p1.l8, exact_lm, p1.delta, call.nfull, call.lens, widened, canary,
                        state.page_flags, call.cfg.ladder, escalated=escalated, traffic=traffic)  # fmt: skip
        return done.out, done.report
    bad_page = state.page_flags.amax(dim=1) > 0  # (R,)
    shifts = torch.arange(G, device=dev, dtype=torch.int32).view(1, 1, G, 1)
    key_mask = ((bits.unsqueeze(2) >> shifts) & 1).bool()
    value_mask = ((bits.unsqueeze(2) >> (shifts + G)) & 1).bool()
    out, den, den_t = combine(parts.acc.sum(dim=2), parts.den.sum(dim=2), s.s_tail, s.tail_v, m)
    # max |s| over phase-2 scores: the INT8 ones (phase 1), the exact ones and the tail; an upper bound of the
    # reference's value, and the exp term grows with it
    score_abs2 = torch.maximum(torch.maximum(s.score_abs1, sabs.amax(dim=-1)), finite_abs_max(s.s_tail, (-1,)))
    measured = Measured(
        value_error_mass=parts.aval.sum(dim=2) / den, tail_mass=parts.atail.sum(dim=2) / den, score_abs2=score_abs2,
        exact_log_mass=exact_lm, exact_tail_log_mass=m + torch.log(den_t), key_mask=key_mask, value_mask=value_mask,
        widened=widened, delta=p1.delta, l8=p1.l8, valid=call.bvalid[:, None, None, :],
        has_tail=(call.lens % call.cache.layout.block_size) > 0, canary=canary > 0, bad_page=bad_page,
    )  # fmt: skip
    return out, certify(measured, s, call.cfg.ladder, call.cache.layout.block_size)
