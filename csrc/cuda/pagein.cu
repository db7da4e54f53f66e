// certvllm CUDA page-in extension: a device view of the pinned host shadow tier, and a gather kernel
// that copies (16-token block, KV head) pages from it by block id (zero-copy reads over PCIe).
//
// Built on first use by certvllm/kv/cuda_ext.py (torch.utils.cpp_extension.load). Without it, the
// Triton gather (triton_kernels/gather.py) does the same work; both read the registered host memory
// through its device address.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace {

// One block per (item, k|v): copies the token-major [16, D] run of one (block, head) page.
// src: shadow [E, H, 2, M*16, D] (device address of pinned host memory), bytes per element `elem`.
// out: [n, 2, 16, D]. Pages are copied as 16-byte vectors (16*D*elem is a multiple of 16).
__global__ void gather_pages_kernel(const uint4* __restrict__ src, uint4* __restrict__ out,
                                    const int64_t* __restrict__ ids, const int64_t* __restrict__ heads,
                                    int64_t H, int64_t M, int64_t vec_per_page) {
  const int64_t item = blockIdx.x;
  const int64_t kv = blockIdx.y;
  const int64_t bid = ids[item];
  const int64_t h = heads[item];
  const int64_t e = bid / M, sub = bid % M;
  const uint4* s = src + ((e * H + h) * 2 + kv) * M * vec_per_page + sub * vec_per_page;
  uint4* o = out + (item * 2 + kv) * vec_per_page;
  for (int64_t i = threadIdx.x; i < vec_per_page; i += blockDim.x) o[i] = s[i];
}

}  // namespace

// A CUDA tensor aliasing a pinned (cudaHostRegister'ed or pin_memory) host tensor. The caller keeps the
// host tensor alive for as long as the view is used.
torch::Tensor device_view(torch::Tensor host) {
  TORCH_CHECK(host.device().is_cpu(), "device_view: expected a host tensor");
  void* dptr = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dptr, host.data_ptr(), 0);
  TORCH_CHECK(err == cudaSuccess, "cudaHostGetDevicePointer failed (", cudaGetErrorString(err),
              "): the shadow is not pinned; register it with cudaHostRegister first");
  auto opts = host.options().device(torch::kCUDA, c10::cuda::current_device());
  return torch::from_blob(dptr, host.sizes(), host.strides(), [](void*) {}, opts);
}

void gather_pages(torch::Tensor src, torch::Tensor ids, torch::Tensor heads, torch::Tensor out, int64_t sub_blocks) {
  TORCH_CHECK(src.is_cuda() && out.is_cuda() && ids.is_cuda() && heads.is_cuda(), "gather_pages: CUDA tensors expected");
  TORCH_CHECK(src.dim() == 5 && src.is_contiguous() && out.is_contiguous(), "gather_pages: contiguous [E, H, 2, m*16, D] source");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && heads.scalar_type() == torch::kInt64, "gather_pages: int64 ids/heads");
  const int64_t n = ids.numel();
  if (n == 0) return;
  const int64_t H = src.size(1), D = src.size(4);
  const int64_t page_bytes = 16 * D * src.element_size();
  TORCH_CHECK(page_bytes % 16 == 0, "gather_pages: 16*D*itemsize must be a multiple of 16");
  const c10::cuda::CUDAGuard guard(out.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  dim3 grid(static_cast<unsigned>(n), 2);
  gather_pages_kernel<<<grid, 128, 0, stream>>>(
      reinterpret_cast<const uint4*>(src.data_ptr()), reinterpret_cast<uint4*>(out.data_ptr()),
      ids.data_ptr<int64_t>(), heads.data_ptr<int64_t>(), H, sub_blocks, page_bytes / 16);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_view", &device_view, "CUDA tensor aliasing a pinned host tensor");
  m.def("gather_pages", &gather_pages, "gather (block, head) shadow pages into a device buffer");
}
