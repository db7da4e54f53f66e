"""Certified attention on CUDA with the promoted set F taken from what is resident: one pass in the common case.

``decode_pass: resident`` (``CertConfig``). A layer call runs

1. **the resident pass** (``triton_kernels.fused``): every full block scored from its tier-1 page, the blocks
   whose unquantized keys the layer's promotion pool holds (under their current write generation) scored
   exactly, INT4 values, softmax and the bound accumulators, in one kernel over split-K programs; then the
   partial block and the per-head summary (``triton_kernels.prepare``) and the certificate and checks
   (``triton_kernels.finalize``), exactly as after the two-pass pipeline. The certificate holds for any F
   (docs/certification.md §6), so a stale or partial F only loosens a bound, never breaks it.
2. **the top-up**, for the (row, KV head) groups where some query head of the resident pass missed a target:
   rung 3 (rank, boundary or ``bound_tol``), E_key > ``key_tol``·V_max, E_val > ``v_tol``·V_max, or (coverage
   selection) a tail-mass bound ᾱ_T > ``rung1_tail_threshold``. For those groups only: selection from the
   resident pass's per-block terms (``triton_kernels.select``, rungs 1–2), the pool lookup that pages the
   chosen keys in (they are resident at the next step), and the resident pass again with those promotions
   (keys from the pool or zero-copy from the shadow, promoted values zero-copy). Its results replace the
   first pass's for those groups.
3. **rungs 3/4** (:class:`ResidentRerun`): the resident pass with every block of the escalated groups read
   unquantized, i.e. float32 attention over the originals.

Every step is queued on the stream without a host synchronisation: groups that need nothing make the later
kernels exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.attention.call import LayerCall
from certvllm.attention.gpu import DEFAULT_OPTIONS, CudaOptions, _Call, begin_call, mark
from certvllm.bounds import delta_factor, rounding_factor
from certvllm.bounds.report import RUNG_HEAD_DENSE, RUNG_LAYER_DENSE, CertReport
from certvllm.bounds.summary import Phase1Summary
from certvllm.kv.cuda_pagein import CudaPageInEngine
from certvllm.kv.promotion_cache import PromotionCache
from certvllm.triton_kernels.common import split_plan
from certvllm.triton_kernels.finalize import Finalized, combine_exact, finalize
from certvllm.triton_kernels.fused import FusedGeometry, FusedOut, fused_pass
from certvllm.triton_kernels.prepare import prepare
from certvllm.triton_kernels.select import select_blocks


def _pool_args(pool: PromotionCache | None):
    return None if pool is None else (pool.pool, pool.values, pool.tag, pool.tag_gen, pool.generation,
                                      getattr(pool, "slot_of", None))  # fmt: skip


@dataclass
class _Pass:
    """One layer call's shared state between the resident pass, the top-up and the re-run."""

    call: _Call
    geo: FusedGeometry
    pool: PromotionCache | None
    summary: Phase1Summary
    page_flags: torch.Tensor  # [R, K] int32 (prepare's CallState.page_flags)

    def run(self, bits: torch.Tensor | None = None, active: torch.Tensor | None = None, run_canary: bool = True,
            canary: torch.Tensor | None = None, exact_all: bool = False) -> FusedOut:  # fmt: skip
        c = self.call
        D = c.qs.shape[-1]
        return fused_pass(self.geo, c.qs, c.cache.pages, c.cache.shadow, c.tables, c.nfull, delta_factor(D),
                          rounding_factor(D), pool=_pool_args(self.pool), bits=bits, active=active,
                          run_canary=run_canary, canary=canary, exact_all=exact_all)  # fmt: skip

    def certify(self, p: FusedOut, widened: torch.Tensor, canary: torch.Tensor, **kw) -> Finalized:
        """``finalize`` over pass ``p`` (``into``, ``active``, ``need``: its options)."""
        c, s = self.call, self.summary
        return finalize(p, s.s_tail, s.tail_v, s.l_tail, p.msplit, p.sabs, s.score_abs1, s.base_round, s.v_max,
                        s.eta_max, p.fbits, p.l8, p.exact_lm, p.delta, c.nfull, c.lens, widened, canary,
                        self.page_flags, c.cfg.ladder, msplit=p.msplit, **kw)  # fmt: skip


