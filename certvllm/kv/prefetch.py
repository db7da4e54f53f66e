"""Step prefetch: the key pages each layer read over PCIe at the previous decode step, staged into VRAM
on a side stream while the layers before it run.

Why: with the promotion cache (``certvllm.kv.promotion_cache``) a layer call still reads, inside the call
and on its critical path, the promoted key pages that the pool does not hold — mostly the same pages at
every step (they lose their pool slots to other pages; at batch 8 and 128K about 6,700 of 28,000 per call).
Those reads cannot start before the layer's selection. But the set is known one step ahead, and a gather
with few programs on another stream runs beside a layer's kernels instead of in front of them. So:

* at step t, each layer call lists the needed key pages the pool did not serve, and where they sit in the
  ``[R, H_kv, B]`` grid (``index``);
* each layer, once its promotion pass is queued, starts the staging of layer ``i + depth`` into the ring
  slot it just released (the last layers start the next step's first ones); when the step's batch is
  scheduled (:meth:`StepPrefetcher.begin_step`, called by the engine before the forward) the first
  layers' stagings start if nothing started them;
* layer ``i`` waits for its staging, and where the pool left a needed page to the shadow and the staging
  holds it under the block's current write generation, reads it from the staging instead of over PCIe.

Byte layout of the ring (device memory, allocated once, sized by ``CertConfig.prefetch_fraction``)::

    ring    [depth, CAP, 16, D]  shadow dtype   ring[s, i] = unquantized keys of one (block, KV head)
                                                page, token-major (the promotion cache's page layout)
    tag     [depth, CAP]         int64          page id e = block·H_kv + head of ring[s, i], −1 empty
    tag_gen [depth, CAP]         int64          the block's write generation when ring[s, i] was tagged

and per registered layer: ``pages [CAP]`` int64 (the next call's list), ``index [R, H_kv, B]`` int32 (the
entry of each grid position, −1 none) and ``step [4]`` int64 counters. Layer ``i`` uses ring slot
``i mod depth``.

**Never stale.** An entry is served only when its tag equals (page, the block's current generation), as
in the promotion cache. The tags are written by a kernel that completes before the kernel that copies the
pages starts (:func:`certvllm.triton_kernels.prefetch.snapshot_tags`, then ``stage_pages``), both on the
side stream after an event on the main stream: a write queued before that event is seen by both; a write
that lands later bumps the block's generation after its data is in the shadow, so a tag taken before the
bump never matches again, and a tag taken after it was taken after the data landed, which the copy kernel
(launched later) then reads. Blocks that were rewritten and pages that did not fit (``CAP``) are read over
PCIe as before. When the batch changes shape (requests finished or joined, the table widened), each row's
map follows the row that began with the same block at the previous call (:meth:`StepPrefetcher._regrid`).
The staged bytes are the shadow's bytes, so the attention output is bit-for-bit that of a call without
prefetch (tests compare them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from certvllm.kv.deferred import DeferredStats, ReadBatch, take
from certvllm.triton_kernels.tuning import DEFAULT_TUNING, KernelTuning

if TYPE_CHECKING:
    from certvllm.kv.cache import LayerKVCache

#: ring slots: layer i's staging is filled while layers i−depth+1 … i−1 run
DEPTH = 2
#: a layer whose listed pages are under this share of its call's [R, H_kv, B] grid is staged by half the
#: programs: few pages against a long call, so a slower staging still arrives in time and disturbs the
#: call's kernels less; a larger share needs every program to arrive in time
SPARSE_SHARE = 0.05


@dataclass
class _Layer:
    cache: LayerKVCache
    pages: torch.Tensor  # [CAP] int64: the pages to stage for this layer's next call
    step: torch.Tensor  # [4] int64 of the last call: listed, kept (≤ CAP), pool misses, served
    index: torch.Tensor | None = None  # [R, H_kv, B] int32: staging entry per grid position
    ready: torch.cuda.Event | None = None  # recorded on the side stream once the staging is in
    staged: bool = False  # a staging was issued for the coming call (waited for or not)
    first: torch.Tensor | None = None  # [R] int64: the first block id of each row at the last call


class StepPrefetcher:
    """The step prefetch of one device's layers (see the module docstring).

    Args:
        head_dim, dtype, device: of the layers' shadows (one model: all layers alike).
        capacity: staging entries per ring slot (``CAP``).
        depth: ring slots.
        programs: the staging gather's grid (few programs, so that it runs beside the layers' kernels);
            default ``tuning.prefetch_programs``.
        tuning: the staging gather's programs (unless ``programs`` is given) and the pages each has in
            flight (``prefetch_unroll``).
    """

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int,
                 depth: int = DEPTH, programs: int | None = None, *,
                 tuning: KernelTuning = DEFAULT_TUNING) -> None:  # fmt: skip
        if programs is None:
            programs = tuning.prefetch_programs
        if capacity < 1:
            raise ValueError(f"prefetch capacity={capacity}: needs at least one page; or set prefetch_fraction=0")
        if depth < 1:
            raise ValueError(f"prefetch depth={depth}: must be ≥ 1")
        self.capacity, self.depth, self.programs = int(capacity), int(depth), int(programs)
        self.per_iteration = tuning.prefetch_unroll
        self.device = torch.device(device)
        self.ring = torch.zeros(depth, capacity, 16, head_dim, dtype=dtype, device=device)
        self.tag = torch.full((depth, capacity), -1, dtype=torch.int64, device=device)
        self.tag_gen = torch.full((depth, capacity), -1, dtype=torch.int64, device=device)
        self.layers: list[_Layer] = []
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)  # staged, pool misses, served
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if cuda else None
        self.nbytes = self.ring.numel() * self.ring.element_size() + 16 * depth * capacity

    @classmethod
    def for_cache(cls, cache: LayerKVCache, fraction: float, depth: int = DEPTH, *,
                  tuning: KernelTuning = DEFAULT_TUNING) -> StepPrefetcher | None:  # fmt: skip
        """A prefetcher whose ring slots hold ``fraction`` of one layer's (block, KV head) pages (None when
        ``fraction`` is 0). Its device memory is ``depth·fraction`` of one layer's key half in the shadow
        dtype, for all layers together."""
        if fraction <= 0:
            return None
        cap = max(1, math.ceil(fraction * cache.num_blocks * cache.num_kv_heads))
        return cls(cache.layout.head_dim, cache.shadow.dtype, cache.pages.device, cap, depth, tuning=tuning)

    # -- registration ----------------------------------------------------------------------------------
    def register(self, cache: LayerKVCache, at: int | None = None) -> int:
        """Add a layer (in forward order), or replace layer ``at`` (its cache was reallocated), and return
        its index (the layer's ``kv.residency.Residency`` holds it)."""
        if cache.pages.device != self.device:
            raise ValueError(f"layer cache on {cache.pages.device}, prefetcher on {self.device}: one per device")
        if cache.layout.head_dim != self.ring.shape[-1] or cache.shadow.dtype != self.ring.dtype:
            raise ValueError("all layers of a prefetcher need the same head_dim and shadow dtype")
        cache.enable_generations()
        lay = _Layer(cache, torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device),
                     torch.zeros(4, dtype=torch.int64, device=self.device))  # fmt: skip
        if at is None:
            at = len(self.layers)
            self.layers.append(lay)
        else:
            self._wait(self.layers[at])
            self.layers[at] = lay
        return at

    # -- the engine's side -------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The step's batch is scheduled: start staging the first ``depth`` layers (those the previous
        step's last layers have not already started)."""
        for i in range(min(self.depth, len(self.layers))):
            if not self.layers[i].staged:
                self._issue(i)

    def end_step(self) -> None:
        """Make the current stream wait for every staging still in flight (what a CUDA-graph capture of
        one step needs to end joined); the stagings stay valid for the layers' next calls."""
        for lay in self.layers:
            self._wait(lay)

    # -- the layer call's side ---------------------------------------------------------------------------
    def serve(self, i: int, tables: torch.Tensor, nfull: torch.Tensor, bits: torch.Tensor, need_mask: int,
              slot_map: torch.Tensor, nslots: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """After the pool lookup of layer ``i``'s call: serve from the staging what it holds, and list the
        next call's staging. Updates ``slot_map`` in place (staged pages get ``nslots + entry``).

        Returns:
            ``(stage, served)``: the ``[CAP, 16, D]`` staging pages for the promotion pass and a 0-dim
            int64 device tensor, the pages served from them (they cross no PCIe in this call).
        """
        from certvllm.triton_kernels.prefetch import serve_and_record

        lay = self.layers[i]
        cache = lay.cache
        shape = tuple(bits.shape)
        staged = lay.staged
        self._wait(lay)
        lay.staged = False
        if lay.index is None or tuple(lay.index.shape) != shape:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"step prefetch: layer {i} meets a new grid {shape} inside CUDA-graph capture; run the "
                    "shape once before capturing (the prefetch allocates its grid map outside capture)"
                )
            lay.index = self._regrid(lay, tables, shape)
            staged = staged and lay.first is not None
        s = i % self.depth
        lay.step.zero_()
        serve_and_record(tables, nfull, bits, need_mask, cache.num_blocks, cache.generation, slot_map, lay.index,
                         self.tag[s], self.tag_gen[s], lay.pages, lay.step, nslots, staged)  # fmt: skip
        self.counts += lay.step[1:]
        lay.first = tables[:, 0].clone()  # the rows' identities, should the next call's grid differ
        return self.ring[s], lay.step[3]

    @staticmethod
    def _regrid(lay: _Layer, tables: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The grid map for a call whose ``[R, H_kv, B]`` grid differs from the previous call's (requests
        finished or joined, rows moved, the table widened): each row takes the map of the previous row
        that began with the same block — the same request, as far as the block tables tell — and a row
        without one starts empty. A wrong match costs nothing but misses: entries are checked against
        the page they are served for."""
        index = torch.full(shape, -1, dtype=torch.int32, device=tables.device)
        if lay.index is None or lay.first is None or lay.index.shape[1] != shape[1]:
            return index
        same = tables[:, :1] == lay.first.unsqueeze(0)  # [R, R_prev]
        src = same.to(torch.int8).argmax(dim=1)
        b = min(shape[2], lay.index.shape[2])
        index[:, :, :b] = torch.where(same.any(dim=1).view(-1, 1, 1), lay.index[src, :, :b], -1)
        return index

    def after_promote(self, i: int) -> None:
        """Layer ``i``'s promotion pass is queued: its ring slot is free once that runs, so stage layer
        ``i + depth`` there — or, for the last layers, layer ``i + depth − L`` of the next step (when the
        layer count ``L`` is a multiple of ``depth``, so that the ring slot is the same)."""
        j = i + self.depth
        n = len(self.layers)
        if j < n:
            self._issue(j)
        elif n % self.depth == 0 and j - n < n:
            self._issue(j - n)

    # -- internals ---------------------------------------------------------------------------------------
    def _issue(self, i: int) -> None:
        from certvllm.kv.cuda_pagein import ensure_device_readable
        from certvllm.triton_kernels.prefetch import snapshot_tags, stage_pages

        lay = self.layers[i]
        if lay.index is None:  # never called: nothing listed yet
            return
        cache = lay.cache
        shadow = ensure_device_readable(cache)
        sparse = int(SPARSE_SHARE * lay.index.numel())
        s = i % self.depth
        count = lay.step[:1]
        if self.side is not None:  # after everything queued so far on the layer's stream
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):  # None (CPU, the interpreter): in order, no stream
            snapshot_tags(lay.pages, count, cache.generation, self.tag[s], self.tag_gen[s], cache.num_kv_heads)
            stage_pages(self.ring[s], shadow, lay.pages, count, cache.num_kv_heads, cache.sub_blocks,
                        cache.keys_channel_major, self.programs, self.per_iteration, sparse)  # fmt: skip
            if self.side is not None:
                lay.ready = torch.cuda.Event()
                lay.ready.record(self.side)
        lay.staged = True

    def _wait(self, lay: _Layer) -> None:
        if lay.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(lay.ready)
            lay.ready = None

    def take_stats(self) -> dict[str, int]:
        """Return and reset the counters (synchronises once): ``staged`` (pages listed for staging, within
        the capacity), ``candidates`` (needed pages the pool did not hold) and ``served`` (of those, read
        from the staging)."""
        staged, cand, served = (int(x) for x in self.counts.tolist())
        self.counts.zero_()
        return {"staged": staged, "candidates": cand, "served": served}

    def take_stats_deferred(self, batch: ReadBatch | None = None) -> DeferredStats:
        """:meth:`take_stats` without a synchronisation: the counters are copied to pinned host memory and
        zeroed on the device, in stream order, and read when the result is resolved (the same names); with a
        ``batch``, as a member of its read (queued by ``batch.issue()``)."""
        return DeferredStats(names=("staged", "candidates", "served"), read=take(self.counts, batch))
