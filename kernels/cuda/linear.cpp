// linear() on cuBLASLt. cuBLAS is column-major: the row-major y[n,out] = x[n,in] @ w[out,in]^T is
// D[out,n] = op(A)[out,in] * B[in,n] with A = w read transposed (stored [in,out], ld = w's row
// stride) and B = x as stored ([in,n], ld = x's row stride): the "TN" case every GEMM kernel on
// Hopper supports. The bias is the BIAS epilogue (one value per row of D = per output feature).
//
// Plan/run split: per thread and device one handle and one workspace (created once); per GEMM
// shape one descriptor set and heuristic choice (created once). The run path only sets the bias
// pointer and enqueues. Contract: the workspace is per thread, so one thread must not have
// linear() running on two streams that execute concurrently.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_status.h"

namespace sf::kernels::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommended size on Hopper
constexpr size_t kMaxPlans = 256;  // chunk tails make n vary; bound the cache, rebuild when full

Status lt_status(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::ok();
  const Code code = s == CUBLAS_STATUS_NOT_SUPPORTED  ? Code::kUnsupported
                    : s == CUBLAS_STATUS_ALLOC_FAILED ? Code::kResourceExhausted
                                                      : Code::kInternal;
  return Status(
      code,
      std::string(what) + ": " + cublasLtGetStatusName(s) + " (" + cublasLtGetStatusString(s) + ")",
      file, line);
}
#define SF_LT_TRY(expr) SF_TRY(lt_status((expr), #expr, __FILE__, __LINE__))

// Largest power of two <= 256 dividing the address: the heuristic must only offer kernels whose
// vector loads this alignment allows (its default assumes 256).
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// m, n, k, lda, ldb, ldd, input type, bias, alignments of A, B, D.
using GemmKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool,
                           uint32_t, uint32_t, uint32_t>;

struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool bias = false;

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct LtContext {
  int device = -1;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<GemmKey, std::unique_ptr<GemmPlan>> plans;

  LtContext() = default;
  LtContext(const LtContext&) = delete;
  LtContext& operator=(const LtContext&) = delete;
  ~LtContext() {  // thread exit; errors cannot be reported (the runtime may already be unloading)
    plans.clear();
    if (workspace) {
      (void)cudaSetDevice(device);
      (void)cudaFree(workspace);
    }
    if (handle) cublasLtDestroy(handle);
  }
};

thread_local std::vector<std::unique_ptr<LtContext>> t_contexts;  // indexed by device ordinal

Result<LtContext*> context_for_current_device() {
  int dev = 0;
  SF_CUDA_TRY(cudaGetDevice(&dev));
  if (t_contexts.size() <= size_t(dev)) t_contexts.resize(size_t(dev) + 1);
  std::unique_ptr<LtContext>& slot = t_contexts[size_t(dev)];
  if (!slot) {
    auto ctx = std::make_unique<LtContext>();
    ctx->device = dev;
    SF_LT_TRY(cublasLtCreate(&ctx->handle));
    SF_CUDA_TRY(cudaMalloc(&ctx->workspace, kWorkspaceBytes));
    slot = std::move(ctx);
  }
  return slot.get();
}

Result<cudaDataType_t> input_type(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return SF_ERR(kUnsupported, std::string("linear: dtype ") + dtype_name(t) +
                                      " (CUDA supports F32, F16, BF16)");
  }
}

template <typename T>
Status set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  SF_LT_TRY(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
  return Status::ok();
}
template <typename T>
Status set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                const T& value) {
  SF_LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  return Status::ok();
}

struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
  }
};

