"""Host memory for the shadow tier: plain on the CPU, pinned with ``cudaHostRegister`` on CUDA.

``cudaHostRegister`` pins exactly the allocation (``pin_memory=True`` rounds large sizes up to a
power of two), and the registered pointer is valid on the device (unified addressing), which the
zero-copy gather kernels use.
"""

from __future__ import annotations

import torch


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
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(err) != 0:
            raise PinnedMemoryError(
                f"cudaHostRegister failed ({err}) for {tensor.numel() * tensor.element_size() / 2**30:.2f} GiB of "
                "shadow pages; lower --cert-host-memory-gb or raise the memlock limit (ulimit -l)"
            )
    return tensor
