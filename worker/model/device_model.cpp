// DeviceModel and DevicePrefill (see device_model.h): weights upload, the plan step (streams,
// events, workspace, GEMM algorithms) and the run step (enqueue only, one wait at the end).
#include "worker/model/device_model.h"

#include <algorithm>
#include <atomic>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#if SF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/hash.h"
#include "common/log.h"
#include "common/text.h"
#include "common/thread_pool.h"
#include "common/timing.h"
#include "kernels/api.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/sparse_estimate.h"
#include "kernels/kv_importance.h"
#include "worker/model/kv_sizer.h"
#include "worker/model/sparse_config.h"
#endif

namespace sf::model {

#if SF_HAVE_CUDA
namespace {

using kernels::cuda::DeviceBuffer;
using Clock = std::chrono::steady_clock;

TensorView dview(void* p, DType t, std::initializer_list<int64_t> dims) {
  return TensorView::make(p, t, dims, Device::kCuda);
}

// A weight on the device: its buffer and the view the kernels read (view.data is null when the
// model has no such tensor, e.g. biases of Llama; kernels treat that as "none").
struct DevTensor {
  DeviceBuffer buf;
  TensorView view;
};

// The part of a [rows, cols] weight (1-D: [n, 1]) a TP slice holds.
struct Part {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
};

// One weight of the device model: where it goes, its dtype, its unsliced shape, the slice's
// part, and how a synthetic model draws it.
struct WeightSpec {
  const char* name;
  DevTensor* dst;
  DType dtype;
  int64_t R = 0, C = 1;  // unsliced shape; C == 1 with one_d
  bool one_d = false;
  Part part;
  float mean = 0.f, stdv = 1.f;  // synthetic
  uint64_t tag = 0;              // synthetic: which tensor (the hash's seed)
  const OwnedTensor* host = nullptr;
};

Status set_view(const WeightSpec& w, DevTensor* out) {
  TensorView v;
  v.data = out->buf.data();
  v.dtype = w.dtype;
  v.device = Device::kCuda;
  v.ndim = w.one_d ? 1 : 2;
  v.shape[0] = w.part.rows;
  v.stride[0] = w.one_d ? 1 : w.part.cols;
  if (!w.one_d) {
    v.shape[1] = w.part.cols;
    v.stride[1] = 1;
  }
  out->view = v;
  return Status::ok();
}

// From the host model: the slice's part, converted to the device dtype, uploaded.
Status upload_part(const WeightSpec& w) {
  const OwnedTensor& t = *w.host;
  if (t.empty()) return Status::ok();
  SF_ENSURE(!t.shape.empty() && t.shape.size() <= 2, kInvalidArgument,
            std::string("device upload: tensor ") + w.name + " must be 1-D or 2-D");
  const int64_t R = t.shape[0], C = t.shape.size() == 2 ? t.shape[1] : 1;
  SF_ENSURE(R == w.R && C == w.C && int64_t(t.data.size()) == R * C, kInvalidArgument,
            std::string("device upload: tensor ") + w.name + " has shape " + std::to_string(R) +
                "x" + std::to_string(C) + ", the config implies " + std::to_string(w.R) + "x" +
                std::to_string(w.C));
  const Part& p = w.part;
  const size_t n = size_t(p.rows * p.cols);
  std::vector<float> f32;
  std::vector<uint16_t> half;
  if (w.dtype == DType::kF32)
    f32.resize(n);
  else
    half.resize(n);
  const float* src = t.data.data();
  parallel_for(
      size_t(p.rows),
      [&](size_t b, size_t e) {
        for (size_t r = b; r < e; ++r) {
          const float* row = src + (int64_t(r) + p.row0) * C + p.col0;
          const size_t o = r * size_t(p.cols);
          for (int64_t c = 0; c < p.cols; ++c) {
            if (w.dtype == DType::kF32)
              f32[o + size_t(c)] = row[c];
            else
              half[o + size_t(c)] = f32_to_bf16(row[c]);
          }
        }
      },
      std::max<size_t>(1, (size_t(1) << 16) / size_t(std::max<int64_t>(p.cols, 1))));
  SF_TRY(w.dst->buf.alloc(n * dtype_size(w.dtype)));
  SF_TRY(w.dst->buf.upload(w.dtype == DType::kF32 ? static_cast<const void*>(f32.data())
                                                  : static_cast<const void*>(half.data()),
                           n * dtype_size(w.dtype)));
  return set_view(w, w.dst);
}

// Synthetic: drawn on the device (kernels::cuda::fill_normal), positions in the unsliced tensor.
Status fill_part(const WeightSpec& w) {
  const Part& p = w.part;
  SF_TRY(w.dst->buf.alloc(size_t(p.rows * p.cols) * dtype_size(w.dtype)));
  SF_TRY(set_view(w, w.dst));
  kernels::cuda::FillNormal f;
  f.seed = w.tag;
  f.mean = w.mean;
  f.stdv = w.stdv;
  f.ld = w.C;
  f.row0 = p.row0;
  f.col0 = p.col0;
  return kernels::cuda::fill_normal(w.dst->view, f, nullptr);
}


// RAII over the runtime's handles. Destructors cannot report; a failure there resurfaces at the
// next runtime call, as with DeviceBuffer.
class CudaStream {
 public:
  CudaStream() = default;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream() {
    if (s_) (void)cudaStreamDestroy(s_);
  }
  // Non-blocking: no implicit ordering with the legacy default stream, whose synchronous copies
  // (DeviceBuffer::upload) complete before they return anyway.
  Status create() {
    SF_CUDA_TRY(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    return Status::ok();
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  CudaEvent(CudaEvent&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  CudaEvent& operator=(CudaEvent&&) = delete;
  CudaEvent(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (e_) (void)cudaEventDestroy(e_);
  }
  // Ordering-only events skip timestamps (cheaper to record and to wait on).
  Status create(bool timing) {
    SF_CUDA_TRY(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
    return Status::ok();
  }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Page-locked host memory: device-to-host copies into it are truly asynchronous (into pageable
// memory the runtime stages them and blocks the calling thread).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) {
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(p_, o.p_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }
  ~PinnedBuffer() { reset(); }
  void reset() {
    if (p_) (void)cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  Status alloc(size_t bytes) {
    reset();
    if (bytes == 0) return Status::ok();
    SF_CUDA_TRY(cudaMallocHost(&p_, bytes));
    bytes_ = bytes;
    return Status::ok();
  }
  void* data() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Between streams: `waiter` does not start later work until `producer`'s work so far is done.
Status stream_after(cudaStream_t waiter, cudaStream_t producer, cudaEvent_t ev) {
  SF_CUDA_TRY(cudaEventRecord(ev, producer));
  SF_CUDA_TRY(cudaStreamWaitEvent(waiter, ev, 0));
  return Status::ok();
}

}  // namespace

// Spare buffers between plans, by role: a role is the buffer's place in DevicePrefill::Impl (its
// offset there), the same in every plan.
struct DeviceBufferCache::Impl {
  std::map<size_t, DeviceBuffer> device;
  std::map<size_t, PinnedBuffer> host;
  bool lent = false;  // a live plan draws on it (one at a time)
  int device_ordinal = -1;  // where its device buffers live
};

DeviceBufferCache::DeviceBufferCache() : impl_(std::make_unique<Impl>()) {}
DeviceBufferCache::~DeviceBufferCache() = default;
namespace {
template <typename Spares>
size_t bytes_held(const Spares& m) {
  size_t n = 0;
  for (const auto& [role, b] : m) n += b.size();
  return n;
}
}  // namespace
size_t DeviceBufferCache::device_bytes_held() const { return bytes_held(impl_->device); }
size_t DeviceBufferCache::host_bytes_held() const { return bytes_held(impl_->host); }
void DeviceBufferCache::clear() {
  impl_->device.clear();
  impl_->host.clear();
}

struct DeviceModel::Impl {
  ModelConfig cfg;       // the slice's
  ModelConfig full_cfg;  // the whole model's
  TpSlice slice;
  DType wdt = DType::kBF16;
  int device = 0;
  std::string device_name;
  size_t bytes = 0;
  std::vector<float> rope_freqs;  // host: rope() reads the divisors while planning each launch
  struct Layer {
    DevTensor attn_norm, wq, wk, wv, bq, bk, bv, wo, ffn_norm, w_gate, w_up, w_down;
  };
  DevTensor tok_embd, out_norm, lm_head;  // lm_head.view may alias tok_embd (tied, F32)
  std::vector<Layer> layers;

  ~Impl() { (void)cudaSetDevice(device); }  // the buffers are freed on their own device

  // Sets the configs and the device, then puts every weight of the slice on it: copied from
  // `host`, or (host null) drawn synthetically from `seed`.
  Status build(const ModelConfig& c, DType weight_dtype, int dev, TpSlice sl, const Model* host,
               uint64_t seed);
};

Status DeviceModel::Impl::build(const ModelConfig& c, DType weight_dtype, int dev, TpSlice sl,
                                const Model* host, uint64_t seed) {
  SF_ENSURE(weight_dtype == DType::kBF16 || weight_dtype == DType::kF32, kUnsupported,
            std::string("device model: weight dtype ") + dtype_name(weight_dtype) +
                " (supported: BF16, F32)");
  SF_TRY(cuda_device_check(dev));
  SF_TRY(c.validate());
  SF_ENSURE(sl.ways >= 1 && sl.index >= 0 && sl.index < sl.ways, kInvalidArgument,
            "device model: TP slice " + std::to_string(sl.index) + " of " +
                std::to_string(sl.ways) + " does not exist");
  SF_ENSURE(c.n_kv_heads % sl.ways == 0 && c.intermediate % sl.ways == 0, kInvalidArgument,
            "device model: TP " + std::to_string(sl.ways) + " does not divide the model's " +
                std::to_string(c.n_kv_heads) + " KV heads and " + std::to_string(c.intermediate) +
                " intermediate size");
  SF_CUDA_TRY(cudaSetDevice(dev));
  cudaDeviceProp prop{};
  SF_CUDA_TRY(cudaGetDeviceProperties(&prop, dev));
  full_cfg = c;
  cfg = c;
  cfg.n_heads = c.n_heads / sl.ways;
  cfg.n_kv_heads = c.n_kv_heads / sl.ways;
  cfg.intermediate = c.intermediate / sl.ways;
  slice = sl;
  wdt = weight_dtype;
  device = dev;
  device_name = prop.name;
  if (host) {
    SF_TRY(check_host_weights(*host, "device upload"));  // (not "0 layers" for a shape-only one)
    const ModelWeights& w = host->weights();
    rope_freqs = w.rope_freqs.data;
    SF_ENSURE(w.layers.size() == size_t(c.n_layers), kInvalidArgument,
              "device upload: model has " + std::to_string(w.layers.size()) +
                  " layers, config says " + std::to_string(c.n_layers));
  }

  const int64_t H = c.hidden, d = c.head_dim, qd = int64_t(c.n_heads) * d,
                kvd = int64_t(c.n_kv_heads) * d, I = c.intermediate, V = c.vocab;
  const int64_t qd_t = qd / sl.ways, kvd_t = kvd / sl.ways, I_t = I / sl.ways;
  const int64_t q0 = qd_t * sl.index, kv0 = kvd_t * sl.index, i0 = I_t * sl.index;
  const DType f32 = DType::kF32, wd = weight_dtype;
  const float sH = 1.f / std::sqrt(float(H)), sQ = 1.f / std::sqrt(float(qd)),
              sI = 1.f / std::sqrt(float(I));
  std::vector<WeightSpec> specs;
  // tag: which tensor; kind < 16 per layer, globals after the layers.
  auto tag_of = [&](int64_t layer, int kind) {
    return splitmix64(seed ^ splitmix64(uint64_t(layer * 16 + kind)));
  };
  auto whole = [](int64_t R, int64_t C) { return Part{0, R, 0, C}; };
  auto rows = [](int64_t r0, int64_t n, int64_t C) { return Part{r0, n, 0, C}; };
  auto cols = [](int64_t R, int64_t c0, int64_t n) { return Part{0, R, c0, n}; };
  auto add = [&](const char* name, DevTensor* dst, DType t, int64_t R, int64_t C, bool one_d,
                 Part part, float mean, float stdv, uint64_t tag, const OwnedTensor* src) {
    WeightSpec w{name, dst, t, R, C, one_d, part, mean, stdv, tag, src};
    specs.push_back(w);
  };
  const ModelWeights* hw = host ? &host->weights() : nullptr;
  const int64_t G = c.n_layers;  // global tensors' layer id in the tag
  add("tok_embd", &tok_embd, f32, V, H, false, whole(V, H), 0.f, 1.f, tag_of(G, 0),
      hw ? &hw->tok_embd : nullptr);
  add("out_norm", &out_norm, f32, H, 1, true, whole(H, 1), 1.f, 0.1f, tag_of(G, 1),
      hw ? &hw->out_norm : nullptr);
  // Tied and F32: the embedding table serves as the head. Otherwise the head is its own copy (a
  // tied synthetic head draws the embedding's values: same tag).
  const bool tied = host ? hw->lm_head.empty() : c.tied_embeddings;
  if (!(tied && wd == f32))
    add("lm_head", &lm_head, wd, V, H, false, whole(V, H), 0.f, tied ? 1.f : sH,
        tag_of(G, tied ? 0 : 2), host ? &host->output_weight() : nullptr);
  layers.resize(size_t(c.n_layers));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    Layer& L = layers[size_t(l)];
    const LayerWeights* s = hw ? &hw->layers[size_t(l)] : nullptr;
    auto src = [&](const OwnedTensor LayerWeights::*f) { return s ? &(s->*f) : nullptr; };
    add("attn_norm", &L.attn_norm, f32, H, 1, true, whole(H, 1), 1.f, 0.1f, tag_of(l, 0),
        src(&LayerWeights::attn_norm));
    add("wq", &L.wq, wd, qd, H, false, rows(q0, qd_t, H), 0.f, sH, tag_of(l, 1),
        src(&LayerWeights::wq));
    add("wk", &L.wk, wd, kvd, H, false, rows(kv0, kvd_t, H), 0.f, sH, tag_of(l, 2),
        src(&LayerWeights::wk));
    add("wv", &L.wv, wd, kvd, H, false, rows(kv0, kvd_t, H), 0.f, sH, tag_of(l, 3),
        src(&LayerWeights::wv));
    if (host ? !s->bq.empty() : c.qkv_bias) {
      add("bq", &L.bq, f32, qd, 1, true, rows(q0, qd_t, 1), 0.f, 0.1f, tag_of(l, 4),
          src(&LayerWeights::bq));
      add("bk", &L.bk, f32, kvd, 1, true, rows(kv0, kvd_t, 1), 0.f, 0.1f, tag_of(l, 5),
          src(&LayerWeights::bk));
      add("bv", &L.bv, f32, kvd, 1, true, rows(kv0, kvd_t, 1), 0.f, 0.1f, tag_of(l, 6),
          src(&LayerWeights::bv));
    }
    add("wo", &L.wo, wd, H, qd, false, cols(H, q0, qd_t), 0.f, sQ, tag_of(l, 7),
        src(&LayerWeights::wo));
    add("ffn_norm", &L.ffn_norm, f32, H, 1, true, whole(H, 1), 1.f, 0.1f, tag_of(l, 8),
        src(&LayerWeights::ffn_norm));
    add("w_gate", &L.w_gate, wd, I, H, false, rows(i0, I_t, H), 0.f, sH, tag_of(l, 9),
        src(&LayerWeights::w_gate));
    add("w_up", &L.w_up, wd, I, H, false, rows(i0, I_t, H), 0.f, sH, tag_of(l, 10),
        src(&LayerWeights::w_up));
    add("w_down", &L.w_down, wd, H, I, false, cols(H, i0, I_t), 0.f, sI, tag_of(l, 11),
        src(&LayerWeights::w_down));
  }
  for (const WeightSpec& w : specs) {
    SF_TRY(host ? upload_part(w) : fill_part(w));
    bytes += w.dst->buf.size();
  }
  if (!host) SF_TRY(kernels::cuda::stream_synchronize(nullptr));  // the fills
  if (tied && wd == f32) lm_head.view = tok_embd.view;
  return Status::ok();
}

struct DevicePrefill::Impl {
  const DeviceModel::Impl* m = nullptr;
  PrefillOptions opt;
  int64_t max_tokens = 0, chunk = 0, max_logit_rows = 0;
  int64_t max_rows = 0;  // rows this rank holds at most: max_tokens, or a shard's local rows
  int kv_stage = 0;      // pinned K/V slots (PrefillOptions::kv_staging_layers; n_layers: one each)
  bool half = false;  // linear inputs are cast to the weight dtype first
  // BF16 weights and a cuDNN build: attention runs on BF16 copies of Q, K, V (cuDNN's fused
  // kernel, fp32 softmax and accumulation) and its output is widened back to F32. F32 weights
  // keep the F32 reference kernel (the bit-for-bit path the f32 tests bound at 1e-5).
  bool attn_bf16 = false;
  // A rank of a TP x CP group (plan_shard): its pieces of the prompt and the exchange hooks.
  bool sharded = false;
  DeviceShard shard;
  double plan_s = 0, hook_s = 0;
  size_t ws_bytes = 0;
  PlanTimes times;
  // opt.buffers: the buffers this plan holds, by role, to give back when it is destroyed.
  std::map<size_t, DeviceBuffer*> dev_roles;
  std::map<size_t, PinnedBuffer*> host_roles;
  bool holds_cache = false;  // this plan draws on opt.buffers (and gives back to it)
  bool idle = true;          // no run in progress or failed since the last success

  CudaStream compute, copy;
  // Device workspace, NL = the rows this rank holds (S unsharded). x: residual [NL, H]; q, att:
  // [NL, hq*d]; lse: [hq, NL]; part: [NL, H] (O and down projections, summed over TP slices
  // before the residual add); per chunk C: xn [C, H], gate, up [C, I], xh [C, max(H, hq*d, I)]
  // in the weight dtype. K/V: two slots of [NL, hkv*d] used by alternate layers; logits: two
  // slots of [C, vocab].
  DeviceBuffer tokens, positions, x, q, att, lse, xn, xh, part, gate, up;
  DeviceBuffer qh, kh, vh, atth;  // attn_bf16: BF16 [NL, hq*d] / [S, hkv*d] / [NL, hq*d]
  DeviceBuffer kh_loc, vh_loc;    // sharded, attn_bf16: this rank's BF16 K/V rows [NL, hkv*d]
  DeviceBuffer k_all, v_all;      // sharded, F32 attention: every row [S, hkv*d]
  DeviceBuffer k[2], v[2], logits[2];
  // PrefillOptions::kv_host_bf16: per slot, the layer's K then V rounded to bf16 on the copy
  // stream before they leave the device (the pinned staging and the result then hold bf16).
  DeviceBuffer kv16[2];
  bool kv_bf16 = false;
  CudaEvent kv_ready[2], kv_free[2], logits_ready[2], logits_free[2];
  std::vector<CudaEvent> kv_copied;           // per layer, on the copy stream
  std::vector<CudaEvent> att_begin, att_end;  // per layer, timing the attention kernel
  CudaEvent layers_begin;                     // before layer 0; with layer_end: per-layer time
  CudaEvent tp_ready, tp_done;                // overlapped TP: a chunk's partials, their sum
  std::vector<CudaEvent> layer_end;
  // importance_window > 0: one layer's SnapKV scores [hkv, S] on the device, every layer's in
  // pinned host memory (copied on the compute stream after each layer), and their timing.
  // With sparse attention also the window rows' dense output (discarded) and LSE, from the
  // attention's own dense kernel in its own dtype (so BF16 keys need no F32 copy).
  // A shard computes them only where the prompt ends (imp_here: the window's rows live there),
  // against every key.
  DeviceBuffer imp, imp_o, imp_lse;
  bool imp_here = false;
  std::vector<CudaEvent> imp_begin, imp_end, imp_copied;
  PinnedBuffer h_tokens, h_kv, h_logits, h_imp;
  // Sparse attention (opt.sparse at the planned length): per layer and piece a device estimator
  // plan, all on one shared arena (their runs are ordered on the compute stream, and each index
  // is consumed by its attention before the next one is built); per layer a device counter of
  // the pairs computed (density); estimator timing per layer and piece.
  bool use_sparse = false;
  std::vector<kernels::cuda::SparseEstimatePlan> est;  // [layer * pieces + piece]
  DeviceBuffer est_ws, est_index, pairs;
  std::vector<CudaEvent> est_begin, est_end;
  // Each estimator run's {blocks, columns} need, copied to pinned memory behind it, and per layer
  // an event after the layer's last copy: the host checks a layer's slots while its attention
  // runs and grows the plan in place (grow_sparse) before anything reads a truncated index.
  PinnedBuffer h_need;  // int32 [est.size() x 2]
  std::vector<CudaEvent> need_ready;
  double causal_pairs = 0;  // of one layer, every head of the slice
  // Index capacity per slot of every plan (0 before planning), and the most any slot of the last
  // run needed: more than the capacity means the run truncated slots and must be redone.
  int cap_blocks = 0, cap_cols = 0, need_blocks = 0, need_cols = 0;
  int grows = 0;            // in-place grows during the last run (PrefillResult::sparse_grows)
  double grown_est_s = 0;   // estimator time of runs a grow discarded, in the last run
  // plan_sparse failed part way (a grow with no memory): its plans are not usable, and a later
  // run says so instead of launching on a freed arena (the caller plans again).
  bool sparse_broken = false;
  bool dry = false;         // forward() walks the ops but only plans the GEMMs and attention shapes

  ~Impl() {
    // An error path may leave work in flight on buffers about to be freed.
    (void)cudaSetDevice(m ? m->device : 0);
    bool synced = true;
    if (compute.get()) synced = cudaStreamSynchronize(compute.get()) == cudaSuccess && synced;
    if (copy.get()) synced = cudaStreamSynchronize(copy.get()) == cudaSuccess && synced;
    if (DeviceBufferCache* bc = holds_cache ? opt.buffers.get() : nullptr) {
      // The buffers go back to the cache for the next plan only when nothing can still be
      // writing them: the last run succeeded (a failed one may have left a TP sum in flight on
      // the communicator's stream over `part`) and both streams drained. Otherwise they are
      // freed with the plan.
      if (idle && synced) {
        for (auto& [role, b] : dev_roles)
          if (b->data()) bc->impl_->device[role] = std::move(*b);
        for (auto& [role, b] : host_roles)
          if (b->data()) bc->impl_->host[role] = std::move(*b);
      }
      bc->impl_->lent = false;
    }
  }

  kernels::Stream cs() const { return kernels::Stream{Device::kCuda, compute.get()}; }

  // A buffer's role: its place in this struct, the same in every plan.
  size_t role_of(const void* member) const {
    return size_t(static_cast<const char*>(member) - reinterpret_cast<const char*>(this));
  }

  // b, at least `bytes` long: the cache's buffer of the same role when it is large enough, else
  // a new allocation (after freeing the cache's smaller one, and once more after freeing every
  // spare if the first attempt runs out of memory). Its time goes to `timer`.
  template <typename Buf>
  Status take_or_alloc(Buf& b, size_t bytes, std::map<size_t, Buf> DeviceBufferCache::Impl::*pool,
                       std::map<size_t, Buf*>& roles, double& timer) {
    const auto t0 = Clock::now();
    if (holds_cache) {
      std::map<size_t, Buf>& spares = opt.buffers->impl_.get()->*pool;
      const size_t role = role_of(&b);
      roles[role] = &b;
      auto it = spares.find(role);
      if (it != spares.end()) {
        if (bytes > 0 && it->second.size() >= bytes) {
          b = std::move(it->second);
          spares.erase(it);
          times.reused_bytes += int64_t(b.size());
          timer += seconds_since(t0);
          return Status::ok();
        }
        spares.erase(it);
      }
    }
    Status st = b.alloc(bytes);
    if (!st.is_ok() && holds_cache) {
      opt.buffers->clear();
      (void)cudaGetLastError();  // the failed allocation's error is not the next launch's
      st = b.alloc(bytes);
    }
    SF_TRY(st);
    times.allocated_bytes += int64_t(bytes);
    timer += seconds_since(t0);
    return Status::ok();
  }

  Status alloc(DeviceBuffer& b, size_t bytes) {
    SF_TRY(take_or_alloc(b, bytes, &DeviceBufferCache::Impl::device, dev_roles,
                         times.device_buffers_s));
    ws_bytes += b.size();
    // All-ones bytes are NaN as F32/BF16: a read of an element no kernel wrote shows in the
    // output instead of passing as a plausible value.
    if (b.size()) SF_CUDA_TRY(cudaMemsetAsync(b.data(), 0xFF, b.size(), compute.get()));
    return Status::ok();
  }

  Status alloc_host(PinnedBuffer& b, size_t bytes) {
    return take_or_alloc(b, bytes, &DeviceBufferCache::Impl::host, host_roles,
                         times.host_buffers_s);
  }

  // The rows this rank computes: the shard's pieces, or the whole prompt.
  std::vector<std::array<int64_t, 2>> pieces(int64_t S) const {
    if (sharded) return shard.pieces;
    return {{int64_t(0), S}};
  }

  // The F32 activation x as a GEMM input: itself with F32 weights, else rounded into xh.
  Result<TensorView> gemm_input(const TensorView& x_f32) {
    if (!half) return x_f32;
    const TensorView h = dview(xh.data(), m->wdt, {x_f32.shape[0], x_f32.shape[1]});
    if (!dry) SF_TRY(kernels::cast(x_f32, h, cs()));
    return h;
  }

  Status linear(const TensorView& in, const DevTensor& w, const DevTensor& b, const TensorView& y) {
    if (dry) return kernels::cuda::linear_plan(in, w.view, b.view, y);
    return kernels::linear(in, w.view, b.view, y, cs());
  }

  // A shard hook: runs once the compute stream has drained (it reads what the stream wrote);
  // its time is the communication the rank waited for.
  template <typename F>
  Status hook(F&& f) {
    // Overlapped TP: the compute stream may wait on sums still on the communicator's stream.
    // Wait for those against its deadline first, so a dead TP peer is an error here, not a hang
    // in the synchronize below (which has no deadline).
    if (shard.reduce_tp_enqueue && shard.reduce_tp_wait) SF_TRY(hook_nosync(shard.reduce_tp_wait));
    SF_CUDA_TRY(cudaStreamSynchronize(compute.get()));
    return hook_nosync(f);
  }
  template <typename F>
  Status hook_nosync(F&& f) {
    const auto t0 = Clock::now();
    Status s = f();
    hook_s += seconds_since(t0);
    return s;
  }

  // Overlapped TP: part rows [r0, r0 + n) are final on the compute stream; their sum over the
  // slices starts now on the communicator's stream.
  Status partial_ready(int64_t r0, int64_t n) {
    if (dry || !shard.reduce_tp_enqueue || n == 0) return Status::ok();
    const int64_t H = m->cfg.hidden;
    SF_CUDA_TRY(cudaEventRecord(tp_ready.get(), compute.get()));
    return shard.reduce_tp_enqueue(part.as<float>() + r0 * H, n * H, tp_ready.get(), tp_done.get());
  }

  // x += part over n rows, after the TP slices' partial sums have been added up: the compute
  // stream waits for the last enqueued sum (the communicator's stream runs them in order), or
  // the host runs the blocking all-reduce.
  Status residual_add(float* X, int64_t n) {
    const int64_t H = m->cfg.hidden;
    if (dry || n == 0) return Status::ok();
    if (shard.reduce_tp_enqueue)
      SF_CUDA_TRY(cudaStreamWaitEvent(compute.get(), tp_done.get(), 0));
    else if (shard.reduce_tp)
      SF_TRY(hook([&] { return shard.reduce_tp(part.as<float>(), n * H); }));
    return kernels::add_inplace(dview(X, DType::kF32, {n, H}),
                                dview(part.data(), DType::kF32, {n, H}), cs());
  }

  // (Re-)plans every layer's and piece's estimator with at least the given slot capacities (0:
  // the estimator's defaults) on one arena sized for the largest.
  Status plan_sparse(int min_blocks = 0, int min_cols = 0);
  // Re-plans with a quarter more room than {max_blocks, max_cols} (never less than now), on a
  // new arena; synchronizes the compute stream first (the old arena's readers) and after.
  Status grow_sparse(int max_blocks, int max_cols);
  Status setup(const DeviceModel::Impl& dmi, int64_t max_toks, const PrefillOptions& o);
  Status forward(std::span<const int32_t> ids, int64_t S, PrefillResult* res);
};

Status DevicePrefill::Impl::forward(std::span<const int32_t> ids, int64_t S, PrefillResult* res) {
  const ModelConfig& c = m->cfg;
  const int64_t H = c.hidden, hq = c.n_heads, hkv = c.n_kv_heads, d = c.head_dim,
                I = c.intermediate, vocab = c.vocab, qd = hq * d, kvd = hkv * d;
  const std::vector<std::array<int64_t, 2>> pcs = pieces(S);
  int64_t NL = 0;
  for (const auto& p : pcs) NL += p[1] - p[0];
  const int64_t C = std::min(chunk, NL);
  const bool keep_kv = opt.keep_kv;
  // Host copies of each layer's K/V: for the result (keep_kv) and for the per-layer hook.
  const bool host_kv = keep_kv || bool(opt.on_layer_kv);
  // Device KV tiering: the sink reads each layer's K/V slot on the copy stream, as host_kv does.
  const bool dev_sink = bool(opt.on_layer_kv_device);
  const bool kv_out = host_kv || dev_sink;
  const cudaStream_t st = compute.get(), cp = copy.get();
  float* const X = x.as<float>();
  float* const Q = q.as<float>();
  float* const ATT = att.as<float>();
  const int32_t* const pos = positions.as<int32_t>();
  kernels::RopeParams rope = c.rope;
  if (!m->rope_freqs.empty()) rope.freq_factors = m->rope_freqs.data();
  kernels::AttentionParams ap;
  ap.causal = true;
  const DevTensor none;
  hook_s = 0;
  grows = 0;
  grown_est_s = 0;
  const Status broken =
      use_sparse && sparse_broken
          ? SF_ERR(kInternal,
                   "device prefill: the sparse plan could not grow (see the earlier error); plan "
                   "the prefill again")
          : Status::ok();
  // Alone, refuse at once; a shard's peers would wait in this run's exchanges and TP sums, so it
  // keeps in step without attention (as a run whose plan fails mid-way does, below).
  if (!broken.is_ok() && !sharded) return broken;

  if (!dry) {
    int32_t* const ht = h_tokens.as<int32_t>();
    int64_t o = 0;
    for (const auto& p : pcs) {
      std::memcpy(ht + o, ids.data() + p[0], size_t(p[1] - p[0]) * sizeof(int32_t));
      o += p[1] - p[0];
    }
    SF_CUDA_TRY(cudaMemcpyAsync(tokens.data(), ht, size_t(NL) * sizeof(int32_t),
                                cudaMemcpyHostToDevice, st));
    SF_TRY(kernels::embedding(m->tok_embd.view, tokens.as<int32_t>(), NL,
                              dview(X, DType::kF32, {NL, H}), cs()));
    if (use_sparse) SF_CUDA_TRY(cudaMemsetAsync(pairs.data(), 0, pairs.size(), st));
    SF_CUDA_TRY(cudaEventRecord(layers_begin.get(), st));
  }

  // Waits poll with a sleep: cudaEventSynchronize spins a core (the events have no blocking-sync
  // flag), beside other ranks' threads. A shard whose copies can wait on a collective bounds
  // them (DeviceShard::copy_wait_timeout_s).
  const double wait_limit_s = shard.copy_wait_timeout_s;
  const auto wait_event = [wait_limit_s](cudaEvent_t e,
                                         const char* what = "a K/V copy") -> Status {
    const auto w0 = Clock::now();
    cudaError_t ce;
    while ((ce = cudaEventQuery(e)) == cudaErrorNotReady) {
      if (wait_limit_s > 0 && seconds_since(w0) > wait_limit_s)
        return SF_ERR(kDeadlineExceeded,
                      sformat("device prefill: %s did not complete in %.0f s (it waits on the "
                              "TP all-reduces: a peer may have stopped)",
                              what, wait_limit_s));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    SF_CUDA_TRY(ce);
    return Status::ok();
  };
  // The device sink's placements, in layer order: layers [0, placed) are placed. Each waits for
  // its layer's block copies and importance.
  int placed = 0;
  const auto place_through = [&](int last) -> Status {
    for (; placed <= last; ++placed) {
      SF_TRY(wait_event(kv_copied[size_t(placed)].get()));
      std::span<const float> imp_p;
      if (imp_here) {
        SF_TRY(wait_event(imp_copied[size_t(placed)].get()));
        imp_p = std::span<const float>(
            h_imp.as<float>() + size_t(placed) * size_t(hkv * max_tokens), size_t(hkv * S));
      }
      SF_TRY(opt.on_layer_kv_device.place(placed, imp_p));
    }
    return Status::ok();
  };

  // Layer l's K/V in pinned memory: its slot of the ring (one slot per layer unless
  // kv_staging_layers asked for fewer).
  const size_t he = kv_bf16 ? sizeof(uint16_t) : sizeof(float);  // a host K/V element
  const auto staged = [&](int l) {
    return h_kv.as<char>() + size_t(2 * (l % kv_stage)) * size_t(max_rows * kvd) * he;
  };
  // A shard's rows (its pieces in order), after the caller's lead rows when it has any.
  const int64_t lead = keep_kv ? shard.kv_lead_rows : 0;
  if (!dry) {
    KvCache& kv = res->kv;
    kv.n_layers = c.n_layers;
    kv.n_kv_heads = int(hkv);
    kv.head_dim = int(d);
    kv.n_tokens = lead + NL;
    kv.k.assign(keep_kv && !kv_bf16 ? size_t(c.n_layers) : 0, {});
    kv.v.assign(keep_kv && !kv_bf16 ? size_t(c.n_layers) : 0, {});
    kv.k16.assign(keep_kv && kv_bf16 ? size_t(c.n_layers) : 0, {});
    kv.v16.assign(keep_kv && kv_bf16 ? size_t(c.n_layers) : 0, {});
  }
  // The result's K/V vectors are sized (their pages faulted in) from the run's start on threads
  // of their own (KvSizer), while the host enqueues and the device computes the first layers,
  // in layer order; each landing waits only for its own layer's two vectors. Sized inline at the
  // first landing instead, a 1M-token CP rank's 34 GB took 7.8-8.8 s with the host blocked and a
  // two-slot ring's device idle behind it; waiting for all of it at the first landing still
  // stalled a 4-way 1M block-sparse prefill for about the sizing's 4 s (bench/NOTES.md,
  // forty-seventh and forty-eighth sessions). Destroyed (stopped, joined) on every return.
  std::optional<KvSizer> kv_sizer;
  if (!dry && keep_kv) kv_sizer.emplace(&res->kv, size_t((lead + NL) * kvd), num_threads());
  // Layers [landed, last] leave the host side, in order, on this thread, as soon as their copies
  // land while the device computes later layers (their work is already enqueued: all of it with a
  // slot per layer, else up to the ring's size, so the host holds the device back only when it
  // copies slower than the device computes):
  // - the result's K and V leave pinned memory on the CPU thread pool. One thread's copy into
  //   fresh pages (page faults first) ran at 2-3 GB/s and tripled a 32K prefill with keep_kv
  //   (bench/NOTES.md, thirty-seventh session), so the vectors are sized (faulted in) by the
  //   sizer thread above first (a layer waits for its own vectors), while the device
  //   computes, and each layer is then one parallel memcpy;
  // - the device sink places the layer (its block copies were queued before kv_copied; the
  //   demotions it issues run on the pool's copy stream beside the compute);
  // - the host hook (KV tiering) gets the layer's host K/V and importance;
  // - opt.on_layer_done reports progress.
  int landed = 0;
  Status land_error;  // the ring's first failed landing (see its call in the layer loop)
  Status sparse_error = broken;  // a shard's failed check or grow of its sparse plan (see below)
  if (!sparse_error.is_ok() && kv_sizer) kv_sizer->stop();  // nothing will land
  const auto land_through = [&](int last) -> Status {
    KvCache& kv = res->kv;
    for (; landed <= last; ++landed) {
      // A shard whose sparse plan failed goes on enqueuing without attention: its later layers'
      // K/V are not the prompt's, so none lands (kv_hooks.final would call them final) and the
      // host copies nothing more. (The stopped sizer alone does not stop this: it skips only
      // the layers it had not sized yet.)
      if (!sparse_error.is_ok()) return sparse_error;
      const int l = landed;
      if (!kv_out) {
        if (opt.on_layer_done) {
          SF_TRY(wait_event(layer_end[size_t(l)].get()));
          opt.on_layer_done(l);
        }
        continue;
      }
      SF_TRY(wait_event(kv_copied[size_t(l)].get()));
      char* const hb = host_kv ? staged(l) : nullptr;
      float* hk = host_kv ? reinterpret_cast<float*>(hb) : nullptr;
      float* hv = host_kv ? reinterpret_cast<float*>(hb + size_t(max_rows * kvd) * he) : nullptr;
      if (keep_kv) {
        if (Status w = kv_sizer->wait(l); !w.is_ok())
          return Status(w.code(), "device prefill: " + w.message(), __FILE__, __LINE__);
        const auto c0 = Clock::now();
        const size_t at = size_t(lead * kvd);
        if (kv_bf16)
          parallel_copy_pair(kv.k16[size_t(l)].data() + at, reinterpret_cast<const uint16_t*>(hk),
                             kv.v16[size_t(l)].data() + at, reinterpret_cast<const uint16_t*>(hv),
                             size_t(NL * kvd));
        else
          parallel_copy_pair(kv.k[size_t(l)].data() + at, hk, kv.v[size_t(l)].data() + at, hv,
                             size_t(NL * kvd));
        if (lead > 0)
          SF_TRY(shard.fill_kv_lead(l, kv.k[size_t(l)].data(), kv.v[size_t(l)].data()));
        res->kv_copy_s += seconds_since(c0);
      }
      if (dev_sink) SF_TRY(place_through(l));
      std::span<const float> imp_l;
      if (imp_here && opt.on_layer_kv) {
        SF_TRY(wait_event(imp_copied[size_t(l)].get()));
        imp_l = std::span<const float>(h_imp.as<float>() + size_t(l) * size_t(hkv * max_tokens),
                                       size_t(hkv * S));
      }
      if (opt.on_layer_kv)
        SF_TRY(opt.on_layer_kv(l, TensorView::make(hk, DType::kF32, {S, hkv, d}),
                               TensorView::make(hv, DType::kF32, {S, hkv, d}), imp_l));
      if (keep_kv && opt.kv_hooks.final) opt.kv_hooks.final(l, kv, {});
      if (opt.on_layer_done) opt.on_layer_done(l);
    }
    return Status::ok();
  };

  for (int l = 0; l < c.n_layers; ++l) {
    const DeviceModel::Impl::Layer& L = m->layers[size_t(l)];
    const int slot = kv_out ? l % 2 : 0;
    // Slot reuse: layer l writes the slot layer l-2 used; its copy-out must have finished.
    if (!dry && kv_out && l >= 2) SF_CUDA_TRY(cudaStreamWaitEvent(st, kv_free[slot].get(), 0));
    float* const K = k[slot].as<float>();
    float* const V = v[slot].as<float>();

    // 1) norm, QKV, RoPE per chunk of this rank's rows (positions: their places in the prompt).
    for (int64_t c0 = 0; c0 < NL; c0 += C) {
      const int64_t n = std::min(C, NL - c0);
      const TensorView xnv = dview(xn.data(), DType::kF32, {n, H});
      float* const qc = Q + c0 * qd;
      float* const kc = K + c0 * kvd;
      float* const vc = V + c0 * kvd;
      if (!dry)
        SF_TRY(kernels::rms_norm(dview(X + c0 * H, DType::kF32, {n, H}), L.attn_norm.view,
                                 c.rms_eps, xnv, cs()));
      SF_ASSIGN(const TensorView in, gemm_input(xnv));
      SF_TRY(linear(in, L.wq, L.bq, dview(qc, DType::kF32, {n, qd})));
      SF_TRY(linear(in, L.wk, L.bk, dview(kc, DType::kF32, {n, kvd})));
      SF_TRY(linear(in, L.wv, L.bv, dview(vc, DType::kF32, {n, kvd})));
      if (!dry) {
        SF_TRY(kernels::rope(dview(qc, DType::kF32, {n, hq, d}), pos + c0, rope, cs()));
        SF_TRY(kernels::rope(dview(kc, DType::kF32, {n, hkv, d}), pos + c0, rope, cs()));
      }
    }

    // K and V of this layer are final: copy them out while attention and later layers run.
    if (!dry && kv_out) {
      SF_TRY(stream_after(cp, st, kv_ready[slot].get()));
      if (host_kv) {
        // The ring's slot is free once the host took out the layer that used it last. A failed
        // landing stops the host's side, not the enqueueing: a shard's peers wait in this
        // layer's and later layers' collectives, so the error is returned after them.
        if (l >= kv_stage && land_error.is_ok()) {
          land_error = land_through(l - kv_stage);
          if (!land_error.is_ok() && kv_sizer) kv_sizer->stop();  // nothing more will land
          // Alone, no peer waits on this run: stop here rather than compute the rest for nothing.
          if (!land_error.is_ok() && !sharded) return land_error;
        }
        const size_t bytes = size_t(NL * kvd) * he;
        char* const hk = staged(l);
        char* const hv = hk + size_t(max_rows * kvd) * he;
        if (kv_bf16) {
          // Rounded on the copy stream (after kv_ready, as the copies are), into this slot's
          // bf16 pair; the slot's next use two layers on is ordered behind these on `cp`.
          char* const k16 = static_cast<char*>(kv16[slot].data());
          SF_TRY(kernels::cuda::cast(dview(K, DType::kF32, {NL, hkv, d}),
                                     dview(k16, DType::kBF16, {NL, hkv, d}), cp));
          SF_TRY(kernels::cuda::cast(dview(V, DType::kF32, {NL, hkv, d}),
                                     dview(k16 + bytes, DType::kBF16, {NL, hkv, d}), cp));
          SF_CUDA_TRY(cudaMemcpyAsync(hk, k16, bytes, cudaMemcpyDeviceToHost, cp));
          SF_CUDA_TRY(cudaMemcpyAsync(hv, k16 + bytes, bytes, cudaMemcpyDeviceToHost, cp));
        } else {
          SF_CUDA_TRY(cudaMemcpyAsync(hk, K, bytes, cudaMemcpyDeviceToHost, cp));
          SF_CUDA_TRY(cudaMemcpyAsync(hv, V, bytes, cudaMemcpyDeviceToHost, cp));
        }
      }
      // The tiering sink queues its block copies (device tier: device to device; spilled
      // blocks: to pinned host) behind them, on the same stream; it never waits here.
      // A sink that bounds the layers in flight gets layer l - max_inflight placed first (its
      // cold blocks then drain in the background); layer l's QKV is already queued meanwhile.
      if (dev_sink && opt.on_layer_kv_device.max_inflight > 0)
        SF_TRY(place_through(l - opt.on_layer_kv_device.max_inflight));
      if (dev_sink) SF_TRY(opt.on_layer_kv_device.enqueue(l, K, V, NL, cp));
      SF_CUDA_TRY(cudaEventRecord(kv_free[slot].get(), cp));
      SF_CUDA_TRY(cudaEventRecord(kv_copied[size_t(l)].get(), cp));
    }

    // 2) attention inputs: Q of this rank's rows, K/V of the whole prompt (a shard gets the other
    // ranks' rows through exchange_kv, in the attention's dtype), then one call per piece.
    const DType adt = attn_bf16 ? DType::kBF16 : DType::kF32;
    const size_t aes = dtype_size(adt);
    void* const QA = attn_bf16 ? qh.data() : static_cast<void*>(Q);
    void* const OA = attn_bf16 ? atth.data() : static_cast<void*>(ATT);
    void* KA = attn_bf16 ? kh.data() : static_cast<void*>(K);
    void* VA = attn_bf16 ? vh.data() : static_cast<void*>(V);
    if (shard.exchanges()) {
      void* kl = K;
      void* vl = V;
      if (attn_bf16) {
        kl = kh_loc.data();
        vl = vh_loc.data();
        if (!dry) {
          SF_TRY(kernels::cast(dview(K, DType::kF32, {NL, hkv, d}), dview(kl, adt, {NL, hkv, d}),
                               cs()));
          SF_TRY(kernels::cast(dview(V, DType::kF32, {NL, hkv, d}), dview(vl, adt, {NL, hkv, d}),
                               cs()));
        }
      } else {
        KA = k_all.data();
        VA = v_all.data();
      }
      if (!dry && shard.exchange_kv_enqueue)
        SF_TRY(shard.exchange_kv_enqueue(l, kl, vl, KA, VA, adt, st));
      else if (!dry)
        SF_TRY(hook([&] { return shard.exchange_kv(l, kl, vl, KA, VA, adt); }));
    }
    // Attention time: the casts and the kernels (a shard's exchange is communication).
    if (!dry) {
      SF_CUDA_TRY(cudaEventRecord(att_begin[size_t(l)].get(), st));
      if (attn_bf16) {
        SF_TRY(
            kernels::cast(dview(Q, DType::kF32, {NL, hq, d}), dview(QA, adt, {NL, hq, d}), cs()));
        if (!shard.exchanges()) {
          SF_TRY(
              kernels::cast(dview(K, DType::kF32, {S, hkv, d}), dview(KA, adt, {S, hkv, d}), cs()));
          SF_TRY(
              kernels::cast(dview(V, DType::kF32, {S, hkv, d}), dview(VA, adt, {S, hkv, d}), cs()));
        }
      }
    }
    // One attention call per piece; each piece's index view (for opt.on_sparse_index).
    std::vector<kernels::cuda::SparseIndexDevice> piece_idx(use_sparse ? pcs.size() : 0);
    const auto attend = [&]() -> Status {
      for (int64_t j = 0, lo = 0; j < int64_t(pcs.size());
           lo += pcs[size_t(j)][1] - pcs[size_t(j)][0], ++j) {
        const int64_t b = pcs[size_t(j)][0], e = pcs[size_t(j)][1], n = e - b;
        ap.q_offset = b;
        const TensorView qv =
            dview(static_cast<char*>(QA) + size_t(lo * qd) * aes, adt, {n, hq, d});
        const TensorView kv3 = dview(KA, adt, {e, hkv, d});
        const TensorView vv = dview(VA, adt, {e, hkv, d});
        const TensorView ov =
            dview(static_cast<char*>(OA) + size_t(lo * qd) * aes, adt, {n, hq, d});
        if (dry) {
          if (attn_bf16 && !use_sparse)
            SF_TRY(kernels::cuda::attention_dense_plan(qv, kv3, vv, ov, ap));
          continue;
        }
        const TensorView lv = dview(lse.as<float>() + hq * lo, DType::kF32, {hq, n});
        if (use_sparse && !sparse_error.is_ok()) continue;  // a failed run, kept in step
        if (use_sparse) {
          // The piece's index from its own queries (the last 64 rows score vertical-slash heads)
          // against keys [0, e), then the sparse kernel on it.
          const size_t i = size_t(l) * pcs.size() + size_t(j);
          kernels::cuda::SparseIndexDevice idx;
          SF_CUDA_TRY(cudaEventRecord(est_begin[i].get(), st));
          SF_TRY(kernels::cuda::sparse_estimate_run(&est[i], qv, kv3, &idx, st));
          SF_CUDA_TRY(cudaEventRecord(est_end[i].get(), st));
          SF_TRY(kernels::cuda::sparse_estimate_need_enqueue(est[i], h_need.as<int32_t>() + 2 * i,
                                                             st));
          if (j + 1 == int64_t(pcs.size()))
            SF_CUDA_TRY(cudaEventRecord(need_ready[size_t(l)].get(), st));
          SF_TRY(kernels::cuda::attention_sparse(qv, kv3, vv, idx, ov, lv, ap, st));
          SF_TRY(kernels::cuda::sparse_index_pairs(idx, pairs.as<unsigned long long>() + l, st));
          piece_idx[size_t(j)] = idx;
        } else {
          SF_TRY(kernels::attention_dense(qv, kv3, vv, ov, lv, ap, cs()));
        }
      }
      return Status::ok();
    };
    SF_TRY(attend());
    // Sparse: the layer's index slots against the plan's capacity, checked while its attention
    // runs (the host waits for the estimators, and with two pieces for the first piece's
    // attention). A slot that needed more was truncated: grow the plan in place (a quarter more
    // room, so later layers rarely grow again) and run the layer's estimators and attention
    // again before anything reads its output. At most opt.sparse_max_grows times (2 by default).
    const auto check_sparse = [&]() -> Status {
      for (int tries = 0;; ++tries) {
        SF_TRY(wait_event(need_ready[size_t(l)].get(), "a layer's sparse estimate"));
        int nb = 0, nc = 0;
        bool over = false;
        for (size_t j = 0; j < pcs.size(); ++j) {
          const size_t i = size_t(l) * pcs.size() + j;
          const int32_t* h = h_need.as<int32_t>() + 2 * i;
          nb = std::max(nb, int(h[0]));
          nc = std::max(nc, int(h[1]));
          over = over || h[0] > est[i].launch.max_blocks || h[1] > est[i].launch.max_cols;
        }
        if (!over) return Status::ok();
        if (tries == opt.sparse_max_grows)
          return SF_ERR(kResourceExhausted,
                        "device prefill: layer " + std::to_string(l) + "'s index slots needed " +
                            std::to_string(nb) + " blocks and " + std::to_string(nc) +
                            " columns, the plan holds " + std::to_string(cap_blocks) + " and " +
                            std::to_string(cap_cols) + " after " + std::to_string(tries) +
                            " grow(s) (PrefillOptions::sparse_max_grows)");
        SF_CUDA_TRY(cudaStreamSynchronize(st));
        for (size_t j = 0; j < pcs.size(); ++j) {
          const size_t i = size_t(l) * pcs.size() + j;
          float ms = 0.f;
          SF_CUDA_TRY(cudaEventElapsedTime(&ms, est_begin[i].get(), est_end[i].get()));
          grown_est_s += double(ms) * 1e-3;
        }
        SF_LOG(kInfo, "prefill",
               "layer " << l << ": an index slot needed " << nb << " blocks and " << nc
                        << " columns, the plan holds " << cap_blocks << " and " << cap_cols
                        << "; growing it and running the layer's attention again");
        SF_TRY(grow_sparse(nb, nc));
        ++grows;
        SF_CUDA_TRY(cudaMemsetAsync(pairs.as<unsigned long long>() + l, 0,
                                    sizeof(unsigned long long), st));
        SF_TRY(attend());
      }
    };
    if (!dry && use_sparse && sparse_error.is_ok()) {
      sparse_error = check_sparse();
      // Alone, stop here. A shard's peers wait in this and later layers' exchanges and TP sums:
      // it enqueues the rest of the layers without attention (the plan may be half re-planned)
      // and returns the error after them, and its caller makes it the group's.
      if (!sparse_error.is_ok() && !sharded) return sparse_error;
      // A failed shard's result is dropped: stop faulting in its K/V (no later landing runs:
      // land_through returns sparse_error, which is what the run returns).
      if (!sparse_error.is_ok() && kv_sizer) kv_sizer->stop();
      // The index views stay valid until the next layer's estimators run on this stream.
      if (sparse_error.is_ok() && opt.on_sparse_index)
        for (const kernels::cuda::SparseIndexDevice& di : piece_idx) {
          kernels::SparseIndex hi;
          SF_TRY(kernels::cuda::sparse_index_download(di, di.max_blocks, di.max_cols, &hi, st));
          opt.on_sparse_index(l, hi);
        }
    }
    if (!dry) {
      if (attn_bf16)
        SF_TRY(
            kernels::cast(dview(OA, adt, {NL, hq, d}), dview(ATT, DType::kF32, {NL, hq, d}), cs()));
      SF_CUDA_TRY(cudaEventRecord(att_end[size_t(l)].get(), st));
    }
    ap.q_offset = 0;

    // 2b) SnapKV importance of the last importance_window queries, from this layer's LSE
    // (kernels/kv_importance.h), on the F32 Q and the attention's keys (BF16 ones are widened as
    // the kernel reads them; with bf16 attention the LSE is of the rounded copies, and the kernel
    // caps each recomputed score at its row's LSE). A shard computes it where the prompt ends,
    // from its last piece, whose attention saw every key, against the exchanged keys.
    // A sparse layer's LSE covers the selected keys only and would over-count the others: there
    // the window rows' LSE comes from a dense pass over those rows (the CPU forward's rule), by
    // the attention's dense kernel in its dtype; it is planned with the layer's other kernels.
    const int64_t iwn = imp_here && use_sparse ? std::min<int64_t>(opt.importance_window,
                                                                   pcs.back()[1] - pcs.back()[0])
                                               : 0;
    kernels::AttentionParams iwp = ap;
    iwp.q_offset = S - iwn;
    const auto window_views = [&] {
      return std::array<TensorView, 4>{
          dview(static_cast<char*>(QA) + size_t((NL - iwn) * qd) * aes, adt, {iwn, hq, d}),
          dview(KA, adt, {S, hkv, d}), dview(VA, adt, {S, hkv, d}),
          dview(imp_o.data(), adt, {iwn, hq, d})};
    };
    if (dry && iwn > 0 && attn_bf16) {
      const auto w = window_views();
      SF_TRY(kernels::cuda::attention_dense_plan(w[0], w[1], w[2], w[3], iwp));
    }
    if (!dry && imp_here) {
      const int64_t pb = pcs.back()[0], pn = pcs.back()[1] - pb, plo = NL - pn;
      kernels::ImportanceParams ip;
      ip.window = opt.importance_window;
      ip.pool = opt.importance_pool;
      ip.scale = ap.scale;
      ip.q_offset = pb;
      SF_CUDA_TRY(cudaEventRecord(imp_begin[size_t(l)].get(), st));
      TensorView iq = dview(Q + plo * qd, DType::kF32, {pn, hq, d});
      TensorView il = dview(lse.as<float>() + hq * plo, DType::kF32, {hq, pn});
      const TensorView ik = dview(KA, adt, {S, hkv, d});
      if (use_sparse) {
        const auto w = window_views();
        iq = dview(Q + (NL - iwn) * qd, DType::kF32, {iwn, hq, d});
        il = dview(imp_lse.data(), DType::kF32, {hq, iwn});
        SF_TRY(kernels::attention_dense(w[0], w[1], w[2], w[3], il, iwp, cs()));
        ip.window = int(iwn);
        ip.q_offset = iwp.q_offset;
      }
      SF_TRY(
          kernels::kv_importance(iq, ik, il, ip, dview(imp.data(), DType::kF32, {hkv, S}), cs()));
      SF_CUDA_TRY(cudaEventRecord(imp_end[size_t(l)].get(), st));
      SF_CUDA_TRY(cudaMemcpyAsync(h_imp.as<float>() + size_t(l) * size_t(hkv * max_tokens),
                                  imp.data(), size_t(hkv * S) * sizeof(float),
                                  cudaMemcpyDeviceToHost, st));
      SF_CUDA_TRY(cudaEventRecord(imp_copied[size_t(l)].get(), st));
    }

    // 3) O projection of every row (partial over this TP slice's heads), summed, residual.
    for (int64_t c0 = 0; c0 < NL; c0 += C) {
      const int64_t n = std::min(C, NL - c0);
      SF_ASSIGN(const TensorView in_o, gemm_input(dview(ATT + c0 * qd, DType::kF32, {n, qd})));
      SF_TRY(linear(in_o, L.wo, none, dview(part.as<float>() + c0 * H, DType::kF32, {n, H})));
      SF_TRY(partial_ready(c0, n));
    }
    SF_TRY(residual_add(X, NL));
    // 4) MLP per chunk (down projection partial over this slice's columns), summed, residual.
    for (int64_t c0 = 0; c0 < NL; c0 += C) {
      const int64_t n = std::min(C, NL - c0);
      const TensorView xnv = dview(xn.data(), DType::kF32, {n, H});
      const TensorView gv = dview(gate.data(), DType::kF32, {n, I});
      const TensorView uv = dview(up.data(), DType::kF32, {n, I});
      if (!dry)
        SF_TRY(kernels::rms_norm(dview(X + c0 * H, DType::kF32, {n, H}), L.ffn_norm.view, c.rms_eps,
                                 xnv, cs()));
      SF_ASSIGN(const TensorView in_f, gemm_input(xnv));
      SF_TRY(linear(in_f, L.w_gate, none, gv));
      SF_TRY(linear(in_f, L.w_up, none, uv));
      if (!dry) SF_TRY(kernels::swiglu(gv, uv, gv, cs()));
      SF_ASSIGN(const TensorView in_d, gemm_input(gv));
      SF_TRY(linear(in_d, L.w_down, none, dview(part.as<float>() + c0 * H, DType::kF32, {n, H})));
      SF_TRY(partial_ready(c0, n));
    }
    SF_TRY(residual_add(X, NL));
    if (!dry) SF_CUDA_TRY(cudaEventRecord(layer_end[size_t(l)].get(), st));
  }

  // Final norm + LM head on the requested rows, in chunks through two device slots, each copied
  // to pinned host memory on the copy stream. A shard's last row is the prompt's last on the
  // rank that computes logits (the zigzag puts the last chunk on CP rank 0).
  const bool want_logits = !sharded || shard.logits;
  const int64_t row0 = opt.all_logits ? 0 : NL - 1;
  const int64_t rows = want_logits ? NL - row0 : 0;
  for (int64_t r = 0, j = 0; r < rows; r += C, ++j) {
    const int64_t n = std::min(C, rows - r);
    const int slot = int(j % 2);
    if (!dry && j >= 2) SF_CUDA_TRY(cudaStreamWaitEvent(st, logits_free[slot].get(), 0));
    const TensorView xnv = dview(xn.data(), DType::kF32, {n, H});
    if (!dry)
      SF_TRY(kernels::rms_norm(dview(X + (row0 + r) * H, DType::kF32, {n, H}), m->out_norm.view,
                               c.rms_eps, xnv, cs()));
    SF_ASSIGN(const TensorView in, gemm_input(xnv));
    SF_TRY(linear(in, m->lm_head, none, dview(logits[slot].data(), DType::kF32, {n, vocab})));
    if (!dry) {
      SF_TRY(stream_after(cp, st, logits_ready[slot].get()));
      SF_CUDA_TRY(cudaMemcpyAsync(h_logits.as<float>() + r * vocab, logits[slot].data(),
                                  size_t(n * vocab) * sizeof(float), cudaMemcpyDeviceToHost, cp));
      SF_CUDA_TRY(cudaEventRecord(logits_free[slot].get(), cp));
    }
  }
  if (dry) return Status::ok();
  // Overlapped TP: every sum was enqueued; wait for them against the communicator's deadline
  // before anything else can block on a stream that waits for them.
  if (shard.reduce_tp_enqueue && shard.reduce_tp_wait) SF_TRY(hook_nosync(shard.reduce_tp_wait));

  // Every layer's work is enqueued; the layers the ring did not land yet leave pinned memory now.
  SF_TRY(sparse_error);
  SF_TRY(land_error);
  SF_TRY(land_through(c.n_layers - 1));
  if (kv_sizer) SF_TRY(kv_sizer->finish(&res->kv_alloc_s));
  SF_CUDA_TRY(cudaStreamSynchronize(st));
  SF_CUDA_TRY(cudaStreamSynchronize(cp));
  res->n_logit_rows = rows;
  res->logits.assign(h_logits.as<float>(), h_logits.as<float>() + rows * vocab);
  if (rows > 0) {
    const float* last = res->logits.data() + (rows - 1) * vocab;
    res->first_token = int32_t(std::max_element(last, last + vocab) - last);
  }
  res->attention_s = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    float ms = 0.f;
    SF_CUDA_TRY(cudaEventElapsedTime(&ms, att_begin[size_t(l)].get(), att_end[size_t(l)].get()));
    res->attention_s += double(ms) * 1e-3;
  }
  res->kv_peak_bytes =
      host_kv ? int64_t(kv_stage) * 2 * max_rows * kvd * int64_t(kv_bf16 ? 2 : 4) : 0;
  res->importance_s = 0;
  res->importance.clear();
  if (imp_here) {
    res->importance.resize(size_t(c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {
      const float* hi = h_imp.as<float>() + size_t(l) * size_t(hkv * max_tokens);
      res->importance[size_t(l)].assign(hi, hi + hkv * S);
      float ms = 0.f;
      SF_CUDA_TRY(cudaEventElapsedTime(&ms, imp_begin[size_t(l)].get(), imp_end[size_t(l)].get()));
      res->importance_s += double(ms) * 1e-3;
    }
  }
  res->estimate_s = 0;
  res->density = 1.0;
  if (use_sparse) {
    // Every layer's slots were checked against the plan as it ran (and grown where short); the
    // needs are what a later plan may start from (sparse_need).
    need_blocks = need_cols = 0;
    res->estimate_s = grown_est_s;
    for (size_t i = 0; i < est.size(); ++i) {
      float ms = 0.f;
      SF_CUDA_TRY(cudaEventElapsedTime(&ms, est_begin[i].get(), est_end[i].get()));
      res->estimate_s += double(ms) * 1e-3;
      const int32_t* h = h_need.as<int32_t>() + 2 * i;
      need_blocks = std::max(need_blocks, int(h[0]));
      need_cols = std::max(need_cols, int(h[1]));
    }
    res->sparse_grows = grows;
    res->attention_s -= res->estimate_s;  // the estimators ran inside the attention window
    std::vector<unsigned long long> got(size_t(c.n_layers));
    SF_TRY(pairs.download(got.data(), got.size() * sizeof(unsigned long long)));
    double sum = 0;
    for (unsigned long long g : got) sum += double(g);
    res->density = causal_pairs > 0 ? sum / (causal_pairs * c.n_layers) : 0.0;
  }
  return Status::ok();
}

Status cuda_device_check(int device) {
  int n = 0;
  const Status st = kernels::cuda::device_count(&n);
  if (!st.is_ok()) return SF_ERR(kUnsupported, "no usable CUDA device: " + st.message());
  if (n == 0) return SF_ERR(kUnsupported, "no CUDA device found (cudaGetDeviceCount returned 0)");
  SF_ENSURE(device >= 0 && device < n, kInvalidArgument,
            "CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(n) +
                " visible)");
  return Status::ok();
}

Result<DeviceModel> DeviceModel::upload(const Model& model, DType weight_dtype, int device,
                                        TpSlice slice) {
  DeviceModel dm;
  dm.impl_ = std::make_unique<Impl>();
  SF_TRY(dm.impl_->build(model.config(), weight_dtype, device, slice, &model, 0));
  return dm;
}

Result<DeviceModel> DeviceModel::synthetic(const ModelConfig& cfg, uint64_t seed,
                                           DType weight_dtype, int device, TpSlice slice) {
  DeviceModel dm;
  dm.impl_ = std::make_unique<Impl>();
  SF_TRY(dm.impl_->build(cfg, weight_dtype, device, slice, nullptr, seed));
  return dm;
}

Status DevicePrefill::Impl::setup(const DeviceModel::Impl& dmi, int64_t max_toks,
                                  const PrefillOptions& o) {
  const auto t0 = Clock::now();
  const ModelConfig& c = dmi.cfg;
  SF_ENSURE(max_toks > 0, kInvalidArgument, "device prefill: max_tokens must be positive");
  SF_ENSURE(max_toks <= INT32_MAX, kInvalidArgument,
            "device prefill: max_tokens exceeds the int32 positions");
  SF_ENSURE(o.chunk > 0, kInvalidArgument, "device prefill: chunk must be positive");
  if (o.sparse) {
    const SparseConfig& sc = *o.sparse;
    SF_ENSURE(sc.n_layers == dmi.full_cfg.n_layers && sc.n_heads == dmi.full_cfg.n_heads &&
                  sc.layers.size() == size_t(sc.n_layers),
              kInvalidArgument,
              "device prefill: sparse config is for " + std::to_string(sc.n_layers) + "x" +
                  std::to_string(sc.n_heads) + " layers x heads, the model has " +
                  std::to_string(dmi.full_cfg.n_layers) + "x" +
                  std::to_string(dmi.full_cfg.n_heads));
  }
  SF_ENSURE(!o.on_attention, kUnsupported,
            "device prefill: attention observers read host tensors; use the CPU forward");
  SF_ENSURE(bool(o.on_layer_kv_device) ||
                (!o.on_layer_kv_device.enqueue && !o.on_layer_kv_device.place),
            kInvalidArgument, "device prefill: on_layer_kv_device needs both enqueue and place");
  SF_ENSURE(!sharded || !o.on_layer_kv_device, kUnsupported,
            "device prefill shard: the device KV tiering sink is single-device only");
  SF_ENSURE(!o.kv_host_bf16 || (o.keep_kv && !o.on_layer_kv && !o.on_layer_kv_device),
            kInvalidArgument,
            "device prefill: kv_host_bf16 keeps the result's K/V in bf16; it needs keep_kv and "
            "no per-layer KV hook or sink (they take F32)");
  // Without keep_kv no layer's K/V lands on the host, so the hooks would never be called.
  SF_ENSURE(o.keep_kv || (!o.kv_hooks.final && !o.kv_hooks.failed), kInvalidArgument,
            "device prefill: kv_hooks hand over the result's K/V; they need keep_kv");
  SF_ENSURE(!o.on_layer_kv_device || !o.on_layer_kv, kInvalidArgument,
            "device prefill: on_layer_kv_device and on_layer_kv are two ways to tier the same KV; "
            "give one");
  SF_ENSURE(kernels::cuda::attention_dense_supported(c.head_dim), kUnsupported,
            "device prefill: head_dim " + std::to_string(c.head_dim) +
                " (CUDA attention supports 64 and 128)");
  SF_ENSURE(o.importance_window >= 0, kInvalidArgument,
            "device prefill: importance_window must be >= 0");
  SF_ENSURE(dmi.slice.ways == 1 || (sharded && (shard.reduce_tp || shard.reduce_tp_enqueue)),
            kInvalidArgument,
            "device prefill: the model is TP slice " + std::to_string(dmi.slice.index) + " of " +
                std::to_string(dmi.slice.ways) + "; plan it as a shard with a reduce_tp hook");
  SF_CUDA_TRY(cudaSetDevice(dmi.device));

  m = &dmi;
  opt = o;
  if (opt.buffers) {
    // Two live plans on one cache would each give back the other's roles.
    SF_ENSURE(!opt.buffers->impl_->lent, kInvalidArgument,
              "device prefill: PrefillOptions::buffers is held by another live plan (one plan at "
              "a time draws on a DeviceBufferCache; destroy that plan first)");
    opt.buffers->impl_->lent = true;
    holds_cache = true;
    // Buffers of another device are of no use here.
    if (opt.buffers->impl_->device_ordinal != dmi.device) opt.buffers->clear();
    opt.buffers->impl_->device_ordinal = dmi.device;
  }
  max_tokens = max_toks;
  max_rows = max_toks;
  if (sharded) {
    max_rows = 0;
    for (const auto& p : shard.pieces) max_rows += p[1] - p[0];
  }
  chunk = std::min(o.chunk, max_rows);
  max_logit_rows = o.all_logits ? max_rows : 1;
  half = dmi.wdt != DType::kF32;
  SF_TRY(compute.create());
  SF_TRY(copy.create());

  const size_t f = sizeof(float), S = size_t(max_tokens), NL = size_t(max_rows), C = size_t(chunk);
  const size_t H = size_t(c.hidden), qd = size_t(c.n_heads) * size_t(c.head_dim),
               kvd = size_t(c.n_kv_heads) * size_t(c.head_dim), I = size_t(c.intermediate),
               vocab = size_t(c.vocab);
  SF_TRY(alloc(tokens, NL * sizeof(int32_t)));
  SF_TRY(alloc(x, NL * H * f));
  SF_TRY(alloc(q, NL * qd * f));
  SF_TRY(alloc(att, NL * qd * f));
  SF_TRY(alloc(lse, NL * size_t(c.n_heads) * f));
  SF_TRY(alloc(part, NL * H * f));
  SF_TRY(alloc(xn, C * H * f));
  SF_TRY(alloc(gate, C * I * f));
  SF_TRY(alloc(up, C * I * f));
  if (half) SF_TRY(alloc(xh, C * std::max({H, qd, I}) * dtype_size(dmi.wdt)));
  attn_bf16 = dmi.wdt == DType::kBF16 && kernels::cuda::attention_dense_bf16_available().is_ok();
  if (attn_bf16) {
    SF_TRY(alloc(qh, NL * qd * 2));
    SF_TRY(alloc(kh, S * kvd * 2));
    SF_TRY(alloc(vh, S * kvd * 2));
    SF_TRY(alloc(atth, NL * qd * 2));
  }
  if (shard.exchanges()) {
    if (attn_bf16) {
      SF_TRY(alloc(kh_loc, NL * kvd * 2));
      SF_TRY(alloc(vh_loc, NL * kvd * 2));
    } else {
      SF_TRY(alloc(k_all, S * kvd * f));
      SF_TRY(alloc(v_all, S * kvd * f));
    }
  }
  kv_bf16 = o.kv_host_bf16;
  const bool host_kv = o.keep_kv || bool(o.on_layer_kv);  // as in forward()
  const int kv_slots = host_kv || bool(o.on_layer_kv_device) ? 2 : 1;
  for (int s = 0; s < kv_slots; ++s) {
    SF_TRY(alloc(k[s], NL * kvd * f));
    SF_TRY(alloc(v[s], NL * kvd * f));
    if (kv_bf16) SF_TRY(alloc(kv16[s], 2 * NL * kvd * sizeof(uint16_t)));
  }
  const size_t logit_chunk = std::min(C, size_t(max_logit_rows));
  const int logit_slots = size_t(max_logit_rows) > logit_chunk ? 2 : 1;
  for (int s = 0; s < logit_slots; ++s) SF_TRY(alloc(logits[s], logit_chunk * vocab * f));
  {
    // Each row's place in the prompt (RoPE): 0..S-1, or the shard's pieces.
    std::vector<int32_t> where;
    where.reserve(NL);
    for (const auto& p : pieces(max_tokens))
      for (int64_t i = p[0]; i < p[1]; ++i) where.push_back(int32_t(i));
    SF_TRY(positions.alloc(NL * sizeof(int32_t)));
    SF_TRY(positions.upload(where.data(), NL * sizeof(int32_t)));
    ws_bytes += NL * sizeof(int32_t);
  }

  SF_TRY(alloc_host(h_tokens, NL * sizeof(int32_t)));
  SF_TRY(alloc_host(h_logits, size_t(max_logit_rows) * vocab * f));
  SF_ENSURE(o.sparse_max_grows >= 0, kInvalidArgument,
            "device prefill: sparse_max_grows must be >= 0, got " +
                std::to_string(o.sparse_max_grows));
  SF_ENSURE(o.sparse_capacity[0] >= 0 && o.sparse_capacity[1] >= 0, kInvalidArgument,
            "device prefill: sparse_capacity must be >= 0, got {" +
                std::to_string(o.sparse_capacity[0]) + ", " + std::to_string(o.sparse_capacity[1]) +
                "}");
  SF_ENSURE(o.kv_staging_layers >= 0 && o.kv_staging_max_bytes >= 0, kInvalidArgument,
            "device prefill: kv_staging_layers and kv_staging_max_bytes must be >= 0, got " +
                std::to_string(o.kv_staging_layers) + " and " +
                std::to_string(o.kv_staging_max_bytes));
  // A ring of fewer slots than layers only for the result alone: a per-layer host hook or device
  // sink (tiering, which may take long over a layer) keeps a slot per layer, so the device never
  // waits for it. Nor with overlapped TP sums and no DeviceShard::copy_wait_timeout_s: a layer's
  // copy waits on them, and only the communicator's wait after the last layer would have a
  // deadline.
  kv_stage = o.on_layer_kv || o.on_layer_kv_device ||
                     (shard.reduce_tp_enqueue && !(shard.copy_wait_timeout_s > 0))
                 ? c.n_layers
                 : kv_staging_slots(o, c.n_layers,
                                    2 * NL * kvd * int64_t(kv_bf16 ? sizeof(uint16_t) : f));
  if (host_kv)
    SF_TRY(alloc_host(h_kv, size_t(kv_stage) * 2 * NL * kvd * (kv_bf16 ? sizeof(uint16_t) : f)));
  imp_here = o.importance_window > 0 && (!sharded || shard.pieces.back()[1] == max_tokens);
  // The CUDA kernel's pool limit, checked here so a shard's group agrees on it at plan time.
  SF_ENSURE(o.importance_window == 0 ||
                (o.importance_pool >= 1 && o.importance_pool <= 65 && o.importance_pool % 2 == 1),
            kInvalidArgument,
            "device prefill: importance_pool must be odd and in [1, 65], got " +
                std::to_string(o.importance_pool));
  if (imp_here) {
    SF_TRY(alloc(imp, size_t(c.n_kv_heads) * S * f));
    if (o.sparse) {
      const size_t wn = std::min(size_t(o.importance_window), S);
      SF_TRY(alloc(imp_o, wn * qd * f));
      SF_TRY(alloc(imp_lse, wn * size_t(c.n_heads) * f));
    }
    SF_TRY(alloc_host(h_imp, size_t(c.n_layers) * size_t(c.n_kv_heads) * S * f));
  }

  for (int s = 0; s < 2; ++s) {
    SF_TRY(kv_ready[s].create(false));
    SF_TRY(kv_free[s].create(false));
    SF_TRY(logits_ready[s].create(false));
    SF_TRY(logits_free[s].create(false));
  }
  SF_TRY(layers_begin.create(true));
  SF_TRY(tp_ready.create(false));
  SF_TRY(tp_done.create(false));
  // Per-layer events: timing ones around kernels, ordering-only ones for copies.
  const auto add_event = [](std::vector<CudaEvent>& v, bool timing) {
    v.emplace_back();
    return v.back().create(timing);
  };
  for (int l = 0; l < c.n_layers; ++l) {
    SF_TRY(add_event(kv_copied, false));
    SF_TRY(add_event(att_begin, true));
    SF_TRY(add_event(att_end, true));
    SF_TRY(add_event(layer_end, true));
    if (imp_here) {
      SF_TRY(add_event(imp_begin, true));
      SF_TRY(add_event(imp_end, true));
      SF_TRY(add_event(imp_copied, false));
    }
  }

  use_sparse =
      o.sparse && max_tokens >= o.sparse->dense_below && !sparse_config_is_dense(*o.sparse);
  if (use_sparse) {
    const auto s0 = Clock::now();
    const double dev0 = times.device_buffers_s;
    SF_TRY(plan_sparse(o.sparse_capacity[0], o.sparse_capacity[1]));
    times.sparse_s = seconds_since(s0) - (times.device_buffers_s - dev0);
  }
  // What the cache holds that this plan did not take is sized for another plan: free it now
  // rather than hold it to the next.
  if (holds_cache) {
    opt.buffers->impl_->device.clear();
    opt.buffers->impl_->host.clear();
  }

  // Walk the forward of max_tokens tokens once without enqueueing: every GEMM shape (full and
  // tail chunks, exact pointers and so alignments) and every attention shape gets its cuBLASLt
  // algorithm or cuDNN graph now.
  const auto d0 = Clock::now();
  dry = true;
  SF_TRY(forward({}, max_tokens, nullptr));
  dry = false;
  times.shapes_s = seconds_since(d0);
  SF_CUDA_TRY(cudaStreamSynchronize(compute.get()));  // the poisoning memsets
  plan_s = seconds_since(t0);
  times.total_s = plan_s;
  return Status::ok();
}

Status DevicePrefill::Impl::grow_sparse(int max_blocks, int max_cols) {
  SF_CUDA_TRY(cudaStreamSynchronize(compute.get()));  // the old arena's last readers
  const size_t before = est_ws.size() + est_index.size();
  // A quarter more than asked, in whole 64-entry steps: later layers' (and later runs') needs
  // may differ a little.
  auto room = [](int need, int cap) {
    return std::max(cap, int((int64_t(need) * 5 / 4 + 63) / 64 * 64));
  };
  sparse_broken = true;  // until the re-plan below succeeds whole
  const PlanTimes setup_times = times;  // plan_times() describes the setup, not later grows
  SF_TRY(plan_sparse(room(max_blocks, cap_blocks), room(max_cols, cap_cols)));
  times = setup_times;
  sparse_broken = false;
  ws_bytes -= before;                                 // alloc() counted the new arena
  SF_CUDA_TRY(cudaStreamSynchronize(compute.get()));  // the new arena's poisoning
  return Status::ok();
}

Status DevicePrefill::Impl::plan_sparse(int min_blocks, int min_cols) {
  const ModelConfig& c = m->cfg;
  const int64_t hq = c.n_heads, hkv = c.n_kv_heads, d = c.head_dim;
  const int64_t h0 = int64_t(m->slice.index) * hq;  // this TP slice's heads in the config
  const DType adt = attn_bf16 ? DType::kBF16 : DType::kF32;
  const auto pcs = pieces(max_tokens);
  est.clear();
  est.resize(size_t(c.n_layers) * pcs.size());
  size_t ws_max = 0, ix_max = 0;
  est_ws.reset();  // a re-plan frees the old arena before sizing the new one
  est_index.reset();
  auto plan_all = [&](const kernels::cuda::EstimateMemory& mem) -> Status {
    for (int l = 0; l < c.n_layers; ++l) {
      const auto& lp = opt.sparse->layers[size_t(l)];
      const std::vector<kernels::HeadPattern> ps(lp.begin() + h0, lp.begin() + h0 + hq);
      for (size_t j = 0; j < pcs.size(); ++j) {
        const int64_t b = pcs[j][0], e = pcs[j][1];
        // Shapes only: the plan binds q and k at each run.
        const TensorView qv = dview(nullptr, adt, {e - b, hq, d});
        const TensorView kv = dview(nullptr, adt, {e, hkv, d});
        kernels::cuda::SparseEstimatePlan& p = est[size_t(l) * pcs.size() + j];
        // Capacity: the estimator's default for this piece, raised to what a run needed.
        int nb = min_blocks, nc = min_cols;
        if (nb > 0 || nc > 0) {
          kernels::cuda::SparseEstimatePlan probe;
          kernels::cuda::EstimateMemory size_only;
          size_only.size_only = true;
          SF_TRY(kernels::cuda::sparse_estimate_plan(qv, kv, ps, b, 0, 0, &probe, &size_only));
          nb = std::max(nb, probe.launch.max_blocks);
          nc = std::max(nc, probe.launch.max_cols);
        }
        const Status s = kernels::cuda::sparse_estimate_plan(qv, kv, ps, b, nb, nc, &p, &mem);
        if (!s.is_ok())
          return Status(s.code(), "device prefill: layer " + std::to_string(l) + ": " + s.message(),
                        __FILE__, __LINE__);
        cap_blocks =
            cap_blocks == 0 ? p.launch.max_blocks : std::min(cap_blocks, p.launch.max_blocks);
        cap_cols = cap_cols == 0 ? p.launch.max_cols : std::min(cap_cols, p.launch.max_cols);
        ws_max = std::max(ws_max, p.workspace_bytes);
        ix_max = std::max(ix_max, p.index_bytes);
      }
    }
    return Status::ok();
  };
  kernels::cuda::EstimateMemory sizing;
  sizing.size_only = true;
  SF_TRY(plan_all(sizing));
  cap_blocks = cap_cols = 0;  // the capacities of the real plans below
  SF_TRY(alloc(est_ws, ws_max));
  SF_TRY(alloc(est_index, ix_max));
  SF_TRY(plan_all(kernels::cuda::EstimateMemory{est_ws.as<char>(), ws_max, est_index.as<char>(),
                                                ix_max, false}));
  // A grow during a run keeps what does not depend on the capacity: the layers' pair counts
  // (earlier layers' are summed already), the events (earlier layers' timings) and the need
  // records.
  if (!pairs.data()) SF_TRY(alloc(pairs, size_t(c.n_layers) * sizeof(unsigned long long)));
  while (est_begin.size() < est.size()) {
    est_begin.emplace_back();
    SF_TRY(est_begin.back().create(true));
    est_end.emplace_back();
    SF_TRY(est_end.back().create(true));
  }
  while (need_ready.size() < size_t(c.n_layers)) {
    need_ready.emplace_back();
    SF_TRY(need_ready.back().create(false));
  }
  if (h_need.size() < est.size() * 2 * sizeof(int32_t))
    SF_TRY(h_need.alloc(est.size() * 2 * sizeof(int32_t)));
  // Causal pairs of one layer: a piece [b, e) has rows b..e-1, row t seeing keys [0, t].
  causal_pairs = 0;
  for (const auto& p : pcs) {
    const double n = double(p[1] - p[0]);
    causal_pairs += n * double(p[0]) + n * (n + 1) / 2;
  }
  causal_pairs *= double(hq);
  return Status::ok();
}

Result<DevicePrefill> DevicePrefill::plan(const DeviceModel& dm, int64_t max_tokens,
                                          const PrefillOptions& opt) {
  DevicePrefill p;
  p.impl_ = std::make_unique<Impl>();
  SF_TRY(p.impl_->setup(*dm.impl_, max_tokens, opt));
  return p;
}

Result<DevicePrefill> DevicePrefill::plan_shard(const DeviceModel& dm, DeviceShard shard,
                                                const PrefillOptions& opt) {
  const int64_t S = shard.n_tokens;
  SF_ENSURE(S > 0 && !shard.pieces.empty(), kInvalidArgument,
            "device prefill shard: needs a positive n_tokens and at least one piece");
  int64_t prev = 0, NL = 0;
  for (const auto& p : shard.pieces) {
    SF_ENSURE(p[0] >= prev && p[0] < p[1] && p[1] <= S, kInvalidArgument,
              "device prefill shard: piece [" + std::to_string(p[0]) + ", " + std::to_string(p[1]) +
                  ") is empty, out of order or outside the " + std::to_string(S) + "-token prompt");
    prev = p[1];
    NL += p[1] - p[0];
  }
  SF_ENSURE(NL == S || shard.exchanges(), kInvalidArgument,
            "device prefill shard: a rank that holds part of the prompt needs exchange_kv");
  SF_ENSURE(shard.kv_lead_rows == 0 ||
                (shard.kv_lead_rows > 0 && shard.fill_kv_lead && opt.keep_kv &&
                 shard.kv_lead_rows + NL <= S),
            kInvalidArgument,
            "device prefill shard: kv_lead_rows needs fill_kv_lead, keep_kv and at most the "
            "prompt's rows beside the shard's own");
  SF_ENSURE(!opt.all_logits && !opt.on_layer_kv, kUnsupported,
            "device prefill shard: all_logits and the per-layer KV hook are single-device only");
  SF_ENSURE(shard.kv_lead_rows == 0 || !opt.kv_host_bf16, kUnsupported,
            "device prefill shard: kv_lead_rows are filled as F32; not with kv_host_bf16");
  // Importance comes from the piece that ends the prompt: the window's rows must all be in it.
  const int64_t last_rows = shard.pieces.back()[1] - shard.pieces.back()[0];
  SF_ENSURE(opt.importance_window == 0 || shard.pieces.back()[1] != S ||
                last_rows >= std::min<int64_t>(opt.importance_window, S),
            kUnsupported,
            "device prefill shard: the importance window (" +
                std::to_string(opt.importance_window) + " rows) is longer than the last piece (" +
                std::to_string(last_rows) + " rows); use a longer prompt or fewer CP ranks");
  DevicePrefill p;
  p.impl_ = std::make_unique<Impl>();
  p.impl_->sharded = true;
  p.impl_->shard = std::move(shard);
  SF_TRY(p.impl_->setup(*dm.impl_, S, opt));
  return p;
}

Result<PrefillResult> DevicePrefill::run(std::span<const int32_t> tokens) {
  const auto t0 = Clock::now();
  Impl& w = *impl_;
  const ModelConfig& c = w.m->cfg;
  const int64_t S = int64_t(tokens.size());
  SF_ENSURE(S > 0, kInvalidArgument, "prefill: empty prompt");
  SF_ENSURE(S <= w.max_tokens, kInvalidArgument,
            "device prefill: " + std::to_string(S) + " tokens, the plan holds at most " +
                std::to_string(w.max_tokens));
  SF_ENSURE(!w.sharded || S == w.max_tokens, kInvalidArgument,
            "device prefill shard: " + std::to_string(S) + " tokens, the shard was planned for " +
                std::to_string(w.max_tokens));
  SF_ENSURE(!w.use_sparse || S == w.max_tokens, kInvalidArgument,
            "device prefill: sparse attention runs at the planned length (" +
                std::to_string(w.max_tokens) + " tokens), got " + std::to_string(S) +
                "; plan for this length");
  for (int64_t i = 0; i < S; ++i)
    if (tokens[size_t(i)] < 0 || tokens[size_t(i)] >= c.vocab)
      return SF_ERR(kOutOfRange, "prefill: token id " + std::to_string(tokens[size_t(i)]) +
                                     " at position " + std::to_string(i) + " outside vocab " +
                                     std::to_string(c.vocab));
  SF_CUDA_TRY(cudaSetDevice(w.m->device));
  // A failed earlier run may have left work in flight on the shared buffers.
  SF_CUDA_TRY(cudaStreamSynchronize(w.compute.get()));
  SF_CUDA_TRY(cudaStreamSynchronize(w.copy.get()));
  PrefillResult res;
  // A failed run hands its K/V to kv_hooks.failed (whose caller may still read published rows)
  // instead of freeing it as it returns, after a device KV sink has dropped the layers it holds
  // unplaced (while the copy stream still exists).
  struct HandOver {
    PrefillResult& r;
    const std::function<void(KvCache&&)>& failed;
    const std::function<void()>& abandon;
    bool ok = false;
    ~HandOver() {
      if (ok) return;
      if (abandon) abandon();
      if (failed) failed(std::move(r.kv));
    }
  } hand{res, w.opt.kv_hooks.failed, w.opt.on_layer_kv_device.abandon};
  w.idle = false;
  SF_TRY(w.forward(tokens, S, &res));
  w.idle = true;
  hand.ok = true;
  res.seconds = seconds_since(t0);
  return res;
}

std::array<int, 2> DevicePrefill::sparse_need() const {
  return {impl_->need_blocks, impl_->need_cols};
}
std::array<int, 2> DevicePrefill::sparse_capacity() const {
  if (!impl_->use_sparse) return {0, 0};
  return {impl_->cap_blocks, impl_->cap_cols};
}

DeviceModel::Views DeviceModel::views() const {
  const Impl& m = *impl_;
  Views v;
  v.tok_embd = m.tok_embd.view;
  v.out_norm = m.out_norm.view;
  v.lm_head = m.lm_head.view;
  v.rope_freqs = m.rope_freqs.empty() ? nullptr : m.rope_freqs.data();
  for (const Impl::Layer& L : m.layers)
    v.layers.push_back({L.attn_norm.view, L.wq.view, L.wk.view, L.wv.view, L.bq.view, L.bk.view,
                        L.bv.view, L.wo.view, L.ffn_norm.view, L.w_gate.view, L.w_up.view,
                        L.w_down.view});
  return v;
}

std::vector<double> DevicePrefill::layer_seconds() const {
  const Impl& w = *impl_;
  std::vector<double> out;
  cudaEvent_t prev = w.layers_begin.get();
  for (const CudaEvent& e : w.layer_end) {
    float ms = 0.f;
    // Before any run (or after a failed one) the events never fired: no figures (and the error
    // is cleared, not left for the next launch's check to report as its own).
    if (cudaEventElapsedTime(&ms, prev, e.get()) != cudaSuccess) {
      (void)cudaGetLastError();
      return {};
    }
    out.push_back(double(ms) * 1e-3);
    prev = e.get();
  }
  return out;
}

#else  // !SF_HAVE_CUDA: the same interface, every entry point reports the missing backend.

struct DeviceModel::Impl {
  ModelConfig cfg, full_cfg;
  TpSlice slice;
  DType wdt = DType::kBF16;
  int device = 0;
  std::string device_name;
  size_t bytes = 0;
};

struct DevicePrefill::Impl {
  int64_t max_tokens = 0;
  size_t ws_bytes = 0;
  double plan_s = 0, hook_s = 0;
  PlanTimes times;
  bool attn_bf16 = false;
};

struct DeviceBufferCache::Impl {};
DeviceBufferCache::DeviceBufferCache() : impl_(std::make_unique<Impl>()) {}
DeviceBufferCache::~DeviceBufferCache() = default;
size_t DeviceBufferCache::device_bytes_held() const { return 0; }
size_t DeviceBufferCache::host_bytes_held() const { return 0; }
void DeviceBufferCache::clear() {}

namespace {
Status no_cuda() {
  return SF_ERR(kUnsupported, "built without CUDA (configure with -DSF_CUDA=ON)");
}
}  // namespace

Status cuda_device_check(int) { return no_cuda(); }
Result<DeviceModel> DeviceModel::upload(const Model&, DType, int, TpSlice) { return no_cuda(); }
Result<DeviceModel> DeviceModel::synthetic(const ModelConfig&, uint64_t, DType, int, TpSlice) {
  return no_cuda();
}
Result<DevicePrefill> DevicePrefill::plan(const DeviceModel&, int64_t, const PrefillOptions&) {
  return no_cuda();
}
Result<DevicePrefill> DevicePrefill::plan_shard(const DeviceModel&, DeviceShard,
                                                const PrefillOptions&) {
  return no_cuda();
}
Result<PrefillResult> DevicePrefill::run(std::span<const int32_t>) { return no_cuda(); }
std::vector<double> DevicePrefill::layer_seconds() const { return {}; }
std::array<int, 2> DevicePrefill::sparse_need() const { return {0, 0}; }
DeviceModel::Views DeviceModel::views() const { return {}; }
std::array<int, 2> DevicePrefill::sparse_capacity() const { return {0, 0}; }

#endif  // SF_HAVE_CUDA

DeviceModel::DeviceModel() = default;
DeviceModel::DeviceModel(DeviceModel&&) noexcept = default;
DeviceModel& DeviceModel::operator=(DeviceModel&&) noexcept = default;
DeviceModel::~DeviceModel() = default;
const ModelConfig& DeviceModel::config() const { return impl_->cfg; }
const ModelConfig& DeviceModel::full_config() const { return impl_->full_cfg; }
TpSlice DeviceModel::slice() const { return impl_->slice; }
DType DeviceModel::weight_dtype() const { return impl_->wdt; }
const char* DevicePrefill::attention_kernel() const {
  return impl_->attn_bf16 ? "cuDNN fused flash attention, bf16 q/k/v" : "f32 reference kernel";
}
DType DevicePrefill::attention_dtype() const {
  return impl_->attn_bf16 ? DType::kBF16 : DType::kF32;
}
int DeviceModel::device() const { return impl_->device; }
const std::string& DeviceModel::device_name() const { return impl_->device_name; }
size_t DeviceModel::weight_bytes() const { return impl_->bytes; }

DevicePrefill::DevicePrefill() = default;
DevicePrefill::DevicePrefill(DevicePrefill&&) noexcept = default;
DevicePrefill& DevicePrefill::operator=(DevicePrefill&&) noexcept = default;
DevicePrefill::~DevicePrefill() = default;
int64_t DevicePrefill::max_tokens() const { return impl_->max_tokens; }
size_t DevicePrefill::workspace_bytes() const { return impl_->ws_bytes; }
double DevicePrefill::plan_seconds() const { return impl_->plan_s; }
PlanTimes DevicePrefill::plan_times() const { return impl_->times; }
double DevicePrefill::hook_seconds() const { return impl_->hook_s; }

Result<PrefillResult> prefill_device(const DeviceModel& dm, std::span<const int32_t> tokens,
                                     const PrefillOptions& opt) {
  if (tokens.empty()) return SF_ERR(kInvalidArgument, "prefill: empty prompt");
  SF_ASSIGN(DevicePrefill p, DevicePrefill::plan(dm, int64_t(tokens.size()), opt));
  return p.run(tokens);
}

}  // namespace sf::model
