"""Exact attention over the shadow tier: prefill, rung-3/4 fallbacks and the dense mode.

On the CPU the shadow tier is laid out exactly like vLLM's own CPU KV cache (keys stored
transposed per block), so this runs vLLM's CPU attention kernel on it: an exactly recomputed head is
bit-for-bit what ``--kv-cache-dtype auto`` (with the same block size) computes. On CUDA a single query
token goes through ``dense_decode`` over the row's originals (the kernel ``certvllm.attention.dense_backend``
chose for its shape class); a prefill attends to its cached context, gathered from the shadow, and to the
step's own keys and values (on the device already: a prompt with no cached context crosses no PCIe), in
one variable-length causal FlashAttention call, vLLM's kernel for ``auto``; float32 SDPA where vLLM has
none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from certvllm.attention.dense import dense_decode, gather_row_kv
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.pagein import DirectKeys, PageInEngine

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
_UNRESOLVED = object()
_AMX_LOGGED: set[tuple[torch.dtype, int, int]] = set()


def shadow_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The variant of vLLM's CPU attention kernel that writes and reads the CPU shadow tier: vLLM's own choice
    for ``--kv-cache-dtype auto`` (``cpu_attn._get_attn_isa``), except its AMX kernel, which vLLM picks for
    bfloat16 at block sizes that are multiples of 32 on CPUs with AMX tiles. That kernel stores a block in its
    own tile layout, not the transposed keys and plain values that certvllm's readers expect
    (``LayerKVCache(keys_channel_major=True)``: the quantizer, the compiled kernel's shadow reads, page-ins
    and the audit), so every certified page would be encoded from scrambled originals (measured on a Xeon with
    AMX, SmolLM2 in bfloat16: garbage after the first token, score-canary violations in every layer). The
    AVX-512 kernel (``vec``, vLLM's next choice on such a CPU) is used there instead: exact recomputation
    stays exact, but it is no longer bit-identical to ``auto``, which keeps the AMX kernel."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    if isa != "amx":
        return isa
    if (dtype, block_size, head_dim) not in _AMX_LOGGED:
        _AMX_LOGGED.add((dtype, block_size, head_dim))
        logger.info(
            "certvllm: vLLM's CPU attention uses its AMX kernel for %s at block size %d; the shadow tier uses its "
            "AVX-512 ('vec') kernel and layout instead (certvllm reads that layout): exact recomputation (prefill, "
            "rungs 3/4) is exact but not bit-identical to --kv-cache-dtype auto on this CPU", dtype, block_size,
        )  # fmt: skip
    return "vec"


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
        self._flash_fn: Any = _UNRESOLVED
        self.isa = shadow_isa(dtype, block_size, head_dim) if on_cpu else None

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
            pagein: PageInEngine, fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
            direct: DirectKeys | None = None) -> None:  # fmt: skip
        """Write exact attention of ``query`` ``[T, H_q, D]`` into ``out`` ``[T, H_q, D]`` (same dtype).

        ``fresh``: this step's keys and values of the same tokens, ``[T, H_kv, D]`` each (what the write path
        just stored in the shadow). Off the CPU a prefill then reads only its cached context from the shadow,
        and a prefill with no cached context reads nothing over PCIe. ``direct``: the layer's write-through pool
        (``PromotionCache.direct_keys``): off the CPU the cached context's keys it holds come from device memory
        (the shadow's bytes), so only their values cross PCIe."""
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
        self._run_device(plan, query, cache, out, pagein, fresh, direct)

    def _run_device(self, plan: ExactPlan, query: torch.Tensor, cache: LayerKVCache, out: torch.Tensor,
                    pagein: PageInEngine, fresh: tuple[torch.Tensor, torch.Tensor] | None,
                    direct: DirectKeys | None = None) -> None:  # fmt: skip
        """One-token requests: ``dense_decode`` on the row's originals (the kernel rung 3/4 use). Longer ones:
        keys/values = cached context from the shadow + this step's own, then one variable-length causal
        FlashAttention call (vLLM's kernel, in the model dtype, as ``auto`` computes prefill) or, where vLLM
        has none, float32 SDPA per request."""
        qsl = plan.query_start_loc.tolist()
        lens = plan.seq_lens.tolist()
        sub = cache.sub_blocks
        multi: list[int] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, seq_len in enumerate(lens):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            # on the table's device: the gather takes device ids, so the host never waits for the stream here
            row = plan.block_table[i].long()
            table = (row.unsqueeze(-1) * sub + torch.arange(sub, device=row.device)).flatten()
            ctx = seq_len - (end - start)
            from_shadow = seq_len if fresh is None else ctx
            k, v = gather_row_kv(cache, table, from_shadow, pagein, direct) if from_shadow else (None, None)
            if fresh is not None:
                fk, fv = fresh[0][start:end], fresh[1][start:end]
                k = fk if k is None else torch.cat((k.to(fk.device), fk))
                v = fv if v is None else torch.cat((v.to(fv.device), fv))
            k, v = k.to(query.device), v.to(query.device)
            if end - start == 1:  # one query token sees the whole row: exactly dense_decode
                out[start] = dense_decode(query[start], k, v, self.scale, self.dense_backend).to(out.dtype)
                continue
            multi.append(i)
            keys.append(k)
            values.append(v)
        if not multi:
            return
        flash = self._flash(query.device)
        if flash is not None:
            self._flash_prefill(flash, multi, qsl, lens, query, keys, values, out)
            return
        for i, k, v in zip(multi, keys, values, strict=True):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = _sdpa_causal(query[start:end], k, v, self.scale).to(out.dtype)

    def _flash(self, device: torch.device) -> Any:
        """vLLM's variable-length FlashAttention on CUDA (looked up once), else None."""
        if device.type != "cuda":
            return None
        if self._flash_fn is _UNRESOLVED:
            from certvllm.vllm_plugin._compat import varlen_flash_attention

            self._flash_fn = varlen_flash_attention(self.head_dim)
        return self._flash_fn

    def _flash_prefill(self, flash: Any, multi: list[int], qsl: list[int], lens: list[int], query: torch.Tensor,
                       keys: list[torch.Tensor], values: list[torch.Tensor], out: torch.Tensor) -> None:  # fmt: skip
        """The listed requests in one variable-length call (their query tokens may not be contiguous)."""
        q_runs = [(qsl[i], qsl[i + 1]) for i in multi]
        contiguous = all(a[1] == b[0] for a, b in zip(q_runs, q_runs[1:], strict=False))
        q_lens = [end - start for start, end in q_runs]
        k_lens = [lens[i] for i in multi]
        device = query.device
        cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        cu_k = torch.tensor([0, *k_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        if contiguous:
            lo, hi = q_runs[0][0], q_runs[-1][1]
            q, o = query[lo:hi], out[lo:hi]
        else:
            q = torch.cat([query[s:e] for s, e in q_runs])
            o = torch.empty_like(q)
        flash(q.contiguous(), torch.cat(keys), torch.cat(values), cu_q, cu_k, max(q_lens), max(k_lens),
              self.scale, o)  # fmt: skip
        if not contiguous:  # the contiguous case wrote into its slice of ``out`` (a contiguous view)
            at = 0
            for (start, end), n in zip(q_runs, q_lens, strict=True):
                out[start:end] = o[at : at + n]
                at += n


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 SDPA of ``q`` ``[Q, H_q, D]`` over ``k, v`` ``[T, H_kv, D]`` (T ≥ Q), the queries being the last Q
    positions: ``[Q, H_q, D]`` float32. Causal without a mask tensor when there is no cached context."""
    qf = q.float().transpose(0, 1).unsqueeze(0)  # (1, H_q, Q, D)
    kf = k.float().permute(1, 0, 2).unsqueeze(0)
    vf = v.float().permute(1, 0, 2).unsqueeze(0)
    n_q, n_k = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    if n_q == n_k:
        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        pos_q = torch.arange(n_q, device=q.device).unsqueeze(1) + (n_k - n_q)
        mask = torch.arange(n_k, device=q.device).unsqueeze(0) <= pos_q
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)
