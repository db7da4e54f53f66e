"""Patches that route ``--kv-cache-dtype certified`` to our backend and fix its block geometry.

* backend selection: ``certified`` → the CUSTOM slot, with clear errors for layers we cannot serve
  (MLA, sliding windows, sinks, encoder or cross attention, unsupported head sizes or dtypes);
* the CPU platform, which otherwise returns its own backend whatever was selected;
* platform config: block sizes that are multiples of 16, the sliding-window layers of a hybrid model kept in the
  model's dtype (``hybrid.prepare``), and the checks that must fail at startup (config, prefix-match units, KV
  connectors, host-tier budget);
* KV planning: the block count is capped by what the host tier can shadow, from vLLM's KV cache groups (which
  layers are certified: ``hybrid.CertifiedLayout``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from certvllm import env
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.vllm_plugin import hybrid, settings
from certvllm.vllm_plugin._compat import KV_CACHE_DTYPE
from certvllm.vllm_plugin.layer_kinds import layer_index

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
_MARK = "_certvllm_patched"


def _wrap(owner: Any, name: str, make: Any, static: bool = False) -> None:
    """Replace ``owner.name`` by ``make(original)`` once (idempotent across repeated registration)."""
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    patched = make(original)
    setattr(patched, _MARK, True)
    setattr(owner, name, staticmethod(patched) if static else patched)


def install() -> None:
    _route_selector()
    _route_platform()
    _cap_block_count()


def _check_layer(attn_selector_config: Any, backend: Any) -> None:
    """Refuse, with the fix, any layer the certified path cannot serve."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from certvllm.vllm_plugin.backend import CertifiedAttentionBackend

    cfg = attn_selector_config
    problems = []
    if backend is not None and backend != AttentionBackendEnum.CUSTOM:
        problems.append(f"--attention-backend {backend.name} was given; certified uses its own backend (drop the flag)")
    if cfg.use_mla:
        problems.append("MLA attention (latent KV) is not supported")
    if cfg.has_sliding_window:  # hybrid.prepare skips the layers it finds; this one was not found in the config
        problems.append(
            "sliding-window layers cannot be certified (keep them in the model's dtype with "
            f"--kv-cache-dtype-skip-layers {hybrid.SKIP_SLIDING})"
        )
    if cfg.has_sink:
        layer = _calling_layer()
        index = layer_index(layer) if layer else -1
        problems.append(
            f"attention sinks are not supported on certified layers{f' (layer {layer})' if layer else ''}: the "
            "certificate bounds a softmax over the cached tokens alone, and a sink's logit changes every weight; keep "
            f"every layer with sinks in the model's dtype with --kv-cache-dtype-skip-layers "
            f"{index if index >= 0 else 'N'} [N ...]"
        )
    if cfg.use_sparse:
        problems.append("sparse attention is not supported")
    if cfg.attn_type != AttentionType.DECODER:
        problems.append(f"attention type {cfg.attn_type!r} is not supported (decoder self-attention only)")
    if not CertifiedAttentionBackend.supports_head_size(cfg.head_size):
        sizes = CertifiedAttentionBackend.get_supported_head_sizes()
        problems.append(f"head size {cfg.head_size} is not supported (supported: {sizes})")
    if not CertifiedAttentionBackend.supports_dtype(cfg.dtype):
        problems.append(f"model dtype {cfg.dtype} is not supported (use --dtype bfloat16, float16 or float32)")
    if problems:
        raise ValueError(
            "--kv-cache-dtype certified cannot serve this model: "
            + "; ".join(problems)
            + ". Serve it with --kv-cache-dtype auto."
        )


