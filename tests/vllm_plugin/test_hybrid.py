"""Hybrid-attention models without an engine (``certvllm.vllm_plugin.hybrid``, ``layer_kinds``): which layers slide,
the startup step that keeps them native (and the refusals), the certified layout of vLLM's KV cache groups (formed
by vLLM 0.32's own grouping functions from its own spec classes) against vLLM's own capacity figures, the host tier
arithmetic it drives, shadows shared by certified layers over the same KV memory, ``certvllm serve``'s preflight
geometry and the attention-sink refusal. The engines: ``test_hybrid_engine.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hybrid_models import FULL, SLIDE, write_model

from certvllm.vllm_plugin import hybrid, layer_kinds
from certvllm.vllm_plugin.preflight import StartupRefusal
from certvllm.vllm_plugin.runtime import layer_index

H, D = 2, 64


# -- which layers slide (pure) --------------------------------------------------------------------------------


def test_sliding_layers_follow_layer_types_or_one_window_for_all():
    assert layer_kinds.sliding_layers({"layer_types": [SLIDE, SLIDE, FULL], "sliding_window": 8}) == {0, 1}
    assert layer_kinds.sliding_layers({"layer_types": [FULL, FULL]}) == set()
    # Mistral-style: a window and no layer_types slides every layer; a disabled or zero window none
    assert layer_kinds.sliding_layers({"sliding_window": 4096, "num_hidden_layers": 3}) == {0, 1, 2}
    assert layer_kinds.sliding_layers({"sliding_window": 4096, "use_sliding_window": False}) == set()
    assert layer_kinds.sliding_layers({"sliding_window": None, "num_hidden_layers": 3}) == set()
    assert layer_kinds.sliding_layers({"sliding_window": 4096}) is None  # the layer count is open
    obj = SimpleNamespace(layer_types=[FULL, SLIDE], sliding_window=16)  # a transformers config object
    assert layer_kinds.sliding_layers(obj) == {1}


def test_native_layers_add_the_skipped_indices():
    config = {"layer_types": [SLIDE, FULL, SLIDE, FULL], "sliding_window": 8}
    assert layer_kinds.skipped_indices(["sliding_window", "3", " 1", "x"]) == {1, 3}
    assert layer_kinds.native_layers(config, 4, ["sliding_window"]) == {0, 2}
    assert layer_kinds.native_layers(config, 4, ["sliding_window", "3", "9"]) == {0, 2, 3}  # 9: no such layer
    assert layer_kinds.certified_layer_count(config, 4, ["3"]) == 1
    assert layer_kinds.certified_layer_count({"sliding_window": 8}, 4) is None


# -- startup: hybrid.prepare ----------------------------------------------------------------------------------


def _config(layer_types: list[str] | None = None, skip: list[str] | None = None, window: int | None = 64,
            cache_window: int | None = None) -> Any:  # fmt: skip
    text = SimpleNamespace(num_hidden_layers=len(layer_types or [FULL] * 4), layer_types=layer_types,
                           sliding_window=window)  # fmt: skip
    cache = SimpleNamespace(kv_cache_dtype_skip_layers=list(skip or []), sliding_window=cache_window)
    return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=text, dtype=torch.bfloat16), cache_config=cache)


def test_prepare_keeps_sliding_layers_native_once():
    cfg = _config([SLIDE, SLIDE, FULL, SLIDE], skip=["3"])
    hybrid.prepare(cfg)
    assert cfg.cache_config.kv_cache_dtype_skip_layers == ["3", "sliding_window"]  # sorted, as vLLM keeps it
    hybrid.prepare(cfg)  # every process checks the config again: unchanged
    assert cfg.cache_config.kv_cache_dtype_skip_layers == ["3", "sliding_window"]
    plain = _config([FULL] * 4)
    hybrid.prepare(plain)
    assert plain.cache_config.kv_cache_dtype_skip_layers == []  # no window: nothing to keep native


@pytest.mark.parametrize(
    "cfg",
    [_config([SLIDE] * 4), _config(None, cache_window=64), _config([SLIDE, FULL], skip=["1"])],
    ids=["every layer slides", "one window for the model", "the full layer skipped by index"],
)
def test_prepare_refuses_a_model_with_nothing_to_certify(cfg):
    with pytest.raises(StartupRefusal) as info:
        hybrid.prepare(cfg)
    text = str(info.value)
    assert "none can hold certified pages" in text
    assert "--kv-cache-dtype auto" in text and "--disable-sliding-window" in text


def test_engine_config_of_a_hybrid_model_skips_its_sliding_layers(tmp_path):
    """The real startup: vLLM's engine config of a tiny Gemma 3 (its config check runs ``hybrid.prepare``)."""
    from test_vllm_plugin import _engine_config

    cfg = _engine_config(str(write_model(tmp_path / "gemma3", "gemma3")), max_model_len=512, dtype="float32")
    assert cfg.cache_config.kv_cache_dtype_skip_layers == ["sliding_window"]


