// The CUDA backend against the CPU reference, op by op (ggml's test-backend-ops habit):
//  - fresh random inputs every run; the seed is printed, SF_TEST_SEED=<seed> replays a run;
//  - device outputs are poisoned with NaN before each launch, so unwritten elements show;
//  - every device buffer carries a sentinel guard region behind it, checked after each op;
//  - the relative L2 error ||gpu - cpu|| / ||cpu|| and the max-abs error are bounded per op, with
//    the bound and its reason stated next to each test; any NaN/inf the reference lacks fails.
// Every test skips (GTEST_SKIP) where no CUDA device is present, so the suite passes on CPU hosts.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/api.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/kv_importance.h"
#include "kernels/sparse.h"
#include "tests/common/test_seed.h"

namespace sf::kernels {
namespace {

#define ASSERT_OK(expr)                                           \
  do {                                                            \
    const ::sf::Status st_ = (expr);                              \
    ASSERT_TRUE(st_.is_ok()) << #expr << ": " << st_.to_string(); \
  } while (0)

#define ASSERT_CUDA(expr)                                                      \
  do {                                                                         \
    const cudaError_t e_ = (expr);                                             \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorName(e_) << " " \
                               << cudaGetErrorString(e_);                      \
  } while (0)

const Stream kCpu{};
// The legacy default stream: the synchronous copies in DeviceBuffer are ordered after its work.
const Stream kGpu{Device::kCuda, nullptr};

constexpr size_t kGuardBytes = 256;
// 0xA5A5A5A5 as a float is -2.9e-16: no op writes that by chance.
constexpr uint8_t kGuardByte = 0xA5;
constexpr uint32_t kPoisonBits = 0x7FC0DEADu;  // a quiet NaN

struct Tolerance {
  double nerr;     // bound on ||got - ref||_2 / ||ref||_2
  double max_abs;  // bound on max |got - ref|
};
constexpr Tolerance kExact{0.0, 0.0};

uint64_t base_seed() { return testing::process_seed(); }

// A device allocation followed by kGuardBytes of sentinel that no op may touch.
class DevBuf {
 public:
  Status alloc(size_t bytes) {
    bytes_ = bytes;
    SF_TRY(buf_.alloc(bytes + kGuardBytes));
    const std::vector<uint8_t> guard(kGuardBytes, kGuardByte);
    return buf_.upload(guard.data(), kGuardBytes, bytes);
  }
  template <typename T>
  Status alloc_upload(const std::vector<T>& host) {
    SF_TRY(alloc(host.size() * sizeof(T)));
    return buf_.upload(host.data(), bytes_);
  }
  template <typename T>
  Status upload(const std::vector<T>& host) {
    SF_ENSURE(host.size() * sizeof(T) == bytes_, kInvalidArgument, "DevBuf::upload size");
    return buf_.upload(host.data(), bytes_);
  }
  Status poison() {
    const std::vector<uint32_t> nan((bytes_ + 3) / 4, kPoisonBits);
    return buf_.upload(nan.data(), bytes_);
  }
  Status download_raw(void* dst, size_t bytes) const { return buf_.download(dst, bytes); }
  Status download(std::vector<float>* out) const {
    out->assign(bytes_ / sizeof(float), 0.f);
    return buf_.download(out->data(), bytes_);
  }
  Status guard_intact(bool* ok) const {
    std::vector<uint8_t> g(kGuardBytes);
    SF_TRY(buf_.download(g.data(), kGuardBytes, bytes_));
    *ok = std::all_of(g.begin(), g.end(), [](uint8_t b) { return b == kGuardByte; });
    return Status::ok();
  }
  void* data() const { return buf_.data(); }
  TensorView view(DType t, std::initializer_list<int64_t> dims) const {
    return TensorView::make(buf_.data(), t, dims, Device::kCuda);
  }

 private:
  cuda::DeviceBuffer buf_;
  size_t bytes_ = 0;
};

// An attention test's device buffers: q, k and v uploaded; out and lse allocated and poisoned.
struct DevAttention {
  DevBuf q, k, v, out, lse;
  template <typename T>
  Status upload(const std::vector<T>& hq, const std::vector<T>& hk, const std::vector<T>& hv,
                size_t out_bytes, size_t lse_bytes) {
    SF_TRY(q.alloc_upload(hq));
    SF_TRY(k.alloc_upload(hk));
    SF_TRY(v.alloc_upload(hv));
    SF_TRY(out.alloc(out_bytes));
    SF_TRY(lse.alloc(lse_bytes));
    SF_TRY(out.poison());
    return lse.poison();
  }
};

struct ErrStats {
  double nerr = 0, max_abs = 0;
  int64_t bad_nonfinite = 0, first_bad = -1;
};

// Equal values (infinities included) match exactly; a NaN/inf the reference lacks is counted.
ErrStats compare(const std::vector<float>& got, const std::vector<float>& ref) {
  ErrStats e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isfinite(ref[i])) den += double(ref[i]) * ref[i];
    if (got[i] == ref[i]) continue;
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) {
      if (e.first_bad < 0) e.first_bad = int64_t(i);
      ++e.bad_nonfinite;
      continue;
    }
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    e.max_abs = std::max(e.max_abs, std::abs(d));
  }
  e.nerr = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
  return e;
}

// Downloads `dev` (F32), checks its guard, and compares with `ref` under `tol`.
void expect_matches(const std::string& what, const DevBuf& dev, const std::vector<float>& ref,
                    Tolerance tol) {
  std::vector<float> got;
  ASSERT_OK(cuda::stream_synchronize(nullptr));
  ASSERT_OK(dev.download(&got));
  ASSERT_EQ(got.size(), ref.size()) << what;
  bool guard_ok = false;
  ASSERT_OK(dev.guard_intact(&guard_ok));
  EXPECT_TRUE(guard_ok) << what << ": write past the end of the output (sentinel overwritten)";
  const ErrStats e = compare(got, ref);
  std::cout << "  " << what << ": nerr=" << e.nerr << " (tol " << tol.nerr
            << ")  max_abs=" << e.max_abs << " (tol " << tol.max_abs << ")\n";
  EXPECT_EQ(e.bad_nonfinite, 0) << what << ": non-finite or unwritten element, first at "
                                << e.first_bad << " got "
                                << (e.first_bad >= 0 ? got[size_t(e.first_bad)] : 0.f) << " want "
                                << (e.first_bad >= 0 ? ref[size_t(e.first_bad)] : 0.f);
  EXPECT_LE(e.nerr, tol.nerr) << what;
  EXPECT_LE(e.max_abs, tol.max_abs) << what;
}

// Rounds x to bf16: the bits for the device and the rounded values for the fp32 reference.
void to_bf16(const std::vector<float>& x, std::vector<uint16_t>* bits, std::vector<float>* rounded) {
  bits->resize(x.size());
  rounded->resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    (*bits)[i] = f32_to_bf16(x[i]);
    (*rounded)[i] = bf16_to_f32((*bits)[i]);
  }
}

// expect_matches for a BF16 output: downloads, widens, checks the guard and the bounds.
void expect_matches_bf16(const std::string& what, const DevBuf& dev, const std::vector<float>& ref,
                         Tolerance tol) {
  ASSERT_OK(cuda::stream_synchronize(nullptr));
  std::vector<uint16_t> bits(ref.size());
  ASSERT_OK(dev.download_raw(bits.data(), bits.size() * 2));
  std::vector<float> got(ref.size());
  for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_f32(bits[i]);
  bool guard_ok = false;
  ASSERT_OK(dev.guard_intact(&guard_ok));
  EXPECT_TRUE(guard_ok) << what << ": write past the end of out";
  const ErrStats e = compare(got, ref);
  std::cout << "  " << what << " out: nerr=" << e.nerr << " (tol " << tol.nerr
            << ")  max_abs=" << e.max_abs << " (tol " << tol.max_abs << ")\n";
  EXPECT_EQ(e.bad_nonfinite, 0) << what << ": non-finite or unwritten out element, first at "
                                << e.first_bad;
  EXPECT_LE(e.nerr, tol.nerr) << what;
  EXPECT_LE(e.max_abs, tol.max_abs) << what;
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const Status st = cuda::device_count(&n);
    if (!st.is_ok()) GTEST_SKIP() << "no CUDA device: " << st.to_string();
    if (n == 0) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount returned 0";
    std::cout << "  seed=" << base_seed() << " (replay with SF_TEST_SEED=" << base_seed() << ")\n";
    rng_.seed(base_seed());
  }

  std::vector<float> uniform(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  std::vector<int32_t> ints(size_t n, int32_t lo, int32_t hi) {  // [lo, hi]
    std::uniform_int_distribution<int32_t> dist(lo, hi);
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = dist(rng_);
    return v;
  }

  // Attention inputs rounded to bf16 (q ~ U(-3, 3), k and v ~ U(-1, 1)): the bits the device
  // reads and the values the CPU reference sees.
  struct Bf16Qkv {
    std::vector<uint16_t> qb, kb, vb;
    std::vector<float> q, k, v;
  };
  Bf16Qkv bf16_qkv(int64_t n_q, int64_t heads, int64_t n_k, int64_t kv_heads, int64_t d) {
    Bf16Qkv x;
    to_bf16(uniform(size_t(n_q * heads * d), -3.f, 3.f), &x.qb, &x.q);
    to_bf16(uniform(size_t(n_k * kv_heads * d), -1.f, 1.f), &x.kb, &x.k);
    to_bf16(uniform(size_t(n_k * kv_heads * d), -1.f, 1.f), &x.vb, &x.v);
    return x;
  }

  std::mt19937_64 rng_;
};

// ---- embedding: a gather plus exact dtype conversions -> bit-exact. ----------------------------
TEST_F(CudaOps, Embedding) {
  const int64_t vocab = 1000, hidden = 300, n = 37;  // hidden not a multiple of the block size
  std::vector<int32_t> ids = ints(size_t(n), 0, int32_t(vocab - 1));
  ids[0] = 0;
  ids[1] = int32_t(vocab - 1);
  const std::vector<float> values = uniform(size_t(vocab * hidden), -1.f, 1.f);
  DevBuf d_ids;
  ASSERT_OK(d_ids.alloc_upload(ids));
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> half(values.size());
    const void* host_table = values.data();
    DevBuf d_table;
    if (t == DType::kF32) {
      ASSERT_OK(d_table.alloc_upload(values));
    } else {
      for (size_t i = 0; i < values.size(); ++i)
        half[i] = t == DType::kF16 ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
      host_table = half.data();
      ASSERT_OK(d_table.alloc_upload(half));
    }
    std::vector<float> ref(size_t(n * hidden));
    ASSERT_OK(embedding(TensorView::make(const_cast<void*>(host_table), t, {vocab, hidden}),
                        ids.data(), n, TensorView::make(ref.data(), DType::kF32, {n, hidden}),
                        kCpu));
    DevBuf d_out;
    ASSERT_OK(d_out.alloc(ref.size() * 4));
    ASSERT_OK(d_out.poison());
    ASSERT_OK(embedding(d_table.view(t, {vocab, hidden}), static_cast<const int32_t*>(d_ids.data()),
                        n, d_out.view(DType::kF32, {n, hidden}), kGpu));
    expect_matches(std::string("embedding ") + dtype_name(t), d_out, ref, kExact);
  }
}

