"""The promotion cache's per-call lookup (``certvllm.kv.promotion_cache``): five small kernels, two for a write-through pool.

Same result as the torch reference ``PromotionCache.resolve`` plus its fill, bit for bit (the claims are
``atomic_max`` over the same candidates as torch's ``scatter_reduce`` amax, and a maximum does not depend
on the order), in 5 launches instead of ~35 elementwise torch kernels over ``[R, H_kv, B]``:

1. ``_claim1``: per (row, KV head, block): the page is needed (valid block, ``bits & need_mask``); hit =
   one of its two slots holds (page, current generation); hits claim their slot with ``page + 2^62``,
   misses claim their first slot with ``page``; the item's state (slot of a hit, −2 miss) is stored;
2. ``_claim2``: a miss whose first slot's claim is its own page won it; otherwise it claims its second
   slot in a second claim array if round 1 left that slot unclaimed (state −3);
3. ``_claim3``: a state −3 item won its second slot iff the second claim array holds its page;
4. ``_settle``: per item holding a slot, its claim is taken back (compare-and-swap to −1): a hit's, or a
   winning miss's, which then retags the slot with (page, generation) and lists (slot, page) for the fill; of
   several items of one page (rows sharing a block) exactly one swap succeeds;
5. ``_fill_list``: the listed slots get their page's unquantized keys from the shadow (zero-copy).

A **write-through** pool (one slot per page: slot ``e`` is page ``e``'s, ``PromotionCache.write_through``) needs no
claims: ``_direct_lookup`` serves a needed page from its own slot where the tag rule holds and otherwise retags that
slot and lists it for ``_fill_list``, in one pass without compare-and-swap (2 launches instead of 5; the claims'
~3 atomics per item made ``_settle`` 87 µs per served 8 × 32K call on an H100). No other page ever owns slot ``e``, so
the only race is between rows that need the same missing page: each may list it, and the copies write the same
bytes.

The two claim arrays are the pool's own (``PromotionCache.claims``): all −1 between calls, and every entry a
call sets is swapped back by the item that owns it (the final maximum of an entry always belongs to an item that
ends up holding that slot), so no call clears or scans them: a call's work follows its items, not the pool's
size. Step counters (pages needed, hits, slots filled, pages left to the shadow) are added into ``step`` with
one atomic per program. No host synchronisation; CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certvllm.formats.pool_slots import CLAIM_HIT, HASH_MUL

from .common import as_mask, copy_page, device_arg, holds_copy, launch_device_ok, next_pow2
from .shape_class import JIT_OPTIONS, width_class

_HASH_MUL = tl.constexpr(HASH_MUL)  # the two slots and the claim encoding: ``certvllm.formats.pool_slots``
_CLAIM_HIT = tl.constexpr(CLAIM_HIT)


@triton.jit
def _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H: tl.constexpr, BLK: tl.constexpr):
    rk = tl.program_id(0).to(tl.int64)
    r = rk // H
    h = rk % H
    b = tl.program_id(1) * BLK + tl.arange(0, BLK)
    inb = b < B
    valid = inb & (b < tl.load(nfull + r))
    bb = tl.load(bits + rk * B + b, mask=valid, other=0)
    need = valid & ((bb & need_mask) != 0)
    bid = tl.load(tables + r * TB_STRIDE + b, mask=inb, other=0)
    bid = tl.minimum(tl.maximum(bid, 0), num_blocks - 1)
    page = bid * H + h
    s1 = page % P
    s2 = ((page * _HASH_MUL) >> 7) % P
    return rk * B + b, inb, need, bid, page, s1, s2


@triton.jit(**JIT_OPTIONS)
def _claim1(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, gen, tag, tag_gen, claim, state, step,
            H: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    idx, inb, need, bid, page, s1, s2 = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H, BLK)
    g = tl.load(gen + bid, mask=need, other=-2)
    hit1 = holds_copy(tag, tag_gen, s1, page, g, need)
    hit2 = holds_copy(tag, tag_gen, s2, page, g, need & ~hit1)
    hit = hit1 | hit2
    cslot = tl.where(hit2, s2, s1)
    tl.atomic_max(claim + cslot, tl.where(hit, page + _CLAIM_HIT, page), mask=need)
    st = tl.where(hit, cslot, tl.where(need, -2, -1))
    tl.store(state + idx, st.to(tl.int32), mask=inb)
    tl.atomic_add(step + 0, tl.sum(need.to(tl.int64), axis=0))
    tl.atomic_add(step + 1, tl.sum(hit.to(tl.int64), axis=0))


@triton.jit(**JIT_OPTIONS)
def _claim2(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, claim, claim2, state, step,
            H: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    idx, inb, need, bid, page, s1, s2 = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H, BLK)
    st = tl.load(state + idx, mask=inb, other=-1)
    miss = st == -2
    won1 = miss & (tl.load(claim + s1, mask=miss, other=-1) == page)
    rest = miss & ~won1
    try2 = rest & (tl.load(claim + s2, mask=rest, other=0) < 0)
    tl.atomic_max(claim2 + s2, page, mask=try2)
    st = tl.where(won1, s1, tl.where(try2, -3, tl.where(miss, -1, st)))
    tl.store(state + idx, st.to(tl.int32), mask=inb)
    tl.atomic_add(step + 3, tl.sum((rest & ~try2).to(tl.int64), axis=0))


@triton.jit(**JIT_OPTIONS)
def _claim3(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, claim2, state, step,
            H: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    idx, inb, need, bid, page, s1, s2 = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H, BLK)
    st = tl.load(state + idx, mask=inb, other=-1)
    t = st == -3
    won2 = t & (tl.load(claim2 + s2, mask=t, other=-1) == page)
    st = tl.where(won2, s2, tl.where(t, -1, st))
    tl.store(state + idx, st.to(tl.int32), mask=inb)
    tl.atomic_add(step + 3, tl.sum((t & ~won2).to(tl.int64), axis=0))


_NO_CLAIM = tl.constexpr(-2)  # a compare value no claim entry ever holds (entries are −1 or ≥ 0): a masked-off swap


@triton.jit(**JIT_OPTIONS)
def _settle(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, claim, claim2, gen, tag, tag_gen, state,
            fills, nfill, step, H: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    idx, inb, need, bid, page, s1, s2 = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H, BLK)
    st = tl.load(state + idx, mask=inb, other=-1)
    own = inb & (st >= 0)
    slot = tl.where(own, st, s1).to(tl.int64)
    fill = own & (st < -1)  # none yet
    # Triton's CAS takes no mask: an item without a slot swaps against a value no entry holds, at its own first
    # slot (one address per page, not one for all: ~all items on entry 0 serialised the whole kernel); a program
    # whose items hold no slot (no promoted block in its range) issues none
    if tl.sum(own.to(tl.int32), 0) > 0:
        free = tl.full(page.shape, -1, tl.int64)
        old = tl.atomic_cas(claim + slot, tl.where(own, page + _CLAIM_HIT, _NO_CLAIM), free)
        rest = own & (old != page + _CLAIM_HIT)  # not the hit that claimed this slot
        old = tl.atomic_cas(claim + slot, tl.where(rest, page, _NO_CLAIM), free)
        won1 = rest & (old == page)
        rest = rest & ~won1
        if tl.sum(rest.to(tl.int32), 0) > 0:
            old = tl.atomic_cas(claim2 + slot, tl.where(rest, page, _NO_CLAIM), free)
            fill = won1 | (rest & (old == page))
        else:
            fill = won1
    tl.store(tag + slot, page, mask=fill)
    tl.store(tag_gen + slot, tl.load(gen + bid, mask=fill, other=0), mask=fill)
    n = tl.sum(fill.to(tl.int64), axis=0)
    at = tl.atomic_add(nfill, n) + tl.cumsum(fill.to(tl.int64), axis=0) - 1
    tl.store(fills + 2 * at, slot, mask=fill)
    tl.store(fills + 2 * at + 1, page, mask=fill)
    tl.atomic_add(step + 2, n)


@triton.jit(**JIT_OPTIONS)
def _fill_list(src, pool, vpool, fills, nfill, H: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
               CHANNEL_MAJOR: tl.constexpr, VALUES: tl.constexpr):  # fmt: skip
    """The listed fills, grid-stride: program p copies fills p, p + grid, … (the grid is capped, so a call that
    fills nothing costs a few hundred idle programs, not one per item)."""
    n = tl.load(nfill)
    for i in range(tl.program_id(0).to(tl.int64), n, tl.num_programs(0)):
        slot = tl.load(fills + 2 * i)
        e = tl.load(fills + 2 * i + 1)
        copy_page(src, e, 0, pool, slot, H, M, D, DP, CHANNEL_MAJOR)
        if VALUES:
            copy_page(src, e, 1, vpool, slot, H, M, D, DP, CHANNEL_MAJOR)


@triton.jit(**JIT_OPTIONS)
def _direct_lookup(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, gen, tag, tag_gen, state, fills,
                   nfill, step, H: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    """A write-through pool's lookup (module docstring): slot of a needed page = the page; a miss retags its slot
    with (page, generation) and lists (slot, page) for the fill."""
    idx, inb, need, bid, page, _, _ = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H, BLK)
    g = tl.load(gen + bid, mask=need, other=-2)
    hit = holds_copy(tag, tag_gen, page, page, g, need)
    fill = need & ~hit
    tl.store(state + idx, tl.where(need, page, -1).to(tl.int32), mask=inb)
    tl.store(tag + page, page, mask=fill)
    tl.store(tag_gen + page, g, mask=fill)
    n = tl.sum(fill.to(tl.int64), axis=0)
    at = tl.atomic_add(nfill, n) + tl.cumsum(fill.to(tl.int64), axis=0) - 1
    tl.store(fills + 2 * at, page, mask=fill)
    tl.store(fills + 2 * at + 1, page, mask=fill)
    tl.atomic_add(step + 0, tl.sum(need.to(tl.int64), axis=0))
    tl.atomic_add(step + 1, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(step + 2, n)


FILL_PROGRAMS = 512
"""The fill's grid cap: enough programs to keep the copy engines' worth of page copies in flight on an H200
(132 SMs) when a call fills thousands of slots, few enough that an all-hit call's launch is cheap."""


