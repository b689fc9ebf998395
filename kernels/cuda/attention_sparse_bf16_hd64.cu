// One head dim per translation unit (caps nvcc time per file; see dispatch.h). All three mainloops.
#include "kernels/cuda/attention_sparse_bf16_launch.cuh"

namespace sf::kernels::cuda {
template cudaError_t attention_sparse_bf16_launch<64>(const AttentionSparseBf16Params&,
                                                      SparseBf16Mainloop, cudaStream_t);
}  // namespace sf::kernels::cuda
