// One head dim per translation unit (caps nvcc time per file; see dispatch.h).
#include "kernels/cuda/attention_sparse.cuh"

namespace sf::kernels::cuda {
template cudaError_t attention_sparse_launch<64>(const AttentionSparseParams &, cudaStream_t);
}  // namespace sf::kernels::cuda
