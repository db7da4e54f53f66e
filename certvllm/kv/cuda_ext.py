"""The CUDA page-in extension (``csrc/cuda/pagein.cu``): a device view of the pinned shadow and a gather
kernel by block id. Optional: built on first use when ``CERTVLLM_CUDA_EXT=1`` (or by :func:`load`), and
:func:`module` returns None until then, in which case the Triton gather does the same work.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("certvllm")
_NAME = "certvllm_cuda_pagein_v1"
_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None
_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def source() -> Path:
    """Path of ``pagein.cu`` (inside the installed ``certvllm.csrc`` package, else the repository)."""
    try:
        from importlib import resources

        path = Path(str(resources.files("certvllm.csrc") / "cuda" / "pagein.cu"))
        if path.is_file():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "pagein.cu"


def load(verbose: bool = False) -> ModuleType:
    """Build (once) and import the extension; raises RuntimeError with the reason when it cannot."""
    global _module, _failed
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _failed is not None:
            raise RuntimeError(_failed)
        try:
            from torch.utils.cpp_extension import load as load_extension

            root = os.environ.get("CERTVLLM_EXT_DIR") or Path.home() / ".cache" / "certvllm" / "extensions"
            build = Path(root) / _NAME
            build.mkdir(parents=True, exist_ok=True)
            _module = load_extension(name=_NAME, sources=[str(source())], extra_cuda_cflags=["-O3"],
                                     build_directory=str(build), verbose=verbose)  # fmt: skip
        except Exception as err:  # no nvcc, no CUDA: the Triton gather takes over
            _failed = f"certvllm CUDA page-in extension unavailable ({type(err).__name__}: {err}); using Triton"
            logger.warning("%s", _failed)
            raise RuntimeError(_failed) from err
    return _module


def module() -> ModuleType | None:
    """The extension if it is loaded (or ``CERTVLLM_CUDA_EXT=1`` asks to build it now), else None."""
    if _module is not None:
        return _module
    if os.environ.get("CERTVLLM_CUDA_EXT") == "1" and _failed is None and torch.cuda.is_available():
        try:
            return load()
        except RuntimeError:
            return None
    return None


def device_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned host tensor ``host`` (cached; the cache keeps ``host`` alive)."""
    if host.is_cuda:
        return host
    key = host.data_ptr()
    hit = _views.get(key)
    if hit is None or hit[0].shape != host.shape or hit[0].dtype != host.dtype:
        ext = module()
        if ext is None:
            raise RuntimeError("the CUDA page-in extension is not loaded; call certvllm.kv.cuda_ext.load()")
        hit = (host, ext.device_view(host))
        _views[key] = hit
    return hit[1]
