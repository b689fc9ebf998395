#include "decode/device_session.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "decode/decode_session.h"
#include "kernels/api.h"
#include "kernels/decode_attention.h"

#if SF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"
#endif

namespace sf::decode {

kernels::PagedDecodeParams device_attn_params(const DecodeAttnParams& p) {
  kernels::PagedDecodeParams kp;
  kp.psa = p.mode == DecodeAttnMode::kPsa;
  kp.eps = p.eps;
  kp.pin_sink_recent = p.pin_sink_recent;
  kp.recent_mean = p.remainder == PsaRemainder::kRecentMean;
  kp.psa_share_kv_head = p.share_kv_head;
  kp.scale = p.scale;
  return kp;
}

static_assert(kBlockTokens == kernels::kDecodeBlockTokens, "one block size on host and device");
static_assert(kPsaAvgBlocks == kernels::kPsaRecentBlocks, "one psa-avg rule on host and device");

#if SF_HAVE_CUDA

namespace {
// A thread's identity for the graph below, never reused. std::thread::id is: once a thread
// ends, a new one may get its id, and that thread would replay (or try to capture) a graph bound
// to the ended thread's freed cuBLASLt workspace.
uint64_t this_thread_serial() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t serial = next.fetch_add(1, std::memory_order_relaxed);
  return serial;
}

Result<kernels::PoolDType> pool_dtype(kvstore::KvEncoding e) {
  switch (e) {
    case kvstore::KvEncoding::kF32:
      return kernels::PoolDType::kF32;
    case kvstore::KvEncoding::kBF16:
      return kernels::PoolDType::kBF16;
    case kvstore::KvEncoding::kInt8:
      return kernels::PoolDType::kInt8;
    case kvstore::KvEncoding::kInt4:
      break;
  }
  return SF_ERR(kUnsupported, std::string("device pool: the decode kernel reads f32, bf16 or int8 "
                                          "blocks, not ") +
                                  kvstore::kv_encoding_name(e));
}
}  // namespace

struct DevicePagedPool::Impl {
  int n_layers = 0, hkv = 0, d = 0, max_pages = 0;
  kernels::PoolDType dtype = kernels::PoolDType::kF32;
  // k, v [blocks, 64, d] of dtype; kmin, kmax [blocks, d]; fill [blocks]; pages [layers, hkv,
  // max_pages] and n_pages [layers, hkv]. INT8: kscale, kzero [blocks, d], vscale, vzero
  // [blocks, 64] (F16 bits) and kopen [layers, hkv, 64, d] F32.
  kernels::cuda::DeviceBuffer k, v, kmin, kmax, fill, pages, n_pages, kscale, kzero, vscale, vzero,
      kopen;
};

