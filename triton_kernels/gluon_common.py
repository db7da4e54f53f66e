"""Helpers shared by the Gluon kernels (``phase1_mma_gluon``, ``fused_gluon``).

Imported only where Triton has Gluon (``jit_cache.GLUON_MODULES`` lists the modules that need it)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """A view of shared memory ``buf`` with another element type, shape and layout (the same bytes)."""
    if _PUBLIC_REINTERPRET:
        return buf.reinterpret(dtype, shape, layout)
    else:  # Triton < 3.7 names it _reinterpret
        return buf._reinterpret(dtype, shape, layout)


@gluon.jit
def pow2(e):
    """2^e as float32 for int32 e in [-126, 127], exactly (from the exponent bits)."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)
