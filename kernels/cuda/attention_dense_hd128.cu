// One head dim per translation unit (caps nvcc time per file; see dispatch.h).
#include "kernels/cuda/attention_dense.cuh"

namespace sf::kernels::cuda {
template cudaError_t attention_dense_launch<128>(const AttentionDenseParams&, cudaStream_t);
}  // namespace sf::kernels::cuda