Result<DevicePagedPool> DevicePagedPool::upload(const PagedKvCache& cache, int reserve_tokens,
                                                kvstore::KvEncoding enc) {
  if (reserve_tokens < 0) return SF_ERR(kOutOfRange, "device pool: reserve_tokens must be >= 0");
  SF_ASSIGN(const kernels::PoolDType dt, pool_dtype(enc));
  const int64_t L = cache.n_layers(), hkv = cache.n_kv_heads(), d = cache.head_dim(),
                B = kBlockTokens;
  if (dt != kernels::PoolDType::kF32 && d != 64 && d != 128)
    return SF_ERR(kUnsupported, std::string("device pool: ") + kvstore::kv_encoding_name(enc) +
                                    " blocks need head_dim 64 or 128, got " + std::to_string(d));
  DevicePagedPool pool;
  pool.impl_ = std::make_unique<Impl>();
  Impl& m = *pool.impl_;
  m.n_layers = int(L);
  m.hkv = int(hkv);
  m.d = int(d);
  m.dtype = dt;
  // Pages: each head's own, then enough reserved ones for reserve_tokens more tokens.
  int64_t most = 0;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < hkv; ++h) {
      const auto& pg = cache.pages(l, h);
      const int64_t room = pg.empty() ? 0 : B - cache.block(pg.back()).n;
      const int64_t extra = (std::max<int64_t>(0, reserve_tokens - room) + B - 1) / B;
      most = std::max(most, int64_t(pg.size()) + extra);
    }
  // kUnsupported: a context the kernel does not take (--device auto then decodes on the CPU).
  if (most > kernels::kDecodeMaxPages)
    return SF_ERR(kUnsupported, "device pool: a head needs " + std::to_string(most) +
                                   " blocks, more than the kernel's " +
                                   std::to_string(kernels::kDecodeMaxPages) + " (" +
                                   std::to_string(kernels::kDecodeMaxPages * B) + " tokens)");
  m.max_pages = int(std::max<int64_t>(most, 1));
  const int64_t n_blocks = L * hkv * m.max_pages;
  if (n_blocks > INT32_MAX) return SF_ERR(kOutOfRange, "device pool: too many blocks");
  const bool q8 = dt == kernels::PoolDType::kInt8;
  const size_t esize = dt == kernels::PoolDType::kF32 ? 4 : dt == kernels::PoolDType::kBF16 ? 2 : 1;
  const size_t row_bytes = esize * size_t(d), blk_bytes = row_bytes * size_t(B);
  std::vector<uint8_t> hk(size_t(n_blocks) * blk_bytes, 0), hv(hk.size(), 0);
  std::vector<float> hmin(size_t(n_blocks * d), 0.f), hmax(hmin.size(), 0.f);
  std::vector<uint16_t> hks(q8 ? size_t(n_blocks * d) : 0, 0), hkz(hks.size(), 0),
      hvs(q8 ? size_t(n_blocks * B) : 0, 0), hvz(hvs.size(), 0);
  std::vector<float> hopen(q8 ? size_t(L * hkv * B * d) : 0, 0.f);
  std::vector<float> stored(static_cast<size_t>(B * d)), mean(static_cast<size_t>(d));  // one block's keys as stored
  std::vector<int32_t> hfill(size_t(n_blocks), 0), hpages(size_t(n_blocks), -1),
      hnp(size_t(L * hkv), 0);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < hkv; ++h) {
      const int64_t lh = int64_t(l) * hkv + h, first = lh * m.max_pages;
      const auto& pg = cache.pages(l, h);
      hnp[size_t(lh)] = int32_t(pg.size());
      for (int64_t i = 0; i < m.max_pages; ++i) {
        const int64_t blk = first + i;  // a head's pages are its own contiguous range
        hpages[size_t(blk)] = int32_t(blk);
        if (i >= int64_t(pg.size())) continue;
        const KvBlock& kb = cache.block(pg[size_t(i)]);
        // Each block is one key group (kvstore/kv_quant.h): its int8 codes as loaded where it
        // has them, else encoded as an export would be.
        kvstore::EncodedRows ek, ev;
        if (q8 && !kb.kq.data.empty()) {
          ek = kb.kq;
          ev = kb.vq;
        } else {
          SF_ASSIGN(ek, kvstore::kv_encode(enc, true, kb.k.data(), kb.n, int(d)));
          SF_ASSIGN(ev, kvstore::kv_encode(enc, false, kb.v.data(), kb.n, int(d)));
        }
        std::memcpy(hk.data() + size_t(blk) * blk_bytes, ek.data.data(), ek.data.size());
        std::memcpy(hv.data() + size_t(blk) * blk_bytes, ev.data.data(), ev.data.size());
        if (q8) {
          std::copy(ek.scale.begin(), ek.scale.end(), hks.begin() + blk * d);
          std::copy(ek.zero.begin(), ek.zero.end(), hkz.begin() + blk * d);
          std::copy(ev.scale.begin(), ev.scale.end(), hvs.begin() + blk * B);
          std::copy(ev.zero.begin(), ev.zero.end(), hvz.begin() + blk * B);
          if (i + 1 == int64_t(pg.size()))  // the block appends re-encode
            std::copy(kb.k.begin(), kb.k.begin() + kb.n * d, hopen.begin() + lh * B * d);
        }
        if (dt == kernels::PoolDType::kF32) {
          std::memcpy(hmin.data() + blk * d, kb.kmin.data(), sizeof(float) * size_t(d));
          std::memcpy(hmax.data() + blk * d, kb.kmax.data(), sizeof(float) * size_t(d));
        } else {
          // PSA's bound on q.k must hold for the keys the kernel reads: those of the codes going
          // up, whose bf16 rounding or int8 step (a code's half step, the F16 zero rounded down
          // and scale up) can fall outside the cache's own min and max (a two-tier export's
          // merged blocks re-encoded here, a cache kept in F32).
          SF_TRY(kvstore::kv_decode_into(enc, true, ek.data.data(), q8 ? ek.scale.data() : nullptr,
                                         q8 ? ek.zero.data() : nullptr, kb.n, int(d),
                                         stored.data()));
          kvstore::block_key_stats(stored.data(), kb.n, int(d), hmin.data() + blk * d,
                                   hmax.data() + blk * d, mean.data());
        }
        hfill[size_t(blk)] = kb.n;
      }
    }
  auto put = [](kernels::cuda::DeviceBuffer& b, const auto& host) -> Status {
    const size_t bytes = host.size() * sizeof(host[0]);
    if (bytes == 0) return Status::ok();
    SF_TRY(b.alloc(bytes));
    return b.upload(host.data(), bytes);
  };
  SF_TRY(put(m.k, hk));
  SF_TRY(put(m.v, hv));
  SF_TRY(put(m.kmin, hmin));
  SF_TRY(put(m.kmax, hmax));
  SF_TRY(put(m.fill, hfill));
  SF_TRY(put(m.pages, hpages));
  SF_TRY(put(m.n_pages, hnp));
  SF_TRY(put(m.kscale, hks));
  SF_TRY(put(m.kzero, hkz));
  SF_TRY(put(m.vscale, hvs));
  SF_TRY(put(m.vzero, hvz));
  SF_TRY(put(m.kopen, hopen));
  return pool;
}

kernels::PagedKv DevicePagedPool::layer(int l) const {
  const Impl& m = *impl_;
  kernels::PagedKv kv;
  kv.dtype = m.dtype;
  kv.k = m.k.data();
  kv.v = m.v.data();
  if (m.dtype == kernels::PoolDType::kInt8) {
    kv.kscale = m.kscale.as<uint16_t>();
    kv.kzero = m.kzero.as<uint16_t>();
    kv.vscale = m.vscale.as<uint16_t>();
    kv.vzero = m.vzero.as<uint16_t>();
    kv.kopen = m.kopen.as<float>() + int64_t(l) * m.hkv * kBlockTokens * m.d;
  }
  kv.kmin = m.kmin.as<float>();
  kv.kmax = m.kmax.as<float>();
  kv.fill = m.fill.as<int32_t>();
  kv.pages = m.pages.as<int32_t>() + int64_t(l) * m.hkv * m.max_pages;
  kv.n_pages = m.n_pages.as<int32_t>() + int64_t(l) * m.hkv;
  kv.n_kv_heads = m.hkv;
  kv.head_dim = m.d;
  kv.max_pages = m.max_pages;
  return kv;
}

