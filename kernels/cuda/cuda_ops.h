// CUDA backend of kernels/api.h. Plain C++ (no CUDA types) so .cpp callers build with g++; every
// op takes the cudaStream_t as `void* stream`, enqueues work and returns without waiting for the
// device. Shapes and dtypes were validated by api.cpp; what is checked here is what only this
// backend restricts (head dims, dtype combinations). Asynchronous kernel faults surface at the
// caller's next synchronizing call, as with any CUDA library.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/api.h"
#include "kernels/decode_attention.h"
#include "kernels/kv_importance.h"

namespace sf::kernels {
struct SparseIndex;  // kernels/sparse_index.h (C++20; this header is also read by nvcc as C++17)
}  // namespace sf::kernels

namespace sf::kernels::cuda {

// ids must be in [0, vocab): checking them on the device would need a sync; a row whose id is
// out of range is written as NaN so the violation shows downstream instead of reading wild memory.
Status embedding(const TensorView& table, const int32_t* ids, int64_t n, TensorView out,
                 void* stream);
Status rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out, void* stream);
// positions: device pointer. p.freq_factors: host pointer, read during this call only.
Status rope(TensorView x, const int32_t* positions, const RopeParams& p, void* stream);
Status swiglu(const TensorView& gate, const TensorView& up, TensorView out, void* stream);
Status add_inplace(TensorView out, const TensorView& x, void* stream);
// cuBLASLt; x and w both F32, F16 or BF16, y and bias F32; fp32 accumulation (no TF32).
Status linear(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y,
              void* stream);
// One row (api.cpp checked x [1, in], w F32 or BF16): a warp per output row, 8 rows a CTA,
// 16-byte loads of w where rows are 16-byte aligned; no cuBLASLt, no workspace, no plan;
// capture-safe.
Status gemv(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y,
            void* stream);
// gemv() of 1..kGemvMaxParts weights in one grid (each part's outputs as gemv() gives them), and
// the gate/up pair with the SwiGLU epilogue (as gemv() twice and swiglu()).
Status gemv_parts(const TensorView& x, const GemvPart* parts, int n_parts, void* stream);
Status gemv_swiglu(const TensorView& x, const TensorView& w_gate, const TensorView& w_up,
                   TensorView y, void* stream);
// add_inplace() and rms_norm() in one CTA per row, each thread on the same elements as theirs.
Status add_rms_norm(TensorView x, const TensorView& delta, const TensorView& w, float eps,
                    TensorView out, void* stream);
// F32 <-> F16/BF16 or a same-dtype copy (api.cpp checked the pair); round to nearest even.
Status cast(const TensorView& x, TensorView out, void* stream);
// The plan step of linear(): creates this thread's cuBLASLt handle and workspace on the current
// device (once) and picks the algorithm for this shape (once per shape). linear() plans lazily on
// first use of a shape; call this ahead of CUDA graph capture or timed regions, where the
// one-time cudaMalloc must not happen.
Status linear_plan(const TensorView& x, const TensorView& w, const TensorView& bias,
                   const TensorView& y);
// F32 q/k/v/out: our flash-style fp32 reference kernel, head_dim 64 or 128
// (attention_dense_supported), any q_offset. BF16 q/k/v/out: cuDNN's fused flash attention
// (attention_cudnn.cpp; fp32 softmax and accumulation), head_dim a multiple of 8 up to 256, causal
// q_offset 0 or n_k - n_q; kUnsupported when built without cuDNN. lse F32 [heads, n_q] either way.
Status attention_dense(const TensorView& q, const TensorView& k, const TensorView& v,
                       TensorView out, TensorView lse, const AttentionParams& p, void* stream);
bool attention_dense_supported(int head_dim);
// The BF16 path's plan step: this thread's cuDNN handle (once) and, per shape, the built graph
// and its workspace (once). attention_dense plans lazily on a shape's first use; call this ahead
// of CUDA graph capture or timed regions.
Status attention_dense_plan(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const AttentionParams& p);
// Ok when the BF16 dense path can run in this build (cuDNN linked, version >= 9.0); otherwise
// kUnsupported saying what is missing.
Status attention_dense_bf16_available();
Status attention_dense_cudnn(const TensorView& q, const TensorView& k, const TensorView& v,
                             TensorView out, TensorView lse, const AttentionParams& p,
                             void* stream);

// ---- sparse attention over the unified index (attention_sparse.cuh) --------------------------
class DeviceBuffer;
// The index's four arrays in device memory, laid out as in SparseIndex (slot = h * n_qblocks +
// qb). Plain pointers: a device estimator can build one in place.
struct SparseIndexDevice {
  const int32_t* block_count = nullptr;
  const int32_t* block_offset = nullptr;
  const int32_t* column_count = nullptr;
  const int32_t* column_index = nullptr;
  int n_heads = 0;
  int64_t n_q = 0, n_k = 0, q_offset = 0, n_qblocks = 0;
  int max_blocks = 0, max_cols = 0;
  // Plan-time: in every slot, query heads 2j and 2j + 1 hold equally many key blocks and no
  // gathered columns (block-sparse top-k with one budget, a dense index). The bf16 kernel's
  // default mainloop then pairs them on shared tiles (SparseBf16Mainloop).
  bool pair_heads = false;
};
// Plan step: copies a host index into *storage (reallocated to fit) and points *view at it.
// Synchronous; the index must already be valid (sparse_index_validate), the kernel trusts it.
Status sparse_index_upload(const SparseIndex& idx, DeviceBuffer* storage, SparseIndexDevice* view);
// Run step: no allocation, no host synchronization, safe under CUDA graph capture. q, k, v, out
// contiguous and 16-byte aligned, all F32 (CUDA-core fp32 kernel, the reference) or all BF16
// (tensor-core kernel, fp32 accumulation and softmax); lse F32. Geometry must match idx.
Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndexDevice& idx, TensorView out, TensorView lse,
                        const AttentionParams& p, void* stream);
