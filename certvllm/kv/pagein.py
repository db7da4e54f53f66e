"""Page-in engine: the one interface that moves shadow pages (tier 2) to where attention runs.

Promotions (FP16 keys or values of chosen blocks), the trailing partial block, and the exact
fallbacks (rung 3 for a head, rung 4 for a layer) all gather shadow pages by block id here, so
the bytes and time they cost are counted in one place. On the CPU the host tier is indexed
directly; a CUDA engine (zero-copy gather from pinned memory on a side stream) implements the
same two methods.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from certvllm.kv.deferred import DeferredStats, ReadBatch

if TYPE_CHECKING:
    from collections.abc import Callable

    from certvllm.kv.cache import LayerKVCache

DirectKeys = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A write-through pool's ``(keys, tag, tag_gen, generation)`` (``PromotionCache.direct_keys``)."""


class PageInError(RuntimeError):
    """A page-in from the host shadow tier failed: its copy could not be allocated (host memory exhausted) or the
    shadow could not be read. The pages were not returned; nothing was computed from them. The CPU plugin then
    recomputes the layer call exactly (``WorkerRuntime.certified``)."""


@dataclass
class PageInStats:
    """Cumulative page-in traffic since the last :meth:`PageInEngine.take_stats`."""

    bytes: int = 0
    seconds: float = 0.0
    key_blocks: int = 0
    value_blocks: int = 0


class PageInEngine:
    """Gathers shadow pages by block id onto ``device`` (the attention device)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.stats = PageInStats()

    def take_stats(self) -> PageInStats:
        stats, self.stats = self.stats, PageInStats()
        return stats

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Traffic inside the block is not counted (policy-exact tokens: their traffic is not exported); the counts
        from before it are kept for the next take."""
        saved, self.stats = self.stats, PageInStats()
        try:
            yield
        finally:
            self.stats = saved

    def take_stats_deferred(self, batch: ReadBatch | None = None) -> DeferredStats:
        """:meth:`take_stats` without reading the device: the counters (``bytes``, ``seconds``,
        ``key_blocks``, ``value_blocks``) as a :class:`~certvllm.kv.deferred.DeferredStats` that is read
        later (here all known on the host: nothing joins ``batch``, the read a device engine's counts join)."""
        return DeferredStats.of(asdict(self.take_stats()))

    def gather_kv(self, cache: LayerKVCache, block_ids: torch.Tensor, kv_heads: torch.Tensor) -> torch.Tensor:
        """Keys and values of single (block, KV head) pages.

        Args:
            cache: the layer's tiered cache.
            block_ids, kv_heads: ``[n]`` int64.

        Returns:
            ``[n, 2, N, D]`` (keys, values; token-major) in the shadow dtype, on ``self.device``.
        """
        start = time.perf_counter()
        out = self._read(lambda: cache.shadow_pages(block_ids, kv_heads))
        self._count(out, start)
        return out

    def gather_blocks(
        self, cache: LayerKVCache, block_ids: torch.Tensor, direct: DirectKeys | None = None
    ) -> torch.Tensor:
        """Whole blocks (all KV heads, keys and values): ``[m, H_kv, 2, N, D]`` on ``self.device``. ``direct``: a
        write-through pool's keys (``PromotionCache.direct_keys``), which a device engine reads instead of the
        shadow where they are current (the same bytes); this host engine reads the shadow."""
        start = time.perf_counter()
        out = self._read(lambda: cache.shadow_blocks(block_ids))
        self._count(out, start)
        return out

    def _read(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``read()`` (a gathered host copy of shadow pages) moved to ``self.device``; a failure of either step
        (the CPU allocator's out-of-memory error, a failed copy) is raised as a :class:`PageInError`."""
        try:
            return read().to(self.device, non_blocking=True)
        except (RuntimeError, MemoryError) as err:
            raise PageInError(f"certvllm: a page-in from the host shadow tier failed: {err}") from err

    def count_promotions(self, key_blocks: int, value_blocks: int) -> None:
        self.stats.key_blocks += key_blocks
        self.stats.value_blocks += value_blocks

    def _count(self, out: torch.Tensor, start: float) -> None:
        self.stats.bytes += out.numel() * out.element_size()
        self.stats.seconds += time.perf_counter() - start


def engine_for(device: torch.device) -> PageInEngine:
    """A new page-in engine for ``device``: zero-copy gathers on a side stream on CUDA
    (``certvllm.kv.cuda_pagein.CudaPageInEngine``), host gathers elsewhere."""
    if device.type == "cuda":
        from certvllm.kv.cuda_pagein import CudaPageInEngine

        return CudaPageInEngine(device)
    return PageInEngine(device)