kernels::PagedKv DevicePagedPool::all() const {
  kernels::PagedKv kv = layer(0);
  kv.n_kv_heads = impl_->n_layers * impl_->hkv;  // layer l's heads follow layer l - 1's
  return kv;
}

size_t DevicePagedPool::bytes() const {
  const Impl& m = *impl_;
  return m.k.size() + m.v.size() + m.kmin.size() + m.kmax.size() + m.fill.size() + m.pages.size() +
         m.n_pages.size() + m.kscale.size() + m.kzero.size() + m.vscale.size() + m.vzero.size() +
         m.kopen.size();
}

struct DeviceDecodeSession::Impl {
  const model::DeviceModel* dm = nullptr;
  model::DeviceModel::Views w;
  kernels::PagedDecodeParams kp;
  int64_t pos = 0;
  int steps_left = 0;
  bool broken = false;  // a step failed part way: the pool may hold some layers' appends
  int n_layers = 0, hq = 0, hkv = 0, d = 0;
  int64_t H = 0, I = 0, vocab = 0;
  cudaStream_t stream = nullptr;
  DevicePagedPool pool;
  // Activations (F32), token + position, per-layer visited counts.
  // qkv holds q [hq, d], then k and v [hkv, d] each: one RoPE launch turns q and k.
  kernels::cuda::DeviceBuffer x, xn, qkv, att, tmp, gate, up, logits, tokpos, visited,
      attn_ws;  // paged_decode_attention's split partials (every layer's pool has one shape)
  std::vector<int32_t> visited_host;
  // Per layer and KV head, as the appends leave them: blocks and the last block's fill (the
  // device keeps its own; these give blocks_total without a download).
  std::vector<int32_t> np_host, last_fill;
  DecodeAttnStats stats;
  // Verified drafts (verify_draft > 0): the pass's buffers for up to n_max = verify_draft + 1
  // tokens (ptok: token ids then positions; pk, pv: every layer's K/V rows of the pass, kept so
  // the accepted tokens' can be appended again), the pool's snapshot at a round's start, and
  // the host mirrors and counters as they stood then.
  DecodeAttnParams params;  // as opened
  int verify = 0, n_max = 0;
  kernels::PagedDecodeParams kp_pass;
  kernels::cuda::DeviceBuffer ptok, px, pxn, pq, pk, pv, patt, ptmp, pgate, plogits, snap;
  struct Mark {
    std::vector<int32_t> np, fill;
    int64_t pos = 0;
    int steps_left = 0;
  } mark;
  // One step's kernels as a CUDA graph: captured at the second step (the first runs eagerly, so
  // every lazy setup, such as a GEMM plan, has happened) and replayed by every later one. The
  // step reads its token and position from tokpos and the pool's fill from the device, so one
  // capture serves every step. A capture the runtime refuses leaves the session eager.
  bool use_graph = true;
  // The fused step (enqueue_step): gemv_parts for Q/K/V, gemv_swiglu for the MLP, add_rms_norm
  // for each residual add and the norm after it; false: one kernel per op as before (kept for
  // the A/B in sf_bench_decode_session; BF16 weights give the same logits bit for bit).
  bool fused = true;
  // Whether the step calls cuBLASLt (unfused, F32 weights), whose workspace is per thread: then a
  // graph is bound to the thread that captured it. Otherwise any thread may replay it.
  bool thread_bound = false;
  int64_t eager_here = 0, graph_steps = 0;  // eager steps on step_thread; replays
  uint64_t step_thread = 0;                  // this_thread_serial() of the last step
  cudaGraphExec_t graph = nullptr;

  ~Impl() {
    if (graph) (void)cudaGraphExecDestroy(graph);
    if (stream) (void)cudaStreamDestroy(stream);
  }

  kernels::Stream cs() const { return {Device::kCuda, stream}; }
  // One token's append to every head of the host mirrors, as the kernel does it; returns that
  // token's blocks over layers and query heads (what full attention reads for it).
  int64_t mirror_append() {
    int64_t blocks = 0;
    for (size_t i = 0; i < np_host.size(); ++i) {
      if (last_fill[i] == kBlockTokens) {
        ++np_host[i];
        last_fill[i] = 0;
      }
      ++last_fill[i];
      blocks += np_host[i];
    }
    return blocks * (hq / hkv);
  }
  float* q() const { return qkv.as<float>(); }
  float* k() const { return q() + int64_t(hq) * d; }
  float* v() const { return k() + int64_t(hkv) * d; }
  // Device F32 views: [rows, cols], one row of them, and [rows, heads, head_dim] for RoPE.
  static TensorView mat(float* p, int64_t rows, int64_t cols) {
    return TensorView::make(p, DType::kF32, {rows, cols}, Device::kCuda);
  }
  static TensorView row(float* p, int64_t n) { return mat(p, 1, n); }
  TensorView heads(float* p, int64_t rows, int h) const {
    return TensorView::make(p, DType::kF32, {rows, int64_t(h), int64_t(d)}, Device::kCuda);
  }
  // The unfused step's linears: out[1, n_out] = wt in[1, n_in] (+ bias), F32 x. BF16 weights: the
  // one-row GEMV, which reads them as stored (no cast kernel before each linear). F32 weights:
  // cuBLASLt (bench/NOTES.md, twenty-sixth session). The fused step uses the GEMV for both.
  Status linear(float* in, int64_t n_in, const TensorView& wt, const TensorView& bias, float* out,
                int64_t n_out) {
    const TensorView x = row(in, n_in), y = row(out, n_out);
    if (wt.dtype == DType::kBF16) return kernels::gemv(x, wt, bias, y, cs());
    return kernels::linear(x, wt, bias, y, cs());
  }
};