// From a host index (the backend-neutral API, kernels/sparse.h): a stream-ordered device copy of
// the index (cudaMallocAsync + copies from pageable memory, which return once the host data has
// been staged), the launch, then cudaFreeAsync. Not capturable; use the two steps above there.
Status attention_sparse(const TensorView& q, const TensorView& k, const TensorView& v,
                        const SparseIndex& idx, TensorView out, TensorView lse,
                        const AttentionParams& p, void* stream);
bool attention_sparse_supported(int head_dim);
// The BF16 kernel's mainloop. kWgmmaWs (the default): Hopper warpgroup MMA, warp-specialized (a
// producer warpgroup copies for two consumer warpgroups; attention_sparse_bf16_ws.cuh), at
// head_dim 128; head_dim 64 runs kWgmma under this name. Where SparseIndexDevice::pair_heads
// holds and the query heads of a KV head come in pairs, its two consumers take two of them at one
// query block on one pipe (a block tile both hold copied once); otherwise two query blocks of one
// head. kWgmmaWsPair pairs whenever the heads come in pairs; kWgmmaWsSingle never pairs. kWgmma:
// the same products and softmax, one warpgroup that also copies (attention_sparse_bf16_sm90.cuh).
// kMmaSync: the FlashAttention-2-style mma.sync kernel (attention_sparse_bf16.cuh). All but the
// default stay for tests and A/B benchmarks. Process-wide; read at each launch.
enum class SparseBf16Mainloop : int {
  kWgmma = 0,
  kMmaSync = 1,
  kWgmmaWs = 2,
  kWgmmaWsPair = 3,
  kWgmmaWsSingle = 4
};
void set_sparse_bf16_mainloop(SparseBf16Mainloop m);
SparseBf16Mainloop sparse_bf16_mainloop();
const char* sparse_bf16_mainloop_name(SparseBf16Mainloop m);
// By name ("wgmma-ws", "wgmma-ws-pair", "wgmma-ws-single", "wgmma", "mma.sync"); false for
// any other.
bool parse_sparse_bf16_mainloop(std::string_view name, SparseBf16Mainloop* m);

// ---- Paged decode attention (decode_attention.cu) --------------------------------------------
// kernels/decode_attention.h on device pointers (pool, pointers and eps validated there; head_dim
// and the workspace size here).
size_t paged_decode_workspace_bytes(int n_heads, const PagedKv& kv, const PagedDecodeParams& p);
bool paged_decode_staged(int n_heads, const PagedKv& kv, const PagedDecodeParams& p);
Status paged_decode_attention(const float* q, int n_heads, const PagedKv& kv,
                              const PagedDecodeParams& p, float* out, int32_t* visited,
                              void* workspace, size_t workspace_bytes, void* stream);
Status paged_append(const PagedKv& kv, const float* k_new, const float* v_new, int n_tokens,
                    void* stream);
size_t paged_snapshot_bytes(const PagedKv& kv);
// save: the pool's append state into snap; else snap's back into the pool.
Status paged_snapshot(const PagedKv& kv, void* snap, bool save, void* stream);

// ---- KV importance (kv_importance.cu) --------------------------------------------------------
// kernels/kv_importance.h on device tensors (validated there): F32 q, lse, out, F32 or BF16 k;
// pool <= 65, head_dim a multiple of 8 up to 256, q and k 16-byte aligned (else kUnsupported).
// No allocation, no host synchronization.
Status kv_importance(const TensorView& q, const TensorView& k, const TensorView& lse,
                     const ImportanceParams& p, TensorView out, void* stream);

// ---- device helpers (tests, tools) -----------------------------------------------------------
// Deterministic synthetic data: out ([rows, cols] contiguous, F32 or BF16; 1-D counts as one
// column) = mean + stdv * N(0, 1), where element (r, c) is drawn from a hash of seed and its
// position (row0 + r) * ld + col0 + c in a notional [*, ld] whole. A window therefore equals the
// same part of the whole filled with the same seed (tensor-parallel slices of a synthetic model).
struct FillNormal {
  uint64_t seed = 0;
  float mean = 0.f, stdv = 1.f;
  int64_t ld = 0;  // 0: out's own column count
  int64_t row0 = 0, col0 = 0;
};
Status fill_normal(TensorView out, const FillNormal& f, void* stream);
// Number of visible CUDA devices; an error (not 0) when there is no driver.
Status device_count(int* n);
// Waits for `stream` (nullptr: the legacy default stream) and reports any asynchronous error.
Status stream_synchronize(void* stream);
// Programmatic dependent launch of the elementwise kernels (prefill's too), the GEMVs, the paged
// append, decode attention and its merge (kernels/cuda/dependent_launch.cuh). On unless the
// environment holds SF_PDL=0 (exactly "0") at first use; set_dependent_launch() overrides it
// for later launches (a benchmark's A/B). A CUDA graph keeps what was on when it was captured.
bool dependent_launch();
void set_dependent_launch(bool on);

// Owning device allocation. Copies are synchronous (complete on return, ordered after work on
// the legacy default stream): for tests and setup, not for run paths.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  Status alloc(size_t bytes);  // frees any previous allocation first
  void reset();
  Status upload(const void* src, size_t bytes, size_t offset = 0);
  Status download(void* dst, size_t bytes, size_t offset = 0) const;

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace sf::kernels::cuda
