// The attend kernels of head dim 128 (attend_kernel.cuh), one translation unit so that the dimensions compile in
// parallel.
#include "attend_kernel.cuh"

namespace certvllm {
CERTVLLM_ATTEND_DIM(128)
}  // namespace certvllm
