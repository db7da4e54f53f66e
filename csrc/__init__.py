"""C++/CUDA sources of certvllm, shipped as ``certvllm.csrc`` and compiled on first use."""
