"""CUDA page-in: zero-copy gathers from the pinned host shadow, on a side stream.

The shadow (tier 2) is host memory registered with CUDA (``cudaHostRegister``, see ``kv/host.py``), so
its address is valid on the device: a gather kernel reads the wanted pages over PCIe directly into a
device buffer, with no staging copy and no host synchronisation, and with thousands of pages in flight
where a copy per page would pay a transfer's latency for each. The kernel is the Triton gather
(``certvllm.triton_kernels.gather``).

Certified attention on CUDA reads promoted pages inside its phase-2 kernels (the same zero-copy reads,
fused); this engine serves the trailing partial block, the exact fallbacks and any caller that wants
pages in device memory. Gathers run on a side stream ordered after the caller's stream; the ``*_async``
methods return an event the consumer waits on, so the gather overlaps other work.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from certvllm.kv.deferred import DeferredRead, DeferredStats, ReadBatch
from certvllm.kv.pagein import DirectKeys, PageInEngine, PageInStats

if TYPE_CHECKING:
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.promotion_cache import PromotionCache
    from certvllm.kv.shadow_copy import ShadowCopier, ShadowRun

logger = logging.getLogger("certvllm")


@dataclass
class RecordedTraffic:
    """What a CUDA-graph capture of a call would have counted (:meth:`CudaPageInEngine.recording`): the host's
    bytes, and the ``[3]`` int64 device tensor of its device counts (rewritten by every replay), or None."""

    host_bytes: int = 0
    device_counts: torch.Tensor | None = None


_registered: set[int] = set()
_lock = threading.Lock()


def ensure_device_readable(cache: LayerKVCache) -> torch.Tensor:
    """The cache's shadow, made readable from the device: device memory and pinned host memory are used
    as they are; pageable host memory is registered with CUDA once (``cudaHostRegister``, precondition P4).

    Returns the shadow tensor (unchanged object)."""
    shadow = cache.shadow
    if shadow.device.type != "cpu" or not torch.cuda.is_available() or cache.pages.device.type != "cuda":
        return shadow
    if shadow.is_pinned():
        return shadow
    ptr = shadow.data_ptr()
    with _lock:
        if ptr not in _registered:
            nbytes = shadow.numel() * shadow.element_size()
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
            if int(err) != 0:
                from certvllm.kv.host import PinnedMemoryError

                raise PinnedMemoryError(
                    f"cudaHostRegister failed ({err}) for {nbytes / 2**30:.2f} GiB of shadow pages: the device "
                    "cannot read the host tier; allocate it with certvllm.kv.host.allocate_host(pin=True)"
                )
            _registered.add(ptr)
            weakref.finalize(shadow, _unregister_ptr, ptr)  # before the allocator reuses the address
            logger.info("certvllm: registered %.2f GiB of shadow pages with CUDA", nbytes / 2**30)
    return shadow


def _unregister_ptr(ptr: int) -> None:
    with _lock:
        if ptr in _registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
            _registered.discard(ptr)


def unregister(cache: LayerKVCache) -> None:
    """Undo :func:`ensure_device_readable` for this cache's shadow (done automatically when the shadow
    tensor is garbage collected)."""
    _unregister_ptr(cache.shadow.data_ptr())


def _gather(cache: LayerKVCache, ids: torch.Tensor, heads: torch.Tensor | None, device: torch.device,
            direct: DirectKeys | None = None) -> torch.Tensor:  # fmt: skip
    from certvllm.triton_kernels.gather import gather_pages

    return gather_pages(ensure_device_readable(cache), ids, heads, device, channel_major=cache.keys_channel_major,
                        direct=direct)  # fmt: skip


class CudaPageInEngine(PageInEngine):
    """Zero-copy page-in on a side stream (the CUDA implementation of :class:`PageInEngine`).

    Args:
        device: the attention device (a CUDA device; ``cpu`` runs the Triton gather in the interpreter).
        side_stream: gather on a dedicated stream (ordered after the caller's stream by an event).
    """

    def __init__(self, device: torch.device | str = "cuda", side_stream: bool = True) -> None:
        super().__init__(device)
        self._stream = torch.cuda.Stream(self.device) if side_stream and self.device.type == "cuda" else None
        self._device_counts: torch.Tensor | None = None  # [3] int64: key blocks, value blocks, bytes

    # -- gathers ---------------------------------------------------------------------------------
    def _run(self, cache: LayerKVCache, ids: torch.Tensor, heads: torch.Tensor | None, direct: DirectKeys | None = None,
             fork_in_capture: bool = False) -> tuple[torch.Tensor, object]:  # fmt: skip
        """Gather (``ids[i]``, ``heads[i]``) pages, or with ``heads`` None every KV head of each id (block-major),
        on the side stream (``event`` marks the end: the caller waits for it). In a CUDA-graph capture the gather
        is captured on the current stream (``event`` None), unless ``fork_in_capture``: then the side stream is a
        branch of the graph, which the caller's wait joins."""
        start = time.perf_counter()
        ids = ids.to(self.device, torch.int64, non_blocking=True)
        if heads is not None:
            heads = heads.to(self.device, torch.int64, non_blocking=True)
        if self._stream is None or (torch.cuda.is_current_stream_capturing() and not fork_in_capture):
            out = _gather(cache, ids, heads, self.device, direct)
            event = None
        else:
            main = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(main)
            # the id tensors were made on the caller's stream and are often temporaries (gather_blocks_async's
            # are): without this, the caller's next allocations may reuse their memory before the gather reads
            # it, and the gather then follows garbage block ids (an illegal address, or wrong pages)
            ids.record_stream(self._stream)
            if heads is not None:
                heads.record_stream(self._stream)
            with torch.cuda.stream(self._stream):
                out = _gather(cache, ids, heads, self.device, direct)
                event = torch.cuda.Event()
                event.record(self._stream)
            out.record_stream(main)
        self.stats.bytes += out.numel() * out.element_size()
        self.stats.seconds += time.perf_counter() - start
        return out, event

    @staticmethod
    def wait(event: object) -> None:
        """Make the current stream wait for a gather returned by an ``*_async`` method."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)  # type: ignore[arg-type]

    def gather_kv_async(
        self, cache: LayerKVCache, block_ids: torch.Tensor, kv_heads: torch.Tensor
    ) -> tuple[torch.Tensor, object]:
        """:meth:`gather_kv` without waiting: ``([n, 2, N, D], event)``."""
        return self._run(cache, block_ids.reshape(-1), kv_heads.reshape(-1))

    def gather_blocks_async(self, cache: LayerKVCache, block_ids: torch.Tensor, direct: DirectKeys | None = None,
                            fork_in_capture: bool = False) -> tuple[torch.Tensor, object]:  # fmt: skip
        """:meth:`gather_blocks` without waiting: ``([n, H_kv, 2, N, D], event)``; ``fork_in_capture``: as
        :meth:`_run`'s (the caller must wait for ``event`` before its capture ends)."""
        ids = block_ids.reshape(-1)
        out, event = self._run(cache, ids, None, direct, fork_in_capture)  # every head of each block, in one launch
        return out.view(ids.numel(), cache.num_kv_heads, 2, cache.layout.block_size, cache.layout.head_dim), event

    def gather_kv(self, cache: LayerKVCache, block_ids: torch.Tensor, kv_heads: torch.Tensor) -> torch.Tensor:
        out, event = self.gather_kv_async(cache, block_ids, kv_heads)
        self.wait(event)
        return out

    def gather_blocks(
        self, cache: LayerKVCache, block_ids: torch.Tensor, direct: DirectKeys | None = None
    ) -> torch.Tensor:
        """The base class's, with ``direct``'s current keys read from device memory (the bytes counted are the
        whole pages' all the same: the exact prefill that passes ``direct`` runs uncounted)."""
        out, event = self.gather_blocks_async(cache, block_ids, direct)
        self.wait(event)
        return out

    # -- traffic counted on the device (no synchronisation until take_stats; none with take_stats_deferred) --
    def add_device_counts(self, key_blocks: torch.Tensor, value_blocks: torch.Tensor, nbytes: torch.Tensor) -> None:
        """Add promotion counts and fused page-in bytes held in 0-dim device tensors."""
        self.add_device_count_vector(torch.stack((key_blocks, value_blocks, nbytes)).to(torch.int64))

    def add_device_count_vector(self, counts: torch.Tensor) -> None:
        """Add ``[3]`` int64 device counts: key blocks, value blocks, fused page-in bytes (the call's
        ``triton_kernels.finalize.TrafficCount``)."""
        self._device_counts = counts if self._device_counts is None else self._device_counts + counts

    @contextmanager
    def recording(self) -> Iterator[RecordedTraffic]:
        """Around a CUDA-graph capture: the counts the captured work adds are set apart (nothing moved
        during the capture) into the yielded record, for :meth:`add_recorded` after each replay; the
        counts from before are kept."""
        saved = self.stats, self._device_counts
        self.stats, self._device_counts = PageInStats(), None
        record = RecordedTraffic()
        try:
            yield record
        finally:
            record.host_bytes, record.device_counts = self.stats.bytes, self._device_counts
            self.stats, self._device_counts = saved

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Traffic inside the block, host and device counts, is not counted; the counts from before are kept."""
        with self.recording():
            yield

    def add_recorded(self, record: RecordedTraffic) -> None:
        """Count one replay of a captured call (its device counts are copied: the next replay rewrites them)."""
        self.stats.bytes += record.host_bytes
        if record.device_counts is not None:
            counts = record.device_counts
            self._device_counts = counts.clone() if self._device_counts is None else self._device_counts + counts

    def take_stats(self) -> PageInStats:
        """Return and reset the counters (synchronises once to read the device-side counts)."""
        if self._device_counts is not None:
            k, v, b = (int(x) for x in self._device_counts.tolist())
            self.stats.key_blocks += k
            self.stats.value_blocks += v
            self.stats.bytes += b
            self._device_counts = None
        return super().take_stats()

    def take_stats_deferred(self, batch: ReadBatch | None = None) -> DeferredStats:
        """:meth:`take_stats` without a synchronisation: the host counts now, the device counts (promoted key
        and value blocks, fused page-in bytes) as a pinned host copy queued in stream order, read when the
        result is resolved (with a ``batch``: as a member of its read, queued by ``batch.issue()``). The next
        call's device counts start from nothing."""
        counts, self._device_counts = self._device_counts, None
        host = asdict(super().take_stats())  # the host counts only: the device ones are taken above
        if counts is None:
            return DeferredStats.of(host)
        read = batch.add([counts]) if batch is not None else DeferredRead([counts])
        return DeferredStats(host, ("key_blocks", "value_blocks", "bytes"), read)


def write_tokens_on_device(
    cache: LayerKVCache,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    pool: PromotionCache | None = None,
    runs: Sequence[ShadowRun] = (),
    copier: ShadowCopier | None = None,
) -> None:
    """The CUDA write path with no host synchronisation and two launches: this step's tokens go into the shadow
    by device stores, each bumping its block's write generation (``triton_kernels.shadow_write``), then every
    block a token completes (its offset is the last of the block) is encoded into its pages and its generation
    bumped again (``triton_kernels.encode.encode_completed_blocks``, offsets formed in the kernel; a block's tokens that
    are in this write, as all of a prefill's are, are read from ``key``/``value`` in VRAM, the others from the
    shadow over PCIe). The same
    shadow bytes, pages and generations as ``LayerKVCache.write_shadow`` followed by
    :func:`encode_blocks_from_shadow` of the blocks it returns, which bring the slots and the keys to the host.

    Args:
        cache: the layer's cache (token-major shadow, pages on the device).
        key, value: ``[T, H_kv, D]`` in the shadow's dtype, on the pages' device.
        slots: ``[T]`` token slots (16-token block · 16 + offset) on the device; negative: padding, skipped.
        pool: the layer's promotion pool; when it is write-through (``PromotionCache.write_through``) the
            completed blocks' keys go into their slots too.
        runs, copier: engine blocks the write fills completely (``shadow_copy.full_block_runs``) and the device's
            :class:`~certvllm.kv.shadow_copy.ShadowCopier`: those tokens reach the shadow by the copy engines, the
            rest by the SM stores (same bytes and generations).
    """
    from certvllm.triton_kernels.encode import encode_completed_blocks
    from certvllm.triton_kernels.shadow_write import scatter_into_shadow

    if cache.keys_channel_major:
        raise ValueError("the device write path needs a token-major shadow (the CPU layout is channel-major)")
    if cache.layout.block_size != 16:
        raise ValueError(f"the device write path encodes 16-token blocks, the layout has {cache.layout.block_size}")
    shadow = ensure_device_readable(cache)
    slots = slots.to(cache.pages.device, torch.int64)
    if runs:
        if copier is None:
            raise ValueError("runs of full blocks to copy need the device's ShadowCopier")
        for start, end in copier.write(cache, key, value, runs):  # the tokens the copies leave to the SM stores
            scatter_into_shadow(shadow, key[start:end], value[start:end], slots[start:end], cache.sub_blocks, 16,
                                cache.generation)  # fmt: skip
    else:
        scatter_into_shadow(shadow, key, value, slots, cache.sub_blocks, 16, cache.generation)
    encode_completed_blocks(cache.pages, shadow, slots, cache.layout, cache.num_kv_heads, cache.sub_blocks,
                            cache.generation, None if pool is None else pool.write_through_tensors(),
                            source=(key, value))  # fmt: skip


def encode_blocks_from_shadow(cache: LayerKVCache, block_ids: torch.Tensor) -> None:
    """The CUDA write path: (re)encode the pages of full 16-token blocks from their shadow originals with
    the Triton write kernel, in place, for every KV head — what ``LayerKVCache.write`` does with
    ``encode_pages`` once a block fills, with the same bytes. The kernel reads the shadow zero-copy.

    Args:
        cache: the layer's cache (pages on the device).
        block_ids: ``[n]`` int64 ids of full blocks (on the pages' device); negative entries are skipped.
    """
    from certvllm.triton_kernels.encode import encode_into

    shadow = ensure_device_readable(cache)
    dev = cache.pages.device
    listed = block_ids.reshape(-1).to(dev, torch.int64)
    ids = listed.clamp(min=0)
    h, m = cache.num_kv_heads, cache.sub_blocks
    n, d, pb = cache.layout.block_size, cache.layout.head_dim, cache.layout.page_bytes
    item_ids = ids.repeat_interleave(h)
    heads = torch.arange(h, device=dev).repeat(ids.numel())
    e, sub = item_ids // m, item_ids % m
    run = m * n * d  # elements of one (engine block, head, k|v) run of the shadow
    kbase = (e * h + heads) * 2 * run
    if cache.keys_channel_major:
        k_off, stride = kbase + sub * n, m * n
    else:
        k_off, stride = kbase + sub * n * d, None
    v_off = kbase + run + sub * n * d
    dst = torch.where(listed.repeat_interleave(h) >= 0, ((e * h + heads) * m + sub) * pb, -1)
    encode_into(cache.pages, dst, shadow, k_off, shadow, v_off, cache.layout, stride)
    cache.bump_generation(ids, (listed >= 0).to(torch.int64))  # the pages changed: copies taken before are stale
