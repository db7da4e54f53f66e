"""CertConfig validation, presets and error messages."""

from __future__ import annotations

import math

import pytest

from certvllm.config import CertConfigError, load_config, make_config, preset_names


def test_required_presets_exist_and_load():
    names = preset_names()
    for name in ("paper", "default", "strict", "fast", "naive", "dense"):
        assert name in names
        assert load_config(name).mode in ("certified", "naive", "dense")
    paper = load_config("paper")
    assert (paper.tau_cov, paper.k_min, paper.k_max, paper.v_tol, paper.rank_depth) == (0.995, 2, 128, 0.05, 1)
    assert math.isinf(paper.bound_tol)
    assert load_config().canary  # rung 4 is on by default


def test_overrides_apply_and_yaml_files_load(tmp_path):
    cfg = load_config("default", v_tol=0.01)
    assert cfg.v_tol == 0.01
    f = tmp_path / "mine.yaml"
    f.write_text("mode: certified\nk_max: 64\nbound_tol: 0.2\n")
    assert load_config(str(f)).k_max == 64


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("tau_cov", 1.5, "less than or equal to 1"),
        ("tau_cov", 0.0, "greater than 0"),
        ("k_max", -1, "greater than or equal to 0"),
        ("v_tol", -0.1, "greater than or equal to 0"),
        ("mode", "fp8", "certified"),
        ("rank_depth", 0, "greater than or equal to 1"),
        ("promotion_cache_fraction", 1.5, "less than or equal to 1"),
        ("promotion_cache_fraction", -0.1, "greater than or equal to 0"),
    ],
)
def test_invalid_values_name_field_range_and_value(field, value, needle):
    with pytest.raises(CertConfigError) as info:
        make_config(**{field: value})
    msg = str(info.value)
    assert field in msg and needle in msg and repr(value) in msg
    assert f"--cert-{field.replace('_', '-')}" in msg


def test_unknown_field_and_relations():
    with pytest.raises(CertConfigError, match="k_mx"):
        make_config(k_mx=3)
    with pytest.raises(CertConfigError, match="k_min=9 must be ≤ k_max=4"):
        make_config(k_min=9, k_max=4)


def test_unknown_preset_lists_the_choices(tmp_path):
    with pytest.raises(CertConfigError, match="unknown certvllm preset 'bogus'.*paper"):
        load_config("bogus")
    with pytest.raises(CertConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_a_renamed_preset_names_its_replacement():
    with pytest.raises(CertConfigError, match="preset 'budget' became the default preset.*--cert-config default"):
        load_config("budget")


def test_promotion_cache_fraction_default_and_off():
    assert load_config().promotion_cache_fraction == 0.0625  # 16 of 512 FP16 bytes per token at D = 128
    assert load_config("default", promotion_cache_fraction=0).promotion_cache_fraction == 0.0


def test_kernel_tuning_reaches_the_served_calls_and_bad_entries_name_the_fix():
    """``kernel_tuning``: comma-separated ``KernelTuning`` fields, checked when the config is built; the CUDA op runs
    with them (``gpu.options_for``, what ``certified_attention`` uses when no test options are given)."""
    from certvllm.triton_kernels.tuning import DEFAULT_TUNING, KernelTuning, parse_tuning

    from certvllm.attention import gpu

    cfg = load_config("default", kernel_tuning="select_first_window=64, promote_warps=4")
    assert parse_tuning(cfg.kernel_tuning) == KernelTuning(select_first_window=64, promote_warps=4)
    assert gpu.options_for(cfg.kernel_tuning).tuning == KernelTuning(select_first_window=64, promote_warps=4)
    assert gpu.options_for(load_config("default").kernel_tuning) is gpu.DEFAULT_OPTIONS
    assert parse_tuning("") is DEFAULT_TUNING
    for text, needle in [
        (
            "promote_stages=3",
            r"kernel_tuning.*'promote_stages' is not a KernelTuning field; the fields are .*select_warps",
        ),
        ("attend_warps=3", r"kernel_tuning.*KernelTuning.attend_warps=3 is out of range.*--cert-kernel-tuning"),
        ("promote_cuda=8", r"KernelTuning.promote_cuda=8 is out of range: it must be 0 \(the Triton kernel\), 2 or 4"),
        ("attend_warps=four", r"KernelTuning.attend_warps='four' is not an integer; write e.g. attend_warps=2"),
        ("attend_warps", r"'attend_warps': write FIELD=VALUE"),
    ]:
        with pytest.raises(CertConfigError, match=needle):
            load_config("default", kernel_tuning=text)


def test_a_removed_field_says_it_was_removed():
    with pytest.raises(
        CertConfigError, match="overlap_shadow_writes was removed on 2026-12-07.*delete it from the config"
    ):
        load_config("default", overlap_shadow_writes=True)
