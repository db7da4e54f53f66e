"""Compile a Gluon or Triton kernel for a CUDA target on a machine without a GPU, and read what the compiler made
of it.

Triton compiles to a cubin with its bundled ``ptxas`` whatever the machine, given the target
(``GPUTarget("cuda", 90, 32)`` for the H200) and the signature a launch would infer: pointer element types,
scalar types and the constexpr values (the launchers' ``launch_constants``). From the cubin the bundled
``cuobjdump`` gives the registers and stack (spilled bytes) per thread and the SASS; the SASS of the main
loop (the longest backward branch, minus its largest conditional forward skip: the rarely taken path)
gives the instructions issued per iteration.

Used by ``tests/triton_kernels/test_gluon_compile.py`` (the Gluon kernels and the promotion pass compile, within
register and spill bounds) and
``benchmarks/kernel_sass.py`` (instruction mix per iteration, to compare kernel variants before a GPU run).

**One process cannot do both.** On a machine without CUDA, importing ``certvllm.triton_kernels`` sets
``TRITON_INTERPRET=1`` before Triton is imported, so that the Triton kernels run in the interpreter; Triton
then defines its standard library (``tl.sum`` …) as interpreted functions, which a Gluon compile cannot
reference. :func:`run_jobs` therefore compiles in a child process whose Triton is told not to interpret
(``env TRITON_INTERPRET=0 python -m certvllm.triton_kernels.offline_compile``, job specs as JSON on stdin,
results as JSON on the last line of stdout).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import triton

PHASE1_POINTERS = {
    "qs": "*fp32", "pages_u8": "*u8", "pages_i8": "*i8", "pages_f16": "*fp16", "pages_f32": "*fp32",
    "pages_i32": "*i32", "tables": "*i64", "nfull": "*i64", "lut": "*fp32", "bad": "*i32",
}  # fmt: skip
RESIDENT_POINTERS = {
    "qs": "*fp32", "pages_u8": "*u8", "pages_i8": "*i8", "pages_f16": "*fp16", "pages_f32": "*fp32",
    "shadow": "*bf16", "pool": "*bf16", "vpool": "*bf16", "tag": "*i64", "tag_gen": "*i64", "gen": "*i64",
    "slot_of": "*i32",
    "tables": "*i64", "nfull": "*i64", "bits": "*i32", "active": "*i32", "acc": "*fp64", "den": "*fp64",
    "aval": "*fp64", "atail": "*fp64", "bad": "*i32", "fbits": "*i32", "canary": "*i32",
}  # fmt: skip
PROMOTE_POINTERS = {
    "shadow": "*bf16", "pool": "*bf16", "stage": "*bf16", "tables": "*i64", "nfull": "*i64", "bits": "*i32",
    "active": "*i32", "canary": "*i32", "kslot": "*i32", "needed": "*i64",
}  # fmt: skip
SELECT_POINTERS = {
    "nfull": "*i64", "bits": "*i32", "widened": "*i8", "active": "*i32", "scratch": "*i64", "GS": "fp32",
    "TAU1": "fp32", "THR1": "fp32", "KEY_TOL": "fp32", "V_TOL": "fp32", "MARGIN": "fp32", "KMIN": "i32", "KMAX": "i32",
    "KMAX1": "i32", "VKMAX": "i32",
}  # fmt: skip
CALL_INPUTS_POINTERS = {
    "q_in": "*fp16", "Q_R": "i32", "Q_H": "i32", "tables": "*i32", "lens": "*i32", "scale": "fp32",
    "tables64": "*i64", "lens64": "*i64", "nfull": "*i64", "bvalid": "*i1", "tail_ids": "*i64",
}  # fmt: skip
"""Pointer element types of the compiled kernels (unnamed pointers are float32), and the selection's and the call
inputs' scalars (the call inputs as vLLM passes them: float16 queries, int32 tables and lengths)."""
SCALARS = {"num_blocks": "i32", "B": "i32", "TB_STRIDE": "i32", "S": "i32", "BPS": "i32", "DELTA_F": "fp32",
           "ROUND_F": "fp32", "ROUND_W": "fp32", "ROUND_P": "fp32", "ROUND_S": "fp32", "nslots": "i32"}  # fmt: skip
"""Scalar arguments of the kernels."""
OPTIONS = ("num_warps", "maxnreg", "enable_fp_fusion")
"""Keys of ``launch_constants`` that are compile options, not constexprs."""


class ToolMissing(RuntimeError):
    """This Triton lacks what offline compilation needs (Gluon, the NVIDIA backend's tools)."""


@dataclass
class Compiled:
    """One kernel compiled for a CUDA target: registers and stack bytes per thread, the SASS, and the
    opcode counts of one iteration of its main loop (``loop``: without its largest rare branch, ``common``: without
    every rare branch, :func:`common_path_mix`)."""

    registers: int
    stack: int
    sass: str
    loop: collections.Counter = field(default_factory=collections.Counter)
    common: collections.Counter = field(default_factory=collections.Counter)

    @property
    def loop_instructions(self) -> int:
        return sum(self.loop.values())