Result<DeviceDecodeSession> DeviceDecodeSession::open(const model::DeviceModel& dm,
                                                      const PagedKvCache& cache, int64_t next_pos,
                                                      DecodeAttnParams p, int max_new_tokens,
                                                      kvstore::KvEncoding pool_enc,
                                                      bool cuda_graph, bool fused_step) {
  const model::ModelConfig& c = dm.config();
  if (dm.slice().ways != 1)
    return SF_ERR(kUnsupported, "device decode: the model must be whole (no TP slice)");
  SF_TRY(check_cache_geometry(cache, c.n_layers, c.n_kv_heads, c.head_dim, "device decode"));
  if (p.measure_mass)
    return SF_ERR(kUnsupported, "device decode: measure_mass is a host-only diagnostic");
  if (p.guard_margin > 0 && p.verify_draft == 0)
    return SF_ERR(kUnsupported, "device decode: the psa guard (':MARGIN') runs on the host only");
  if (p.verify_draft > 0 && p.mode != DecodeAttnMode::kPsa)
    return SF_ERR(kInvalidArgument, "device decode: verified drafts need psa drafts");
  if (p.verify_draft > kernels::kDecodeMaxTokens - 1)
    return SF_ERR(kUnsupported, "device decode: verify" + std::to_string(p.verify_draft) +
                                    ": a pass takes at most " +
                                    std::to_string(kernels::kDecodeMaxTokens) +
                                    " tokens, so at most " +
                                    std::to_string(kernels::kDecodeMaxTokens - 1) + " drafts");
  if (p.mode == DecodeAttnMode::kPsa && p.share_kv_head &&
      c.n_heads / c.n_kv_heads > kernels::kDecodePsaGqaMaxGroup)
    return SF_ERR(kUnsupported, "device decode: psa '+gqa' takes at most " +
                                    std::to_string(kernels::kDecodePsaGqaMaxGroup) +
                                    " query heads per KV head, the model has " +
                                    std::to_string(c.n_heads / c.n_kv_heads));
  if (c.head_dim != 32 && c.head_dim != 64 && c.head_dim != 128)
    return SF_ERR(kUnsupported, "device decode: head_dim " + std::to_string(c.head_dim) +
                                    " (the decode kernel takes 32, 64 or 128)");
  if (max_new_tokens < 0) return SF_ERR(kOutOfRange, "device decode: max_new_tokens must be >= 0");
  DeviceDecodeSession s;
  s.impl_ = std::make_unique<Impl>();
  Impl& m = *s.impl_;
  m.dm = &dm;
  m.w = dm.views();
  m.kp = device_attn_params(p);
  m.params = p;
  m.pos = next_pos;
  m.steps_left = max_new_tokens;
  m.use_graph = cuda_graph;
  m.fused = fused_step;
  m.thread_bound = !fused_step && dm.weight_dtype() == DType::kF32;
  m.n_layers = c.n_layers;
  m.hq = c.n_heads;
  m.hkv = c.n_kv_heads;
  m.d = c.head_dim;
  m.H = c.hidden;
  m.I = c.intermediate;
  m.vocab = c.vocab;
  SF_CUDA_TRY(cudaSetDevice(dm.device()));

  SF_ASSIGN(m.pool, DevicePagedPool::upload(cache, max_new_tokens, pool_enc));
  const int64_t L = c.n_layers, hkv = c.n_kv_heads, d = c.head_dim;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < hkv; ++h) {
      const auto& pg = cache.pages(l, h);
      m.np_host.push_back(int32_t(pg.size()));
      m.last_fill.push_back(pg.empty() ? kBlockTokens : cache.block(pg.back()).n);
    }
  const int64_t qd = int64_t(c.n_heads) * d, kvd = hkv * d;
  for (auto [buf, n] : {std::pair{&m.x, m.H},
                        {&m.xn, m.H},
                        {&m.qkv, qd + 2 * kvd},
                        {&m.att, qd},
                        {&m.tmp, m.H},
                        {&m.gate, m.I},
                        {&m.logits, m.vocab}})
    SF_TRY(buf->alloc(sizeof(float) * size_t(n)));
  if (!fused_step) SF_TRY(m.up.alloc(sizeof(float) * size_t(m.I)));  // the fused step has no up
  SF_TRY(m.tokpos.alloc(2 * sizeof(int32_t)));
  SF_TRY(m.visited.alloc(sizeof(int32_t) * size_t(L * c.n_heads)));
  size_t ws = kernels::paged_decode_workspace_bytes(c.n_heads, m.pool.layer(0), m.kp);
  if (p.verify_draft > 0) {
    m.verify = p.verify_draft;
    m.n_max = p.verify_draft + 1;
    m.kp_pass.scale = m.kp.scale;
    // A pass's split count depends on its token count (fewer tokens, more splits each), so the
    // workspace is the largest over every count a pass may take.
    for (int t = 1; t <= m.n_max; ++t) {  // 1: a round's last token alone
      m.kp_pass.n_tokens = t;
      ws = std::max(ws, kernels::paged_decode_workspace_bytes(c.n_heads, m.pool.layer(0), m.kp_pass));
    }
    const int64_t N = m.n_max;
    for (auto [buf, n] : {std::pair{&m.px, N * m.H},
                          {&m.pxn, N * m.H},
                          {&m.pq, N * qd},
                          {&m.pk, L * N * kvd},
                          {&m.pv, L * N * kvd},
                          {&m.patt, N * qd},
                          {&m.ptmp, N * m.H},
                          {&m.pgate, N * m.I},
                          {&m.plogits, N * m.vocab}})
      SF_TRY(buf->alloc(sizeof(float) * size_t(n)));
    SF_TRY(m.ptok.alloc(2 * sizeof(int32_t) * size_t(N)));
    SF_TRY(m.snap.alloc(kernels::paged_snapshot_bytes(m.pool.all())));
  }
  if (ws > 0) SF_TRY(m.attn_ws.alloc(ws));
  m.visited_host.assign(size_t(L * c.n_heads), 0);
  SF_CUDA_TRY(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  return s;
}