def test_engine_config_of_an_all_sliding_model_is_refused(tmp_path):
    from test_vllm_plugin import _startup_refusal

    folder = write_model(tmp_path / "gemma3-sliding", "gemma3", layer_types=[SLIDE] * 6)
    out = _startup_refusal(model=str(folder), max_model_len=512, dtype="float32")
    assert "every one of the 6 attention layers of this model has a sliding window (64 tokens)" in out
    assert "Serve it with --kv-cache-dtype auto, list fewer layers in --kv-cache-dtype-skip-layers, or use " in out
    assert "--disable-sliding-window (vLLM then caps --max-model-len at the window)" in out


# -- the engine core: vLLM's KV cache groups ------------------------------------------------------------------


def _vllm_config(max_model_len: int = 512, **cert: Any) -> Any:
    """What the layout and the host tier read of a ``VllmConfig``."""
    from vllm.v1.kv_cache_interface import KVCacheLayout

    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len, dtype=torch.float16),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC, block_size=128),
        max_in_flight_tokens=256, additional_config={"certvllm": cert},
    )  # fmt: skip


def _specs(layer_types: list[str], block: int = 128, itemsize: int = 2) -> dict[str, Any]:
    """Each layer's spec as vLLM 0.32 builds it for a certified run: uint8 certified pages of ``2·D`` bytes per
    token and head (``customize_spec``) on the full layers, native pages on the sliding ones."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from certvllm.vllm_plugin.backend import CertifiedAttentionBackend

    dtype = {2: torch.float16, 4: torch.float32}[itemsize]
    specs: dict[str, Any] = {}
    for i, kind in enumerate(layer_types):
        name = f"model.layers.{i}.self_attn.attn"
        if kind == FULL:
            spec = FullAttentionSpec(block_size=block, num_kv_heads=H, head_size=D, dtype=torch.uint8)
            specs[name] = CertifiedAttentionBackend.customize_spec(spec)
        else:
            specs[name] = SlidingWindowSpec(block_size=block, num_kv_heads=H, head_size=D, dtype=dtype,
                                            sliding_window=64)  # fmt: skip
    return specs


def _vllm_groups(specs: dict[str, Any]) -> list[Any]:
    """The KV cache groups vLLM 0.32 forms from ``specs`` (its hybrid manager's path: pages unified, then grouped)."""
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size, unify_kv_cache_spec_page_size

    return _get_kv_cache_groups_uniform_page_size(unify_kv_cache_spec_page_size(dict(specs)))


@pytest.mark.parametrize(
    ("layer_types", "itemsize", "slots"),
    [
        ([SLIDE] * 5 + [FULL], 4, 1),  # Gemma 3's 5:1 (the tiny gemma3): one group of the full layer
        (([SLIDE] * 3 + [FULL]) * 2, 2, 2),  # Command R7B's 3:1 (the tiny cohere2): both full layers in one group
        (([SLIDE] * 5 + [FULL]) * 4, 2, 4),  # 5:1 over 24 layers: one group of 4 full layers
        ([SLIDE, FULL] * 3, 2, 3),  # 1:1 (gpt-oss-like): groups of 3
    ],
)
def test_layout_of_vllms_groups_matches_vllms_own_figures(layer_types, itemsize, slots):
    from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups, _pool_bytes_per_block

    cfg = _vllm_config()
    groups = _vllm_groups(_specs(layer_types, itemsize=itemsize))
    layout = hybrid.CertifiedLayout.from_groups(cfg, groups)
    full = [i for i, kind in enumerate(layer_types) if kind == FULL]
    assert sorted(layer_index(n) for n in layout.certified) == full
    assert len(layout.native) == len(layer_types) - len(full) and layout.hybrid
    # the certified block grows until its page is the native page: 2·D·itemsize bytes per token against 2·D
    assert layout.block_size == 128 * itemsize
    assert (layout.kv_heads, layout.head_size, layout.groups) == (H, D, len(groups))
    # one shadow per certified layer of the fullest group: the others lie over the same memory
    assert (
        layout.shadow_slots
        == slots
        == max(sum(hybrid.is_certified_spec(g.kv_cache_spec) for _ in g.layer_names) for g in groups)
    )
    assert layout.pool_bytes_per_block == _pool_bytes_per_block(cfg, groups)
    # vLLM's startup check: one max_model_len request in every group together
    assert layout.request_blocks * layout.pool_bytes_per_block == _max_memory_usage_bytes_from_groups(cfg, groups)
    assert layout.shadow_bytes_per_block(itemsize) == slots * layout.block_size * H * 2 * D * itemsize


def test_layout_of_a_single_uniform_group_counts_every_certified_layer():
    """``--disable-hybrid-kv-cache-manager``: every layer in one group (``UniformTypeKVCacheSpecs``), each over its
    own memory, so one shadow per certified layer; a model without native layers is not hybrid."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    specs = _specs([FULL, SLIDE, FULL])
    specs["model.layers.1.self_attn.attn"] = FullAttentionSpec(block_size=128, num_kv_heads=H, head_size=D,
                                                               dtype=torch.float16, sliding_window=64)  # fmt: skip
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    layout = hybrid.CertifiedLayout.from_groups(_vllm_config(), [KVCacheGroupSpec(list(specs), uniform)])
    assert (layout.shadow_slots, layout.block_size, len(layout.native)) == (2, 128, 1)
    assert layout.request_blocks == math.ceil(512 / 128)
    plain = _vllm_groups(_specs([FULL] * 4))
    dense = hybrid.CertifiedLayout.from_groups(_vllm_config(), plain)
    assert not dense.hybrid and dense.shadow_slots == 4 and dense.request_blocks == 4


def test_layout_refusals_and_the_attention_free_case():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    assert hybrid.CertifiedLayout.from_groups(_vllm_config(), []) is None
    native = FullAttentionSpec(block_size=128, num_kv_heads=H, head_size=D, dtype=torch.float16)
    with pytest.raises(StartupRefusal, match="left no attention layer with certified pages"):
        hybrid.CertifiedLayout.from_groups(_vllm_config(), [KVCacheGroupSpec(["model.layers.0.a"], native)])
    groups = _vllm_groups(_specs([FULL, FULL]))
    other = _specs([FULL], block=256)["model.layers.0.self_attn.attn"]
    groups.append(KVCacheGroupSpec(["model.layers.9.a"], other))
    with pytest.raises(StartupRefusal, match="do not share one page geometry"):
        hybrid.CertifiedLayout.from_groups(_vllm_config(), groups)


def test_describe_lists_layer_numbers_in_order():
    layout = hybrid.CertifiedLayout.from_groups(_vllm_config(), _vllm_groups(_specs(([SLIDE] * 3 + [FULL]) * 2)))
    assert layout.describe() == ("certified layers 3, 7; native layers 0, 1, 2, 4, 5, 6; 4 KV cache groups; "
                                 "256-token certified blocks; 2 shadow pages per pool block")  # fmt: skip
    assert hybrid.layer_numbers(["model.layers.11.x", "lm_head", "model.layers.5.x"]) == "5, 11, lm_head"


# -- the host tier's arithmetic ---------------------------------------------------------------------------------


def test_host_tier_counts_the_certified_layers_of_the_planned_groups(caplog):
    from certvllm.vllm_plugin import host_tier

    layer_types = ([SLIDE] * 3 + [FULL]) * 2
    per_block = 2 * 256 * H * 2 * D * 2  # 2 shadow pages of 256-token blocks, float16
    cfg = _vllm_config(host_memory_gb=100 * per_block / 2**30)  # a budget of 100 blocks
    cfg.model_config.hf_text_config = SimpleNamespace(num_hidden_layers=8, layer_types=layer_types, sliding_window=64)
    cfg.model_config.get_num_layers = lambda parallel: 8
    cfg.model_config.get_num_kv_heads = lambda parallel: H
    cfg.model_config.get_head_size = lambda: D
    cfg.cache_config.kv_cache_dtype_skip_layers = ["sliding_window"]
    layout = hybrid.CertifiedLayout.from_groups(cfg, _vllm_groups(_specs(layer_types)))
    with hybrid.planning(layout):
        assert host_tier.shadow_bytes_per_block(cfg) == per_block
        assert host_tier.min_blocks(cfg) == layout.request_blocks + 1
        with caplog.at_level("INFO", logger="vllm.certvllm"):
            assert host_tier.cap_blocks(cfg, 5000) == 100  # capped at the budget's blocks
            assert host_tier.cap_blocks(cfg, 60) == 60
    assert host_tier.device_blocks_before_cap(100) == 5000  # the workers' pools may use the planned blocks' room
    assert host_tier.device_blocks_before_cap(60) is None  # not capped
    assert "2 certified layers only" in caplog.text and "hybrid KV cache: certified layers 3, 7;" in caplog.text
    # before the groups exist (the startup check): every certified layer at --block-size, no more than the layout
    assert host_tier.certified_layers(cfg) == 2
    before = host_tier.shadow_bytes_per_block(cfg) * host_tier.min_blocks(cfg)
    assert before == 2 * 128 * H * 2 * D * 2 * math.ceil(512 / 128)
    assert before <= per_block * (layout.request_blocks + 1)
    # not the figure of a model whose 8 layers all hold certified pages
    assert per_block != 8 * 128 * H * 2 * D * 2


def test_promotion_pool_fits_a_hybrid_pool_block():
    """CUDA's promotion pools (certified layers only) fit in the planned memory when a pool block also holds the
    native layers' pages (``page_bytes``)."""
    from test_vllm_plugin import _check_block_budget

    from certvllm.config import CertConfig

    for fraction in (0.0625, 0.25):
        cfg = CertConfig(promotion_cache_fraction=fraction, cuda_graphs=False)
        # 8 certified layers of 32-token blocks in a pool block of 4 groups × 8 layers' pages
        _check_block_budget(cfg, fraction, 8, 8, 32, 128, 2, False, page_bytes=4 * 8 * 8 * 32 * 256)


# -- the worker: shared shadows, layer kinds ----------------------------------------------------------------------


def _runtime() -> Any:
    """A worker runtime of its own, its metrics in a registry of their own (read back by the tests)."""
    from prometheus_client import CollectorRegistry

    from certvllm.config import CertConfig
    from certvllm.metrics import CertMetrics
    from certvllm.vllm_plugin.runtime import WorkerRuntime

    rt = WorkerRuntime(CertConfig(), "m", "0")
    rt.metrics = CertMetrics("m", "0", registry=CollectorRegistry())
    return rt


def test_certified_layers_over_the_same_memory_share_one_shadow():
    from certvllm.vllm_plugin.host_tier import vllm_page_layout

    rt = _runtime()
    c = vllm_page_layout(D, 16).bytes_per_token
    backing = torch.zeros(2, 6, H, 32, c, dtype=torch.uint8)  # two layers' memory, as vLLM lays a group out
    a = rt.bind("model.layers.3.self_attn.attn", backing[0], D, torch.float16)  # group 0, layer 0
    b = rt.bind("model.layers.7.self_attn.attn", backing[1], D, torch.float16)  # group 0, layer 1
    c_ = rt.bind("model.layers.11.self_attn.attn", backing[0], D, torch.float16)  # group 1, layer 0: a's memory
    assert c_.cache.shadow.data_ptr() == a.cache.shadow.data_ptr() != b.cache.shadow.data_ptr()
    shadow = a.cache.shadow
    assert rt.host_bytes == 2 * shadow.numel() * shadow.element_size()  # the shared one counted once
    other = rt.bind("model.layers.15.self_attn.attn", backing[0].clone(), D, torch.float16)
    assert other.cache.shadow.data_ptr() not in (a.cache.shadow.data_ptr(), b.cache.shadow.data_ptr())


def test_exact_tokens_are_counted_on_the_first_certified_layer():
    rt = _runtime()
    assert rt.counting_layer == 0
    rt.note_layers({f"model.layers.{i}.self_attn.attn": i in (5, 11) for i in range(12)})
    assert rt.counting_layer == 5
    registry = rt.metrics._registry
    values = {i: registry.get_sample_value("vllm:cert_layer_certified",
                                           {"model_name": "m", "engine": "0", "layer": str(i), "rank": "0"})
              for i in range(12)}  # fmt: skip
    assert values == {i: float(i in (5, 11)) for i in range(12)}
    rt.note_layers({f"model.layers.{i}.self_attn.attn": i in (17, 23) for i in range(12, 24)})  # a later stage
    assert rt.counting_layer == -1


# -- certvllm serve's preflight -------------------------------------------------------------------------------


def test_preflight_geometry_counts_certified_layers_only():
    from certvllm.vllm_plugin.preflight import shadow_geometry

    config = {
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sliding_window": 64,
        "layer_types": ([SLIDE] * 3 + [FULL]) * 2,
        "max_position_embeddings": 4096,
    }
    args = ["model", "--max-model-len", "1000"]
    g = shadow_geometry(args, config)
    assert (g.layers, g.hybrid, g.blocks) == (2, True, math.ceil(1000 / 16))  # no +1: a lower bound
    assert shadow_geometry([*args, "--kv-cache-dtype-skip-layers", "sliding_window", "3"], config).layers == 1
    assert shadow_geometry([*args, "--kv-cache-dtype-skip-layers=3,7"], config) is None  # nothing certified
    whole = shadow_geometry([*args, "--disable-sliding-window"], config)
    assert (whole.layers, whole.hybrid, whole.max_model_len) == (8, False, 64)  # capped at the window
    plain = shadow_geometry(args, {**config, "layer_types": [FULL] * 8})
    assert (plain.layers, plain.hybrid, plain.blocks) == (8, False, math.ceil(1000 / 16) + 1)  # unchanged


# -- attention sinks -------------------------------------------------------------------------------------------


def test_attention_sinks_on_a_certified_layer_are_refused_naming_the_layer():
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from certvllm.vllm_plugin import register, routing

    register()
    cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="certified", block_size=128,
                                  has_sink=True)  # fmt: skip

    class Layer:  # stands for vLLM's Attention, which asks the selector from its __init__
        def __init__(self, prefix: str) -> None:
            routing._check_layer(cfg, None)

    with pytest.raises(ValueError) as info:
        Layer("model.layers.5.self_attn.attn")
    text = str(info.value)
    assert "attention sinks are not supported on certified layers (layer model.layers.5.self_attn.attn)" in text
    assert "--kv-cache-dtype-skip-layers 5 [N ...]" in text and "--kv-cache-dtype auto" in text


