"""Exact attention over the shadow tier: prefill, rung-3/4 fallbacks and the dense mode.

On the CPU the shadow tier is laid out exactly like vLLM's own CPU KV cache (keys stored
transposed per block), so this runs vLLM's CPU attention kernel on it: an exactly recomputed head is
bit-for-bit what ``--kv-cache-dtype auto`` (with the same block size) computes. Elsewhere it gathers
the originals per request: a single query token goes through ``dense_decode`` (the kernel
``certvllm.attention.dense_backend`` chose for its shape class), several (prefill) through float32 SDPA
with the causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from certvllm.attention.dense import dense_decode, gather_row_kv
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.pagein import PageInEngine


@dataclass
class ExactPlan:
    """One batch of exact attention: requests with contiguous query tokens.

    Attributes:
        query_start_loc: ``[n + 1]`` int32 (CPU).
        seq_lens: ``[n]`` int32 (CPU).
        block_table: ``[n, max_blocks]`` int32.
        scheduler_metadata: the CPU kernel's work split (None elsewhere).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: Any = None


class ExactAttention:
    """Exact dense attention for query tokens over a layer's shadow pages."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, scale: float,
                 block_size: int, on_cpu: bool, dense_backend: str = "auto") -> None:  # fmt: skip
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.scale, self.block_size, self.on_cpu = dtype, scale, block_size, on_cpu
        self.dense_backend = dense_backend
        self.isa = None
        if on_cpu:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            self.isa = _get_attn_isa(dtype, block_size, head_dim, "auto")

    def plan(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> ExactPlan:
        qsl = query_start_loc.to(torch.int32)
        lens = seq_lens.to(torch.int32)
        meta = None
        if self.on_cpu:
            from vllm import _custom_ops as ops
            from vllm import envs

            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=lens.shape[0], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, seq_lens=lens, dtype=self.dtype, query_start_loc=qsl, causal=True,
                sliding_window_size=-1, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                kv_cache_dtype="auto",
            )  # fmt: skip
        return ExactPlan(qsl, lens, block_table, meta)

    def run(self, plan: ExactPlan, query: torch.Tensor, cache: LayerKVCache, out: torch.Tensor,
            pagein: PageInEngine) -> None:  # fmt: skip
        """Write exact attention of ``query`` ``[T, H_q, D]`` into ``out`` ``[T, H_q, D]`` (same dtype)."""
        if self.on_cpu:
            from vllm import _custom_ops as ops

            nb, heads, _, block, _ = cache.shadow.shape
            key_cache, value_cache = cache.shadow.view(nb, heads, 2 * block, self.head_dim).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens, scale=self.scale, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=plan.block_table, softcap=0.0,
                scheduler_metadata=plan.scheduler_metadata, s_aux=None,
            )  # fmt: skip
            return
        self._run_torch(plan, query, cache, out, pagein)

    def _run_torch(self, plan: ExactPlan, query: torch.Tensor, cache: LayerKVCache, out: torch.Tensor,
                   pagein: PageInEngine) -> None:  # fmt: skip
        qsl = plan.query_start_loc.tolist()
        for i, seq_len in enumerate(plan.seq_lens.tolist()):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            sub = cache.sub_blocks
            table = (plan.block_table[i].cpu().long().unsqueeze(-1) * sub + torch.arange(sub)).flatten()
            k, v = gather_row_kv(cache, table, seq_len, pagein)
            if end - start == 1:  # one query token sees the whole row: exactly dense_decode
                o1 = dense_decode(query[start], k.to(query.device), v.to(query.device), self.scale,
                                  self.dense_backend)  # fmt: skip
                out[start] = o1.to(out.dtype)
                continue
            q = query[start:end].float().transpose(0, 1).unsqueeze(0)  # (1, H_q, q_len, D)
            kf = k.to(q.device).float().permute(1, 0, 2).unsqueeze(0)
            vf = v.to(q.device).float().permute(1, 0, 2).unsqueeze(0)
            ctx = seq_len - (end - start)
            pos_q = torch.arange(end - start, device=q.device).unsqueeze(1) + ctx
            mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= pos_q
            o = F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)  # fmt: skip
            out[start:end] = o[0].transpose(0, 1).to(out.dtype)
