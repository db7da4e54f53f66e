"""The host tier of a vLLM run: its memory budget (engine side) and its shadow pages (worker side).

Every device block has a shadow page per layer in host memory, ``[H_kv, 2, N, D]`` in the model's
dtype (pinned on CUDA, ordinary memory on CPU; :func:`layer_cache`). The shadow is indexed by block
id, so it lives exactly as long as the device block: a freed, preempted or aborted request's blocks are
simply rewritten by their next owner, and nothing is held per request. The worker's layers are held by
``runtime.WorkerRuntime``.

Budget: ``host_memory_gb`` (``--cert-host-memory-gb``), or half of the available host memory when
unset. The KV planner's block count is capped to what the budget can shadow (logged); a budget that
cannot shadow one full-length request refuses to start, naming the flag.

Only certified layers have shadows. In a hybrid model (``hybrid.py``) the sliding-window layers keep native pages
and no shadow, and certified layers whose KV tensors are the same memory (vLLM lays the KV cache groups of one pool
over each other) share one: the arithmetic then comes from vLLM's KV cache groups (:class:`hybrid.CertifiedLayout`,
read while vLLM plans the block count), and before the groups exist (the startup check) from the model config's
layer types, as a lower bound.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from certvllm.config import CertConfig
from certvllm.formats.layout import CODE_LEVELS, PageLayout
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.host import allocate_host
from certvllm.vllm_plugin import hybrid, settings
from certvllm.vllm_plugin.preflight import (
    StartupRefusal,
    default_budget_bytes,
    gib_at_least,
    min_request_blocks,
    shadow_bytes_per_token,
)

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
GIB = 1 << 30


def _itemsize(vllm_config: Any) -> int:
    return torch.empty((), dtype=vllm_config.model_config.dtype).element_size()


def native_layer_count(vllm_config: Any) -> int:
    """Attention layers the model config keeps in the model's dtype (sliding windows, ``--kv-cache-dtype-skip-layers``
    indices: ``hybrid.native_layers``); 0 for a model without (or a config without a readable ``hf_text_config``)."""
    model = vllm_config.model_config
    text = getattr(model, "hf_text_config", None)
    total = getattr(text, "num_hidden_layers", None)
    if text is None or not isinstance(total, int):
        return 0
    skip = getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None)
    return len(hybrid.native_layers(text, total, skip) or ())


def certified_layers(vllm_config: Any) -> int:
    """This rank's attention layers with certified pages before vLLM's KV cache groups exist: its layers minus the
    model's native ones (a lower bound on a pipeline stage, which holds a part of the layers)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return max(0, model.get_num_layers(parallel) - native_layer_count(vllm_config))


def shadow_bytes_per_block(vllm_config: Any, layout: hybrid.CertifiedLayout | None = None) -> int:
    """Host bytes one pool block's shadow pages take on this rank: ``layout``'s (or, while vLLM plans the block
    count, the planned groups', ``hybrid.planned_layout``), else every certified layer of the model config at
    ``--block-size``."""
    layout = layout or hybrid.planned_layout()
    if layout is not None:
        return layout.shadow_bytes_per_block(_itemsize(vllm_config))
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    heads = model.get_num_kv_heads(parallel)
    per_token = shadow_bytes_per_token(
        certified_layers(vllm_config), heads, model.get_head_size(), _itemsize(vllm_config)
    )
    return vllm_config.cache_config.block_size * per_token


def node_ranks(vllm_config: Any) -> int:
    """Tensor-parallel ranks of this engine: each shadows its own KV heads of every block, all from the one
    node's budget (``--cert-host-memory-gb`` is per node)."""
    return max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))


def node_bytes_per_block(vllm_config: Any, layout: hybrid.CertifiedLayout | None = None) -> int:
    """Host bytes one vLLM block's shadow pages take on this node: every certified layer, every rank."""
    return shadow_bytes_per_block(vllm_config, layout) * node_ranks(vllm_config)


def budget_bytes(cfg: CertConfig) -> int:
    """The host tier's budget on this node: ``host_memory_gb``, or half of the memory available now (the smaller
    of the machine's and the container's headroom: ``preflight.default_budget_bytes``). Tensor-parallel ranks share
    it (:func:`node_bytes_per_block`)."""
    if cfg.host_memory_gb is not None:
        return int(cfg.host_memory_gb * GIB)
    return default_budget_bytes()