Status DeviceDecodeSession::step(int32_t token, std::vector<float>* logits) {
  Impl& m = *impl_;
  if (token < 0 || token >= m.vocab)
    return SF_ERR(kOutOfRange, "decode: token id " + std::to_string(token) + " outside vocab " +
                                   std::to_string(m.vocab));
  if (m.steps_left <= 0)
    return SF_ERR(kOutOfRange, "device decode: the session was opened for fewer tokens");
  if (m.broken)
    return SF_ERR(kInternal, "device decode: an earlier step failed; reopen the session");
  Status st = run_step(token, logits);
  if (!st.is_ok()) m.broken = true;
  else ++m.stats.steps;
  return st;
}

Status DeviceDecodeSession::run_step(int32_t token, std::vector<float>* logits) {
  Impl& m = *impl_;
  SF_CUDA_TRY(cudaSetDevice(m.dm->device()));
  const int32_t tp[2] = {token, int32_t(m.pos)};
  // Synchronous and ordered before this step's work: the previous step ended with a wait.
  SF_TRY(m.tokpos.upload(tp, sizeof(tp)));
  // Where the step calls cuBLASLt (thread_bound), a captured graph holds the capturing thread's
  // workspace (kernels/cuda/linear.cpp): a step from another thread drops the graph, runs
  // eagerly there (planning that thread's GEMMs) and captures anew at its next step. Otherwise
  // self stays 0 and any thread replays the graph.
  const uint64_t self = m.thread_bound ? this_thread_serial() : 0;
  if (self != m.step_thread) {
    if (m.graph) (void)cudaGraphExecDestroy(m.graph);
    m.graph = nullptr;
    m.step_thread = self;
    m.eager_here = 0;
  }
  bool ran = false;
  if (m.graph) {
    SF_CUDA_TRY(cudaGraphLaunch(m.graph, m.stream));
    ran = true;
  } else if (m.use_graph && m.eager_here > 0) {
    cudaGraph_t g = nullptr;
    if (cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
      const Status st = enqueue_step();
      const cudaError_t end = cudaStreamEndCapture(m.stream, &g);
      if (!st.is_ok() || end != cudaSuccess || cudaGraphInstantiate(&m.graph, g, 0) != cudaSuccess)
        m.graph = nullptr;
      if (g) (void)cudaGraphDestroy(g);
    }
    if (m.graph) {
      SF_CUDA_TRY(cudaGraphLaunch(m.graph, m.stream));
      ran = true;
    } else {
      // Refused at any point: nothing ran while capturing, so this step and the later ones
      // run eagerly instead.
      (void)cudaGetLastError();
      m.use_graph = false;
    }
  }
  if (ran) {
    ++m.graph_steps;
  } else {
    SF_TRY(enqueue_step());
    ++m.eager_here;
  }
  SF_TRY(kernels::cuda::stream_synchronize(m.stream));
  logits->resize(size_t(m.vocab));
  SF_TRY(m.logits.download(logits->data(), sizeof(float) * size_t(m.vocab)));
  SF_TRY(m.visited.download(m.visited_host.data(), sizeof(int32_t) * m.visited_host.size()));
  const int group = m.hq / m.hkv;
  m.mirror_append();
  for (int l = 0; l < m.n_layers; ++l)
    for (int h = 0; h < m.hq; ++h) {
      m.stats.blocks_visited += m.visited_host[size_t(l * m.hq + h)];
      m.stats.blocks_computed += m.visited_host[size_t(l * m.hq + h)];
      m.stats.blocks_total += m.np_host[size_t(l * m.hkv + h / group)];
      if (m.kp.psa_share_kv_head && h % group == 0) {  // +gqa: a head's visits are its KV head's
        m.stats.kv_blocks_loaded += m.visited_host[size_t(l * m.hq + h)];
        m.stats.kv_blocks_total += m.np_host[size_t(l * m.hkv + h / group)];
      }
    }
  ++m.pos;
  --m.steps_left;
  return Status::ok();
}

