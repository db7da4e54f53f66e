"""The Gluon kernels and the promotion pass compile for the H200 (sm_90) on this machine, without a GPU.

Triton's interpreter does not run Gluon kernels, so the CPU test-suite cannot execute them; the GPU tests
(``pytest -m gpu``) can, but only on a CUDA machine. This test compiles them with the installed Triton and
its bundled ``ptxas`` to sm_90 cubins (``triton_kernels/offline_compile.py``, in a child process without
the interpreter), with the compile-time arguments the launchers use (``launch_constants``), over the
shapes the product supports, and bounds their registers and stack (spilled bytes) as read by the bundled
``cuobjdump``. It catches a Gluon API change or a layout error before a GPU run, and a change that makes a
kernel spill heavily. Skipped (with the reason) when this Triton cannot compile for CUDA offline.
"""

from __future__ import annotations

import pytest
from certvllm.triton_kernels.offline_compile import run_jobs

PHASE1_CASES = [(32, 8, 128), (64, 8, 64), (8, 8, 128), (24, 3, 64), (8, 4, 256)]
RESIDENT_CASES = [
    # hq, hkv, d, launch flags (the first pass of a warm pool by default), largest stack accepted; the bounds
    # hold for Triton 3.9 (this machine's) and 3.6 (the H200's), which spills a little more (in brackets)
    (32, 8, 128, {}, 0),  # LLaMA-3.1-8B: no spills (0 / 0)
    (32, 8, 128, {"use_bits": True, "use_active": True}, 16),  # the top-up and the exact re-run (0 / 8 B)
    (64, 8, 128, {}, 512),  # G = 8: 8 heads' accumulators in registers (144 / 296 B)
    (14, 2, 64, {"pool_values": False}, 256),  # G = 7 (Qwen2.5-0.5B), a keys-only pool (≤ 64 / 128 B)
    (8, 8, 256, {"use_pool": False, "run_canary": False}, 64),
]
PROMOTE_CASES = [
    # hq, hkv, d, most registers accepted. At G <= 4 the pass runs 2 warps per program so that 6 or more programs,
    # each waiting on its own key page, fit a multiprocessor (what made 2 warps faster than 4 on an H100): at most
    # 168 registers (Triton 3.9 here: 154 at LLaMA-3.1-8B's shape; 3.6 on the H100: 128). Larger groups: 8 warps.
    (32, 8, 128, 168),
    (8, 8, 128, 168),
    (32, 8, 64, 168),
    (14, 2, 64, 255),
    (64, 8, 128, 255),
]

SELECT_CASES = [
    # hq, hkv, d, table columns, key budget rule, KernelTuning fields: LLaMA-3.1-8B at 32K under the default ladder
    # (k_max 256: a window of 1,024 sorted positions) with a first window of 64, which compiles both windows' code
    (32, 8, 128, 2048, True, {"select_first_window": 64, "select_search": 0}),
    # the same table by search (no window): one program per head, and keys and values apart; the coverage rule's
    # three searches
    (32, 8, 128, 2048, True, {"select_search": 1, "select_parts": 1}),
    (32, 8, 128, 2048, True, {"select_search": 1, "select_parts": 2}),
    (32, 8, 128, 2048, False, {"select_search": 1, "select_parts": 1}),
]