def min_blocks(vllm_config: Any, layout: hybrid.CertifiedLayout | None = None) -> int:
    """Pool blocks one request of ``max_model_len`` tokens needs, the least useful capacity: with the KV cache groups
    (``layout``, or the planned ones), vLLM's figure for every group together plus one; before them, the blocks of
    one group (plus one, except for a hybrid model, whose figure is then only a lower bound: its native groups and
    block size are not known yet)."""
    layout = layout or hybrid.planned_layout()
    if layout is not None:
        return layout.request_blocks + 1
    max_len, block = vllm_config.model_config.max_model_len, vllm_config.cache_config.block_size
    if native_layer_count(vllm_config):
        return math.ceil(max_len / block)
    return min_request_blocks(max_len, block)


def _refuse(vllm_config: Any, cfg: CertConfig, capacity: int, per_block: int,
            layout: hybrid.CertifiedLayout | None = None) -> StartupRefusal:  # fmt: skip
    """The refusal of a budget below one full-length request (``certvllm serve`` prints it as one line, exit 2)."""
    need = min_blocks(vllm_config, layout)
    budget = "" if cfg.host_memory_gb is None else f" {cfg.host_memory_gb:g}"
    origin = "" if cfg.host_memory_gb is not None else " (unset: half of the host memory available at startup)"
    return StartupRefusal(
        f"certvllm: --cert-host-memory-gb{budget}{origin} can shadow only {capacity} blocks "
        f"({budget_bytes(cfg) / GIB:.2f} GiB at {per_block / 2**20:.2f} MiB per block), fewer than the {need} blocks "
        f"one {vllm_config.model_config.max_model_len}-token request needs. Use --cert-host-memory-gb "
        f"{gib_at_least(need * per_block):.2f} or more, or a smaller --max-model-len."
    )


def check_minimum(vllm_config: Any, cfg: CertConfig) -> None:
    """Startup check (before any memory is touched) of an explicit budget."""
    if cfg.host_memory_gb is None:
        return
    per_block = node_bytes_per_block(vllm_config)
    capacity = budget_bytes(cfg) // per_block
    if capacity < min_blocks(vllm_config):
        raise _refuse(vllm_config, cfg, capacity, per_block)


_DEVICE_BLOCKS: dict[int, int] = {}
"""Capped block count → the block count the device budget planned before the host tier capped it (this process's
plans; :func:`device_blocks_before_cap`)."""


def device_blocks_before_cap(capped_blocks: int) -> int | None:
    """The vLLM block count the device budget planned (pages and promotion pools: ``device_budget``) where the host
    tier then capped the cache at ``capped_blocks``, or None where no plan of this process capped at that count.

    The pools' room was reserved for every planned block, and the cap leaves the cut blocks' pages unallocated, so
    a worker's pools may take both (``promotion_cache.pool_slots``): that memory sits unused otherwise. Only a
    worker in the process that planned (vLLM's engine core with one worker: tensor parallelism 1) sees the plan;
    others size their pools for the capped cache."""
    return _DEVICE_BLOCKS.get(capped_blocks)


def cap_blocks(vllm_config: Any, num_blocks: int) -> int:
    """The KV planner's block count, capped by the host budget (engine-core process; with the planned KV cache
    groups' layout where vLLM is planning them, ``hybrid.planning``). A cap is noted for
    :func:`device_blocks_before_cap`."""
    cfg = settings.cert_config(vllm_config)
    layout = hybrid.planned_layout()
    per_block = node_bytes_per_block(vllm_config, layout)
    capacity = budget_bytes(cfg) // per_block
    if capacity < min_blocks(vllm_config, layout):
        raise _refuse(vllm_config, cfg, capacity, per_block, layout)
    block_tokens = layout.block_size if layout is not None else vllm_config.cache_config.block_size
    if num_blocks > capacity:
        logger.warning(
            "certvllm: capping the KV cache at %d blocks (%d tokens): the host tier budget of %.2f GiB shadows "
            "%d MiB per block; the device could hold %d blocks. Raise --cert-host-memory-gb to use them.",
            capacity, capacity * block_tokens, budget_bytes(cfg) / GIB, per_block >> 20, num_blocks,
        )  # fmt: skip
        _DEVICE_BLOCKS[capacity] = num_blocks
        num_blocks = capacity
    ranks = node_ranks(vllm_config)
    n = len(layout.certified) if layout is not None else 0
    which = "all layers" if layout is None or not layout.hybrid else f"{n} certified layer{'s' * (n != 1)} only"
    logger.info(
        "certvllm: host tier shadows %d blocks = %.2f GiB (%.1f KiB per token, %s%s)",
        num_blocks, num_blocks * per_block / GIB, per_block / block_tokens / 1024, which,
        f"; split across {ranks} tensor-parallel ranks, {num_blocks * per_block / ranks / GIB:.2f} GiB each"
        if ranks > 1 else "",
    )  # fmt: skip
    if layout is not None and layout.hybrid:
        device = layout.pool_bytes_per_block
        logger.info(
            "certvllm: hybrid KV cache: %s; %d pool blocks x %.1f KiB on the device (%.2f GiB), x %.1f KiB of shadow "
            "on the host (%.2f GiB)",
            layout.describe(), num_blocks, device / 1024, num_blocks * device / GIB, per_block / 1024,
            num_blocks * per_block / GIB,
        )  # fmt: skip
    return num_blocks