// ---- rms_norm: fp32 block reduction vs the CPU's double sum; one rounding of the 1/rms factor
// differs by a few ulp, so relative 1e-6 (about 8 ulp) and 1e-5 absolute on outputs of O(1-5). ----
TEST_F(CudaOps, RmsNorm) {
  const int64_t rows = 19, hidden = 1000;
  const Tolerance tol{1e-6, 1e-5};
  const std::vector<float> x = uniform(size_t(rows * hidden), -2.f, 2.f);
  const std::vector<float> w = uniform(size_t(hidden), 0.5f, 1.5f);
  std::vector<float> ref(x.size());
  std::vector<float> x_copy = x;
  ASSERT_OK(rms_norm(TensorView::make(x_copy.data(), DType::kF32, {rows, hidden}),
                     TensorView::make(const_cast<float*>(w.data()), DType::kF32, {hidden}), 1e-5f,
                     TensorView::make(ref.data(), DType::kF32, {rows, hidden}), kCpu));
  DevBuf d_x, d_w, d_out;
  ASSERT_OK(d_x.alloc_upload(x));
  ASSERT_OK(d_w.alloc_upload(w));
  ASSERT_OK(d_out.alloc(x.size() * 4));
  ASSERT_OK(d_out.poison());
  ASSERT_OK(rms_norm(d_x.view(DType::kF32, {rows, hidden}), d_w.view(DType::kF32, {hidden}), 1e-5f,
                     d_out.view(DType::kF32, {rows, hidden}), kGpu));
  expect_matches("rms_norm", d_out, ref, tol);
  // out aliasing x (allowed by the API): the input is the output, so no poisoning here.
  ASSERT_OK(rms_norm(d_x.view(DType::kF32, {rows, hidden}), d_w.view(DType::kF32, {hidden}), 1e-5f,
                     d_x.view(DType::kF32, {rows, hidden}), kGpu));
  expect_matches("rms_norm in place", d_x, ref, tol);
}

// ---- rope: both backends form the angle in double from the same fp32 inverse frequencies and
// round cos/sin to fp32, so they differ only by FMA contraction (~1 ulp): 1e-6 / 1e-5. Positions
// reach 131071, where an fp32 angle would be off by ~1e-2 and fail this bound. ------------------
TEST_F(CudaOps, Rope) {
  const int64_t n = 23, heads = 5, head_dim = 128;
  const Tolerance tol{1e-6, 1e-5};
  std::vector<float> factors = uniform(size_t(head_dim / 2), 1.f, 8.f);
  struct Case {
    const char* name;
    bool neox;
    bool llama3;
    bool freq_factors;
    int rot_dim;
  };
  const Case cases[] = {
      {"adjacent", false, false, false, 0},           {"rotate_half", true, false, false, 0},
      {"adjacent_llama3", false, true, false, 0},     {"rotate_half_llama3", true, true, false, 0},
      {"freq_factors", true, false, true, 0},         {"partial_rot64", false, false, false, 64},
      {"partial_rot64_half", true, false, false, 64},
  };
  std::vector<int32_t> pos = ints(size_t(n), 0, 131071);
  pos[0] = 0;
  DevBuf d_pos;
  ASSERT_OK(d_pos.alloc_upload(pos));
  for (const Case& c : cases) {
    RopeParams p;
    p.neox = c.neox;
    p.rot_dim = c.rot_dim;
    if (c.llama3) {
      p.theta = 500000.f;
      p.scaling_factor = 8.f;
    }
    if (c.freq_factors) p.freq_factors = factors.data();
    const std::vector<float> x = uniform(size_t(n * heads * head_dim), -1.f, 1.f);
    std::vector<float> ref = x;
    ASSERT_OK(
        rope(TensorView::make(ref.data(), DType::kF32, {n, heads, head_dim}), pos.data(), p, kCpu));
    DevBuf d_x;
    ASSERT_OK(d_x.alloc_upload(x));
    ASSERT_OK(rope(d_x.view(DType::kF32, {n, heads, head_dim}),
                   static_cast<const int32_t*>(d_pos.data()), p, kGpu));
    expect_matches(std::string("rope ") + c.name, d_x, ref, tol);
  }
}

// ---- swiglu: expf differs from glibc's by <= 2 ulp; with gate in [-8, 8] and up in [-2, 2]
// outputs reach 16, so 1e-6 relative and 3e-5 absolute (~16 ulp at 16). -----------------------
TEST_F(CudaOps, Swiglu) {
  const int64_t n = 10007;
  const Tolerance tol{1e-6, 3e-5};
  const std::vector<float> gate = uniform(size_t(n), -8.f, 8.f);
  const std::vector<float> up = uniform(size_t(n), -2.f, 2.f);
  std::vector<float> ref(static_cast<size_t>(n));
  ASSERT_OK(swiglu(TensorView::make(const_cast<float*>(gate.data()), DType::kF32, {n}),
                   TensorView::make(const_cast<float*>(up.data()), DType::kF32, {n}),
                   TensorView::make(ref.data(), DType::kF32, {n}), kCpu));
  DevBuf d_gate, d_up, d_out;
  ASSERT_OK(d_gate.alloc_upload(gate));
  ASSERT_OK(d_up.alloc_upload(up));
  ASSERT_OK(d_out.alloc(size_t(n) * 4));
  ASSERT_OK(d_out.poison());
  ASSERT_OK(swiglu(d_gate.view(DType::kF32, {n}), d_up.view(DType::kF32, {n}),
                   d_out.view(DType::kF32, {n}), kGpu));
  expect_matches("swiglu", d_out, ref, tol);
  ASSERT_OK(swiglu(d_gate.view(DType::kF32, {n}), d_up.view(DType::kF32, {n}),
                   d_gate.view(DType::kF32, {n}), kGpu));
  expect_matches("swiglu in place", d_gate, ref, tol);
}

// ---- add_inplace: one correctly rounded fp32 add on both sides -> bit-exact. ------------------
TEST_F(CudaOps, AddInplace) {
  const int64_t n = 10007;
  const std::vector<float> a = uniform(size_t(n), -4.f, 4.f);
  const std::vector<float> b = uniform(size_t(n), -4.f, 4.f);
  std::vector<float> ref = a;
  ASSERT_OK(add_inplace(TensorView::make(ref.data(), DType::kF32, {n}),
                        TensorView::make(const_cast<float*>(b.data()), DType::kF32, {n}), kCpu));
  DevBuf d_a, d_b;
  ASSERT_OK(d_a.alloc_upload(a));
  ASSERT_OK(d_b.alloc_upload(b));
  ASSERT_OK(add_inplace(d_a.view(DType::kF32, {n}), d_b.view(DType::kF32, {n}), kGpu));
  expect_matches("add_inplace", d_a, ref, kExact);
}

// ---- linear -----------------------------------------------------------------------------------
struct LinearCase {
  int64_t n, in, out;
  bool bias;
  int64_t x_pad;  // x is a view of rows of in + x_pad elements (row stride != in)
};

// Inputs are drawn in fp32 and rounded to `t`; the CPU reference runs in fp32 on the rounded
// values, so only the accumulation differs between the two.
void run_linear_case(DType t, const LinearCase& c, const std::vector<float>& x_raw,
                     const std::vector<float>& w_raw, const std::vector<float>& b, Tolerance tol) {
  const int64_t ldx = c.in + c.x_pad;
  std::vector<float> x_f(x_raw.size()), w_f(w_raw.size());
  std::vector<uint16_t> x_h(x_raw.size()), w_h(w_raw.size());
  auto round = [t](float v, uint16_t* h) {
    if (t == DType::kF16) {
      *h = f32_to_f16(v);
      return f16_to_f32(*h);
    }
    if (t == DType::kBF16) {
      *h = f32_to_bf16(v);
      return bf16_to_f32(*h);
    }
    return v;
  };
  for (size_t i = 0; i < x_raw.size(); ++i) x_f[i] = round(x_raw[i], &x_h[i]);
  for (size_t i = 0; i < w_raw.size(); ++i) w_f[i] = round(w_raw[i], &w_h[i]);

  TensorView x_cpu = TensorView::make(x_f.data(), DType::kF32, {c.n, ldx});
  x_cpu.shape[1] = c.in;
  std::vector<float> ref(size_t(c.n * c.out));
  TensorView no_bias;
  ASSERT_OK(linear(
      x_cpu, TensorView::make(w_f.data(), DType::kF32, {c.out, c.in}),
      c.bias ? TensorView::make(const_cast<float*>(b.data()), DType::kF32, {c.out}) : no_bias,
      TensorView::make(ref.data(), DType::kF32, {c.n, c.out}), kCpu));

  DevBuf d_x, d_w, d_b, d_y;
  if (t == DType::kF32) {
    ASSERT_OK(d_x.alloc_upload(x_f));
    ASSERT_OK(d_w.alloc_upload(w_f));
  } else {
    ASSERT_OK(d_x.alloc_upload(x_h));
    ASSERT_OK(d_w.alloc_upload(w_h));
  }
  ASSERT_OK(d_b.alloc_upload(b));
  ASSERT_OK(d_y.alloc(ref.size() * 4));
  ASSERT_OK(d_y.poison());
  TensorView x_gpu = d_x.view(t, {c.n, ldx});
  x_gpu.shape[1] = c.in;
  TensorView b_gpu = c.bias ? d_b.view(DType::kF32, {c.out}) : no_bias;
  ASSERT_OK(
      linear(x_gpu, d_w.view(t, {c.out, c.in}), b_gpu, d_y.view(DType::kF32, {c.n, c.out}), kGpu));
  expect_matches(std::string("linear ") + dtype_name(t) + " n=" + std::to_string(c.n) +
                     " in=" + std::to_string(c.in) + " out=" + std::to_string(c.out) +
                     (c.bias ? " +bias" : "") + (c.x_pad ? " ldx=" + std::to_string(ldx) : ""),
                 d_y, ref, tol);
}