CALL_INPUT_CASES = [(32, 8, 128), (14, 2, 64)]  # LLaMA-3.1-8B; Qwen2.5-0.5B (14 query heads: padded to 16)


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every case compiled once (one child process), keyed by its parameters."""
    jobs = [{"kernel": "phase1", "hq": hq, "hkv": hkv, "d": d} for hq, hkv, d in PHASE1_CASES]
    jobs += [{"kernel": "resident", "hq": hq, "hkv": hkv, "d": d, "flags": f} for hq, hkv, d, f, _ in RESIDENT_CASES]
    jobs += [{"kernel": "promote", "hq": hq, "hkv": hkv, "d": d} for hq, hkv, d, _ in PROMOTE_CASES]
    jobs += [
        {"kernel": "select", "hq": hq, "hkv": hkv, "d": d, "blocks": b, "key_budget": kb, "tuning": t}
        for hq, hkv, d, b, kb, t in SELECT_CASES
    ]
    jobs += [{"kernel": "call_inputs", "hq": hq, "hkv": hkv, "d": d} for hq, hkv, d in CALL_INPUT_CASES]
    results = run_jobs(jobs)
    missing = [r["missing"] for r in results if "missing" in r]
    if missing:
        pytest.skip(missing[0])
    return {repr(j): r for j, r in zip(jobs, results, strict=True)}


@pytest.mark.parametrize("hq,hkv,d", PHASE1_CASES)
def test_phase1_kernel_compiles_for_sm90(hq, hkv, d, compiled):
    from certvllm.triton_kernels import phase1_mma_gluon

    assert phase1_mma_gluon.supported(d, hq // hkv, 4, 4)
    use = compiled[repr({"kernel": "phase1", "hq": hq, "hkv": hkv, "d": d})]
    assert use["registers"] <= 255 and use["stack"] == 0, use
    assert use["loop_instructions"] > 0


@pytest.mark.parametrize("hq,hkv,d,flags,max_stack", RESIDENT_CASES)
def test_resident_kernel_compiles_for_sm90(hq, hkv, d, flags, max_stack, compiled):
    from certvllm.triton_kernels import fused_gluon

    assert fused_gluon.supported(d, hq // hkv, 16, False, 4, 4)
    use = compiled[repr({"kernel": "resident", "hq": hq, "hkv": hkv, "d": d, "flags": flags})]
    assert use["registers"] <= 255 and use["stack"] <= max_stack, use
    assert use["loop_instructions"] > 0


@pytest.mark.parametrize("hq,hkv,d,max_registers", PROMOTE_CASES)
def test_promotion_pass_compiles_for_sm90_without_spills(hq, hkv, d, max_registers, compiled):
    """The promotion pass (a Triton kernel) with its launcher's constants (``phase2.promote_launch_constants``: the
    default warps, a pool, the canary): no spills, and registers within the bound that keeps its programs in
    flight."""
    use = compiled[repr({"kernel": "promote", "hq": hq, "hkv": hkv, "d": d})]
    assert use["stack"] == 0 and use["registers"] <= max_registers, use
    assert use["loop_instructions"] > 0


@pytest.mark.parametrize("hq,hkv,d,blocks,key_budget,tuning", SELECT_CASES)
def test_selection_kernel_compiles_for_sm90(hq, hkv, d, blocks, key_budget, tuning, compiled):
    """The selection kernel with its launcher's constants (``select.select_launch_constants``) compiles for sm_90:
    the interpreter that runs it in the CPU tests does not check what the compiler checks (a value's type must be
    the same on both sides of a branch). Within 255 registers, no spills (Triton 3.9 here: 224 registers)."""
    job = {"kernel": "select", "hq": hq, "hkv": hkv, "d": d, "blocks": blocks, "key_budget": key_budget,
           "tuning": tuning}  # fmt: skip
    use = compiled[repr(job)]
    assert use["stack"] == 0 and use["registers"] <= 255, use


@pytest.mark.parametrize("hq,hkv,d", CALL_INPUT_CASES)
def test_call_inputs_kernel_compiles_for_sm90(hq, hkv, d, compiled):
    """The layer call's input kernel (``call_inputs.launch_constants``) compiles for sm_90, no spills."""
    use = compiled[repr({"kernel": "call_inputs", "hq": hq, "hkv": hkv, "d": d})]
    assert use["stack"] == 0 and use["registers"] <= 128, use


def test_a_gluon_kernel_that_fails_to_compile_falls_back_once_and_loudly():
    """``GluonGate``: a failure at the first launch (compilation) warns, disables the Gluon kernel for the
    process and runs the Triton kernel; a failure after a successful launch is not forgiven."""
    from certvllm.triton_kernels.common import GluonGate

    calls = []

    def broken():
        calls.append("gluon")
        raise RuntimeError("PassManager::run failed")

    gate = GluonGate("resident-pass")
    with pytest.warns(RuntimeWarning, match=r'KernelTuning\(dialect="triton"\)'):
        gate.run(broken, lambda: calls.append("triton"))
    gate.run(broken, lambda: calls.append("triton"))  # not retried
    assert calls == ["gluon", "triton", "triton"] and "PassManager" in gate.failure

    ok = GluonGate("phase-1")
    ok.run(lambda: calls.append("gluon ok"), lambda: calls.append("never"))
    with pytest.raises(RuntimeError, match="illegal"):
        ok.run(lambda: (_ for _ in ()).throw(RuntimeError("illegal memory access")), lambda: calls.append("never"))
    assert "never" not in calls and ok.failure is None

    cuda = GluonGate("attend", dialect="CUDA")  # the CUDA attend kernel's build failure names nvcc, not Triton
    with pytest.warns(RuntimeWarning, match="the CUDA attend kernel failed to compile with nvcc"):
        cuda.run(broken, lambda: calls.append("triton"))
    assert calls[-1] == "triton"


def test_the_tuning_flag_of_the_kernel_scripts_names_the_fields():
    """``benchmarks/kernel_sass.py`` and ``profile_decode.py --tunings``: ``FIELD=VALUE`` items become
    ``KernelTuning`` keyword arguments; an unknown name is refused with the list of fields, an out-of-range value
    with ``KernelTuning``'s own message."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from kernel_sass import parse_tuning

    assert parse_tuning(["attend_warps=8", "dialect=triton"]) == {"attend_warps": 8, "dialect": "triton"}
    with pytest.raises(SystemExit, match="'promote_stages' is not a KernelTuning field; the fields are .*attend_warps"):
        parse_tuning(["promote_stages=3"])
    with pytest.raises(SystemExit, match=r"attend_warps=3 is out of range"):
        parse_tuning(["attend_warps=3"])
    with pytest.raises(SystemExit, match="write FIELD=VALUE"):
        parse_tuning(["attend_warps"])
