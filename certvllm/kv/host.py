"""Host memory for the shadow tier: plain on the CPU, pinned with ``cudaHostRegister`` on CUDA.

``cudaHostRegister`` pins exactly the allocation (``pin_memory=True`` rounds large sizes up to a
power of two), and the registered pointer is valid on the device (unified addressing), which the
zero-copy gather kernels use. Before pinning, the allocation is advised to use transparent huge pages
(``madvise(MADV_HUGEPAGE)``, where the kernel allows it): pinning then faults in and locks 2 MiB pages
instead of 4 KiB ones, which is what registering tens of GiB costs at engine start.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 1 << 21


class PinnedMemoryError(RuntimeError):
    """The host tier could not be pinned (precondition P4)."""


def allocate_host(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, registered with CUDA when ``pin`` is set.

    Zeroed because vLLM's CPU attention kernel computes whole blocks and masks the slots past the
    context with a zero weight: 0 × NaN garbage would be NaN. Large zeroed allocations come from
    calloc, so the pages cost nothing until they are written.
    """
    tensor = torch.zeros(shape, dtype=dtype)
    if pin and torch.cuda.is_available():
        advise_huge_pages(tensor)
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(err) != 0:
            raise PinnedMemoryError(
                f"cudaHostRegister failed ({err}) for {tensor.numel() * tensor.element_size() / 2**30:.2f} GiB of "
                "shadow pages; lower --cert-host-memory-gb or raise the memlock limit (ulimit -l)"
            )
    return tensor


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back the whole 2 MiB pages inside ``tensor``'s memory with huge pages (before it is
    touched). Returns False, changing nothing, where the platform has no ``madvise`` or refuses it."""
    nbytes = tensor.numel() * tensor.element_size()
    start = (tensor.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (tensor.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
