"""Exact prefill off the CPU (``ExactAttention(on_cpu=False)``, what the plugin runs on CUDA), checked on CPU
tensors against a float64 causal reference.

Requests mix a prompt with no cached context, chunked prefills with cached context (whole and partial
16-token blocks of context) and a one-token row. Tolerances, per request: the float16 outputs are at most
``factor = 2`` times as far from the float64 causal reference as that reference computed in float32 and
rounded to float16 is (worst element; ``certvllm.testing.assert_within_lowp_error``, FlashAttention's
rule), plus ``atol = 2^-23·max|v|`` (a float32 ulp at the values' scale: the floor for a reference that
happens to be exact); and, as before, within ``atol = rtol = 2e-3`` of float64: the rule alone allows
about 2 float16 half-ulps of the request's largest output, just under 2e-3 for outputs in [2, 4) (as here:
stricter on every element) but 2^-8 ≈ 3.9e-3 near zero once they reach 4, so both are kept.
Passing the step's own keys and values (``fresh``) must give bit-identical outputs to reading everything
from the shadow: the same values reach the same kernel. The variable-length flash route is checked with a
stand-in kernel that computes each sequence separately from the ``cu_seqlens`` it is given, so the packing
(query runs in any order, non-contiguous runs, bottom-right causal alignment) is what is tested.
"""

from __future__ import annotations

import pytest
import torch

from certvllm.kv.pagein import PageInEngine
from certvllm.testing import assert_within_lowp_error, make_case, paged_batch
from certvllm.vllm_plugin.exact import ExactAttention, ExactPlan

HQ, HKV, D = 8, 2, 64
SCALE = 1 / 8
ATOL = RTOL = 2e-3
FACTOR = 2.0
ULP = 2.0**-23  # atol of the rule per unit of max|v|


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Causal attention of the last ``Q`` positions over ``T`` keys computed in ``dtype``: ``[Q, H_q, D]``."""
    n_q, n_k = q.shape[0], k.shape[0]
    g = HQ // HKV
    kk = k.to(dtype).repeat_interleave(g, dim=1)
    vv = v.to(dtype).repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(dtype), kk) * SCALE
    pos_q = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)
    s = s.masked_fill(torch.arange(n_k).unsqueeze(0) > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


def _assert_matches_reference(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    ref64 = _reference(q, k, v)
    ref_lowp = _reference(q, k, v, torch.float32).to(out.dtype)  # the same math in float32, float16 outputs
    atol = ULP * float(v.float().abs().max())
    assert_within_lowp_error(out, ref64, ref_lowp, factor=FACTOR, atol=atol, what=f"{q.shape[0]}-token request")
    torch.testing.assert_close(out.double(), ref64, atol=ATOL, rtol=RTOL)


@pytest.fixture
def batch():
    """(cache, plan, query, fresh keys/values, per-request (query slice, keys, values))."""
    gen = torch.Generator().manual_seed(7)
    lens = [(70, 70), (100, 37), (64, 16), (90, 1), (33, 33)]  # (seq_len, query tokens): ctx 0, 63, 48, 89, 0
    cases = [make_case("random", t, HQ, HKV, D, torch.float16, gen) for t, _ in lens]
    cache, tables, seq_lens = paged_batch(cases)
    q_lens = [n for _, n in lens]
    qsl = torch.tensor([0, *q_lens]).cumsum(0)
    query = torch.randn(int(qsl[-1]), HQ, D, generator=gen).to(torch.float16)
    fresh_k = torch.cat([c.k[t - n :] for c, (t, n) in zip(cases, lens, strict=True)])
    fresh_v = torch.cat([c.v[t - n :] for c, (t, n) in zip(cases, lens, strict=True)])
    plan = ExactPlan(qsl.to(torch.int32), seq_lens.to(torch.int32), tables.to(torch.int32))
    per_request = [(slice(int(qsl[i]), int(qsl[i + 1])), c.k, c.v) for i, c in enumerate(cases)]
    return cache, plan, query, (fresh_k, fresh_v), per_request


def _run(exact: ExactAttention, batch, fresh: bool) -> torch.Tensor:
    cache, plan, query, kv, _ = batch
    out = torch.empty_like(query)
    exact.run(plan, query, cache, out, PageInEngine("cpu"), fresh=kv if fresh else None)
    return out


def test_prefill_matches_float64_with_and_without_fresh(batch):
    exact = ExactAttention(HQ, HKV, D, torch.float16, SCALE, 16, on_cpu=False)
    from_shadow = _run(exact, batch, fresh=False)
    with_fresh = _run(exact, batch, fresh=True)
    assert torch.equal(from_shadow, with_fresh)
    _, _, query, _, per_request = batch
    for rows, k, v in per_request:
        _assert_matches_reference(with_fresh[rows], query[rows], k, v)


class FlashStandIn:
    """``fn(q, k, v, cu_q, cu_k, max_q, max_k, scale, out)`` computed sequence by sequence (bottom-right
    causal, as FlashAttention aligns it), recording what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, out) -> None:
        assert scale == SCALE and q.is_contiguous() and out.shape == q.shape
        cq, ck = cu_q.tolist(), cu_k.tolist()
        self.calls.append((cq, ck))
        assert max_q == max(b - a for a, b in zip(cq, cq[1:], strict=False))
        assert max_k == max(b - a for a, b in zip(ck, ck[1:], strict=False))
        for i in range(len(cq) - 1):
            o = _reference(q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]])
            out[cq[i] : cq[i + 1]] = o.to(out.dtype)


def test_flash_route_packs_every_multi_token_request_into_one_call(batch, monkeypatch):
    """The one-token row stays on ``dense_decode``; the four prefills go to one variable-length call, whose
    query runs are not contiguous in the batch (the one-token row sits between them)."""
    exact = ExactAttention(HQ, HKV, D, torch.float16, SCALE, 16, on_cpu=False)
    flash = FlashStandIn()
    monkeypatch.setattr(exact, "_flash", lambda device: flash)  # what CUDA resolves to, on CPU tensors
    cache, plan, query, kv, per_request = batch
    out = torch.empty_like(query)
    exact.run(plan, query, cache, out, PageInEngine("cpu"), fresh=kv)
    assert len(flash.calls) == 1
    cu_q, cu_k = flash.calls[0]
    assert cu_q == [0, 70, 107, 123, 156] and cu_k == [0, 70, 170, 234, 267]
    for rows, k, v in per_request:
        _assert_matches_reference(out[rows], query[rows], k, v)
