"""The device side of the KV budget: room for the CUDA promotion cache inside vLLM's KV memory.

vLLM sizes the KV cache from the memory its profiler leaves free, in pages of ``C`` bytes per token per
KV head (``CertifiedAttentionBackend.customize_spec``). On CUDA each layer also allocates a promotion
cache (``certvllm.kv.promotion_cache``) after that profiling, so without a correction the pool would be
carved out of memory vLLM believes is spare. The engine-side block-count hook therefore lowers the block
count so that pages and pools together fit the memory vLLM planned for pages alone:

    blocks' · (page + pool) + fixed ≤ blocks · page

with, per vLLM block and across this rank's layers, ``page = L · H_kv · B · C`` and
``pool = L · (f · H_kv · B/16 · slot + 8 · B/16) + 2 · p · H_kv · B/16 · slot + L · (8 p + 4) · H_kv · B/16``
(``f`` = ``promotion_cache_fraction``, a slot is one ``[16, D]`` key page in the model's dtype plus its
two int64 tags and two int64 claim entries — with ``decode_pass: resident`` (``ResidentPool``) its value page
and a 4-byte fill flag instead of the claims, plus 4 bytes of ``slot_of`` per (16-token block, KV head) and 16
fixed bytes per layer —, 8 bytes of write generation per 16-token block; ``p`` = ``prefetch_fraction``: the step
prefetch's ring of two slots (a key page and its tags each) shared by all layers, and per layer its page list and
grid map, ``certvllm.kv.prefetch``), and ``fixed = (L + 2) · slot + 8 L`` for what rounding up may add.

When the host tier caps the cache below ``blocks'`` (``host_tier.cap_blocks``), the pages of the blocks it cut are
never allocated while their pools' room was counted here: the workers' pools take that room and the cut pages'
memory (``host_tier.device_blocks_before_cap``, ``promotion_cache.pool_slots``), within the same total.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from certvllm.config import CertConfig
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.kv.prefetch import DEPTH
from certvllm.kv.residency import pool_values
from certvllm.vllm_plugin import hybrid
from certvllm.vllm_plugin.host_tier import vllm_page_layout

logger = logging.getLogger("vllm.certvllm")

TAG_BYTES = 16  # two int64 per slot: page id and write generation
CLAIM_BYTES = 16  # two int64 per pool slot: the lookup's claim arrays (triton_kernels.pool)
GENERATION_BYTES = 8  # int64 write counter per 16-token block


def blocks_with_pool(
    num_blocks: int,
    *,
    layers: int,
    kv_heads: int,
    block_size: int,
    head_size: int,
    itemsize: int,
    cfg: CertConfig,
    page_bytes: int | None = None,
) -> int:
    """The largest vLLM block count whose pages plus promotion pools fit in ``num_blocks`` pages' memory.

    Args:
        num_blocks: blocks vLLM planned (pages only).
        layers, kv_heads: certified attention layers and KV heads of this rank.
        block_size: tokens per vLLM block of the certified layers (a multiple of 16).
        head_size: D.
        itemsize: bytes per element of the model's dtype (the shadow's and the pool's).
        cfg: the run's settings (``promotion_cache_fraction``, 0 leaves ``num_blocks`` unchanged;
            ``prefetch_fraction``).
        page_bytes: device bytes of one pool block as vLLM planned it (a hybrid model's pool also holds its native
            layers' pages, and its groups share blocks: ``hybrid.CertifiedLayout.pool_bytes_per_block``); default
            ``layers`` certified pages.
    """
    fraction = cfg.promotion_cache_fraction
    if fraction <= 0 or num_blocks <= 0:
        return num_blocks
    subs = block_size // BLOCK_SIZE
    resident = pool_values(cfg.decode_pass)
    key_slot = BLOCK_SIZE * head_size * itemsize + TAG_BYTES  # also a step-prefetch ring slot's
    slot = key_slot + (BLOCK_SIZE * head_size * itemsize + 4 if resident else CLAIM_BYTES)
    if page_bytes is None:
        page_bytes = layers * kv_heads * block_size * vllm_page_layout(head_size, cfg.value_group_size).bytes_per_token
    pool = layers * (fraction * kv_heads * subs * slot + GENERATION_BYTES * subs)
    if resident:  # slot_of: one int32 per (16-token block, KV head) of the layer
        pool += layers * 4 * kv_heads * subs
    prefetch = cfg.step_prefetch_fraction
    if prefetch > 0:  # the ring (all layers: key pages) and, per layer, the page list and the grid map
        pool += DEPTH * prefetch * kv_heads * subs * key_slot + layers * (8 * prefetch + 4) * kv_heads * subs
    fixed = layers * (slot + (16 if resident else 0))  # each pool's slot count rounds up; the hand and its count
    if prefetch > 0:  # and the ring's and the page lists'
        fixed += DEPTH * key_slot + 8 * layers
    return max(int((num_blocks * page_bytes - fixed) // (page_bytes + pool)), 0)


def fit_promotion_pool(vllm_config: Any, cfg: CertConfig, num_blocks: int) -> int:
    """``num_blocks`` lowered for the CUDA promotion cache (unchanged off CUDA or with the pool off)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike() or cfg.promotion_cache_fraction <= 0:
        return num_blocks
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    layout = hybrid.planned_layout()
    if layout is not None:  # vLLM's KV cache groups: the certified layers only, at their block size, in the pool
        geometry = {"layers": len(layout.certified), "kv_heads": layout.kv_heads, "block_size": layout.block_size,
                    "head_size": layout.head_size, "page_bytes": layout.pool_bytes_per_block}  # fmt: skip
    else:
        geometry = {"layers": model.get_num_layers(parallel), "kv_heads": model.get_num_kv_heads(parallel),
                    "block_size": vllm_config.cache_config.block_size, "head_size": model.get_head_size()}  # fmt: skip
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    fitted = blocks_with_pool(num_blocks, itemsize=itemsize, cfg=cfg, **geometry)
    logger.info(
        "certvllm: %d of %d planned KV blocks kept to leave room for the promotion cache "
        "(promotion_cache_fraction=%g; 0 turns it off and keeps every block)",
        fitted, num_blocks, cfg.promotion_cache_fraction,
    )  # fmt: skip
    return fitted
