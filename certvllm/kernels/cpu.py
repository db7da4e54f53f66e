"""The CPU certified-attention kernel (``csrc/cpu/certified_decode.cpp``), built on first use.

``make install`` builds it once (``python -m certvllm.kernels.cpu``) so no request pays for it. If it
cannot be built, :func:`available` is False and certified attention runs the (slower) PyTorch
reference, which computes the same certificate.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from certvllm.env import environment
from certvllm.kernels.jit import JitExtension, csrc_file

_NAME = "certvllm_cpu_v5"


def arch_flags() -> list[str]:
    """Vector ISA flags for this machine (``CERTVLLM_CPU_ARCH_FLAGS`` overrides, e.g. for images)."""
    override = environment().cpu_arch_flags
    if override is not None:
        return list(override)
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else []


_EXT = JitExtension(
    _NAME + ("-" + "".join(f.strip("-m") for f in arch_flags()) if arch_flags() else ""),
    [csrc_file("cpu", "certified_decode.cpp")],
    "certified attention uses the PyTorch path",
    extra_cflags=["-O3", "-fopenmp", "-fopenmp-simd", *arch_flags()],
    extra_ldflags=["-fopenmp"],
)


_AUDIT_EXT = JitExtension(
    "certvllm_audit_v1" + ("-" + "".join(f.strip("-m") for f in arch_flags()) if arch_flags() else ""),
    [csrc_file("cpu", "audit_reference.cpp")],
    "the audit's reference uses the PyTorch path",
    extra_cflags=["-O3", "-fopenmp", *arch_flags()],
    extra_ldflags=["-fopenmp"],
)
"""Audit mode's float64 reference (``csrc/cpu/audit_reference.cpp``; ``certvllm.attention.audit``)."""


def build_dir() -> Path:
    return _EXT.build_dir


def load() -> ModuleType:
    """Build (once) and import the extension; raises RuntimeError with the compiler's reason."""
    return _EXT.load()


def available() -> bool:
    try:
        load()
        return True
    except RuntimeError:
        return False


def load_audit() -> ModuleType:
    """Build (once) and import the audit's reference extension; raises RuntimeError with the compiler's reason."""
    return _AUDIT_EXT.load()


def audit_available() -> bool:
    """Whether the audit's compiled reference can be used (else ``reference_heads`` runs its torch path)."""
    try:
        load_audit()
        return True
    except RuntimeError:
        return False


if __name__ == "__main__":
    load()
    print(f"certvllm: CPU kernel built in {build_dir()}")
    if audit_available():
        print(f"certvllm: audit reference built in {_AUDIT_EXT.build_dir}")
