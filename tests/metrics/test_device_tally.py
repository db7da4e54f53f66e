"""The device tally (``certvllm.metrics.tally``, kernel ``triton_kernels.report_tally``) gives the metrics exactly the
counts and buckets of the host fold of the same reports: per-call host records (``CertMetrics.record``, the CPU path)
and once-per-step tallies (``CertMetrics.record_step``, the CUDA path) must expose the same series.

Reports are random with every rung and flag, plus the corners of the fold: NaN and infinite bounds (the last
bucket, outside the sum), ``v_max`` 0 (the relative bound's clamp), values equal to a bucket bound in float32
(which bucket is decided in float64), rows past a padded call's real rows (not counted). On the CPU the kernel runs
in Triton's interpreter; ``pytest -m gpu`` runs it compiled. Sums are compared to 1e-12 relative (float64 sums in
another order); every count exactly."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from certvllm.bounds.report import CertReport
from certvllm.metrics import CertMetrics
from certvllm.metrics.prometheus import BOUND_BUCKETS, RELATIVE_BUCKETS
from certvllm.testing import metric_samples

FLAGS = ("rank_fail", "boundary_fail", "bound_fail", "canary_fail", "precondition")


def _report(rows: int, heads: int, gen: torch.Generator) -> CertReport:
    rep = CertReport.zeros(rows, heads)
    rep.rung = torch.randint(0, 5, (rows, heads), generator=gen).to(torch.int8)
    rep.e_key = torch.rand(rows, heads, generator=gen) ** 3 * 3
    rep.e_val = torch.rand(rows, heads, generator=gen) ** 3 * 30
    rep.v_max = torch.rand(rows, heads, generator=gen) * 4
    rep.k_star = torch.randint(0, 40, (rows, heads), generator=gen, dtype=torch.int32)
    rep.v_promoted = torch.randint(0, 9, (rows, heads), generator=gen, dtype=torch.int32)
    for flag in FLAGS:
        setattr(rep, flag, torch.rand(rows, heads, generator=gen) < 0.3)
    rep.rung[0, :4] = torch.tensor([0, 1, 2, 0], dtype=torch.int8)  # certified corners below
    rep.e_key[0, 0], rep.e_val[0, 1] = float("nan"), float("inf")
    rep.v_max[0, 2] = 0.0
    rep.e_key[0, 3], rep.e_val[0, 3] = BOUND_BUCKETS[4], BOUND_BUCKETS[6]  # on a bound, in float32
    rep.e_key[-1, -1] = -float("inf")
    return rep


def _compare(device: str) -> None:
    from certvllm.kv.deferred import ReadBatch
    from certvllm.metrics.tally import DeviceTally

    gen = torch.Generator().manual_seed(5)
    host = CertMetrics("m", "0", flush_seconds=3600, registry=CollectorRegistry())
    tallied = CertMetrics("m", "0", flush_seconds=3600, registry=CollectorRegistry())
    tally = DeviceTally(device, (BOUND_BUCKETS, BOUND_BUCKETS, RELATIVE_BUCKETS))
    heads = 6
    for step in range(3):
        for layer in (3, 0, 7):  # rows given in first-use order, not by index
            padded = 5 + step
            real = padded - (layer == 0)  # layer 0's calls are padded by one row: it must not count
            rep = _report(padded, heads, gen)
            host.record(rep.select(slice(0, real)), layer)
            on_device = rep.to(device)
            if layer == 0:
                tally.add(on_device, layer, torch.tensor([real], device=device))
            else:
                tally.add(on_device, layer)
        batch = ReadBatch()
        tallied.record_step(tally.take(batch), batch=batch)
    host.flush()
    tallied.flush()
    want, got = metric_samples(host._registry), metric_samples(tallied._registry)
    assert want.keys() == got.keys()
    assert want["vllm:cert_head_steps_total{rung=3}"] > 0
    assert want["vllm:cert_e_key_bucket{le=+Inf}"] > want["vllm:cert_e_key_bucket{le=10.0}"]  # the non-finite ones
    for name, value in want.items():
        if "_sum{" in name:
            assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-300), name
        else:
            assert got[name] == value, name
    assert not bool(tally.totals.any()), "a take leaves the rows it read zeroed"


def test_tally_and_host_fold_expose_the_same_series():
    _compare("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tally_and_host_fold_expose_the_same_series_on_cuda():
    _compare("cuda")


def test_a_tally_refuses_a_layer_past_its_rows():
    from certvllm.metrics.tally import DeviceTally

    tally = DeviceTally("cpu", (BOUND_BUCKETS, BOUND_BUCKETS, RELATIVE_BUCKETS), max_layers=2)
    tally.row(4)
    tally.row(9)
    with pytest.raises(RuntimeError, match="holds 2 layers; layer 11"):
        tally.row(11)