# -- the GPU test's model, built here ----------------------------------------------------------------------------


def test_the_gpu_hybrid_model_folder_is_built_here(tmp_path):
    """``test_gpu_hybrid.py``'s OLMo-3-7B-shaped folder (``python -m certvllm.models dummy DIR --shape olmo-3-7b``):
    transformers reads it as OLMo 3 with 8 full-attention layers of 32, and vLLM's startup check on this machine
    keeps the other 24 native."""
    from test_vllm_plugin import _engine_config
    from transformers import AutoConfig

    from certvllm.models import DEFAULT_MODEL_DIR, main, prepare_default_model
    from certvllm.vllm_plugin.preflight import shadow_geometry

    tokenizer = prepare_default_model(Path(__file__).resolve().parents[2] / DEFAULT_MODEL_DIR)
    assert main(["dummy", str(tmp_path / "olmo3"), "--shape", "olmo-3-7b", "--tokenizer-dir", str(tokenizer)]) == 0
    config = AutoConfig.from_pretrained(tmp_path / "olmo3")
    assert type(config).__name__ == "Olmo3Config" and config.sliding_window == 4096
    assert [i for i, t in enumerate(config.layer_types) if t == FULL] == list(range(3, 32, 4))
    raw = json.loads((tmp_path / "olmo3" / "config.json").read_text())
    assert shadow_geometry([str(tmp_path / "olmo3"), "--max-model-len", "16384"], raw).layers == 8
    cfg = _engine_config(str(tmp_path / "olmo3"), max_model_len=16384)
    assert cfg.cache_config.kv_cache_dtype_skip_layers == ["sliding_window"]
