"""The CUDA page-in extension (``csrc/cuda/pagein.cu``): a device view of the pinned shadow and a gather
kernel by block id. Optional: built on first use when ``CERTVLLM_CUDA_EXT=1`` (or by :func:`load`), and
:func:`module` returns None until then, in which case the Triton gather does the same work.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import torch

from certvllm.kernels.jit import JitExtension, csrc_file

_NAME = "certvllm_cuda_pagein_v1"
_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def source() -> Path:
    """Path of ``pagein.cu`` (inside the installed ``certvllm.csrc`` package)."""
    return csrc_file("cuda", "pagein.cu")


_EXT = JitExtension(_NAME, [source()], "page-ins use the Triton gather", extra_cuda_cflags=["-O3"])


def load(verbose: bool = False) -> ModuleType:
    """Build (once) and import the extension; raises RuntimeError with the reason when it cannot."""
    return _EXT.load()


def module() -> ModuleType | None:
    """The extension if it is loaded (or ``CERTVLLM_CUDA_EXT=1`` asks to build it now), else None."""
    if _EXT.loaded is not None:
        return _EXT.loaded
    if os.environ.get("CERTVLLM_CUDA_EXT") == "1" and not _EXT.failed and torch.cuda.is_available():
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
