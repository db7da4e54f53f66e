"""Hybrid-attention models under ``--kv-cache-dtype certified``: certified pages on the full-attention layers, native
pages (the model's dtype, vLLM's own attention) on the sliding-window layers.

vLLM keeps chosen layers out of a quantized KV cache with ``--kv-cache-dtype-skip-layers`` (``CacheConfig.
kv_cache_dtype_skip_layers``): a layer with a sliding window (entry ``sliding_window``) or a listed index gets
``kv_cache_dtype="auto"`` when vLLM's ``Attention`` is built, so its backend is vLLM's own and its KV cache spec
a plain one in the model's dtype; the hybrid KV cache manager then puts the certified and the native layers in
separate KV cache groups of one block pool (pages of equal size: vLLM pads or scales the block sizes, so the
certified layers' vLLM block may hold more tokens than ``--block-size``).

What this module adds:

* :func:`prepare` (startup, in the process that builds the config): a model with sliding-window layers gets
  ``sliding_window`` in that list (logged), since a window cannot be certified (the certificate covers attention
  over the whole cached context, and the certified kernels have no window); a model whose every layer slides has
  nothing to certify and is refused with the fix.
* :class:`CertifiedLayout` (engine core, from vLLM's KV cache groups): which layers are certified, their block size
  and how many host shadows one pool block needs. vLLM lays the groups over the same memory (the ``k``-th layer of
  every group starts at the same offset of one backing allocation in 0.32/0.33, shares one tensor in 0.26) and hands
  a block id to one group at a time, and each certified layer's shadow mirrors that: certified layers whose KV
  tensors are the same memory share one shadow (``runtime.WorkerRuntime.bind``), so a pool block needs
  ``shadow_slots`` shadow pages, the largest number of certified layers in one group, not one per certified layer.
  The host tier's budget, its cap on the block count and its minimum (one ``max_model_len`` request in every group
  of the pool, vLLM's own figure) are computed from it (``host_tier``), and so is the CUDA promotion cache's room
  (``device_budget``).

Capacity arithmetic (per pool block, this rank; ``B_c`` the certified layers' block size, ``H`` their KV heads):
device ``max over groups of Σ pages`` (vLLM's divisor of the KV memory), host ``shadow_slots · B_c · H · 2 · D ·
itemsize``. With ``--block-size`` ``B`` and native pages of ``2·D·itemsize`` bytes per token and head against the
certified ``2·D``, vLLM scales the certified block to ``B_c = itemsize · B`` (0.32, CPU) or pads the native page
(0.26, CUDA: ``B_c`` = 32, native blocks of 16 tokens).

Native layers never reach certvllm's code: their outputs are vLLM's exact attention over unquantized originals, so
the rule that every head-step is certified or exact still holds; ``vllm:cert_layer_certified`` shows which layers
are which (``docs/metrics.md``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from certvllm.vllm_plugin.layer_kinds import (
    SKIP_SLIDING,
    certified_layer_count,
    config_field,
    layer_index,
    native_layers,
    skipped_indices,
    sliding_layers,
)
from certvllm.vllm_plugin.preflight import StartupRefusal

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers

__all__ = [
    "SKIP_SLIDING", "CertifiedLayout", "certified_layer_count", "is_certified_spec", "layer_numbers",
    "native_layers", "planned_layout", "planning", "prepare", "skipped_indices", "sliding_layers",
]  # fmt: skip


# -- startup (the process that builds the config) -----------------------------------------------------------------
def prepare(vllm_config: Any) -> None:
    """Keep the sliding-window layers of a certified run in the model's dtype (``--kv-cache-dtype-skip-layers
    sliding_window``, added and logged when the model has such layers); refuse a model with nothing to certify.

    Runs in every process that checks the config (vLLM's ``check_and_update_config``), before the workers build the
    model: ``Attention.__init__`` reads the list there. Idempotent."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    text = getattr(model, "hf_text_config", None)
    num_layers = config_field(text, "num_hidden_layers") if text is not None else None
    if not isinstance(num_layers, int) or num_layers <= 0:
        return
    sliding = sliding_layers(text) or set()
    if getattr(cache, "sliding_window", None) is not None:  # vLLM's one window for every layer
        sliding = set(range(num_layers))
    skip = list(getattr(cache, "kv_cache_dtype_skip_layers", None) or [])
    native = sliding | {i for i in skipped_indices(skip) if 0 <= i < num_layers}
    if not native:
        return
    if len(native) >= num_layers:
        window = config_field(text, "sliding_window") or getattr(cache, "sliding_window", None)
        what = f"has a sliding window ({window} tokens)" if sliding else "has no window"
        raise StartupRefusal(
            f"certvllm: every one of the {num_layers} attention layers of this model {what} or is listed in "
            f"--kv-cache-dtype-skip-layers ({' '.join(skip) or '-'}): none can hold certified pages (a window "
            "cannot be certified; such layers keep native pages). Serve it with --kv-cache-dtype auto, list fewer "
            "layers in --kv-cache-dtype-skip-layers, or use --disable-sliding-window (vLLM then caps --max-model-len "
            "at the window) to certify every layer."
        )
    if sliding and SKIP_SLIDING not in skip:
        # sorted, as vLLM keeps it (the list is a hash factor of the compile cache)
        cache.kv_cache_dtype_skip_layers = sorted({*skip, SKIP_SLIDING})
    dtype = str(model.dtype).removeprefix("torch.")
    logger.info(
        "certvllm: hybrid model: %d of %d attention layers keep native %s pages (%d with a sliding window; "
        "--kv-cache-dtype-skip-layers %s), the other %d are certified",
        len(native), num_layers, dtype, len(sliding), " ".join(cache.kv_cache_dtype_skip_layers),
        num_layers - len(native),
    )  # fmt: skip


# -- the engine core's view: vLLM's KV cache groups ---------------------------------------------------------------
def is_certified_spec(spec: Any) -> bool:
    """A layer spec of certified pages: attention pages of ``uint8`` (the ``certified`` dtype; native layers keep
    the model's float dtype)."""
    return getattr(spec, "dtype", None) == torch.uint8 and hasattr(spec, "num_kv_heads")


def _layer_specs(group: Any) -> list[tuple[str, Any]]:
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    if isinstance(per_layer, dict):
        return [(name, per_layer[name]) for name in group.layer_names if name in per_layer]
    return [(name, spec) for name in group.layer_names]


def _request_blocks(spec: Any, vllm_config: Any) -> int:
    """Pool blocks one ``max_model_len`` request takes in a group with ``spec`` (vLLM's own figure)."""
    pages = getattr(spec, "max_memory_usage_pages", None)
    if callable(pages):  # UniformTypeKVCacheSpecs
        return int(pages(vllm_config))
    return math.ceil(spec.max_memory_usage_bytes(vllm_config) / spec.page_size_bytes)


@dataclass(frozen=True)
class CertifiedLayout:
    """The certified layers of one worker's KV cache groups (vLLM's ``KVCacheGroupSpec`` list).

    Attributes:
        certified: names of the layers with certified pages, in group order.
        native: names of the other layers (model-dtype pages, vLLM's own attention).
        block_size: tokens per vLLM block of the certified layers (vLLM may scale it above ``--block-size`` so
            that their page matches the native layers').
        kv_heads, head_size: of the certified layers (this rank's heads).
        shadow_slots: host shadows per pool block: the most certified layers of one group (layer ``k`` of every
            group shares one tensor, and the certified layers among them one shadow).
        request_blocks: pool blocks one ``max_model_len`` request takes, every group together (vLLM's figure).
        groups: KV cache groups.
        pool_bytes_per_block: device bytes of one pool block (the largest group's pages: vLLM's divisor of the KV
            memory).
    """

    certified: tuple[str, ...]
    native: tuple[str, ...]
    block_size: int
    kv_heads: int
    head_size: int
    shadow_slots: int
    request_blocks: int
    groups: int
    pool_bytes_per_block: int

    @property
    def hybrid(self) -> bool:
        return bool(self.native)

    @classmethod
    def from_groups(cls, vllm_config: Any, groups: list[Any]) -> CertifiedLayout | None:
        """The layout of ``groups``; None where they hold no attention layer (an attention-free model)."""
        certified: list[str] = []
        native: list[str] = []
        slots = 0
        geometry: set[tuple[int, int, int]] = set()
        request_blocks = 0
        pool_bytes = 0
        for group in groups:
            if getattr(group, "host_resident", False):
                continue
            in_group = 0
            specs = _layer_specs(group)
            pool_bytes = max(pool_bytes, sum(spec.page_size_bytes for _, spec in specs))
            for name, spec in specs:
                if is_certified_spec(spec):
                    certified.append(name)
                    geometry.add((spec.block_size, spec.num_kv_heads, spec.head_size))
                    in_group += 1
                else:
                    native.append(name)
            slots = max(slots, in_group)
            request_blocks += _request_blocks(group.kv_cache_spec, vllm_config)
        if not certified and not native:
            return None
        if not certified:
            raise StartupRefusal(
                "certvllm: --kv-cache-dtype certified left no attention layer with certified pages (every layer has a "
                "sliding window or is listed in --kv-cache-dtype-skip-layers). Serve this model with --kv-cache-dtype "
                "auto, or list fewer layers."
            )
        if len(geometry) != 1:
            raise StartupRefusal(
                f"certvllm: the certified layers do not share one page geometry ((block size, KV heads, head size): "
                f"{sorted(geometry)}); serve this model with --kv-cache-dtype auto."
            )
        ((block_size, kv_heads, head_size),) = geometry
        return cls(tuple(certified), tuple(native), block_size, kv_heads, head_size, slots, request_blocks,
                   len(groups), pool_bytes)  # fmt: skip

    def shadow_bytes_per_block(self, itemsize: int) -> int:
        """Host bytes of one pool block's shadow pages on this rank (keys and values, every shadow slot)."""
        return self.shadow_slots * self.block_size * self.kv_heads * 2 * self.head_size * itemsize

    def describe(self) -> str:
        """For the startup log: the split by layer number, the groups, the block size and the shadow pages per
        block."""
        return (f"certified layers {layer_numbers(self.certified)}; native layers {layer_numbers(self.native) or '-'}; "
                f"{self.groups} KV cache groups; {self.block_size}-token certified blocks; {self.shadow_slots} shadow "
                f"page{'s' * (self.shadow_slots != 1)} per pool block")  # fmt: skip


def layer_numbers(names: tuple[str, ...] | list[str]) -> str:
    """``model.layers.11.self_attn.attn, model.layers.5.self_attn.attn`` → ``5, 11``: the layer numbers in order
    (names without a number after them, as they are)."""
    numbers = sorted(layer_index(name) for name in names if layer_index(name) >= 0)
    return ", ".join([*(str(n) for n in numbers), *(name for name in names if layer_index(name) < 0)])


_PLANNING: contextvars.ContextVar[CertifiedLayout | None] = contextvars.ContextVar("certvllm_layout", default=None)


@contextlib.contextmanager
def planning(layout: CertifiedLayout | None) -> Iterator[None]:
    """While vLLM turns memory into a block count for these groups, the host tier's cap reads ``layout``."""
    token = _PLANNING.set(layout)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def planned_layout() -> CertifiedLayout | None:
    """The layout of the groups vLLM is planning now (:func:`planning`), else None."""
    return _PLANNING.get()