// F32 (CUBLAS_COMPUTE_32F, no TF32) vs OpenBLAS sgemm: both fp32 with different summation
// orders; with in <= 2048 and U(-1,1) inputs the typical relative error is ~1e-6, so 2e-5
// relative and 5e-4 absolute (outputs ~15). A wrong layout or missing bias is off by O(1).
TEST_F(CudaOps, LinearF32) {
  const LinearCase cases[] = {
      {37, 264, 200, false, 0}, {37, 264, 200, true, 8}, {5, 2048, 96, true, 0}};
  for (const LinearCase& c : cases) {
    const auto x = uniform(size_t(c.n * (c.in + c.x_pad)), -1.f, 1.f);
    const auto w = uniform(size_t(c.out * c.in), -1.f, 1.f);
    const auto b = uniform(size_t(c.out), -1.f, 1.f);
    run_linear_case(DType::kF32, c, x, w, b, {2e-5, 5e-4});
    if (HasFatalFailure()) return;
  }
}

// BF16/F16 inputs with fp32 accumulation on tensor cores, vs fp32 on the same rounded inputs:
// products are exact in fp32, so only accumulation differs, but Hopper's MMA accumulation may
// truncate rather than round: for in = 1024 that bounds the drift near 1e-4 relative of outputs
// ~10. Hence 1e-4 relative and 2e-3 absolute.
TEST_F(CudaOps, LinearHalf) {
  const LinearCase cases[] = {{37, 1024, 72, true, 0}, {16, 256, 128, false, 8}};
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (const LinearCase& c : cases) {
      const auto x = uniform(size_t(c.n * (c.in + c.x_pad)), -1.f, 1.f);
      const auto w = uniform(size_t(c.out * c.in), -1.f, 1.f);
      const auto b = uniform(size_t(c.out), -1.f, 1.f);
      run_linear_case(t, c, x, w, b, {1e-4, 2e-3});
      if (HasFatalFailure()) return;
    }
  }
}

// ---- gemv: one row, F32 x against F32 or BF16 weights as stored ----------------------------------
// The CPU gemv on the same values (BF16 widened exactly on both sides): only the summation order
// differs, so LinearF32's bounds (2e-5 relative, 5e-4 absolute; outputs up to ~30 at in = 4096).
// in = 577 and a padded row stride take the scalar path; out = 1001 leaves a partial CTA.
TEST_F(CudaOps, Gemv) {
  struct Case {
    int64_t in, out, ldw;
    bool bias;
  };
  const Case cases[] = {{576, 1536, 576, false}, {4096, 1001, 4096, true}, {577, 300, 577, true},
                        {576, 64, 584, false}, {576, 64, 580, true}};
  for (const DType wdt : {DType::kF32, DType::kBF16})
    for (const Case& c : cases) {
      const auto x = uniform(size_t(c.in), -1.f, 1.f);
      const auto w32 = uniform(size_t(c.out * c.ldw), -1.f, 1.f);
      const auto b = uniform(size_t(c.out), -1.f, 1.f);
      std::vector<uint16_t> w16(w32.size());
      for (size_t i = 0; i < w32.size(); ++i) w16[i] = f32_to_bf16(w32[i]);
      TensorView no_bias;
      TensorView w_cpu = wdt == DType::kBF16
                             ? TensorView::make(w16.data(), DType::kBF16, {c.out, c.ldw})
                             : TensorView::make(const_cast<float*>(w32.data()), DType::kF32, {c.out, c.ldw});
      w_cpu.shape[1] = c.in;
      std::vector<float> ref(size_t(c.out));
      ASSERT_OK(gemv(TensorView::make(const_cast<float*>(x.data()), DType::kF32, {1, c.in}), w_cpu,
                     c.bias ? TensorView::make(const_cast<float*>(b.data()), DType::kF32, {c.out}) : no_bias,
                     TensorView::make(ref.data(), DType::kF32, {1, c.out}), kCpu));
      DevBuf d_x, d_w, d_b, d_y;
      ASSERT_OK(d_x.alloc_upload(x));
      if (wdt == DType::kBF16) {
        ASSERT_OK(d_w.alloc_upload(w16));
      } else {
        ASSERT_OK(d_w.alloc_upload(w32));
      }
      ASSERT_OK(d_b.alloc_upload(b));
      ASSERT_OK(d_y.alloc(ref.size() * 4));
      ASSERT_OK(d_y.poison());
      TensorView w_gpu = d_w.view(wdt, {c.out, c.ldw});
      w_gpu.shape[1] = c.in;
      ASSERT_OK(gemv(d_x.view(DType::kF32, {1, c.in}), w_gpu,
                     c.bias ? d_b.view(DType::kF32, {c.out}) : no_bias,
                     d_y.view(DType::kF32, {1, c.out}), kGpu));
      expect_matches(std::string("gemv ") + dtype_name(wdt) + " in=" + std::to_string(c.in) +
                         " out=" + std::to_string(c.out) + " ldw=" + std::to_string(c.ldw) +
                         (c.bias ? " +bias" : ""),
                     d_y, ref, {2e-5, 5e-4});
      if (HasFatalFailure()) return;
    }
}

// ---- the decode step's fused ops: gemv_parts, gemv_swiglu, add_rms_norm -------------------------
// Each equals, bit for bit, the device ops it joins on the same inputs (the decode session's
// fused step relies on it: FusedStepIsTheUnfusedStepBitForBit; gemv() is gemv_parts with one
// part, so for parts that check is the mapping of CTAs to parts, and for swiglu the epilogue and
// the paired pass), and the CPU reference within the joined ops' bounds: gemv's 2e-5 / 5e-4 per part; for silu(g) u, whose factors each carry gemv's
// error, 5e-5 normalized and 5e-2 absolute (|g|, |u| reach ~80 at in = 4096: gemv's measured
// worst 3.4e-5 on a factor moves the product by up to ~5e-3).
TEST_F(CudaOps, GemvPartsAndSwigluEqualTheOpsTheyJoin) {
  const TensorView none{};
  for (const DType wdt : {DType::kF32, DType::kBF16})
    // 16-byte rows (576: only the tail loop), the scalar path, and rows that fill the unrolled
    // groups of loads.
    for (const int64_t in : {int64_t(576), int64_t(577), int64_t(4096)}) {
      const std::string tag = std::string(dtype_name(wdt)) + " in=" + std::to_string(in);
      auto weights = [&](int64_t out, DevBuf* d, std::vector<float>* host32,
                         std::vector<uint16_t>* host16) -> Status {
        *host32 = uniform(size_t(out * in), -1.f, 1.f);
        host16->resize(host32->size());
        for (size_t i = 0; i < host32->size(); ++i) (*host16)[i] = f32_to_bf16((*host32)[i]);
        return wdt == DType::kBF16 ? d->alloc_upload(*host16) : d->alloc_upload(*host32);
      };
      auto cpu_w = [&](std::vector<float>& w32, std::vector<uint16_t>& w16, int64_t out) {
        return wdt == DType::kBF16 ? TensorView::make(w16.data(), DType::kBF16, {out, in})
                                   : TensorView::make(w32.data(), DType::kF32, {out, in});
      };
      const auto x = uniform(size_t(in), -1.f, 1.f);
      DevBuf d_x;
      ASSERT_OK(d_x.alloc_upload(x));
      const TensorView x_cpu = TensorView::make(const_cast<float*>(x.data()), DType::kF32, {1, in});
      const TensorView x_gpu = d_x.view(DType::kF32, {1, in});

      // Three parts as the step's Q, K, V: 576 rows with a bias, 192, 193 (a partial CTA) with one.
      const int64_t outs[3] = {576, 192, 193};
      const bool biased[3] = {true, false, true};
      std::vector<float> w32[3], b[3], ref[3];
      std::vector<uint16_t> w16[3];
      DevBuf d_w[3], d_b[3], d_y[3], d_one[3];
      GemvPart cpu_parts[3], gpu_parts[3];
      for (int i = 0; i < 3; ++i) {
        ASSERT_OK(weights(outs[i], &d_w[i], &w32[i], &w16[i]));
        b[i] = uniform(size_t(outs[i]), -1.f, 1.f);
        ASSERT_OK(d_b[i].alloc_upload(b[i]));
        ref[i].assign(size_t(outs[i]), 0.f);
        ASSERT_OK(d_y[i].alloc(size_t(outs[i]) * 4));
        ASSERT_OK(d_one[i].alloc(size_t(outs[i]) * 4));
        ASSERT_OK(d_y[i].poison());
        ASSERT_OK(d_one[i].poison());
        const TensorView bias_cpu =
            biased[i] ? TensorView::make(b[i].data(), DType::kF32, {outs[i]}) : none;
        cpu_parts[i] = {cpu_w(w32[i], w16[i], outs[i]), bias_cpu,
                        TensorView::make(ref[i].data(), DType::kF32, {1, outs[i]})};
        gpu_parts[i] = {d_w[i].view(wdt, {outs[i], in}),
                        biased[i] ? d_b[i].view(DType::kF32, {outs[i]}) : none,
                        d_y[i].view(DType::kF32, {1, outs[i]})};
        ASSERT_OK(gemv(x_gpu, gpu_parts[i].w, gpu_parts[i].bias,
                       d_one[i].view(DType::kF32, {1, outs[i]}), kGpu));
      }
      ASSERT_OK(gemv_parts(x_cpu, cpu_parts, 3, kCpu));
      ASSERT_OK(gemv_parts(x_gpu, gpu_parts, 3, kGpu));
      for (int i = 0; i < 3; ++i) {
        const std::string what = "gemv_parts " + tag + " part " + std::to_string(i);
        expect_matches(what + " vs cpu", d_y[i], ref[i], {2e-5, 5e-4});
        std::vector<float> one;
        ASSERT_OK(cuda::stream_synchronize(nullptr));
        ASSERT_OK(d_one[i].download(&one));
        expect_matches(what + " vs device gemv", d_y[i], one, kExact);
        if (HasFatalFailure()) return;
      }

      // Parts whose rows load differently alone (one 16-byte aligned, one shifted by an element):
      // each output is still its own gemv()'s.
      if (in % 8 == 0) {
        std::vector<float> s32(size_t(192 * in + 1));
        std::vector<uint16_t> s16(s32.size());
        for (size_t i = 0; i < s32.size(); ++i) {
          s32[i] = i ? w32[1][i - 1] : 0.f;
          s16[i] = i ? w16[1][i - 1] : 0;
        }
        DevBuf d_s, d_m0, d_m1, d_r1;
        if (wdt == DType::kBF16) {
          ASSERT_OK(d_s.alloc_upload(s16));
        } else {
          ASSERT_OK(d_s.alloc_upload(s32));
        }
        const TensorView shifted = TensorView::make(
            static_cast<char*>(d_s.data()) + dtype_size(wdt), wdt, {192, in}, Device::kCuda);
        ASSERT_OK(d_m0.alloc(size_t(576) * 4));
        ASSERT_OK(d_m1.alloc(size_t(192) * 4));
        ASSERT_OK(d_r1.alloc(size_t(192) * 4));
        ASSERT_OK(d_m0.poison());
        ASSERT_OK(d_m1.poison());
        const GemvPart mixed[2] = {gpu_parts[0], {shifted, none, d_m1.view(DType::kF32, {1, 192})}};
        const GemvPart mixed0 = {gpu_parts[0].w, gpu_parts[0].bias, d_m0.view(DType::kF32, {1, 576})};
        ASSERT_OK(gemv_parts(x_gpu, mixed, 2, kGpu));
        ASSERT_OK(gemv_parts(x_gpu, &mixed0, 1, kGpu));  // part 0's outputs once more
        ASSERT_OK(gemv(x_gpu, shifted, none, d_r1.view(DType::kF32, {1, 192}), kGpu));
        std::vector<float> r0, r1;
        ASSERT_OK(cuda::stream_synchronize(nullptr));
        ASSERT_OK(d_y[0].download(&r0));
        ASSERT_OK(d_r1.download(&r1));
        expect_matches("gemv_parts " + tag + " mixed alignment, aligned part", d_m0, r0, kExact);
        expect_matches("gemv_parts " + tag + " mixed alignment, shifted part vs gemv", d_m1, r1,
                       kExact);
        expect_matches("gemv_parts " + tag + " mixed alignment, shifted part vs cpu", d_m1, ref[1],
                       {2e-5, 5e-4});
        if (HasFatalFailure()) return;
      }

      // The MLP pair: 1536 rows (SmolLM2's intermediate) and 1001 (a partial CTA).
      for (const int64_t out : {int64_t(1536), int64_t(1001)}) {
        const std::string what = "gemv_swiglu " + tag + " out=" + std::to_string(out);
        std::vector<float> g32, u32;
        std::vector<uint16_t> g16, u16;
        DevBuf d_g, d_u, d_gy, d_uy, d_ref, d_y2;
        ASSERT_OK(weights(out, &d_g, &g32, &g16));
        ASSERT_OK(weights(out, &d_u, &u32, &u16));
        std::vector<float> ref2(static_cast<size_t>(out));
        ASSERT_OK(gemv_swiglu(x_cpu, cpu_w(g32, g16, out), cpu_w(u32, u16, out),
                              TensorView::make(ref2.data(), DType::kF32, {1, out}), kCpu));
        for (DevBuf* d : {&d_gy, &d_uy, &d_ref, &d_y2}) {
          ASSERT_OK(d->alloc(size_t(out) * 4));
          ASSERT_OK(d->poison());
        }
        const TensorView wg = d_g.view(wdt, {out, in}), wu = d_u.view(wdt, {out, in});
        ASSERT_OK(gemv(x_gpu, wg, none, d_gy.view(DType::kF32, {1, out}), kGpu));
        ASSERT_OK(gemv(x_gpu, wu, none, d_uy.view(DType::kF32, {1, out}), kGpu));
        ASSERT_OK(swiglu(d_gy.view(DType::kF32, {1, out}), d_uy.view(DType::kF32, {1, out}),
                         d_ref.view(DType::kF32, {1, out}), kGpu));
        ASSERT_OK(gemv_swiglu(x_gpu, wg, wu, d_y2.view(DType::kF32, {1, out}), kGpu));
        expect_matches(what + " vs cpu", d_y2, ref2, {5e-5, 5e-2});
        std::vector<float> joined;
        ASSERT_OK(cuda::stream_synchronize(nullptr));
        ASSERT_OK(d_ref.download(&joined));
        expect_matches(what + " vs device gemv, gemv, swiglu", d_y2, joined, kExact);
        if (HasFatalFailure()) return;
      }
    }
}

