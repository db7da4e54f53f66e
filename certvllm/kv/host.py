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
    """A host tensor, registered with CUDA when ``pin`` is set.

    Not zeroed: a shadow slot is read only after its token was written (full blocks, and the written
    prefix of a partial block), so untouched memory is never used and costs nothing until written.
    """
    tensor = torch.empty(shape, dtype=dtype)
    if pin and torch.cuda.is_available():
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(err) != 0:
            raise PinnedMemoryError(
                f"cudaHostRegister failed ({err}) for {tensor.numel() * tensor.element_size() / 2**30:.2f} GiB of "
                "shadow pages; lower --cert-host-memory-gb or raise the memlock limit (ulimit -l)"
            )
    return tensor
