"""The test helpers of ``certvllm.testing`` that other tests lean on: FlashAttention's tolerance rule
(``assert_within_lowp_error``) and the float64 evaluation of a certified call (``certified_exact``,
``run_with_exact``).

Tolerances: the rule's own checks use exact binary fractions (no rounding in the comparisons). The float64
evaluation must equal ``exact_attention`` to 1e-12 relative when every block is original (two float64
summation orders), and the reference path's float32 output must lie within 2^-14·max|v| of the float64
evaluation of its own selection (float32 rounding is ~2^-17·max|v| or less at these inputs; a wrong
operand — INT8 keys for original ones, INT4 values — moves the output by ~1e-3·max|v|).
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from certvllm.attention import certified_attention
from certvllm.config import load_config
from certvllm.testing import (
    FAMILIES,
    assert_within_lowp_error,
    certified_exact,
    exact_attention,
    make_case,
    paged_batch,
    run_with_exact,
)


def _refs() -> tuple[torch.Tensor, torch.Tensor]:
    ref64 = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 0.125]], dtype=torch.float64)
    lowp = ref64 + torch.tensor([[2.0**-20, -(2.0**-21), 0.0], [0.0, 2.0**-22, 0.0]], dtype=torch.float64)
    return ref64, lowp.float()


def test_rule_passes_within_the_factor_and_fails_beyond_it():
    ref64, lowp = _refs()
    out = ref64.clone()
    out[1, 2] += 2.0 * 2.0**-20  # exactly twice the worst same-precision error
    assert_within_lowp_error(out.float(), ref64, lowp, factor=2.0)
    out[1, 2] += 2.0**-24
    with pytest.raises(AssertionError) as err:
        assert_within_lowp_error(out.float(), ref64, lowp, factor=2.0, what="toy")
    msg = str(err.value)
    assert msg.startswith("toy: ") and "at (1, 2)" in msg and "2·9.53674e-07" in msg and "ratio 2.06" in msg


def test_rule_per_slice_and_the_atol_floor():
    ref64, lowp = _refs()
    out = ref64.clone()
    out[1, 0] += 2.0**-20  # row 1's own worst same-precision error is 2^-22: 4x over it
    assert_within_lowp_error(out, ref64, lowp)  # over the whole tensor the worst error is 2^-20
    with pytest.raises(AssertionError, match=r"at \(1, 0\).*1 of 2 slice"):
        assert_within_lowp_error(out, ref64, lowp, dim=-1)
    assert_within_lowp_error(out, ref64, lowp, dim=-1, atol=2.0**-20)
    exact = ref64.float()  # a low-precision reference that happens to be exact: only atol is left
    with pytest.raises(AssertionError):
        assert_within_lowp_error(ref64 + 2.0**-23, ref64, exact)
    assert_within_lowp_error(ref64 + 2.0**-23, ref64, exact, atol=2.0**-23)


def test_rule_rejects_a_non_finite_output_and_a_low_precision_ref64():
    ref64, lowp = _refs()
    out = ref64.clone()
    out[0, 1] = float("nan")
    with pytest.raises(AssertionError, match=r"non-finite out at \(0, 1\)"):
        assert_within_lowp_error(out, ref64, lowp)
    with pytest.raises(AssertionError, match="must be float64"):
        assert_within_lowp_error(lowp, lowp, lowp)


def test_all_original_blocks_evaluate_to_exact_attention(gen):
    cases = [make_case("random", t, 8, 2, 64, torch.float16, gen) for t in (5, 16, 77)]
    cache, tables, lens = paged_batch(cases)
    q = torch.stack([c.q for c in cases])
    every = torch.ones(3, 2, 4, tables.shape[1], dtype=torch.bool)
    got = certified_exact(q, cache, tables, lens, 1 / 8, every, every)
    for i, c in enumerate(cases):
        want = exact_attention(c.q, c.k, c.v, 1 / 8)
        assert ((got[i] - want).abs() <= 1e-12 * want.abs().max()).all()


@pytest.mark.parametrize("preset", ["default", "strict", "naive"])
@pytest.mark.parametrize("family", ["random", "retrieval_peaks", "huge_norms"])
def test_the_reference_path_is_float32_rounding_from_its_float64_evaluation(family, preset, gen):
    assert family in FAMILIES
    cases = [make_case(family, t, 8, 2, 64, torch.bfloat16, gen) for t in (9, 40, 300)]
    cache, tables, lens = paged_batch(cases)
    q = torch.stack([c.q for c in cases])
    cfg = load_config(preset)
    res, exact = run_with_exact(partial(certified_attention, q, cache, tables, lens, cfg, backend="reference"),
                                q, cache, tables, lens, 1 / math.sqrt(64))  # fmt: skip
    vmax = max(float(c.v.float().abs().max()) for c in cases)
    assert float((res.out.double() - exact).abs().max()) <= 2.0**-14 * vmax
    if preset != "naive":
        assert bool((res.report.k_star > 0).any())  # some blocks were promoted: the selection was read


def test_run_with_exact_refuses_a_selection_it_cannot_see(gen):
    from certvllm.attention import cpu_fused

    if not cpu_fused.cpu_kernel.available():
        pytest.skip("the CPU kernel is not built")
    cases = [make_case("random", 300, 8, 2, 64, torch.float16, gen)]
    cache, tables, lens = paged_batch(cases)
    q = torch.stack([c.q for c in cases])
    fused = partial(certified_attention, q, cache, tables, lens, load_config("default"), backend="cpu")
    with pytest.raises(RuntimeError, match="unseen"):
        run_with_exact(fused, q, cache, tables, lens, 1 / 8)
