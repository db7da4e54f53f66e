// The attend and promotion kernels of head dim 256 (attend_kernel.cuh, promote_kernel.cuh), one translation unit so
// that the dimensions compile in parallel.
#include "attend_kernel.cuh"
#include "promote_kernel.cuh"

namespace certvllm {
CERTVLLM_ATTEND_DIM(256)
CERTVLLM_PROMOTE_DIM(256)
}  // namespace certvllm