// One step's work on the session's stream, no host wait: embedding of tokpos[0], every layer
// (the K/V append and attention at position tokpos[1]), the logits. Fused (the default), a layer
// is 9 launches plus the attention's: add_rms_norm, gemv_parts (Q, K, V), rope (q and k as one
// tensor), paged_append, the attention, gemv (O), add_rms_norm, gemv_swiglu, gemv (down); the
// residual add of the down projection joins the next layer's first norm.
Status DeviceDecodeSession::enqueue_step() {
  Impl& m = *impl_;
  const model::ModelConfig& c = m.dm->config();
  kernels::RopeParams rope = c.rope;
  rope.freq_factors = m.w.rope_freqs;
  const int32_t* d_tok = m.tokpos.as<int32_t>();
  const int32_t* d_pos = d_tok + 1;
  const int64_t H = m.H, qd = int64_t(m.hq) * m.d, kvd = int64_t(m.hkv) * m.d, I = m.I;
  const TensorView none{};
  const kernels::Stream cs = m.cs();
  float *x = m.x.as<float>(), *xn = m.xn.as<float>(), *att = m.att.as<float>(),
        *tmp = m.tmp.as<float>(), *gate = m.gate.as<float>();
  auto attention = [&](int l) -> Status {
    const kernels::PagedKv kv = m.pool.layer(l);
    SF_TRY(kernels::paged_append(kv, m.k(), m.v(), cs));
    return kernels::paged_decode_attention(m.q(), m.hq, kv, m.kp, att,
                                           m.visited.as<int32_t>() + int64_t(l) * m.hq,
                                           m.attn_ws.data(), m.attn_ws.size(), cs);
  };
  SF_TRY(kernels::embedding(m.w.tok_embd, d_tok, 1, Impl::row(x, H), cs));
  if (m.fused) {
    for (int l = 0; l < m.n_layers; ++l) {
      const model::DeviceModel::LayerViews& L = m.w.layers[size_t(l)];
      // Layer 0 has no residual pending; later layers add the previous down projection here.
      SF_TRY(kernels::add_rms_norm(Impl::row(x, H), l ? Impl::row(tmp, H) : none, L.attn_norm,
                                   c.rms_eps, Impl::row(xn, H), cs));
      const kernels::GemvPart qkv[3] = {{L.wq, L.bq, Impl::row(m.q(), qd)},
                                        {L.wk, L.bk, Impl::row(m.k(), kvd)},
                                        {L.wv, L.bv, Impl::row(m.v(), kvd)}};
      SF_TRY(kernels::gemv_parts(Impl::row(xn, H), qkv, 3, cs));
      SF_TRY(kernels::rope(m.heads(m.q(), 1, m.hq + m.hkv), d_pos, rope, cs));
      SF_TRY(attention(l));
      SF_TRY(kernels::gemv(Impl::row(att, qd), L.wo, none, Impl::row(tmp, H), cs));
      SF_TRY(kernels::add_rms_norm(Impl::row(x, H), Impl::row(tmp, H), L.ffn_norm, c.rms_eps,
                                   Impl::row(xn, H), cs));
      SF_TRY(kernels::gemv_swiglu(Impl::row(xn, H), L.w_gate, L.w_up, Impl::row(gate, I), cs));
      SF_TRY(kernels::gemv(Impl::row(gate, I), L.w_down, none, Impl::row(tmp, H), cs));
    }
    SF_TRY(kernels::add_rms_norm(Impl::row(x, H), m.n_layers ? Impl::row(tmp, H) : none,
                                 m.w.out_norm, c.rms_eps, Impl::row(xn, H), cs));
    return kernels::gemv(Impl::row(xn, H), m.w.lm_head, none, Impl::row(m.logits.as<float>(), m.vocab),
                         cs);
  }
  for (int l = 0; l < m.n_layers; ++l) {
    const model::DeviceModel::LayerViews& L = m.w.layers[size_t(l)];
    SF_TRY(kernels::rms_norm(Impl::row(x, H), L.attn_norm, c.rms_eps, Impl::row(xn, H), cs));
    SF_TRY(m.linear(xn, H, L.wq, L.bq, m.q(), qd));
    SF_TRY(m.linear(xn, H, L.wk, L.bk, m.k(), kvd));
    SF_TRY(m.linear(xn, H, L.wv, L.bv, m.v(), kvd));
    SF_TRY(kernels::rope(m.heads(m.q(), 1, m.hq), d_pos, rope, cs));
    SF_TRY(kernels::rope(m.heads(m.k(), 1, m.hkv), d_pos, rope, cs));
    SF_TRY(attention(l));
    SF_TRY(m.linear(att, qd, L.wo, none, tmp, H));
    SF_TRY(kernels::add_inplace(Impl::row(x, H), Impl::row(tmp, H), cs));
    SF_TRY(kernels::rms_norm(Impl::row(x, H), L.ffn_norm, c.rms_eps, Impl::row(xn, H), cs));
    SF_TRY(m.linear(xn, H, L.w_gate, none, gate, I));
    SF_TRY(m.linear(xn, H, L.w_up, none, m.up.as<float>(), I));
    SF_TRY(kernels::swiglu(Impl::row(gate, I), Impl::row(m.up.as<float>(), I), Impl::row(gate, I), cs));
    SF_TRY(m.linear(gate, I, L.w_down, none, tmp, H));
    SF_TRY(kernels::add_inplace(Impl::row(x, H), Impl::row(tmp, H), cs));
  }
  SF_TRY(kernels::rms_norm(Impl::row(x, H), m.w.out_norm, c.rms_eps, Impl::row(xn, H), cs));
  return m.linear(xn, H, m.w.lm_head, none, m.logits.as<float>(), m.vocab);
}

