"""The tree is ruff clean: lint rules and formatting (the same commands as ``make lint``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")
FORMATTED = ("certvllm", "tests", "benchmarks", "scripts", "triton_kernels")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", *FORMATTED]], ids=["check", "format"])
def test_ruff_clean(args: list[str]) -> None:
    assert RUFF.exists(), f"ruff not found beside {sys.executable}: install the dev extra (make install)"
    proc = subprocess.run([str(RUFF), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ruff {' '.join(args)} failed; run `make lint` and fix:\n{proc.stdout[-4000:]}"