def vllm_page_layout(head_dim: int, value_group: int, code_levels: tuple[int, int] = CODE_LEVELS) -> PageLayout:
    """The page of a 16-token block under vLLM: ``2·D`` bytes per token per KV head, whatever the value group
    (vLLM sizes its KV tensor before any certvllm setting is known; g = 16 fills it exactly, g = 32 leaves
    padding, g = 8 does not fit and is refused at startup). ``code_levels``: the largest key and value codes
    (``CertConfig.key_code_levels``, ``value_code_levels``: fewer only in the stress study's formats)."""
    return PageLayout(head_dim, value_group, token_bytes=2 * head_dim, key_levels=code_levels[0],
                      value_levels=code_levels[1])  # fmt: skip


def check_page_fits(head_dim: int, value_group: int) -> None:
    """Startup check that the value group fits vLLM's page (raises naming the fix)."""
    smallest = PageLayout(head_dim, value_group).smallest_token_bytes
    if smallest > 2 * head_dim:
        raise ValueError(
            f"certvllm: value_group_size {value_group} needs {smallest} bytes per token at head size {head_dim}, "
            f"more than vLLM's {2 * head_dim}-byte certified page; use --cert-value-group-size 16 or 32"
        )


def layer_cache(name: str, kv_cache: torch.Tensor, head_dim: int, dtype: torch.dtype, value_group: int,
                shadow: torch.Tensor | None = None,
                code_levels: tuple[int, int] = CODE_LEVELS) -> LayerKVCache:  # fmt: skip
    """The tiered cache of layer ``name`` over vLLM's ``[num_blocks, H_kv, N, C]`` uint8 KV tensor, with a new
    shadow in host memory (pinned with CUDA when the tensor is on a GPU; on the CPU the shadow doubles as
    a cache for vLLM's own CPU kernel, which stores keys transposed), or ``shadow``: the shadow of another
    certified layer whose KV tensor is the same memory (``runtime.WorkerRuntime.bind``: a hybrid model's KV cache
    groups share their tensors, and a block id belongs to one group at a time). ``code_levels``: as
    :func:`vllm_page_layout`."""
    num_blocks, heads, n, c = kv_cache.shape
    layout = vllm_page_layout(head_dim, value_group, code_levels)
    if n % layout.block_size != 0 or c != layout.bytes_per_token:
        raise ValueError(
            f"layer {name}: KV tensor {list(kv_cache.shape)} does not match the certified page "
            f"[*, *, m·{layout.block_size}, {layout.bytes_per_token}]"
        )
    on_cpu = kv_cache.device.type == "cpu"
    shape = (num_blocks, heads, 2, n, head_dim)
    if shadow is not None:
        if tuple(shadow.shape) != shape or shadow.dtype != dtype:
            raise ValueError(f"layer {name}: a shared shadow {list(shadow.shape)} {shadow.dtype} is not {list(shape)}")
        return LayerKVCache(kv_cache.view(num_blocks, heads, n * c), shadow, layout, keys_channel_major=on_cpu)
    try:
        shadow = allocate_host(shape, dtype, pin=not on_cpu)
    except (RuntimeError, MemoryError) as err:
        if isinstance(err, RuntimeError) and "allocate memory" not in str(err):
            raise
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raise MemoryError(
            f"certvllm: the host shadow of layer {name} ({nbytes / GIB:.2f} GiB) could not be allocated: host memory "
            f"is exhausted ({err}). Lower --cert-host-memory-gb (or the KV cache: --max-model-len, "
            "VLLM_CPU_KVCACHE_SPACE / --gpu-memory-utilization), or free host memory."
        ) from err
    return LayerKVCache(kv_cache.view(num_blocks, heads, n * c), shadow, layout, keys_channel_major=on_cpu)