// Several rows of x (a verification pass's): row r of each output equals, bit for bit, the
// one-row device op on x's row r (a warp reads a weight row once for up to four rows, each
// summed in the one-row order), and the CPU's rows within gemv's bounds. 2, 5 and 65 rows (a
// partial group of four, and the pass's size at verify64), on the 16-byte path, the scalar path
// and the unrolled groups; three parts with a partial CTA; the MLP pair.
TEST_F(CudaOps, GemvRowsAreOneRowGemvs) {
  const TensorView none{};
  for (const DType wdt : {DType::kF32, DType::kBF16})
    for (const int64_t in : {int64_t(576), int64_t(577), int64_t(4096)})
      for (const int64_t n : {int64_t(2), int64_t(5), int64_t(65)}) {
        const std::string tag = std::string(dtype_name(wdt)) + " in=" + std::to_string(in) +
                                " n=" + std::to_string(n);
        const int64_t outs[3] = {576, 192, 193};
        const auto x = uniform(size_t(n * in), -1.f, 1.f);
        DevBuf d_x;
        ASSERT_OK(d_x.alloc_upload(x));
        std::vector<float> w32[3], b[3];
        std::vector<uint16_t> w16[3];
        DevBuf d_w[3], d_b[3], d_y[3], d_one[3];
        GemvPart parts[3], cpu_parts[3];
        std::vector<float> cpu_y[3];
        for (int i = 0; i < 3; ++i) {
          w32[i] = uniform(size_t(outs[i] * in), -1.f, 1.f);
          w16[i].resize(w32[i].size());
          for (size_t j = 0; j < w32[i].size(); ++j) w16[i][j] = f32_to_bf16(w32[i][j]);
          if (wdt == DType::kBF16) {
            ASSERT_OK(d_w[i].alloc_upload(w16[i]));
          } else {
            ASSERT_OK(d_w[i].alloc_upload(w32[i]));
          }
          b[i] = uniform(size_t(outs[i]), -1.f, 1.f);
          ASSERT_OK(d_b[i].alloc_upload(b[i]));
          ASSERT_OK(d_y[i].alloc(size_t(n * outs[i]) * 4));
          ASSERT_OK(d_y[i].poison());
          ASSERT_OK(d_one[i].alloc(size_t(n * outs[i]) * 4));
          ASSERT_OK(d_one[i].poison());
          const TensorView bias = i == 1 ? none : d_b[i].view(DType::kF32, {outs[i]});
          parts[i] = {d_w[i].view(wdt, {outs[i], in}), bias, d_y[i].view(DType::kF32, {n, outs[i]})};
          cpu_y[i].assign(size_t(n * outs[i]), 0.f);
          cpu_parts[i] = {wdt == DType::kBF16
                              ? TensorView::make(w16[i].data(), DType::kBF16, {outs[i], in})
                              : TensorView::make(w32[i].data(), DType::kF32, {outs[i], in}),
                          i == 1 ? none : TensorView::make(b[i].data(), DType::kF32, {outs[i]}),
                          TensorView::make(cpu_y[i].data(), DType::kF32, {n, outs[i]})};
        }
        ASSERT_OK(gemv_parts(d_x.view(DType::kF32, {n, in}), parts, 3, kGpu));
        ASSERT_OK(gemv_parts(TensorView::make(const_cast<float*>(x.data()), DType::kF32, {n, in}),
                             cpu_parts, 3, kCpu));
        // The same rows one at a time, into the matching rows of d_one.
        for (int64_t r = 0; r < n; ++r) {
          GemvPart one[3];
          for (int i = 0; i < 3; ++i)
            one[i] = {parts[i].w, parts[i].bias,
                      TensorView::make(static_cast<float*>(d_one[i].data()) + r * outs[i],
                                       DType::kF32, {1, outs[i]}, Device::kCuda)};
          ASSERT_OK(gemv_parts(TensorView::make(static_cast<float*>(d_x.data()) + r * in,
                                                DType::kF32, {1, in}, Device::kCuda),
                               one, 3, kGpu));
        }
        for (int i = 0; i < 3; ++i) {
          std::vector<float> rows;
          ASSERT_OK(cuda::stream_synchronize(nullptr));
          ASSERT_OK(d_one[i].download(&rows));
          const std::string what = "gemv_parts " + tag + " part " + std::to_string(i);
          expect_matches(what + " vs one row at a time", d_y[i], rows, kExact);
          expect_matches(what + " vs cpu", d_y[i], cpu_y[i], {2e-5, 5e-4});
          if (HasFatalFailure()) return;
        }
        // The MLP pair over the same rows (1001 outputs: a partial CTA).
        const int64_t out = 1001;
        auto g32 = uniform(size_t(out * in), -1.f, 1.f), u32 = uniform(size_t(out * in), -1.f, 1.f);
        std::vector<uint16_t> g16(g32.size()), u16(u32.size());
        for (size_t j = 0; j < g32.size(); ++j) g16[j] = f32_to_bf16(g32[j]), u16[j] = f32_to_bf16(u32[j]);
        DevBuf d_g, d_u, d_s, d_s1;
        if (wdt == DType::kBF16) {
          ASSERT_OK(d_g.alloc_upload(g16));
          ASSERT_OK(d_u.alloc_upload(u16));
        } else {
          ASSERT_OK(d_g.alloc_upload(g32));
          ASSERT_OK(d_u.alloc_upload(u32));
        }
        ASSERT_OK(d_s.alloc(size_t(n * out) * 4));
        ASSERT_OK(d_s.poison());
        ASSERT_OK(d_s1.alloc(size_t(n * out) * 4));
        ASSERT_OK(d_s1.poison());
        const TensorView wg = d_g.view(wdt, {out, in}), wu = d_u.view(wdt, {out, in});
        ASSERT_OK(gemv_swiglu(d_x.view(DType::kF32, {n, in}), wg, wu, d_s.view(DType::kF32, {n, out}),
                              kGpu));
        for (int64_t r = 0; r < n; ++r)
          ASSERT_OK(gemv_swiglu(TensorView::make(static_cast<float*>(d_x.data()) + r * in,
                                                 DType::kF32, {1, in}, Device::kCuda),
                                wg, wu,
                                TensorView::make(static_cast<float*>(d_s1.data()) + r * out,
                                                 DType::kF32, {1, out}, Device::kCuda),
                                kGpu));
        std::vector<float> rows;
        ASSERT_OK(cuda::stream_synchronize(nullptr));
        ASSERT_OK(d_s1.download(&rows));
        expect_matches("gemv_swiglu " + tag + " vs one row at a time", d_s, rows, kExact);
        if (HasFatalFailure()) return;
      }
}