// The verification pass (generate_greedy with verify_draft): the fused step's ops over n rows,
// each linear a gemv over the rows (row i as the fused step's gemv gives it; the unfused step
// with F32 weights uses cuBLASLt instead, so its logits differ from the pass's by the sums'
// order), the attention the pass kernel (full, n_tokens = n) after the n tokens' K/V are
// appended; then a wait and the logits. Eager: n changes from round to round.
Status DeviceDecodeSession::run_pass(const int32_t* tokens, int n, std::vector<float>* logits) {
  Impl& m = *impl_;
  if (n < 1 || n > m.n_max)
    return SF_ERR(kInternal, "device decode: a pass of " + std::to_string(n) + " tokens");
  if (n > m.steps_left)
    return SF_ERR(kOutOfRange, "device decode: the session was opened for fewer tokens");
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= m.vocab)
      return SF_ERR(kOutOfRange, "decode: token id " + std::to_string(tokens[i]) +
                                     " outside vocab " + std::to_string(m.vocab));
  const model::ModelConfig& c = m.dm->config();
  SF_CUDA_TRY(cudaSetDevice(m.dm->device()));
  std::vector<int32_t> tp(size_t(2 * n));
  for (int i = 0; i < n; ++i) tp[size_t(i)] = tokens[i], tp[size_t(n + i)] = int32_t(m.pos + i);
  SF_TRY(m.ptok.upload(tp.data(), tp.size() * sizeof(int32_t)));
  const int32_t* d_tok = m.ptok.as<int32_t>();
  const int32_t* d_pos = d_tok + n;
  kernels::RopeParams rope = c.rope;
  rope.freq_factors = m.w.rope_freqs;
  const int64_t H = m.H, qd = int64_t(m.hq) * m.d, kvd = int64_t(m.hkv) * m.d, I = m.I, N = n;
  const TensorView none{};
  const kernels::Stream cs = m.cs();
  auto rows = [N](float* p, int64_t cols) { return Impl::mat(p, N, cols); };
  float *x = m.px.as<float>(), *xn = m.pxn.as<float>(), *q = m.pq.as<float>(),
        *att = m.patt.as<float>(), *tmp = m.ptmp.as<float>(), *gate = m.pgate.as<float>();
  kernels::PagedDecodeParams kp = m.kp_pass;
  kp.n_tokens = n;
  SF_TRY(kernels::embedding(m.w.tok_embd, d_tok, N, rows(x, H), cs));
  for (int l = 0; l < m.n_layers; ++l) {
    const model::DeviceModel::LayerViews& L = m.w.layers[size_t(l)];
    float* k = m.pk.as<float>() + int64_t(l) * m.n_max * kvd;
    float* v = m.pv.as<float>() + int64_t(l) * m.n_max * kvd;
    SF_TRY(kernels::add_rms_norm(rows(x, H), l ? rows(tmp, H) : none, L.attn_norm, c.rms_eps,
                                 rows(xn, H), cs));
    const kernels::GemvPart qkv[3] = {
        {L.wq, L.bq, rows(q, qd)}, {L.wk, L.bk, rows(k, kvd)}, {L.wv, L.bv, rows(v, kvd)}};
    SF_TRY(kernels::gemv_parts(rows(xn, H), qkv, 3, cs));
    SF_TRY(kernels::rope(m.heads(q, N, m.hq), d_pos, rope, cs));
    SF_TRY(kernels::rope(m.heads(k, N, m.hkv), d_pos, rope, cs));
    const kernels::PagedKv kv = m.pool.layer(l);
    SF_TRY(kernels::paged_append(kv, k, v, cs, n));
    SF_TRY(kernels::paged_decode_attention(q, m.hq, kv, kp, att, nullptr, m.attn_ws.data(),
                                           m.attn_ws.size(), cs));
    SF_TRY(kernels::gemv(rows(att, qd), L.wo, none, rows(tmp, H), cs));
    SF_TRY(kernels::add_rms_norm(rows(x, H), rows(tmp, H), L.ffn_norm, c.rms_eps, rows(xn, H),
                                 cs));
    SF_TRY(kernels::gemv_swiglu(rows(xn, H), L.w_gate, L.w_up, rows(gate, I), cs));
    SF_TRY(kernels::gemv(rows(gate, I), L.w_down, none, rows(tmp, H), cs));
  }
  SF_TRY(kernels::add_rms_norm(rows(x, H), m.n_layers ? rows(tmp, H) : none, m.w.out_norm,
                               c.rms_eps, rows(xn, H), cs));
  SF_TRY(kernels::gemv(rows(xn, H), m.w.lm_head, none, rows(m.plogits.as<float>(), m.vocab), cs));
  SF_TRY(kernels::cuda::stream_synchronize(m.stream));
  logits->resize(size_t(N * m.vocab));
  SF_TRY(m.plogits.download(logits->data(), sizeof(float) * logits->size()));
  m.pos += n;
  m.steps_left -= n;
  return Status::ok();
}

