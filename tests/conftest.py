"""Shared fixtures: seeded generators and the hypothesis profile used in CI."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("CERTVLLM_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Model folders and sizing of the GPU engine tests (tests/vllm_plugin/test_gpu_vllm.py)."""
    group = parser.getgroup("certvllm GPU engines")
    group.addoption(
        "--dummy8b-dir", default=None,
        help="Llama-3.1-8B-shaped dummy model folder (default .device/llama8b-dummy, written when missing)",
    )  # fmt: skip
    group.addoption(
        "--smollm2-dir", default=None,
        help="prepared SmolLM2-135M folder with its weights (default models/smollm2-135m-instruct)",
    )  # fmt: skip
    group.addoption(
        "--gpu-host-memory-gb", type=float, default=None,
        help="host tier of the 131072-token engine in GiB (default: sized automatically)",
    )  # fmt: skip
