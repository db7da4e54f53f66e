"""Page layout, INT8 key and INT4 value formats: sizes, exact round-trips, error guarantees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from certvllm.formats.keys import P2_RELATIVE_SLACK, key_sigma, quantize_keys
from certvllm.formats.layout import PageLayout, key_scale_lut
from certvllm.formats.pages import PageReader, encode_pages
from certvllm.formats.values import pack_int4, quantize_values, unpack_int4


def test_page_budget_at_d128_is_at_most_256_bytes_per_token():
    layout = PageLayout(128)
    assert layout.used_bytes == 3984
    assert layout.bytes_per_token == 256
    assert layout.bytes_per_token * 2 == layout.fp16_bytes_per_token()


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
def test_layout_fields_do_not_overlap_and_fit(d):
    lay = PageLayout(d)
    starts = [lay.k_codes, lay.v_codes, lay.v_scale, lay.v_zero, lay.k_offset, lay.k_scale_code, lay.header]
    assert starts == sorted(starts)
    assert lay.used_bytes <= lay.page_bytes
    assert all(s % 2 == 0 for s in starts) and lay.header % 16 == 0
    assert lay.bytes_per_token <= lay.fp16_bytes_per_token() // 2


@pytest.mark.parametrize("d", [0, 7, 24, 264])
def test_unsupported_head_dims_name_the_fix(d):
    with pytest.raises(ValueError, match="head_dim"):
        PageLayout(d)


def test_int4_pack_round_trip_is_exact(gen):
    codes = torch.randint(0, 16, (5, 16, 64), generator=gen, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 16, 32)
    assert torch.equal(unpack_int4(packed), codes)
    assert int(packed[0, 0, 0]) == int(codes[0, 0, 0]) | (int(codes[0, 0, 1]) << 4)


def test_scale_lut_is_monotone_and_starts_at_zero():
    lut = key_scale_lut()
    assert lut[0] == 0 and lut[255] == 1.0
    assert (lut[2:] > lut[1:-1]).all()


def _float64_dequant_keys(qk):
    sigma = key_sigma(qk.scale_code, qk.exponent, key_scale_lut()).double()
    return qk.offset.double().unsqueeze(-2) + qk.codes.double() * sigma.unsqueeze(-2), sigma


@given(
    scale=st.floats(1e-4, 1e4),
    offset=st.floats(-1e3, 1e3),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_key_error_is_within_half_a_step(scale, offset, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(3, 2, 16, 64, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
    qk = quantize_keys(k)
    if bool(qk.violated.any()):  # only when the originals leave the float16 range
        assert (k.double().abs() > 65504).any()
        return
    khat, sigma = _float64_dequant_keys(qk)
    err = (k.double() - khat).abs()
    assert (err <= sigma.unsqueeze(-2) * (0.5 + P2_RELATIVE_SLACK)).all()


@pytest.mark.parametrize("key_levels,value_levels", [(15, 3), (3, 1)])
def test_stress_formats_use_fewer_codes_and_keep_p2_and_eta(key_levels, value_levels, gen):
    """The stress study's formats (``PageLayout.key_levels``/``value_levels``): codes stay within the levels, P2
    (|k − k̂| ≤ σ/2) and η ≥ ‖V̂ − V‖ still hold, and the error is larger than the standard format's."""
    k = (torch.randn(4, 2, 16, 64, generator=gen) * torch.rand(4, 2, 1, 64, generator=gen) * 3).half()
    v = (torch.randn(4, 2, 16, 64, generator=gen) * 2).half()
    qk = quantize_keys(k, key_levels)
    assert int(qk.codes.max()) <= key_levels and not bool(qk.violated.any())
    khat, sigma = _float64_dequant_keys(qk)
    assert ((k.double() - khat).abs() <= sigma.unsqueeze(-2) * (0.5 + P2_RELATIVE_SLACK)).all()
    assert int(unpack_int4(quantize_values(v, 16, value_levels).codes).max()) <= value_levels
    stress, standard = PageLayout(64, key_levels=key_levels, value_levels=value_levels), PageLayout(64)
    errs = []
    for lay in (stress, standard):
        dec = PageReader(lay).decode(encode_pages(k, v, lay))
        err = torch.linalg.vector_norm(dec.values.double() - v.double(), dim=-1).amax(dim=-1)
        assert (err <= dec.eta.double()).all()
        errs.append((float(err.max()), float((dec.keys.double() - k.double()).abs().max())))
    assert errs[0][0] > 2 * errs[1][0] and errs[0][1] > 2 * errs[1][1]


def test_code_levels_outside_the_fields_name_the_range():
    with pytest.raises(ValueError, match=r"largest key code must be in \[1, 255\]"):
        PageLayout(64, key_levels=256)
    with pytest.raises(ValueError, match=r"largest value code in \[1, 15\]"):
        PageLayout(64, value_levels=0)


def test_constant_channels_and_blocks_reconstruct_exactly():
    k = torch.randn(2, 1, 16, 64).half()
    k[0, 0, :, 3] = 1.25
    k[1] = 0.5  # a fully constant block
    qk = quantize_keys(k)
    khat, sigma = _float64_dequant_keys(qk)
    assert torch.isfinite(khat).all()
    assert sigma[0, 0, 3] == 0 and (sigma[1] == 0).all()
    assert torch.equal(khat[0, 0, :, 3], k.double()[0, 0, :, 3])
    assert torch.equal(khat[1], k.double()[1])


@given(scale=st.floats(1e-4, 1e3), seed=st.integers(0, 2**31 - 1))
def test_value_annotations_bound_the_real_errors(scale, seed):
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(4, 3, 16, 64, generator=g, dtype=torch.float64) * scale).half()
    v[0, 0, 5, :16] = 0.75  # an all-equal group
    lay = PageLayout(64)
    dec = PageReader(lay).decode(encode_pages(v, v, lay))
    err = torch.linalg.vector_norm(dec.values.double() - v.double(), dim=-1).amax(dim=-1)
    norms = torch.linalg.vector_norm(v.double(), dim=-1).amax(dim=-1)
    assert (err <= dec.eta.double()).all()
    assert (norms <= dec.nu.double()).all()
    assert (dec.nu.double() <= norms * (1 + 2.0**-12)).all()  # annotations are tight up to NORM_SLACK
    assert torch.equal(dec.values[0, 0, 5, :16], torch.full((16,), 0.75))
    assert torch.isfinite(dec.values).all()


def test_value_quantizer_groups():
    v = torch.randn(1, 1, 16, 64).bfloat16()
    for g in (8, 16, 32):
        qv = quantize_values(v, g)
        assert qv.scale.shape == (1, 1, 16, 64 // g)


def test_out_of_range_and_non_finite_blocks_are_flagged():
    lay = PageLayout(64)
    k = torch.randn(3, 1, 16, 64).bfloat16()
    v = torch.randn(3, 1, 16, 64).bfloat16()
    k[0, 0, 2, 7] = -1e6  # beyond float16: no float16 offset can represent it
    v[1, 0, 0, 0] = float("nan")
    dec = PageReader(lay).decode(encode_pages(k, v, lay))
    assert dec.violated[:, 0].tolist() == [True, True, False]
    assert dec.valid.all()


def test_page_round_trip_bf16_and_fp16(gen):
    lay = PageLayout(128)
    for dtype in (torch.float16, torch.bfloat16):
        k = torch.randn(2, 4, 16, 128, generator=gen).to(dtype)
        dec = PageReader(lay).decode(encode_pages(k, k, lay))
        assert (dec.keys - k.float()).abs().max() <= dec.sigma.max()
        assert not dec.violated.any()
