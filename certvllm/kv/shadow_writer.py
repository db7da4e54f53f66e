"""A prefill's originals stored into the host tier on a side stream (``CertConfig.overlap_shadow_writes``).

The shadow scatter (``triton_kernels.shadow_write``) stores a write's keys and values into pinned host memory
from the device at PCIe speed (about 1.4 ms per 16K tokens of a LLaMA-3.1-8B layer on an H100), and the stream
waits for it. A :class:`ShadowWriter` stores on its own stream every token of a write except the certified decode
rows' (``rows``: their partial blocks, re-runs and audits read the shadow in the layer call that follows), so
that the layer's attention and the next layers' work run meanwhile. Its contract:

* the step's other readers of those tokens take them from the write's tensors, not from the shadow: the encode of
  the blocks the write completes (``encode_completed_blocks(source=...)``, per token) and the exact prefill
  (``fresh`` keys and values);
* every write first settles (:meth:`settle`): the caller's stream waits for all side stores queued so far (one
  stream, so its last event covers them), so every later reader of any layer (the next layer's and the next
  step's calls, re-runs, audits, pool fills, step prefetches, the next chunk's cached context) finds them in
  place. A layer's stores therefore overlap its own attention and MLP and the next layer's projections
  (milliseconds in a prefill step, against ~0.7 ms of stores per 8K-token chunk); settling is a no-op while a CUDA
  graph is being captured (a captured decode write stays inline and settles at replay time, outside the capture);
* the write generations of the side-stored tokens are bumped on the caller's stream, before the encode, as the
  inline scatter bumps them: the tags the encode gives the pool are the ones it gives without the side stream;
* the tensors the side stream reads are recorded on it, so the caching allocator does not hand them out early.

On a CPU device (the interpreter's tests) there is no side stream: both parts are stored in order, inline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from certvllm.kv.cache import LayerKVCache


class ShadowWriter:
    """The side stream of one device and the event of the last stores queued on it."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last: torch.cuda.Event | None = None

    def settle(self) -> None:
        """Make the current stream wait for every store queued on the side stream so far (no host
        synchronisation; nothing while a CUDA graph is being captured)."""
        if self._last is None or torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_stream(self.device).wait_event(self._last)
        self._last = None

    def scatter(self, cache: LayerKVCache, shadow: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slots: torch.Tensor, rows: torch.Tensor) -> None:  # fmt: skip
        """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slots`` ``[T]`` int64 (device; negative: padding) into
        ``shadow``: the tokens at indices ``rows`` ``[R]`` int64 (device) on the current stream, the others on the
        side stream, with every stored token's write generation bumped on the current stream. The caller encodes
        the completed blocks from ``key``/``value`` afterwards (``encode_completed_blocks(source=...)``)."""
        from certvllm.triton_kernels.shadow_write import scatter_into_shadow

        is_row = torch.zeros(slots.shape[0], dtype=torch.bool, device=slots.device)
        is_row[rows] = True
        row_slots = torch.where(is_row, slots, -1)
        side_slots = torch.where(is_row, -1, slots)
        if cache.generation is not None:  # the side tokens' generations, where the inline scatter bumps them
            stored = side_slots >= 0
            cache.bump_generation(torch.where(stored, side_slots // 16, 0), stored.to(torch.int64))
        scatter_into_shadow(shadow, key, value, row_slots, cache.sub_blocks, 16, cache.generation)
        if self.stream is None:
            scatter_into_shadow(shadow, key, value, side_slots, cache.sub_blocks, 16)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # key/value/slots are ready
        with torch.cuda.stream(self.stream):
            scatter_into_shadow(shadow, key, value, side_slots, cache.sub_blocks, 16)
            event = torch.cuda.Event()
            event.record(self.stream)
        for tensor in (key, value, side_slots):
            tensor.record_stream(self.stream)
        self._last = event