def resident_rows(
    layer_call: LayerCall,
    pool: PromotionCache | None,
    options: CudaOptions = DEFAULT_OPTIONS,
    timings: dict | None = None,
) -> tuple[torch.Tensor, CertReport, ResidentRerun]:
    """The call's rows → ``(out [R, H_q, D] float32, report, rerun)`` (module docstring); rungs 3/4 are left to
    ``rerun.apply``. Runs on CPU tensors under ``TRITON_INTERPRET=1``."""
    cache, cfg, pagein = layer_call.cache, layer_call.cfg, layer_call.pagein
    mark(timings, "start")
    call, tail_raw, tail_event = begin_call(layer_call, lambda width: True)
    R, K, G, B, D = call.shape
    dev, lens = call.qs.device, call.lens
    splits, bps = split_plan(B, R * K, options.blocks_per_split, tuning=options.tuning)
    geo = FusedGeometry(cache.layout, K, G, cache.sub_blocks, cache.num_blocks, splits, bps,
                        cache.keys_channel_major, gluon_warps=options.tuning.resident_warps,
                        gluon_maxnreg=options.tuning.resident_maxnreg, dialect=options.tuning.dialect)  # fmt: skip
    certified = cfg.mode == "certified"
    run_canary = cfg.ladder.checks_canary
    state = _Pass(call, geo, pool if certified else None, None, None)  # type: ignore[arg-type]
    first = state.run(run_canary=run_canary)
    mark(timings, "resident")
    CudaPageInEngine.wait(tail_event)
    state.summary, prepared = prepare(call.qs, tail_raw, lens, first)
    state.page_flags = prepared.page_flags
    no_widen = torch.zeros(R, K, G, dtype=torch.bool, device=dev)
    top_up = certified and cfg.ladder.forced_rung == 0
    need = torch.zeros(R, K, dtype=torch.int32, device=dev) if top_up else None
    done = state.certify(first, no_widen, first.canary, need=need)
    mark(timings, "certify")
    fbits, paged = None, torch.zeros((), dtype=torch.int64, device=dev)
    if need is not None:
        fbits, paged = _top_up(state, first, done, need, layer_call.generator)
        mark(timings, "top_up")
    else:
        fbits = _read_exactly(first.fbits, None, None)
    out, report = done.out, done.report
    if isinstance(pagein, CudaPageInEngine):
        values = ((fbits >> G) != 0).sum()
        page_half = cache.layout.block_size * D * cache.shadow.element_size()
        pagein.add_device_counts(((fbits & ((1 << G) - 1)) != 0).sum(), values, (paged + values) * page_half)
    return out, report, ResidentRerun(state)


def _top_up(
    state: _Pass, first: FusedOut, done: Finalized, need: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 of the module docstring for the groups ``need`` ``[R, K]`` int32 marks (kernels exit at once for the
    others): their results are written over the first pass's in ``done``.

    Returns ``(fbits, paged)``: the ``[R, K, B]`` bitmask of what the call's output read exactly and the 0-dim
    count of key pages read over PCIe (pool fills and pages left to the shadow)."""
    call, cfg, s = state.call, state.call.cfg, state.summary
    R, K, G, B, _ = call.shape
    dev = call.qs.device
    bits, widened = select_blocks(first.l8, s.lse, first.delta, s.round1, call.nfull, first.eta, s.v_max, cfg.ladder,
                                  active=need)  # fmt: skip
    if cfg.exploration_rate > 0:
        gen = generator if generator is not None and generator.device.type == dev.type else None
        draw = torch.rand((R, K, G, B), generator=gen, device=dev)
        shifts = torch.arange(G, device=dev, dtype=torch.int32).view(1, 1, G, 1)
        explore = (draw < cfg.exploration_rate) & call.bvalid[:, None, None, :] & (need != 0)[:, :, None, None]
        bits |= (explore.to(torch.int32) << shifts).sum(dim=2, dtype=torch.int32)
    # a group whose selection the first pass already read exactly would get the first pass's results again:
    # no second pass for it (in the steady state of a warm pool this is every group that cannot meet a target)
    need = need * ((bits & ~first.fbits) != 0).any(dim=-1).to(need.dtype)
    bits = bits * need.unsqueeze(-1)
    keys = (1 << G) - 1
    if state.pool is not None:
        # page the chosen keys in (served from the pool from this call on); the pages the first pass read are
        # looked up too, which pins them: this call's fills never evict what the call reads
        _, paged = state.pool.lookup(call.cache, call.tables, call.nfull, bits | (first.fbits & keys), keys)
    else:
        paged = ((bits & keys) != 0).sum()
    # the second pass adds its canary findings to the first's flags (one row flag for both passes)
    second = state.run(bits=bits, active=need, run_canary=cfg.ladder.checks_canary, canary=first.canary)
    state.certify(second, widened.view(R, K, G), first.canary, into=done, active=need)
    row_canary = (first.canary > 0).view(R, 1)  # a canary failure sends every head of its row to rung 4
    done.report.canary_fail.logical_or_(row_canary)
    done.report.rung.masked_fill_(row_canary, RUNG_LAYER_DENSE)
    return _read_exactly(first.fbits, second.fbits, need != 0), paged


def _read_exactly(first: torch.Tensor, second: torch.Tensor | None, need: torch.Tensor | None) -> torch.Tensor:
    """The call's ``[R, K, B]`` bitmask of what its output read unquantized (bit g keys of query head g, bit
    G + g its values): the top-up pass's where it ran, else the first pass's. (``testing.run_with_exact`` reads
    the selection here.)"""
    if second is None:
        return first
    return torch.where(need.unsqueeze(-1), second, first)


@dataclass
class ResidentRerun:
    """Rungs 3/4 of a resident call: the escalated groups' heads recomputed over the originals."""

    state: _Pass

    bounds_zeroed = False
    """The report's rung-3/4 heads may keep bounds (a canary failure raises a row to rung 4 after ``finalize``)."""

    def apply(self, rung: torch.Tensor, out: torch.Tensor, forced: bool = False) -> None:
        """Overwrite ``out`` ``[R, H_q, D]`` on the heads whose ``rung`` ``[R, H_q]`` is ≥ 3 with float32 attention
        over the originals (every block read unquantized). No host synchronisation. (``forced``: as
        ``gpu.DeviceRerun.apply``'s; this re-run is never conditional.)"""
        call, s = self.state.call, self.state.summary
        R, K, G, _, _ = call.shape
        active = (rung >= RUNG_HEAD_DENSE).view(R, K, G).any(dim=-1).to(torch.int32)
        p = self.state.run(active=active, run_canary=False, exact_all=True)
        combine_exact(p, s.s_tail, s.tail_v, p.msplit, rung, out, msplit=p.msplit)
