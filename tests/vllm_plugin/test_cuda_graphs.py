"""The plugin's CUDA-graph setting: modes with full graphs are lowered to PIECEWISE at startup, with the reason
logged; piecewise and none are left alone (checked on the config object the startup hook receives)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from vllm.config import CUDAGraphMode

from certvllm.vllm_plugin.routing import _piecewise_cuda_graphs


def _config(mode: CUDAGraphMode) -> SimpleNamespace:
    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY])
def test_full_graphs_become_piecewise_with_a_log_line(mode, caplog):
    cfg = _config(mode)
    with caplog.at_level(logging.INFO, logger="vllm.certvllm"):
        _piecewise_cuda_graphs(cfg)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert f"cudagraph_mode {mode.name} -> PIECEWISE" in caplog.text and "between the captured pieces" in caplog.text


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE])
def test_piecewise_and_none_are_kept(mode, caplog):
    cfg = _config(mode)
    with caplog.at_level(logging.INFO, logger="vllm.certvllm"):
        _piecewise_cuda_graphs(cfg)
    assert cfg.compilation_config.cudagraph_mode == mode and "cudagraph_mode" not in caplog.text
