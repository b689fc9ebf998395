// DeviceModel and DevicePrefill (see device_model.h): weights upload, the plan step (streams,
// events, workspace, GEMM algorithms) and the run step (enqueue only, one wait at the end).
#include "worker/model/device_model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <vector>

#if SF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/thread_pool.h"
#include "kernels/api.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/kv_importance.h"
#endif

namespace sf::model {

#if SF_HAVE_CUDA
namespace {

using kernels::cuda::DeviceBuffer;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

TensorView dview(void* p, DType t, std::initializer_list<int64_t> dims) {
  return TensorView::make(p, t, dims, Device::kCuda);
}

// A weight on the device: its buffer and the view the kernels read (view.data is null when the
// model has no such tensor, e.g. biases of Llama; kernels treat that as "none").
struct DevTensor {
  DeviceBuffer buf;
  TensorView view;
};

Status upload_tensor(const OwnedTensor& t, DType dtype, const char* name, DevTensor* out) {
  if (t.empty()) return Status::ok();
  SF_ENSURE(!t.shape.empty() && t.shape.size() <= 2, kInvalidArgument,
            std::string("device upload: tensor ") + name + " must be 1-D or 2-D");
  const size_t n = t.data.size();
  SF_TRY(out->buf.alloc(n * dtype_size(dtype)));
  if (dtype == DType::kF32) {
    SF_TRY(out->buf.upload(t.data.data(), n * sizeof(float)));
  } else {
    std::vector<uint16_t> half(n);
    const float* src = t.data.data();
    parallel_for(
        n,
        [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) half[i] = f32_to_bf16(src[i]);
        },
        size_t(1) << 16);
    SF_TRY(out->buf.upload(half.data(), n * sizeof(uint16_t)));
  }
  TensorView v;
  v.data = out->buf.data();
  v.dtype = dtype;
  v.device = Device::kCuda;
  v.ndim = int(t.shape.size());
  int64_t stride = 1;
  for (int k = v.ndim - 1; k >= 0; --k) {
    v.shape[size_t(k)] = t.shape[size_t(k)];
    v.stride[size_t(k)] = stride;
    stride *= t.shape[size_t(k)];
  }
  SF_ENSURE(
      stride == int64_t(n), kInvalidArgument,
      std::string("device upload: tensor ") + name + " has a shape that does not match its data");
  out->view = v;
  return Status::ok();
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
  ~PinnedBuffer() {
    if (p_) (void)cudaFreeHost(p_);
  }
  Status alloc(size_t bytes) {
    if (bytes == 0) return Status::ok();
    SF_CUDA_TRY(cudaMallocHost(&p_, bytes));
    bytes_ = bytes;
    return Status::ok();
  }
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

struct DeviceModel::Impl {
  ModelConfig cfg;
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
};

struct DevicePrefill::Impl {
  const DeviceModel::Impl* m = nullptr;
  PrefillOptions opt;
  int64_t max_tokens = 0, chunk = 0, max_logit_rows = 0;
  bool half = false;  // linear inputs are cast to the weight dtype first
  // BF16 weights and a cuDNN build: attention runs on BF16 copies of Q, K, V (cuDNN's fused
  // kernel, fp32 softmax and accumulation) and its output is widened back to F32. F32 weights
  // keep the F32 reference kernel (the bit-for-bit path the f32 tests bound at 1e-5).
  bool attn_bf16 = false;
  double plan_s = 0;
  size_t ws_bytes = 0;

  CudaStream compute, copy;
  // Device workspace. x: residual [S, H]; q, att: [S, hq*d]; lse: [hq, S]; per chunk C: xn, tmp
  // [C, H], gate, up [C, I], xh [C, max(H, hq*d, I)] in the weight dtype. K/V: two slots of
  // [S, hkv*d] used by alternate layers; logits: two slots of [C, vocab].
  DeviceBuffer tokens, positions, x, q, att, lse, xn, xh, tmp, gate, up;
  DeviceBuffer qh, kh, vh, atth;  // attn_bf16: BF16 [S, hq*d] / [S, hkv*d] / [S, hq*d]
  DeviceBuffer k[2], v[2], logits[2];
  CudaEvent kv_ready[2], kv_free[2], logits_ready[2], logits_free[2];
  std::vector<CudaEvent> kv_copied;           // per layer, on the copy stream
  std::vector<CudaEvent> att_begin, att_end;  // per layer, timing the attention kernel
  // importance_window > 0: one layer's SnapKV scores [hkv, S] on the device, every layer's in
  // pinned host memory (copied on the compute stream after each layer), and their timing.
  DeviceBuffer imp;
  std::vector<CudaEvent> imp_begin, imp_end, imp_copied;
  PinnedBuffer h_tokens, h_kv, h_logits, h_imp;
  bool dry = false;  // forward() walks the ops but only plans the GEMMs

