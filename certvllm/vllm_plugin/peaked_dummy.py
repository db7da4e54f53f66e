"""``--load-format certvllm-peaked-dummy``: vLLM's dummy weights with attention that is peaked, not flat.

Why: serving benchmarks at 8B shapes run without real weights (they cannot be carried to the GPU machine),
and vLLM's dummy weights (uniform in ±1e-3, norms included) make every attention score about 0: attention is
flat, no selection of at most ``k_max`` blocks covers its mass past ~2K tokens, and every certified head-step
falls back to exact attention (rung 3). Such a benchmark measures the fallback, not the certified path.

This loader keeps vLLM's dummy initialisation and then, in every attention layer, sets the input norm's
weight to 1 and redraws the query and key rows of ``qkv_proj`` uniformly with standard deviation
``σ_w = √(score_std / hidden_size)``. The residual stream of a dummy model stays its (normalised) token
embeddings, so for two tokens the score ``q·k/√D`` is a sum of ``D`` products with variance
``(hidden_size·σ_w²)² / D`` each: its standard deviation is ``score_std``. With ``score_std`` = 6 (the
default) a query's softmax mass sits on a few tokens of its context, as in a retrieval head, and most heads
certify; smaller spreads approach flat attention (docs/performance.md has the rung shares measured per
spread). The outputs are as meaningless as the dummy model's, and as stable (the attention output enters
the residual through the dummy ``o_proj``, ±1e-3).

``--model-loader-extra-config '{"score_std": 4.0}'`` sets another spread. Llama-style attention modules only
(``qkv_proj`` with ``q_size`` and ``kv_size``); anything else is refused with the fix.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

LOAD_FORMAT = "certvllm-peaked-dummy"
DEFAULT_SCORE_STD = 6.0
SEED = 1234


@torch.no_grad()
def peak_attention(model: nn.Module, hidden_size: int, score_std: float = DEFAULT_SCORE_STD, seed: int = SEED) -> int:
    """Make ``model``'s attention peaked in place (module docstring); returns the attention layers changed.

    Args:
        model: a vLLM model after dummy initialisation.
        hidden_size: the residual stream's width.
        score_std: the standard deviation of ``q·k/√D`` between two tokens (> 0).
        seed: the redraws' seed (layer ``i`` uses ``seed + i``).
    """
    if not score_std > 0:
        raise ValueError(f"score_std={score_std}: must be > 0 (the spread of the attention scores; default 6)")
    bound = math.sqrt(3.0) * math.sqrt(score_std / hidden_size)  # uniform(−b, b) has std b/√3
    layers = 0
    for name, module in model.named_modules():
        if name.endswith("input_layernorm") and isinstance(getattr(module, "weight", None), torch.Tensor):
            module.weight.fill_(1.0)
        qkv, q_size, kv_size = (getattr(module, a, None) for a in ("qkv_proj", "q_size", "kv_size"))
        if qkv is None or q_size is None or kv_size is None:
            continue
        weight = qkv.weight  # [q_size + 2·kv_size, hidden_size]
        rows = q_size + kv_size
        gen = torch.Generator(device=weight.device).manual_seed(seed + layers)
        draw = torch.rand(rows, weight.shape[1], generator=gen, device=weight.device, dtype=torch.float32)
        weight[:rows].copy_(((2 * draw - 1) * bound).to(weight.dtype))
        layers += 1
    if layers == 0:
        raise ValueError(
            f"--load-format {LOAD_FORMAT} found no attention module with qkv_proj, q_size and kv_size (Llama-style); "
            "use --load-format dummy for this model"
        )
    return layers


def register_loader() -> None:
    """Register :data:`LOAD_FORMAT` with vLLM's model loaders (idempotent)."""
    from vllm.model_executor.model_loader import dummy_loader, register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class PeakedDummyModelLoader(dummy_loader.DummyModelLoader):
        """vLLM's dummy weights, then :func:`peak_attention`."""

        def __init__(self, load_config: Any) -> None:
            extra = dict(load_config.model_loader_extra_config or {})
            self.score_std = float(extra.pop("score_std", DEFAULT_SCORE_STD))
            if extra:
                raise ValueError(
                    f"--model-loader-extra-config {sorted(extra)}: {LOAD_FORMAT} takes only score_std (default "
                    f"{DEFAULT_SCORE_STD})"
                )
            BaseModelLoader.__init__(self, load_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            super().load_weights(model, model_config)
            peak_attention(model, model_config.get_hidden_size(), self.score_std)

    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if LOAD_FORMAT not in _LOAD_FORMAT_TO_MODEL_LOADER:
        register_model_loader(LOAD_FORMAT)(PeakedDummyModelLoader)
