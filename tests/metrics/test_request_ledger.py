"""``certvllm.metrics.requests``: per-request certificates accumulated in the worker.

The ledger is fed the same layer-call reports as the Prometheus metrics (``CertMetrics``) and must give each request
exactly the part of every series its rows caused: the head-steps by rung, the promoted blocks, the rung-4 rows, the
audits, and the largest returned bound, which must fall in the bucket of the ``vllm:cert_bound_relative`` histogram
that holds its largest observation. Slots are reused after release, grow without losing totals, and a snapshot is
the totals at the time it was taken. The CUDA side (no host synchronisation in the layer calls or the snapshot) is
``test_request_ledger_on_cuda``, run with ``pytest -m gpu``."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from prometheus_client import CollectorRegistry

from certvllm.bounds.report import CertReport
from certvllm.metrics import CertMetrics
from certvllm.metrics.prometheus import RELATIVE_BUCKETS
from certvllm.metrics.requests import (
    COUNTS,
    EXACT_REASONS,
    RequestLedger,
    RequestTotals,
    certificate,
    merge_certificates,
)
from certvllm.testing import metric_samples

HEADS = 6


def _report(rows: int, gen: torch.Generator) -> CertReport:
    """A report with every rung (whole rows at rung 4), bounds over several decades, promotions."""
    r = CertReport.zeros(rows, HEADS)
    r.rung.copy_(torch.randint(0, 4, (rows, HEADS), generator=gen).to(torch.int8))
    r.rung[torch.rand(rows, generator=gen) < 0.2] = 4
    r.e_key.copy_(10 ** (torch.rand(rows, HEADS, generator=gen) * 4 - 5))
    r.e_val.copy_(10 ** (torch.rand(rows, HEADS, generator=gen) * 4 - 5))
    r.v_max.copy_(torch.rand(rows, HEADS, generator=gen) + 0.05)
    exact = r.rung >= 3
    for t in (r.e_key, r.e_val):
        t.masked_fill_(exact, 0.0)  # rungs 3/4 report no bound, as the op does
    r.k_star.copy_(torch.randint(0, 30, (rows, HEADS), generator=gen, dtype=torch.int32))
    r.v_promoted.copy_(torch.randint(0, 3, (rows, HEADS), generator=gen, dtype=torch.int32))
    return r


def _steps(gen: torch.Generator) -> list[list[str | None]]:
    """Each step's certified rows as request ids: three requests joining and leaving, one with several rows in a
    step (a certified prefill), and padding rows of no request."""
    return [["a"], ["a", "b"], ["a", "b", "b", "b"], [None, "b", "a"], ["c", "b"], ["c", None], ["c"]]


def _run(gen: torch.Generator, only: str | None = None, layers: int = 3) -> tuple[RequestLedger, dict, list]:
    """The steps of :func:`_steps` (rows of requests other than ``only`` dropped when it is given) through a ledger
    and a ``CertMetrics`` of their own; the ledger, the Prometheus samples and every (request, report row) pair."""
    ledger = RequestLedger(capacity=2)  # grows while the requests arrive
    registry = CollectorRegistry()
    metrics = CertMetrics("ledger", "0", registry=registry, flush_seconds=3600)
    rows_seen = []
    for step in _steps(gen):
        requests = [r for r in step if only is None or r == only]
        if not requests:
            continue
        slots = ledger.slots(requests, "cpu")
        for layer in range(layers):
            report = _report(len(requests), gen)
            ledger.record(report, slots)
            metrics.record(report, layer)
            rows_seen += [(rid, report.select(i)) for i, rid in enumerate(requests)]
    metrics.flush()
    return ledger, metric_samples(registry), rows_seen


def _expected(rows: list, rid: str) -> dict[str, float]:
    """A request's totals straight from its report rows (independent of the ledger's reductions)."""
    mine = [r for who, r in rows if who == rid]
    rung = torch.stack([r.rung for r in mine]).long()
    certified = rung <= 2
    bound = torch.stack([r.e_key + r.e_val for r in mine])
    rel = bound / torch.stack([r.v_max for r in mine]).clamp_min(1e-30)
    out = {f"rung_{k}": int((rung == k).sum()) for k in range(5)}
    out["layers_recomputed"] = int((rung == 4).any(dim=1).sum())
    out["promoted_key_blocks"] = int(sum(int(r.k_star.sum()) for r in mine))
    out["promoted_value_blocks"] = int(sum(int(r.v_promoted.sum()) for r in mine))
    out["bound_max"] = float(bound[certified].max()) if certified.any() else 0.0
    out["bound_relative_max"] = float(rel[certified].max()) if certified.any() else 0.0
    return out


def test_each_request_gets_its_own_share_of_every_series(gen):
    ledger, prom, rows = _run(gen)
    totals = ledger.snapshot(["a", "b", "c", "unknown"]).totals()
    assert set(totals) == {"a", "b", "c"}  # a request the ledger never saw has no entry
    for rid in ("a", "b", "c"):
        want, got = _expected(rows, rid), totals[rid]
        counts = dict(zip(COUNTS, got.counts, strict=True))
        for name in COUNTS[:8]:
            assert counts[name] == want[name], (rid, name)
        assert got.maxes[0] == pytest.approx(want["bound_max"], rel=1e-6)
        assert got.maxes[1] == pytest.approx(want["bound_relative_max"], rel=1e-6)
    # the requests' shares add up to the series, padding rows (no request) aside
    padding = [r for who, r in rows if who is None]
    pad_rungs = torch.bincount(torch.cat([r.rung.flatten() for r in padding]).long(), minlength=5).tolist()
    for k in range(5):
        share = sum(dict(zip(COUNTS, totals[r].counts, strict=True))[f"rung_{k}"] for r in totals)
        assert share + pad_rungs[k] == prom[f"vllm:cert_head_steps_total{{rung={k}}}"]
    keys = sum(dict(zip(COUNTS, t.counts, strict=True))["promoted_key_blocks"] for t in totals.values())
    assert keys + sum(int(r.k_star.sum()) for r in padding) == prom["vllm:cert_promoted_key_blocks_total{}"]


def test_a_request_alone_moves_the_series_by_exactly_its_totals(gen):
    """What the server test checks through ``/metrics``, here on one process: a request run alone."""
    ledger, prom, rows = _run(gen, only="b")
    got = ledger.snapshot(["b"]).totals()["b"]
    cert = certificate(got)
    for k in range(5):
        assert cert["head_steps"][str(k)] == prom[f"vllm:cert_head_steps_total{{rung={k}}}"]
    assert cert["promoted_key_blocks"] == prom["vllm:cert_promoted_key_blocks_total{}"]
    assert cert["promoted_value_blocks"] == prom["vllm:cert_promoted_value_blocks_total{}"]
    assert cert["certified_head_steps"] == prom["vllm:cert_bound_relative_count{}"]
    # the largest relative bound lies in the histogram's highest occupied bucket
    assert_in_top_bucket(cert["bound_relative_max"], prom)


def assert_in_top_bucket(value: float, prom: dict[str, float]) -> None:
    """``value`` (the largest observation of ``vllm:cert_bound_relative``) lies in the smallest bucket that holds
    every observation, and above the bucket edge before it."""
    total = prom["vllm:cert_bound_relative_count{}"]
    edges = [*RELATIVE_BUCKETS, math.inf]
    cumulative = [prom[f"vllm:cert_bound_relative_bucket{{le={float(e)}}}" if e != math.inf else
                       "vllm:cert_bound_relative_bucket{le=+Inf}"] for e in edges]  # fmt: skip
    top = next(i for i, c in enumerate(cumulative) if c == total)
    assert value <= edges[top]
    assert top == 0 or value > edges[top - 1]


def test_audits_exact_tokens_release_and_reuse(gen):
    ledger = RequestLedger(capacity=2)
    slots = ledger.slots(["x", "y", "x"], "cpu")
    ledger.record(_report(3, gen), slots)
    ledger.record_audit(slots[torch.tensor([0, 1, 2, 2])], torch.tensor([False, True, True, False]))
    ledger.record_exact("x", "prefill", 7)
    ledger.record_exact("z", "prefill_cached", 3)  # exact tokens only: no certified row
    ledger.record_exact(None, "prefill", 5)  # padding: no request
    totals = ledger.snapshot(["x", "y", "z"]).totals()
    audits = {r: dict(zip(COUNTS, t.counts, strict=True)) for r, t in totals.items()}
    assert (audits["x"]["audits"], audits["x"]["audit_violations"]) == (3, 1)
    assert (audits["y"]["audits"], audits["y"]["audit_violations"]) == (1, 1)
    assert totals["x"].exact == [7, 0, 0] and totals["z"].exact == [0, 3, 0]
    assert totals["z"].counts == [0] * len(COUNTS) and totals["z"].maxes == [0.0, 0.0]
    assert certificate(totals["y"])["audit_flagged"] and not certificate(totals["z"])["audit_flagged"]
    # a snapshot is the totals when it was taken
    before = ledger.snapshot(["x"])
    ledger.record(_report(3, gen), slots)
    assert before.totals()["x"].counts[:5] == totals["x"].counts[:5]
    # released requests leave; their slots come back zeroed for the next ones
    ledger.release(["x", "z"])
    assert set(ledger.snapshot(["x", "y", "z"]).totals()) == {"y"}
    again = ledger.slots(["w"], "cpu")
    assert int(again[0]) == int(slots[0])
    assert ledger.snapshot(["w"]).totals()["w"].counts == [0] * len(COUNTS)


def test_growth_keeps_every_total(gen):
    ledger = RequestLedger(capacity=2)
    first = ledger.slots(["r0"], "cpu")
    ledger.record(_report(1, gen), first)
    before = ledger.snapshot(["r0"]).totals()["r0"]
    ledger.slots([f"r{i}" for i in range(40)], "cpu")  # grows twice
    assert ledger.counts.shape[0] > 40
    assert ledger.snapshot(["r0"]).totals()["r0"] == before


def test_a_non_finite_bound_is_reported_as_such(gen):
    ledger = RequestLedger()
    report = _report(2, gen)
    report.rung[0, 0] = 0
    report.e_key[0, 0] = float("nan")
    ledger.record(report, ledger.slots(["n", "m"], "cpu"))
    totals = ledger.snapshot(["n", "m"]).totals()
    cert = certificate(totals["n"])
    assert cert["bound_max"] is None and cert["bound_relative_max"] is None and not cert["bound_finite"]
    assert certificate(totals["m"])["bound_finite"]


def test_totals_merge_over_ranks_and_certificates_over_requests():
    a = RequestTotals([1, 2, 3, 4, 5, 1, 10, 2, 3, 0], [0.5, 0.01], [4, 0, 0])
    b = RequestTotals([2, 0, 0, 1, 0, 0, 5, 0, 1, 1], [0.25, 0.02], [4, 0, 0])
    ranks = a.merge_ranks(b)  # two tensor-parallel ranks: their own heads, the same tokens
    assert ranks.counts == [3, 2, 3, 5, 5, 1, 15, 2, 4, 1] and ranks.maxes == [0.5, 0.02] and ranks.exact == [4, 0, 0]
    merged = merge_certificates([certificate(a), certificate(b)])  # two prompts of one response
    assert merged["head_steps"] == {"0": 3, "1": 2, "2": 3, "3": 5, "4": 5}
    assert merged["exact_tokens"] == {"prefill": 8, "prefill_cached": 0, "dense_mode": 0}
    assert merged["bound_max"] == 0.5 and merged["bound_relative_max"] == 0.02
    assert merged["audit_flagged"] and merged["requests"] == 2 and merged["bound_finite"]
    assert merge_certificates([]) is None
    nothing = certificate(RequestTotals())
    assert nothing["bound_max"] is None and nothing["certified_head_steps"] == 0
    assert merge_certificates([nothing, certificate(a)])["bound_max"] == 0.5
    assert list(nothing["exact_tokens"]) == list(EXACT_REASONS)
    assert pickle.loads(pickle.dumps(a)) == a


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_request_ledger_on_cuda(gen):
    """Eight steps of thirty layer calls on the GPU, each step's rows moved up once from pinned memory, its
    calls recorded and its wanted requests snapshotted, under ``set_sync_debug_mode("error")`` (any call that
    synchronises the host with the GPU raises); the totals read afterwards equal the CPU ledger's."""
    steps = [["a", "b"], ["a", "b", "c"], ["b", "c"], ["c", None]] * 2
    reports = [[_report(len(s), gen) for _ in range(30)] for s in steps]
    on_gpu = [[r.to("cuda") for r in calls] for calls in reports]
    cpu, gpu = RequestLedger(), RequestLedger()
    for ledger, device in ((cpu, "cpu"), (gpu, "cuda")):  # allocate and pin outside the checked region
        ledger.slots(["a", "b", "c"], device)
    snaps = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, calls in zip(steps, on_gpu, strict=True):
            slots = gpu.slots(step, "cuda").pin_memory().to("cuda", non_blocking=True)
            for report in calls:
                gpu.record(report, slots)
            gpu.record_audit(slots[:1], torch.ones(1, dtype=torch.bool, device="cuda"))
            snaps.append(gpu.snapshot([r for r in step if r]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for step, calls in zip(steps, reports, strict=True):
        slots = cpu.slots(step, "cpu")
        for report in calls:
            cpu.record(report, slots)
        cpu.record_audit(slots[:1], torch.ones(1, dtype=torch.bool))
    want = cpu.snapshot(["a", "b", "c"]).totals()
    got = snaps[5].totals() | snaps[6].totals() | snaps[7].totals()  # each request's last step: a, b, c
    for rid in ("a", "b", "c"):
        assert got[rid].counts == want[rid].counts
        assert got[rid].maxes == pytest.approx(want[rid].maxes, rel=1e-6)
