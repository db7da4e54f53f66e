"""The attend pass's CUDA kernel (``csrc/cuda/attend_kernel.cuh``; read its header first): build on first use, the shapes it
takes, and the launch into the :class:`phase2.AttendOut` buffers.

The kernel computes what ``phase2._attend_kernel`` computes, with the same float32 block sums and float64
accumulation (docs/certification.md §5.1), so the certificate is unchanged; it differs in how the bytes move:
independent warps stream their pages through a ring of ``cp.async`` stages instead of waiting on each load. It is
compiled by torch's extension tools (``certvllm.kernels.jit``, nvcc) the first time a CUDA process asks for it
(the server's warm-up does); where that fails, :data:`ATTEND_CUDA_GATE` warns once and the Triton kernel runs.
"""

from __future__ import annotations

import torch

from certvllm.formats.layout import BLOCK_SIZE, PageLayout
from certvllm.kernels.jit import JitExtension, csrc_file

from .common import GluonGate, interpreting, next_pow2

VALUE_GROUP = 16
"""The value group size the kernel is compiled for (other sizes run the Triton kernel)."""
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16
WARPS = (2, 4, 8)
_EXT = JitExtension(
    "certvllm_cuda_attend_v1",
    [csrc_file("cuda", name) for name in ("attend.cu", "attend_d64.cu", "attend_d128.cu", "attend_d256.cu")],
    "the attend pass runs the Triton kernel",
    headers=(csrc_file("cuda", "attend_kernel.cuh"),),
    extra_cuda_cflags=["-O3", "-std=c++17"],
)
_DEVICE_POINTERS: dict[int, int] = {}
ATTEND_CUDA_GATE = GluonGate("attend", dialect="CUDA")
"""Falls back to the Triton kernel, once and with a warning, when the extension cannot be built."""


def supported(layout: PageLayout, group: int, warps: int, device: torch.device) -> bool:
    """Whether the CUDA kernel takes this call: a compiled (not interpreted) CUDA device of compute capability 9.x,
    a head dim in :data:`HEAD_DIMS`, value groups of :data:`VALUE_GROUP`, at most :data:`MAX_GROUP` query heads per
    KV head, ``warps`` in :data:`WARPS`, and no earlier build failure in this process."""
    if interpreting() or device.type != "cuda" or ATTEND_CUDA_GATE.failure is not None:
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return (
        layout.head_dim in HEAD_DIMS and layout.value_group == VALUE_GROUP and 1 <= group <= MAX_GROUP
        and warps in WARPS and layout.block_size == BLOCK_SIZE
    )  # fmt: skip


def check_layout(layout: PageLayout) -> None:
    """The kernel copies the value codes, scales and zeros as one span: they must be contiguous and 16-byte
    aligned in the page (``formats.layout`` puts them so; raises naming the offsets otherwise)."""
    n, d = layout.block_size, layout.head_dim
    if (
        layout.v_scale != layout.v_codes + n * d // 2
        or layout.v_zero != layout.v_scale + 2 * n * layout.groups
        or layout.v_codes % 16
        or layout.header % 16
        or layout.page_bytes % 16
    ):  # fmt: skip
        raise ValueError(
            f"page layout {layout}: the CUDA attend kernel needs the value codes, scales and zeros contiguous and "
            "the value span, header and page 16-byte aligned; run the Triton kernel (KernelTuning(dialect='triton'))"
        )


def load():
    """The built extension module (built now if needed; RuntimeError naming the reason when it cannot be)."""
    return _EXT.load()


def launch(out, geo, scores, mmax, shadow, pages, tables, nfull, bits, active, exact_lm, warps: int) -> None:
    """Launch the CUDA attend pass into ``out`` (:class:`phase2.AttendOut`); the arguments are
    :func:`phase2.attend`'s. ``shadow`` is read through its device address (pinned host memory under unified
    addressing, or device memory)."""
    lay = geo.layout
    check_layout(lay)
    if geo.group > MAX_GROUP or next_pow2(geo.group) > MAX_GROUP:
        raise ValueError(f"{geo.group} query heads per KV head: the CUDA attend kernel takes at most {MAX_GROUP}")
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    ext = load()
    host = shadow.data_ptr()
    if host not in _DEVICE_POINTERS:  # resolved once per shadow allocation (a query, outside any graph capture)
        _DEVICE_POINTERS[host] = ext.device_pointer(host) if shadow.device.type == "cpu" else host
    ext.attend(
        scores, mmax, _DEVICE_POINTERS[host], shadow.dtype == torch.bfloat16, pages, tables, nfull, bits, active,
        out.acc, out.den, out.aval, out.atail, exact_lm, geo.num_blocks, geo.splits, geo.blocks_per_split,
        geo.num_kv_heads, geo.group, geo.sub_blocks, lay.value_group, lay.page_bytes, lay.v_codes, lay.header, warps,
    )  # fmt: skip
