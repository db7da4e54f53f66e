// The attend kernels of head dim 256 (attend_kernel.cuh), one translation unit so that the dimensions compile in
// parallel.
#include "attend_kernel.cuh"

namespace certvllm {
CERTVLLM_ATTEND_DIM(256)
}  // namespace certvllm
