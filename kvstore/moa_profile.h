// MoA profiling for KV retention (seed 003, "Mixture of Sparse Attention"): per layer and KV
// head, an elastic span alpha + beta * N of recent tokens, chosen from how much of the prompt
// end's attention each head pays within each distance on calibration text, then fitted across
// prompt lengths. MoA profiles the attention's influence on the loss and solves for spans under a
// density; here the measure is the observation window's attention mass (SnapKV column sums, the
// rows a decode node continues from), every head weighted alike, and the solver a greedy over
// each head's upper concave envelope. `sparsefill moa-profile` runs it and writes the config that
// `moa:config=FILE` reads (kvstore/retention.h).
#pragma once
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kvstore/retention.h"

namespace sf::kvstore {

// The share of one head's attention mass (scores[t], t < n: column sums over the observation
// window, unpooled) that keeping the first `sink` tokens plus the newest w tokens captures, for
// w = 0, step, 2 step, ... ; the last entry keeps everything (1, or 0 for a head with no mass).
// Empty when step or n is not positive.
std::vector<double> moa_mass_curve(const float* scores, int64_t n, int64_t sink, int64_t step);

// Spans in tokens (multiples of step), one per curve, whose captured masses sum to as much as
// the greedy finds with at most `budget` span tokens in all: each move takes one head to its next
// vertex of its curve's upper concave envelope (the best mass per token from where it stands)
// that still fits the budget; ties go to the lower head. Lazy: one head is re-scored a move. Every head starts at min_span (rounded up to a step, capped at its
// curve); budget below the heads' min_span total is an error.
Result<std::vector<int64_t>> moa_allocate(const std::vector<std::vector<double>>& curves,
                                          int64_t step, int64_t budget, int64_t min_span);

// alpha + beta * N through the points (lengths[i], spans[i]) by least squares, with beta in [0, 1]
// and alpha >= 0 (a clamped coefficient refits the other). One point: alpha = span, beta = 0.
MoaSpan moa_fit(const std::vector<int64_t>& lengths, const std::vector<int64_t>& spans);

}  // namespace sf::kvstore