Status build_plan(LtContext& ctx, cudaDataType_t ab, const GemmKey& key, GemmPlan& plan) {
  const auto [m, n, k, lda, ldb, ldd, type, bias, align_a, align_b, align_d] = key;
  // Strict fp32 accumulation (no TF32) for every input type: this is the reference-grade path.
  SF_LT_TRY(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  SF_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, cublasOperation_t(CUBLAS_OP_T)));
  SF_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, cublasOperation_t(CUBLAS_OP_N)));
  plan.bias = bias;
  // The bias type defaults to D's type, F32.
  if (bias)
    SF_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                    cublasLtEpilogue_t(CUBLASLT_EPILOGUE_BIAS)));
  SF_LT_TRY(cublasLtMatrixLayoutCreate(&plan.a, ab, uint64_t(k), uint64_t(m), lda));
  SF_LT_TRY(cublasLtMatrixLayoutCreate(&plan.b, ab, uint64_t(k), uint64_t(n), ldb));
  SF_LT_TRY(cublasLtMatrixLayoutCreate(&plan.d, CUDA_R_32F, uint64_t(m), uint64_t(n), ldd));

  PreferenceGuard guard;
  SF_LT_TRY(cublasLtMatmulPreferenceCreate(&guard.pref));
  cublasLtMatmulPreference_t pref = guard.pref;
  SF_TRY(set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(kWorkspaceBytes)));
  SF_TRY(set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a));
  SF_TRY(set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b));
  SF_TRY(set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d));
  SF_TRY(set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d));

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  SF_LT_TRY(cublasLtMatmulAlgoGetHeuristic(ctx.handle, plan.desc, plan.a, plan.b, plan.d, plan.d,
                                           pref, 1, &result, &found));
  if (found == 0)
    return SF_ERR(kUnsupported, "linear: cuBLASLt has no algorithm for m=" + std::to_string(m) +
                                    " n=" + std::to_string(n) + " k=" + std::to_string(k));
  plan.algo = result.algo;
  return Status::ok();
}

struct Planned {
  LtContext* ctx;
  GemmPlan* plan;
};

Result<Planned> plan_linear(const TensorView& x, const TensorView& w, const TensorView& bias,
                            const TensorView& y) {
  SF_ASSIGN(const cudaDataType_t ab, input_type(x.dtype));
  SF_ENSURE(w.dtype == x.dtype, kUnsupported,
            std::string("linear: x is ") + dtype_name(x.dtype) + " but w is " +
                dtype_name(w.dtype) + " (CUDA needs one input dtype)");
  SF_ENSURE(y.dtype == DType::kF32, kUnsupported, "linear: y must be F32 on CUDA");
  SF_ENSURE(!bias.data || (bias.dtype == DType::kF32 && bias.contiguous()), kUnsupported,
            "linear: bias must be contiguous F32 on CUDA");
  SF_ENSURE(x.shape[1] > 0, kInvalidArgument, "linear: in must be positive");
  SF_ASSIGN(LtContext * ctx, context_for_current_device());
  const GemmKey key{w.shape[0],
                    x.shape[0],
                    x.shape[1],
                    w.stride[0],
                    x.stride[0],
                    y.stride[0],
                    int(ab),
                    bias.data != nullptr,
                    alignment_of(w.data),
                    alignment_of(x.data),
                    alignment_of(y.data)};
  auto it = ctx->plans.find(key);
  if (it == ctx->plans.end()) {
    if (ctx->plans.size() >= kMaxPlans) ctx->plans.clear();
    auto plan = std::make_unique<GemmPlan>();
    SF_TRY(build_plan(*ctx, ab, key, *plan));
    it = ctx->plans.emplace(key, std::move(plan)).first;
  }
  return Planned{ctx, it->second.get()};
}

}  // namespace

Status linear_plan(const TensorView& x, const TensorView& w, const TensorView& bias,
                   const TensorView& y) {
  SF_ASSIGN(Planned p, plan_linear(x, w, bias, y));
  (void)p;
  return Status::ok();
}

Status linear(const TensorView& x, const TensorView& w, const TensorView& bias, TensorView y,
              void* stream) {
  if (x.shape[0] == 0 || w.shape[0] == 0) return Status::ok();
  SF_ASSIGN(Planned p, plan_linear(x, w, bias, y));
  if (p.plan->bias) SF_TRY(set_desc(p.plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias.data));
  const float alpha = 1.f, beta = 0.f;
  SF_LT_TRY(cublasLtMatmul(p.ctx->handle, p.plan->desc, &alpha, w.data, p.plan->a, x.data,
                           p.plan->b, &beta, y.data, p.plan->d, y.data, p.plan->d, &p.plan->algo,
                           p.ctx->workspace, kWorkspaceBytes, static_cast<cudaStream_t>(stream)));
  return Status::ok();
}

}  // namespace sf::kernels::cuda
