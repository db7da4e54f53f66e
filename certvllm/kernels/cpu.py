"""The CPU certified-attention kernel (``csrc/cpu/certified_decode.cpp``), built on first use.

The extension is compiled with torch's C++ extension tools into ``$CERTVLLM_EXT_DIR`` (default
``~/.cache/certvllm/extensions``); ``make install`` builds it once so no request pays for it. If it
cannot be built, :func:`available` is False and certified attention runs the (slower) PyTorch
reference, which computes the same certificate.
"""

from __future__ import annotations

import logging
import os
import threading
from importlib import resources
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("certvllm")
_NAME = "certvllm_cpu_v5"
_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None


def arch_flags() -> list[str]:
    """Vector ISA flags for this machine (``CERTVLLM_CPU_ARCH_FLAGS`` overrides, e.g. for images)."""
    override = os.environ.get("CERTVLLM_CPU_ARCH_FLAGS")
    if override is not None:
        return override.split()
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else []


def build_dir() -> Path:
    root = os.environ.get("CERTVLLM_EXT_DIR") or Path.home() / ".cache" / "certvllm" / "extensions"
    path = Path(root) / (_NAME + ("-" + "".join(f.strip("-m") for f in arch_flags()) if arch_flags() else ""))
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> ModuleType:
    """Build (once) and import the extension; raises RuntimeError with the compiler's reason."""
    global _module, _failed
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _failed is not None:
            raise RuntimeError(_failed)
        from torch.utils.cpp_extension import load as load_extension

        source = resources.files("certvllm.csrc") / "cpu" / "certified_decode.cpp"
        try:
            _module = load_extension(
                name=_NAME,
                sources=[str(source)],
                extra_cflags=["-O3", "-fopenmp", "-fopenmp-simd", *arch_flags()],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir()),
                verbose=False,
            )
        except Exception as err:  # a missing compiler must not take the service down
            _failed = f"certvllm CPU kernel unavailable ({type(err).__name__}: {err}); using the PyTorch path"
            logger.warning("%s", _failed)
            raise RuntimeError(_failed) from err
    return _module


def available() -> bool:
    if os.environ.get("CERTVLLM_CPU_KERNEL", "1") == "0":
        return False
    try:
        load()
        return True
    except RuntimeError:
        return False


if __name__ == "__main__":
    load()
    print(f"certvllm: CPU kernel built in {build_dir()}")
