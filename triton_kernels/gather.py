"""Zero-copy page-in: gather shadow pages (tier 2) by 16-token block id into a device buffer.

The shadow ``[E, H_kv, 2, m·N, D]`` lives in host memory registered with CUDA (``cudaHostRegister``),
so its address is valid on the device (unified addressing) and Triton's launcher resolves it like
any device pointer: the kernel reads host memory over PCIe directly, with no staging copy. Many
pages in flight at once are what reach the link's bandwidth, so callers batch page-ins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    copy_page,
    device_arg,
    holds_copy,
    launch_device_ok,
    load_shadow_tile,
    next_pow2,
    store_page_tile,
)
from .shape_class import JIT_OPTIONS


@triton.jit(**JIT_OPTIONS)
def _gather_pages_kernel(
    src,  # shadow storage [E, H, 2, m*N, D] (float16/bfloat16), host-pinned or device
    out,  # [n, 2, N, D] output (same dtype), device
    block_ids,  # [n] int64 16-token block ids ([n / H] with ALL_HEADS)
    heads,  # [n] int64 KV heads (not read with ALL_HEADS)
    keys,  # [P, N, D] a write-through pool's key pages, slot = page = block·H + head (POOL only)
    tag,  # [P] int64 page held by each slot, −1 empty (POOL only)
    tag_gen,  # [P] int64 the generation it was written under (POOL only)
    generation,  # [num_blocks] int64 current write generation per 16-token block (POOL only)
    H: tl.constexpr,  # KV heads of the shadow
    M: tl.constexpr,  # 16-token blocks per engine block (m)
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # next power of two ≥ D
    CHANNEL_MAJOR: tl.constexpr,  # keys stored [D, m*N] per (engine block, head)
    POOL: tl.constexpr,  # keys from the pool where its slot holds the page's current copy
    ALL_HEADS: tl.constexpr,  # item i is (block_ids[i // H], head i % H)
):
    item = tl.program_id(0)
    kv = tl.program_id(1)  # 0 keys, 1 values
    if ALL_HEADS:
        bid = tl.load(block_ids + item // H)
        h = (item % H).to(tl.int64)
    else:
        bid = tl.load(block_ids + item)
        h = tl.load(heads + item)
    if POOL:
        # keys whose slot holds (page, the block's current generation): the same tag rule as the pool's lookups
        # (docs/certification.md §5.1); they are the shadow's bytes, in device memory, so nothing crosses PCIe
        page = bid * H + h
        if holds_copy(tag, tag_gen, page, page, tl.load(generation + bid), kv == 0):
            t = tl.arange(0, 16)
            d = tl.arange(0, DP)
            x = tl.load(keys + page * (16 * D) + t[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0)
        else:
            x = load_shadow_tile(src, bid, h, kv, H, M, D, DP, CHANNEL_MAJOR)
    else:
        x = load_shadow_tile(src, bid, h, kv, H, M, D, DP, CHANNEL_MAJOR)
    store_page_tile(out + (item * 2 + kv) * (16 * D), x, D, DP)


def gather_pages(
    shadow: torch.Tensor,
    block_ids: torch.Tensor,
    heads: torch.Tensor | None,
    device: torch.device,
    channel_major: bool = False,
    out: torch.Tensor | None = None,
    direct: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Originals of (block, KV head) pages: ``[n, 2, N, D]`` in the shadow dtype on ``device``.

    Args:
        shadow: ``[E, H_kv, 2, m·N, D]`` float16/bfloat16 (pinned host memory, or device memory).
        block_ids, heads: ``[n]`` int64 on ``device``; ``heads`` None: every KV head of each block, block-major
            (item ``i·H + h`` is head h of ``block_ids[i]``; ``n`` = H·len(block_ids)).
        device: where the result goes (and where the kernel runs).
        channel_major: keys are stored ``[D, m·N]`` per (engine block, head).
        out: optional ``[n, 2, N, D]`` destination.
        direct: a write-through pool's ``(keys, tag, tag_gen, generation)``
            (``PromotionCache.direct_keys``): the keys of a page its slot holds under the block's current
            generation are read from it (the shadow's bytes, in device memory), the rest from the shadow.
    """
    e, h, _, mn, d = shadow.shape
    n = block_ids.numel() * (h if heads is None else 1)
    if out is None:
        out = torch.empty(n, 2, 16, d, dtype=shadow.dtype, device=device)
    if n == 0:
        return out
    launch_device_ok(out)
    keys, tag, tag_gen, generation = direct if direct is not None else (out, block_ids, block_ids, block_ids)
    _gather_pages_kernel[(n, 2)](
        device_arg(shadow), out, block_ids, block_ids if heads is None else heads, keys, tag, tag_gen, generation,
        H=h, M=mn // 16, D=d, DP=next_pow2(d), CHANNEL_MAJOR=channel_major, POOL=direct is not None,
        ALL_HEADS=heads is None, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit(**JIT_OPTIONS)
def _fill_pool_kernel(
    src,  # shadow storage [E, H, 2, m*N, D] (float16/bfloat16), host-pinned or device
    pool,  # [P, N, D] promotion-cache key pages (same dtype), device
    vpool,  # [P, N, D] its value pages (VALUES)
    fill_page,  # [P] int64: page id e = block·H + head to copy into slot p, or −1 (leave the slot)
    H: tl.constexpr,  # KV heads of the shadow
    M: tl.constexpr,  # 16-token blocks per engine block (m)
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # next power of two ≥ D
    CHANNEL_MAJOR: tl.constexpr,  # keys stored [D, m*N] per (engine block, head)
    VALUES: tl.constexpr,  # the pool holds value pages too
):
    p = tl.program_id(0).to(tl.int64)
    e = tl.load(fill_page + p)
    if e >= 0:
        copy_page(src, e, 0, pool, p, H, M, D, DP, CHANNEL_MAJOR)
        if VALUES:
            copy_page(src, e, 1, vpool, p, H, M, D, DP, CHANNEL_MAJOR)


def fill_pool(
    pool: torch.Tensor,
    shadow: torch.Tensor,
    fill_page: torch.Tensor,
    num_kv_heads: int,
    sub_blocks: int,
    channel_major: bool = False,
    values: torch.Tensor | None = None,
) -> None:
    """Copy the unquantized keys (and, with ``values``, the values) of page ``fill_page[p]`` (``block·H_kv + head``) into promotion-cache slot
    ``p`` (token-major ``[N, D]``), for every ``p`` with ``fill_page[p] ≥ 0``; zero-copy from the pinned
    shadow, one program per slot, no host synchronisation.

    Args:
        pool: ``[P, N, D]`` on the device, the shadow's dtype.
        shadow: ``[E, H_kv, 2, m·N, D]`` (pinned host memory, or device memory).
        fill_page: ``[P]`` int64 on the pool's device.
        num_kv_heads, sub_blocks: ``H_kv`` and ``m`` of the shadow.
        channel_major: keys are stored ``[D, m·N]`` per (engine block, head).
        values: the pool's ``[P, N, D]`` value pages, or None (a keys-only pool).
    """
    p, n, d = pool.shape
    if p == 0:
        return
    launch_device_ok(pool)
    _fill_pool_kernel[(p,)](
        device_arg(shadow), pool, pool if values is None else values, fill_page,
        H=num_kv_heads, M=sub_blocks, D=d, DP=next_pow2(d), CHANNEL_MAJOR=channel_major, VALUES=values is not None,
        num_warps=4,
    )  # fmt: skip
