"""Between phase 1 and selection, in one kernel: score the trailing partial block exactly, and reduce the
phase-1 per-block terms to what selection, phase 2 and the certificate need, for every (row, KV head,
query head).

The same values as its torch reference, ``certvllm.attention.epilogue.summarize``
(:class:`~certvllm.bounds.summary.Phase1Summary`):

* s_tail = ⟨q·λ, k_t⟩ over the partial block's live tokens (−inf elsewhere), float32 D-term sums;
* the partial block's score rounding (``bounds.score_rounding`` with the per-channel max |k|) and its
  largest value norm (float64, rounded up by 2^-20, as ``tail_vnorm``);
* V_max = max(max_b ν_b, tail norm), η_max, max |s| (phase 1 and tail), R without and with the exp term
  (``bounds.exp_rounding``), ℓ_tail = logsumexp(s_tail) and lse = logsumexp(ℓ⁸ ∪ ℓ_tail) with torch's
  convention (an infinite max is replaced by 0 before the shift);
* the partial block's values as float32 (0 past its tokens) for the output combination.

It also initialises the per-call device state of the passes after it (:class:`CallState`), so that they need no
fill or reduction launches of their own: the promotion bitmask zeroed (selection ORs into it), every group active,
the rows' canary flags zeroed (the promotion pass sets them), phase 1's page flags reduced per (row, KV head), and
the flags and counters the epilogue sets zeroed.

Maxima propagate NaN as torch's ``amax`` does; sums over D and over blocks are in another order than the
reference's (any order is covered by γ_n, docs/certification.md §5); compiled without FMA contraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from certvllm.bounds.summary import Phase1Summary
from certvllm.bounds.terms import exp_factors, rounding_factor

from .common import GLUE_MAX_BLOCKS, exp_f32, head_program, launch_device_ok, log_f32, max_nan, next_pow2, precise
from .shape_class import JIT_OPTIONS, width_class

MAX_BLOCKS = GLUE_MAX_BLOCKS


def supported(num_blocks: int) -> bool:
    return num_blocks >= 1 and width_class(num_blocks).glue


@triton.jit(**JIT_OPTIONS)
def _prepare_kernel(
    qs,  # [R, H·G, D] float32 scaled queries
    tail_raw,  # [R, H, 2, N, D] originals of the partial block (float16/bfloat16)
    lens,  # [R] int64
    l8,  # [R, H, G, B] float32
    eta,  # [R, H, B] float32
    nu,  # [R, H, B] float32
    rmax,  # [R, H, G, B] float32
    amax,  # [R, H, G, B] float32
    s_tail,  # out [R, H, G, N]
    tail_v,  # out [R, H, N, D] (written by the g = 0 program)
    l_tail,  # out [R, H, G]
    lse,  # out [R, H, G]
    score_abs1,  # out [R, H, G]
    base_round,  # out [R, H, G]
    round1,  # out [R, H, G]
    v_max,  # out [R, H] (g = 0)
    eta_max,  # out [R, H] (g = 0)
    bad,  # [R, H, B] int32 phase 1's page flags
    page_flags,  # out [R, H] int32: max of the group's page flags (g = 0)
    bits,  # out [R, H, B] int32 zeroed (g = 0)
    active,  # out [R, H] int32 ones (g = 0)
    canary,  # out [R] int32 zeroed (h = g = 0)
    widened,  # out [R, H, G] int8 zeroed
    escalated,  # out [1] int8 zeroed (pid = 0)
    counts,  # out [3] int64 zeroed (pid = 0)
    B,
    RF,  # rounding_factor(D)
    C1,  # exp_rounding: |s|·C1 + C0
    C0,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BP: tl.constexpr,
    PRECISE: tl.constexpr,
):
    N: tl.constexpr = 16
    pid, rk, g, r = head_program(G, H)
    dd = tl.arange(0, DP)
    nn = tl.arange(0, N)
    pos = tl.arange(0, BP)
    live = nn < (tl.load(lens + r) % N)  # [N]
    m2 = live[:, None] & (dd[None, :] < D)
    kv = tail_raw + rk * (2 * N * D) + nn[:, None] * D + dd[None, :]
    tk = tl.load(kv, mask=m2, other=0.0).to(tl.float32)  # [N, DP]
    tv = tl.load(kv + N * D, mask=m2, other=0.0).to(tl.float32)
    q = tl.load(qs + pid * D + dd, mask=dd < D, other=0.0)  # [DP]
    st = tl.where(live, tl.sum(q[None, :] * tk, 1), float("-inf"))  # [N]
    tl.store(s_tail + pid * N + nn, st)
    tail_round = tl.sum(tl.abs(q) * tl.max(tl.abs(tk), 0), 0) * RF

    # logsumexp over the partial block, then over the full blocks and it (torch.logsumexp's convention)
    mt = tl.max(st, 0)
    mt0 = tl.where(tl.abs(mt) == float("inf"), 0.0, mt)
    lt = log_f32(tl.sum(exp_f32(st - mt0, PRECISE), 0), PRECISE) + mt0
    row = pid * B
    lg = tl.load(l8 + row + pos, mask=pos < B, other=float("-inf"))
    mx = tl.maximum(tl.reduce(lg, 0, max_nan), lt, propagate_nan=tl.PropagateNan.ALL)
    mx0 = tl.where(tl.abs(mx) == float("inf"), 0.0, mx)
    total = tl.sum(exp_f32(lg - mx0, PRECISE), 0) + exp_f32(lt - mx0, PRECISE)
    tl.store(l_tail + pid, lt)
    tl.store(lse + pid, log_f32(total, PRECISE) + mx0)

    fin_t = tl.max(tl.where(tl.abs(st) < float("inf"), tl.abs(st), 0.0), 0)
    sa = tl.maximum(tl.reduce(tl.load(amax + row + pos, mask=pos < B, other=0.0), 0, max_nan), fin_t,
                    propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    br = tl.maximum(tl.reduce(tl.load(rmax + row + pos, mask=pos < B, other=0.0), 0, max_nan), tail_round,
                    propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    tl.store(score_abs1 + pid, sa)
    tl.store(base_round + pid, br)
    tl.store(round1 + pid, br + (sa * C1 + C0))
    tl.store(widened + pid, 0)
    if pid == 0:
        tl.store(escalated, 0)
        tl.store(counts + tl.arange(0, 4), tl.zeros([4], tl.int64), mask=tl.arange(0, 4) < 3)

    if g == 0:
        tl.store(tail_v + (rk * N + nn[:, None]) * D + dd[None, :], tv, mask=dd[None, :] < D)
        tv64 = tv.to(tl.float64)
        vnorm = (tl.max(tl.sqrt(tl.sum(tv64 * tv64, 1)), 0) * (1 + 2.0**-20)).to(tl.float32)
        nu_max = tl.reduce(tl.load(nu + rk * B + pos, mask=pos < B, other=0.0), 0, max_nan)
        tl.store(v_max + rk, tl.maximum(nu_max, vnorm, propagate_nan=tl.PropagateNan.ALL))
        tl.store(eta_max + rk, tl.reduce(tl.load(eta + rk * B + pos, mask=pos < B, other=0.0), 0, max_nan))
        tl.store(page_flags + rk, tl.max(tl.load(bad + rk * B + pos, mask=pos < B, other=0), 0))
        tl.store(bits + rk * B + pos, pos * 0, mask=pos < B)
        tl.store(active + rk, 1)
        if rk % H == 0:
            tl.store(canary + r, 0)


@dataclass
class CallState:
    """The per-call device buffers that :func:`prepare`'s kernel initialises for the passes after it.

    Attributes:
        bits: ``[R, K, B]`` int32 zeros: the promotion bitmask that selection ORs its bits into.
        active: ``[R, K]`` int32 ones: every group is computed by the promotion and attend passes.
        canary: ``[R]`` int32 zeros: the rows' canary flags, set by the promotion pass.
        widened: ``[R, K, G]`` bool False: no rung 1 (what a call without selection reports).
        escalated: ``[1]`` int8 zero: set to 1 by ``finalize`` when a head of the call is at rung 3 or 4 (the
            predicate of the device re-run's conditional node, ``KernelTuning.rerun_if_node``); None where the
            state was not made by :func:`prepare` (the torch glue).
        counts: ``[3]`` int64 zeros: the call's promoted key blocks, value blocks and page-in bytes, which
            ``finalize`` counts (``finalize.TrafficCount``); None where the state was not made by :func:`prepare`.
        page_flags: ``[R, K]`` int32: 1 where a page of the group breaks a precondition or lacks ``FLAG_VALID``
            (phase 1's per-block ``bad`` flags reduced over the blocks); a row with any is certified at rung 4.
    """

    bits: torch.Tensor
    active: torch.Tensor
    canary: torch.Tensor
    page_flags: torch.Tensor
    widened: torch.Tensor
    escalated: torch.Tensor | None = None
    counts: torch.Tensor | None = None


def prepare(qs: torch.Tensor, tail_raw: torch.Tensor, lens: torch.Tensor, p1) -> tuple[Phase1Summary, CallState]:
    """Launch the kernel: ``(summary, state)``.

    Args:
        qs: ``[R, H_q, D]`` float32 scaled queries.
        tail_raw: ``[R, K, 2, 16, D]`` the partial block's originals (float16/bfloat16), as gathered.
        lens: ``[R]`` int64 row lengths.
        p1: the phase-1 outputs (``triton_kernels.phase1.Phase1Out``, or a pass with the same ``l8``, ``eta``,
            ``nu``, ``rmax``, ``amax`` and ``bad``).
    """
    launch_device_ok(qs)
    R, K, G, B = p1.l8.shape
    D = qs.shape[-1]
    if not supported(B):
        raise ValueError(f"prepare: {B} block-table columns, the kernel holds at most {MAX_BLOCKS}")
    f32 = dict(dtype=torch.float32, device=qs.device)
    out = Phase1Summary(
        s_tail=torch.empty(R, K, G, 16, **f32), tail_v=torch.empty(R, K, 16, D, **f32),
        l_tail=torch.empty(R, K, G, **f32), lse=torch.empty(R, K, G, **f32), score_abs1=torch.empty(R, K, G, **f32),
        base_round=torch.empty(R, K, G, **f32), round1=torch.empty(R, K, G, **f32),
        v_max=torch.empty(R, K, 1, **f32), eta_max=torch.empty(R, K, 1, **f32),
    )  # fmt: skip
    i32 = dict(dtype=torch.int32, device=qs.device)
    widened = torch.empty(R, K, G, dtype=torch.int8, device=qs.device)
    state = CallState(bits=torch.empty(R, K, B, **i32), active=torch.empty(R, K, **i32), canary=torch.empty(R, **i32),
                      page_flags=torch.empty(R, K, **i32), widened=widened.view(torch.bool),
                      escalated=torch.empty(1, dtype=torch.int8, device=qs.device),
                      counts=torch.empty(3, dtype=torch.int64, device=qs.device))  # fmt: skip
    c1, c0 = exp_factors()
    _prepare_kernel[(R * K * G,)](
        qs, tail_raw.contiguous(), lens, p1.l8, p1.eta, p1.nu, p1.rmax, p1.amax,
        out.s_tail, out.tail_v, out.l_tail, out.lse, out.score_abs1, out.base_round, out.round1, out.v_max,
        out.eta_max, p1.bad, state.page_flags, state.bits, state.active, state.canary, widened,
        state.escalated, state.counts, B, rounding_factor(D), c1, c0,
        H=K, G=G, D=D, DP=next_pow2(D), BP=width_class(B).bp, PRECISE=precise(), num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out, state
