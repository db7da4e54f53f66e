"""Soundness of certified attention against the float64 exact reference, on random and
adversarial inputs, plus each rung reached by a constructed input.

Tolerances: for every head with rung ≤ 2, ‖out − exact‖₂ ≤ e_key + e_val with exact computed in
float64 over the unquantized originals — no slack. For rung ≥ 3, the output must be bit-identical
to ``dense_decode`` on the same originals.

The compiled CPU kernel against the PyTorch reference: on heads where both reach the same rung ≤ 2,
outputs within 1e-4·V_max of each other and bound terms e_val, e_key within ``torch.allclose`` rtol = 1e-3,
atol = 1e-7 (directed-rounding sums in another order, with no float64 counterpart). Outputs also by
FlashAttention's rule (``certvllm.testing.assert_within_lowp_error``), per family: the kernel's worst
deviation from the float64 evaluation of the certified computation (``certvllm.testing.run_with_exact``:
the reference's selection, exact dequantization; heads where both paths agree on rung ≤ 2, K* and value
promotions) is at most ``factor = 2`` times the reference's own (float32 arithmetic), plus
``atol = 2^-23·max|v|`` (a float32 ulp at the values' scale: the floor where the reference happens to be
exact, e.g. a one-hot softmax). Every family passes since the kernel scores the trailing partial block
with the same reduction as promoted blocks (before, identical keys in the two, as ``retrieval_peaks``
makes, got scores a few ulps apart and the output 2–13× the allowance).
"""

from __future__ import annotations

import importlib.util
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from certvllm.attention import certified_attention, certified_decode, dense_decode
from certvllm.config import load_config, make_config
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.testing import (
    FAMILIES,
    assert_within_lowp_error,
    check_soundness,
    exact_attention,
    make_case,
    paged_batch,
    run_with_exact,
)

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("default", "paper", "strict", "fast", "naive", "coverage")
DTYPES = (torch.float16, torch.bfloat16)


