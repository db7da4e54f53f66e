"""``benchmarks/profile_serving.py``: its ``--dtypes`` entries with certvllm settings of their own."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _profile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_serving", ROOT / "benchmarks" / "profile_serving.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_dtype_entry_adds_its_own_certvllm_settings() -> None:
    variant = _profile().variant
    base = {"host_memory_gb": 16}
    assert variant("auto", base) == ("auto", base)
    assert variant("certified", base) == ("certified", base)
    assert variant("certified+cuda_graphs=false", base) == ("certified", {"host_memory_gb": 16, "cuda_graphs": False})
    assert variant("certified+audit_rate=0,host_memory_gb=8", base) == (
        "certified", {"host_memory_gb": 8, "audit_rate": 0})  # fmt: skip
    assert base == {"host_memory_gb": 16}  # the shared settings are not changed
    with pytest.raises(ValueError, match="only certified"):
        variant("fp8+cuda_graphs=false", base)
