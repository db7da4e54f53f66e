"""Compiled kernels (CPU C++ extension; Triton kernels live in ``certvllm.triton_kernels``)."""
