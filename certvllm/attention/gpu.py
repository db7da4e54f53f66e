"""Certified attention on CUDA: Triton kernels for every pass, and no host synchronisation between them.

Same algorithm, same certificate and same report as :func:`certvllm.attention.paged._certified_rows`
(read that first); what differs is where each step runs:

1. trailing partial block: gathered zero-copy from the pinned shadow (``CudaPageInEngine``, side stream),
   overlapping phase 1;
2. phase 1 (``triton_kernels.phase1``): INT8 scores, ℓ⁸_b, Δ_b, R_b, η_b, ν_b, page flags — split-K;
3. ``triton_kernels.prepare``: the partial block's exact scores, rounding and norms, and the per-block
   reductions (V_max, η_max, max|s|, R, lse);
4. selection (``triton_kernels.select``: top-K*, rung 1, rung 2 into the promotion bitmask; exploration
   draws on the device);
5. phase 2 (``triton_kernels.phase2``): promotion pass (exact scores of promoted blocks read zero-copy
   from the shadow, or from the device-resident promotion cache ``certvllm.kv.promotion_cache`` when the
   config enables it and the page is there under its current write generation, or from the step
   prefetch's staging ``certvllm.kv.prefetch`` when the engine registered the layer; canary), then one
   attend pass mixing unquantized and INT8/INT4 blocks with float64 accumulation across blocks and
   splits, plus the bound accumulators;
6. ``triton_kernels.finalize``: the output, the bounds (``certvllm.bounds``' formulas), the rank and
   boundary checks and the report;
7. rungs 3/4: ``fallback="sdpa"`` (default) recomputes escalated rows with ``dense_fn`` (default
   ``dense_paged``: ``dense_decode`` over the originals, so bit-identical to it; its kernel is torch SDPA
   unless ``CERTVLLM_DENSE_BACKEND`` selects xformers, ``certvllm.attention.dense_backend``), which needs the
   row list on the host: one synchronisation at the end of the layer call. ``fallback="device"`` instead
   re-runs the phase-2 kernels with every block of the escalated (row, KV head) groups unquantized:
   exact float32 attention over the originals with the reference's summation structure, and the whole
   call stays free of host synchronisation (CUDA-graph capturable).

Steps 3, 4 and 6 have torch references in this module (``CERTVLLM_TORCH_GLUE=1``, and automatically for
block tables wider than the kernels take): ``selection.select_keys``/``select_values``,
``checks.rank_and_boundary`` and the code in ``_certified_rows`` / ``_epilogue_torch``.

The number of blocks per row is taken from the block table's width, never from the lengths, so the host
does not need to read ``seq_lens``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from certvllm.attention.checks import rank_and_boundary
from certvllm.attention.dense import dense_paged
from certvllm.attention.paged import finite_abs_max, validate_shapes
from certvllm.attention.report import (
    RUNG_HEAD_DENSE,
    RUNG_LAYER_DENSE,
    RUNG_VALUES,
    RUNG_WIDEN,
    CertifiedOutput,
    CertReport,
)
from certvllm.attention.selection import VALUE_BUDGET_MARGIN, Phase1, select_keys, select_values
from certvllm.bounds import (
    alpha_inflation,
    delta_factor,
    exp_rounding,
    key_bound,
    key_sum_bound,
    rounding_factor,
    score_rounding,
    tail_mass_upper,
    value_bound,
)
from certvllm.config import CertConfig
from certvllm.formats.layout import key_scale_lut
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.cuda_pagein import CudaPageInEngine, ensure_device_readable
from certvllm.kv.pagein import PageInEngine
from certvllm.kv.promotion_cache import PromotionCache
from certvllm.triton_kernels.common import split_plan
from certvllm.triton_kernels.finalize import combine_exact, finalize
from certvllm.triton_kernels.finalize import supported as finalize_supported
from certvllm.triton_kernels.phase1 import phase1
from certvllm.triton_kernels.phase2 import Phase2Geometry, attend, promote
from certvllm.triton_kernels.prepare import prepare
from certvllm.triton_kernels.prepare import supported as prepare_supported
from certvllm.triton_kernels.select import select_blocks
from certvllm.triton_kernels.select import supported as select_supported

NEG_INF = float("-inf")
DenseFn = Callable[[list[int]], torch.Tensor]
FALLBACKS = ("sdpa", "device")
_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    if device not in _LUTS:
        _LUTS[device] = key_scale_lut().to(device)
    return _LUTS[device]


def _mark(timings: dict[str, list] | None, name: str) -> None:
    if timings is not None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        timings.setdefault("_events", []).append((name, ev))


def stage_times(timings: dict) -> dict[str, float]:
    """Milliseconds between consecutive marks recorded by ``certified_attention_gpu(timings=...)``
    (call after synchronising)."""
    evs = timings.get("_events", [])
    return {evs[i][0]: evs[i - 1][1].elapsed_time(evs[i][1]) for i in range(1, len(evs))}


def _validate(q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Shape checks only: value checks (lengths ≥ 1, enough columns) would read device memory."""
    validate_shapes(q, cache, block_tables, seq_lens)
    if 2 * (q.shape[1] // cache.num_kv_heads) > 31:
        raise ValueError("the CUDA path supports at most 15 query heads per KV head (int32 promotion bitmask)")


def certified_attention_gpu(
    q: torch.Tensor,
    cache: LayerKVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    config: CertConfig,
    scale: float | None = None,
    pagein: PageInEngine | None = None,
    generator: torch.Generator | None = None,
    dense_fn: DenseFn | None = None,
    *,
    fallback: str | None = None,
    blocks_per_split: int | None = None,
    timings: dict | None = None,
) -> CertifiedOutput:
    """Certified attention for a batch of rows over one layer's paged cache, on the pages' device.

    Arguments and result as :func:`certvllm.attention.paged.certified_attention` (which dispatches
    here when the pages are on CUDA), plus:

    Args:
        fallback: ``"sdpa"`` or ``"device"`` (see the module docstring); default from the environment
            variable ``CERTVLLM_GPU_FALLBACK``, else ``"sdpa"``. A given ``dense_fn`` always takes the
            ``"sdpa"`` route, since it needs the row list.
        blocks_per_split: override the split-K plan (tests).
        timings: if a dict, CUDA events are recorded at stage boundaries (read with :func:`stage_times`).

    Runs on CPU tensors too when ``TRITON_INTERPRET=1`` (how the test-suite checks it without a GPU).
    """
    _validate(q, cache, block_tables, seq_lens)
    dev = cache.pages.device
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    fallback = fallback or os.environ.get("CERTVLLM_GPU_FALLBACK", "sdpa")
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback={fallback!r}: choose one of {FALLBACKS}")
    if pagein is None:
        pagein = CudaPageInEngine(dev)
    ensure_device_readable(cache)
    R, Hq, D = q.shape
    if config.mode == "dense":
        report = CertReport.zeros(R, Hq, dev)
        report.rung.fill_(RUNG_LAYER_DENSE)
        fn = dense_fn or _default_dense(q, cache, block_tables, seq_lens, scale, pagein)
        return CertifiedOutput(fn(list(range(R))).float().to(dev), report)

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the rounding terms assume full float32 products
    try:
        out, report, ctx = _certified_rows(q, cache, block_tables, seq_lens, config, scale, pagein, generator,
                                           blocks_per_split, timings)  # fmt: skip
        exact = report.rung >= RUNG_HEAD_DENSE  # their bounds are already 0
        if dense_fn is not None or fallback == "sdpa":
            rows = exact.any(dim=1).nonzero().flatten().tolist()  # the one synchronisation (end of the call)
            if rows:
                fn = dense_fn or _default_dense(q, cache, block_tables, seq_lens, scale, pagein)
                dense = fn(rows).float().to(dev)
                idx = torch.tensor(rows, device=dev)
                out[idx] = torch.where(exact[idx].unsqueeze(-1), dense, out[idx])
        else:
            _exact_rerun(ctx, exact, report.rung, out)
        _mark(timings, "fallback")
    finally:
        torch.set_float32_matmul_precision(previous)
    return CertifiedOutput(out, report)


def _default_dense(q, cache, block_tables, seq_lens, scale, pagein) -> DenseFn:
    lens = seq_lens.tolist()
    tables = block_tables.to(cache.pages.device, torch.int64)
    return lambda rows: dense_paged(q.to(cache.pages.device), cache, tables, lens, rows, scale, pagein)


class _Ctx:
    """What the device fallback re-run needs from the main pass."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def _certified_rows(q, cache, block_tables, seq_lens, cfg, scale, pagein, generator, blocks_per_split, timings):
    R, Hq, D = q.shape
    K = cache.num_kv_heads
    G = Hq // K
    N = cache.layout.block_size
    dev = cache.pages.device
    certified = cfg.mode == "certified"
    _mark(timings, "start")

    lens = seq_lens.to(dev, torch.int64)
    tables = block_tables.to(dev, torch.int64).contiguous()
    B = tables.shape[1]
    nfull = lens // N
    ntail = lens % N
    qs = (q.to(dev).float() * scale).contiguous()  # fl(q·λ), as the reference
    qs4 = qs.view(R, K, G, D)

    # ---- trailing partial block: zero-copy gather on the side stream, overlapping phase 1
    tail_ids = tables.gather(1, nfull.clamp(max=B - 1).unsqueeze(1)).squeeze(1).clamp(0, cache.num_blocks - 1)
    if isinstance(pagein, CudaPageInEngine):
        tail_raw, tail_event = pagein.gather_blocks_async(cache, tail_ids)
    else:
        tail_raw, tail_event = pagein.gather_blocks(cache, tail_ids.cpu()).to(dev), None

    # ---- phase 1
    splits, bps = split_plan(B, R * K, blocks_per_split)
    p1 = phase1(qs, cache.pages, tables, nfull, _lut(dev), cache.layout, K, cache.sub_blocks,
                delta_factor(D), rounding_factor(D), splits, bps)  # fmt: skip
    _mark(timings, "phase1")

    CudaPageInEngine.wait(tail_event)
    bvalid = torch.arange(B, device=dev) < nfull.unsqueeze(1)  # (R, B)
    valid4 = bvalid[:, None, None, :]
    l8 = p1.l8
    eta = p1.eta.unsqueeze(2)  # (R, K, 1, B)
    bad_page = p1.bad.amax(dim=(1, 2)) > 0  # (R,)
    has_tail = ntail > 0
    if _fused(B):  # the partial block and the per-block reductions in one kernel
        pre = prepare(qs, tail_raw, lens, p1)
        s_tail, tail_v, l_tail, lse = pre.s_tail, pre.tail_v, pre.l_tail, pre.lse.unsqueeze(-1)
        v_max, eta_max, score_abs1, base_round, round1 = (pre.v_max, pre.eta_max, pre.score_abs1, pre.base_round,
                                                          pre.round1)  # fmt: skip
    else:  # the reference of triton_kernels.prepare
        tok_valid = torch.arange(N, device=dev) < ntail.unsqueeze(1)  # (R, N)
        live = tok_valid[:, None, :, None]
        tail_k = torch.where(live, tail_raw[:, :, 0].float(), 0.0)
        tail_v = torch.where(live, tail_raw[:, :, 1].float(), 0.0)
        s_tail = torch.einsum("rkgd,rknd->rkgn", qs4, tail_k).masked_fill(~tok_valid[:, None, None, :], NEG_INF)
        tail_round = score_rounding(qs4.abs(), tail_k.abs().amax(dim=2).unsqueeze(1)).squeeze(-1)  # (R, K, G)
        tail_vnorm = (torch.linalg.vector_norm(tail_v.double(), dim=-1).amax(dim=-1) * (1 + 2.0**-20)).float()
        v_max = torch.maximum(p1.nu.amax(dim=-1), tail_vnorm).unsqueeze(-1)  # (R, K, 1)
        eta_max = eta.amax(dim=-1)
        score_abs1 = torch.maximum(p1.amax.amax(dim=-1), finite_abs_max(s_tail, (-1,)))
        base_round = torch.maximum(p1.rmax.amax(dim=-1), tail_round)
        round1 = base_round + exp_rounding(score_abs1)
        l_tail = torch.logsumexp(s_tail, dim=-1)
        lse = torch.logsumexp(torch.cat((l8, l_tail.unsqueeze(-1)), dim=-1), dim=-1, keepdim=True)

    # ---- selection (rungs 1 and 2), on the device: one kernel, or the torch reference
    shifts = torch.arange(G, device=dev, dtype=torch.int32).view(1, 1, G, 1)
    if certified and _fused(B):
        budget = (cfg.v_tol * v_max.squeeze(-1)) / VALUE_BUDGET_MARGIN
        bits, widened = select_blocks(l8, lse.squeeze(-1), p1.delta, round1, nfull, p1.eta, budget, cfg)
        if cfg.exploration_rate > 0:
            draw = torch.rand((R, K, G, B), generator=generator if _on(generator, dev) else None, device=dev)
            bits |= (((draw < cfg.exploration_rate) & valid4).to(torch.int32) << shifts).sum(dim=2, dtype=torch.int32)
    else:
        if certified:
            ph1 = Phase1(
                log_mass=l8, mass=torch.exp(l8 - lse), delta=p1.delta, rounding=round1, valid=valid4,
                num_full=nfull.view(R, 1, 1), v_max=v_max, eta=eta,
            )  # fmt: skip
            key_mask, widened = select_keys(ph1, cfg.model_copy(update={"exploration_rate": 0.0}), None)
            if cfg.exploration_rate > 0:
                draw = torch.rand(key_mask.shape, generator=generator if _on(generator, dev) else None, device=dev)
                key_mask = key_mask | ((draw < cfg.exploration_rate) & valid4)
            value_mask = select_values(ph1, key_mask, cfg)
        else:
            key_mask = torch.zeros(R, K, G, B, dtype=torch.bool, device=dev)
            value_mask = key_mask
            widened = key_mask[..., 0]
        bits = ((key_mask.to(torch.int32) << shifts) | (value_mask.to(torch.int32) << (shifts + G))).sum(dim=2)
        bits = bits.to(torch.int32).contiguous()  # (R, K, B)
    _mark(timings, "selection")

    # ---- phase 2: promotion pass (zero-copy keys, canary), global max, attend pass
    geo = Phase2Geometry(cache.layout, K, G, cache.sub_blocks, cache.num_blocks, splits, bps, cache.keys_channel_major)
    shadow = cache.shadow
    active = torch.ones(R, K, dtype=torch.int32, device=dev)
    canary = torch.zeros(R, dtype=torch.int32, device=dev)
    run_canary = certified and cfg.canary
    pcache = PromotionCache.for_call(cache, cfg)
    pool = kslot = key_paged = stage = None
    prefetch = cache.prefetch if pcache is not None else None
    if pcache is not None:  # device-resident promotion cache: hits are read from VRAM, not over PCIe
        need_mask = -1 if run_canary else (1 << G) - 1  # the bits for which the promotion pass reads keys
        kslot, key_paged = pcache.lookup(cache, tables, nfull, bits, need_mask)
        pool = pcache.pool
        if prefetch is not None:  # step prefetch: pages staged while the previous layers ran
            stage, served = prefetch[0].serve(prefetch[1], tables, nfull, bits, need_mask, kslot, pcache.slots)
            key_paged = key_paged - served
        _mark(timings, "pool")
    smax, sabs = promote(geo, qs, shadow, tables, nfull, bits, active, p1.scores, p1.m8, p1.delta,
                         round1.contiguous(), canary, run_canary, pool, kslot, stage)  # fmt: skip
    if prefetch is not None:
        prefetch[0].after_promote(prefetch[1])
    m = torch.maximum(smax.amax(dim=-1), s_tail.amax(dim=-1)).contiguous()  # (R, K, G)
    exact_lm = torch.empty(R, K, G, B, dtype=torch.float32, device=dev)
    _mark(timings, "promote")
    parts = attend(geo, p1.scores, m, shadow, cache.pages, tables, nfull, bits, active, exact_lm)
    _mark(timings, "attend")
    if isinstance(pagein, CudaPageInEngine):
        key_bits = (1 << G) - 1
        value_loads = (bits >> G) != 0
        page_half = N * D * cache.shadow.element_size()
        if key_paged is None:
            key_reads = ((bits != 0) if run_canary else ((bits & key_bits) != 0)).sum()
        else:
            key_reads = key_paged  # pool hits cross no PCIe
        pagein.add_device_counts(((bits & key_bits) != 0).sum(), value_loads.sum(),
                                 (key_reads + value_loads.sum()) * page_half)  # fmt: skip

    # ---- output, bounds on the output actually computed, checks and report: one kernel, or torch
    if _fused(B):
        out, report = finalize(parts, s_tail, tail_v, l_tail, m, sabs, score_abs1, base_round, v_max, eta_max, bits,
                               l8, exact_lm, p1.delta, nfull, lens, widened, canary, bad_page, cfg)  # fmt: skip
    else:
        out, report = _epilogue_torch(
            parts, s_tail, tail_v, l_tail, m, sabs, score_abs1, base_round, v_max, eta_max, bits, l8, exact_lm,
            p1.delta, bvalid, has_tail, widened, canary, bad_page, cfg,
        )  # fmt: skip
    _mark(timings, "bounds")
    ctx = _Ctx(geo=geo, qs=qs, shadow=shadow, tables=tables, nfull=nfull, bvalid=bvalid, scores=p1.scores,
               m8=p1.m8, delta=p1.delta, round1=round1, pages=cache.pages, s_tail=s_tail, tail_v=tail_v,
               shape=(R, K, G, B, D))  # fmt: skip
    return out, report, ctx


def _fused(num_blocks: int) -> bool:
    """Whether the glue between the heavy passes runs as kernels (``triton_kernels.prepare``, ``select``,
    ``finalize``: ~10 launches) or as their torch references (~250 launches): the kernels unless
    ``CERTVLLM_TORCH_GLUE=1`` or the block table is wider than they hold."""
    return os.environ.get("CERTVLLM_TORCH_GLUE", "0") != "1" and all(
        ok(num_blocks) for ok in (prepare_supported, select_supported, finalize_supported)
    )


def _epilogue_torch(parts, s_tail, tail_v, l_tail, m, sabs, score_abs1, base_round, v_max, eta_max, bits, l8, exact_lm,
                    delta, bvalid, has_tail, widened, canary, bad_page, cfg):  # fmt: skip
    """The reference of ``triton_kernels.finalize`` (``CERTVLLM_TORCH_GLUE=1``): combine the attend parts
    with the partial block, bound the output actually computed, run the checks and fill the report."""
    R, K, G, B = l8.shape
    D = tail_v.shape[-1]
    Hq = K * G
    N = s_tail.shape[-1]
    dev = l8.device
    certified = cfg.mode == "certified"
    valid4 = bvalid[:, None, None, :]
    shifts = torch.arange(G, device=dev, dtype=torch.int32).view(1, 1, G, 1)
    key_mask = ((bits.unsqueeze(2) >> shifts) & 1).bool()
    value_mask = ((bits.unsqueeze(2) >> (shifts + G)) & 1).bool()
    w_tail = torch.exp(s_tail - m.unsqueeze(-1))
    den_t = w_tail.sum(dim=-1)
    num = parts.acc.sum(dim=2) + torch.einsum("rkgn,rknd->rkgd", w_tail, tail_v).double()
    den = parts.den.sum(dim=2) + den_t.double()
    out = (num / den.unsqueeze(-1)).float().reshape(R, Hq, D)

    # ---- bounds on the output actually computed
    e_val = value_bound((parts.aval.sum(dim=2) / den).unsqueeze(-1), torch.ones_like(den).unsqueeze(-1), N)
    in_tail = valid4 & ~key_mask
    alpha = ((parts.atail.sum(dim=2) / den) * alpha_inflation(N)).float()
    delta_tail = torch.where(in_tail, delta, 0.0).amax(dim=-1)
    # max |s| over phase-2 scores: the INT8 ones (phase 1), the exact ones and the tail; an upper bound
    # of the reference's value, and the exp term grows with it
    score_abs2 = torch.maximum(torch.maximum(score_abs1, sabs.amax(dim=-1)), finite_abs_max(s_tail, (-1,)))
    round2 = base_round + exp_rounding(score_abs2)
    alpha_up = tail_mass_upper(alpha, delta_tail, round2)
    e_key, e_round = key_bound(v_max, key_sum_bound(alpha_up, delta_tail, round2), eta_max, N)

    # ---- checks and report
    report = CertReport.zeros(R, Hq, dev)
    flat = lambda x: x.reshape(R, Hq)  # noqa: E731
    if certified and cfg.rank_check:
        exact_all = torch.cat((exact_lm, (m + torch.log(den_t)).unsqueeze(-1)), -1)
        int8_lm = torch.cat((l8, l_tail.unsqueeze(-1)), dim=-1)
        tail_col = has_tail[:, None, None, None]
        in_f = torch.cat((key_mask, tail_col.expand(R, K, G, 1)), dim=-1)
        rank_fail, boundary_fail = rank_and_boundary(
            int8_lm, exact_all, in_f, torch.cat((valid4, tail_col), dim=-1),
            torch.cat((delta, torch.zeros_like(delta[..., :1])), dim=-1), round2, cfg.rank_depth, cfg.eps_guard,
        )  # fmt: skip
        report.rank_fail = flat(rank_fail)
        report.boundary_fail = flat(boundary_fail)
    v_max_h = v_max.expand(R, K, G)
    bound = e_key + e_val
    bound_fail = ~(bound <= cfg.bound_tol * v_max_h) | ~torch.isfinite(bound)
    precondition = bad_page.view(R, 1).expand(R, Hq)
    report.e_key, report.e_val, report.e_round = flat(e_key), flat(e_val), flat(e_round.expand(R, K, G)).contiguous()
    report.k_star = flat(key_mask.sum(dim=-1).to(torch.int32))
    report.v_promoted = flat(value_mask.sum(dim=-1).to(torch.int32))
    report.v_max = flat(v_max_h).contiguous()
    report.delta_tail = flat(delta_tail)
    report.alpha_tail = flat(alpha_up)
    report.precondition = precondition.clone()
    rung = torch.zeros(R, Hq, dtype=torch.int8, device=dev)
    rung = torch.where(flat(widened), RUNG_WIDEN, rung)
    rung = torch.where(report.v_promoted > 0, RUNG_VALUES, rung)
    if certified:
        report.bound_fail = flat(bound_fail)
        report.canary_fail = (canary > 0).view(R, 1).expand(R, Hq).clone()
        head_dense = report.rank_fail | report.boundary_fail | report.bound_fail
        rung = torch.where(head_dense, RUNG_HEAD_DENSE, rung)
        rung = torch.where(report.canary_fail | precondition, RUNG_LAYER_DENSE, rung)
        if cfg.force_fallback != "none":
            rung.fill_(RUNG_HEAD_DENSE if cfg.force_fallback == "head" else RUNG_LAYER_DENSE)
    else:
        unbounded = precondition | ~torch.isfinite(report.bound)
        report.e_key = torch.where(unbounded, float("inf"), report.e_key)
    report.rung = rung.to(torch.int8)
    exact = report.rung >= RUNG_HEAD_DENSE  # recomputed exactly: no error to bound
    for t in (report.e_key, report.e_val, report.e_round):
        t.masked_fill_(exact, 0.0)
    return out, report


def _on(generator: torch.Generator | None, dev: torch.device) -> bool:
    return generator is not None and generator.device.type == dev.type


def _exact_rerun(ctx: _Ctx, exact: torch.Tensor, rung: torch.Tensor, out: torch.Tensor) -> None:
    """Rungs 3/4 on the device: phase 2 again with every block of the escalated (row, KV head) groups read
    unquantized (keys and values); ``out`` ``[R, H_q, D]`` is overwritten on the escalated heads. When none
    escalated the kernels exit at once (the call stays free of host synchronisation)."""
    R, K, G, B, D = ctx.shape
    dev = ctx.qs.device
    active = exact.view(R, K, G).any(dim=-1)
    full = (1 << (2 * G)) - 1
    bits = torch.where(active[:, :, None] & ctx.bvalid[:, None, :], full, 0).to(torch.int32).contiguous()
    active_i = active.to(torch.int32).contiguous()
    canary = torch.zeros(R, dtype=torch.int32, device=dev)
    smax, _ = promote(ctx.geo, ctx.qs, ctx.shadow, ctx.tables, ctx.nfull, bits, active_i, ctx.scores, ctx.m8,
                      ctx.delta, ctx.round1.contiguous(), canary, False)  # fmt: skip
    m = torch.maximum(smax.amax(dim=-1), ctx.s_tail.amax(dim=-1)).contiguous()
    exact_lm = torch.empty(R, K, G, B, dtype=torch.float32, device=dev)
    parts = attend(ctx.geo, ctx.scores, m, ctx.shadow, ctx.pages, ctx.tables, ctx.nfull, bits, active_i, exact_lm)
    if _fused(B):
        combine_exact(parts, ctx.s_tail, ctx.tail_v, m, rung, out)
        return
    w_tail = torch.exp(ctx.s_tail - m.unsqueeze(-1))
    num = parts.acc.sum(dim=2) + torch.einsum("rkgn,rknd->rkgd", w_tail, ctx.tail_v).double()
    den = parts.den.sum(dim=2) + w_tail.sum(dim=-1).double()
    exact_out = (num / den.unsqueeze(-1)).float().reshape(R, K * G, D)
    out.copy_(torch.where(exact.unsqueeze(-1), exact_out, out))
