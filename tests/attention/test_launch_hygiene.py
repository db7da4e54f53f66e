"""Launch hygiene of the CUDA path's layer call: besides its kernels, a certified call launches only the few torch
operations listed here, so that a CUDA graph of the call holds no fill, reduction or cast nodes between them.

Each torch launch is a node of the call's CUDA graph with its own launch latency (docs/performance.md, sixteenth
session, has the measured costs). Under Triton's interpreter the call runs on the CPU; every aten operation it
dispatches outside a kernel launch is recorded with the module that made it, and views and allocations without a
fill (no device work) are left out. The test fails on any launch not in the list, so a new one is a deliberate
change to this file.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.triton_kernels.common import interpreting  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import certvllm  # noqa: E402
from certvllm.attention.synthetic import SyntheticLayer  # noqa: E402
from certvllm.config import load_config  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="counts launches under Triton's interpreter (CPU)")

_REPO = Path(certvllm.__file__).resolve().parent.parent
_NO_DEVICE_WORK = {
    "aten.view.default", "aten.view.dtype", "aten._unsafe_view.default", "aten.as_strided.default",
    "aten.detach.default", "aten.t.default", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
    "aten.squeeze.default", "aten.select.int", "aten.slice.Tensor", "aten.empty.memory_format",
    "aten.empty_strided.default", "aten.alias.default", "aten.permute.default", "aten.reshape.default",
    "aten._reshape_alias.default", "aten.unbind.int", "aten.split.Tensor",
}  # fmt: skip

# (operation, module) → launches per call: the counters of the promotion pool and the page-in engine
EXPECTED = Counter({
    ("aten.zeros.default", "pool"): 1,  # the pool lookup's step and fill counters
    ("aten.add_.Tensor", "promotion_cache"): 1,  # the pool's totals += the step's counts
    ("aten.add.Tensor", "promotion_cache"): 1,  # pages read over PCIe: fills + bypasses
    ("aten.add.Tensor", "cuda_pagein"): 1,  # the engine's device counts += the call's (none in a graph capture)
})  # fmt: skip


class _Launches(TorchDispatchMode):
    """Records ``(operation, module)`` of every aten operation dispatched outside a Triton kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if self.inside_kernel == 0 and name not in _NO_DEVICE_WORK:
            ours = [f for f in traceback.extract_stack() if _is_ours(f.filename)]
            self.seen[(name, Path(ours[-1].filename).stem if ours else "?")] += 1
        return out


def _is_ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return _REPO in path.parents and ".venv" not in path.parts and "tests" not in path.parts


@pytest.fixture
def launches(monkeypatch):
    """A :class:`_Launches` mode that does not look inside the interpreter's kernel launches."""
    from triton.runtime.interpreter import GridExecutor

    mode = _Launches()
    run = GridExecutor.__call__

    def counted(self, *args, **kwargs):
        mode.inside_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.inside_kernel -= 1

    monkeypatch.setattr(GridExecutor, "__call__", counted)
    return mode


@pytest.mark.parametrize("preset", ["default", "naive"])
def test_a_certified_call_launches_only_its_kernels_and_the_listed_counters(launches, preset):
    """A warm call of two rows (one with a partial block) launches exactly ``EXPECTED`` besides its kernels, on the
    default preset (selection, promotion pool, canary, rank checks, the device re-run) and on the naive one."""
    layer = SyntheticLayer(8, 2, 64, torch.float16, load_config(preset), "cpu", blocks=16)
    lens = [100, 70]
    layer.call(lens)  # the first call makes the caches' lazily built state (pools, constants)
    q, tables, seq_lens = layer._inputs(lens)
    with launches:
        result = layer._op(q, tables, seq_lens, 0, None, None)
    assert result.out.shape == (2, 8, 64)
    assert launches.seen == EXPECTED, f"torch launches in the call: {dict(launches.seen)}"


@pytest.mark.parametrize("overrides,escalates", [({}, False), ({"force_fallback": "head"}, True)])
def test_the_rerun_flag_marks_exactly_the_calls_with_an_escalated_head(monkeypatch, overrides, escalates):
    """``KernelTuning.rerun_if_node``: the epilogue's flag (the predicate of the re-run's conditional node in a graph
    capture) is 1 exactly when a head ends at rung 3 or 4, and the call's output and report are those of the call
    without the option (eagerly the re-run runs either way)."""
    from certvllm.attention import gpu

    seen = []
    apply = gpu.DeviceRerun.apply

    def spy(self, rung, out, forced=False):
        seen.append((None if self.escalated is None else int(self.escalated[0]), bool((rung >= 3).any())))
        return apply(self, rung, out, forced)

    monkeypatch.setattr(gpu.DeviceRerun, "apply", spy)
    results = []
    for tuning in ("", "rerun_if_node=1"):
        cfg = load_config("default", kernel_tuning=tuning, **overrides)
        results.append(SyntheticLayer(8, 2, 64, torch.float16, cfg, "cpu", blocks=16).call([100, 70]))
    (plain_flag, plain_any), (flag, any_escalated) = seen
    assert plain_flag is None and plain_any == any_escalated == escalates
    assert flag == int(escalates)
    plain, flagged = results
    assert torch.equal(plain.out, flagged.out) and torch.equal(plain.report.rung, flagged.report.rung)


def test_the_epilogue_counts_a_pooled_calls_traffic_as_the_torch_glue():
    """The promotion counts that ``finalize`` adds (``TrafficCount``, with the pool's count of key pages read over
    PCIe) equal the torch glue's sums, on two identical layers with a promotion pool."""
    from certvllm.attention import certified_attention
    from certvllm.attention.gpu import CudaOptions

    stats = []
    for glue in ("torch", "auto"):
        layer = SyntheticLayer(8, 2, 64, torch.float16, load_config("default"), "cpu", blocks=16)
        q, tables, seq_lens = layer._inputs([100, 70])
        layer.pagein.take_stats()  # what the fill counted
        certified_attention(q, layer.cache, tables, seq_lens, layer.config, layer.scale, pagein=layer.pagein,
                            generator=layer.generator, residency=layer.residencies[0], backend="cuda",
                            cuda_options=CudaOptions(glue=glue))  # fmt: skip
        s = layer.pagein.take_stats()
        stats.append((s.key_blocks, s.value_blocks, s.bytes))
    assert layer.residencies[0].pool is not None
    assert stats[1] == stats[0] and stats[0][0] > 0, stats
