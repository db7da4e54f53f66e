"""The CUDA kernels of phase 2 (``csrc/cuda/attend_kernel.cuh`` and ``promote_kernel.cuh``; read their headers first):
build on first use (one extension), the shapes they take, and their launches: the attend pass into the
:class:`phase2.AttendOut` buffers, the promotion pass into ``phase2.promote``'s outputs.

The kernel computes what ``phase2._attend_kernel`` computes, with the same float32 block sums and float64
accumulation (docs/certification.md §5.1), so the certificate is unchanged; it differs in how the bytes move:
independent warps stream their pages through a ring of ``cp.async`` stages instead of waiting on each load. It is
compiled by torch's extension tools (``certvllm.kernels.jit``, nvcc) the first time a CUDA process asks for it
(the server's warm-up does); where that fails, :data:`ATTEND_CUDA_GATE` warns once and that call and later ones run the
Triton kernel (``phase2.attend``). The promotion kernel computes ``phase2._promote_kernel``'s outputs: its exact
scores are D-term float32 sums in another order, which γ_D covers (docs/certification.md §5.1); it runs where
``KernelTuning.promote_cuda`` asks for it (:func:`promote_supported`).
"""

from __future__ import annotations

import functools

import torch

from certvllm.formats.layout import BLOCK_SIZE, PageLayout
from certvllm.kernels.jit import JitExtension, csrc_file

from .common import GluonGate, interpreting

VALUE_GROUP = 16
"""The value group size the kernel is compiled for (other sizes run the Triton kernel)."""
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16
WARPS = (2, 4, 8)
_EXT = JitExtension(
    "certvllm_cuda_attend_v1",
    [csrc_file("cuda", name) for name in ("attend.cu", "attend_d64.cu", "attend_d128.cu", "attend_d256.cu")],
    "the attend pass runs the Triton kernel",
    headers=(csrc_file("cuda", "attend_kernel.cuh"), csrc_file("cuda", "promote_kernel.cuh")),
    extra_cuda_cflags=["-O3", "-std=c++17"],
)
_DEVICE_POINTERS: dict[int, int] = {}
ATTEND_CUDA_GATE = GluonGate("attend", dialect="CUDA")
"""Falls back to the Triton kernel, once and with a warning, when the extension cannot be built."""
PROMOTE_CUDA_GATE = GluonGate("promotion", dialect="CUDA")
"""The promotion kernel's own gate (it launches before the attend kernel in a call: a failure of its first launch
must not turn the attend kernel off)."""


@functools.cache
def _hopper(index: int) -> bool:
    """Whether CUDA device ``index`` has compute capability 9.x (asked once per device, not per layer call)."""
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.cache
def layout_fits(layout: PageLayout) -> bool:
    """Whether the kernel can copy a page's value codes, scales and zeros as one span: contiguous, the span, header
    and page 16-byte aligned, 16-token blocks and value groups of :data:`VALUE_GROUP` (``formats.layout`` lays
    them out so at every supported head dim)."""
    n, d = layout.block_size, layout.head_dim
    return (
        n == BLOCK_SIZE and layout.value_group == VALUE_GROUP and d in HEAD_DIMS
        and layout.v_scale == layout.v_codes + n * d // 2
        and layout.v_zero == layout.v_scale + 2 * n * layout.groups
        and layout.v_codes % 16 == 0 and layout.header % 16 == 0 and layout.page_bytes % 16 == 0
    )  # fmt: skip


def _hopper_build(device: torch.device, *gates: GluonGate) -> bool:
    """A compiled (not interpreted) CUDA device of compute capability 9.x, and no earlier failure of ``gates``."""
    if interpreting() or device.type != "cuda" or any(gate.failure is not None for gate in gates):
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


