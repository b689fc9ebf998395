#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace sf::kernels::cpu {

Status embedding(const TensorView& table, const int32_t* ids, int64_t n, TensorView out) {
  const int64_t vocab = table.shape[0], h = table.shape[1];
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      return SF_ERR(kOutOfRange, "embedding: token id " + std::to_string(ids[i]) + " at position " +
                                     std::to_string(i) + " outside vocab " + std::to_string(vocab));
  float* o = out.ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = ids[i];
    switch (table.dtype) {
      case DType::kF32: std::memcpy(o + i * h, table.ptr<float>() + r * h, size_t(h) * 4); break;
      case DType::kF16:
        for (int64_t j = 0; j < h; ++j) o[i * h + j] = f16_to_f32(table.ptr<uint16_t>()[r * h + j]);
        break;
      case DType::kBF16:
        for (int64_t j = 0; j < h; ++j) o[i * h + j] = bf16_to_f32(table.ptr<uint16_t>()[r * h + j]);
        break;
      default: return SF_ERR(kUnsupported, "embedding: table dtype");
    }
  }
  return Status::ok();
}

Status rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out) {
  const int64_t n = x.shape[0], h = x.shape[1];
  const float* xp = x.ptr<float>();
  const float* wp = w.ptr<float>();
  float* op = out.ptr<float>();
  parallel_for(size_t(n), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float* r = xp + i * h;
      double ss = 0;  // double: rows of 4K+ values lose digits in fp32 sums
      for (int64_t j = 0; j < h; ++j) ss += double(r[j]) * r[j];
      const float inv = float(1.0 / std::sqrt(ss / double(h) + double(eps)));
      float* o = op + i * h;
      for (int64_t j = 0; j < h; ++j) o[j] = r[j] * inv * wp[j];
    }
  }, 16);
  return Status::ok();
}

// exp(v) = 2^k * exp(r): k = round(v / ln2) via the 1.5 * 2^23 rounding trick, 2^k assembled in
// the exponent bits (v >= -87 keeps it normal).
float exp_sub_sum(float* x, int64_t n, float sub) {
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float v = std::max(x[j] - sub, -87.f);
    const float kf = (v * 1.44269504f + 12582912.f) - 12582912.f;  // round(v / ln2)
    const float r = v - kf * 0.693145751953125f - kf * 1.428606765330187e-06f;
    const float poly = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    const int32_t bits = (int32_t(kf) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    x[j] = poly * scale;
    sum += x[j];
  }
  return sum;
}

void softmax_in_place(float* x, int64_t n) {
  if (n <= 0) return;
  const float sum = exp_sub_sum(x, n, *std::max_element(x, x + n));
  for (int64_t j = 0; j < n; ++j) x[j] /= sum;
}

void rope_inv_freq(const RopeParams& p, int rot_dim, float* out) {
  const int half = rot_dim / 2;
  for (int i = 0; i < half; ++i) {
    double f = std::pow(double(p.theta), -2.0 * i / double(rot_dim));
    if (p.freq_factors) {
      f /= double(p.freq_factors[i]);
    } else if (p.scaling_factor > 0.f) {
      // Llama-3: keep high frequencies, divide low ones by factor, blend in between.
      const double kPi = 3.14159265358979323846;
      const double wavelen = 2 * kPi / f;
      const double low_wl = p.original_max_pos / p.low_freq_factor;
      const double high_wl = p.original_max_pos / p.high_freq_factor;
      if (wavelen > low_wl) {
        f /= p.scaling_factor;
      } else if (wavelen >= high_wl) {
        const double smooth = (p.original_max_pos / wavelen - p.low_freq_factor) /
                              (p.high_freq_factor - p.low_freq_factor);
        f = (1 - smooth) * f / p.scaling_factor + smooth * f;
      }
    }
    out[i] = float(f);
  }
}

Status rope(TensorView x, const int32_t* positions, const RopeParams& p) {
  const int64_t n = x.shape[0], heads = x.shape[1], d = x.shape[2];
  const int rot = p.rot_dim > 0 ? p.rot_dim : int(d);
  std::vector<float> inv(size_t(rot / 2));
  rope_inv_freq(p, rot, inv.data());
  float* xp = x.ptr<float>();
  parallel_for(size_t(n), [&](size_t b, size_t e) {
    std::vector<float> c(size_t(rot / 2)), s(size_t(rot / 2));
    for (size_t t = b; t < e; ++t) {
      for (int i = 0; i < rot / 2; ++i) {
        const double a = double(positions[t]) * double(inv[size_t(i)]);
        c[size_t(i)] = float(std::cos(a));
        s[size_t(i)] = float(std::sin(a));
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* r = xp + (int64_t(t) * heads + h) * d;
        for (int i = 0; i < rot / 2; ++i) {
          const int i0 = p.neox ? i : 2 * i;
          const int i1 = p.neox ? i + rot / 2 : 2 * i + 1;
          const float x0 = r[i0], x1 = r[i1];
          r[i0] = x0 * c[size_t(i)] - x1 * s[size_t(i)];
          r[i1] = x0 * s[size_t(i)] + x1 * c[size_t(i)];
        }
      }
    }
  }, 8);
  return Status::ok();
}

Status swiglu(const TensorView& gate, const TensorView& up, TensorView out) {
  const int64_t n = gate.numel();
  const float* g = gate.ptr<float>();
  const float* u = up.ptr<float>();
  float* o = out.ptr<float>();
  parallel_for(size_t(n), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }, 4096);
  return Status::ok();
}

Status add_inplace(TensorView out, const TensorView& x) {
  const int64_t n = out.numel();
  float* o = out.ptr<float>();
  const float* a = x.ptr<float>();
  for (int64_t i = 0; i < n; ++i) o[i] += a[i];
  return Status::ok();
}

Status add_rms_norm(TensorView x, const TensorView& delta, const TensorView& w, float eps, TensorView out) {
  if (delta.data) SF_TRY(add_inplace(x, delta));
  return rms_norm(x, w, eps, out);
}

}  // namespace sf::kernels::cpu
