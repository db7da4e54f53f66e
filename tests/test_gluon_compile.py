"""The Gluon kernels compile for the H200 (sm_90) on this machine, without a GPU.

Triton's interpreter does not run Gluon kernels, so the CPU test-suite cannot execute them; the GPU tests
(``pytest -m gpu``) can, but only on a CUDA machine. This test compiles them with the installed Triton and
its bundled ``ptxas`` to an sm_90 cubin, with the compile-time arguments the launchers use
(``launch_constants``), over the shapes the product supports, and bounds their registers and stack (spilled
bytes) as read by the bundled ``cuobjdump``. It catches a Gluon API change or a layout error before a GPU
run, and a change that makes a kernel spill heavily. Skipped (with the reason) when this Triton has no
NVIDIA backend tools.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")

from certvllm.formats.layout import PageLayout  # noqa: E402


def _nvidia_tool(name: str) -> str:
    import triton.backends.nvidia as nv

    path = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    if not os.access(path, os.X_OK):
        pytest.skip(f"this Triton ships no {name} (needed to compile for sm_90 without a GPU)")
    return path


def _gluon():
    try:
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as err:
        pytest.skip(f"this Triton has no Gluon ({err}); the Triton kernels are used instead")
    return GluonASTSource


ATTEND_POINTERS = {
    "scores": "*fp32", "mmax": "*fp32", "shadow": "*fp16", "pages_u8": "*u8", "pages_f16": "*fp16",
    "pages_f32": "*fp32", "tables": "*i64", "nfull": "*i64", "bits": "*i32", "active": "*i32", "acc": "*fp64",
    "den": "*fp64", "aval": "*fp64", "atail": "*fp64", "exact_lm": "*fp32",
}  # fmt: skip
PHASE1_POINTERS = {
    "qs": "*fp32", "pages_u8": "*u8", "pages_i8": "*i8", "pages_f16": "*fp16", "pages_f32": "*fp32",
    "tables": "*i64", "nfull": "*i64", "lut": "*fp32", "bad": "*i32",
}  # fmt: skip
SCALARS = {"num_blocks": "i32", "B": "i32", "TB_STRIDE": "i32", "S": "i32", "BPS": "i32", "DELTA_F": "fp32",
           "ROUND_F": "fp32"}  # fmt: skip


def compile_sm90(kernel, pointers: dict, constants: dict) -> dict:
    """Compile a Gluon kernel for sm_90; returns ``{"registers", "stack"}`` per thread. Pointer arguments
    not named in ``pointers`` are float32 outputs; constants also carry the compile options (``num_warps``,
    ``maxnreg``, ``enable_fp_fusion``)."""
    from triton.backends.compiler import GPUTarget

    source_cls = _gluon()
    cuobjdump = _nvidia_tool("cuobjdump")
    options = {k: constants.pop(k) for k in ("num_warps", "maxnreg", "enable_fp_fusion") if k in constants}
    signature, constexprs = {}, {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name], constexprs[name] = "constexpr", constants[name]
        else:
            signature[name] = SCALARS.get(name) or pointers.get(name, "*fp32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if signature[n].startswith("*")}
    compiled = triton.compile(source_cls(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert m, f"no resource usage in cuobjdump's output: {usage[-400:]}"
    return {"registers": int(m.group(1)), "stack": int(m.group(2))}


@pytest.mark.parametrize(
    "hq,hkv,d,parts,chunk,max_stack",
    [
        (32, 8, 128, 1, 2, 64),  # LLaMA-3.1-8B, the default configuration (128-register cap: a few bytes spill)
        (64, 8, 128, 1, 2, 0),  # G = 8: no cap, no spills
        (8, 8, 64, 1, 2, 64),  # G = 1
        (24, 3, 64, 1, 2, 64),
        (8, 4, 256, 1, 2, 64),
        (32, 8, 128, 2, 4, 512),  # other measured configurations (slower; this one spills under the cap)
        (32, 8, 128, 4, 2, 64),
    ],
)
def test_attend_kernel_compiles_for_sm90(hq, hkv, d, parts, chunk, max_stack):
    from certvllm.triton_kernels import attend_gluon
    from certvllm.triton_kernels.phase2 import Phase2Geometry

    geo = Phase2Geometry(PageLayout(d), hkv, hq // hkv, 1, 1024, 4, 64, attend_parts=parts, attend_chunk_bytes=chunk)
    assert attend_gluon.supported(d, geo.group, geo.attend_warps, geo.attend_warps, 16, parts, chunk)
    use = compile_sm90(attend_gluon._attend_gluon_kernel, ATTEND_POINTERS,
                       attend_gluon.launch_constants(geo, geo.attend_warps))  # fmt: skip
    cap = geo.attend_maxnreg if geo.group <= 4 and geo.attend_maxnreg else 255
    assert use["registers"] <= cap, use
    assert use["stack"] <= max_stack, use


@pytest.mark.parametrize("hq,hkv,d,chain", [(32, 8, 128, False), (32, 8, 128, True), (64, 8, 64, False),
                                            (8, 8, 128, False), (8, 4, 256, False)])  # fmt: skip
def test_phase1_kernel_compiles_for_sm90(hq, hkv, d, chain, monkeypatch):
    from certvllm.triton_kernels import phase1_gluon

    monkeypatch.setenv("CERTVLLM_P1_CHAIN", "1" if chain else "0")
    consts = phase1_gluon.launch_constants(PageLayout(d), hkv, hq // hkv, 1, 4, 4)
    use = compile_sm90(phase1_gluon._phase1_gluon_kernel, PHASE1_POINTERS, consts)
    assert use["registers"] <= 255 and use["stack"] == 0, use


def test_compiled_constants_match_a_launch():
    """The constants compiled above are the ones a launch passes: ``launch`` forwards ``launch_constants``
    unchanged (checked by intercepting the kernel's launch on CPU tensors)."""
    from certvllm.triton_kernels import attend_gluon
    from certvllm.triton_kernels.phase2 import AttendOut, Phase2Geometry

    geo = Phase2Geometry(PageLayout(128), 8, 4, 1, 64, 2, 8)
    seen = {}

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(kwargs, grid=grid)

            return run

    t = torch.zeros(1)
    out = AttendOut(t, t, t, t)
    orig = attend_gluon._attend_gluon_kernel
    attend_gluon._attend_gluon_kernel = Spy()
    try:
        attend_gluon.launch(out, geo, torch.zeros(2, 8, 4, 4, 16), t, t, torch.zeros(8, 2, 8), torch.zeros(2, 4),
                            t, t, t, t, 4)  # fmt: skip
    finally:
        attend_gluon._attend_gluon_kernel = orig
    grid = seen.pop("grid")
    assert seen == attend_gluon.launch_constants(geo, 4)
    assert grid == (2 * 8 * geo.attend_parts, geo.splits)


def test_a_gluon_kernel_that_fails_to_compile_falls_back_once_and_loudly():
    """``GluonGate``: a failure at the first launch (compilation) warns, disables the Gluon kernel for the
    process and runs the Triton kernel; a failure after a successful launch is not forgiven."""
    from certvllm.triton_kernels.common import GluonGate

    calls = []

    def broken():
        calls.append("gluon")
        raise RuntimeError("PassManager::run failed")

    gate = GluonGate("attend", "CERTVLLM_ATTEND_GLUON")
    with pytest.warns(RuntimeWarning, match="CERTVLLM_ATTEND_GLUON=0"):
        gate.run(broken, lambda: calls.append("triton"))
    gate.run(broken, lambda: calls.append("triton"))  # not retried
    assert calls == ["gluon", "triton", "triton"] and "PassManager" in gate.failure

    ok = GluonGate("phase-1", "CERTVLLM_P1_GLUON")
    ok.run(lambda: calls.append("gluon ok"), lambda: calls.append("never"))
    with pytest.raises(RuntimeError, match="illegal"):
        ok.run(lambda: (_ for _ in ()).throw(RuntimeError("illegal memory access")), lambda: calls.append("never"))
    assert "never" not in calls and ok.failure is None
