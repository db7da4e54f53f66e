"""CUDA graphs of the device write path: a decode step's tokens stored by one graph replay per layer.

The device write path (:func:`certvllm.kv.cuda_pagein.write_tokens_on_device`) is two Triton launches per layer
and step: the shadow scatter and the encoding of the blocks the write completes. Each launch costs tens of
microseconds of Python on the host (argument binding, the launcher), and a served certified decode step is
host-bound (docs/performance.md: 9.4 ms of a 41.9 ms profiled step at 8K × 1 on the H200 went to this path). A
replay of the two launches captured together costs one graph launch and the copies of the inputs.

**Inputs.** A graph reads static buffers of a padded token count (``token_bucket``: the next power of two), shared
by the graphs of every layer with one (dtype, KV heads, head size, bucket) and written before each replay:
``key`` and ``value`` ``[T_b, H_kv, D]`` and ``slots`` ``[T_b]`` int64, the padding slots −1 (the kernels skip
negative slots, so padding stores nothing and encodes nothing). Each graph is keyed by its layer as well, because
the captured launches name that layer's pages, shadow and generation counters.

**Same effect as the eager path.** A replay runs the same two kernels on the same arguments as
``write_tokens_on_device`` on the padded inputs, which equals that function on the unpadded ones: the same shadow
bytes, pages and generation counts (a GPU test compares them).

The first write of a key runs eagerly (it is that write: capture records without running) and is then
captured; at most ``max_graphs`` graphs are kept, least recently used first out. A failed capture leaves every
later write eager, with a warning.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from certvllm.kv.cache import LayerKVCache
from certvllm.kv.cuda_pagein import write_tokens_on_device
from certvllm.kv.graph_capture import GraphStore

if TYPE_CHECKING:
    from certvllm.kv.promotion_cache import PromotionCache

MAX_WRITE_GRAPHS = 1024
"""Write graphs a worker keeps (they allocate nothing: each is two kernel nodes)."""


def token_bucket(tokens: int) -> int:
    """Padded token count of a write of ``tokens`` tokens (≥ 1): the next power of two."""
    if tokens < 1:
        raise ValueError(f"a write needs at least one token, got {tokens}")
    return 1 << (tokens - 1).bit_length()


class _WriteInputs:
    """The static inputs of every write graph of one (dtype, KV heads, head size, token bucket)."""

    def __init__(self, tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.key = torch.zeros(tokens, heads, head_dim, dtype=dtype, device=device)  # [T_b, H_kv, D]
        self.value = torch.zeros_like(self.key)  # [T_b, H_kv, D]
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)  # [T_b], −1: padding

    def load(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Write one write's tokens; the slots past them become −1 (stored nowhere)."""
        t = slots.shape[0]
        self.key[:t].copy_(key)
        self.value[:t].copy_(value)
        self.slots[:t].copy_(slots)
        if self.slots.shape[0] > t:
            self.slots[t:].fill_(-1)


@dataclass
class _WriteGraph:
    graph: torch.cuda.CUDAGraph
    inputs: _WriteInputs


class WriteGraphs(GraphStore[_WriteGraph, _WriteInputs]):
    """The captured device writes of one worker's layers on one CUDA device (see the module docstring).

    Args:
        device: the layers' device.
        max_tokens: writes of more tokens than this run eagerly (the engine's largest decode batch).
        max_graphs: graphs kept, least recently used evicted first.
    """

    def __init__(self, device: torch.device | str, max_tokens: int, max_graphs: int = MAX_WRITE_GRAPHS) -> None:
        super().__init__(device, "max_tokens", max_tokens, max_graphs, "device writes")
        self.max_tokens = int(max_tokens)

    def write(self, layer: Hashable, cache: LayerKVCache, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor, pool: PromotionCache | None = None) -> None:  # fmt: skip
        """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slots`` ``[T]`` (as ``write_tokens_on_device``): replayed
        from this layer's graph of the token bucket, captured at the first write of that key, or run eagerly
        (more than ``max_tokens`` tokens, a stream being captured by someone else, or captures disabled).

        Args:
            layer: the layer's identity (its cache is fixed per key).
            cache: the layer's cache (token-major shadow, pages on this device).
            key, value: the tokens in the shadow's dtype, on this device; slots: int64 on this device.
            pool: the layer's promotion pool (fixed per ``layer``), filled by the write where it is write-through.
        """
        t = slots.shape[0]
        if (t < 1 or t > self.max_tokens or self.disabled is not None
                or torch.cuda.is_current_stream_capturing()):  # fmt: skip
            write_tokens_on_device(cache, key, value, slots, pool)
            return
        bucket = token_bucket(t)
        graph_key = (layer, key.dtype, bucket)
        entry = self._lookup(graph_key)
        if entry is not None:
            entry.inputs.load(key, value, slots)
            entry.graph.replay()
            self.replays += 1
            return
        h, d = key.shape[1], key.shape[2]
        inputs = self._shared_inputs(
            (key.dtype, (h, d), bucket), lambda: _WriteInputs(bucket, h, d, key.dtype, self.device)
        )
        inputs.load(key, value, slots)

        def call() -> None:
            write_tokens_on_device(cache, inputs.key, inputs.value, inputs.slots, pool)

        call()  # this write (the capture below records it without running it)
        captured = self._capture(call)
        if captured is not None:  # else the eager write stands; this worker's writes stay eager from now on
            self._keep(graph_key, _WriteGraph(captured[0], inputs))
