"""``--load-format certvllm-peaked-dummy`` (``certvllm.vllm_plugin.peaked_dummy``): the redrawn query and key
rows give scores ``q·k/√D`` of the asked spread between tokens whose hidden states have unit RMS (measured over
4,096 token pairs per head, within 10 %), the value rows and the other weights are left as they were, the input
norms become 1; a model without Llama-style attention and bad settings are refused with the fix; the plugin
registers the format with vLLM's loaders."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from certvllm.vllm_plugin.peaked_dummy import LOAD_FORMAT, peak_attention

HIDDEN, HQ, HKV, D = 256, 4, 2, 64


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((HIDDEN,), 1e-3))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, (HQ + 2 * HKV) * D, bias=False)
        self.q_size, self.kv_size = HQ * D, HKV * D


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = _Norm()
        self.self_attn = _Attention()
        self.post_attention_layernorm = _Norm()


def _model(layers: int = 2) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(_Layer() for _ in range(layers))
    return model


@pytest.mark.parametrize("score_std", [2.0, 6.0])
def test_scores_get_the_asked_spread_and_nothing_else_changes(score_std):
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert peak_attention(model, HIDDEN, score_std) == 2
    gen = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.layers):
        w = layer.self_attn.qkv_proj.weight.detach()
        assert torch.equal(w[(HQ + HKV) * D :], before[f"layers.{i}.self_attn.qkv_proj.weight"][(HQ + HKV) * D :])
        assert bool((layer.input_layernorm.weight == 1).all())
        assert torch.equal(layer.post_attention_layernorm.weight, before[f"layers.{i}.post_attention_layernorm.weight"])
        h = torch.randn(2, 4096, HIDDEN, generator=gen)
        h = h / h.pow(2).mean(-1, keepdim=True).sqrt()  # what the input norm hands the projection
        q = (h[0] @ w[: HQ * D].T).view(4096, HQ, D)
        k = (h[1] @ w[HQ * D : (HQ + HKV) * D].T).view(4096, HKV, D)
        scores = (q.view(4096, HKV, HQ // HKV, D) * k.unsqueeze(2)).sum(-1) / math.sqrt(D)
        spread = scores.std(dim=0)
        assert bool(((spread - score_std).abs() <= 0.1 * score_std).all()), spread


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="--load-format dummy"):
        peak_attention(nn.Sequential(nn.Linear(4, 4)), 4)
    with pytest.raises(ValueError, match="must be > 0"):
        peak_attention(_model(), HIDDEN, 0.0)


def test_the_plugin_registers_the_load_format():
    pytest.importorskip("vllm")
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from certvllm.vllm_plugin import register

    register()
    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"score_std": 4.0}))
    assert type(loader).__name__ == "PeakedDummyModelLoader" and loader.score_std == 4.0
    with pytest.raises(ValueError, match="takes only score_std"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"std": 4.0}))