@given(
    family=st.sampled_from(FAMILIES),
    preset=st.sampled_from(PRESETS),
    hkv=st.integers(1, 4),
    ratio=st.sampled_from([1, 3, 4, 8]),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from(DTYPES),
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_bound_holds_over_shapes_and_families(family, preset, hkv, ratio, d, dtype, lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    cases = [make_case(family, t, hkv * ratio, hkv, d, dtype, gen) for t in lengths]
    res = check_soundness(cases, load_config(preset))
    assert res.violations == 0, f"error > bound: {(res.error - res.bound).max()}"
    assert res.dense_mismatch == 0


def test_soundness_sweep_covers_every_family_preset_and_shape():
    """One pass of ``benchmarks/bench_soundness.py``'s family × preset × GQA-shape cycle (both dtypes
    alternate) with short rows: zero violations, every rung-3/4 head equal to dense. The ≥ 10⁶ head-step
    run is the benchmark itself (README, docs/performance.md)."""
    spec = importlib.util.spec_from_file_location("bench_soundness", ROOT / "benchmarks" / "bench_soundness.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cycle = len(FAMILIES) * len(bench.PRESETS) * len(bench.SHAPES)
    groups = bench.run_shard(0, seed=2026, rows=4, max_len=600, calls=cycle)
    assert groups["all"]["violations"] == 0 and groups["all"]["mismatch"] == 0
    expected = {f"family:{f}" for f in FAMILIES} | {f"preset:{p}" for p in bench.PRESETS}
    expected |= {f"shape:{hq}/{hkv}/{d}" for hq, hkv, d in bench.SHAPES}
    assert expected <= set(groups)


@pytest.mark.parametrize("levels", [(15, 3), (255, 1), (3, 15)])
@pytest.mark.parametrize("preset", ["default", "naive", "strict"])
def test_the_bound_holds_on_the_stress_formats(levels, preset, gen):
    """The evaluation's stress formats (4-bit keys with 2-bit values, 1-bit values, 2-bit keys in the same pages):
    every certified head within its bound on random and adversarial families, rungs 3/4 equal to dense, and the
    naive path's error larger than on the standard format (what the stress study exists to show)."""
    cfg = load_config(preset, key_code_levels=levels[0], value_code_levels=levels[1])
    worst = {}
    for family in ("random", "outlier_channels", "near_tied_blocks", "retrieval_peaks", "sink_and_recency"):
        cases = [make_case(family, t, 8, 2, 64, torch.float16, gen) for t in (700, 333)]
        res = _run(cases, cfg)
        if preset == "naive":
            base = check_soundness(cases, load_config("naive"))
            worst[family] = (float(res.error.max()), float(base.error.max()))
    assert all(stress > base for stress, base in worst.values()), worst


def _run(cases, cfg):
    res = check_soundness(cases, cfg)
    assert res.violations == 0 and res.dense_mismatch == 0
    return res


def test_rung1_widens_coverage_when_the_tail_is_heavy(gen):
    cfg = make_config(k_min=1, k_max=8, rung1_multiplier=2.0, rung1_tail_threshold=0.02, v_tol=100.0,
                      rank_check=False, bound_tol=math.inf)  # fmt: skip
    res = _run([make_case("flat", 64 * BLOCK_SIZE, 4, 2, 64, torch.float16, gen)], cfg)
    assert (res.rung == 1).all()
    assert (res.report.k_star == 16).all()


def test_rung1_key_tolerance_trigger(gen):
    base = dict(k_min=1, k_max=4, rung1_tail_threshold=1.0, v_tol=100.0, rank_check=False, rung1_multiplier=8.0)
    case = make_case("random", 48 * BLOCK_SIZE, 4, 2, 64, torch.float16, gen)
    loose = _run([case], make_config(**base))
    tight = _run([case], make_config(**base, key_tol=1e-3))
    assert (loose.rung == 0).all()
    assert (tight.rung == 1).all()
    assert (tight.report.k_star > loose.report.k_star).all()
    assert (tight.report.e_key <= loose.report.e_key).all()


def test_rung2_promotes_values_until_the_value_budget_is_met(gen):
    case = make_case("random", 40 * BLOCK_SIZE, 8, 2, 64, torch.bfloat16, gen)
    res = _run([case], make_config(v_tol=0.002, rank_check=False))
    assert (res.rung == 2).all() and (res.report.v_promoted > 0).all()
    assert (res.report.e_val <= 0.002 * res.report.v_max * 1.0001).all()
    none = _run([case], make_config(v_tol=10.0, rank_check=False))
    assert (none.report.v_promoted == 0).all()


def test_rung3_boundary_test_on_duplicated_top_blocks(gen):
    # two identical blocks: with one block promoted the other ties it, so it may outrank F
    case = make_case("random", 8 * BLOCK_SIZE, 2, 1, 64, torch.float16, gen)
    case.k[BLOCK_SIZE : 2 * BLOCK_SIZE] = case.k[:BLOCK_SIZE]
    case.k[:BLOCK_SIZE] *= 1.0
    case.q[:] = case.k[:BLOCK_SIZE, 0].float().mean(0).to(case.q.dtype) * 3
    res = _run([case], make_config(k_min=1, k_max=1, tau_cov=0.5, rung1_tail_threshold=1.0, v_tol=100.0))
    assert (res.rung == 3).all() and res.report.boundary_fail.all()


def test_rung3_rank_check_on_near_tied_blocks():
    cfg = make_config(k_min=4, k_max=4, eps_guard=0.0, rung1_tail_threshold=1.0, v_tol=100.0)
    found = 0
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        res = _run([make_case("near_tied_blocks", 20 * BLOCK_SIZE, 8, 2, 64, torch.float16, gen)], cfg)
        found += int(res.report.rank_fail.sum())
        assert ((res.rung == 3) | ~res.report.rank_fail).all()
    assert found > 0


def test_rung3_bound_tolerance_recomputes_exactly(gen):
    case = make_case("random", 300, 8, 2, 128, torch.bfloat16, gen)
    res = _run([case], make_config(bound_tol=1e-9))
    assert (res.rung == 3).all() and res.report.bound_fail.all()
    assert (res.bound == 0).all()
    dense = dense_decode(case.q, case.k, case.v, 1 / math.sqrt(128))
    out = certified_decode(case.q, case.k, case.v, make_config(bound_tol=1e-9)).out
    assert torch.equal(out, dense)


def test_rung4_canary_catches_pages_that_disagree_with_their_shadow(gen):
    cases = [make_case("random", 10 * BLOCK_SIZE, 4, 2, 64, torch.float16, gen) for _ in range(2)]
    cache, tables, lens = paged_batch(cases)
    lay = cache.layout
    corrupted = tables[0, :10]
    pages = cache.read_pages(corrupted)
    pages[..., lay.k_codes : lay.k_codes + BLOCK_SIZE * lay.head_dim] = 255  # keys that disagree with the shadow
    cache.write_pages(corrupted, pages)
    q = torch.stack([c.q for c in cases])
    res = certified_attention(q, cache, tables, lens, load_config("default"))
    assert (res.report.rung[0] == 4).all() and res.report.canary_fail[0].all()
    assert (res.report.rung[1] <= 2).all()
    assert torch.equal(res.out[0], dense_decode(cases[0].q, cases[0].k, cases[0].v, 1 / 8))


def test_rung4_precondition_violation_keys_beyond_float16(gen):
    case = make_case("random", 5 * BLOCK_SIZE, 4, 2, 64, torch.bfloat16, gen)
    case.k[3, 1, 0] = -3e5
    res = _run([case], load_config("default"))
    assert (res.rung == 4).all() and res.report.precondition.all()
    naive = check_soundness([case], load_config("naive"))
    assert torch.isinf(naive.report.e_key).all()  # no fallback, so no finite certificate


def test_dense_and_naive_modes_share_the_call(gen):
    case = make_case("random", 200, 8, 2, 64, torch.float16, gen)
    dense = certified_decode(case.q, case.k, case.v, load_config("dense"))
    assert (dense.report.rung == 4).all()
    assert torch.equal(dense.out, dense_decode(case.q, case.k, case.v, 1 / 8))
    naive = certified_decode(case.q, case.k, case.v, load_config("naive"))
    assert (naive.report.rung == 0).all() and (naive.report.k_star == 0).all()
    assert (naive.report.v_promoted == 0).all()


def test_short_sequences_are_exact_up_to_rounding(gen):
    for t in (1, 7, 15):
        case = make_case("random", t, 8, 4, 64, torch.float16, gen)
        res = certified_decode(case.q, case.k, case.v)
        ref = exact_attention(case.q, case.k, case.v)
        assert (res.report.k_star == 0).all() and (res.report.rung == 0).all()
        assert (torch.linalg.vector_norm(res.out.double() - ref, dim=-1) <= res.report.bound.double()).all()
        assert (res.report.bound < 1e-3 * res.report.v_max).all()


def test_batched_rows_match_single_sequence_calls(gen):
    cases = [make_case("retrieval_peaks", t, 12, 3, 64, torch.float16, gen) for t in (5, 33, 250, 600)]
    batch = check_soundness(cases, load_config("default"))
    for i, c in enumerate(cases):
        single = certified_decode(c.q, c.k, c.v)
        assert torch.equal(single.report.k_star, batch.report.k_star[i])
        ref = exact_attention(c.q, c.k, c.v)
        err = torch.linalg.vector_norm(single.out.double() - ref, dim=-1)
        assert (err <= single.report.bound.double()).all()


def test_multi_token_rows_share_a_block_table(gen):
    """Prefill-style rows: query p attends to tokens [0, p]; rows share the block table."""
    case = make_case("sink_and_recency", 130, 8, 2, 64, torch.float16, gen)
    cache, tables, _ = paged_batch([case])
    positions = torch.tensor([15, 16, 31, 47, 100, 129])
    q = torch.randn(len(positions), 8, 64, generator=gen).half()
    res = certified_attention(q, cache, tables.expand(len(positions), -1), positions + 1, load_config("default"))
    for i, p in enumerate(positions.tolist()):
        ref = exact_attention(q[i], case.k[: p + 1], case.v[: p + 1])
        err = torch.linalg.vector_norm(res.out[i].double() - ref, dim=-1)
        ok = (err <= res.report.bound[i].double()) | (res.report.rung[i] >= 3)
        assert ok.all()


def test_input_validation_messages():
    q = torch.randn(6, 64)
    k = torch.randn(10, 4, 64).half()
    with pytest.raises(ValueError, match="not a multiple of H_kv"):
        certified_decode(q, k, k)
    with pytest.raises(ValueError, match="Invalid shapes"):
        certified_decode(q, k[:, :, :32], k)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):  # float32: the CPU activation dtype
        certified_decode(torch.randn(4, 64), k.double(), k.double())


@pytest.mark.parametrize("t", [10, 40, 200])
@pytest.mark.parametrize("preset", ["default", "naive"])
def test_tiny_bf16_values_keep_a_positive_bound(t, preset, gen):
    """float32 squares of ~1e-25 values underflow; the annotations must not report 0."""
    case = make_case("random", t, 4, 2, 64, torch.bfloat16, gen)
    case.v = (case.v.double() * 1e-25).to(torch.bfloat16)
    res = check_soundness([case], load_config(preset))
    assert res.violations == 0
    assert (res.report.v_max > 0).all()


@pytest.mark.parametrize("t", [10, 300])
def test_overflowing_bounds_escalate_instead_of_returning_nan(t, gen):
    case = make_case("random", t, 4, 2, 64, torch.bfloat16, gen)
    case.q = (case.q.double() * 1000).to(torch.bfloat16)
    res = check_soundness([case], load_config("default"))
    assert res.violations == 0 and res.dense_mismatch == 0
    certified = res.rung <= 2
    assert torch.isfinite(res.bound[certified]).all()


@pytest.fixture(params=["cpu", "reference"])
def cpu_path(request):
    """Run a test on the compiled CPU kernel and on the PyTorch reference (the op's ``backend``)."""
    from certvllm.attention import cpu_fused

    if request.param == "cpu":
        assert cpu_fused.cpu_kernel.available(), "the CPU kernel did not build"
    return request.param


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", PRESETS)
def test_both_cpu_paths_are_sound(cpu_path, family, preset, gen):
    cases = [make_case(family, t, 12, 3, 64, torch.bfloat16, gen) for t in (3, 16, 47, 300, 777)]
    res = check_soundness(cases, load_config(preset), backend=cpu_path)
    assert res.violations == 0 and res.dense_mismatch == 0


def test_cpu_kernel_times_its_shadow_reads(gen):
    """The compiled CPU kernel reads promoted pages (and partial blocks) from the shadow in place: the page-in
    engine's seconds (``vllm:cert_page_in_seconds``) grow whenever its bytes do, and stay 0 when nothing is
    read (naive mode over whole blocks)."""
    from certvllm.attention import cpu_fused
    from certvllm.kv.pagein import PageInEngine

    assert cpu_fused.cpu_kernel.available()
    for preset, lengths, reads in (("default", (600, 1700), True), ("naive", (608, 1712), False)):
        cases = [make_case("random", t, 8, 2, 64, torch.bfloat16, gen) for t in lengths]
        cache, tables, lens = paged_batch(cases)
        q = torch.stack([c.q for c in cases])
        pagein = PageInEngine()
        certified_attention(q, cache, tables, lens, load_config(preset), pagein=pagein, backend="cpu")
        stats = pagein.take_stats()
        assert (stats.bytes > 0) == reads and (stats.seconds > 0) == reads, (preset, stats)
        assert stats.seconds < 10.0


@pytest.mark.parametrize("preset", ["default", "coverage"])
def test_fused_kernel_matches_the_reference(preset, gen):
    from certvllm.attention import cpu_fused

    assert cpu_fused.cpu_kernel.available()
    agree = total = 0
    for family in FAMILIES:
        cases = [make_case(family, t, 8, 2, 128, torch.float16, gen) for t in (20, 200, 650)]
        cache, tables, lens = paged_batch(cases)
        q = torch.stack([c.q for c in cases])
        cfg = load_config(preset)
        fused = certified_attention(q, cache, tables, lens, cfg, backend="cpu")
        ref = certified_attention(q, cache, tables, lens, cfg, backend="reference")
        same = fused.report.rung == ref.report.rung
        agree += int(same.sum())
        total += same.numel()
        both = same & (ref.report.rung <= 2)
        scale = ref.report.v_max[both].unsqueeze(-1)
        assert ((fused.out[both] - ref.out[both]).abs() <= 1e-4 * scale).all()
        assert torch.allclose(fused.report.e_val[both], ref.report.e_val[both], rtol=1e-3, atol=1e-7)
        assert torch.allclose(fused.report.e_key[both], ref.report.e_key[both], rtol=1e-3, atol=1e-7)
        assert torch.equal(fused.report.k_star[both], ref.report.k_star[both])
    assert agree >= 0.97 * total


@pytest.mark.parametrize(
    "family",
    FAMILIES,
)  # fmt: skip
def test_fused_kernel_output_is_within_twice_the_references_float32_error(family):
    from certvllm.attention import cpu_fused

    assert cpu_fused.cpu_kernel.available()
    gen = torch.Generator().manual_seed(0)
    cases = [make_case(family, t, 8, 2, 128, torch.float16, gen) for t in (20, 200, 650)]
    cache, tables, lens = paged_batch(cases)
    q = torch.stack([c.q for c in cases])
    cfg = load_config("default")
    fused = certified_attention(q, cache, tables, lens, cfg, backend="cpu")
    reference = partial(certified_attention, q, cache, tables, lens, cfg, backend="reference")
    ref, exact = run_with_exact(reference, q, cache, tables, lens, 1 / math.sqrt(128))
    same = (fused.report.rung == ref.report.rung) & (ref.report.rung <= 2)
    same &= (fused.report.k_star == ref.report.k_star) & (fused.report.v_promoted == ref.report.v_promoted)
    assert 2 * int(same.sum()) >= same.numel()  # near-tied blocks may reorder the selection on a few heads
    atol = 2.0**-23 * max(float(c.v.float().abs().max()) for c in cases)
    assert_within_lowp_error(fused.out[same], exact[same], ref.out[same], factor=2.0, atol=atol,
                             what=f"CPU kernel, {family}")  # fmt: skip


def test_a_process_with_mixed_matmul_precision_settings_still_serves(gen):
    """vLLM's batch-invariant mode (or a user) sets CUDA matmuls' ``fp32_precision`` apart from the other backends;
    torch's global precision getter then raises, and a certified call must not: it runs with full-precision
    float32 matmuls (``ieee``) on every backend and gives every setting back afterwards."""
    from certvllm.attention.op import _precision_knobs, exact_float32

    knobs = _precision_knobs()
    if not knobs:
        pytest.skip(f"torch {torch.__version__} has no per-backend float32 precision settings")
    saved = [k.fp32_precision for k in knobs]
    cuda = torch.backends.cuda.matmul
    try:
        cuda.fp32_precision = "tf32"
        torch.backends.cudnn.allow_tf32 = True
        cases = [make_case("random", 300, 4, 2, 64, torch.float16, gen)]
        cache, tables, lens = paged_batch(cases)
        with exact_float32():
            assert all(k.fp32_precision == "ieee" for k in knobs)
        assert cuda.fp32_precision == "tf32"
        case = cases[0]
        res = certified_attention(case.q.unsqueeze(0), cache, tables, lens, load_config("default"))
        err = torch.linalg.vector_norm(res.out[0].double() - exact_attention(case.q, case.k, case.v), dim=-1)
        cert = res.report.rung[0] <= 2
        assert bool((err[cert] <= res.report.bound[0][cert].double()).all())
        assert cuda.fp32_precision == "tf32"
    finally:
        for k, value in zip(knobs, saved, strict=True):
            k.fp32_precision = value
