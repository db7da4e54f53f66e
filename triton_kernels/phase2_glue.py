"""The small steps around the promotion and attend passes, one launch each in place of a few torch launches.

* :func:`global_max`: the attend pass's m = max(max_s smax, max_t s_tail) per query head (torch's
  ``amax``/``maximum``, NaN kept), 3 launches → 1;
* :func:`rerun_inputs`: the exact re-run's promotion bitmask (every bit on the full blocks of an escalated
  group), its active flags and a zeroed canary, from the ``[R, H_q]`` rungs of the report, 7 launches → 1.

(A call's promotion counts are the epilogue's: ``finalize.TrafficCount``.)

Each returns what its torch expression did, exactly (integer flags; maxima are exact), so callers may use
either. Tested against those expressions under the interpreter (``tests/triton_kernels/test_phase2_glue.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certvllm.bounds.report import RUNG_HEAD_DENSE

from .common import holds_copy, launch_device_ok, max_nan, next_pow2
from .shape_class import JIT_OPTIONS

_HEAD = tl.constexpr(RUNG_HEAD_DENSE)

RERUN_BLOCK = 1024
"""Block columns per iteration of the re-run input kernel."""


@triton.jit(**JIT_OPTIONS)
def _global_max_kernel(smax, s_tail, m, S, SP: tl.constexpr, N: tl.constexpr):
    """One program per (row, KV head, query head): m = max(smax[pid, :S], s_tail[pid, :N])."""
    pid = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    a = tl.load(smax + pid * S + s, mask=s < S, other=float("-inf"))
    t = tl.load(s_tail + pid * N + tl.arange(0, N))
    tl.store(m + pid, max_nan(tl.reduce(a, 0, max_nan), tl.reduce(t, 0, max_nan)))


def global_max(smax: torch.Tensor, s_tail: torch.Tensor) -> torch.Tensor:
    """``[R, K, G, S]`` split maxima of the promotion pass and ``[R, K, G, N]`` partial-block scores (float32)
    → ``[R, K, G]`` float32 m, as ``torch.maximum(smax.amax(-1), s_tail.amax(-1))``."""
    launch_device_ok(smax)
    R, K, G, S = smax.shape
    N = s_tail.shape[-1]
    m = torch.empty(R, K, G, dtype=torch.float32, device=smax.device)
    _global_max_kernel[(R * K * G,)](smax.contiguous(), s_tail.contiguous(), m, S, SP=next_pow2(S), N=N,
                                     num_warps=1)  # fmt: skip
    return m


@triton.jit(**JIT_OPTIONS)
def _rerun_inputs_kernel(rung, nfull, bits, active, canary, B, G: tl.constexpr, GP: tl.constexpr,
                         H: tl.constexpr, FULL: tl.constexpr, BLOCK: tl.constexpr,
                         tables=None, TB_STRIDE=0, num_blocks=1, tag=None, tag_gen=None, gen=None, kslot=None,
                         DIRECT: tl.constexpr = False):  # fmt: skip
    """One program per (row, KV head): active = any head of the group at rung ≥ 3 (escalated); bits = FULL (every promotion
    bit) on the row's full blocks where active, else 0; program (r, 0) zeroes canary[r]. ``DIRECT``: also the
    slot map of a write-through pool (slot = page ``block·H + head``): the page where the slot's tag is (page,
    the block's current generation) on an active group's full block, else −1 (read from the shadow)."""
    pid = tl.program_id(0).to(tl.int64)
    r = pid // H
    g = tl.arange(0, GP)
    act = tl.max((tl.load(rung + pid * G + g, mask=g < G, other=0) >= _HEAD).to(tl.int32), 0)
    tl.store(active + pid, act)
    if pid % H == 0:
        tl.store(canary + r, 0)
    nf = tl.load(nfull + r)
    word = tl.where(act != 0, FULL, 0)
    for start in range(0, B, BLOCK):
        b = start + tl.arange(0, BLOCK)
        tl.store(bits + pid * B + b, tl.where(b < nf, word, 0), mask=b < B)
        if DIRECT:
            take = (b < nf) & ((b * 0 + act) != 0)
            bid = tl.load(tables + r * TB_STRIDE + b, mask=take, other=0)
            bid = tl.minimum(tl.maximum(bid, 0), num_blocks - 1)
            page = bid * H + pid % H
            held = holds_copy(tag, tag_gen, page, page, tl.load(gen + bid, mask=take, other=-2), take)
            tl.store(kslot + pid * B + b, tl.where(held, page, -1).to(tl.int32), mask=b < B)


def rerun_inputs(rung: torch.Tensor, nfull: torch.Tensor, num_kv_heads: int, num_blocks: int,
                 direct: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``[R, H_q]`` int8 rungs (a head at rung ≥ 3 escalates), ``[R]`` int64 full blocks per row →
    ``(bits [R, K, B] int32, active [R, K] int32, canary [R] int32 zeros, kslot)`` of the exact re-run, as
    ``DeviceRerun``'s torch lines.

    ``direct``: a write-through pool's ``(tables [R, ≥B] int64, tag, tag_gen, generation, cache blocks)``
    (``kv.promotion_cache.PromotionCache.write_through``); ``kslot`` is then the ``[R, K, B]`` int32 slot map
    of the re-run's promotion pass (the pages the pool holds under their current generation), else None."""
    launch_device_ok(nfull)
    R, Hq = rung.shape
    K, B = num_kv_heads, num_blocks
    G = Hq // K
    full = (1 << (2 * G)) - 1
    full = full - (1 << 32) if full >= 1 << 31 else full  # the int32 word of every bit (G = 16: −1)
    dev = nfull.device
    bits = torch.empty(R, K, B, dtype=torch.int32, device=dev)
    active = torch.empty(R, K, dtype=torch.int32, device=dev)
    canary = torch.empty(R, dtype=torch.int32, device=dev)
    kslot, extra = None, {}
    if direct is not None:
        tables, tag, tag_gen, generation, cache_blocks = direct
        kslot = torch.empty(R, K, B, dtype=torch.int32, device=dev)
        extra = dict(tables=tables, TB_STRIDE=tables.stride(0), num_blocks=cache_blocks, tag=tag, tag_gen=tag_gen,
                     gen=generation, kslot=kslot, DIRECT=True)  # fmt: skip
    _rerun_inputs_kernel[(R * K,)](rung.contiguous(), nfull, bits, active, canary, B, G=G,
                                   GP=next_pow2(G), H=K, FULL=full, BLOCK=min(RERUN_BLOCK, next_pow2(B)),
                                   num_warps=4, **extra)  # fmt: skip
    return bits, active, canary, kslot
