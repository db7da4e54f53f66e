"""Write path, first half on the device: a step's keys and values scattered into the shadow (tier 2).

The shadow is pinned (or registered) host memory that the device addresses directly, so one program per
(token, KV head) stores the token's key and value rows there over PCIe: no copy to the host, no host-side
scatter, and no synchronisation (the slots never come to the host). Tokens with a negative slot (vLLM's
padding) are skipped.

Shadow layout (``LayerKVCache.shadow``, token-major; the CUDA path's)::

    shadow [E, H_kv, 2, M·N, D]  model dtype   element (e, h, 0|1, i, d): key|value channel d of token i of
                                               engine block e (16-token block e·M + i // N, offset i % N)

so token slot ``s`` (16-token block ``b = s // N``, offset ``o = s % N``) of KV head ``h`` sits at element
``((b // M)·H_kv + h)·2·M·N·D + (b % M)·N·D + o·D`` (keys) and ``M·N·D`` further (values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import device_arg, launch_device_ok, next_pow2
from .shape_class import JIT_OPTIONS


@triton.jit(**JIT_OPTIONS)
def _scatter_kernel(
    key,  # [T, H_kv, D] this step's keys (any token and head strides, channel stride 1)
    value,  # [T, H_kv, D] values, same
    slots,  # [T] int64 token slots (16-token block · N + offset), < 0: skip
    shadow,  # the shadow storage (layout above)
    gen,  # [blocks] int64 write generations of the 16-token blocks (read only with BUMP)
    KEY_T,  # key token stride (elements)
    KEY_H,  # key head stride
    VAL_T,  # value token stride
    VAL_H,  # value head stride
    H: tl.constexpr,  # KV heads
    M: tl.constexpr,  # 16-token blocks per engine block
    N: tl.constexpr,  # tokens per 16-token block
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # next power of two ≥ D
    BUMP: tl.constexpr = False,  # add 1 to the token's block generation (LayerKVCache.bump_generation)
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots + t)
    if slot < 0:  # padding token
        return
    block = slot // N
    if BUMP:  # once per token (head 0)
        tl.atomic_add(gen + block, 1, mask=h == 0)
    run = M * N * D
    base = ((block // M) * H + h) * 2 * run + ((block % M) * N + slot % N) * D
    d = tl.arange(0, DP)
    dm = d < D
    k = tl.load(key + t * KEY_T + h * KEY_H + d, mask=dm)
    v = tl.load(value + t * VAL_T + h * VAL_H + d, mask=dm)
    tl.store(shadow + base + d, k, mask=dm)
    tl.store(shadow + base + run + d, v, mask=dm)


def scatter_into_shadow(shadow: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                        sub_blocks: int, block_size: int, generation: torch.Tensor | None = None) -> None:  # fmt: skip
    """Store ``key``/``value`` ``[T, H_kv, D]`` (the shadow's dtype, channel stride 1) at ``slots`` ``[T]`` int64
    (on the keys' device; negative: skipped) into ``shadow`` ``[E, H_kv, 2, M·N, D]`` (token-major, contiguous;
    pinned host memory the device can address, or any tensor under the interpreter). With ``generation``
    (``[blocks]`` int64 on the keys' device, ``LayerKVCache.generation``), each stored token adds 1 to its
    16-token block's counter in the same launch."""
    t, h, d = key.shape
    if t == 0:
        return
    if value.shape != key.shape or key.dtype != shadow.dtype or value.dtype != shadow.dtype:
        raise ValueError(f"keys {tuple(key.shape)} {key.dtype}, values {tuple(value.shape)} {value.dtype}: need the "
                         f"same shape and the shadow's dtype {shadow.dtype}")  # fmt: skip
    if key.stride(2) != 1 or value.stride(2) != 1 or not shadow.is_contiguous():
        raise ValueError("the keys' and values' channels must be contiguous and the shadow contiguous")
    launch_device_ok(key)
    bump = generation is not None
    _scatter_kernel[(t, h)](
        key, value, slots, device_arg(shadow), generation if bump else slots, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), H=h, M=sub_blocks, N=block_size, D=d, DP=next_pow2(d), BUMP=bump,
        num_warps=1,
    )  # fmt: skip