TEST_F(CudaOps, GemvPartsAndSwigluRefusals) {
  DevBuf d_x, d_w, d_w16, d_y;
  ASSERT_OK(d_x.alloc(64 * 4));
  ASSERT_OK(d_w.alloc(64 * 64 * 4));
  ASSERT_OK(d_w16.alloc(64 * 64 * 2));
  ASSERT_OK(d_y.alloc(64 * 4));
  const TensorView none{}, x = d_x.view(DType::kF32, {1, 64}), y = d_y.view(DType::kF32, {1, 64});
  const TensorView w = d_w.view(DType::kF32, {64, 64}), w16 = d_w16.view(DType::kBF16, {64, 64});
  const GemvPart p{w, none, y};
  const GemvPart four[4] = {p, p, p, p};
  EXPECT_EQ(gemv_parts(x, four, 0, kGpu).code(), Code::kInvalidArgument);
  EXPECT_EQ(gemv_parts(x, four, 4, kGpu).code(), Code::kInvalidArgument);  // over kGemvMaxParts
  const GemvPart mixed[2] = {p, {w16, none, y}};
  EXPECT_EQ(gemv_parts(x, mixed, 2, kGpu).code(), Code::kInvalidArgument);
  const GemvPart short_y[1] = {{w, none, d_y.view(DType::kF32, {1, 32})}};
  EXPECT_EQ(gemv_parts(x, short_y, 1, kGpu).code(), Code::kInvalidArgument);
  EXPECT_EQ(gemv_swiglu(x, w, w16, y, kGpu).code(), Code::kInvalidArgument);
  EXPECT_EQ(gemv_swiglu(x, w, d_w.view(DType::kF32, {32, 64}), y, kGpu).code(),
            Code::kInvalidArgument);
}

// add_rms_norm: the device add_inplace then rms_norm bit for bit (x and out), the CPU within
// rms_norm's bounds, and without delta rms_norm alone.
TEST_F(CudaOps, AddRmsNormIsAddThenNorm) {
  const int64_t rows = 3, hidden = 1000;
  const auto x = uniform(size_t(rows * hidden), -2.f, 2.f);
  const auto dl = uniform(size_t(rows * hidden), -2.f, 2.f);
  const auto w = uniform(size_t(hidden), 0.5f, 1.5f);
  std::vector<float> cx = x, cref(x.size());
  ASSERT_OK(add_rms_norm(TensorView::make(cx.data(), DType::kF32, {rows, hidden}),
                         TensorView::make(const_cast<float*>(dl.data()), DType::kF32, {rows, hidden}),
                         TensorView::make(const_cast<float*>(w.data()), DType::kF32, {hidden}), 1e-5f,
                         TensorView::make(cref.data(), DType::kF32, {rows, hidden}), kCpu));
  DevBuf d_x1, d_x2, d_d, d_w, d_o1, d_o2;
  ASSERT_OK(d_x1.alloc_upload(x));
  ASSERT_OK(d_x2.alloc_upload(x));
  ASSERT_OK(d_d.alloc_upload(dl));
  ASSERT_OK(d_w.alloc_upload(w));
  ASSERT_OK(d_o1.alloc(x.size() * 4));
  ASSERT_OK(d_o2.alloc(x.size() * 4));
  ASSERT_OK(d_o1.poison());
  ASSERT_OK(d_o2.poison());
  const TensorView wv = d_w.view(DType::kF32, {hidden});
  ASSERT_OK(add_inplace(d_x1.view(DType::kF32, {rows, hidden}), d_d.view(DType::kF32, {rows, hidden}), kGpu));
  ASSERT_OK(rms_norm(d_x1.view(DType::kF32, {rows, hidden}), wv, 1e-5f, d_o1.view(DType::kF32, {rows, hidden}),
                     kGpu));
  ASSERT_OK(add_rms_norm(d_x2.view(DType::kF32, {rows, hidden}), d_d.view(DType::kF32, {rows, hidden}), wv,
                         1e-5f, d_o2.view(DType::kF32, {rows, hidden}), kGpu));
  std::vector<float> x1, o1;
  ASSERT_OK(cuda::stream_synchronize(nullptr));
  ASSERT_OK(d_x1.download(&x1));
  ASSERT_OK(d_o1.download(&o1));
  expect_matches("add_rms_norm x vs add_inplace", d_x2, x1, kExact);
  expect_matches("add_rms_norm out vs add_inplace, rms_norm", d_o2, o1, kExact);
  expect_matches("add_rms_norm x vs cpu", d_x2, cx, kExact);  // one float add each
  expect_matches("add_rms_norm out vs cpu", d_o2, cref, {1e-6, 1e-5});
  // Without delta: rms_norm of x alone, x untouched.
  ASSERT_OK(d_o2.poison());
  ASSERT_OK(rms_norm(d_x1.view(DType::kF32, {rows, hidden}), wv, 1e-5f, d_o1.view(DType::kF32, {rows, hidden}),
                     kGpu));
  ASSERT_OK(add_rms_norm(d_x1.view(DType::kF32, {rows, hidden}), TensorView{}, wv, 1e-5f,
                         d_o2.view(DType::kF32, {rows, hidden}), kGpu));
  ASSERT_OK(cuda::stream_synchronize(nullptr));
  ASSERT_OK(d_o1.download(&o1));
  expect_matches("add_rms_norm without delta vs rms_norm", d_o2, o1, kExact);
  expect_matches("add_rms_norm without delta leaves x", d_x1, x1, kExact);
}

// ---- attention_dense ----------------------------------------------------------------------------
// fp32 online softmax vs the CPU's two-pass fp32 softmax (double denominator): differences are
// exp/rounding order, ~1e-6 relative; 1e-5 relative and 1e-4 absolute on out (|out| <= 1) and on
// lse (|lse| < 10). A mask off by one key or a wrong GQA head mapping moves out by >1e-2.
struct AttnCase {
  const char* name;
  int64_t n_q, n_k, heads, kv_heads, head_dim;
  bool causal;
  int64_t q_offset;
};

TEST_F(CudaOps, AttentionDense) {
  const Tolerance tol{1e-5, 1e-4};
  const AttnCase cases[] = {
      {"causal gqa4 d128", 77, 77, 8, 2, 128, true, 0},
      {"chunk gqa4 d128 (n_q<n_k)", 45, 173, 8, 2, 128, true, 128},
      {"causal mha d64", 100, 100, 4, 4, 64, true, 0},
      {"non-causal gqa2 d64", 33, 90, 4, 2, 64, false, 0},
      {"chunk gqa4 d64", 50, 300, 8, 2, 64, true, 250},
      {"row 0 sees no key d64 (q_offset=-1)", 20, 20, 2, 1, 64, true, -1},
  };
  for (const AttnCase& c : cases) {
    const int64_t d = c.head_dim;
    // q in [-3, 3] and k in [-1, 1]: scaled scores have unit variance, a non-flat softmax.
    const auto q = uniform(size_t(c.n_q * c.heads * d), -3.f, 3.f);
    const auto k = uniform(size_t(c.n_k * c.kv_heads * d), -1.f, 1.f);
    const auto v = uniform(size_t(c.n_k * c.kv_heads * d), -1.f, 1.f);
    AttentionParams p;
    p.causal = c.causal;
    p.q_offset = c.q_offset;
    std::vector<float> ref(q.size()), ref_lse(size_t(c.heads * c.n_q));
    ASSERT_OK(attention_dense(
        TensorView::make(const_cast<float*>(q.data()), DType::kF32, {c.n_q, c.heads, d}),
        TensorView::make(const_cast<float*>(k.data()), DType::kF32, {c.n_k, c.kv_heads, d}),
        TensorView::make(const_cast<float*>(v.data()), DType::kF32, {c.n_k, c.kv_heads, d}),
        TensorView::make(ref.data(), DType::kF32, {c.n_q, c.heads, d}),
        TensorView::make(ref_lse.data(), DType::kF32, {c.heads, c.n_q}), p, kCpu));
    DevAttention dev;
    ASSERT_OK(dev.upload(q, k, v, ref.size() * 4, ref_lse.size() * 4));
    auto& [d_q, d_k, d_v, d_out, d_lse] = dev;
    ASSERT_OK(attention_dense(
        d_q.view(DType::kF32, {c.n_q, c.heads, d}), d_k.view(DType::kF32, {c.n_k, c.kv_heads, d}),
        d_v.view(DType::kF32, {c.n_k, c.kv_heads, d}), d_out.view(DType::kF32, {c.n_q, c.heads, d}),
        d_lse.view(DType::kF32, {c.heads, c.n_q}), p, kGpu));
    expect_matches(std::string("attention out, ") + c.name, d_out, ref, tol);
    expect_matches(std::string("attention lse, ") + c.name, d_lse, ref_lse, tol);
  }
}

TEST_F(CudaOps, AttentionRejectsUnsupportedHeadDim) {
  EXPECT_TRUE(cuda::attention_dense_supported(64));
  EXPECT_TRUE(cuda::attention_dense_supported(128));
  EXPECT_FALSE(cuda::attention_dense_supported(96));
  const int64_t n = 4, heads = 2, d = 96;
  DevBuf d_q, d_out, d_lse;
  ASSERT_OK(d_q.alloc(size_t(n * heads * d) * 4));
  ASSERT_OK(d_out.alloc(size_t(n * heads * d) * 4));
  ASSERT_OK(d_lse.alloc(size_t(n * heads) * 4));
  const TensorView qv = d_q.view(DType::kF32, {n, heads, d});
  const Status st = attention_dense(qv, qv, qv, d_out.view(DType::kF32, {n, heads, d}),
                                    d_lse.view(DType::kF32, {heads, n}), AttentionParams{}, kGpu);
  EXPECT_EQ(st.code(), Code::kUnsupported) << st.to_string();
}

// ---- attention_sparse over the unified index ----------------------------------------------------
// Against the CPU sparse kernel (kernels/sparse.h on host tensors) on fresh random inputs and
// random indices built by sparse_index_build from random candidates (columns, slash diagonals,
// key blocks, sink, local window), so entries are unaligned, runs of adjacent entries occur,
// short causal tail entries and gathered column tails occur. Both sides are fp32 online softmax
// over the same keys in different tile orders: ~1e-6 relative; the bounds are the dense
// kernel's (1e-5 relative, 1e-4 absolute). A key dropped, added or masked off by one row moves
// out by > 1e-2. With the full index, the sparse kernel must equal the dense CUDA kernel.
struct SparseCase {
  const char* name;
  int64_t n_q, n_k, heads, kv_heads, head_dim;
  int64_t q_offset;
};