Result<std::vector<int32_t>> DeviceDecodeSession::generate_verified(
    int32_t first_token, int n_new,
    const std::function<void(int, const std::vector<float>&)>& on_logits) {
  Impl& m = *impl_;
  if (m.broken)
    return SF_ERR(kInternal, "device decode: an earlier step failed; reopen the session");
  const kernels::PagedKv all = m.pool.all();
  // saved: the snapshot holds the pool as this round began (taken at its first draft); a round
  // without drafts (the last token alone) takes none and never takes tokens back.
  bool saved = false, pass_saved = false;
  auto restore = [&]() -> Status {
    SF_TRY(kernels::paged_restore(all, m.snap.data(), m.snap.size(), m.cs()));
    m.np_host = m.mark.np;
    m.last_fill = m.mark.fill;
    m.pos = m.mark.pos;
    m.steps_left = m.mark.steps_left;
    return Status::ok();
  };
  VerifyOps ops;
  ops.draft = [&](int32_t t, std::vector<float>* z) -> Status {
    if (!saved) {
      SF_TRY(kernels::paged_snapshot(all, m.snap.data(), m.snap.size(), m.cs()));
      m.mark = Impl::Mark{m.np_host, m.last_fill, m.pos, m.steps_left};
      saved = true;
    }
    const int64_t steps = m.stats.steps;  // a draft is no step of the output
    const Status st = step(t, z);
    m.stats.steps = steps;
    return st;
  };
  ops.drop_drafts = [&]() -> Status { return saved ? restore() : Status::ok(); };
  ops.pass = [&](const std::vector<int32_t>& in, std::vector<float>* zv,
                 std::vector<int64_t>* totals) -> Status {
    // The drafts' snapshot is also the pool before the pass (drop_drafts restored it).
    pass_saved = saved;
    saved = false;
    const int n = int(in.size());
    const Status st = run_pass(in.data(), n, zv);
    if (!st.is_ok()) {
      m.broken = true;
      return st;
    }
    // Each query head read each block of its KV head once; token i computed its own.
    totals->assign(size_t(n), 0);
    for (int i = 0; i < n; ++i) {
      (*totals)[size_t(i)] = m.mirror_append();
      m.stats.blocks_computed += (*totals)[size_t(i)];
    }
    int64_t read = 0;
    for (int32_t np : m.np_host) read += np;
    m.stats.blocks_visited += read * (m.hq / m.hkv);
    if (m.kp.psa_share_kv_head) m.stats.kv_blocks_loaded += read;
    return Status::ok();
  };
  ops.keep = [&](int kept) -> Status {
    if (!pass_saved) return SF_ERR(kInternal, "device decode: no snapshot to take a pass back to");
    // Back to the pool before the pass, then the kept tokens' K/V (the pass's rows) again.
    SF_TRY(restore());
    for (int l = 0; l < m.n_layers; ++l) {
      const int64_t off = int64_t(l) * m.n_max * int64_t(m.hkv) * m.d;
      SF_TRY(kernels::paged_append(m.pool.layer(l), m.pk.as<float>() + off,
                                   m.pv.as<float>() + off, m.cs(), kept));
    }
    for (int i = 0; i < kept; ++i) m.mirror_append();
    m.pos += kept;
    m.steps_left -= kept;
    return kernels::cuda::stream_synchronize(m.stream);
  };
  ops.count_kv = m.kp.psa_share_kv_head;  // the device counts KV-head loads with +gqa only
  auto out = verified_decode(first_token, n_new, m.params, m.vocab, m.hq / m.hkv, &m.stats, ops,
                             on_logits);
  if (!out.is_ok()) m.broken = true;
  return out;
}

#else  // !SF_HAVE_CUDA

struct DevicePagedPool::Impl {};
Result<DevicePagedPool> DevicePagedPool::upload(const PagedKvCache&, int, kvstore::KvEncoding) {
  return SF_ERR(kUnsupported, "device pool: built without CUDA (configure with -DSF_CUDA=ON)");
}
kernels::PagedKv DevicePagedPool::layer(int) const { return {}; }
kernels::PagedKv DevicePagedPool::all() const { return {}; }
size_t DevicePagedPool::bytes() const { return 0; }

struct DeviceDecodeSession::Impl {
  DecodeAttnStats stats;
  DevicePagedPool pool;
  int64_t graph_steps = 0;
};

Result<DeviceDecodeSession> DeviceDecodeSession::open(const model::DeviceModel&,
                                                      const PagedKvCache&, int64_t,
                                                      DecodeAttnParams, int, kvstore::KvEncoding,
                                                      bool, bool) {
  return SF_ERR(kUnsupported, "device decode: built without CUDA (configure with -DSF_CUDA=ON)");
}
Status DeviceDecodeSession::step(int32_t, std::vector<float>*) {
  return SF_ERR(kUnsupported, "device decode: built without CUDA");
}
Status DeviceDecodeSession::run_step(int32_t, std::vector<float>*) {
  return SF_ERR(kUnsupported, "device decode: built without CUDA");
}
Status DeviceDecodeSession::enqueue_step() {
  return SF_ERR(kUnsupported, "device decode: built without CUDA");
}
Status DeviceDecodeSession::run_pass(const int32_t*, int, std::vector<float>*) {
  return SF_ERR(kUnsupported, "device decode: built without CUDA");
}
Result<std::vector<int32_t>> DeviceDecodeSession::generate_verified(
    int32_t, int, const std::function<void(int, const std::vector<float>&)>&) {
  return SF_ERR(kUnsupported, "device decode: built without CUDA");
}

#endif  // SF_HAVE_CUDA

DevicePagedPool::DevicePagedPool() = default;
DevicePagedPool::DevicePagedPool(DevicePagedPool&&) noexcept = default;
DevicePagedPool& DevicePagedPool::operator=(DevicePagedPool&&) noexcept = default;
DevicePagedPool::~DevicePagedPool() = default;

DeviceDecodeSession::DeviceDecodeSession() = default;
DeviceDecodeSession::DeviceDecodeSession(DeviceDecodeSession&&) noexcept = default;
DeviceDecodeSession& DeviceDecodeSession::operator=(DeviceDecodeSession&&) noexcept = default;
DeviceDecodeSession::~DeviceDecodeSession() = default;
const DecodeAttnStats& DeviceDecodeSession::stats() const { return impl_->stats; }
size_t DeviceDecodeSession::pool_bytes() const { return impl_->pool.bytes(); }
int64_t DeviceDecodeSession::graph_steps() const { return impl_->graph_steps; }

Result<std::vector<int32_t>> DeviceDecodeSession::generate_greedy(
    int32_t first_token, int n_new,
    const std::function<void(int, const std::vector<float>&)>& on_logits) {
#if SF_HAVE_CUDA
  if (impl_->verify > 0) return generate_verified(first_token, n_new, on_logits);
#endif
  return greedy_decode(
      first_token, n_new, [this](int32_t t, std::vector<float>* z) { return step(t, z); },
      on_logits);
}

}  // namespace sf::decode
