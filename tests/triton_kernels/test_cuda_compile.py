"""The CUDA attend and promotion kernels (``csrc/cuda/attend_kernel.cuh``, ``promote_kernel.cuh``) compile for sm_90a
with nvcc, offline: the three per-head-dim units instantiate every configuration the launchers dispatch to, and those
of at most 8 query heads per KV head keep their accumulators in registers (no spills). Runs where nvcc is installed
(the H200 and this project's development machine); where it is not, the test is skipped with that reason (the
kernels are then built, and tested, on the GPU: ``test_gpu.py``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_SOURCES = Path(__file__).resolve().parents[2] / "csrc" / "cuda"
NVCC = shutil.which("nvcc")


def _ptxas_report(tmp_path: Path) -> dict[tuple[str, int, int, int], tuple[int, int]]:
    """``{(kernel, D, GP, warps): (registers, spill store bytes)}`` of every compiled kernel (``attend``,
    ``promote``)."""
    procs = [
        subprocess.Popen(
            [
                NVCC,
                "-O3",
                "-std=c++17",
                "-arch=sm_90a",
                "-cubin",
                "-Xptxas",
                "-v",
                "-o",
                str(tmp_path / f"d{d}.cubin"),
                str(CUDA_SOURCES / f"attend_d{d}.cu"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for d in (64, 128, 256)
    ]
    stderr = ""
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-4000:]
        stderr += err
    report: dict[tuple[int, int, int], tuple[int, int]] = {}
    name = None
    spill = 0
    for line in stderr.splitlines():
        m = re.search(r"Compiling entry function '_ZN8certvllm13attend_kernelILi(\d+)ELi(\d+)ELi\d+ELi(\d+)ELi", line)
        if m:
            name = ("attend", *(int(x) for x in m.groups()))
            continue
        m = re.search(r"Compiling entry function '_ZN8certvllm14promote_kernelILi(\d+)ELi(\d+)ELi(\d+)E", line)
        if m:
            name = ("promote", *(int(x) for x in m.groups()))
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name is not None:
            report[name] = (int(m.group(1)), spill)
            name = None
    return report


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here: the CUDA kernel is built and tested on the GPU")
def test_every_cuda_configuration_compiles_for_sm90_without_spills_up_to_gqa_8(tmp_path):
    report = _ptxas_report(tmp_path)
    dims, groups = (64, 128, 256), (1, 2, 4, 8, 16)
    expected = {("attend", d, gp, w) for d in dims for gp in groups for w in (2, 4, 8)}
    expected |= {("promote", d, gp, w) for d in dims for gp in groups for w in (2, 4)}
    assert set(report) == expected
    for (kernel, d, gp, w), (regs, spill) in report.items():
        assert regs <= 255
        if gp <= 8:
            assert spill == 0, ((kernel, d, gp, w), regs, spill)
