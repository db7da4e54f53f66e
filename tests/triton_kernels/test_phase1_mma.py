"""Phase 1 with the INT8 scores on the tensor cores (``triton_kernels/phase1_mma.py``, docs/certification.md §5.2).

In Triton's interpreter here (compiled on a GPU, where the Gluon kernel is compared with it too):

* every score of every full block and query head is within the block's R_b of the real-number INT8 score
  ŝ_t = Σ_c q'_c·(ℓ̃_c + code·σ_c), evaluated in float64 from the decoded pages (no slack: the float64 evaluation's own
  error, ≤ 2^-40 of the magnitude, is far inside R_b's margins);
* R_b is at least the float32 path's (``bounds.score_rounding``: ``rounding_factor``·Σ|q'|·M_c), so it bounds the
  promotion pass's exact scores of the block too (1 − 2^-20: sums in other orders);
* η_b, ν_b and the page flags are the decoded pages', Δ_b is ``bounds.block_delta`` of the decoded scales to 1e-6
  relative (the same products, summed in another order); the block maxima within R_b of the float64 scores' and the
  log-masses within R_b plus ``tl.exp``'s approximation (1e-5 relative: they feed selection heuristics only);
* a zero query head scores exactly; a head out of the kernel's range (a tiny query on tiny keys) gets R_b = +inf.

The whole certified path runs this phase 1 in ``test_triton_kernels.py`` and ``test_gpu.py`` (soundness over the
random and adversarial families, rungs 3/4 exact).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.triton_kernels import phase1 as p1mod  # noqa: E402
from certvllm.triton_kernels.common import split_plan  # noqa: E402
from certvllm.triton_kernels.tuning import KernelTuning  # noqa: E402

from certvllm.attention.gpu import _lut  # noqa: E402
from certvllm.bounds import block_delta, delta_factor, score_rounding  # noqa: E402
from certvllm.formats.pages import PageReader  # noqa: E402
from certvllm.kv.cache import LayerKVCache  # noqa: E402
from certvllm.testing import exact_int8_scores, make_case, out_of_phase1_range_case, paged_batch  # noqa: E402

pytestmark = pytest.mark.slow  # the interpreter: make test runs it, make test-quick does not
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MMA = KernelTuning()
GPU_LANE = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="runs compiled: pytest -m gpu")]


def _gpu_lane(*values):
    return pytest.param(*values, marks=GPU_LANE)


def _phase1(cases, tuning, blocks_per_split=3):
    """Phase 1 over ``cases`` (paged by the reference writer) → (Phase1Out, q' [R, H_q, D], cache, tables, nfull)."""
    cache, tables, lens = paged_batch(cases)
    d = cases[0].q.shape[-1]
    hkv = cases[0].k.shape[1]
    dcache = LayerKVCache(cache.pages.to(DEV), cache.shadow, cache.layout)
    tables, nfull = tables.long().to(DEV).contiguous(), (lens // 16).long().to(DEV)
    q = (torch.stack([c.q for c in cases]).to(DEV).float() * (1 / math.sqrt(d))).contiguous()
    splits, bps = split_plan(tables.shape[1], len(cases) * hkv, blocks_per_split)
    out = p1mod.phase1(q, dcache.pages, tables, nfull, _lut(DEV), cache.layout, hkv, cache.sub_blocks,
                       delta_factor(d), splits, bps, tuning=tuning)  # fmt: skip
    return out, q, cache, tables, nfull


def _reference(q, cache, tables, nfull):
    """From the decoded pages: ŝ in float64 ``[R, H_kv, B, G, 16]``, the validity of the full blocks ``[R, B]``, and the
    float32 path's per-block terms (``bounds``): Δ_b and R_b ``[R, H_kv, G, B]``, η_b, ν_b, flags ``[R, H_kv, B]``."""
    lay = cache.layout
    dec = PageReader(lay).decode(cache.pages, with_values=False)
    tab = tables.cpu()
    R, B = tab.shape
    hkv = cache.num_kv_heads
    G = q.shape[1] // hkv
    sig = dec.sigma[tab]  # [R, B, H, D]
    qh = q.cpu().view(R, hkv, G, lay.head_dim)
    s = torch.stack([exact_int8_scores(q[r].cpu(), cache, tab[r]) for r in range(R)])  # [R, K, B, G, 16]
    valid = torch.arange(B) < nfull.cpu().unsqueeze(1)
    qa = qh.abs()
    delta = block_delta(qa, sig)
    rounding = score_rounding(qa, dec.key_mag[tab])
    bad = (~dec.valid | dec.violated)[tab].permute(0, 2, 1)
    return s, valid, delta, rounding, dec.eta[tab].permute(0, 2, 1), dec.nu[tab].permute(0, 2, 1), bad


@pytest.mark.parametrize(
    "family,hq,hkv,d",
    [("random", 8, 2, 64), ("outlier_channels", 12, 4, 64), _gpu_lane("huge_norms", 32, 8, 128),
     _gpu_lane("constant_channels", 8, 1, 128), _gpu_lane("tiny_norms", 16, 2, 64), _gpu_lane("one_hot", 24, 3, 64)],
)  # fmt: skip
@pytest.mark.parametrize("dialect", ["auto", "triton"])
def test_mma_scores_stay_within_their_bound_and_match_the_float32_path(family, hq, hkv, d, dialect, gen):
    """``dialect``: on a GPU ``auto`` runs the Gluon kernel and ``triton`` the compiled Triton one; in the interpreter
    both are the Triton kernel."""
    cases = [make_case(family, t, hq, hkv, d, torch.float16, gen) for t in (40, 133)]
    got, q, cache, tables, nfull = _phase1(cases, KernelTuning(dialect=dialect))
    exact, valid, delta, rounding, eta, nu, bad = _reference(q, cache, tables, nfull)
    v5 = valid[:, None, :, None, None]
    r_b = got.rmax.cpu().double()
    err = torch.where(v5, (got.scores.cpu().double() - exact).abs(), 0.0)
    assert bool((err <= r_b.permute(0, 1, 3, 2)[..., None]).all()), float(
        (err / r_b.permute(0, 1, 3, 2)[..., None]).max()
    )
    v4 = valid[:, None, None, :].expand_as(r_b)
    assert bool((got.rmax.cpu()[v4] >= rounding[v4] * (1 - 2.0**-20)).all())  # covers the float32 path's scores
    v3 = valid[:, None, :].expand_as(eta)
    for name, want, neutral in (("eta", eta, 0.0), ("nu", nu, 0.0), ("bad", bad.int(), 0)):
        got_f = getattr(got, name).cpu()
        assert torch.equal(got_f[v3], want[v3].to(got_f.dtype)) and bool((got_f[~v3] == neutral).all()), name
    torch.testing.assert_close(got.delta.cpu()[v4], delta[v4], rtol=1e-6, atol=0.0)
    assert bool((got.delta.cpu()[~v4] == 0).all()) and bool((got.rmax.cpu()[~v4] == 0).all())
    m_exact = exact.amax(dim=-1).permute(0, 1, 3, 2)  # [R, K, G, B]
    l_exact = torch.logsumexp(exact, dim=-1).permute(0, 1, 3, 2)
    m8, l8 = got.m8.cpu().double(), got.l8.cpu().double()
    assert bool(((m8 - m_exact).abs()[v4] <= r_b[v4]).all())
    assert bool(((l8 - l_exact).abs()[v4] <= r_b[v4] + 1e-5 * (1 + l_exact.abs()[v4])).all())
    assert bool(torch.isneginf(got.m8.cpu()[~v4]).all()) and bool(torch.isneginf(got.l8.cpu()[~v4]).all())


def test_mma_zero_query_head_scores_exactly_and_a_tiny_one_is_out_of_range(gen):
    """Head 0 of the group all zero: every score is exactly 0 (Σ 0·ℓ', no limb term) and R_b finite. Then, in bfloat16,
    head 1 scaled by 2^-100 on keys scaled by 2^-20: its grid exponent falls below the kernel's range, so its R_b is
    +inf and its scores 0 (finite: the canary stays quiet), the other heads in range. (The certified call sends that
    head, and only it, to rung 3: ``test_triton_kernels.py``.)"""
    cases = [make_case("random", t, 4, 1, 64, torch.float16, gen) for t in (70, 90)]
    for c in cases:
        c.q[0].zero_()
    got, *_ = _phase1(cases, MMA)
    for r, t in enumerate((70, 90)):
        s0 = got.scores[r, 0, : t // 16, 0].cpu()
        assert torch.equal(s0, torch.zeros_like(s0)) and bool(torch.isfinite(got.rmax[r, 0, 0, : t // 16]).all())
    out, *_ = _phase1(out_of_phase1_range_case(gen), MMA)
    nb = 70 // 16
    assert bool(torch.isinf(out.rmax[0, 0, 1, :nb]).all()) and bool((out.scores[0, 0, :nb, 1] == 0).all())
    assert bool(torch.isfinite(out.rmax[0, 0, [0, 2, 3], :nb]).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon kernel runs compiled only")
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (24, 3, 64), (64, 8, 128), (8, 8, 256)])
def test_gluon_mma_phase1_matches_the_triton_kernel(hq, hkv, d, gen):
    """The Gluon kernel against the Triton one (the interpreter-tested arithmetic): page fields and flags equal, Δ_b
    and R_b to float32 rounding (sums in another order), scores within the sum of both R_b and within the Gluon
    kernel's own R_b of the float64 INT8 scores."""
    if not p1mod.use_gluon(d, hq // hkv, MMA):
        pytest.skip("the Gluon MMA phase 1 does not take this shape")
    cases = [make_case(f, t, hq, hkv, d, torch.float16, gen) for f, t in (("random", 700), ("outlier_channels", 333))]
    got, q, cache, tables, nfull = _phase1(cases, MMA, 5)
    ref, *_ = _phase1(cases, KernelTuning(dialect="triton"), 5)
    for name in ("eta", "nu", "bad"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    for name in ("delta", "rmax"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-6, atol=0.0, msg=name)
    exact, valid, *_ = _reference(q, cache, tables, nfull)
    v5 = valid[:, None, :, None, None]
    err = torch.where(v5, (got.scores.cpu().double() - exact).abs(), 0.0)
    assert bool((err <= got.rmax.cpu().double().permute(0, 1, 3, 2)[..., None]).all())
    diff = torch.where(v5.to(DEV), (got.scores - ref.scores).abs(), 0.0)
    assert bool((diff <= (got.rmax + ref.rmax).permute(0, 1, 3, 2).unsqueeze(-1)).all())
