"""Tiny hybrid-attention model configs for the CPU tests (``test_hybrid.py``, ``test_hybrid_engine.py``): two real
architectures vLLM serves natively, shrunk to a few layers, run with ``load_format="dummy"`` and the bundled SmolLM2
tokenizer (``certvllm.models.write_dummy_config`` sets the vocabulary size and special token ids to its own).

* ``gemma3``: ``Gemma3ForCausalLM`` (text-only Gemma 3), 6 layers, 5 sliding-window layers (64 tokens) to 1
  full-attention layer as Gemma 3's pattern, q/k norms. Run in float32: vLLM refuses float16 for Gemma 3, and
  bfloat16 would take vLLM's AMX kernel on CPUs that have AMX, whose cache the shadow cannot hold (float32 and
  float16 run vLLM's same kernel on every x86 CPU, which forced rung 4's identity with ``auto`` needs).
* ``cohere2``: ``Cohere2ForCausalLM`` (Command R7B), 8 layers, 3 sliding-window layers to 1 full as Command R7B's
  ``sliding_window_pattern`` 4 (full layers 3 and 7), parallel attention/MLP blocks. Run in float16.

``HEAD_DIM`` 64, 4 query / 2 KV heads; a 128-token CPU block (vLLM's default) then holds native pages of
``2·D·itemsize`` bytes per token and head against certified ``2·D``: vLLM scales the certified layers' block to
``128·itemsize`` tokens so that every KV cache group's page has the same size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 2, 64, 64
_COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "sliding_window": WINDOW, "max_position_embeddings": 4096}  # fmt: skip
SLIDE, FULL = "sliding_attention", "full_attention"

MODELS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "config": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_COMMON,
                   "num_hidden_layers": 6, "layer_types": [SLIDE] * 5 + [FULL], "query_pre_attn_scalar": HEAD_DIM,
                   "torch_dtype": "float32"},  # fmt: skip
        "dtype": "float32",
        "itemsize": 4,
    },
    "cohere2": {
        "config": {"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", **_COMMON,
                   "num_hidden_layers": 8, "layer_types": ([SLIDE] * 3 + [FULL]) * 2, "torch_dtype": "float16"},
        "dtype": "float16",
        "itemsize": 2,
    },
}  # fmt: skip


def full_layers(name: str) -> list[int]:
    """The full-attention (certified) layer numbers of model ``name``."""
    return [i for i, kind in enumerate(MODELS[name]["config"]["layer_types"]) if kind == FULL]


def write_model(folder: Path, name: str, **overrides: Any) -> Path:
    """Write model ``name``'s folder (config.json with ``overrides``, the bundled tokenizer) at ``folder``."""
    from certvllm.models import DEFAULT_MODEL_DIR, prepare_default_model, write_dummy_config

    root = Path(__file__).resolve().parents[2]
    tokenizer = prepare_default_model(root / DEFAULT_MODEL_DIR)
    return write_dummy_config(folder, {**MODELS[name]["config"], **overrides}, tokenizer)
