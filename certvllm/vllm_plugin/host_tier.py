"""The host tier of a vLLM run: its memory budget (engine side) and its shadow pages (worker side).

Every device block has a shadow page per layer in host memory, ``[H_kv, 2, N, D]`` in the model's
dtype (pinned on CUDA, ordinary memory on CPU; :func:`layer_cache`). The shadow is indexed by block
id, so it lives exactly as long as the device block: a freed, preempted or aborted request's blocks are
simply rewritten by their next owner, and nothing is held per request. The worker's layers are held by
``runtime.WorkerRuntime``.

Budget: ``host_memory_gb`` (``--cert-host-memory-gb``), or half of the available host memory when
unset. The KV planner's block count is capped to what the budget can shadow (logged); a budget that
cannot shadow one full-length request refuses to start, naming the flag.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from certvllm.config import CertConfig
from certvllm.formats.layout import PageLayout
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.host import allocate_host
from certvllm.vllm_plugin import settings
from certvllm.vllm_plugin.preflight import (
    StartupRefusal,
    default_budget_bytes,
    gib_at_least,
    min_request_blocks,
    shadow_bytes_per_token,
)

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
GIB = 1 << 30


def shadow_bytes_per_block(vllm_config: Any) -> int:
    """Host bytes one vLLM block's shadow pages take across all layers of this rank."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    layers = model.get_num_layers(parallel)
    heads = model.get_num_kv_heads(parallel)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return vllm_config.cache_config.block_size * shadow_bytes_per_token(layers, heads, model.get_head_size(), itemsize)


def node_ranks(vllm_config: Any) -> int:
    """Tensor-parallel ranks of this engine: each shadows its own KV heads of every block, all from the one
    node's budget (``--cert-host-memory-gb`` is per node)."""
    return max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))


def node_bytes_per_block(vllm_config: Any) -> int:
    """Host bytes one vLLM block's shadow pages take on this node: every layer, every rank."""
    return shadow_bytes_per_block(vllm_config) * node_ranks(vllm_config)


def budget_bytes(cfg: CertConfig) -> int:
    """The host tier's budget on this node: ``host_memory_gb``, or half of the memory available now (the smaller
    of the machine's and the container's headroom: ``preflight.default_budget_bytes``). Tensor-parallel ranks share
    it (:func:`node_bytes_per_block`)."""
    if cfg.host_memory_gb is not None:
        return int(cfg.host_memory_gb * GIB)
    return default_budget_bytes()


def min_blocks(vllm_config: Any) -> int:
    """vLLM blocks one request of ``max_model_len`` tokens needs: the least useful capacity."""
    return min_request_blocks(vllm_config.model_config.max_model_len, vllm_config.cache_config.block_size)


def _refuse(vllm_config: Any, cfg: CertConfig, capacity: int, per_block: int) -> StartupRefusal:
    """The refusal of a budget below one full-length request (``certvllm serve`` prints it as one line, exit 2)."""
    need = min_blocks(vllm_config)
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


def cap_blocks(vllm_config: Any, num_blocks: int) -> int:
    """The KV planner's block count, capped by the host budget (engine-core process)."""
    cfg = settings.cert_config(vllm_config)
    per_block = node_bytes_per_block(vllm_config)
    capacity = budget_bytes(cfg) // per_block
    if capacity < min_blocks(vllm_config):
        raise _refuse(vllm_config, cfg, capacity, per_block)
    if num_blocks > capacity:
        logger.warning(
            "certvllm: capping the KV cache at %d blocks (%d tokens): the host tier budget of %.2f GiB shadows "
            "%d MiB per block; the device could hold %d blocks. Raise --cert-host-memory-gb to use them.",
            capacity, capacity * vllm_config.cache_config.block_size, budget_bytes(cfg) / GIB, per_block >> 20,
            num_blocks,
        )  # fmt: skip
        num_blocks = capacity
    ranks = node_ranks(vllm_config)
    logger.info(
        "certvllm: host tier shadows %d blocks = %.2f GiB (%.1f KiB per token, all layers%s)",
        num_blocks, num_blocks * per_block / GIB, per_block / vllm_config.cache_config.block_size / 1024,
        f"; split across {ranks} tensor-parallel ranks, {num_blocks * per_block / ranks / GIB:.2f} GiB each"
        if ranks > 1 else "",
    )  # fmt: skip
    return num_blocks


def vllm_page_layout(head_dim: int, value_group: int) -> PageLayout:
    """The page of a 16-token block under vLLM: ``2·D`` bytes per token per KV head, whatever the value group
    (vLLM sizes its KV tensor before any certvllm setting is known; g = 16 fills it exactly, g = 32 leaves
    padding, g = 8 does not fit and is refused at startup)."""
    return PageLayout(head_dim, value_group, token_bytes=2 * head_dim)


def check_page_fits(head_dim: int, value_group: int) -> None:
    """Startup check that the value group fits vLLM's page (raises naming the fix)."""
    smallest = PageLayout(head_dim, value_group).smallest_token_bytes
    if smallest > 2 * head_dim:
        raise ValueError(
            f"certvllm: value_group_size {value_group} needs {smallest} bytes per token at head size {head_dim}, "
            f"more than vLLM's {2 * head_dim}-byte certified page; use --cert-value-group-size 16 or 32"
        )


def layer_cache(name: str, kv_cache: torch.Tensor, head_dim: int, dtype: torch.dtype, value_group: int) -> LayerKVCache:
    """The tiered cache of layer ``name`` over vLLM's ``[num_blocks, H_kv, N, C]`` uint8 KV tensor, with a new
    shadow in host memory (pinned with CUDA when the tensor is on a GPU; on the CPU the shadow doubles as
    a cache for vLLM's own CPU kernel, which stores keys transposed)."""
    num_blocks, heads, n, c = kv_cache.shape
    layout = vllm_page_layout(head_dim, value_group)
    if n % layout.block_size != 0 or c != layout.bytes_per_token:
        raise ValueError(
            f"layer {name}: KV tensor {list(kv_cache.shape)} does not match the certified page "
            f"[*, *, m·{layout.block_size}, {layout.bytes_per_token}]"
        )
    on_cpu = kv_cache.device.type == "cpu"
    shape = (num_blocks, heads, 2, n, head_dim)
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
