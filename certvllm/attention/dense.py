"""Exact dense attention over the unquantized originals: rungs 3 and 4, and the dense mode.

One function computes it for unpaged K/V; the paged variant gathers a row's shadow pages and calls
that same function on the same values, so a head recomputed by rung 3/4 is bit-identical to
``dense_decode`` on the originals. The kernel (torch SDPA, or xformers where installed and measured
faster on CUDA) is chosen per shape class by :mod:`certvllm.attention.dense_backend` from
``CertConfig.dense_backend``, and the choice is cached, so every call of a class uses the same one.
"""

from __future__ import annotations

import torch

from certvllm.attention import dense_backend
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.pagein import DirectKeys, PageInEngine


def dense_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str = "auto"
) -> torch.Tensor:
    """Exact attention of one query per head over ``T`` tokens, in float32.

    Args:
        q: ``[H_q, D]``; k, v: ``[T, H_kv, D]`` (float16/bfloat16 originals).
        backend: ``auto``, ``sdpa`` or ``xformers`` (``CertConfig.dense_backend``).

    Returns:
        ``[H_q, D]`` float32, computed in float32 by the kernel :func:`dense_backend.choose` picks.
    """
    return dense_backend.decode(q, k, v, scale, backend)


def gather_row_kv(
    cache: LayerKVCache, block_table: torch.Tensor, seq_len: int, pagein: PageInEngine, direct: DirectKeys | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The originals of one row's first ``seq_len`` tokens from the shadow: ``[T, H_kv, D]`` each; with ``direct``
    (a write-through pool's keys, ``PromotionCache.direct_keys``) a device engine reads the current keys it holds
    from device memory instead (the same bytes)."""
    n = cache.layout.block_size
    nblocks = -(-seq_len // n)
    blocks = pagein.gather_blocks(cache, block_table[:nblocks].long(), direct)  # (b, H_kv, 2, N, D)
    kv = blocks.permute(2, 0, 3, 1, 4).reshape(2, nblocks * n, cache.num_kv_heads, -1)
    return kv[0, :seq_len], kv[1, :seq_len]


def dense_paged(
    q: torch.Tensor,
    cache: LayerKVCache,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    rows: list[int],
    scale: float,
    pagein: PageInEngine,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention for the listed rows: ``[len(rows), H_q, D]`` float32."""
    outs = []
    for r in rows:
        k, v = gather_row_kv(cache, block_tables[r], seq_lens[r], pagein)
        outs.append(dense_decode(q[r], k, v, scale, backend))
    return torch.stack(outs) if outs else q.new_zeros((0, *q.shape[1:]), dtype=torch.float32)
