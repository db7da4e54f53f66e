"""The layer call's input kernel (``triton_kernels/call_inputs.py``) against the torch expressions it replaces.

Integer moves, a comparison and one float32 multiply, so the comparison is exact (``torch.equal``). In Triton's
interpreter here, compiled on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.triton_kernels.call_inputs import BLOCK, call_inputs  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N = 16


def _torch_inputs(q, tables, lens, scale, num_blocks):
    """What ``certvllm.attention.gpu.begin_call`` computed before the kernel, line for line."""
    tables = tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64)
    nfull = lens // N
    B = tables.shape[1]
    bvalid = torch.arange(B, device=tables.device) < nfull.unsqueeze(1)
    tail_ids = tables.gather(1, nfull.clamp(max=B - 1).unsqueeze(1)).squeeze(1).clamp(0, num_blocks - 1)
    return (q.float() * scale).contiguous(), tables, lens, nfull, bvalid, tail_ids


@pytest.mark.parametrize(
    "rows,width,qdtype,tdtype",
    [
        (3, 5, torch.float16, torch.int32),  # vLLM's dtypes: half queries, int32 tables and lengths
        (2, BLOCK + 7, torch.bfloat16, torch.int64),  # a table over one loop iteration wide
        (4, 1, torch.float32, torch.int32),  # one column: every row's tail index clamps to it
        (0, 3, torch.float16, torch.int64),  # no rows
    ],
)
def test_call_inputs_are_the_torch_lines(rows, width, qdtype, tdtype):
    """Strided views as vLLM passes them (queries a slice of a wider q/k/v row, the table a slice of a wider
    one); lengths on and off block boundaries, a row that fills its table (the tail index clamps to the last
    column), table entries past the cache and negative (clamped)."""
    g = torch.Generator().manual_seed(rows * 1000 + width)
    hq, d, num_blocks = 6, 64, 50
    qkv = torch.randn(rows, 3 * hq, d, generator=g).to(qdtype)
    q = qkv[:, :hq]  # row stride 3·hq·d
    wide = torch.randint(-2, num_blocks + 5, (rows, width + 3), generator=g).to(tdtype)
    tables = wide[:, :width]  # row stride width + 3
    lens = torch.randint(0, N * width + 1, (rows,), generator=g).to(tdtype)
    if rows >= 3:
        lens[0], lens[1], lens[2] = N * width, 0, N * (width - 1) + 5 if width > 1 else 5
    scale = 1 / 8.0 + 1e-3  # not a power of two: the product rounds
    want = _torch_inputs(q, tables, lens, scale, num_blocks)
    got = call_inputs(q.to(DEV), tables.to(DEV), lens.to(DEV), scale, N, num_blocks)
    names = ("qs", "tables64", "lens64", "nfull", "bvalid", "tail_ids")
    for name, w, x in zip(names, want, got, strict=True):
        assert x.dtype == w.dtype and x.shape == w.shape, name
        assert torch.equal(x.cpu(), w), name


def test_call_inputs_refuses_what_it_cannot_read():
    q = torch.zeros(2, 4, 8, dtype=torch.int32, device=DEV)
    tables = torch.zeros(2, 3, dtype=torch.int64, device=DEV)
    lens = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"queries of dtype torch.int32.*pass q\.float\(\)\.contiguous\(\)"):
        call_inputs(q, tables, lens, 1.0, N, 10)
    with pytest.raises(ValueError, match=r"contiguous columns; pass tables\.contiguous\(\)"):
        call_inputs(q.float(), tables.t().contiguous().t(), lens, 1.0, N, 10)
