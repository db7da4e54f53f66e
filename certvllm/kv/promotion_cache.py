"""Device-resident promotion cache: a bounded VRAM pool of unquantized key pages reused across decode steps.

The promotion pass (``triton_kernels.phase2.promote``) reads the unquantized keys of every promoted
(row, KV head, block) from the pinned host shadow over PCIe (zero-copy). The top
blocks of a head change little from one decode step to the next, so most of those reads repeat. This pool
keeps copies of key pages (one 16-token block of one KV head: ``[16, D]`` in the shadow's dtype,
token-major) in device memory:

* ``slots`` entries per layer, sized by ``CertConfig.promotion_cache_fraction`` of the layer's
  (block, KV head) pages, allocated once with the layer's state (``kv.residency.Residency.for_layer``) and
  counted in the VRAM accounting (:attr:`PromotionCache.nbytes`);
* **two choices**: the page ``e = block·H_kv + head`` may live only in slot ``e mod slots`` or in a second
  slot given by a multiplicative hash of ``e`` (:meth:`PromotionCache.slots_of`);
* every slot holds a tag ``(e, generation)``; the block's write generation is
  ``LayerKVCache.generation[block]`` (device memory), which every writer of the block's shadow or page
  increments (``LayerKVCache.write_shadow``/``write_pages``/``copy_blocks``,
  ``cuda_pagein.encode_blocks_from_shadow``). **A slot is served iff its tag equals (e, current
  generation)**: a rewritten block has a larger generation than any copy taken before, so a stale copy is
  never read. Misses read the shadow exactly as before.

Per layer call, :meth:`PromotionCache.lookup` (four Triton kernels, ``triton_kernels.pool``; no host
synchronisation, CUDA-graph capturable) resolves the step's needed pages to slots. Its torch reference,
:meth:`PromotionCache.lookup_reference` (built on :meth:`PromotionCache.resolve`), computes the same
result bit for bit and is what the tests compare the kernels with:

1. hit = the tag of one of the page's two slots matches (e, generation);
2. each slot is claimed by at most one page per step: a hit keeps its slot; otherwise the missing page with
   the largest ``e`` among those whose first slot it is wins it (``scatter_reduce`` amax: deterministic);
   a miss that lost its first slot then claims its second slot if no page claimed that one, again the
   largest ``e`` winning;
3. the slots claimed by misses are filled from the shadow (zero-copy) and their tags set to
   (e, the block's generation);
4. pages that lost their slot (conflicts within the step) keep reading the shadow directly (``slot = -1``).

**Write-through** (:attr:`PromotionCache.write_through`): when the pool has one slot per page (a cache whose
host tier capped it below the blocks the device budget planned: ``pool_slots`` gives the unallocated pages'
memory to the pool), the device write path copies each completed block's keys, read from the shadow to encode
its pages, into the block's own slots and tags them (e, the generation the encode made): the same bytes and
the same tag rule as a fill, with no PCIe read at the block's first promotion.

All of this is stream-ordered: the lookup reads the generations after every write queued before the call,
the fill runs before the promotion kernel, and the next call's lookup after this call's fill. A host write
to the shadow happens after a synchronisation (``write_shadow`` copies its tokens to the host) and its
generation bump is queued behind it, so a fill that raced with the host write carries the old generation
and is never served.

A pool made with ``values=True`` (the resident decode pass, ``CertConfig.decode_pass``) also holds each slot's
value page, filled and tagged with its keys: the resident pass reads a hit's values unquantized too. The
two-pass path reads keys only from the pool (values are promoted for about one block per head and read
zero-copy by the attend pass), so it makes a keys-only pool.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from certvllm.formats.pool_slots import CLAIM_HIT, HASH_MUL
from certvllm.kv.deferred import DeferredStats, ReadBatch, take

if TYPE_CHECKING:
    from certvllm.kv.cache import LayerKVCache


def pool_slots(cache: LayerKVCache, fraction: float, planned_blocks: int | None = None, values: bool = False) -> int:
    """Slots of one layer's pool: ``fraction`` of the cache's (block, KV head) pages (0 when ``fraction`` is 0).

    ``planned_blocks``: the 16-token blocks the device memory was planned for, where the cache holds fewer (a cache
    capped by its host tier, ``vllm_plugin.host_tier``). The pool then takes ``fraction`` of the planned blocks'
    pages (the room the device budget reserved for pools) plus as many slots as the pages of the cut blocks would
    have taken (memory planned for pages that the cap leaves unallocated), at most one slot per page of the cache.
    ``values``: the slots hold value pages too (:func:`bytes_per_slot`)."""
    if fraction <= 0:
        return 0
    heads, pages = cache.num_kv_heads, cache.num_blocks * cache.num_kv_heads
    slots = max(1, math.ceil(fraction * cache.num_blocks * heads))
    cut = (planned_blocks or 0) - cache.num_blocks
    if cut > 0:
        reserved = math.ceil(fraction * cut * heads)
        unallocated = cut * heads * cache.layout.page_bytes // bytes_per_slot(cache, values)
        slots += reserved + unallocated
    return min(slots, max(1, pages))


def bytes_per_slot(cache: LayerKVCache, values: bool = False) -> int:
    """Device bytes of one slot: the key page and its two int64 tags, plus the lookup's two int64 claim entries
    (the hashed pool), or plus the value page (``values``: the resident pass's pool, which claims no slots)."""
    page = cache.layout.block_size * cache.layout.head_dim * cache.shadow.element_size()
    return page + 16 + (page if values else 16)


class PromotionCache:
    """The pool of one layer (see the module docstring).

    Args:
        cache: the layer's cache; its write generations are switched on here.
        slots: number of pool slots (≥ 1).
        values: the slots hold value pages too (module docstring).
    """

    def __init__(self, cache: LayerKVCache, slots: int, values: bool = False) -> None:
        if slots < 1:
            raise ValueError(f"a promotion cache needs at least one slot, got {slots}")
        dev = cache.pages.device
        n, d = cache.layout.block_size, cache.layout.head_dim
        self.slots = int(slots)
        self.num_kv_heads = cache.num_kv_heads
        self.generation = cache.enable_generations()
        self.pool = torch.zeros(self.slots, n, d, dtype=cache.shadow.dtype, device=dev)
        self.values = torch.zeros(self.slots, n, d, dtype=cache.shadow.dtype, device=dev) if values else None
        self.tag = torch.full((self.slots,), -1, dtype=torch.int64, device=dev)  # page id e, −1 empty
        self.tag_gen = torch.full((self.slots,), -1, dtype=torch.int64, device=dev)  # its generation
        # the hashed lookup's claim arrays (triton_kernels.pool), all −1 between calls; rows padded to an even
        # length so that the second starts 16-byte aligned whatever the slot count (alignment is in compile keys).
        # The resident pool (values) allocates its slots explicitly and claims none.
        slots_even = self.slots + self.slots % 2
        self.claims = None if values else torch.full((2, slots_even), -1, dtype=torch.int64, device=dev)
        # cumulative, on the device: pages looked up, hits, slots filled, pages read from the shadow (bypass)
        self.counts = torch.zeros(4, dtype=torch.int64, device=dev)
        self.nbytes = self.slots * bytes_per_slot(cache, values)
        self.pages = cache.num_blocks * cache.num_kv_heads

    @property
    def write_through(self) -> bool:
        """Whether the write path fills this pool (:meth:`write_through_tensors`): a keys-only pool with one slot per
        (block, KV head) page of the cache. Then ``e mod slots = e`` and no page ever conflicts with another, so the
        write of a block can copy its keys into the block's own slots without evicting anything, and a page is
        found in VRAM from its first promotion on. A hashed pool (fewer slots than pages) is filled only by
        lookups."""
        return self.values is None and self.slots == self.pages

    def write_through_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(keys, tag, tag_gen)`` for ``triton_kernels.encode.encode_completed_blocks`` when :attr:`write_through`,
        else None."""
        return (self.pool, self.tag, self.tag_gen) if self.write_through else None

    def direct_keys(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(keys, tag, tag_gen, generation)`` for gathers that may read a page's keys from this pool instead of
        the shadow (``triton_kernels.gather.gather_pages``): only a write-through pool, whose slot of page e is e;
        None otherwise."""
        held = self.write_through_tensors()
        return None if held is None else (*held, self.generation)

    # -- the per-call lookup -------------------------------------------------------------------------
    def slots_of(self, page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two slots page ``e`` may occupy: ``e mod slots`` and a multiplicative hash of ``e`` (exact in
        int64 for ``e < 2^32``)."""
        return page % self.slots, ((page * HASH_MUL) >> 7) % self.slots

    def resolve(
        self, tables: torch.Tensor, need: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1–2 of the lookup, without side effects.

        Args:
            tables: ``[R, B]`` int64 block ids (clamped to ``[0, num_blocks)`` here, as the kernels do).
            need: ``[R, H_kv, B]`` bool, the key pages the promotion pass will read.
            num_blocks: the cache's 16-token block count.

        Returns:
            ``(slot_map, claim, hit)``: ``[R, H_kv, B]`` int32 slot of each needed page that the pool serves
            (−1: read the shadow), ``[slots]`` int64 claim (``−1`` unclaimed, ``e`` a miss to fill,
            ``e + 2^62`` a hit), and the ``[R, H_kv, B]`` bool hits.
        """
        R, K, B = need.shape
        dev = need.device
        bid = tables[:, :B].clamp(0, num_blocks - 1)
        page = bid.unsqueeze(1) * K + torch.arange(K, device=dev, dtype=torch.int64).view(1, K, 1)  # [R, K, B]
        s1, s2 = self.slots_of(page)
        gen = self.generation.index_select(0, bid.reshape(-1)).view(R, 1, B)
        hit1 = need & (self.tag.take(s1) == page) & (self.tag_gen.take(s1) == gen)
        hit2 = need & ~hit1 & (self.tag.take(s2) == page) & (self.tag_gen.take(s2) == gen)
        hit = hit1 | hit2
        miss = need & ~hit
        # round 1: a hit keeps its slot (it outranks every miss); a miss claims its first slot
        claim = torch.full((self.slots,), -1, dtype=torch.int64, device=dev)
        claim.scatter_reduce_(0, torch.where(hit2, s2, s1).reshape(-1),
                              torch.where(hit, page + CLAIM_HIT, torch.where(miss, page, -1)).reshape(-1),
                              reduce="amax")  # fmt: skip
        won1 = miss & (claim.take(s1) == page)
        # round 2: a miss that lost its first slot claims its second one, if nobody claimed that in round 1
        try2 = miss & ~won1 & (claim.take(s2) < 0)
        claim2 = torch.full((self.slots,), -1, dtype=torch.int64, device=dev)
        claim2.scatter_reduce_(0, s2.reshape(-1), torch.where(try2, page, -1).reshape(-1), reduce="amax")
        won2 = try2 & (claim2.take(s2) == page)
        claim = torch.where(claim >= 0, claim, claim2)
        slot_map = torch.where(hit1 | won1, s1, torch.where(hit2 | won2, s2, -1)).to(torch.int32)
        return slot_map, claim, hit

    def lookup(
        self, cache: LayerKVCache, tables: torch.Tensor, nfull: torch.Tensor, bits: torch.Tensor, need_mask: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Resolve, fill the claimed slots from the shadow and retag them, in the five launches of
        ``triton_kernels.pool`` (two for a write-through pool, whose page ``e`` has slot ``e`` alone and needs no
        claims). No host synchronisation.

        Args:
            cache: the layer's cache (the pool's).
            tables: ``[R, B]`` int64 block ids; nfull: ``[R]`` int64 full blocks per row.
            bits: ``[R, H_kv, B]`` int32 promotion bitmasks; the promotion pass reads a block's keys iff
                the block is full and ``bits & need_mask != 0`` (``need_mask`` as int32, −1 = any bit).

        Returns:
            ``(slot_map, paged)``: the ``[R, H_kv, B]`` int32 slot map for the promotion kernel (see
            :meth:`resolve`) and a 0-dim int64 device tensor, the key pages this step reads over PCIe
            (slots filled + pages that bypass the pool).
        """
        from certvllm.kv.cuda_pagein import ensure_device_readable
        from certvllm.triton_kernels.pool import pool_lookup

        shadow = ensure_device_readable(cache)
        slot_map, step = pool_lookup(self.pool, self.tag, self.tag_gen, self.generation, shadow, tables, nfull,
                                     bits, need_mask, cache.num_blocks, cache.sub_blocks,
                                     cache.keys_channel_major, self.claims, self.values,
                                     direct=self.write_through)  # fmt: skip
        return self._count(slot_map, step)

    def lookup_reference(
        self, cache: LayerKVCache, tables: torch.Tensor, nfull: torch.Tensor, bits: torch.Tensor, need_mask: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`lookup` in torch (:meth:`resolve`, then the fill with ``gather.fill_pool``): the same slot
        map, tags, pool contents and counts, bit for bit, in about 35 launches. The reference the tests
        compare the kernels with."""
        from certvllm.kv.cuda_pagein import ensure_device_readable
        from certvllm.triton_kernels.gather import fill_pool

        shadow = ensure_device_readable(cache)
        B = bits.shape[2]
        valid = torch.arange(B, device=bits.device) < nfull.unsqueeze(1)
        need = valid.unsqueeze(1) & ((bits & need_mask) != 0)
        slot_map, claim, hit = self.resolve(tables, need, cache.num_blocks)
        fill = (claim >= 0) & (claim < CLAIM_HIT)
        fill_page = torch.where(fill, claim, -1)
        fill_bid = fill_page.clamp(min=0) // self.num_kv_heads
        self.tag_gen.copy_(torch.where(fill, self.generation.index_select(0, fill_bid), self.tag_gen))
        self.tag.copy_(torch.where(fill, claim, self.tag))
        fill_pool(self.pool, shadow, fill_page, self.num_kv_heads, cache.sub_blocks, cache.keys_channel_major,
                  self.values)  # fmt: skip
        looked = need.sum()
        return self._count(slot_map, torch.stack((looked, hit.sum(), fill.sum(), looked - (slot_map >= 0).sum())))

    def _count(self, slot_map: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add a lookup's step counts to the totals; ``(slot_map, pages read over PCIe)``."""
        self.counts += step
        return slot_map, step[2] + step[3]

    def take_stats(self) -> dict[str, int]:
        """Return and reset the counters (synchronises once): ``lookups`` (pages the promotion pass read),
        ``hits`` (served from a slot that already held them), ``fills`` (slots filled from the shadow) and
        ``bypass`` (pages read from the shadow because another page held their slot this step)."""
        looked, hits, fills, bypass = (int(x) for x in self.counts.tolist())
        self.counts.zero_()
        return {"lookups": looked, "hits": hits, "fills": fills, "bypass": bypass}

    def take_stats_deferred(self, batch: ReadBatch | None = None) -> DeferredStats:
        """:meth:`take_stats` without a synchronisation: the counters are copied to pinned host memory and
        zeroed on the device, in stream order, and read when the result is resolved (the same names); with a
        ``batch``, as a member of its read (queued by ``batch.issue()``)."""
        return DeferredStats(names=("lookups", "hits", "fills", "bypass"), read=take(self.counts, batch))


class ResidentPool(PromotionCache):
    """The pool of the resident decode pass (``CertConfig.decode_pass: resident``): slots allocated explicitly
    instead of by two-choice hashing, each holding a page's keys and values.

    * ``slot_of`` ``[num_blocks·H_kv]`` int32: the slot of page ``e`` or −1 (−2 while a call claims it). A page
      never loses its slot to a hash conflict, nor to the call that needs it: the FIFO ``hand`` gives new pages
      only slots whose tenants the call does not need, so a page stays until the hand comes back round to its
      slot at a call that does not read it.
    * A slot is served iff ``tag[slot] == e`` and ``tag_gen[slot]`` equals the block's current write generation,
      exactly the rule of the hashed pool (module docstring); ``slot_of`` only says where to look, so a stale
      or raced entry can only make a page miss, never serve wrong bytes.
    * :meth:`lookup` (``triton_kernels.pool.resident_page_in``, 5 launches, no host synchronisation) makes the
      needed pages resident: hits are pinned and stay, a page whose slot holds an older generation is refilled in
      place, and each other page takes the next unpinned slot from the hand (evicting its tenant); pages beyond
      the unpinned slots are counted as ``bypass`` and read from the shadow this call. Which pages a call serves
      and evicts does not depend on the order its programs run in (only which new page lands in which of the
      granted slots does), so a CUDA-graph replay from the same pool state reads the same F as the eager call.
      The fill copies keys and values from the shadow and tags the slot with the block's generation, in stream
      order after every write queued before the call.

    Costs over the hashed pool: 4 bytes per (block, KV head) page of the layer for ``slot_of``, and 12 per slot.
    """

    def __init__(self, cache: LayerKVCache, slots: int) -> None:
        super().__init__(cache, slots, values=True)
        dev = cache.pages.device
        self.slot_of = torch.full((cache.num_blocks * cache.num_kv_heads,), -1, dtype=torch.int32, device=dev)
        self.hand = torch.zeros(1, dtype=torch.int64, device=dev)
        self.call_fills = torch.zeros(1, dtype=torch.int64, device=dev)
        self.fill_flag = torch.zeros(self.slots, dtype=torch.int32, device=dev)
        self.nbytes += self.slot_of.numel() * 4 + self.slots * 4 + 16

    def lookup(
        self, cache: LayerKVCache, tables: torch.Tensor, nfull: torch.Tensor, bits: torch.Tensor, need_mask: int
    ) -> tuple[None, torch.Tensor]:
        """Page in every full block with ``bits & need_mask`` (class docstring). Returns ``(None, paged)``: no slot
        map (the resident pass finds slots through ``slot_of``) and the 0-dim count of pages read over PCIe."""
        from certvllm.kv.cuda_pagein import ensure_device_readable
        from certvllm.triton_kernels.pool import resident_page_in

        shadow = ensure_device_readable(cache)
        step = resident_page_in(self, shadow, tables, nfull, bits, need_mask, cache.num_blocks, cache.sub_blocks,
                                cache.keys_channel_major)  # fmt: skip
        self.counts += step
        return None, step[2] + step[3]