// Random candidates per slot; with per_head, one candidate set per head for all its query
// blocks (as vertical-slash and block-sparse indices look: neighbouring query blocks share most
// block entries and columns). max_cols bounds the candidate columns a slot draws: a few hundred
// give several gathered-column tiles in a row (as adaptive-vs does), so the kernels' column
// copies reuse their stages.
SparseIndex random_index(std::mt19937_64& rng, int64_t heads, int64_t n_q, int64_t n_k,
                         int64_t q_offset, bool per_head = false, int max_cols = 48) {
  // max_cols 0: no gathered columns, and no column capacity (as block-sparse estimators build).
  SparseIndex idx = sparse_index_make(int(heads), n_q, n_k, q_offset, 2, max_cols > 0 ? 8 : 0);
  std::uniform_int_distribution<int> pick(0, 1 << 30);
  const auto draw = [&](int64_t kend) {
    IndexCandidates c;
    const int n_cols = max_cols > 0 ? pick(rng) % max_cols : 0;
    const int n_diag = pick(rng) % 5, n_blk = pick(rng) % 4;
    for (int i = 0; i < n_cols; ++i) c.columns.push_back(int32_t(pick(rng) % kend));
    for (int i = 0; i < n_diag; ++i) c.diagonals.push_back(int32_t(pick(rng) % kend));
    for (int i = 0; i < n_blk; ++i) c.key_blocks.push_back(int32_t(pick(rng) % (kend / 64 + 1)));
    return c;
  };
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t sink = std::array<int64_t, 3>{0, 3, 64}[size_t(pick(rng) % 3)];
    const int64_t local = std::array<int64_t, 3>{0, 40, 64}[size_t(pick(rng) % 3)];
    // Candidates past a slot's causal limit are ignored by the builder.
    const IndexCandidates head_c = draw(std::max<int64_t>(1, std::min(n_k, q_offset + n_q)));
    for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) {
      const SparseSlotGeometry g = sparse_slot_geometry(n_q, n_k, q_offset, qb);
      sparse_index_build(&idx, int(h), qb, per_head ? head_c : draw(g.kend), sink, local);
    }
  }
  return idx;
}

TEST_F(CudaOps, AttentionSparse) {
  const Tolerance tol{1e-5, 1e-4};
  const SparseCase cases[] = {
      {"gqa4 d128", 300, 300, 8, 2, 128, 0},
      {"gqa4 d128 chunk (n_q<n_k)", 77, 333, 8, 2, 128, 256},
      {"mha d64 short", 45, 45, 4, 4, 64, 0},
      {"gqa8 d64 long", 1500, 1500, 8, 1, 64, 0},
      {"gqa4 d128 chunk, n_k past last row", 130, 600, 4, 1, 128, 400},
      // 528 slots, more than the 132 SMs hold at once: CTAs start as others retire.
      {"gqa4 d128 4200 (528 slots)", 4200, 4200, 8, 2, 128, 0},
  };
  for (const SparseCase& c : cases) {
    for (int full = 0; full < 2; ++full) {
      const int64_t d = c.head_dim;
      const auto q = uniform(size_t(c.n_q * c.heads * d), -3.f, 3.f);
      const auto k = uniform(size_t(c.n_k * c.kv_heads * d), -1.f, 1.f);
      const auto v = uniform(size_t(c.n_k * c.kv_heads * d), -1.f, 1.f);
      const SparseIndex idx = full ? sparse_index_dense(int(c.heads), c.n_q, c.n_k, c.q_offset)
                                   : random_index(rng_, c.heads, c.n_q, c.n_k, c.q_offset);
      ASSERT_OK(sparse_index_validate(idx, 0));
      const std::string name = std::string(c.name) + (full ? ", full index" : ", random index");
      std::cout << "  " << name << ": density " << idx.density() << "\n";
      AttentionParams p;
      p.q_offset = c.q_offset;
      std::vector<float> ref(q.size()), ref_lse(size_t(c.heads * c.n_q));
      const auto hq = TensorView::make(const_cast<float*>(q.data()), DType::kF32, {c.n_q, c.heads, d});
      const auto hk =
          TensorView::make(const_cast<float*>(k.data()), DType::kF32, {c.n_k, c.kv_heads, d});
      const auto hv =
          TensorView::make(const_cast<float*>(v.data()), DType::kF32, {c.n_k, c.kv_heads, d});
      ASSERT_OK(attention_sparse(hq, hk, hv, idx,
                                 TensorView::make(ref.data(), DType::kF32, {c.n_q, c.heads, d}),
                                 TensorView::make(ref_lse.data(), DType::kF32, {c.heads, c.n_q}),
                                 p, kCpu));
      DevAttention dev;
      ASSERT_OK(dev.upload(q, k, v, ref.size() * 4, ref_lse.size() * 4));
      auto& [d_q, d_k, d_v, d_out, d_lse] = dev;
      const TensorView qv = d_q.view(DType::kF32, {c.n_q, c.heads, d});
      const TensorView kv = d_k.view(DType::kF32, {c.n_k, c.kv_heads, d});
      const TensorView vv = d_v.view(DType::kF32, {c.n_k, c.kv_heads, d});
      const TensorView ov = d_out.view(DType::kF32, {c.n_q, c.heads, d});
      const TensorView lv = d_lse.view(DType::kF32, {c.heads, c.n_q});
      ASSERT_OK(d_out.poison());
      ASSERT_OK(d_lse.poison());
      ASSERT_OK(attention_sparse(qv, kv, vv, idx, ov, lv, p, kGpu));
      expect_matches("sparse out vs cpu sparse, " + name, d_out, ref, tol);
      expect_matches("sparse lse vs cpu sparse, " + name, d_lse, ref_lse, tol);
      if (HasFailure()) return;
      if (full) {  // the full index against the dense CUDA kernel on the same device inputs
        std::vector<float> sp_out, sp_lse;
        ASSERT_OK(cuda::stream_synchronize(nullptr));
        ASSERT_OK(d_out.download(&sp_out));
        ASSERT_OK(d_lse.download(&sp_lse));
        ASSERT_OK(d_out.poison());
        ASSERT_OK(d_lse.poison());
        ASSERT_OK(attention_dense(qv, kv, vv, ov, lv, p, kGpu));
        std::vector<float> dn_out, dn_lse;
        ASSERT_OK(cuda::stream_synchronize(nullptr));
        ASSERT_OK(d_out.download(&dn_out));
        ASSERT_OK(d_lse.download(&dn_lse));
        const ErrStats eo = compare(sp_out, dn_out), el = compare(sp_lse, dn_lse);
        std::cout << "  sparse(full) vs cuda dense, " << c.name << ": out nerr=" << eo.nerr
                  << " max_abs=" << eo.max_abs << ", lse nerr=" << el.nerr
                  << " max_abs=" << el.max_abs << "\n";
        EXPECT_EQ(eo.bad_nonfinite + el.bad_nonfinite, 0) << name;
        EXPECT_LE(eo.nerr, tol.nerr) << name;
        EXPECT_LE(eo.max_abs, tol.max_abs) << name;
        EXPECT_LE(el.nerr, tol.nerr) << name;
        EXPECT_LE(el.max_abs, tol.max_abs) << name;
      }
    }
  }
}

// bf16 tensor-core kernel: q, k, v rounded to bf16 on the host, so the CPU sparse kernel sees
// exactly the values the GPU sees; the GPU then rounds P to bf16 before P V (2^-9 relative per
// probability) and the output to bf16 (2^-9 relative per element): ~3e-3 relative in all,
// bounded at 1e-2 relative and 1e-2 absolute (|out| <= 1). lse is computed from fp32 scores and
// unrounded probabilities: 2e-5 relative, 5e-4 absolute. A wrong mask or fragment layout moves
// out by > 5e-2. One test per index kind (full; random per slot; random per head; random per slot
// with up to 400 columns; random per slot without columns), so a kind can run alone (a
// sanitizer's slow run, or a failure's replay).
class CudaOpsSparseBf16 : public CudaOps, public ::testing::WithParamInterface<int> {};
constexpr std::array<const char*, 5> kSparseIndexKinds{"full", "random", "per_head",
                                                         "column_heavy", "block_only"};

TEST_P(CudaOpsSparseBf16, AttentionSparseBf16) {
  const int kind = GetParam();
  const Tolerance tol{1e-2, 1e-2}, tol_lse{2e-5, 5e-4};
  const SparseCase cases[] = {
      {"gqa4 d128", 300, 300, 8, 2, 128, 0},
      {"gqa4 d128 chunk (n_q<n_k)", 77, 333, 8, 2, 128, 256},
      {"gqa8 d64 long", 1500, 1500, 8, 1, 64, 0},
      {"gqa4 d64 chunk, n_k past last row", 130, 600, 8, 2, 64, 400},
      {"gqa4 d128 long", 1100, 1100, 8, 2, 128, 0},
      {"gqa4 d128 chunk, n_k past last row", 130, 600, 4, 1, 128, 400},
      // 528 slots, more than the 132 SMs hold at once: CTAs start as others retire.
      {"gqa4 d128 4200 (528 slots)", 4200, 4200, 8, 2, 128, 0},
  };
  // Every mainloop (wgmma, mma.sync, wgmma-ws, the default, which pairs the heads of the full
  // index (SparseIndexDevice::pair_heads), and wgmma-ws-pair and -single, which force pairing or
  // not; at head_dim 64 the ws names run the wgmma kernel) on the same cases; the default comes
  // back on every exit. Forced pairing on the random indices gives the two heads of a CTA
  // different block lists, with and without columns (tiles one head holds and the other
  // computes masked); the full index gives identical ones.
  struct Restore {
    ~Restore() { cuda::set_sparse_bf16_mainloop(cuda::SparseBf16Mainloop::kWgmmaWs); }
  } restore;
  // The default first: a run cut short (compute-sanitizer's racecheck is ~100x slower) covers it.
  for (const auto ml : {cuda::SparseBf16Mainloop::kWgmmaWs, cuda::SparseBf16Mainloop::kWgmmaWsPair,
                        cuda::SparseBf16Mainloop::kWgmmaWsSingle, cuda::SparseBf16Mainloop::kWgmma,
                        cuda::SparseBf16Mainloop::kMmaSync}) {
    cuda::set_sparse_bf16_mainloop(ml);
    for (const SparseCase& c : cases) {
      const bool full = kind == 0;
      const int64_t d = c.head_dim;
      auto [qb, kb, vb, q, k, v] = bf16_qkv(c.n_q, c.heads, c.n_k, c.kv_heads, d);
      const SparseIndex idx = full
                                  ? sparse_index_dense(int(c.heads), c.n_q, c.n_k, c.q_offset)
                                  : random_index(rng_, c.heads, c.n_q, c.n_k, c.q_offset,
                                                 kind == 2, std::array{48, 48, 400, 0}[kind - 1]);
      const std::string name = std::string("bf16 ") + cuda::sparse_bf16_mainloop_name(ml) + " " +
                               c.name + ", " + kSparseIndexKinds[size_t(kind)] + " index";
      AttentionParams p;
      p.q_offset = c.q_offset;
      std::vector<float> ref(q.size()), ref_lse(size_t(c.heads * c.n_q));
      ASSERT_OK(attention_sparse(
          TensorView::make(q.data(), DType::kF32, {c.n_q, c.heads, d}),
          TensorView::make(k.data(), DType::kF32, {c.n_k, c.kv_heads, d}),
          TensorView::make(v.data(), DType::kF32, {c.n_k, c.kv_heads, d}), idx,
          TensorView::make(ref.data(), DType::kF32, {c.n_q, c.heads, d}),
          TensorView::make(ref_lse.data(), DType::kF32, {c.heads, c.n_q}), p, kCpu));
      DevAttention dev;
      ASSERT_OK(dev.upload(qb, kb, vb, ref.size() * 2, ref_lse.size() * 4));
      auto& [d_q, d_k, d_v, d_out, d_lse] = dev;
      ASSERT_OK(attention_sparse(d_q.view(DType::kBF16, {c.n_q, c.heads, d}),
                                 d_k.view(DType::kBF16, {c.n_k, c.kv_heads, d}),
                                 d_v.view(DType::kBF16, {c.n_k, c.kv_heads, d}), idx,
                                 d_out.view(DType::kBF16, {c.n_q, c.heads, d}),
                                 d_lse.view(DType::kF32, {c.heads, c.n_q}), p, kGpu));
      expect_matches_bf16(name, d_out, ref, tol);
      expect_matches(name + " lse", d_lse, ref_lse, tol_lse);
      if (HasFailure()) return;
    }
  }
}
INSTANTIATE_TEST_SUITE_P(IndexKinds, CudaOpsSparseBf16,
                         ::testing::Range(0, int(kSparseIndexKinds.size())),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(kSparseIndexKinds[size_t(i.param)]);
                         });