  ~Impl() {
    // An error path may leave work in flight on buffers about to be freed.
    (void)cudaSetDevice(m ? m->device : 0);
    if (compute.get()) (void)cudaStreamSynchronize(compute.get());
    if (copy.get()) (void)cudaStreamSynchronize(copy.get());
  }

  kernels::Stream cs() const { return kernels::Stream{Device::kCuda, compute.get()}; }

  Status alloc(DeviceBuffer& b, size_t bytes) {
    SF_TRY(b.alloc(bytes));
    ws_bytes += bytes;
    // All-ones bytes are NaN as F32/BF16: a read of an element no kernel wrote shows in the
    // output instead of passing as a plausible value.
    if (bytes) SF_CUDA_TRY(cudaMemsetAsync(b.data(), 0xFF, bytes, compute.get()));
    return Status::ok();
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

  Status forward(std::span<const int32_t> ids, int64_t S, PrefillResult* res);
};

Status DevicePrefill::Impl::forward(std::span<const int32_t> ids, int64_t S, PrefillResult* res) {
  const ModelConfig& c = m->cfg;
  const int64_t H = c.hidden, hq = c.n_heads, hkv = c.n_kv_heads, d = c.head_dim,
                I = c.intermediate, vocab = c.vocab, qd = hq * d, kvd = hkv * d;
  const int64_t C = std::min(chunk, S);
  const bool keep_kv = opt.keep_kv;
  // Host copies of each layer's K/V: for the result (keep_kv) and for the per-layer hook.
  const bool host_kv = keep_kv || bool(opt.on_layer_kv);
  const cudaStream_t st = compute.get(), cp = copy.get();
  float* const X = x.as<float>();
  float* const Q = q.as<float>();
  float* const ATT = att.as<float>();
  const int32_t* const pos = positions.as<int32_t>();
  kernels::RopeParams rope = c.rope;
  if (!m->rope_freqs.empty()) rope.freq_factors = m->rope_freqs.data();
  kernels::AttentionParams ap;
  ap.causal = true;
  ap.q_offset = 0;
  const DevTensor none;

  if (!dry) {
    std::memcpy(h_tokens.as<int32_t>(), ids.data(), size_t(S) * sizeof(int32_t));
    SF_CUDA_TRY(cudaMemcpyAsync(tokens.data(), h_tokens.as<int32_t>(), size_t(S) * sizeof(int32_t),
                                cudaMemcpyHostToDevice, st));
    SF_TRY(kernels::embedding(m->tok_embd.view, tokens.as<int32_t>(), S,
                              dview(X, DType::kF32, {S, H}), cs()));
  }

  for (int l = 0; l < c.n_layers; ++l) {
    const DeviceModel::Impl::Layer& L = m->layers[size_t(l)];
    const int slot = host_kv ? l % 2 : 0;
    // Slot reuse: layer l writes the slot layer l-2 used; its copy-out must have finished.
    if (!dry && host_kv && l >= 2) SF_CUDA_TRY(cudaStreamWaitEvent(st, kv_free[slot].get(), 0));
    float* const K = k[slot].as<float>();
    float* const V = v[slot].as<float>();

    // 1) norm, QKV, RoPE per chunk.
    for (int64_t c0 = 0; c0 < S; c0 += C) {
      const int64_t n = std::min(C, S - c0);
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
    if (!dry && host_kv) {
      SF_TRY(stream_after(cp, st, kv_ready[slot].get()));
      const size_t bytes = size_t(S * kvd) * sizeof(float);
      float* const hk = h_kv.as<float>() + size_t(2 * l) * size_t(max_tokens * kvd);
      float* const hv = hk + size_t(max_tokens * kvd);
      SF_CUDA_TRY(cudaMemcpyAsync(hk, K, bytes, cudaMemcpyDeviceToHost, cp));
      SF_CUDA_TRY(cudaMemcpyAsync(hv, V, bytes, cudaMemcpyDeviceToHost, cp));
      SF_CUDA_TRY(cudaEventRecord(kv_free[slot].get(), cp));
      SF_CUDA_TRY(cudaEventRecord(kv_copied[size_t(l)].get(), cp));
    }

    // 2) attention over all rows.
    if (attn_bf16) {
      const TensorView qb = dview(qh.data(), DType::kBF16, {S, hq, d});
      const TensorView kb = dview(kh.data(), DType::kBF16, {S, hkv, d});
      const TensorView vb = dview(vh.data(), DType::kBF16, {S, hkv, d});
      const TensorView ob = dview(atth.data(), DType::kBF16, {S, hq, d});
      if (dry) {
        SF_TRY(kernels::cuda::attention_dense_plan(qb, kb, vb, ob, ap));
      } else {
        SF_CUDA_TRY(cudaEventRecord(att_begin[size_t(l)].get(), st));
        SF_TRY(kernels::cast(dview(Q, DType::kF32, {S, hq, d}), qb, cs()));
        SF_TRY(kernels::cast(dview(K, DType::kF32, {S, hkv, d}), kb, cs()));
        SF_TRY(kernels::cast(dview(V, DType::kF32, {S, hkv, d}), vb, cs()));
        SF_TRY(kernels::attention_dense(qb, kb, vb, ob, dview(lse.data(), DType::kF32, {hq, S}), ap,
                                        cs()));
        SF_TRY(kernels::cast(ob, dview(ATT, DType::kF32, {S, hq, d}), cs()));
        SF_CUDA_TRY(cudaEventRecord(att_end[size_t(l)].get(), st));
      }
    } else if (!dry) {
      SF_CUDA_TRY(cudaEventRecord(att_begin[size_t(l)].get(), st));
      SF_TRY(kernels::attention_dense(
          dview(Q, DType::kF32, {S, hq, d}), dview(K, DType::kF32, {S, hkv, d}),
          dview(V, DType::kF32, {S, hkv, d}), dview(ATT, DType::kF32, {S, hq, d}),
          dview(lse.data(), DType::kF32, {hq, S}), ap, cs()));
      SF_CUDA_TRY(cudaEventRecord(att_end[size_t(l)].get(), st));
    }

    // 2b) SnapKV importance of the last importance_window queries, from this layer's LSE
    // (kernels/kv_importance.h), on the F32 Q and K (with bf16 attention the LSE is of the
    // rounded copies; the kernel caps each recomputed score at its row's LSE).
    if (!dry && opt.importance_window > 0) {
      kernels::ImportanceParams ip;
      ip.window = opt.importance_window;
      ip.pool = opt.importance_pool;
      ip.scale = ap.scale;
      ip.q_offset = ap.q_offset;
      SF_CUDA_TRY(cudaEventRecord(imp_begin[size_t(l)].get(), st));
      SF_TRY(kernels::kv_importance(dview(Q, DType::kF32, {S, hq, d}),
                                    dview(K, DType::kF32, {S, hkv, d}),
                                    dview(lse.data(), DType::kF32, {hq, S}), ip,
                                    dview(imp.data(), DType::kF32, {hkv, S}), cs()));
      SF_CUDA_TRY(cudaEventRecord(imp_end[size_t(l)].get(), st));
      SF_CUDA_TRY(cudaMemcpyAsync(h_imp.as<float>() + size_t(l) * size_t(hkv * max_tokens),
                                  imp.data(), size_t(hkv * S) * sizeof(float),
                                  cudaMemcpyDeviceToHost, st));
      SF_CUDA_TRY(cudaEventRecord(imp_copied[size_t(l)].get(), st));
    }

    // 3) O projection, residual, MLP per chunk.
    for (int64_t c0 = 0; c0 < S; c0 += C) {
      const int64_t n = std::min(C, S - c0);
      const TensorView xc = dview(X + c0 * H, DType::kF32, {n, H});
      const TensorView xnv = dview(xn.data(), DType::kF32, {n, H});
      const TensorView tv = dview(tmp.data(), DType::kF32, {n, H});
      const TensorView gv = dview(gate.data(), DType::kF32, {n, I});
      const TensorView uv = dview(up.data(), DType::kF32, {n, I});
      SF_ASSIGN(const TensorView in_o, gemm_input(dview(ATT + c0 * qd, DType::kF32, {n, qd})));
      SF_TRY(linear(in_o, L.wo, none, tv));
      if (!dry) {
        SF_TRY(kernels::add_inplace(xc, tv, cs()));
        SF_TRY(kernels::rms_norm(xc, L.ffn_norm.view, c.rms_eps, xnv, cs()));
      }
      SF_ASSIGN(const TensorView in_f, gemm_input(xnv));
      SF_TRY(linear(in_f, L.w_gate, none, gv));
      SF_TRY(linear(in_f, L.w_up, none, uv));
      if (!dry) SF_TRY(kernels::swiglu(gv, uv, gv, cs()));
      SF_ASSIGN(const TensorView in_d, gemm_input(gv));
      SF_TRY(linear(in_d, L.w_down, none, tv));
      if (!dry) SF_TRY(kernels::add_inplace(xc, tv, cs()));
    }
  }

  // Final norm + LM head on the requested rows, in chunks through two device slots, each copied
  // to pinned host memory on the copy stream.
  const int64_t row0 = opt.all_logits ? 0 : S - 1;
  const int64_t rows = S - row0;
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

  // The only waits of the run. Each layer's KV leaves pinned memory as soon as its copy is done,
  // while the device still computes later layers.
  KvCache& kv = res->kv;
  kv.n_layers = c.n_layers;
  kv.n_kv_heads = int(hkv);
  kv.head_dim = int(d);
  kv.n_tokens = S;
  kv.k.assign(keep_kv ? size_t(c.n_layers) : 0, {});
  kv.v.assign(keep_kv ? size_t(c.n_layers) : 0, {});
  // The per-layer hook (KV tiering) runs here, on the host thread, for each layer as soon as its
  // K/V (and importance) copies land, while the device computes later layers: every layer's
  // work is already enqueued, so the hook never holds the GPU back.
  if (host_kv) {
    for (int l = 0; l < c.n_layers; ++l) {
      SF_CUDA_TRY(cudaEventSynchronize(kv_copied[size_t(l)].get()));
      float* hk = h_kv.as<float>() + size_t(2 * l) * size_t(max_tokens * kvd);
      float* hv = hk + size_t(max_tokens * kvd);
      if (opt.on_layer_kv) {
        std::span<const float> imp_l;
        if (opt.importance_window > 0) {
          SF_CUDA_TRY(cudaEventSynchronize(imp_copied[size_t(l)].get()));
          imp_l = std::span<const float>(h_imp.as<float>() + size_t(l) * size_t(hkv * max_tokens),
                                         size_t(hkv * S));
        }
        SF_TRY(opt.on_layer_kv(l, TensorView::make(hk, DType::kF32, {S, hkv, d}),
                               TensorView::make(hv, DType::kF32, {S, hkv, d}), imp_l));
      }
      if (keep_kv) {
        kv.k[size_t(l)].assign(hk, hk + S * kvd);
        kv.v[size_t(l)].assign(hv, hv + S * kvd);
      }
    }
  }
  SF_CUDA_TRY(cudaStreamSynchronize(st));
  SF_CUDA_TRY(cudaStreamSynchronize(cp));
  res->n_logit_rows = rows;
  res->logits.assign(h_logits.as<float>(), h_logits.as<float>() + rows * vocab);
  const float* last = res->logits.data() + (rows - 1) * vocab;
  res->first_token = int32_t(std::max_element(last, last + vocab) - last);
  res->attention_s = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    float ms = 0.f;
    SF_CUDA_TRY(cudaEventElapsedTime(&ms, att_begin[size_t(l)].get(), att_end[size_t(l)].get()));
    res->attention_s += double(ms) * 1e-3;
  }
  res->kv_peak_bytes =
      host_kv ? int64_t(c.n_layers) * 2 * max_tokens * kvd * int64_t(sizeof(float)) : 0;
  res->importance_s = 0;
  res->importance.clear();
  if (opt.importance_window > 0) {
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

Result<DeviceModel> DeviceModel::upload(const Model& model, DType weight_dtype, int device) {
  SF_ENSURE(weight_dtype == DType::kBF16 || weight_dtype == DType::kF32, kUnsupported,
            std::string("device upload: weight dtype ") + dtype_name(weight_dtype) +
                " (supported: BF16, F32)");
  SF_TRY(cuda_device_check(device));
  const ModelConfig& c = model.config();
  SF_TRY(c.validate());
  SF_CUDA_TRY(cudaSetDevice(device));
  cudaDeviceProp prop{};
  SF_CUDA_TRY(cudaGetDeviceProperties(&prop, device));

  DeviceModel dm;
  dm.impl_ = std::make_unique<Impl>();
  Impl& m = *dm.impl_;
  m.cfg = c;
  m.wdt = weight_dtype;
  m.device = device;
  m.device_name = prop.name;
  const ModelWeights& w = model.weights();
  m.rope_freqs = w.rope_freqs.data;
  SF_ENSURE(w.layers.size() == size_t(c.n_layers), kInvalidArgument,
            "device upload: model has " + std::to_string(w.layers.size()) +
                " layers, config says " + std::to_string(c.n_layers));
  const DType f32 = DType::kF32, wd = weight_dtype;
  SF_TRY(upload_tensor(w.tok_embd, f32, "tok_embd", &m.tok_embd));
  SF_TRY(upload_tensor(w.out_norm, f32, "out_norm", &m.out_norm));
  if (w.lm_head.empty() && wd == f32) {
    m.lm_head.view = m.tok_embd.view;  // tied and same dtype: one copy serves both
  } else {
    SF_TRY(upload_tensor(model.output_weight(), wd, "lm_head", &m.lm_head));
  }
  m.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& s = w.layers[l];
    Impl::Layer& L = m.layers[l];
    SF_TRY(upload_tensor(s.attn_norm, f32, "attn_norm", &L.attn_norm));
    SF_TRY(upload_tensor(s.wq, wd, "wq", &L.wq));
    SF_TRY(upload_tensor(s.wk, wd, "wk", &L.wk));
    SF_TRY(upload_tensor(s.wv, wd, "wv", &L.wv));
    SF_TRY(upload_tensor(s.bq, f32, "bq", &L.bq));
    SF_TRY(upload_tensor(s.bk, f32, "bk", &L.bk));
    SF_TRY(upload_tensor(s.bv, f32, "bv", &L.bv));
    SF_TRY(upload_tensor(s.wo, wd, "wo", &L.wo));
    SF_TRY(upload_tensor(s.ffn_norm, f32, "ffn_norm", &L.ffn_norm));
    SF_TRY(upload_tensor(s.w_gate, wd, "w_gate", &L.w_gate));
    SF_TRY(upload_tensor(s.w_up, wd, "w_up", &L.w_up));
    SF_TRY(upload_tensor(s.w_down, wd, "w_down", &L.w_down));
    for (const DevTensor* t : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.bq, &L.bk, &L.bv, &L.wo,
                               &L.ffn_norm, &L.w_gate, &L.w_up, &L.w_down})
      m.bytes += t->buf.size();
  }
  m.bytes += m.tok_embd.buf.size() + m.out_norm.buf.size() + m.lm_head.buf.size();
  return dm;
}

Result<DevicePrefill> DevicePrefill::plan(const DeviceModel& dm, int64_t max_tokens,
                                          const PrefillOptions& opt) {
  const auto t0 = Clock::now();
  const DeviceModel::Impl& m = *dm.impl_;
  const ModelConfig& c = m.cfg;
  SF_ENSURE(max_tokens > 0, kInvalidArgument, "device prefill: max_tokens must be positive");
  SF_ENSURE(max_tokens <= INT32_MAX, kInvalidArgument,
            "device prefill: max_tokens exceeds the int32 positions");
  SF_ENSURE(opt.chunk > 0, kInvalidArgument, "device prefill: chunk must be positive");
  SF_ENSURE(opt.sparse == nullptr, kUnsupported,
            "device prefill: sparse attention is not implemented on CUDA yet (dense only); use the "
            "CPU forward for sparse attention modes");
  SF_ENSURE(!opt.on_attention, kUnsupported,
            "device prefill: attention observers read host tensors; use the CPU forward");
  SF_ENSURE(kernels::cuda::attention_dense_supported(c.head_dim), kUnsupported,
            "device prefill: head_dim " + std::to_string(c.head_dim) +
                " (CUDA attention supports 64 and 128)");
  SF_CUDA_TRY(cudaSetDevice(m.device));

  DevicePrefill p;
  p.impl_ = std::make_unique<Impl>();
  Impl& w = *p.impl_;
  w.m = &m;
  w.opt = opt;
  w.max_tokens = max_tokens;
  w.chunk = std::min(opt.chunk, max_tokens);
  w.max_logit_rows = opt.all_logits ? max_tokens : 1;
  w.half = m.wdt != DType::kF32;
  SF_TRY(w.compute.create());
  SF_TRY(w.copy.create());

  const size_t f = sizeof(float), S = size_t(max_tokens), C = size_t(w.chunk);
  const size_t H = size_t(c.hidden), qd = size_t(c.n_heads) * size_t(c.head_dim),
               kvd = size_t(c.n_kv_heads) * size_t(c.head_dim), I = size_t(c.intermediate),
               vocab = size_t(c.vocab);
  SF_TRY(w.alloc(w.tokens, S * sizeof(int32_t)));
  SF_TRY(w.alloc(w.x, S * H * f));
  SF_TRY(w.alloc(w.q, S * qd * f));
  SF_TRY(w.alloc(w.att, S * qd * f));
  SF_TRY(w.alloc(w.lse, S * size_t(c.n_heads) * f));
  SF_TRY(w.alloc(w.xn, C * H * f));
  SF_TRY(w.alloc(w.tmp, C * H * f));
  SF_TRY(w.alloc(w.gate, C * I * f));
  SF_TRY(w.alloc(w.up, C * I * f));
  if (w.half) SF_TRY(w.alloc(w.xh, C * std::max({H, qd, I}) * dtype_size(m.wdt)));
  w.attn_bf16 = m.wdt == DType::kBF16 && kernels::cuda::attention_dense_bf16_available().is_ok();
  if (w.attn_bf16) {
    SF_TRY(w.alloc(w.qh, S * qd * 2));
    SF_TRY(w.alloc(w.kh, S * kvd * 2));
    SF_TRY(w.alloc(w.vh, S * kvd * 2));
    SF_TRY(w.alloc(w.atth, S * qd * 2));
  }
  const bool host_kv = opt.keep_kv || bool(opt.on_layer_kv);  // as in forward()
  const int kv_slots = host_kv ? 2 : 1;
  for (int s = 0; s < kv_slots; ++s) {
    SF_TRY(w.alloc(w.k[s], S * kvd * f));
    SF_TRY(w.alloc(w.v[s], S * kvd * f));
  }
  const size_t logit_chunk = std::min(C, size_t(w.max_logit_rows));
  const int logit_slots = size_t(w.max_logit_rows) > logit_chunk ? 2 : 1;
  for (int s = 0; s < logit_slots; ++s) SF_TRY(w.alloc(w.logits[s], logit_chunk * vocab * f));
  {
    std::vector<int32_t> iota(S);
    for (size_t i = 0; i < S; ++i) iota[i] = int32_t(i);
    SF_TRY(w.positions.alloc(S * sizeof(int32_t)));
    SF_TRY(w.positions.upload(iota.data(), S * sizeof(int32_t)));
    w.ws_bytes += S * sizeof(int32_t);
  }

  SF_TRY(w.h_tokens.alloc(S * sizeof(int32_t)));
  SF_TRY(w.h_logits.alloc(size_t(w.max_logit_rows) * vocab * f));
  if (host_kv) SF_TRY(w.h_kv.alloc(size_t(c.n_layers) * 2 * S * kvd * f));
  SF_ENSURE(opt.importance_window >= 0, kInvalidArgument,
            "device prefill: importance_window must be >= 0");
  if (opt.importance_window > 0) {
    SF_TRY(w.alloc(w.imp, size_t(c.n_kv_heads) * S * f));
    SF_TRY(w.h_imp.alloc(size_t(c.n_layers) * size_t(c.n_kv_heads) * S * f));
  }

  for (int s = 0; s < 2; ++s) {
    SF_TRY(w.kv_ready[s].create(false));
    SF_TRY(w.kv_free[s].create(false));
    SF_TRY(w.logits_ready[s].create(false));
    SF_TRY(w.logits_free[s].create(false));
  }
  // Per-layer events: timing ones around kernels, ordering-only ones for copies.
  const auto add_event = [](std::vector<CudaEvent>& v, bool timing) {
    v.emplace_back();
    return v.back().create(timing);
  };
  for (int l = 0; l < c.n_layers; ++l) {
    SF_TRY(add_event(w.kv_copied, false));
    SF_TRY(add_event(w.att_begin, true));
    SF_TRY(add_event(w.att_end, true));
    if (opt.importance_window > 0) {
      SF_TRY(add_event(w.imp_begin, true));
      SF_TRY(add_event(w.imp_end, true));
      SF_TRY(add_event(w.imp_copied, false));
    }
  }

  // Walk the forward of max_tokens tokens once without enqueueing: every GEMM shape (full and
  // tail chunks, exact pointers and so alignments) gets its cuBLASLt algorithm now.
  w.dry = true;
  SF_TRY(w.forward({}, max_tokens, nullptr));
  w.dry = false;
  SF_CUDA_TRY(cudaStreamSynchronize(w.compute.get()));  // the poisoning memsets
  w.plan_s = seconds_since(t0);
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
  SF_TRY(w.forward(tokens, S, &res));
  res.seconds = seconds_since(t0);
  return res;
}

#else  // !SF_HAVE_CUDA: the same interface, every entry point reports the missing backend.

struct DeviceModel::Impl {
  ModelConfig cfg;
  DType wdt = DType::kBF16;
  int device = 0;
  std::string device_name;
  size_t bytes = 0;
};

struct DevicePrefill::Impl {
  int64_t max_tokens = 0;
  size_t ws_bytes = 0;
  double plan_s = 0;
  bool attn_bf16 = false;
};

namespace {
Status no_cuda() {
  return SF_ERR(kUnsupported, "built without CUDA (configure with -DSF_CUDA=ON)");
}
}  // namespace

Status cuda_device_check(int) { return no_cuda(); }
Result<DeviceModel> DeviceModel::upload(const Model&, DType, int) { return no_cuda(); }
Result<DevicePrefill> DevicePrefill::plan(const DeviceModel&, int64_t, const PrefillOptions&) {
  return no_cuda();
}
Result<PrefillResult> DevicePrefill::run(std::span<const int32_t>) { return no_cuda(); }

#endif  // SF_HAVE_CUDA

DeviceModel::DeviceModel() = default;
DeviceModel::DeviceModel(DeviceModel&&) noexcept = default;
DeviceModel& DeviceModel::operator=(DeviceModel&&) noexcept = default;
DeviceModel::~DeviceModel() = default;
const ModelConfig& DeviceModel::config() const { return impl_->cfg; }
DType DeviceModel::weight_dtype() const { return impl_->wdt; }
const char* DevicePrefill::attention_kernel() const {
  return impl_->attn_bf16 ? "cuDNN fused flash attention, bf16 q/k/v" : "f32 reference kernel";
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

Result<PrefillResult> prefill_device(const DeviceModel& dm, std::span<const int32_t> tokens,
                                     const PrefillOptions& opt) {
  if (tokens.empty()) return SF_ERR(kInvalidArgument, "prefill: empty prompt");
  SF_ASSIGN(DevicePrefill p, DevicePrefill::plan(dm, int64_t(tokens.size()), opt));
  return p.run(tokens);
}

}  // namespace sf::model
