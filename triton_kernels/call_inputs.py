"""A layer call's inputs on the device in one launch: the scaled float32 queries, the int64 block table and lengths,
the full-block counts, the valid-block mask and each row's trailing-block id.

What ``certvllm.attention.gpu.begin_call`` computed with about ten torch launches (dtype copies, a floor division,
an ``arange`` and a comparison, two clamps and a gather, a cast and a multiply):

* ``qs[r, h, :] = float32(q[r, h, :]) · float32(scale)`` (one rounding, as torch's float32 multiply by a Python
  float);
* ``tables64 = int64(tables)`` (contiguous), ``lens64 = int64(lens)``, ``nfull = lens64 // N``;
* ``bvalid[r, b] = b < nfull[r]``;
* ``tail_ids[r] = clamp(tables64[r, min(nfull[r], B − 1)], 0, num_blocks − 1)``: the block holding the row's
  partial block (or a harmless valid id when the row ends on a block boundary).

Every output equals its torch expression exactly (integer moves and one float32 multiply), tested under the
interpreter against those expressions (``tests/triton_kernels/test_call_inputs.py``). One program per row; the
table is copied ``BLOCK`` columns at a time, so the compile key does not depend on the table's width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import launch_device_ok, next_pow2
from .shape_class import JIT_OPTIONS

BLOCK = 1024
"""Block-table columns per loop iteration."""
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TABLE_DTYPES = (torch.int32, torch.int64)


@triton.jit(**JIT_OPTIONS)
def _call_inputs_kernel(q_in, Q_R, Q_H, tables, TB_STRIDE, lens, scale, qs, tables64, lens64, nfull, bvalid, tail_ids,
                        B, num_blocks, HQ: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                        N: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One program per row r (module docstring)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, DP)[None, :]
    mq = (h < HQ) & (d < D)
    x = tl.load(q_in + r * Q_R + h * Q_H + d, mask=mq, other=0.0).to(tl.float32)
    tl.store(qs + (r * HQ + h) * D + d, x * scale, mask=mq)
    ln = tl.load(lens + r).to(tl.int64)
    nf = ln // N
    tl.store(lens64 + r, ln)
    tl.store(nfull + r, nf)
    row = tables + r * TB_STRIDE
    for c0 in range(0, B, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < B
        tl.store(tables64 + r * B + c, tl.load(row + c, mask=m, other=0).to(tl.int64), mask=m)
        tl.store(bvalid + r * B + c, c < nf, mask=m)
    tail = tl.load(row + tl.minimum(nf, B - 1)).to(tl.int64)
    tl.store(tail_ids + r, tl.minimum(tl.maximum(tail, 0), num_blocks - 1))


def call_inputs(
    q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float, block_size: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's outputs for ``R`` rows, on ``q``'s device.

    Args:
        q: ``[R, H_q, D]`` float16, bfloat16, float32 or float64 queries (rows and heads at any stride, channels contiguous).
        tables: ``[R, B]`` int32 or int64 block ids (B ≥ 1; rows at any stride, columns contiguous).
        lens: ``[R]`` int32 or int64 tokens per row.
        scale: the softmax scale.
        block_size: tokens per block ``N``.
        num_blocks: 16-token blocks in the cache (the clamp of the trailing-block ids).

    Returns:
        ``(qs [R, H_q, D] float32, tables64 [R, B] int64, lens64 [R] int64, nfull [R] int64, bvalid [R, B] bool,
        tail_ids [R] int64)``.
    """
    launch_device_ok(q)
    R, HQ, D = q.shape
    B = tables.shape[1]
    if q.dtype not in QUERY_DTYPES or q.stride(2) != 1:
        raise ValueError(f"call_inputs: queries of dtype {q.dtype} and strides {q.stride()}: they must be float16, "
                         "bfloat16, float32 or float64 with contiguous channels; pass q.float().contiguous()")  # fmt: skip
    if tables.dtype not in TABLE_DTYPES or lens.dtype not in TABLE_DTYPES or B < 1 or tables.stride(1) != 1:
        raise ValueError(f"call_inputs: a block table of dtype {tables.dtype}, shape {tuple(tables.shape)} and "
                         f"strides {tables.stride()} with lengths of dtype {lens.dtype}: both must be int32 or int64, "
                         "the table at least one column wide with contiguous columns; pass tables.contiguous()")  # fmt: skip
    dev = q.device
    qs = torch.empty(R, HQ, D, dtype=torch.float32, device=dev)
    tables64 = torch.empty(R, B, dtype=torch.int64, device=dev)
    lens64, nfull, tail_ids = (torch.empty(R, dtype=torch.int64, device=dev) for _ in range(3))
    bvalid = torch.empty(R, B, dtype=torch.bool, device=dev)
    if R:
        _call_inputs_kernel[(R,)](
            q, q.stride(0), q.stride(1), tables, tables.stride(0), lens, scale, qs, tables64, lens64, nfull, bvalid,
            tail_ids, B, num_blocks, **launch_constants(HQ, D, block_size),
        )  # fmt: skip
    return qs, tables64, lens64, nfull, bvalid, tail_ids


def launch_constants(num_q_heads: int, head_dim: int, block_size: int) -> dict:
    """The compile-time arguments of :func:`_call_inputs_kernel` (constexprs and ``num_warps``), for its launch and
    for compiling it offline (``offline_compile``)."""
    return dict(HQ=num_q_heads, D=head_dim, HP=next_pow2(num_q_heads), DP=next_pow2(head_dim), N=block_size,
                BLOCK=BLOCK, num_warps=4)  # fmt: skip