def _calling_layer(max_depth: int = 12) -> str | None:
    """The name (``prefix``) of the vLLM attention layer being built on this call stack, for error messages."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        prefix = frame.f_locals.get("prefix") if frame.f_code.co_name == "__init__" else None
        if isinstance(prefix, str) and prefix:
            return prefix
        frame = frame.f_back
    return None


def _route_selector() -> None:
    import vllm.v1.attention.selector as selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def make(original: Any) -> Any:
        def routed(backend: Any, attn_selector_config: Any, num_heads: Any = None, **kwargs: Any) -> Any:
            if attn_selector_config.kv_cache_dtype == KV_CACHE_DTYPE:
                _check_layer(attn_selector_config, backend)
                backend = AttentionBackendEnum.CUSTOM
            return original(backend, attn_selector_config, num_heads, **kwargs)

        return routed

    _wrap(selector, "_cached_get_attn_backend", make)


def _route_platform() -> None:
    from vllm.platforms import current_platform

    from certvllm.vllm_plugin import BACKEND_PATH

    platform_cls = type(current_platform)

    def make_backend(original: Any) -> Any:
        def get_attn_backend_cls(selected_backend: Any, attn_selector_config: Any, num_heads: Any = None) -> Any:
            if attn_selector_config.kv_cache_dtype == KV_CACHE_DTYPE:
                return BACKEND_PATH
            return original(selected_backend, attn_selector_config, num_heads)

        return get_attn_backend_cls

    def make_config(original: Any) -> Any:
        def check_and_update_config(vllm_config: Any) -> None:
            if vllm_config.cache_config.cache_dtype == KV_CACHE_DTYPE:
                _prepare_certified(vllm_config)
            original(vllm_config)

        return check_and_update_config

    if current_platform.is_cpu():
        _wrap(platform_cls, "get_attn_backend_cls", make_backend, static=True)
    _wrap(platform_cls, "check_and_update_config", make_config, static=True)


def _prepare_certified(vllm_config: Any) -> None:
    """Startup checks and settings for a certified run (API-server / LLM process)."""
    cache = vllm_config.cache_config
    cfg = settings.cert_config(vllm_config)  # fails here, at startup, on a bad preset or value
    if cache.user_specified_block_size and cache.block_size % BLOCK_SIZE != 0:
        raise ValueError(
            f"--block-size {cache.block_size} cannot be used with --kv-cache-dtype certified: pages hold "
            f"{BLOCK_SIZE}-token blocks. Use a multiple of {BLOCK_SIZE} or drop --block-size."
        )
    if getattr(cache, "prefix_match_unit", None) not in (None, cache.block_size):
        raise ValueError(
            f"--prefix-match-unit {cache.prefix_match_unit} copies partial blocks on write, which would bypass "
            "the certified write path; drop it with --kv-cache-dtype certified."
        )
    transfer = vllm_config.kv_transfer_config
    connector = getattr(transfer, "kv_connector", None) if transfer is not None else None
    if connector and connector != settings.CONNECTOR_NAME:  # certvllm's own transfers no KV (certificates.py)
        raise ValueError(
            f"KV connector {transfer.kv_connector!r} writes device pages directly, bypassing the certified "
            "write path and the host shadow tier; it cannot be combined with --kv-cache-dtype certified."
        )
    from vllm.platforms import current_platform

    from certvllm.attention import dense_backend
    from certvllm.vllm_plugin import host_tier

    if current_platform.is_cuda():  # the CPU platform turns CUDA graphs off itself
        _piecewise_cuda_graphs(vllm_config)
    hybrid.prepare(vllm_config)  # sliding-window layers: native pages (before the host tier's minimum counts layers)
    host_tier.check_minimum(vllm_config, cfg)
    host_tier.check_page_fits(vllm_config.model_config.get_head_size(), cfg.value_group_size)
    dense_backend.check_request(cfg.dense_backend, current_platform.is_cuda())  # before any request
    logger.info("certvllm: certified KV cache, preset settings %s", cfg.model_dump(exclude_defaults=True))
    logger.info("certvllm: %s", env.environment())


def _piecewise_cuda_graphs(vllm_config: Any) -> None:
    """CUDA graphs with the certified backend: the model is captured piecewise, attention runs between the
    pieces. A full graph would freeze the per-step host work (the certified/exact split of the batch, the
    cut of the block table, the prefetch plan), so a mode with full graphs is lowered to PIECEWISE here, with
    the reason logged; vLLM's compile and its piecewise graphs stay as configured."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is None or not hasattr(mode, "has_full_cudagraphs") or not mode.has_full_cudagraphs():
        return
    from vllm.config import CUDAGraphMode

    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    logger.info(
        "certvllm: cudagraph_mode %s -> PIECEWISE: certified attention plans each step on the host (which "
        "tokens are certified or exact, the block table's cut, the page prefetch), so it runs between the "
        "captured pieces; the rest of the model keeps its CUDA graphs and torch.compile.",
        mode.name,
    )


def _cap_block_count() -> None:
    from certvllm.vllm_plugin import host_tier
    from certvllm.vllm_plugin.device_budget import fit_promotion_pool

    for module_name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            module = __import__(module_name, fromlist=["may_override_num_blocks"])
        except ImportError:
            continue
        if not hasattr(module, "may_override_num_blocks"):
            continue
        if hasattr(module, "get_kv_cache_config_from_groups"):
            _wrap(module, "get_kv_cache_config_from_groups", _plan_with_layout)

        def make(original: Any) -> Any:
            def may_override_num_blocks(vllm_config: Any, num_blocks: int) -> int:
                num_blocks = original(vllm_config, num_blocks)
                if vllm_config.cache_config.cache_dtype != KV_CACHE_DTYPE:
                    return num_blocks
                cfg = settings.cert_config(vllm_config)
                return host_tier.cap_blocks(vllm_config, fit_promotion_pool(vllm_config, cfg, num_blocks))

            return may_override_num_blocks

        _wrap(module, "may_override_num_blocks", make)
        return


def _plan_with_layout(original: Any) -> Any:
    """vLLM's ``get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory)`` with the groups'
    certified layout (``hybrid.CertifiedLayout``) readable by the block-count hook while it plans (a certified run)."""

    def get_kv_cache_config_from_groups(vllm_config: Any, kv_cache_groups: Any, *args: Any, **kwargs: Any) -> Any:
        if vllm_config.cache_config.cache_dtype != KV_CACHE_DTYPE:
            return original(vllm_config, kv_cache_groups, *args, **kwargs)
        layout = hybrid.CertifiedLayout.from_groups(vllm_config, list(kv_cache_groups))
        with hybrid.planning(layout):
            return original(vllm_config, kv_cache_groups, *args, **kwargs)

    return get_kv_cache_config_from_groups


def self_test() -> None:
    """The CUSTOM slot must resolve to our backend class."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from certvllm.vllm_plugin import BACKEND_PATH

    if AttentionBackendEnum.CUSTOM.get_path() != BACKEND_PATH:
        raise RuntimeError(f"certvllm self-test: CUSTOM resolves to {AttentionBackendEnum.CUSTOM.get_path()}")
    cls = resolve_obj_by_qualname(BACKEND_PATH)
    if cls.get_name() != "CUSTOM" or not cls.supports_kv_cache_dtype(KV_CACHE_DTYPE):
        raise RuntimeError("certvllm self-test: the backend does not accept the certified dtype")
