"""Dense decode baselines for ``bench_decode.py``: what a vLLM operator would run instead of certified attention.

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` over contiguous FP16 K/V ``[B, H_kv, T, D]``.
- ``fa3``: vLLM's FlashAttention-3 (``vllm.vllm_flash_attn.flash_attn_varlen_func``, ``fa_version=3``) over a
  paged FP16 cache, the call vLLM's ``FLASH_ATTN`` backend makes on Hopper for a decode batch: pages of
  ``block_size`` tokens ``[num_blocks, block_size, H_kv, D]`` for keys and for values, an int32 block table,
  ``seqused_k``, and the scheduler metadata computed ahead of time (vLLM's ``aot_schedule``).
- ``fa3-fp8``: the same over an FP8 (e4m3) cache with per-tensor scales, the query quantized to FP8 as vLLM's
  attention layer does for ``--kv-cache-dtype fp8``; descales ``[B, H_kv]`` float32. Output BF16.

The FA3 baselines need vLLM (0.26 on the lent H200: ``benchmarks/vllm_gpu.sh part ...`` installs it) and a
Hopper GPU; :func:`require_fa3` says so before any work is done.

Each builder returns a zero-argument callable (graph-capturable: no host synchronisation, no allocation that
depends on data) whose result is ``[B, H_q, D]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

BASELINES = ("sdpa", "fa3", "fa3-fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def require_fa3() -> None:
    """Raise ``SystemExit`` with the fix when vLLM's FlashAttention-3 cannot run here."""
    try:
        from vllm.vllm_flash_attn import is_fa_version_supported
    except ImportError as err:
        raise SystemExit(
            f"--baselines fa3/fa3-fp8 need vLLM's FlashAttention ({err}); install vLLM >= 0.26 for this CUDA "
            "(on the lent H200: the offline bundle, `bash benchmarks/vllm_gpu.sh part .bundle/h200-vllm0.26.0/"
            "part-00N` for every part, then export PYTHONPATH=/tmp/site), or leave fa3 out of --baselines"
        ) from err
    if not is_fa_version_supported(3):
        raise SystemExit(
            f"--baselines fa3/fa3-fp8 need FlashAttention-3, which needs a Hopper GPU (sm_90); this is "
            f"{torch.cuda.get_device_name()}: leave fa3 out of --baselines"
        )


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float) -> Callable:
    """Dense SDPA: ``q [B, H_q, D]``, ``k``/``v [B, T, H_kv, D]`` (the first ``seq_len`` tokens are the context)."""
    kd = k[:, :seq_len].permute(0, 2, 1, 3).contiguous()
    vd = v[:, :seq_len].permute(0, 2, 1, 3).contiguous()
    qd = q.unsqueeze(2)

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True).squeeze(2)

    return run


def paged_fp16(k: torch.Tensor, v: torch.Tensor, seq_len: int, block_size: int, seed: int = 0):
    """vLLM's FlashAttention page layout of the first ``seq_len`` tokens of each row, blocks shuffled.

    Returns ``(k_cache, v_cache [num_blocks, block_size, H_kv, D], block_table [B, nb] int32)``."""
    batch, _, hkv, d = k.shape
    nb = -(-seq_len // block_size)
    pad = nb * block_size - seq_len
    kk = F.pad(k[:, :seq_len], (0, 0, 0, 0, 0, pad)).view(batch * nb, block_size, hkv, d)
    vv = F.pad(v[:, :seq_len], (0, 0, 0, 0, 0, pad)).view(batch * nb, block_size, hkv, d)
    perm = torch.randperm(batch * nb, generator=torch.Generator().manual_seed(seed)).to(k.device)
    k_cache = torch.empty_like(kk)
    v_cache = torch.empty_like(vv)
    k_cache[perm] = kk
    v_cache[perm] = vv
    return k_cache, v_cache, perm.view(batch, nb).to(torch.int32)


def fa3_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float, *, fp8: bool,
    block_size: int = 16,
) -> Callable:  # fmt: skip
    """vLLM's FA3 decode call over a paged cache (FP16, or FP8 with ``fp8``); see the module docstring."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    batch, hq, d = q.shape
    hkv = k.shape[2]
    dev = q.device
    k_cache, v_cache, table = paged_fp16(k, v, seq_len, block_size)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    seqused = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    qq = q.contiguous()
    descale: dict = {}
    if fp8:
        f8 = torch.float8_e4m3fn
        scales = [x.abs().amax().float() / FP8_MAX for x in (q, k_cache, v_cache)]
        qq = (q.float() / scales[0]).to(f8)
        k_cache = (k_cache.float() / scales[1]).to(f8)
        v_cache = (v_cache.float() / scales[2]).to(f8)
        shape = (batch, hkv)
        descale = {
            n: s.reshape(1, 1).expand(shape)
            for n, s in zip(("q_descale", "k_descale", "v_descale"), scales, strict=True)
        }
    meta = get_scheduler_metadata(
        batch_size=batch, max_seqlen_q=1, max_seqlen_k=seq_len, num_heads_q=hq, num_heads_kv=hkv, headdim=d,
        cache_seqlens=seqused, qkv_dtype=qq.dtype, cu_seqlens_q=cu_q, page_size=block_size, causal=True,
    )  # fmt: skip

    def run() -> torch.Tensor:
        return flash_attn_varlen_func(
            qq, k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=seq_len, seqused_k=seqused,
            softmax_scale=scale, causal=True, block_table=table, scheduler_metadata=meta, fa_version=3, **descale,
        )  # fmt: skip

    return run


def build_baseline(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float
) -> Callable:
    """The callable of baseline ``name`` (one of :data:`BASELINES`)."""
    if name == "sdpa":
        return sdpa_decode(q, k, v, seq_len, scale)
    if name in ("fa3", "fa3-fp8"):
        return fa3_decode(q, k, v, seq_len, scale, fp8=name == "fa3-fp8")
    raise ValueError(f"baseline {name!r} is not one of {BASELINES}: pick from those")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max_i ||out_i − ref_i||₂ / ||ref_i||₂ over the (row, head) outputs, in float64."""
    o, r = out.double().reshape(-1, out.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    return float(((o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).max())
