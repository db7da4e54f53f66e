"""``benchmarks/dense_baselines.py``: the dense decode baselines of ``bench_decode.py``, checked where a CPU can.

The FA3 calls themselves need vLLM's CUDA build on a Hopper GPU (they run in ``bench_decode.py --baselines fa3
fa3-fp8`` on the lent H200, whose output records each baseline's error against SDPA); here: the paged layout they
read holds exactly the context, SDPA equals a float64 softmax reference, and asking for FA3 without vLLM's CUDA
build stops with the fix.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _baselines() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dense_baselines", ROOT / "benchmarks" / "dense_baselines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["dense_baselines"] = module
    spec.loader.exec_module(module)
    return module


def _inputs(batch: int = 3, t: int = 53, hq: int = 8, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, t, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, t, hkv, d, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("seq_len", [16, 37, 53])
def test_paged_layout_holds_the_context(seq_len: int) -> None:
    """Reading the pages through the block table gives back tokens [0, seq_len) of every row, unchanged."""
    db = _baselines()
    q, k, v = _inputs()
    k_cache, v_cache, table = db.paged_fp16(k, v, seq_len, block_size=16)
    assert table.dtype == torch.int32 and table.shape == (3, -(-seq_len // 16))
    assert sorted(table.flatten().tolist()) == list(range(table.numel()))  # every page used once
    for cache, src in ((k_cache, k), (v_cache, v)):
        rows = cache[table.long()].reshape(3, -1, 2, 16)[:, :seq_len]
        assert torch.equal(rows, src[:, :seq_len])


def test_sdpa_baseline_matches_float64_softmax() -> None:
    """The SDPA baseline over the first seq_len tokens equals softmax(q·kᵀ·scale)·v (GQA: 4 query heads per KV
    head) to 1e-12 in float64."""
    db = _baselines()
    q, k, v = _inputs()
    seq_len, scale = 41, 0.3
    out = db.build_baseline("sdpa", q, k, v, seq_len, scale)()
    kk = k[:, :seq_len].repeat_interleave(4, dim=2)  # [B, T, H_q, D]
    vv = v[:, :seq_len].repeat_interleave(4, dim=2)
    p = torch.softmax(torch.einsum("bhd,bthd->bht", q, kk) * scale, dim=-1)
    ref = torch.einsum("bht,bthd->bhd", p, vv)
    assert out.shape == ref.shape
    assert db.relative_error(out, ref) < 1e-12
    assert db.relative_error(ref + 1e-3 * ref.norm(dim=-1, keepdim=True), ref) > 1e-3  # the metric sees errors


def test_unknown_baseline_and_missing_fa3_name_the_fix() -> None:
    db = _baselines()
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="pick from"):
        db.build_baseline("flash", q, k, v, 16, 0.25)
    if torch.cuda.is_available():
        pytest.skip("a CUDA build of vLLM may be present: bench_decode.py runs FA3 there")
    with pytest.raises(SystemExit, match="leave fa3 out of --baselines"):
        db.require_fa3()
