// The BF16 dense attention path: cuDNN's fused flash attention (SDPA forward), described through
// the cuDNN graph API with NVIDIA's header-only frontend. The issue allows it for the dense path
// ("our kernel or cuDNN's, whichever is faster"); the sparse kernel stays ours.
//
// Layout: our q [n_q, heads, D] and k/v [n_k, kv_heads, D] are cuDNN's [b=1, h, s, D] tensors with
// strides (s*h*D, D, h*D, 1): no transpose, GQA native (cuDNN broadcasts each KV head over its
// query-head group). Stats (LSE, natural log of the softmax denominator including the row max)
// is [1, h, n_q, 1] with strides (h*n_q, n_q, 1, 1): our [heads, n_q] layout.
//
// Causal alignment: q_offset == 0 is cuDNN's top-left diagonal; q_offset == n_k - n_q (queries
// are the last n_q keys, as in chunked or CP prefill) is bottom-right. Any other offset is
// kUnsupported here (the fp32 kernel takes any offset).
//
// Plan/run split as linear.cpp: per thread and device one cuDNN handle; per shape one built graph
// (heuristics, execution plan) and its workspace, created once. The run path sets the stream and
// enqueues one execute; nothing allocates on the device or waits for the host.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"

#if SF_HAVE_CUDNN
#include <cudnn.h>

#include <cudnn_frontend.h>
#endif

namespace sf::kernels::cuda {

#if SF_HAVE_CUDNN
namespace {

namespace fe = cudnn_frontend;

constexpr size_t kMaxPlans = 64;  // lengths vary per request; bound the cache, rebuild when full
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats };

Status cudnn_err(cudnnStatus_t s, const char* what, const char* file, int line) {
  if (s == CUDNN_STATUS_SUCCESS) return Status::ok();
  return Status(Code::kInternal, std::string(what) + ": " + cudnnGetErrorString(s), file, line);
}
#define SF_CUDNN_TRY(expr) SF_TRY(cudnn_err((expr), #expr, __FILE__, __LINE__))

Status fe_err(fe::error_object e, const char* step, const char* file, int line) {
  if (e.is_good()) return Status::ok();
  const Code code = e.get_code() == fe::error_code_t::GRAPH_NOT_SUPPORTED ? Code::kUnsupported
                                                                           : Code::kInternal;
  return Status(code, std::string("cuDNN attention graph: ") + step + ": " + e.get_message(),
                file, line);
}
#define SF_FE_TRY(expr, step) SF_TRY(fe_err((expr), step, __FILE__, __LINE__))

// n_q, n_k, heads, kv_heads, head_dim, q_offset, scale bits, causal.
using Key = std::tuple<int64_t, int64_t, int, int, int, int64_t, uint32_t, bool>;

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  std::unordered_map<int64_t, void*> pack{{kQ, nullptr}, {kK, nullptr}, {kV, nullptr},
                                          {kO, nullptr}, {kStats, nullptr}};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (workspace) cudaFree(workspace);
  }
};

struct Context {
  int device = -1;
  cudnnHandle_t handle = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans;
  Context() = default;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context() {  // thread exit: plans first (they use the handle), errors cannot be reported
    plans.clear();
    if (handle) cudnnDestroy(handle);
  }
};

// One context per (thread, device), like linear.cpp.
Result<Context*> context() {
  thread_local std::map<int, std::unique_ptr<Context>> ctxs;
  int dev = 0;
  SF_CUDA_TRY(cudaGetDevice(&dev));
  auto& c = ctxs[dev];
  if (!c) {
    auto fresh = std::make_unique<Context>();
    fresh->device = dev;
    SF_CUDNN_TRY(cudnnCreate(&fresh->handle));
    c = std::move(fresh);
  }
  return c.get();
}

float scale_of(const AttentionParams& p, int d) {
  return p.scale > 0.f ? p.scale : 1.f / std::sqrt(float(d));
}

Key key_of(const TensorView& q, const TensorView& k, const AttentionParams& p) {
  const float sc = scale_of(p, int(q.shape[2]));
  uint32_t bits = 0;
  std::memcpy(&bits, &sc, sizeof bits);
  return Key{q.shape[0], k.shape[0], int(q.shape[1]), int(k.shape[1]), int(q.shape[2]),
             p.causal ? p.q_offset : 0, bits, p.causal};
}

Status check_shape(const TensorView& q, const TensorView& k, const AttentionParams& p) {
  const int64_t n_q = q.shape[0], n_k = k.shape[0];
  const int d = int(q.shape[2]);
  SF_ENSURE(d % 8 == 0 && d <= 256, kUnsupported,
            "cuDNN attention: head_dim " + std::to_string(d) + " (needs a multiple of 8, <= 256)");
  if (p.causal) {
    SF_ENSURE(p.q_offset == 0 || p.q_offset == n_k - n_q, kUnsupported,
              "cuDNN attention: causal q_offset " + std::to_string(p.q_offset) +
                  " (supported: 0, or n_k - n_q = " + std::to_string(n_k - n_q) + ")");
  }
  return Status::ok();
}

