"""``certified_decode``: one decode step over unpaged originals, through the paged path."""

from __future__ import annotations

from functools import lru_cache

import torch

from certvllm.attention.op import certified_attention
from certvllm.bounds.report import CertifiedOutput
from certvllm.config import CertConfig, load_config
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.kv.cache import LayerKVCache


@lru_cache(maxsize=1)
def _default_config() -> CertConfig:
    return load_config()


def paged_copy(k: torch.Tensor, v: torch.Tensor, value_group: int) -> tuple[LayerKVCache, torch.Tensor]:
    """Write ``k, v`` ``[T, H_kv, D]`` into a fresh tiered cache through the serving write path.

    Block 0 is left unused (vLLM's null block) and the sequence's blocks are laid out in reverse
    physical order, so the block table is exercised. Returns the cache and the ``[nb]`` block table.
    """
    t, heads, d = k.shape
    nb = -(-t // BLOCK_SIZE)
    cache = LayerKVCache.allocate(nb + 1, heads, d, k.dtype, device=k.device, value_group=value_group)
    table = torch.arange(nb, 0, -1, dtype=torch.int64)
    pos = torch.arange(t)
    slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    cache.write(k, v, slots)
    return cache, table


def certified_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: CertConfig | None = None,
    scale: float | None = None,
) -> CertifiedOutput:
    """Certified attention for one decode step of one sequence.

    Args:
        q: ``[H_q, D]`` query (post-RoPE), any float dtype.
        k, v: ``[T, H_kv, D]`` unquantized keys (post-RoPE) and values, float16 or bfloat16.
        config: tolerances and mode; the ``default`` preset if omitted.
        scale: softmax scale, ``1/√D`` if omitted.

    Returns:
        :class:`CertifiedOutput` with ``out`` ``[H_q, D]`` float32 and a per-query-head report
        (``rung``, ``e_key``, ``e_val``, ``k_star``, …). For every head with rung ≤ 2,
        ‖out − exact‖₂ ≤ e_key + e_val, where exact is attention over ``k, v`` in exact arithmetic.
    """
    if k.dim() != 3 or v.shape != k.shape or q.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"Invalid shapes: expected q [H_q, D] and k, v [T, H_kv, D]; got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    if k.shape[0] < 1:
        raise ValueError("k and v need at least one token")
    config = config or _default_config()
    cache, table = paged_copy(k, v, config.value_group_size)
    res = certified_attention(q.unsqueeze(0), cache, table.unsqueeze(0), torch.tensor([k.shape[0]]), config, scale)
    return CertifiedOutput(res.out[0], res.report.select(0))
