"""Triton kernels of certvllm, shipped as ``certvllm.triton_kernels`` (never as a top-level
``triton_kernels`` module, which would shadow vLLM's own). Each kernel sits beside its launcher."""
