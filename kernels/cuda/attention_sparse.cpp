// Host side of the CUDA sparse kernels: the index's device layout, its upload (plan step) and the
// backend-neutral entry point that takes a host SparseIndex. Plain C++20 (the index header uses
// std::span); the launches are in cuda_ops.cu.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/sparse_index.h"

namespace sf::kernels::cuda {
namespace {

// int32 element offsets of the four arrays in one allocation.
struct IndexLayout {
  size_t bc = 0, bo = 0, cc = 0, ci = 0, total = 0;
};
IndexLayout index_layout(const SparseIndex& idx) {
  const size_t slots = size_t(idx.n_heads) * size_t(idx.n_qblocks);
  IndexLayout l;
  l.bo = l.bc + slots;
  l.cc = l.bo + slots * size_t(idx.max_blocks);
  l.ci = l.cc + slots;
  l.total = l.ci + slots * size_t(idx.max_cols);
  return l;
}
SparseIndexDevice index_view(const SparseIndex& idx, const int32_t* base) {
  const IndexLayout l = index_layout(idx);
  SparseIndexDevice d;
  d.block_count = base + l.bc;
  d.block_offset = base + l.bo;
  d.column_count = base + l.cc;
  d.column_index = base + l.ci;
  d.n_heads = idx.n_heads;
  d.n_q = idx.n_q;
  d.n_k = idx.n_k;
  d.q_offset = idx.q_offset;
  d.n_qblocks = idx.n_qblocks;
  d.max_blocks = idx.max_blocks;
  d.max_cols = idx.max_cols;
  // Linear in the slots; index_view runs at plan time (upload) or beside a synchronous copy.
  d.pair_heads = idx.n_heads % 2 == 0;
  for (int h = 0; d.pair_heads && h < idx.n_heads; h += 2)
    for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) {
      const size_t a = idx.slot(h, qb), b = idx.slot(h + 1, qb);
      if (idx.block_count[a] != idx.block_count[b] || idx.column_count[a] != 0 ||
          idx.column_count[b] != 0) {
        d.pair_heads = false;
        break;
      }
    }
  return d;
}
Status index_sizes_ok(const SparseIndex& idx) {
  const size_t slots = size_t(idx.n_heads) * size_t(idx.n_qblocks);
  if (idx.block_count.size() != slots || idx.column_count.size() != slots ||
      idx.block_offset.size() != slots * size_t(idx.max_blocks) ||
      idx.column_index.size() != slots * size_t(idx.max_cols))
    return SF_ERR(kInvalidArgument, "attention_sparse: index arrays do not match its geometry");
  return Status::ok();
}

}  // namespace

Status sparse_index_upload(const SparseIndex& idx, DeviceBuffer* storage, SparseIndexDevice* view) {
  SF_TRY(index_sizes_ok(idx));
  const IndexLayout l = index_layout(idx);
  if (storage->size() < l.total * sizeof(int32_t))
    SF_TRY(storage->alloc(l.total * sizeof(int32_t)));
  SF_TRY(storage->upload(idx.block_count.data(), idx.block_count.size() * 4, l.bc * 4));
  SF_TRY(storage->upload(idx.block_offset.data(), idx.block_offset.size() * 4, l.bo * 4));
  SF_TRY(storage->upload(idx.column_count.data(), idx.column_count.size() * 4, l.cc * 4));
  SF_TRY(storage->upload(idx.column_index.data(), idx.column_index.size() * 4, l.ci * 4));
  *view = index_view(idx, storage->as<int32_t>());
  return Status::ok();
}

Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndex& idx, TensorView out, TensorView lse,
                        const AttentionParams& p, void* stream) {
  if (!attention_sparse_supported(int(q.shape[2])))
    return SF_ERR(kUnsupported, "attention_sparse: head_dim " + std::to_string(q.shape[2]) +
                                    " (CUDA supports 64, 128)");
  SF_TRY(index_sizes_ok(idx));
  const IndexLayout l = index_layout(idx);
  if (l.total == 0) return Status::ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  void* dev = nullptr;
  SF_CUDA_TRY(cudaMallocAsync(&dev, l.total * sizeof(int32_t), s));
  int32_t* base = static_cast<int32_t*>(dev);
  cudaError_t err = cudaSuccess;
  const auto copy = [&](const std::vector<int32_t>& src, size_t at) {
    if (err == cudaSuccess && !src.empty())
      err = cudaMemcpyAsync(base + at, src.data(), src.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice, s);
  };
  copy(idx.block_count, l.bc);
  copy(idx.block_offset, l.bo);
  copy(idx.column_count, l.cc);
  copy(idx.column_index, l.ci);
  Status st = err == cudaSuccess
                  ? Status::ok()
                  : cuda_status(err, "attention_sparse: index upload", __FILE__, __LINE__);
  if (st.is_ok()) st = attention_sparse(q, k, v, index_view(idx, base), out, lse, p, stream);
  // Freed in stream order after the kernel; the first error is the one reported.
  const cudaError_t free_err = cudaFreeAsync(dev, s);
  if (st.is_ok()) SF_CUDA_TRY(free_err);
  return st;
}

}  // namespace sf::kernels::cuda
