#include "kvstore/moa_profile.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace sf::kvstore {

std::vector<double> moa_mass_curve(const float* scores, int64_t n, int64_t sink, int64_t step) {
  if (step <= 0 || n <= 0) return {};  // moa_allocate refuses an empty curve
  const int64_t s = std::clamp<int64_t>(sink, 0, n);
  double total = 0, base = 0;
  for (int64_t t = 0; t < n; ++t) total += double(scores[t]);
  for (int64_t t = 0; t < s; ++t) base += double(scores[t]);
  const int64_t room = n - s;  // tokens a span can add
  const int64_t points = (room + step - 1) / step + 1;
  std::vector<double> c(size_t(points), 0.0);
  if (total <= 0) return c;
  double acc = base;
  int64_t t = n;  // tokens [t, n) are in the span
  for (int64_t i = 0; i < points; ++i) {
    const int64_t stop = std::max(s, n - std::min(room, i * step));
    while (t > stop) acc += double(scores[--t]);
    c[size_t(i)] = std::min(1.0, acc / total);
  }
  return c;
}

Result<std::vector<int64_t>> moa_allocate(const std::vector<std::vector<double>>& curves,
                                          int64_t step, int64_t budget, int64_t min_span) {
  SF_ENSURE(step > 0, kInvalidArgument, "moa profile: step must be positive");
  const size_t H = curves.size();
  std::vector<int64_t> at(H, 0);  // each head's index on its curve
  int64_t used = 0;
  for (size_t h = 0; h < H; ++h) {
    SF_ENSURE(!curves[h].empty(), kInvalidArgument, "moa profile: an empty mass curve");
    const int64_t last = int64_t(curves[h].size()) - 1;
    at[h] = std::min(last, (std::max<int64_t>(0, min_span) + step - 1) / step);
    used += at[h] * step;
  }
  if (used > budget)
    return SF_ERR(kInvalidArgument, "moa profile: a budget of " + std::to_string(budget) +
                                        " span tokens is below the heads' minimum of " +
                                        std::to_string(used));
  // Each head's best move from where it stands: to any later point within `room` steps, by mass
  // gained per token (0, none: no gain). The best jump from a point lands on a vertex of the
  // curve's upper concave envelope, so a head whose curve is flat before a far-back rise still
  // gets that rise.
  struct Move {
    double gain = 0;
    int64_t to = -1;
  };
  auto best_move = [&](size_t h, int64_t room) {
    Move m;
    const std::vector<double>& c = curves[h];
    const int64_t last = std::min<int64_t>(int64_t(c.size()) - 1, at[h] + room);
    for (int64_t j = at[h] + 1; j <= last; ++j) {
      const double g = (c[size_t(j)] - c[size_t(at[h])]) / double((j - at[h]) * step);
      if (g > m.gain) m = {g, j};
    }
    return m;
  };
  // Lazy greedy: a cached move was the best under a budget at least as large as what is left, so
  // its gain bounds the head's best now. The largest bound is taken if it still fits; otherwise
  // that head is re-scored under what is left. One head is re-scored per step, not all of them.
  std::vector<Move> cached(H);
  for (size_t h = 0; h < H; ++h) cached[h] = best_move(h, (budget - used) / step);
  for (;;) {
    size_t bh = H;
    for (size_t h = 0; h < H; ++h)
      if (cached[h].to >= 0 && (bh == H || cached[h].gain > cached[bh].gain)) bh = h;
    if (bh == H) break;  // nothing fits, or nothing gains
    const int64_t room = (budget - used) / step;
    if (cached[bh].to - at[bh] > room) {
      cached[bh] = best_move(bh, room);
      continue;
    }
    used += (cached[bh].to - at[bh]) * step;
    at[bh] = cached[bh].to;
    cached[bh] = best_move(bh, (budget - used) / step);
  }
  std::vector<int64_t> spans(H);
  for (size_t h = 0; h < H; ++h) spans[h] = at[h] * step;
  return spans;
}

MoaSpan moa_fit(const std::vector<int64_t>& lengths, const std::vector<int64_t>& spans) {
  const size_t n = std::min(lengths.size(), spans.size());
  if (n == 0) return {};
  double mx = 0, my = 0;
  for (size_t i = 0; i < n; ++i) mx += double(lengths[i]), my += double(spans[i]);
  mx /= double(n);
  my /= double(n);
  double sxx = 0, sxy = 0;
  for (size_t i = 0; i < n; ++i) {
    sxx += (double(lengths[i]) - mx) * (double(lengths[i]) - mx);
    sxy += (double(lengths[i]) - mx) * (double(spans[i]) - my);
  }
  double beta = sxx > 0 ? std::clamp(sxy / sxx, 0.0, 1.0) : 0.0;
  double alpha = my - beta * mx;
  if (alpha < 0) {
    // Through the origin: the best beta alone, clamped again.
    double sx2 = 0, sxy0 = 0;
    for (size_t i = 0; i < n; ++i)
      sx2 += double(lengths[i]) * double(lengths[i]), sxy0 += double(lengths[i]) * double(spans[i]);
    alpha = 0;
    beta = sx2 > 0 ? std::clamp(sxy0 / sx2, 0.0, 1.0) : 0.0;
  }
  return {alpha, beta};
}

}  // namespace sf::kvstore
