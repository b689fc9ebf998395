// One head dim per translation unit (caps nvcc time per file; see dispatch.h).
#include "kernels/cuda/attention_sparse_bf16.cuh"

namespace sf::kernels::cuda {
template cudaError_t attention_sparse_bf16_launch<64>(const AttentionSparseBf16Params&,
                                                      cudaStream_t);
}  // namespace sf::kernels::cuda
