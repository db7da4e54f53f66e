"""Helpers shared by the Triton kernels: directed float16/float32 rounding, rounding to nearest even,
exp/log with documented accuracy, and the launch-time switches.

Every kernel runs compiled on a CUDA device, or under ``TRITON_INTERPRET=1`` on CPU tensors (the
test-suite does this at tiny shapes). ``libdevice`` has no interpreter implementation, so each kernel
takes a ``PRECISE`` constexpr: True when compiled (libdevice ``expf``/``rint``, ≤ 2 ulp and exact), False
under the interpreter (NumPy's ``exp``/``rint``, which are at least as accurate).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = [
    "as_mask",
    "device_arg",
    "interpreting",
    "launch_device_ok",
    "next_pow2",
    "precise",
    "split_plan",
]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def precise() -> bool:
    """The value of every kernel's ``PRECISE`` constexpr."""
    return not interpreting()


def launch_device_ok(t: torch.Tensor) -> None:
    """Refuse CPU tensors outside the interpreter with a clear message (Triton would fail obscurely)."""
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "certvllm Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 (set before the first launch) "
            f"to run on {t.device} in Triton's interpreter"
        )


class _HostPointer:
    """A pinned host tensor handed to a compiled kernel as a plain pointer (``data_ptr`` + ``dtype``, the
    protocol Triton's launcher accepts); the launcher resolves its device address with
    ``cuPointerGetAttribute``, which is valid for registered memory under unified addressing."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self._tensor.data_ptr()


def device_arg(t: torch.Tensor) -> torch.Tensor | _HostPointer:
    """What to pass a kernel for ``t``: the tensor itself, or a host pointer for host memory when compiled."""
    if t.device.type == "cpu" and not interpreting():
        return _HostPointer(t)
    return t


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def split_plan(num_blocks: int, groups: int, blocks_per_split: int | None = None) -> tuple[int, int]:
    """Split-K plan ``(splits, blocks_per_split)`` for ``groups`` (row, KV head) programs over
    ``num_blocks`` blocks: about ``CERTVLLM_GPU_PROGRAMS_PER_SM`` (default 8) programs per multiprocessor,
    at least 4 blocks per program."""
    if blocks_per_split is None:
        sms = 132
        if torch.cuda.is_available() and not interpreting():
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        per_sm = int(os.environ.get("CERTVLLM_GPU_PROGRAMS_PER_SM", "8"))
        want = max(1, -(-per_sm * sms // max(1, groups)))
        blocks_per_split = max(4, -(-num_blocks // want))
    blocks_per_split = max(1, min(int(blocks_per_split), max(1, num_blocks)))
    return max(1, -(-num_blocks // blocks_per_split)), blocks_per_split


@triton.jit
def fp16_round_down(x):
    """Largest float16 ≤ x (x float32) — ``formats.rounding.fp16_round_down``."""
    y = x.to(tl.float16)
    bits = y.to(tl.int16, bitcast=True).to(tl.int32)
    down = tl.where(y > 0, bits - 1, tl.where(y == 0, -32767, bits + 1))  # -32767 = 0x8001: −smallest subnormal
    too_big = y.to(tl.float32) > x
    return tl.where(too_big, down.to(tl.int16).to(tl.float16, bitcast=True), y)


@triton.jit
def fp16_round_up(x):
    """Smallest float16 ≥ x (x float64) — ``formats.rounding.fp16_round_up``. Rounding to float32 first and
    then to float16 lands on one of the two float16 neighbours of x (float16 ⊂ float32, rounding is
    monotone), and the correction picks the upper one."""
    y = x.to(tl.float32).to(tl.float16)
    bits = y.to(tl.int16, bitcast=True).to(tl.int32)
    up = tl.where(y > 0, bits + 1, tl.where(y == 0, 1, bits - 1))
    too_small = y.to(tl.float64) < x
    return tl.where(too_small, up.to(tl.int16).to(tl.float16, bitcast=True), y)


@triton.jit
def fp32_round_up_nonneg(x):
    """Smallest float32 ≥ x for x ≥ 0 (float64) — ``formats.rounding.fp32_round_up``."""
    y = x.to(tl.float32)
    bits = y.to(tl.int32, bitcast=True)
    too_small = y.to(tl.float64) < x
    return tl.where(too_small, (bits + 1).to(tl.float32, bitcast=True), y)


@triton.jit
def rint(x, PRECISE: tl.constexpr):
    """Round to nearest, ties to even (``torch.round``), for |x| < 2^22."""
    if PRECISE:
        r = libdevice.rint(x)
    else:
        r = (x + 8388608.0) - 8388608.0
    return r


@triton.jit
def exp_f32(x, PRECISE: tl.constexpr):
    """exp in float32 within 2 ulp (libdevice ``expf``; ``tl.exp`` is ``ex2.approx`` of a rounded product,
    whose error grows with |x| and is not what the certificate's exp term assumes)."""
    if PRECISE:
        r = libdevice.exp(x)
    else:
        r = tl.exp(x)
    return r


@triton.jit
def pow2_f32(e):
    """2^e as float32 for int32 e in [-126, 127], exactly (from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_f64(e):
    """2^e as float64 for int32 e in [-1022, 1023], exactly."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def ceil_log2_f64(x):
    """⌈log₂ x⌉ (int32) for a normal float64 x > 0, exactly, from its bits."""
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 2047).to(tl.int32) - 1023
    mant = bits & 4503599627370495  # 2^52 − 1
    return tl.where(mant != 0, e + 1, e)


@triton.jit
def as_mask(x):
    """A boolean mask from ``scalar & tensor`` (Triton's interpreter turns such a mix into integers)."""
    return x != 0
