"""Staging gather of the step prefetch: copy listed key pages from the pinned shadow into a device buffer
with a few persistent programs, so that it runs beside a layer's kernels instead of in front of them.

One program per page (``gather.fill_pool``) floods every SM with programs that wait on PCIe, and whatever
runs on another stream waits behind them. ``stage_pages`` launches ``programs`` programs
(``KernelTuning.prefetch_programs``) that each loop over the list, ``U`` pages per iteration
(``KernelTuning.prefetch_unroll``; all loads issued before any store), which keeps about ``programs·U``
4 KiB pages in flight while leaving the SMs to a concurrent layer call.

Byte layout of the destination (``certvllm.kv.prefetch``): ``dst[i]`` is ``[N, D]`` token-major in the
shadow's dtype (the promotion cache's page layout), for ``i < len(pages)``; an entry whose page id is −1 is
left as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_arg, launch_device_ok, next_pow2
from .pool import _items
from .shape_class import JIT_OPTIONS, width_class
from .tuning import DEFAULT_TUNING


@triton.jit(**JIT_OPTIONS)
def _stage_pages_kernel(
    src,  # shadow storage [E, H, 2, m*N, D] (float16/bfloat16), host-pinned or device
    dst,  # [P, N, D] staging pages (same dtype), device
    pages,  # [CAP] int64: page id e = block·H + head to copy into dst[i], or −1 (skip)
    count,  # [1] int64 (device): entries of pages in use (capped at CAP)
    CAP,  # entries of pages and dst
    SPARSE,  # fewer than this many pages: only half the programs copy (they disturb the layers less)
    NPROG: tl.constexpr,  # programs in the grid
    U: tl.constexpr,  # pages per program and iteration
    H: tl.constexpr,  # KV heads of the shadow
    M: tl.constexpr,  # 16-token blocks per engine block (m)
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # next power of two ≥ D
    CHANNEL_MAJOR: tl.constexpr,  # keys stored [D, m*N] per (engine block, head)
):
    N: tl.constexpr = 16
    pid = tl.program_id(0)
    u = tl.arange(0, U)
    t = tl.arange(0, N)
    d = tl.arange(0, DP)
    dm = d < D
    P = tl.minimum(tl.load(count), CAP)
    nprog = tl.where(P < SPARSE, max(NPROG // 2, 1), NPROG)
    for first in range(tl.where(pid < nprog, pid * U, P), P, nprog * U):  # programs past nprog: no work
        i = first + u
        e = tl.load(pages + i, mask=i < P, other=-1)
        ok = e >= 0
        e = tl.maximum(e, 0)
        bid = e // H
        h = e % H
        base = (((bid // M) * H + h) * 2) * (M * N * D)  # the key half of (engine block, head)
        sub = (bid % M) * N
        token_major = (sub[:, None, None] + t[None, :, None]) * D + d[None, None, :]
        if CHANNEL_MAJOR:
            offs = d[None, None, :] * (M * N) + sub[:, None, None] + t[None, :, None]
        else:
            offs = token_major
        m3 = ok[:, None, None] & dm[None, None, :]
        x = tl.load(src + base[:, None, None] + offs, mask=m3, other=0.0)
        out = i.to(tl.int64)[:, None, None] * (N * D) + t[None, :, None] * D + d[None, None, :]
        tl.store(dst + out, x, mask=m3)


def stage_pages(
    dst: torch.Tensor,
    shadow: torch.Tensor,
    pages: torch.Tensor,
    count: torch.Tensor,
    num_kv_heads: int,
    sub_blocks: int,
    channel_major: bool = False,
    programs: int = DEFAULT_TUNING.prefetch_programs,
    per_iteration: int = DEFAULT_TUNING.prefetch_unroll,
    sparse: int = 0,
) -> None:
    """Copy the unquantized keys of page ``pages[i]`` (``block·H_kv + head``) into ``dst[i]`` for every
    ``i < min(count, P)`` with ``pages[i] ≥ 0``; zero-copy from the pinned shadow, no host synchronisation.

    Args:
        dst: ``[P, N, D]`` on the device, the shadow's dtype.
        shadow: ``[E, H_kv, 2, m·N, D]`` (pinned host memory, or device memory).
        pages: ``[P]`` int64 on ``dst``'s device; count: ``[1]`` (or a 1-element view) int64 there.
        num_kv_heads, sub_blocks: ``H_kv`` and ``m`` of the shadow.
        channel_major: keys are stored ``[D, m·N]`` per (engine block, head).
        programs, per_iteration: the grid and the pages each program has in flight (a power of two);
            defaults: ``DEFAULT_TUNING.prefetch_programs`` and ``.prefetch_unroll``.
        sparse: below this many listed pages only half the programs copy (see ``certvllm.kv.prefetch``).
    """
    p, _, d = dst.shape
    if p == 0:
        return
    if pages.shape != (p,):
        raise ValueError(f"pages has shape {tuple(pages.shape)}; it must be ({p},), one id per staging entry")
    launch_device_ok(dst)
    _stage_pages_kernel[(programs,)](
        device_arg(shadow), dst, pages, count, p, sparse,
        NPROG=programs, U=per_iteration, H=num_kv_heads, M=sub_blocks, D=d, DP=next_pow2(d),
        CHANNEL_MAJOR=channel_major, num_warps=8 if per_iteration >= 4 else 4,
    )  # fmt: skip


@triton.jit(**JIT_OPTIONS)
def _snapshot_tags_kernel(pages, count, gen, tag, tag_gen, CAP, H: tl.constexpr, BLK: tl.constexpr):
    """tag[i] = pages[i] and tag_gen[i] = the block's write generation now, for i < min(count, CAP); −1 past it."""
    i = tl.program_id(0) * BLK + tl.arange(0, BLK)
    inb = i < CAP
    listed = inb & (i < tl.load(count))
    e = tl.load(pages + i, mask=listed, other=-1)
    g = tl.load(gen + tl.maximum(e, 0) // H, mask=listed & (e >= 0), other=-1)
    tl.store(tag + i, e, mask=inb)
    tl.store(tag_gen + i, tl.where(e >= 0, g, -1), mask=inb)


def snapshot_tags(pages: torch.Tensor, count: torch.Tensor, generation: torch.Tensor, tag: torch.Tensor,
                  tag_gen: torch.Tensor, num_kv_heads: int) -> None:  # fmt: skip
    """Tag the staging entries before their pages are read (one launch; see ``certvllm.kv.prefetch``)."""
    cap = tag.shape[0]
    blk = 1024
    _snapshot_tags_kernel[(triton.cdiv(cap, blk),)](pages, count, generation, tag, tag_gen, cap, H=num_kv_heads,
                                                    BLK=blk, num_warps=4)  # fmt: skip


@triton.jit(**JIT_OPTIONS)
def _serve_record_kernel(
    tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks,  # as the pool lookup (triton_kernels.pool)
    gen,  # [num_blocks] int64 write generations
    slot_map,  # in/out [R, H, B] int32: pool slot, −1 shadow; staged pages get nslots + i
    index,  # in/out [R, H, B] int32: staging entry of each position (−1 none), this call's in, next call's out
    tag, tag_gen,  # [CAP] int64 tags of this call's staging entries
    pages,  # out [CAP] int64: the pages to stage for the next call
    step,  # in/out [4] int64: pages listed for the next call, of them kept (< CAP), pool misses, served
    nslots, CAP,
    H: tl.constexpr, BLK: tl.constexpr, SERVE: tl.constexpr,
):  # fmt: skip
    # the pool lookup's items (pool slots unused: one slot)
    idx, inb, need, bid, page, _, _ = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, 1, H, BLK)
    slot = tl.load(slot_map + idx, mask=inb, other=-1)
    tl.atomic_add(step + 2, tl.sum((need & (slot < 0)).to(tl.int64), axis=0))
    if SERVE:
        j = tl.load(index + idx, mask=inb, other=-1)
        cand = need & (slot < 0) & (j >= 0)
        jj = tl.maximum(j, 0)
        ok = cand & (tl.load(tag + jj, mask=cand, other=-1) == page)
        ok = ok & (tl.load(tag_gen + jj, mask=cand, other=-1) == tl.load(gen + bid, mask=cand, other=-2))
        slot = tl.where(ok, nslots + j, slot)
        tl.store(slot_map + idx, slot, mask=inb)
        tl.atomic_add(step + 3, tl.sum(ok.to(tl.int64), axis=0))
    nxt = need & ((slot < 0) | (slot >= nslots))  # not held by the pool: worth staging for the next call
    n_local = tl.sum(nxt.to(tl.int64), axis=0)
    first = tl.atomic_add(step + 0, n_local)
    pos = first + tl.cumsum(nxt.to(tl.int64), axis=0) - 1
    keep = nxt & (pos < CAP)
    tl.atomic_add(step + 1, tl.sum(keep.to(tl.int64), axis=0))
    tl.store(index + idx, tl.where(keep, pos, -1).to(tl.int32), mask=inb)
    tl.store(pages + pos, page, mask=keep)


