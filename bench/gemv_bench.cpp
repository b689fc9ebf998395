// The decode step's one-row linears on a GPU host: kernels::gemv / gemv_parts / gemv_swiglu at
// the Llama-3-8B and SmolLM2 shapes, timed in alternating rounds with a device-to-device copy of
// the same weights' bytes (a copy moves them twice: read and write). Weights N(0, 1) from
// fill_normal (never zeros), x N(0, 1). One JSON line per (shape, weights dtype): microseconds
// per call (the median of 5 rounds of `reps` back-to-back calls on one stream, each after the
// last, as in a step) and the weights' bytes per second. Shapes whose weights fit in L2 (50 MB on
// an H100) are partly served from it across the repeats, as they are not in a step.
//   sf_bench_gemv [reps=50]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "kernels/api.h"
#include "kernels/cuda/cuda_ops.h"

using namespace sf;
namespace cuda = sf::kernels::cuda;
using sf::bench::fail;

namespace {

struct Shape {
  const char* name;  // model and linear
  const char* op;    // gemv, parts or swiglu
  int64_t in;
  std::vector<int64_t> outs;  // one per weight (parts: Q, K, V; swiglu: gate, up)
};

TensorView dev(void* p, DType t, std::initializer_list<int64_t> dims) {
  return TensorView::make(p, t, dims, Device::kCuda);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  if (reps < 1) {
    std::fprintf(stderr, "usage: sf_bench_gemv [reps>=1]\n");
    return 2;
  }
  const std::vector<Shape> shapes = {
      {"llama3-8b qkv", "parts", 4096, {4096, 1024, 1024}},
      {"llama3-8b o", "gemv", 4096, {4096}},
      {"llama3-8b gate+up", "swiglu", 4096, {14336, 14336}},
      {"llama3-8b down", "gemv", 14336, {4096}},
      {"llama3-8b lm_head", "gemv", 4096, {128256}},
      {"smollm2 qkv", "parts", 576, {576, 192, 192}},
      {"smollm2 gate+up", "swiglu", 576, {1536, 1536}},
      {"smollm2 down", "gemv", 1536, {576}},
      {"smollm2 lm_head", "gemv", 576, {49152}},
  };
  const std::string commit = bench::source_commit(), command = bench::command_line(argc, argv),
                    date = now_iso8601();
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  cudaStream_t st = nullptr;
  if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess)
    return fail("stream", SF_ERR(kInternal, "cudaStreamCreate"));
  const kernels::Stream ks{Device::kCuda, st};
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (const DType wdt : {DType::kBF16, DType::kF32})
    for (const Shape& sh : shapes) {
      const size_t esz = dtype_size(wdt);
      std::vector<cuda::DeviceBuffer> w(sh.outs.size()), y(sh.outs.size());
      cuda::DeviceBuffer x, copy;
      int64_t bytes = 0, out_total = 0;
      for (size_t i = 0; i < sh.outs.size(); ++i) {
        const int64_t n = sh.outs[i] * sh.in;
        if (Status s = w[i].alloc(size_t(n) * esz); !s.is_ok()) return fail("alloc", s);
        if (Status s = y[i].alloc(size_t(sh.outs[i]) * 4); !s.is_ok()) return fail("alloc", s);
        cuda::FillNormal f;
        f.seed = 17 + i;
        if (Status s = cuda::fill_normal(dev(w[i].data(), wdt, {sh.outs[i], sh.in}), f, st); !s.is_ok())
          return fail("fill", s);
        bytes += n * int64_t(esz);
        out_total += sh.outs[i];
      }
      if (Status s = x.alloc(size_t(sh.in) * 4); !s.is_ok()) return fail("alloc", s);
      {
        cuda::FillNormal f;
        f.seed = 5;
        if (Status s = cuda::fill_normal(dev(x.data(), DType::kF32, {sh.in}), f, st); !s.is_ok())
          return fail("fill", s);
      }
      if (Status s = copy.alloc(size_t(bytes)); !s.is_ok()) return fail("alloc", s);
      const TensorView xv = dev(x.data(), DType::kF32, {1, sh.in}), none{};
      auto call = [&]() -> Status {
        if (std::string(sh.op) == "parts") {
          kernels::GemvPart parts[kernels::kGemvMaxParts];
          for (size_t i = 0; i < sh.outs.size(); ++i)
            parts[i] = {dev(w[i].data(), wdt, {sh.outs[i], sh.in}), none,
                        dev(y[i].data(), DType::kF32, {1, sh.outs[i]})};
          return kernels::gemv_parts(xv, parts, int(sh.outs.size()), ks);
        }
        if (std::string(sh.op) == "swiglu")
          return kernels::gemv_swiglu(xv, dev(w[0].data(), wdt, {sh.outs[0], sh.in}),
                                      dev(w[1].data(), wdt, {sh.outs[1], sh.in}),
                                      dev(y[0].data(), DType::kF32, {1, sh.outs[0]}), ks);
        return kernels::gemv(xv, dev(w[0].data(), wdt, {sh.outs[0], sh.in}), none,
                             dev(y[0].data(), DType::kF32, {1, sh.outs[0]}), ks);
      };
      // Timed: the GEMV, then the copy, in alternating rounds; the first round warms up.
      constexpr int kRounds = 6;
      std::vector<double> us[2];
      for (int r = 0; r < kRounds; ++r)
        for (int k = 0; k < 2; ++k) {
          cudaEventRecord(e0, st);
          for (int i = 0; i < reps; ++i) {
            if (k == 1) {
              size_t at = 0;  // every weight of the shape, end to end into one buffer
              for (const auto& wi : w) {
                if (cudaMemcpyAsync(static_cast<char*>(copy.data()) + at, wi.data(), wi.size(),
                                    cudaMemcpyDeviceToDevice, st) != cudaSuccess)
                  return fail("copy", SF_ERR(kInternal, "cudaMemcpyAsync"));
                at += wi.size();
              }
            } else if (Status s = call(); !s.is_ok()) {
              return fail("gemv", s);
            }
          }
          cudaEventRecord(e1, st);
          if (cudaEventSynchronize(e1) != cudaSuccess) return fail("sync", SF_ERR(kInternal, "event"));
          float ms = 0.f;
          cudaEventElapsedTime(&ms, e0, e1);
          if (r > 0) us[k].push_back(1e3 * double(ms) / reps);
        }
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      const double t = median(us[0]), copy_us = median(us[1]);
      std::printf(
          "{\"device\": \"%s\", \"shape\": \"%s\", \"op\": \"%s\", \"weights\": \"%s\", "
          "\"in\": %lld, \"out\": %lld, \"weight_bytes\": %lld, \"us\": %.2f, "
          "\"weight_gbs\": %.1f, \"copy_us_same_bytes\": %.2f, \"copy_gbs_read_write\": %.1f, "
          "\"reps\": %d, \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\"}\n",
          prop.name, sh.name, sh.op, dtype_name(wdt), static_cast<long long>(sh.in),
          static_cast<long long>(out_total), static_cast<long long>(bytes), t,
          double(bytes) / (t * 1e3), copy_us, 2.0 * double(bytes) / (copy_us * 1e3), reps,
          date.c_str(), commit.c_str(), command.c_str());
      std::fflush(stdout);
    }
  return 0;
}
