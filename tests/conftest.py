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