def serve_and_record(
    tables: torch.Tensor,
    nfull: torch.Tensor,
    bits: torch.Tensor,
    need_mask: int,
    num_blocks: int,
    generation: torch.Tensor,
    slot_map: torch.Tensor,
    index: torch.Tensor,
    tag: torch.Tensor,
    tag_gen: torch.Tensor,
    pages: torch.Tensor,
    step: torch.Tensor,
    nslots: int,
    serve: bool,
) -> None:
    """One launch over ``[R, H_kv, B]`` (see ``certvllm.kv.prefetch``): where the pool left a needed page to
    the shadow and this call's staging holds it under its current generation, point the slot map at the
    staging entry; then list every needed page the pool does not hold as the next call's staging and
    rewrite ``index`` for it. ``step`` must be zero on entry and ends as (pages listed, of them kept —
    entries past ``len(pages)`` are dropped —, needed pages the pool did not serve, of them served here)."""
    launch_device_ok(slot_map)
    R, H, B = bits.shape
    if R * B == 0:
        return
    blk = width_class(B).item_block
    _serve_record_kernel[(R * H, triton.cdiv(B, blk))](
        tables, tables.stride(0), nfull, bits, B, need_mask, num_blocks, generation, slot_map, index, tag, tag_gen,
        pages, step, nslots, pages.shape[0], H=H, BLK=blk, SERVE=serve, num_warps=4,
    )  # fmt: skip