// ---- kv_importance ------------------------------------------------------------------------------
// Against the CPU kernel on the same q, k and lse (the CPU dense attention's, so p <= 1; one
// window row per case gets lse = -inf and must add nothing). Both are fp32 sums of the same terms
// in different orders with different exp implementations: ~1e-6 relative; bounds 1e-5 relative,
// 1e-4 absolute (sums reach window x group). A row or key counted twice, or a causal slip, moves
// a sum by a whole probability (> 1e-3). Cases: GQA 4 and 8, head_dim 64 and 128, a chunk
// (q_offset > 0), a window longer than the prompt, pool 1, 7 and the largest CUDA takes (65),
// fewer keys than the pool. Head_dim 64 runs first: a larger head_dim then needs more shared
// memory than the first call's opt-in (which once stayed at the first call's size, so the d 128
// launches failed when a d 64 one came first in a process).
TEST_F(CudaOps, KvImportance) {
  const Tolerance tol{1e-5, 1e-4};
  struct Case {
    const char* name;
    int64_t n_q, n_k, heads, kv_heads, head_dim, q_offset;
    int window, pool;
  };
  const Case cases[] = {
      {"gqa8 d64 long", 1500, 1500, 8, 1, 64, 0, 32, 7},
      {"window past the prompt", 20, 20, 4, 1, 64, 0, 64, 5},
      {"fewer keys than the pool", 40, 40, 4, 1, 64, 0, 16, 65},
      {"gqa4 d128", 300, 300, 8, 2, 128, 0, 64, 7},
      {"gqa4 d128 chunk", 77, 333, 8, 2, 128, 256, 32, 1},
      {"pool 65", 200, 200, 4, 2, 128, 0, 16, 65},
  };
  for (const Case& c : cases) {
    const int64_t d = c.head_dim;
    const auto q = uniform(size_t(c.n_q * c.heads * d), -3.f, 3.f);
    const auto k = uniform(size_t(c.n_k * c.kv_heads * d), -1.f, 1.f);
    const auto v = uniform(size_t(c.n_k * c.kv_heads * d), -1.f, 1.f);
    std::vector<float> att(q.size()), lse(size_t(c.heads * c.n_q));
    AttentionParams ap;
    ap.q_offset = c.q_offset;
    const auto hq =
        TensorView::make(const_cast<float*>(q.data()), DType::kF32, {c.n_q, c.heads, d});
    const auto hk =
        TensorView::make(const_cast<float*>(k.data()), DType::kF32, {c.n_k, c.kv_heads, d});
    ASSERT_OK(attention_dense(
        hq, hk, TensorView::make(const_cast<float*>(v.data()), DType::kF32, {c.n_k, c.kv_heads, d}),
        TensorView::make(att.data(), DType::kF32, {c.n_q, c.heads, d}),
        TensorView::make(lse.data(), DType::kF32, {c.heads, c.n_q}), ap, kCpu));
    lse[size_t(c.n_q - 1)] = -INFINITY;  // head 0, last row: saw nothing
    ImportanceParams ip;
    ip.window = c.window;
    ip.pool = c.pool;
    ip.q_offset = c.q_offset;
    // F32 keys, then BF16 keys (a CP rank's exchanged keys) against the CPU kernel on the same
    // keys rounded to BF16.
    std::vector<uint16_t> kb(k.size());
    std::vector<float> kr(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      kb[i] = f32_to_bf16(k[i]);
      kr[i] = bf16_to_f32(kb[i]);
    }
    DevBuf d_q, d_k, d_kb, d_lse, d_out;
    ASSERT_OK(d_q.alloc_upload(q));
    ASSERT_OK(d_k.alloc_upload(k));
    ASSERT_OK(d_kb.alloc_upload(kb));
    ASSERT_OK(d_lse.alloc_upload(lse));
    ASSERT_OK(d_out.alloc(size_t(c.kv_heads * c.n_k) * 4));
    for (const DType kt : {DType::kF32, DType::kBF16}) {
      const bool bf = kt == DType::kBF16;
      std::vector<float> ref(size_t(c.kv_heads * c.n_k));
      ASSERT_OK(kv_importance(hq,
                              TensorView::make(bf ? kr.data() : const_cast<float*>(k.data()),
                                               DType::kF32, {c.n_k, c.kv_heads, d}),
                              TensorView::make(lse.data(), DType::kF32, {c.heads, c.n_q}), ip,
                              TensorView::make(ref.data(), DType::kF32, {c.kv_heads, c.n_k})));
      ASSERT_OK(d_out.poison());
      ASSERT_OK(kv_importance(d_q.view(DType::kF32, {c.n_q, c.heads, d}),
                              (bf ? d_kb : d_k).view(kt, {c.n_k, c.kv_heads, d}),
                              d_lse.view(DType::kF32, {c.heads, c.n_q}), ip,
                              d_out.view(DType::kF32, {c.kv_heads, c.n_k}), kGpu));
      expect_matches(std::string("kv_importance ") + (bf ? "bf16 keys " : "") + c.name, d_out, ref,
                     tol);
      if (HasFailure()) return;
    }
  }
  // BF16 keys on the CPU are refused (the CUDA kernel widens them; the CPU kernel takes F32).
  {
    std::vector<uint16_t> kb(64 * 64);
    std::vector<float> q1(4 * 64), l1(4), o1(64);
    ImportanceParams ip;
    EXPECT_EQ(kv_importance(TensorView::make(q1.data(), DType::kF32, {1, 4, 64}),
                            TensorView::make(kb.data(), DType::kBF16, {64, 1, 64}),
                            TensorView::make(l1.data(), DType::kF32, {4, 1}), ip,
                            TensorView::make(o1.data(), DType::kF32, {1, 64}))
                  .code(),
              Code::kInvalidArgument);
  }
  // A pool wider than CUDA's halo is refused, not computed wrong.
  DevBuf d_q, d_k, d_lse, d_out;
  ASSERT_OK(d_q.alloc(64 * 4 * 64 * 4));
  ASSERT_OK(d_k.alloc(64 * 1 * 64 * 4));
  ASSERT_OK(d_lse.alloc(4 * 64 * 4));
  ASSERT_OK(d_out.alloc(64 * 4));
  ImportanceParams ip;
  ip.pool = 67;
  const Status st =
      kv_importance(d_q.view(DType::kF32, {64, 4, 64}), d_k.view(DType::kF32, {64, 1, 64}),
                    d_lse.view(DType::kF32, {4, 64}), ip, d_out.view(DType::kF32, {1, 64}), kGpu);
  EXPECT_EQ(st.code(), Code::kUnsupported) << st.to_string();
}

