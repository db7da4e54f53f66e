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
CONNECTOR_NAME = "CertvllmConnector"
"""The KV connector that carries per-request certificates back (``certificates.py``)."""
CONNECTOR_MODULE = "certvllm.vllm_plugin.certificates"
CERTIFICATE_MIDDLEWARE = "certvllm.vllm_plugin.certificate_api.CertificateMiddleware"
"""The API server side: the ``certvllm`` field of completion and chat responses (``certificate_api.py``)."""
CERTIFICATE_MODES = ("request", "always")
"""``request``: a response carries its certificate when its request asks for it; ``always``: every response."""


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


def certificate_mode(vllm_config: Any) -> str | None:
    """``request`` or ``always`` when this run returns per-request certificates (its KV connector is certvllm's,
    ``certificates.CertvllmConnector``), else None."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != CONNECTOR_NAME:
        return None
    mode = (getattr(kv, "kv_connector_extra_config", None) or {}).get("certificates", "request")
    if mode not in CERTIFICATE_MODES:
        raise ValueError(f'kv_connector_extra_config["certificates"] must be one of {CERTIFICATE_MODES}, got {mode!r}')
    return mode


def certificate_transfer_config(mode: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a run that returns certificates in ``mode`` (one of
    :data:`CERTIFICATE_MODES`): certvllm's connector by its module path, as a producer that hands nothing off."""
    if mode not in CERTIFICATE_MODES:
        raise ValueError(f"certificate mode {mode!r}: choose one of {', '.join(CERTIFICATE_MODES)}")
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"certificates": mode}}  # fmt: skip
