"""CUDA graphs of certified layer calls (``certvllm.attention.graphs``).

CPU: the padding buckets (never smaller than the call, never in another compile class, bounded waste) and
the config's coupling with the step prefetch. GPU (``pytest -m gpu``): over a sequence of decode calls whose
row counts, lengths and table widths change (tokens appended between calls, a row ending exactly on a block
boundary of its table), every replay returns bit for bit what an eager call on the same padded inputs
returns (outputs and every report field); every certified head (rung ≤ 2) is within its bound of float64
exact attention over the originals, no slack; the page-in counts of a replay equal the eager call's.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch
from certvllm.triton_kernels.shape_class import width_class

from certvllm.attention.graphs import row_bucket, width_bucket
from certvllm.bounds.report import CertReport


def test_row_bucket_holds_the_call_with_bounded_padding():
    assert [row_bucket(r) for r in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 16, 24, 64, 64]
    for r in range(1, 600):
        b = row_bucket(r)
        assert r <= b and (b <= 2 * r if r <= 8 else b < r + 8)
    with pytest.raises(ValueError, match="at least one row"):
        row_bucket(0)


def test_width_bucket_stays_in_the_compile_class():
    assert [width_bucket(b) for b in (1, 7, 9, 16, 17, 33, 100, 129, 513, 8192)] == [
        1, 7, 10, 16, 20, 40, 112, 160, 640, 8192]  # fmt: skip
    for b in range(1, 9000):
        w, top = width_bucket(b), 1 << (b - 1).bit_length()
        assert b <= w <= top and width_class(w) == width_class(b)
        assert w - b < max(1, top // 8)
    with pytest.raises(ValueError, match="at least one column"):
        width_bucket(0)


def test_cuda_graphs_turn_the_step_prefetch_off():
    from certvllm.config import load_config

    assert load_config("default").cuda_graphs is True
    assert load_config("default").step_prefetch_fraction == 0.0
    eager = load_config("default", cuda_graphs=False)
    assert eager.step_prefetch_fraction == eager.prefetch_fraction > 0


def test_graphs_need_a_cuda_device():
    from certvllm.attention.graphs import LayerCallGraphs

    with pytest.raises(ValueError, match="CUDA device"):
        LayerCallGraphs("cpu", max_rows=8)


# -- GPU ----------------------------------------------------------------------------------------------
def _padded(q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor):
    """The padded inputs the graphs build (module docstring of ``graphs``), built independently."""
    R, B = tables.shape
    rows, width = row_bucket(R), width_bucket(B)
    qp = torch.zeros(rows, *q.shape[1:], dtype=q.dtype, device=q.device)
    tp = torch.zeros(rows, width, dtype=torch.int64, device=q.device)
    lp = torch.ones(rows, dtype=torch.int64, device=q.device)
    qp[:R], tp[:R, :B], lp[:R] = q, tables, lens
    return qp, tp, lp


def _exact64(layer, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 attention of each row over the originals in the shadow: ``[R, H_q, D]``."""
    from certvllm.testing import exact_attention

    cache = layer.cache
    outs = []
    for r in range(q.shape[0]):
        t = int(lens[r])
        blocks = cache.shadow_blocks(tables[r, : -(-t // 16)].cpu()).double()  # [nb, K, 2, 16, D]
        k = blocks[:, :, 0].transpose(0, 1).flatten(1, 2)[:, :t]  # [K, t, D]
        v = blocks[:, :, 1].transpose(0, 1).flatten(1, 2)[:, :t]
        outs.append(exact_attention(q[r].cpu().double(), k.transpose(0, 1), v.transpose(0, 1), scale))
    return torch.stack(outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replays_equal_eager_calls_on_the_padded_inputs_and_stay_certified():
    from certvllm.attention import certified_attention
    from certvllm.attention.graphs import LayerCallGraphs
    from certvllm.attention.synthetic import SyntheticLayer, table_width
    from certvllm.config import load_config
    from certvllm.kv.residency import Residency

    cfg = load_config("default")
    layer = SyntheticLayer(8, 2, 128, torch.bfloat16, cfg, "cuda", blocks=96, seed=3)
    residency = Residency(pool=layer.residencies[0].pool)  # what the runtime passes: the pool, no prefetch
    scale = 1 / math.sqrt(128)
    graphs = LayerCallGraphs("cuda", max_rows=16)
    gen = torch.Generator().manual_seed(5)
    steps = [[40], [40, 77, 300], [41, 78, 301], [42, 79, 302], [500] * 5, [33, 96], [35, 95], [1000, 7, 250]]
    for lens_list in steps:
        lens = torch.tensor(lens_list, dtype=torch.int64, device="cuda")
        tables = layer.tables(len(lens_list), table_width(max(lens_list), 16))
        q = torch.randn(len(lens_list), 8, 128, generator=gen).to(torch.bfloat16).cuda()
        before = graphs.replays
        step = object()  # the step's token: both layers of the step share one write of its tables and lengths
        got = graphs.run("layer0", q, layer.cache, tables, lens, cfg, scale, pagein=layer.pagein,
                         residency=residency, step=step)  # fmt: skip
        got_out = got.out.clone()
        got_report = got.report.select(torch.arange(len(lens_list), device="cuda"))
        got_traffic = layer.pagein.take_stats()
        qp, tp, lp = _padded(q, tables, lens)
        want = certified_attention(qp, layer.cache, tp, lp, cfg, scale, pagein=layer.pagein, residency=residency,
                                   backend="cuda")  # fmt: skip
        want_traffic = layer.pagein.take_stats()
        R = len(lens_list)
        assert torch.equal(got_out, want.out[:R]), lens_list
        for f in fields(CertReport):
            assert torch.equal(getattr(got_report, f.name), getattr(want.report, f.name)[:R]), (f.name, lens_list)
        if graphs.replays > before:  # a replay counts the promotions of the call it replays (the bytes differ:
            # the eager call finds in the pool the pages the replay just filled)
            assert (got_traffic.key_blocks, got_traffic.value_blocks) == (want_traffic.key_blocks,
                                                                          want_traffic.value_blocks)  # fmt: skip
            assert got_traffic.bytes >= want_traffic.bytes > 0
        exact = _exact64(layer, q, tables, lens, scale)
        err = torch.linalg.vector_norm(got_out.double().cpu() - exact, dim=-1)
        certified = got_report.rung.cpu() <= 2
        bound = got_report.bound.double().cpu()
        assert bool((err[certified] <= bound[certified]).all()), (lens_list, float((err - bound)[certified].max()))
        # a second layer in the same step: its graph shares the inputs (tables and lengths already written)
        q1 = torch.randn(len(lens_list), 8, 128, generator=gen).to(torch.bfloat16).cuda()
        got1 = graphs.run("layer1", q1, layer.cache, tables, lens, cfg, scale, pagein=layer.pagein,
                          residency=residency, step=step)  # fmt: skip
        got1_out = got1.out.clone()
        want1 = certified_attention(_padded(q1, tables, lens)[0], layer.cache, tp, lp, cfg, scale,
                                    pagein=layer.pagein, residency=residency, backend="cuda")  # fmt: skip
        assert torch.equal(got1_out, want1.out[:R]), ("layer1", lens_list)
        layer.pagein.take_stats()  # the second layer's traffic is not the next step's
    assert graphs.replays == 6 and graphs.captures == len(graphs) == 10  # 2 layers × keys 1×3, 4×20, 8×32, 2×6, 4×64
    # the same table tensor modified in place, under a new step token: its new values are what the replay reads
    tables[0, 0] = tables[1, 0]
    got = graphs.run("layer0", q, layer.cache, tables, lens, cfg, scale, pagein=layer.pagein, residency=residency,
                     step=object())  # fmt: skip
    got_out = got.out.clone()
    qp, tp, lp = _padded(q, tables, lens)
    want = certified_attention(qp, layer.cache, tp, lp, cfg, scale, pagein=layer.pagein, residency=residency,
                               backend="cuda")  # fmt: skip
    assert graphs.replays == 7 and torch.equal(got_out, want.out[: len(lens)])
