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


def test_kernels_add_a_prefill_phase_and_record_the_profiled_one(monkeypatch) -> None:
    mod = _profile()
    monkeypatch.setattr(mod, "prompts", lambda model, batch, context, seed=0: [[seed, i] for i in range(batch)])
    args = mod.argparse.Namespace(model="m", batch=[1, 8], context=4096, max_tokens=16, top=5, kernels=7,
                                  dtype="bfloat16")  # fmt: skip
    spec = mod.spec_for(args, "certified", {}, {})
    assert mod.phase_names(7) == ("warm-up", "timed", "profiled", "prefill")
    assert mod.phase_names(0) == mod.PHASES
    phases = spec["phases"]
    assert len(phases) == 8
    warm, timed, profiled, prefill = phases[4:]
    assert warm["requests"] == timed["requests"] == profiled["requests"]
    assert profiled["profile"] == 5 and profiled["kernels"] == 7 and "kernels" not in timed
    assert prefill["kernels"] == 7 and "profile" not in prefill
    assert [r["max_tokens"] for r in prefill["requests"]] == [1] * 8
    assert [r["prompt_token_ids"] for r in prefill["requests"]] == [[1008, i] for i in range(8)]  # new prompts
    args.kernels = 0
    assert all("kernels" not in p for p in mod.spec_for(args, "certified", {}, {})["phases"])

    def phase(seconds: float, **extra) -> dict:
        return {"seconds": [seconds], "metrics": {}, "metrics_before": {}, **extra}

    kern = {"total_us": 3200.0, "launches": 40, "kernels": [{"kernel": "_promote_kernel", "launches": 32,
                                                             "total_us": 3000.0}]}  # fmt: skip
    result = {"init_seconds": 1.0, "log": ""}
    got = mod.summarize("certified", 8, result, [phase(1.6), phase(0.8), phase(0.9, profile={}, kernels=kern),
                                                 phase(2.5, kernels=kern)], 16)  # fmt: skip
    assert got["step_ms"] == {"warm-up": 100.0, "timed": 50.0, "profiled": 56.25}
    assert got["decode_kernels"]["steps"] == 16 and got["decode_kernels"]["total_us"] == 3200.0
    assert got["prefill_kernels"]["seconds"] == 2.5
    without = mod.summarize("auto", 8, result, [phase(1.6), phase(0.8), phase(0.9, profile={})], 16)
    assert "decode_kernels" not in without and "prefill_kernels" not in without


def test_kernel_summary_keeps_device_kernels_by_device_time() -> None:
    from types import SimpleNamespace

    from certvllm.vllm_plugin.harness import kernel_summary

    def event(key: str, count: int, us: float, device: str) -> SimpleNamespace:
        return SimpleNamespace(key=key, count=count, device_time_total=us, device_type=f"DeviceType.{device}")

    events = [event("cudaLaunchKernel", 90, 450.0, "CPU"), event("_attend", 32, 800.0, "CUDA"),
              event("_promote_kernel", 32, 1200.5, "CUDA"), event("idle", 3, 0.0, "CUDA")]  # fmt: skip
    # the promotion pass's 32 launches: 28 short ones and 4 long ones (exact re-runs under the same name)
    times = [20.0] * 28 + [300.0] * 3 + [500.5]
    launches = [SimpleNamespace(name="_promote_kernel", device_type="DeviceType.CUDA", device_time=t) for t in times]
    launches.append(SimpleNamespace(name="cudaLaunchKernel", device_type="DeviceType.CPU", device_time=0.0))
    prof = SimpleNamespace(key_averages=lambda: events, events=lambda: launches)
    got = kernel_summary(prof, 1)
    assert got == {"total_us": 2000.5, "launches": 64,
                   "kernels": [{"kernel": "_promote_kernel", "launches": 32, "total_us": 1200.5,
                                "launch_us": {"p50": 20.0, "p90": 300.0, "max": 500.5}}]}  # fmt: skip