def pool_lookup(
    pool: torch.Tensor,
    tag: torch.Tensor,
    tag_gen: torch.Tensor,
    generation: torch.Tensor,
    shadow: torch.Tensor,
    tables: torch.Tensor,
    nfull: torch.Tensor,
    bits: torch.Tensor,
    need_mask: int,
    num_blocks: int,
    sub_blocks: int,
    channel_major: bool,
    claims: torch.Tensor,
    values: torch.Tensor | None = None,
    direct: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole lookup (see the module docstring).

    Args:
        pool, tag, tag_gen: the cache's ``[P, N, D]`` pages and ``[P]`` int64 tags (updated in place).
        claims: ``[2, P + P % 2]`` int64, the pool's claim arrays: all −1 before the call, and after it.
        values: the ``[P, N, D]`` value pages of a pool that holds values too (filled with the keys), or None.
        generation: ``[num_blocks]`` int64 write generations.
        shadow: ``[E, H_kv, 2, m·N, D]`` originals (pinned host or device).
        tables: ``[R, ≥B]`` int64 block ids; nfull ``[R]`` int64; bits ``[R, H_kv, B]`` int32 promotion masks.
        need_mask: the bits that make the promotion pass read a block's keys (as int32: −1 = any bit).
        num_blocks, sub_blocks, channel_major: of the cache.
        direct: the pool is write-through (one slot per page, keys only): ``_direct_lookup`` instead of the claims.

    Returns:
        ``(slot_map [R, H_kv, B] int32, step [4] int64)``: the slot map (−1: read the shadow) and this call's
        counts (pages needed, hits, slots filled, pages left to the shadow).
    """
    launch_device_ok(pool)
    R, H, B = bits.shape
    P = pool.shape[0]
    dev = bits.device
    if claims.shape != (2, P + P % 2):
        raise ValueError(f"claims {tuple(claims.shape)}: a pool of {P} slots has claim arrays [2, {P + P % 2}]")
    counters = torch.zeros(5, dtype=torch.int64, device=dev)  # one launch: the step counts, then the fill count
    step, nfill = counters[:4], counters[4:]
    state = torch.empty(R, H, B, dtype=torch.int32, device=dev)
    if R * B == 0:
        return state, step
    blk = width_class(B).item_block
    grid = (R * H, triton.cdiv(B, blk))
    common = (tables, tables.stride(0), nfull, bits, B, need_mask, num_blocks, P)
    items = R * H * B  # at most one fill each
    fills = torch.empty(2 * items, dtype=torch.int64, device=dev)  # (slot, page) pairs
    if direct:
        if values is not None or num_blocks * H != P:
            raise ValueError(f"a direct lookup needs a keys-only pool of one slot per page ({num_blocks * H}), got "
                             f"{P} slots{' with values' if values is not None else ''}: pass direct=False")  # fmt: skip
        _direct_lookup[grid](*common, generation, tag, tag_gen, state, fills, nfill, step, H=H, BLK=blk, num_warps=4)
    else:
        _claims(common, grid, blk, H, generation, tag, tag_gen, claims, state, fills, nfill, step)
    d = pool.shape[2]
    _fill_list[(min(items, FILL_PROGRAMS),)](
        device_arg(shadow), pool, pool if values is None else values, fills, nfill,
        H=H, M=sub_blocks, D=d, DP=next_pow2(d), CHANNEL_MAJOR=channel_major, VALUES=values is not None,
        num_warps=4,
    )  # fmt: skip
    return state, step


def _claims(common: tuple, grid: tuple, blk: int, H: int, generation: torch.Tensor, tag: torch.Tensor,
            tag_gen: torch.Tensor, claims: torch.Tensor, state: torch.Tensor, fills: torch.Tensor,
            nfill: torch.Tensor, step: torch.Tensor) -> None:  # fmt: skip
    """Steps 1–4 of the hashed pool's lookup (module docstring): the slot map into ``state``, the fills listed."""
    _claim1[grid](*common, generation, tag, tag_gen, claims[0], state, step, H=H, BLK=blk, num_warps=4)
    _claim2[grid](*common, claims[0], claims[1], state, step, H=H, BLK=blk, num_warps=4)
    _claim3[grid](*common, claims[1], state, step, H=H, BLK=blk, num_warps=4)
    _settle[grid](*common, claims[0], claims[1], generation, tag, tag_gen, state, fills, nfill, step, H=H, BLK=blk,
                  num_warps=4)  # fmt: skip


# ---- explicitly allocated slots (the resident decode pass: certvllm.kv.promotion_cache.ResidentPool) -------------
_CMP_NEVER = tl.constexpr(-3)  # a slot_of value that never occurs: a CAS against it changes nothing
# fill_flag values: a slot untouched this call (the FIFO hand may take it), one a page needed this call holds
# (pinned: never evicted by the call that needs it), one to be filled from the shadow (a new tenant, or a
# refill in place of an older write generation)
_FREE = tl.constexpr(0)
_PINNED = tl.constexpr(1)
_FILL = tl.constexpr(2)


@triton.jit(**JIT_OPTIONS)
def _resident_mark(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, gen, tag, tag_gen, slot_of,
                   fill_flag, ticket, step, H: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    """Per (row, KV head, block) needed: a hit (slot_of → a slot tagged (page, current generation)) pins its
    slot; a page whose slot holds an older generation pins it for a refill in place; a page without a slot (or
    whose slot went to another page) claims ``slot_of`` (CAS −1 → −2), and the winner sets its ``ticket`` flag
    (a page two items need has one winner). No slot changes hands here: every needed page is pinned before any
    is evicted (``_resident_assign``, after the tickets are ranked in item order)."""
    idx, inb, need, bid, page, _s1, _s2 = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H, BLK)
    zero = page * 0
    minus1 = (zero - 1).to(tl.int32)  # CAS values typed as slot_of's int32 (the interpreter writes a value's width)
    safe = page  # a masked-off CAS still lands: at its own page's entry (spread), never all on entry 0
    g = tl.load(gen + bid, mask=need, other=-2)
    s = tl.load(slot_of + safe, mask=need, other=-1).to(tl.int64)
    has = need & (s >= 0)
    st = tl.where(has, s, 0)
    owned = has & (tl.load(tag + st, mask=has, other=-1) == page)
    hit = owned & (tl.load(tag_gen + st, mask=owned, other=-1) == g)
    tl.store(fill_flag + st, tl.where(hit, _PINNED, _FILL).to(tl.int32), mask=owned)  # one page: items agree
    dangling = has & ~owned  # the slot went to another page: forget it, then claim afresh
    tl.atomic_cas(slot_of + safe, tl.where(dangling, s, _CMP_NEVER).to(tl.int32), minus1)
    miss = need & (~has | dangling)
    old = tl.atomic_cas(slot_of + safe, tl.where(miss, -1, _CMP_NEVER).to(tl.int32), minus1 - 1)
    win = as_mask(miss & (old == -1))  # (the interpreter returns the CAS result's comparison as integers)
    tl.store(ticket + idx, win.to(tl.int32), mask=inb)
    tl.atomic_add(step + 0, tl.sum(need.to(tl.int64), axis=0))
    tl.atomic_add(step + 1, tl.sum(hit.to(tl.int64), axis=0))


@triton.jit(**JIT_OPTIONS)
def _resident_free_slots(fill_flag, hand, rank, N, call_fills, free, P, CHUNK: tl.constexpr):
    """One program: the slots the FIFO hand may give this call's new pages, in hand order from ``hand``, skipping
    pinned ones, into ``free`` (as many as there are tickets: ``rank[N - 1]``); ``call_fills`` becomes the number
    granted and the hand moves past the last slot granted."""
    h = tl.load(hand)
    want = tl.load(rank + N - 1).to(tl.int64)
    base = want * 0
    last = want * 0 - 1
    for start in range(0, P, CHUNK):
        j = start + tl.arange(0, CHUNK)
        inb = j < P
        slot = (h + j) % P
        avail = inb & (tl.load(fill_flag + slot, mask=inb, other=_PINNED) == _FREE)
        nth = base + tl.cumsum(avail.to(tl.int64), axis=0) - 1
        take = avail & (nth < want)
        tl.store(free + nth, slot, mask=take)
        last = tl.maximum(last, tl.max(tl.where(take, j, -1), axis=0))
        base += tl.sum(avail.to(tl.int64), axis=0)
    tl.store(call_fills, tl.minimum(want, base))
    tl.store(hand, tl.where(last >= 0, (h + last + 1) % P, h))


@triton.jit(**JIT_OPTIONS)
def _resident_assign(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, tag, slot_of, call_fills, fill_flag,
                     ticket, rank, free, step, H: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    """Per ticket holder, k its rank in item order: k below the slots granted takes ``free[k]``, evicts its tenant
    (a page no item of this call needs: those are pinned) and marks the slot for the fill; a holder past them
    gives its claim back and is read from the shadow this call (bypass). Ranks in item order, not in the order
    programs ran, make which pages get slots deterministic when there are more tickets than free slots."""
    idx, inb, need, bid, page, _s1, _s2 = _items(tables, TB_STRIDE, nfull, bits, B, need_mask, num_blocks, P, H, BLK)
    win = need & (tl.load(ticket + idx, mask=inb, other=0) != 0)
    k = tl.load(rank + idx, mask=win, other=0).to(tl.int64) - 1
    ok = win & (k < tl.load(call_fills + k * 0, mask=win, other=0))
    slot = tl.load(free + tl.where(ok, k, 0), mask=ok, other=0)
    victim = tl.load(tag + slot, mask=ok, other=-1)
    evict = ok & (victim >= 0)  # its slot_of forgets the slot (a CAS: an entry pointing elsewhere is kept)
    tl.atomic_cas(slot_of + tl.where(evict, victim, page), tl.where(evict, slot, _CMP_NEVER).to(tl.int32),
                  (victim * 0 - 1).to(tl.int32))  # fmt: skip
    tl.store(tag + slot, page, mask=ok)
    tl.store(fill_flag + slot, _FILL, mask=ok)
    tl.store(slot_of + tl.where(win, page, 0), tl.where(ok, slot, -1).to(tl.int32), mask=win)
    tl.atomic_add(step + 3, tl.sum((win & ~ok).to(tl.int64), axis=0))


@triton.jit(**JIT_OPTIONS)
def _resident_fill(src, pool, vpool, gen, tag, tag_gen, call_fills, fill_flag, step, P,
                   H: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CHANNEL_MAJOR: tl.constexpr,
                   SPP: tl.constexpr, VALUES: tl.constexpr):  # fmt: skip
    """Per slot marked for a fill: copy its tenant's keys (and values) from the shadow and tag it with the
    block's generation; every mark of the call (pins too) is cleared, and program 0 resets the ticket counter.

    Warps of one program run unsynchronised, so the marks are read by all of its warps before the barrier and
    cleared only after it: a warp that cleared a mark before a slower one had read it would leave that warp's part
    of the page uncopied (seen on the H200)."""
    pid = tl.program_id(0)
    js = tl.arange(0, SPP)
    ps = pid.to(tl.int64) * SPP + js
    flags = tl.load(fill_flag + ps, mask=ps < P, other=_FREE)
    tl.debug_barrier()
    tl.store(fill_flag + ps, flags * 0, mask=(ps < P) & (flags != _FREE))
    if pid == 0:
        tl.store(call_fills, tl.load(call_fills) * 0)
    for j in range(0, SPP):
        p = pid.to(tl.int64) * SPP + j
        if tl.sum(tl.where(js == j, flags, 0), axis=0) == _FILL:
            e = tl.load(tag + p)
            tl.store(tag_gen + p, tl.load(gen + e // H))
            copy_page(src, e, 0, pool, p, H, M, D, DP, CHANNEL_MAJOR)
            if VALUES:
                copy_page(src, e, 1, vpool, p, H, M, D, DP, CHANNEL_MAJOR)
    tl.atomic_add(step + 2, tl.sum((flags == _FILL).to(tl.int64), axis=0))


def resident_page_in(pool, shadow: torch.Tensor, tables: torch.Tensor, nfull: torch.Tensor, bits: torch.Tensor,
                     need_mask: int, num_blocks: int, sub_blocks: int, channel_major: bool) -> torch.Tensor:  # fmt: skip
    """Make every needed page resident in an explicitly allocated pool (``kv.promotion_cache.ResidentPool``): mark
    (pins and tickets), the tickets ranked in item order, the free slots in hand order, assign, fill; five
    launches, no host synchronisation.
    Returns this call's ``step`` counts ``[4]`` int64 (pages needed, hits, slots filled, pages left without a
    slot)."""
    launch_device_ok(pool.pool)
    R, H, B = bits.shape
    P = pool.slots
    dev = bits.device
    step = torch.zeros(4, dtype=torch.int64, device=dev)
    if R * B == 0:
        return step
    ticket = torch.empty(R, H, B, dtype=torch.int32, device=dev)
    free = torch.empty(P, dtype=torch.int64, device=dev)
    blk = width_class(B).item_block
    grid = (R * H, triton.cdiv(B, blk))
    common = (tables, tables.stride(0), nfull, bits, B, need_mask, num_blocks, P)
    _resident_mark[grid](*common, pool.generation, pool.tag, pool.tag_gen, pool.slot_of, pool.fill_flag, ticket,
                         step, H=H, BLK=blk, num_warps=4)  # fmt: skip
    rank = torch.cumsum(ticket.view(-1), 0, dtype=torch.int32)  # integer sums: deterministic
    _resident_free_slots[(1,)](pool.fill_flag, pool.hand, rank, rank.numel(), pool.call_fills, free, P, CHUNK=1024,
                               num_warps=4)  # fmt: skip
    _resident_assign[grid](*common, pool.tag, pool.slot_of, pool.call_fills, pool.fill_flag, ticket, rank, free,
                           step, H=H, BLK=blk, num_warps=4)  # fmt: skip
    spp = 16
    d = pool.pool.shape[2]
    values = pool.values
    _resident_fill[(triton.cdiv(P, spp),)](
        device_arg(shadow), pool.pool, pool.pool if values is None else values, pool.generation, pool.tag,
        pool.tag_gen, pool.call_fills, pool.fill_flag, step, P, H=H, M=sub_blocks, D=d, DP=next_pow2(d),
        CHANNEL_MAJOR=channel_major, SPP=spp, VALUES=values is not None, num_warps=4,
    )  # fmt: skip
    return step