// ---- attention_dense on BF16: cuDNN's fused flash attention -------------------------------------
// Against the CPU fp32 dense kernel on the same bf16-rounded inputs. cuDNN rounds P to bf16 for
// the PV product and out to bf16: the bounds are the bf16 sparse kernel's (1e-2 relative and
// absolute on out, |out| <= 1). Stats (LSE) come from fp32 scores: 2e-5 relative, 5e-4 absolute.
// Cases: top-left causal (q_offset 0), bottom-right causal (a chunk: q_offset = n_k - n_q),
// non-causal, GQA 4 and 8, head_dim 64 and 128. A causal offset that is neither is kUnsupported.
TEST_F(CudaOps, AttentionDenseBf16Cudnn) {
  const Status avail = cuda::attention_dense_bf16_available();
  if (!avail.is_ok()) GTEST_SKIP() << avail.to_string();
  const Tolerance tol{1e-2, 1e-2}, tol_lse{2e-5, 5e-4};
  struct Case {
    const char* name;
    int64_t n_q, n_k, heads, kv_heads, head_dim, q_offset;
    bool causal;
  };
  const Case cases[] = {
      {"causal gqa4 d128", 300, 300, 8, 2, 128, 0, true},
      {"chunk gqa4 d128 (bottom-right, n_q<n_k)", 77, 333, 8, 2, 128, 256, true},
      {"causal gqa8 d64 long", 1500, 1500, 8, 1, 64, 0, true},
      {"non-causal gqa2 d64", 33, 90, 4, 2, 64, 0, false},
  };
  for (const Case& c : cases) {
    const int64_t d = c.head_dim;
    auto [qb, kb, vb, q, k, v] = bf16_qkv(c.n_q, c.heads, c.n_k, c.kv_heads, d);
    AttentionParams p;
    p.causal = c.causal;
    p.q_offset = c.q_offset;
    std::vector<float> ref(q.size()), ref_lse(size_t(c.heads * c.n_q));
    ASSERT_OK(attention_dense(TensorView::make(q.data(), DType::kF32, {c.n_q, c.heads, d}),
                              TensorView::make(k.data(), DType::kF32, {c.n_k, c.kv_heads, d}),
                              TensorView::make(v.data(), DType::kF32, {c.n_k, c.kv_heads, d}),
                              TensorView::make(ref.data(), DType::kF32, {c.n_q, c.heads, d}),
                              TensorView::make(ref_lse.data(), DType::kF32, {c.heads, c.n_q}), p,
                              kCpu));
    DevAttention dev;
    ASSERT_OK(dev.upload(qb, kb, vb, ref.size() * 2, ref_lse.size() * 4));
    auto& [d_q, d_k, d_v, d_out, d_lse] = dev;
    const TensorView qv = d_q.view(DType::kBF16, {c.n_q, c.heads, d});
    const TensorView kv = d_k.view(DType::kBF16, {c.n_k, c.kv_heads, d});
    const TensorView vv = d_v.view(DType::kBF16, {c.n_k, c.kv_heads, d});
    const TensorView ov = d_out.view(DType::kBF16, {c.n_q, c.heads, d});
    ASSERT_OK(cuda::attention_dense_plan(qv, kv, vv, ov, p));
    ASSERT_OK(attention_dense(qv, kv, vv, ov, d_lse.view(DType::kF32, {c.heads, c.n_q}), p, kGpu));
    const std::string name = std::string("cudnn bf16 ") + c.name;
    expect_matches_bf16(name, d_out, ref, tol);
    expect_matches(name + " lse", d_lse, ref_lse, tol_lse);
    if (HasFailure()) return;
  }
  // A causal offset that is neither alignment cuDNN knows.
  const int64_t n_q = 16, n_k = 64, h = 2, d = 64;
  DevBuf d_q, d_k, d_out, d_lse;
  ASSERT_OK(d_q.alloc(size_t(n_q * h * d) * 2));
  ASSERT_OK(d_k.alloc(size_t(n_k * h * d) * 2));
  ASSERT_OK(d_out.alloc(size_t(n_q * h * d) * 2));
  ASSERT_OK(d_lse.alloc(size_t(n_q * h) * 4));
  AttentionParams p;
  p.q_offset = 10;
  const Status st = attention_dense(
      d_q.view(DType::kBF16, {n_q, h, d}), d_k.view(DType::kBF16, {n_k, h, d}),
      d_k.view(DType::kBF16, {n_k, h, d}), d_out.view(DType::kBF16, {n_q, h, d}),
      d_lse.view(DType::kF32, {h, n_q}), p, kGpu);
  EXPECT_EQ(st.code(), Code::kUnsupported) << st.to_string();
}

// The run step with a device-resident index is capturable (no allocation, no sync) and replays
// reproduce the eager result bit for bit; unsupported head dims and non-causal params are refused.
TEST_F(CudaOps, AttentionSparseDeviceIndexGraphAndRejects) {
  const int64_t n = 200, heads = 8, kv_heads = 2, d = 128;
  const auto q = uniform(size_t(n * heads * d), -3.f, 3.f);
  const auto k = uniform(size_t(n * kv_heads * d), -1.f, 1.f);
  const auto v = uniform(size_t(n * kv_heads * d), -1.f, 1.f);
  const SparseIndex idx = random_index(rng_, heads, n, n, 0);
  DevAttention dev;
  ASSERT_OK(dev.upload(q, k, v, q.size() * 4, size_t(heads * n) * 4));
  auto& [d_q, d_k, d_v, d_out, d_lse] = dev;
  const TensorView qv = d_q.view(DType::kF32, {n, heads, d});
  const TensorView kv = d_k.view(DType::kF32, {n, kv_heads, d});
  const TensorView vv = d_v.view(DType::kF32, {n, kv_heads, d});
  const TensorView ov = d_out.view(DType::kF32, {n, heads, d});
  const TensorView lv = d_lse.view(DType::kF32, {heads, n});
  cuda::DeviceBuffer idx_storage;
  cuda::SparseIndexDevice didx;
  ASSERT_OK(cuda::sparse_index_upload(idx, &idx_storage, &didx));
  const AttentionParams p;

  ASSERT_OK(d_out.poison());
  ASSERT_OK(d_lse.poison());
  ASSERT_OK(attention_sparse(qv, kv, vv, idx, ov, lv, p, kGpu));  // host-index path
  std::vector<float> eager_out, eager_lse;
  ASSERT_OK(cuda::stream_synchronize(nullptr));
  ASSERT_OK(d_out.download(&eager_out));
  ASSERT_OK(d_lse.download(&eager_lse));

  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { (void)cudaStreamDestroy(s); }
  } stream_guard{stream};
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status captured = cuda::attention_sparse(qv, kv, vv, didx, ov, lv, p, stream);
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_OK(captured);
  ASSERT_CUDA(end);
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_OK(d_out.poison());
  ASSERT_OK(d_lse.poison());
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_OK(cuda::stream_synchronize(stream));
  expect_matches("sparse graph replay out", d_out, eager_out, kExact);
  expect_matches("sparse graph replay lse", d_lse, eager_lse, kExact);
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);

  AttentionParams nc;
  nc.causal = false;
  EXPECT_EQ(attention_sparse(qv, kv, vv, idx, ov, lv, nc, kGpu).code(), Code::kInvalidArgument);
  EXPECT_FALSE(cuda::attention_sparse_supported(96));
  const int64_t d96 = 96;
  const SparseIndex idx96 = sparse_index_dense(2, 4, 4, 0);
  DevBuf d_x, d_o96, d_l96;
  ASSERT_OK(d_x.alloc(size_t(4 * 2 * d96) * 4));
  ASSERT_OK(d_o96.alloc(size_t(4 * 2 * d96) * 4));
  ASSERT_OK(d_l96.alloc(size_t(4 * 2) * 4));
  const TensorView x96 = d_x.view(DType::kF32, {4, 2, d96});
  const Status st = attention_sparse(x96, x96, x96, idx96, d_o96.view(DType::kF32, {4, 2, d96}),
                                     d_l96.view(DType::kF32, {2, 4}), p, kGpu);
  EXPECT_EQ(st.code(), Code::kUnsupported) << st.to_string();
}

// ---- CUDA graph capture -----------------------------------------------------------------------
// Capture in global mode fails if any op synchronizes with the host or allocates, so this checks
// the "run paths never sync" contract and linear's plan/run split; replays must match eager runs.
TEST_F(CudaOps, GraphCaptureMatchesEager) {
  const int64_t n = 40, heads = 8, kv_heads = 2, d = 128, hidden = 192, out_f = 96;
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { (void)cudaStreamDestroy(s); }
  } stream_guard{stream};
  const Stream gs{Device::kCuda, stream};

  const auto x = uniform(size_t(n * hidden), -2.f, 2.f);
  const auto nw = uniform(size_t(hidden), 0.5f, 1.5f);
  const auto w = uniform(size_t(out_f * hidden), -1.f, 1.f);
  const auto b = uniform(size_t(out_f), -1.f, 1.f);
  const auto q0 = uniform(size_t(n * heads * d), -3.f, 3.f);
  const auto k = uniform(size_t(n * kv_heads * d), -1.f, 1.f);
  const auto v = uniform(size_t(n * kv_heads * d), -1.f, 1.f);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = int32_t(1000 + i);

  DevBuf d_x, d_nw, d_xn, d_w, d_b, d_y, d_q0, d_q, d_k, d_v, d_o, d_lse, d_pos;
  ASSERT_OK(d_x.alloc_upload(x));
  ASSERT_OK(d_nw.alloc_upload(nw));
  ASSERT_OK(d_w.alloc_upload(w));
  ASSERT_OK(d_b.alloc_upload(b));
  ASSERT_OK(d_q0.alloc_upload(q0));
  ASSERT_OK(d_q.alloc(q0.size() * 4));
  ASSERT_OK(d_k.alloc_upload(k));
  ASSERT_OK(d_v.alloc_upload(v));
  ASSERT_OK(d_pos.alloc_upload(pos));
  ASSERT_OK(d_xn.alloc(x.size() * 4));
  ASSERT_OK(d_y.alloc(size_t(n * out_f) * 4));
  ASSERT_OK(d_o.alloc(q0.size() * 4));
  ASSERT_OK(d_lse.alloc(size_t(heads * n) * 4));
  RopeParams rp;
  rp.neox = true;
  const TensorView xn = d_xn.view(DType::kF32, {n, hidden});
  const TensorView wv = d_w.view(DType::kF32, {out_f, hidden});
  const TensorView bv = d_b.view(DType::kF32, {out_f});
  const TensorView yv = d_y.view(DType::kF32, {n, out_f});
  ASSERT_OK(cuda::linear_plan(xn, wv, bv, yv));

  auto enqueue = [&]() -> Status {
    SF_TRY(rms_norm(d_x.view(DType::kF32, {n, hidden}), d_nw.view(DType::kF32, {hidden}), 1e-6f, xn,
                    gs));
    SF_TRY(linear(xn, wv, bv, yv, gs));
    const cudaError_t e =
        cudaMemcpyAsync(d_q.data(), d_q0.data(), q0.size() * 4, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return SF_ERR(kInternal, cudaGetErrorString(e));
    const TensorView qv = d_q.view(DType::kF32, {n, heads, d});
    SF_TRY(rope(qv, static_cast<const int32_t*>(d_pos.data()), rp, gs));
    return attention_dense(qv, d_k.view(DType::kF32, {n, kv_heads, d}),
                           d_v.view(DType::kF32, {n, kv_heads, d}),
                           d_o.view(DType::kF32, {n, heads, d}),
                           d_lse.view(DType::kF32, {heads, n}), AttentionParams{}, gs);
  };
  DevBuf* outs[] = {&d_xn, &d_y, &d_o, &d_lse};
  const char* names[] = {"graph rms_norm", "graph linear", "graph attention out",
                         "graph attention lse"};

  for (DevBuf* o : outs) ASSERT_OK(o->poison());
  ASSERT_OK(enqueue());
  ASSERT_OK(cuda::stream_synchronize(stream));
  std::vector<std::vector<float>> eager(4);
  for (int i = 0; i < 4; ++i) ASSERT_OK(outs[i]->download(&eager[size_t(i)]));

  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status captured = enqueue();
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_OK(captured);
  ASSERT_CUDA(end);
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    for (DevBuf* o : outs) ASSERT_OK(o->poison());
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_OK(cuda::stream_synchronize(stream));
    // Deterministic kernels and one cuBLASLt algorithm: replays reproduce the eager run exactly.
    for (int i = 0; i < 4; ++i) expect_matches(names[i], *outs[i], eager[size_t(i)], kExact);
  }
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace sf::kernels