def nvidia_tool(name: str) -> str:
    """Path of a tool Triton's NVIDIA backend ships (``ptxas``, ``cuobjdump``, ``nvdisasm``)."""
    import triton.backends.nvidia as nv

    path = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    if not os.access(path, os.X_OK):
        raise ToolMissing(f"this Triton ships no {name} (needed to compile for CUDA without a GPU)")
    return path


def compile_cuda(kernel, pointers: dict, constants: dict, arch: int = 90, gluon: bool = True) -> Compiled:
    """Compile ``kernel`` (a Gluon kernel, or a Triton one with ``gluon=False``) for sm_``arch``. ``constants``
    is a launcher's ``launch_constants`` (constexprs plus the compile options in :data:`OPTIONS`); pointers not in
    ``pointers`` are float32. Needs a process whose Triton was imported without the interpreter (module docstring;
    else :func:`run_jobs`)."""
    from .common import interpreting
    from .shape_class import CALLER_POINTERS

    if interpreting():
        raise RuntimeError("Triton interprets kernels in this process: compile kernels offline with run_jobs()")
    if gluon:
        try:
            from triton.experimental.gluon._runtime import GluonASTSource as Source
        except ImportError as err:
            raise ToolMissing(f"this Triton has no Gluon ({err})") from err
    else:
        from triton.compiler import ASTSource as Source
    from triton.backends.compiler import GPUTarget

    cuobjdump = nvidia_tool("cuobjdump")
    options = {k: constants[k] for k in OPTIONS if k in constants}
    signature, constexprs = {}, {}
    for name in kernel.arg_names:
        if name in constants and name not in OPTIONS:
            signature[name], constexprs[name] = "constexpr", constants[name]
        else:
            signature[name] = SCALARS.get(name) or pointers.get(name, "*fp32")
    # what a launch specialises: 16-byte alignment of the pointers the kernels do not opt out for, no scalar
    # (``shape_class.RUNTIME_INTS``, ``CALLER_POINTERS``)
    aligned = [i for i, n in enumerate(kernel.arg_names) if signature[n].startswith("*") and n not in CALLER_POINTERS]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    compiled = triton.compile(Source(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage[-400:]}")
    return Compiled(int(m.group(1)), int(m.group(2)), sass, main_loop_mix(sass), common_path_mix(sass))


def main_loop_mix(sass: str) -> collections.Counter:
    """Opcode counts of one iteration of the longest loop in ``sass`` (``cuobjdump -sass`` text: the longest
    backward branch, taken or conditional), without
    its largest conditional forward branch's body (the rarely taken path, e.g. value-promoted blocks)."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))

    def target(ins: str) -> int | None:
        t = re.search(r"BRA\s.*?0x([0-9a-f]+)", ins)
        return int(t.group(1), 16) if t else None

    best = (0, 0)
    for addr, ins in lines:
        dest = target(ins) if "BRA" in ins else None  # a loop may close with a conditional branch
        if dest is not None and dest < addr and addr - dest > best[1] - best[0]:
            best = (dest, addr)
    start, end = best
    skip = (0, 0)
    for addr, ins in lines:
        dest = target(ins) if "BRA" in ins and ins.startswith("@") else None
        if dest is not None and start <= addr < end and addr < dest <= end and dest - addr > skip[1] - skip[0]:
            skip = (addr, dest)
    mix: collections.Counter = collections.Counter()
    for addr, ins in lines:
        if start <= addr <= end and not skip[0] < addr < skip[1]:
            toks = ins.split()
            op = toks[1] if toks[0].startswith("@") else toks[0]
            mix[op.split(".")[0]] += 1
    return mix


def common_path_mix(sass: str, rare: int = 100) -> collections.Counter:
    """Opcode counts of the main loop's common path: the longest loop of ``sass`` without the body of every
    conditional forward branch longer than ``rare`` instructions (taken as rarely run: the resident pass's exact-key
    branch, its running-maximum rescaling, its exact-value token loop); of an if/else, the longer arm is dropped."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))
    at = {addr: i for i, (addr, _) in enumerate(lines)}

    def target(ins: str) -> int | None:
        t = re.search(r"BRA\s.*?0x([0-9a-f]+)", ins)
        return int(t.group(1), 16) if t else None

    lo = hi = 0
    for addr, ins in lines:
        dest = target(ins) if "BRA" in ins else None
        if dest is not None and dest < addr and dest in at and at[addr] - at[dest] > hi - lo:
            lo, hi = at[dest], at[addr]
    skip: set[int] = set()
    for addr, ins in lines[lo:hi]:
        dest = target(ins) if "BRA" in ins and ins.startswith("@") else None
        if dest is None or dest <= addr or dest not in at or at[dest] > hi or at[dest] - at[addr] <= rare:
            continue
        i0, i1 = at[addr], at[dest]
        last = lines[i1 - 1][1]
        other = target(last) if last.startswith("BRA") else None
        if other is not None and other in at and at[other] - i1 < i1 - i0:  # if/else: keep the shorter arm
            skip.update(range(i0, i1))
        elif other is not None and other in at:
            skip.update(range(i1, at[other]))
        else:
            skip.update(range(i0, i1))
    mix: collections.Counter = collections.Counter()
    for i in range(lo, hi + 1):
        if i not in skip:
            toks = lines[i][1].split()
            op = toks[1] if toks[0].startswith("@") else toks[0]
            mix[op.split(".")[0]] += 1
    return mix


def run_jobs(jobs: list[dict], timeout: float = 1200.0) -> list[dict]:
    """Compile each job in a child process without the interpreter; returns per job ``registers``,
    ``stack``, ``loop_instructions`` and ``loop_top`` (the 12 most frequent opcodes of the loop), or
    ``missing`` (why this Triton cannot compile offline).

    A job: ``{"kernel": "phase1" | "resident" | "promote" | "select" | "call_inputs", "hq", "hkv", "d",
    "tuning": {KernelTuning field: value}, "flags": {fused_gluon.launch_constants flag: value}}`` (``tuning`` optional: the launchers'
    ``DEFAULT_TUNING`` with these fields replaced; ``flags`` for ``resident`` only: the resident pass of a warm
    pool with value pages and the canary by default; ``promote``: the promotion pass over a pool with the canary,
    the Triton kernel; ``select``: the selection kernel for a table of ``"blocks"`` columns, with ``"key_budget"`` and
    ``"k_max_widened"`` of the ladder, by default the ``default`` preset's: True and 512; ``call_inputs``: the
    layer call's input kernel for 16-token blocks). The child inherits
    this process's environment; ``env`` sets Triton's own switch off in it before Python starts."""
    cmd = ["env", "TRITON_INTERPRET=0", sys.executable, "-m", "certvllm.triton_kernels.offline_compile"]
    proc = subprocess.run(cmd, input=json.dumps(jobs), capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"offline compilation failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _run_job(spec: dict) -> dict:
    from certvllm.formats.layout import PageLayout

    from . import call_inputs, fused_gluon, phase1_mma_gluon, phase2, select
    from .fused import CANARY_SLACK, FusedGeometry
    from .tuning import KernelTuning

    tuning = KernelTuning(**spec.get("tuning", {}))
    try:
        hq, hkv, d = spec["hq"], spec["hkv"], spec["d"]
        if spec["kernel"] == "resident":
            geo = FusedGeometry(PageLayout(d), hkv, hq // hkv, 1, 1024, 4, 64)
            flags = {"use_pool": True, "pool_values": True, "use_bits": False, "use_active": False,
                     "run_canary": True, **spec.get("flags", {})}  # fmt: skip
            kernel, pointers = fused_gluon._fused_gluon_kernel, RESIDENT_POINTERS
            consts = fused_gluon.launch_constants(geo, tuning.resident_warps, CANARY_SLACK, **flags)
            if tuning.resident_maxnreg:
                consts["maxnreg"] = tuning.resident_maxnreg
        elif spec["kernel"] == "phase1":
            kernel, pointers = phase1_mma_gluon._phase1_mma_gluon_kernel, PHASE1_POINTERS
            consts = phase1_mma_gluon.launch_constants(PageLayout(d), hkv, hq // hkv, 1, tuning.phase1_warps)
        elif spec["kernel"] == "promote":
            kernel, pointers = phase2._promote_kernel, PROMOTE_POINTERS
            consts = phase2.promote_launch_constants(hkv, hq // hkv, d, 1, False, True, True, tuning)
        elif spec["kernel"] == "select":
            kernel, pointers = select._select_kernel, SELECT_POINTERS
            consts = select.select_launch_constants(spec["blocks"], hkv, hq // hkv, spec.get("key_budget", True),
                                                    spec.get("k_max_widened", 512), tuning=tuning,
                                                    parts=tuning.select_parts or 1)  # fmt: skip
        elif spec["kernel"] == "call_inputs":
            kernel, pointers = call_inputs._call_inputs_kernel, CALL_INPUTS_POINTERS
            consts = call_inputs.launch_constants(hq, d, 16)
        else:
            raise ValueError(f"job kernel {spec['kernel']!r}: it must be 'phase1', 'resident', 'promote', 'select' "
                             "or 'call_inputs'")  # fmt: skip
        triton_kernel = spec["kernel"] in ("promote", "select", "call_inputs")
        c = compile_cuda(kernel, pointers, consts, gluon=not triton_kernel)
        return {"registers": c.registers, "stack": c.stack, "loop_instructions": c.loop_instructions,
                "common_path_instructions": sum(c.common.values()), "loop_top": dict(c.loop.most_common(12))}  # fmt: skip
    except ToolMissing as err:
        return {"missing": str(err)}


if __name__ == "__main__":
    from .common import interpreting

    if interpreting():
        raise SystemExit("run with TRITON_INTERPRET=0: a Gluon compile cannot use the interpreter's Triton")
    print(json.dumps([_run_job(spec) for spec in json.loads(sys.stdin.read())]))
