"""The device-resident state of one layer's certified calls, held by whoever owns the layer (the vLLM
worker's runtime, a benchmark, a test) and passed to ``certified_attention``; nothing is hung on the cache.

* ``pool``: the layer's promotion pool (``promotion_cache.PromotionCache``): unquantized key pages kept in
  VRAM across decode steps;
* ``prefetcher`` / ``prefetch_index``: the worker's step prefetcher (``prefetch.StepPrefetcher``) and this
  layer's place in it.

Both serve the CUDA path only and are sized once, outside any CUDA-graph capture
(:meth:`Residency.for_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.prefetch import StepPrefetcher
    from certvllm.kv.promotion_cache import PromotionCache


def pool_values(decode_pass: str) -> bool:
    """Whether a layer's pool is the resident pass's (``kv.promotion_cache.ResidentPool``: explicit slots, value
    pages too; the pass reads a hit's keys and values unquantized) for this ``CertConfig.decode_pass``."""
    return decode_pass == "resident"


@dataclass
class Residency:
    """One layer's promotion pool and step-prefetch slot (either may be absent)."""

    pool: PromotionCache | None = None
    prefetcher: StepPrefetcher | None = None
    prefetch_index: int = -1

    @classmethod
    def for_layer(cls, cache: LayerKVCache, pool_fraction: float, resident: bool = False,
                  planned_blocks: int | None = None) -> Residency:  # fmt: skip
        """A residency with a new promotion pool of ``pool_fraction`` of the cache's (block, KV head) pages
        (none when the fraction is 0): the hashed ``PromotionCache`` of the two-pass path, or with ``resident``
        (:func:`pool_values`) the explicitly allocated ``ResidentPool`` with value pages. The pool lives on the
        pages' device; only the CUDA path reads it. ``planned_blocks``: the 16-token blocks the device memory was
        planned for, where that is more than the cache holds (``promotion_cache.pool_slots``)."""
        from certvllm.kv.promotion_cache import PromotionCache, ResidentPool, pool_slots

        if pool_fraction <= 0:
            return cls()
        slots = pool_slots(cache, pool_fraction, planned_blocks, values=resident)
        return cls(pool=ResidentPool(cache, slots) if resident else PromotionCache(cache, slots))

    def prefetch_slot(self) -> tuple[Any, int] | None:
        """``(prefetcher, layer index)`` when the layer takes part in a step prefetch, else None."""
        if self.pool is None or self.prefetcher is None or self.prefetch_index < 0:
            return None
        return self.prefetcher, self.prefetch_index
