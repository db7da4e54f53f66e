"""Host memory for the shadow tier: plain on the CPU, pinned with ``cudaHostRegister`` on CUDA.

``cudaHostRegister`` pins exactly the allocation (``pin_memory=True`` rounds large sizes up to a
power of two), and the registered pointer is valid on the device (unified addressing), which the
zero-copy gather kernels use. Before pinning, the allocation is advised to use transparent huge pages
(``madvise(MADV_HUGEPAGE)``, where the kernel allows it): pinning then faults in and locks 2 MiB pages
instead of 4 KiB ones, which is what registering tens of GiB costs at engine start.

On a machine with several NUMA nodes the pinned pages should sit on the node of the GPU that reads them
(a tensor-parallel rank's shadow on its own GPU's side: PCIe reads from the far socket cross the socket link).
The allocation is still untouched when it is pinned, so :func:`prefer_node` (``mbind(MPOL_PREFERRED)`` on its
range) before ``cudaHostRegister`` places every page there as registration faults it in; the node comes from
the GPU's PCI device in sysfs (:func:`gpu_numa_node`). Where the platform has no such node (-1, one node) or
refuses ``mbind`` (some containers), the pages go wherever the kernel puts them, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from pathlib import Path

import torch

logger = logging.getLogger("vllm.certvllm")

_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 1 << 21
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}  # the syscall numbers of mbind(2)
_MPOL_PREFERRED = 1  # linux/mempolicy.h
_PAGE = 1 << 12
PCI_DEVICES = Path("/sys/bus/pci/devices")


class PinnedMemoryError(RuntimeError):
    """The host tier could not be pinned (precondition P4)."""


def allocate_host(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, registered with CUDA when ``pin`` is set (on the current GPU's NUMA node where it
    has one: module docstring).

    Zeroed because vLLM's CPU attention kernel computes whole blocks and masks the slots past the
    context with a zero weight: 0 × NaN garbage would be NaN. Large zeroed allocations come from
    calloc, so the pages cost nothing until they are written.
    """
    tensor = torch.zeros(shape, dtype=dtype)
    if pin and torch.cuda.is_available():
        node = gpu_numa_node(torch.cuda.current_device())
        if node is not None and prefer_node(tensor, node):
            logger.debug("certvllm: shadow of %.2f GiB placed on NUMA node %d (GPU %d's)",
                         tensor.numel() * tensor.element_size() / 2**30, node, torch.cuda.current_device())  # fmt: skip
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


def numa_node_of_pci(domain: int, bus: int, device: int, sysfs: Path = PCI_DEVICES) -> int | None:
    """The NUMA node of PCI device ``domain:bus:device.0`` from sysfs, or None (no such entry, or -1: the
    platform has one node or does not say)."""
    try:
        node = int((sysfs / f"{domain:04x}:{bus:02x}:{device:02x}.0" / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_numa_node(index: int) -> int | None:
    """The NUMA node of CUDA device ``index`` (:func:`numa_node_of_pci` of its PCI address), or None."""
    props = torch.cuda.get_device_properties(index)
    try:
        return numa_node_of_pci(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except AttributeError:  # a torch without the PCI fields
        return None


def prefer_node(tensor: torch.Tensor, node: int) -> bool:
    """Ask the kernel to place the (untouched) pages of ``tensor`` on NUMA node ``node`` when they are first
    touched (``mbind(MPOL_PREFERRED)`` over its whole pages). Returns False, changing nothing, where the platform
    has no ``mbind`` or refuses it."""
    nr = _SYS_MBIND.get(platform.machine())
    nbytes = tensor.numel() * tensor.element_size()
    start = (tensor.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
    end = (tensor.data_ptr() + nbytes) & ~(_PAGE - 1)
    if nr is None or end <= start or node < 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    bits = 64
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    ok = libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(start), ctypes.c_ulong(end - start),
                      ctypes.c_int(_MPOL_PREFERRED), mask, ctypes.c_ulong(words * bits + 1),
                      ctypes.c_uint(0))  # fmt: skip
    return ok == 0