def supported(layout: PageLayout, group: int, warps: int, device: torch.device) -> bool:
    """Whether the CUDA kernel takes this call: a compiled (not interpreted) CUDA device of compute capability 9.x,
    a page layout it can stream (:func:`layout_fits`), at most :data:`MAX_GROUP` query heads per KV head, ``warps``
    in :data:`WARPS`, and no earlier build failure in this process."""
    shape_ok = 1 <= group <= MAX_GROUP and warps in WARPS and layout_fits(layout)
    return shape_ok and _hopper_build(device, ATTEND_CUDA_GATE)


def promote_supported(head_dim: int, group: int, channel_major: bool, warps: int, device: torch.device) -> bool:
    """Whether the CUDA promotion kernel takes this call: ``warps`` (``KernelTuning.promote_cuda``) 2 or 4, a
    compiled CUDA device of compute capability 9.x with no earlier build failure, a head dim in :data:`HEAD_DIMS`,
    at most :data:`MAX_GROUP` query heads per KV head, and token-major shadow keys (the CUDA layout)."""
    shape_ok = warps in (2, 4) and not channel_major and head_dim in HEAD_DIMS and 1 <= group <= MAX_GROUP
    return shape_ok and _hopper_build(device, ATTEND_CUDA_GATE, PROMOTE_CUDA_GATE)


def load():
    """The built extension module (built now if needed; RuntimeError naming the reason when it cannot be)."""
    return _EXT.load()


def launch(out, geo, scores, mmax, shadow, pages, tables, nfull, bits, active, exact_lm, warps: int) -> None:
    """Launch the CUDA attend pass into ``out`` (:class:`phase2.AttendOut`) for a call :func:`supported` accepted; the
    arguments are :func:`phase2.attend`'s. ``shadow`` is read through its device address (pinned host memory under unified
    addressing, or device memory)."""
    lay = geo.layout  # :func:`supported` has checked it (the extension checks shapes and dtypes again)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    ext = load()
    ext.attend(
        scores, mmax, _device_address(ext, shadow), shadow.dtype == torch.bfloat16, pages, tables, nfull, bits, active,
        out.acc, out.den, out.aval, out.atail, exact_lm, geo.num_blocks, geo.splits, geo.blocks_per_split,
        geo.num_kv_heads, geo.group, geo.sub_blocks, lay.value_group, lay.page_bytes, lay.v_codes, lay.header, warps,
    )  # fmt: skip


def _device_address(ext, shadow: torch.Tensor) -> int:
    """The shadow's address on the device: pinned host memory under unified addressing, or device memory as it is
    (resolved once per allocation, by a query outside any graph capture)."""
    host = shadow.data_ptr()
    if host not in _DEVICE_POINTERS:
        _DEVICE_POINTERS[host] = ext.device_pointer(host) if shadow.device.type == "cpu" else host
    return _DEVICE_POINTERS[host]


def launch_promote(geo, qs, shadow, tables, nfull, bits, active, scores, m8, delta, round1, canary, run_canary: bool,
                   pool, kslot, stage, smax, sabs, warps: int) -> None:  # fmt: skip
    """Launch the CUDA promotion pass into ``scores``, ``canary``, ``smax`` and ``sabs`` for a call
    :func:`promote_supported` accepted; the arguments are :func:`phase2.promote`'s (``pool``/``kslot`` None: every
    key page from the shadow; ``stage`` None: no staging pages)."""
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    ext = load()
    use_pool = pool is not None and kslot is not None
    ext.promote(
        qs, _device_address(ext, shadow), shadow.dtype == torch.bfloat16, pool if use_pool else None,
        stage if use_pool else None, kslot.contiguous() if use_pool else None, pool.shape[0] if use_pool else 0,
        tables, nfull, bits, active, scores, m8.contiguous(), delta.contiguous(), round1.contiguous(), canary, smax,
        sabs, geo.num_blocks, geo.splits, geo.blocks_per_split, geo.num_kv_heads, geo.group, geo.sub_blocks,
        run_canary, warps,
    )  # fmt: skip
