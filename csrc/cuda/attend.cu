// The torch bindings of the attend pass and the promotion pass (attend_kernel.cuh and promote_kernel.cuh have the
// kernels and their documentation): argument checks and the dispatch over head dims to the per-dimension units
// (attend_d64.cu, attend_d128.cu, attend_d256.cu).
#include "attend_kernel.cuh"
#include "promote_kernel.cuh"

namespace certvllm {

// Launch the attend pass; cudaErrorInvalidValue for a (D, GP, warps) that is not compiled.
cudaError_t launch_attend(const AttendArgs& a, int rows_heads, int D, int GP, int warps, cudaStream_t stream) {
  switch (D) {
    case 64: return launch_attend_dim<64>(a, rows_heads, GP, warps, stream);
    case 128: return launch_attend_dim<128>(a, rows_heads, GP, warps, stream);
    case 256: return launch_attend_dim<256>(a, rows_heads, GP, warps, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Launch the promotion pass; cudaErrorInvalidValue for a (D, GP, warps) that is not compiled.
cudaError_t launch_promote(const PromoteArgs& a, int rows_heads, int D, int GP, int warps, cudaStream_t stream) {
  switch (D) {
    case 64: return launch_promote_dim<64>(a, rows_heads, GP, warps, stream);
    case 128: return launch_promote_dim<128>(a, rows_heads, GP, warps, stream);
    case 256: return launch_promote_dim<256>(a, rows_heads, GP, warps, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace certvllm

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == dtype, "certvllm attend: ", name,
              " must be a contiguous CUDA tensor of ", dtype, ", got ", t.scalar_type(),
              t.is_cuda() ? "" : " on the CPU", t.is_contiguous() ? "" : " (not contiguous)");
}

// The split-K fields AttendArgs and PromoteArgs share: the block table, lengths, bitmask, active groups and the plan.
void set_split_args(certvllm::SplitArgs& a, const torch::Tensor& tables, const torch::Tensor& nfull, const torch::Tensor& bits,
                    const torch::Tensor& active, int64_t num_blocks, int64_t splits, int64_t blocks_per_split,
                    int64_t kv_heads, int64_t group, int64_t sub_blocks) {
  a.tables = tables.data_ptr<int64_t>();
  a.nfull = nfull.data_ptr<int64_t>();
  a.bits = bits.data_ptr<int32_t>();
  a.active = active.data_ptr<int32_t>();
  a.num_blocks = num_blocks;
  a.B = tables.size(1);
  a.tb_stride = tables.stride(0);
  a.S = static_cast<int>(splits);
  a.BPS = static_cast<int>(blocks_per_split);
  a.H = static_cast<int>(kv_heads);
  a.G = static_cast<int>(group);
  a.M = static_cast<int>(sub_blocks);
}

// The smallest power of two >= x (the compiled query-head group sizes).
int64_t pow2_at_least(int64_t x) {
  return x <= 1 ? 1 : int64_t(1) << (64 - __builtin_clzll(static_cast<uint64_t>(x - 1)));
}

// Python: attend(scores, mmax, shadow_ptr, shadow_bf16, pages, tables, nfull, bits, active, acc, den, aval,
// atail, exact_lm, num_blocks, splits, blocks_per_split, kv_heads, group, sub_blocks, value_group, page_bytes,
// v_codes, header, warps)
void attend(torch::Tensor scores, torch::Tensor mmax, int64_t shadow_ptr, bool shadow_bf16, torch::Tensor pages,
            torch::Tensor tables, torch::Tensor nfull, torch::Tensor bits, torch::Tensor active, torch::Tensor acc,
            torch::Tensor den, torch::Tensor aval, torch::Tensor atail, torch::Tensor exact_lm, int64_t num_blocks,
            int64_t splits, int64_t blocks_per_split, int64_t kv_heads, int64_t group, int64_t sub_blocks,
            int64_t value_group, int64_t page_bytes, int64_t v_codes, int64_t header, int64_t warps) {
  check(scores, "scores", torch::kFloat32);
  check(mmax, "mmax", torch::kFloat32);
  check(pages, "pages", torch::kUInt8);
  check(nfull, "nfull", torch::kInt64);
  check(bits, "bits", torch::kInt32);
  check(active, "active", torch::kInt32);
  check(acc, "acc", torch::kFloat64);
  check(den, "den", torch::kFloat64);
  check(aval, "aval", torch::kFloat64);
  check(atail, "atail", torch::kFloat64);
  check(exact_lm, "exact_lm", torch::kFloat32);
  TORCH_CHECK(tables.is_cuda() && tables.scalar_type() == torch::kInt64 && tables.dim() == 2 && tables.stride(1) == 1,
              "certvllm attend: tables must be a CUDA int64 [R, B] tensor with unit column stride");
  TORCH_CHECK(scores.dim() == 5 && scores.size(4) == certvllm::kTokens, "certvllm attend: scores must be [R, H, B, G, 16]");
  const int64_t R = scores.size(0), D = acc.size(4);
  const int64_t gp = pow2_at_least(group);
  TORCH_CHECK(certvllm::attend_cpl(static_cast<int>(D), static_cast<int>(gp)) > 0,
              "certvllm attend: head dim ", D, " with ", group, " query heads per KV head is not compiled");
  c10::cuda::CUDAGuard guard(scores.device());
  certvllm::AttendArgs a{};
  a.scores = scores.data_ptr<float>();
  a.mmax = mmax.data_ptr<float>();
  a.shadow = reinterpret_cast<const void*>(shadow_ptr);
  a.pages = pages.data_ptr<uint8_t>();
  set_split_args(a, tables, nfull, bits, active, num_blocks, splits, blocks_per_split, kv_heads, group, sub_blocks);
  a.acc = acc.data_ptr<double>();
  a.den = den.data_ptr<double>();
  a.aval = aval.data_ptr<double>();
  a.atail = atail.data_ptr<double>();
  a.exact_lm = exact_lm.data_ptr<float>();
  TORCH_CHECK(value_group == certvllm::kGroup, "certvllm attend: value group ", value_group, " is not compiled (",
              certvllm::kGroup, " is)");
  TORCH_CHECK(num_blocks > 0 && num_blocks < (int64_t(1) << 31), "certvllm attend: ", num_blocks,
              " blocks do not fit the kernel's int32 block ids");
  a.page_bytes = static_cast<int>(page_bytes);
  a.v_codes = static_cast<int>(v_codes);
  a.header = static_cast<int>(header);
  a.shadow_bf16 = shadow_bf16 ? 1 : 0;
  TORCH_CHECK(bits.size(2) == a.B, "certvllm attend: bits must have the table's ", a.B, " columns");
  const cudaError_t err = certvllm::launch_attend(a, static_cast<int>(R * kv_heads), static_cast<int>(D),
                                                  static_cast<int>(gp), static_cast<int>(warps),
                                                  at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "certvllm attend: launch failed: ", cudaGetErrorString(err));
}

// Python: promote(qs, shadow_ptr, shadow_bf16, pool, stage, kslot, nslots, tables, nfull, bits, active, scores, m8,
// delta, round1, canary, smax, sabs, num_blocks, splits, blocks_per_split, kv_heads, group, sub_blocks,
// run_canary, warps). pool, stage and kslot may be None (every key page from the shadow).
void promote(torch::Tensor qs, int64_t shadow_ptr, bool shadow_bf16, c10::optional<torch::Tensor> pool,
             c10::optional<torch::Tensor> stage, c10::optional<torch::Tensor> kslot, int64_t nslots,
             torch::Tensor tables, torch::Tensor nfull, torch::Tensor bits, torch::Tensor active, torch::Tensor scores,
             torch::Tensor m8, torch::Tensor delta, torch::Tensor round1, torch::Tensor canary, torch::Tensor smax,
             torch::Tensor sabs, int64_t num_blocks, int64_t splits, int64_t blocks_per_split, int64_t kv_heads,
             int64_t group, int64_t sub_blocks, bool run_canary, int64_t warps) {
  check(qs, "qs", torch::kFloat32);
  check(nfull, "nfull", torch::kInt64);
  check(bits, "bits", torch::kInt32);
  check(active, "active", torch::kInt32);
  check(scores, "scores", torch::kFloat32);
  check(m8, "m8", torch::kFloat32);
  check(delta, "delta", torch::kFloat32);
  check(round1, "round1", torch::kFloat32);
  check(canary, "canary", torch::kInt32);
  check(smax, "smax", torch::kFloat32);
  check(sabs, "sabs", torch::kFloat32);
  TORCH_CHECK(tables.is_cuda() && tables.scalar_type() == torch::kInt64 && tables.dim() == 2 && tables.stride(1) == 1,
              "certvllm promote: tables must be a CUDA int64 [R, B] tensor with unit column stride");
  TORCH_CHECK(scores.dim() == 5 && scores.size(4) == certvllm::kTokens, "certvllm promote: scores must be [R, H, B, G, 16]");
  TORCH_CHECK(num_blocks > 0 && num_blocks < (int64_t(1) << 31), "certvllm promote: ", num_blocks,
              " blocks do not fit the kernel's int32 block ids");
  const int64_t R = qs.size(0), D = qs.size(2);
  c10::cuda::CUDAGuard guard(qs.device());
  certvllm::PromoteArgs a{};
  a.qs = qs.data_ptr<float>();
  a.shadow = reinterpret_cast<const void*>(shadow_ptr);
  const auto key_pages = [&](const c10::optional<torch::Tensor>& t, const char* name) -> const void* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->element_size() == 2 && t->dim() == 3 &&
                    t->size(1) == certvllm::kTokens && t->size(2) == D,
                "certvllm promote: ", name, " must be contiguous CUDA [P, 16, ", D, "] 16-bit key pages");
    return t->data_ptr();
  };
  a.pool = key_pages(pool, "pool");
  a.stage = stage.has_value() ? key_pages(stage, "stage") : a.pool;
  if (kslot.has_value()) {
    check(*kslot, "kslot", torch::kInt32);
    TORCH_CHECK(a.pool != nullptr, "certvllm promote: a slot map needs the pool");
    a.kslot = kslot->data_ptr<int32_t>();
  }
  a.nslots = nslots;
  set_split_args(a, tables, nfull, bits, active, num_blocks, splits, blocks_per_split, kv_heads, group, sub_blocks);
  a.scores = scores.data_ptr<float>();
  a.m8 = m8.data_ptr<float>();
  a.delta = delta.data_ptr<float>();
  a.round1 = round1.data_ptr<float>();
  a.canary = canary.data_ptr<int32_t>();
  a.smax = smax.data_ptr<float>();
  a.sabs = sabs.data_ptr<float>();
  a.canary_on = run_canary ? 1 : 0;
  a.shadow_bf16 = shadow_bf16 ? 1 : 0;
  TORCH_CHECK(bits.size(2) == a.B, "certvllm promote: bits must have the table's ", a.B, " columns");
  const cudaError_t err = certvllm::launch_promote(a, static_cast<int>(R * kv_heads), static_cast<int>(D),
                                                   static_cast<int>(pow2_at_least(group)), static_cast<int>(warps),
                                                   at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "certvllm promote: launch failed: ", cudaGetErrorString(err));
}

// The device address of ptr: pinned or registered host memory (unified addressing), or device memory as it is.
int64_t device_pointer(int64_t ptr) {
  cudaPointerAttributes attr{};
  void* p = reinterpret_cast<void*>(ptr);
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return ptr;
  }
  return attr.devicePointer != nullptr ? reinterpret_cast<int64_t>(attr.devicePointer) : ptr;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "the certified attend pass (CUDA)");
  m.def("promote", &promote, "the certified promotion pass (CUDA)");
  m.def("device_pointer", &device_pointer, "the device address of a host or device pointer");
}