Status build(Context* c, const TensorView& q, const TensorView& k, const AttentionParams& p,
             Plan* plan) {
  const int64_t n_q = q.shape[0], n_k = k.shape[0], h = q.shape[1], hk = k.shape[1],
                d = q.shape[2];
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto input = [&](const char* name, int64_t uid, int64_t heads, int64_t s) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({1, heads, s, d})
                         .set_stride({s * heads * d, d, heads * d, 1}));
  };
  auto Q = input("Q", kQ, h, n_q);
  auto K = input("K", kK, hk, n_k);
  auto V = input("V", kV, hk, n_k);
  auto opts = fe::graph::SDPA_attributes()
                  .set_name("sparsefill_dense")
                  .set_generate_stats(true)
                  .set_attn_scale(scale_of(p, int(d)));
  if (p.causal) {
    if (p.q_offset == 0)
      opts.set_causal_mask(true);
    else
      opts.set_causal_mask_bottom_right(true);
  }
  auto [O, Stats] = g->sdpa(Q, K, V, opts);
  O->set_output(true).set_uid(kO).set_dim({1, h, n_q, d}).set_stride({n_q * h * d, d, h * d, 1});
  Stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({1, h, n_q, 1})
      .set_stride({h * n_q, n_q, 1, 1});
  SF_FE_TRY(g->validate(), "validate");
  SF_FE_TRY(g->build_operation_graph(c->handle), "build_operation_graph");
  SF_FE_TRY(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  SF_FE_TRY(g->check_support(c->handle), "check_support");
  SF_FE_TRY(g->build_plans(c->handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  SF_FE_TRY(g->get_workspace_size(plan->workspace_bytes), "get_workspace_size");
  if (plan->workspace_bytes > 0) SF_CUDA_TRY(cudaMalloc(&plan->workspace, size_t(plan->workspace_bytes)));
  plan->graph = std::move(g);
  return Status::ok();
}

Result<Plan*> plan_for(const TensorView& q, const TensorView& k, const AttentionParams& p) {
  SF_TRY(check_shape(q, k, p));
  SF_ASSIGN(Context* c, context());
  const Key key = key_of(q, k, p);
  auto it = c->plans.find(key);
  if (it != c->plans.end()) return it->second.get();
  if (c->plans.size() >= kMaxPlans) c->plans.clear();
  auto plan = std::make_unique<Plan>();
  try {
    SF_TRY(build(c, q, k, p, plan.get()));
  } catch (const std::exception& e) {  // the frontend reports some failures by throwing
    return SF_ERR(kInternal, std::string("cuDNN attention graph: ") + e.what());
  }
  Plan* raw = plan.get();
  c->plans.emplace(key, std::move(plan));
  return raw;
}

}  // namespace

Status attention_dense_bf16_available() {
  const size_t v = cudnnGetVersion();
  // 9.x: SDPA with GQA, bottom-right causal alignment and stats, on Hopper.
  SF_ENSURE(v >= 90000, kUnsupported,
            "cuDNN attention: libcudnn " + std::to_string(v) + " is older than 9.0");
  return Status::ok();
}

Status attention_dense_plan(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const AttentionParams& p) {
  SF_TRY(attention_dense_bf16_available());
  SF_ASSIGN(Plan * plan, plan_for(q, k, p));
  (void)plan;
  return Status::ok();
}

Status attention_dense_cudnn(const TensorView& q, const TensorView& k, const TensorView& v,
                             TensorView out, TensorView lse, const AttentionParams& p,
                             void* stream) {
  SF_ASSIGN(Plan * plan, plan_for(q, k, p));
  SF_ASSIGN(Context* c, context());
  SF_CUDNN_TRY(cudnnSetStream(c->handle, static_cast<cudaStream_t>(stream)));
  plan->pack[kQ] = q.data;
  plan->pack[kK] = k.data;
  plan->pack[kV] = v.data;
  plan->pack[kO] = out.data;
  plan->pack[kStats] = lse.data;
  try {
    SF_FE_TRY(plan->graph->execute(c->handle, plan->pack, plan->workspace), "execute");
  } catch (const std::exception& e) {
    return SF_ERR(kInternal, std::string("cuDNN attention execute: ") + e.what());
  }
  return Status::ok();
}

#else  // built without cuDNN

Status attention_dense_bf16_available() {
  return SF_ERR(kUnsupported,
                "BF16 dense attention: built without cuDNN (SF_CUDNN; needs cudnn.h, libcudnn and "
                "the frontend headers from deploy/fetch-cudnn-frontend.sh)");
}
Status attention_dense_plan(const TensorView&, const TensorView&, const TensorView&,
                            const TensorView&, const AttentionParams&) {
  return attention_dense_bf16_available();
}
Status attention_dense_cudnn(const TensorView&, const TensorView&, const TensorView&, TensorView,
                             TensorView, const AttentionParams&, void*) {
  return attention_dense_bf16_available();
}

#endif

}  // namespace sf::kernels::cuda
