"""The certvllm configuration of a vLLM run: ``additional_config["certvllm"]``.

``certvllm serve --cert-config PRESET --cert-v-tol 0.02`` becomes
``--additional-config '{"certvllm": {"preset": "PRESET", "v_tol": 0.02}}'``; plain ``vllm serve`` users
can pass that JSON themselves. The config travels pickled to every vLLM process.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from certvllm.config import CertConfig, load_config

ADDITIONAL_CONFIG_KEY = "certvllm"


def plugin_options(vllm_config: Any) -> dict[str, Any]:
    extra = getattr(vllm_config, "additional_config", None) or {}
    options = extra.get(ADDITIONAL_CONFIG_KEY, {})
    if not isinstance(options, dict):
        raise ValueError(
            f'additional_config["{ADDITIONAL_CONFIG_KEY}"] must be a JSON object, got {type(options).__name__}'
        )
    return options


@lru_cache(maxsize=8)
def _load(options_json: str) -> CertConfig:
    options = json.loads(options_json)
    preset = options.pop("preset", None)
    return load_config(preset, **options)


def cert_config(vllm_config: Any) -> CertConfig:
    """The validated :class:`CertConfig` of this run (raises ``CertConfigError`` naming the fix)."""
    return _load(json.dumps(plugin_options(vllm_config), sort_keys=True))
