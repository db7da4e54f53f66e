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


if __name__ == "__main__":
    load()
    print(f"certvllm: CPU kernel built in {build_dir()}")
