"""Which attention layers of a model config slide, and so which keep native pages under ``--kv-cache-dtype
certified`` (pure: no torch, no vLLM, so that ``certvllm serve``'s preflight can read a model folder with it).

A model config is a ``config.json`` dict or a transformers config object (vLLM's ``hf_text_config``). vLLM gives a
layer a sliding window when its ``layer_types`` entry is ``sliding_attention`` (Gemma 2/3, Cohere2, OLMo 3,
gpt-oss, Qwen2 with windows...), or every layer when the config has a ``sliding_window`` and no ``layer_types``
(Mistral-style: one window for the whole model). Such layers keep pages in the model's dtype
(``--kv-cache-dtype-skip-layers sliding_window``, ``hybrid.prepare``), and so do layers named by index in that list.
"""

from __future__ import annotations

import re
from typing import Any

SKIP_SLIDING = "sliding_window"
"""The ``--kv-cache-dtype-skip-layers`` entry that keeps every sliding-window layer in the model's dtype."""
SLIDING_TYPES = ("sliding_attention",)
"""``layer_types`` entries of layers vLLM builds with a sliding window."""
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` → 7), −1 if none."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else -1


def config_field(config: Any, name: str) -> Any:
    """``config[name]`` of a dict, ``config.name`` of an object; None where absent."""
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def sliding_layers(config: Any) -> set[int] | None:
    """Indices of the layers with a sliding window: ``layer_types`` entries ``sliding_attention``; every layer when
    the config has a window and no ``layer_types`` (``use_sliding_window: false`` turns it off); None where a window
    is set and ``num_hidden_layers`` is missing (the count is open)."""
    types = config_field(config, "layer_types")
    if isinstance(types, list | tuple) and types:
        return {i for i, kind in enumerate(types) if kind in SLIDING_TYPES}
    window = config_field(config, "sliding_window")
    if not window or config_field(config, "use_sliding_window") is False:
        return set()
    layers = config_field(config, "num_hidden_layers")
    return set(range(layers)) if isinstance(layers, int) else None


def skipped_indices(skip_layers: Any) -> set[int]:
    """The layer indices named in ``--kv-cache-dtype-skip-layers`` (its other entries name attention types)."""
    return {int(entry) for entry in skip_layers or () if str(entry).strip().isdigit()}


def native_layers(config: Any, num_layers: int, skip_layers: Any = ()) -> set[int] | None:
    """Indices in ``[0, num_layers)`` of the layers kept in the model's dtype: the sliding ones and those skipped by
    index; None where the config leaves the sliding ones open."""
    sliding = sliding_layers(config)
    if sliding is None:
        return None
    return {i for i in sliding | skipped_indices(skip_layers) if 0 <= i < num_layers}


def certified_layer_count(config: Any, num_layers: int, skip_layers: Any = ()) -> int | None:
    """Attention layers of ``num_layers`` that hold certified pages; None where the config leaves it open."""
    native = native_layers(config, num_layers, skip_layers)
    return None if native is None else num_layers - len(native)
