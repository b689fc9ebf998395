// The sparse index: geometry, builder, density accounting and validation. See sparse_index.h for
// the representation (how diagonals and windows become 64-key entries plus columns).
#include "kernels/sparse_index.h"

#include <algorithm>
#include <string>

namespace sf::kernels {
namespace {

constexpr int64_t kB = kSparseBlock;

// Keys row i of a slot may see: [0, limit).
int64_t row_limit(const SparseSlotGeometry& g, int64_t n_k, int64_t i) {
  return std::clamp<int64_t>(g.base + i + 1, 0, n_k);
}

// Pairs contributed by keys [a, e) (sorted inside the slot) over the slot's rows.
int64_t range_pairs(const SparseSlotGeometry& g, int64_t n_k, int64_t a, int64_t e) {
  if (e <= a) return 0;
  if (e <= row_limit(g, n_k, 0)) return (e - a) * g.rows;  // visible to every row
  int64_t sum = 0;
  for (int64_t i = 0; i < g.rows; ++i)
    sum += std::clamp<int64_t>(row_limit(g, n_k, i) - a, 0, e - a);
  return sum;
}

// Streams the candidate ranges of a slot in ascending start order and merges them into
// maximal disjoint intervals, calling emit(a, e) for each.
template <typename Emit>
void merge_ranges(const SparseSlotGeometry& g, std::span<const int32_t> diagonals,
                  std::span<const int32_t> key_blocks, int64_t sink, int64_t local, Emit&& emit) {
  const int64_t kend = g.kend;
  // Singletons: the sink and the local window.
  int64_t fixed_a[2], fixed_e[2];
  int n_fixed = 0;
  const int64_t se = std::min(std::max<int64_t>(sink, 0), kend);
  const int64_t la = std::clamp<int64_t>(g.base - std::max<int64_t>(local, 0), 0, kend);
  if (se > 0) {
    fixed_a[n_fixed] = 0;
    fixed_e[n_fixed++] = se;
  }
  if (la < kend) {
    fixed_a[n_fixed] = la;
    fixed_e[n_fixed++] = kend;
  }
  if (n_fixed == 2 && fixed_a[1] < fixed_a[0]) {
    std::swap(fixed_a[0], fixed_a[1]);
    std::swap(fixed_e[0], fixed_e[1]);
  }
  // Diagonals ascending -> starts descending: walk them from the back.
  ptrdiff_t di = ptrdiff_t(diagonals.size()) - 1;
  size_t bi = 0;
  int fi = 0;
  int64_t cur_a = -1, cur_e = -1;
  for (;;) {
    int64_t a = INT64_MAX, e = 0;
    int src = -1;
    // Skip candidates that clip to nothing so every stream's head is a real range.
    while (di >= 0) {
      const int64_t o = diagonals[size_t(di)];
      const int64_t da = std::clamp<int64_t>(g.base - o, 0, kend),
                    de = std::clamp<int64_t>(g.base - o + g.rows, 0, kend);
      if (o >= 0 && da < de) break;
      --di;
    }
    while (bi < key_blocks.size()) {
      const int64_t b = key_blocks[bi];
      if (b >= 0 && b * kB < kend) break;
      ++bi;
    }
    if (di >= 0) {
      const int64_t o = diagonals[size_t(di)];
      a = std::clamp<int64_t>(g.base - o, 0, kend);
      e = std::clamp<int64_t>(g.base - o + g.rows, 0, kend);
      src = 0;
    }
    if (bi < key_blocks.size() && key_blocks[bi] * kB < a) {
      a = key_blocks[bi] * kB;
      e = std::min(a + kB, kend);
      src = 1;
    }
    if (fi < n_fixed && fixed_a[fi] < a) {
      a = fixed_a[fi];
      e = fixed_e[fi];
      src = 2;
    }
    if (src < 0) break;
    if (src == 0)
      --di;
    else if (src == 1)
      ++bi;
    else
      ++fi;
    if (cur_e >= a) {
      cur_e = std::max(cur_e, e);
    } else {
      if (cur_e > cur_a) emit(cur_a, cur_e);
      cur_a = a;
      cur_e = e;
    }
  }
  if (cur_e > cur_a) emit(cur_a, cur_e);
}

std::string where(int h, int64_t qb) {
  return "sparse index: head " + std::to_string(h) + " qblock " + std::to_string(qb) + ": ";
}

Status bad(const std::string& msg) { return SF_ERR(kInvalidArgument, msg); }

}  // namespace

void sparse_index_key_rows(const SparseIndex& idx, int64_t qb_begin, int64_t qb_end, int q_per_kv,
                           int kv_head0, int n_kv, uint8_t* need) {
  for (int h = 0; h < idx.n_heads; ++h) {
    uint8_t* nh = need + kv_head0 + h / q_per_kv;
    for (int64_t qb = std::max<int64_t>(qb_begin, 0); qb < std::min(qb_end, idx.n_qblocks); ++qb) {
      const SparseSlotGeometry g = sparse_slot_geometry(idx.n_q, idx.n_k, idx.q_offset, qb);
      const size_t sl = idx.slot(h, qb);
      for (int32_t b = 0; b < idx.block_count[sl]; ++b) {
        const int64_t off = idx.block_offset[sl * size_t(idx.max_blocks) + size_t(b)];
        for (int64_t t = off; t < std::min<int64_t>(off + kB, g.kend); ++t) nh[t * n_kv] = 1;
      }
      for (int32_t c = 0; c < idx.column_count[sl]; ++c)
        nh[int64_t(idx.column_index[sl * size_t(idx.max_cols) + size_t(c)]) * n_kv] = 1;
    }
  }
}

SparseSlotGeometry sparse_slot_geometry(int64_t n_q, int64_t n_k, int64_t q_offset, int64_t qb) {
  SparseSlotGeometry g;
  const int64_t r0 = qb * kB;
  g.rows = std::clamp<int64_t>(n_q - r0, 0, kB);
  g.base = q_offset + r0;
  g.kend = std::clamp<int64_t>(g.base + g.rows, 0, n_k);
  return g;
}

void sparse_slot_build(const SparseSlotGeometry& g, std::span<const int32_t> columns,
                       std::span<const int32_t> diagonals, std::span<const int32_t> key_blocks,
                       int64_t sink, int64_t local, int64_t tail_block_min,
                       std::vector<int32_t>* blocks, std::vector<int32_t>* columns_out) {
  size_t ci = 0;
  // Free candidate columns below `upto` that no interval covers go out in order.
  auto flush_columns = [&](int64_t upto) {
    for (; ci < columns.size() && columns[ci] < upto; ++ci)
      if (columns[ci] >= 0) columns_out->push_back(columns[ci]);
  };
  // An interval is written once the next one's start is known (a tail block must end by it).
  int64_t pa = -1, pe = -1;
  auto finish = [&](int64_t next_a) {
    if (pe <= pa) return;
    flush_columns(pa);
    int64_t end = pe;
    if (pe == g.kend) {
      for (int64_t off = pa; off < pe; off += kB) blocks->push_back(int32_t(off));
    } else {
      const int64_t full_end = pa + (pe - pa) / kB * kB, tail = pe - full_end;
      for (int64_t off = pa; off < full_end; off += kB) blocks->push_back(int32_t(off));
      if (sparse_tail_to_block(tail, tail_block_min, full_end, next_a)) {
        blocks->push_back(int32_t(full_end));
        end = full_end + kB;
      } else {
        for (int64_t key = full_end; key < pe; ++key) columns_out->push_back(int32_t(key));
      }
    }
    while (ci < columns.size() && columns[ci] < end) ++ci;  // covered
  };
  merge_ranges(g, diagonals, key_blocks, sink, local, [&](int64_t a, int64_t e) {
    finish(a);
    pa = a;
    pe = e;
  });
  finish(g.kend);
  flush_columns(g.kend);
}

int64_t SparseIndex::pairs(int h, int64_t qb) const {
  const SparseSlotGeometry g = sparse_slot_geometry(n_q, n_k, q_offset, qb);
  const size_t s = slot(h, qb);
  int64_t sum = 0;
  const int32_t* bo = block_offset.data() + s * size_t(max_blocks);
  for (int32_t i = 0; i < block_count[s]; ++i)
    sum += range_pairs(g, n_k, bo[i], std::min<int64_t>(bo[i] + kB, g.kend));
  const int32_t* ci = column_index.data() + s * size_t(max_cols);
  for (int32_t i = 0; i < column_count[s]; ++i)
    sum += range_pairs(g, n_k, ci[i], int64_t(ci[i]) + 1);
  return sum;
}

double SparseIndex::density() const {
  int64_t causal = 0;
  for (int64_t i = 0; i < n_q; ++i) causal += std::clamp<int64_t>(q_offset + i + 1, 0, n_k);
  causal *= n_heads;
  if (causal == 0) return 0.0;
  int64_t sum = 0;
  for (int h = 0; h < n_heads; ++h)
    for (int64_t qb = 0; qb < n_qblocks; ++qb) sum += pairs(h, qb);
  return double(sum) / double(causal);
}

void sparse_index_copy_slot(const SparseIndex& from, size_t s, SparseIndex* to, size_t d) {
  const int32_t nb = from.block_count[s], nc = from.column_count[s];
  to->block_count[d] = nb;
  to->column_count[d] = nc;
  std::copy_n(from.block_offset.begin() + ptrdiff_t(s * size_t(from.max_blocks)), nb,
              to->block_offset.begin() + ptrdiff_t(d * size_t(to->max_blocks)));
  std::copy_n(from.column_index.begin() + ptrdiff_t(s * size_t(from.max_cols)), nc,
              to->column_index.begin() + ptrdiff_t(d * size_t(to->max_cols)));
}

bool sparse_index_slot_equal(const SparseIndex& a, size_t s, const SparseIndex& b, size_t t) {
  const int32_t nb = a.block_count[s], nc = a.column_count[s];
  if (nb != b.block_count[t] || nc != b.column_count[t]) return false;
  const auto ab = a.block_offset.begin() + ptrdiff_t(s * size_t(a.max_blocks));
  const auto ac = a.column_index.begin() + ptrdiff_t(s * size_t(a.max_cols));
  return std::equal(ab, ab + nb, b.block_offset.begin() + ptrdiff_t(t * size_t(b.max_blocks))) &&
         std::equal(ac, ac + nc, b.column_index.begin() + ptrdiff_t(t * size_t(b.max_cols)));
}

SparseIndex sparse_index_make(int n_heads, int64_t n_q, int64_t n_k, int64_t q_offset,
                              int max_blocks, int max_cols) {
  SparseIndex idx;
  idx.n_heads = n_heads;
  idx.n_q = n_q;
  idx.n_k = n_k;
  idx.q_offset = q_offset;
  idx.n_qblocks = (n_q + kB - 1) / kB;
  idx.max_blocks = max_blocks;
  idx.max_cols = max_cols;
  const size_t slots = size_t(std::max(n_heads, 0)) * size_t(std::max<int64_t>(idx.n_qblocks, 0));
  idx.block_count.assign(slots, 0);
  idx.column_count.assign(slots, 0);
  idx.block_offset.assign(slots * size_t(std::max(max_blocks, 0)), 0);
  idx.column_index.assign(slots * size_t(std::max(max_cols, 0)), 0);
  return idx;
}

namespace {

// Re-lays out one list array of the index for a larger per-slot capacity.
void grow(std::vector<int32_t>* arr, const std::vector<int32_t>& counts, int* cap, int need) {
  int new_cap = std::max(need, *cap * 2);
  std::vector<int32_t> next(counts.size() * size_t(new_cap), 0);
  for (size_t s = 0; s < counts.size(); ++s)
    std::copy_n(arr->data() + s * size_t(*cap), counts[s], next.data() + s * size_t(new_cap));
  arr->swap(next);
  *cap = new_cap;
}

}  // namespace

void sparse_index_build(SparseIndex* idx, int h, int64_t qb, const IndexCandidates& c, int64_t sink,
                        int64_t local, int64_t tail_block_min) {
  auto sorted = [](std::vector<int32_t> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  };
  const std::vector<int32_t> cols = sorted(c.columns), diags = sorted(c.diagonals),
                             kbs = sorted(c.key_blocks);
  std::vector<int32_t> blocks, columns;
  const SparseSlotGeometry g = sparse_slot_geometry(idx->n_q, idx->n_k, idx->q_offset, qb);
  sparse_slot_build(g, cols, diags, kbs, sink, local, tail_block_min, &blocks, &columns);
  if (int(blocks.size()) > idx->max_blocks)
    grow(&idx->block_offset, idx->block_count, &idx->max_blocks, int(blocks.size()));
  if (int(columns.size()) > idx->max_cols)
    grow(&idx->column_index, idx->column_count, &idx->max_cols, int(columns.size()));
  const size_t s = idx->slot(h, qb);
  idx->block_count[s] = int32_t(blocks.size());
  idx->column_count[s] = int32_t(columns.size());
  std::copy(blocks.begin(), blocks.end(),
            idx->block_offset.begin() + ptrdiff_t(s * size_t(idx->max_blocks)));
  std::copy(columns.begin(), columns.end(),
            idx->column_index.begin() + ptrdiff_t(s * size_t(idx->max_cols)));
}

SparseIndex sparse_index_dense(int n_heads, int64_t n_q, int64_t n_k, int64_t q_offset) {
  const int64_t kend_max = std::clamp<int64_t>(q_offset + n_q, 0, n_k);
  SparseIndex idx =
      sparse_index_make(n_heads, n_q, n_k, q_offset, int((kend_max + kB - 1) / kB), 0);
  for (int h = 0; h < n_heads; ++h)
    for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) {
      const SparseSlotGeometry g = sparse_slot_geometry(n_q, n_k, q_offset, qb);
      const size_t s = idx.slot(h, qb);
      int32_t n = 0;
      for (int64_t off = 0; off < g.kend; off += kB)
        idx.block_offset[s * size_t(idx.max_blocks) + size_t(n++)] = int32_t(off);
      idx.block_count[s] = n;
    }
  return idx;
}

Status sparse_index_validate(const SparseIndex& idx, int64_t sink) {
  if (idx.n_heads <= 0)
    return bad("sparse index: n_heads must be positive, got " + std::to_string(idx.n_heads));
  if (idx.n_q < 0 || idx.n_k < 0) return bad("sparse index: n_q and n_k must be >= 0");
  if (idx.q_offset < 0)
    return bad("sparse index: q_offset must be >= 0, got " + std::to_string(idx.q_offset));
  if (idx.n_k > INT32_MAX) return bad("sparse index: n_k exceeds int32 key positions");
  if (idx.n_qblocks != (idx.n_q + kB - 1) / kB)
    return bad("sparse index: n_qblocks " + std::to_string(idx.n_qblocks) +
               " != ceil(n_q / 64) for n_q " + std::to_string(idx.n_q));
  if (idx.max_blocks < 0 || idx.max_cols < 0)
    return bad("sparse index: max_blocks / max_cols must be >= 0");
  const size_t slots = size_t(idx.n_heads) * size_t(idx.n_qblocks);
  if (idx.block_count.size() != slots)
    return bad("sparse index: block_count has " + std::to_string(idx.block_count.size()) +
               " entries, want " + std::to_string(slots));
  if (idx.column_count.size() != slots)
    return bad("sparse index: column_count has " + std::to_string(idx.column_count.size()) +
               " entries, want " + std::to_string(slots));
  if (idx.block_offset.size() != slots * size_t(idx.max_blocks))
    return bad("sparse index: block_offset has " + std::to_string(idx.block_offset.size()) +
               " entries, want n_heads * n_qblocks * max_blocks = " +
               std::to_string(slots * size_t(idx.max_blocks)));
  if (idx.column_index.size() != slots * size_t(idx.max_cols))
    return bad("sparse index: column_index has " + std::to_string(idx.column_index.size()) +
               " entries, want n_heads * n_qblocks * max_cols = " +
               std::to_string(slots * size_t(idx.max_cols)));
  for (int h = 0; h < idx.n_heads; ++h) {
    for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) {
      const size_t s = idx.slot(h, qb);
      const SparseSlotGeometry g = sparse_slot_geometry(idx.n_q, idx.n_k, idx.q_offset, qb);
      const int32_t bc = idx.block_count[s], cc = idx.column_count[s];
      if (bc < 0 || bc > idx.max_blocks)
        return bad(where(h, qb) + "block_count " + std::to_string(bc) +
                   " outside [0, max_blocks = " + std::to_string(idx.max_blocks) + "]");
      if (cc < 0 || cc > idx.max_cols)
        return bad(where(h, qb) + "column_count " + std::to_string(cc) +
                   " outside [0, max_cols = " + std::to_string(idx.max_cols) + "]");
      const int32_t* bo = idx.block_offset.data() + s * size_t(idx.max_blocks);
      const int32_t* ci = idx.column_index.data() + s * size_t(idx.max_cols);
      for (int32_t i = 0; i < bc; ++i) {
        if (bo[i] < 0 || bo[i] >= g.kend)
          return bad(where(h, qb) + "block_offset[" + std::to_string(i) +
                     "] = " + std::to_string(bo[i]) + " outside the causal keys [0, " +
                     std::to_string(g.kend) + ")");
        if (i > 0 && int64_t(bo[i]) < int64_t(bo[i - 1]) + kB)
          return bad(where(h, qb) + "block_offset[" + std::to_string(i) +
                     "] = " + std::to_string(bo[i]) + " is unsorted or overlaps block_offset[" +
                     std::to_string(i - 1) + "] = " + std::to_string(bo[i - 1]) +
                     " (entries cover 64 keys)");
      }
      int32_t bi = 0;
      for (int32_t i = 0; i < cc; ++i) {
        if (ci[i] < 0 || ci[i] >= g.kend)
          return bad(where(h, qb) + "column_index[" + std::to_string(i) +
                     "] = " + std::to_string(ci[i]) + " outside the causal keys [0, " +
                     std::to_string(g.kend) + ")");
        if (i > 0 && ci[i] <= ci[i - 1])
          return bad(where(h, qb) + "column_index[" + std::to_string(i) + "] = " +
                     std::to_string(ci[i]) + " is not above column_index[" + std::to_string(i - 1) +
                     "] = " + std::to_string(ci[i - 1]) + " (sorted, unique)");
        while (bi < bc && int64_t(bo[bi]) + kB <= ci[i]) ++bi;
        if (bi < bc && bo[bi] <= ci[i])
          return bad(where(h, qb) + "column_index[" + std::to_string(i) +
                     "] = " + std::to_string(ci[i]) + " lies inside block_offset[" +
                     std::to_string(bi) + "] = " + std::to_string(bo[bi]));
      }
      // Coverage of [x, y) by the (disjoint, sorted) blocks and columns.
      auto first_gap = [&](int64_t x, int64_t y) -> int64_t {
        int64_t pos = x;
        int32_t i = 0, j = 0;
        while (pos < y) {
          while (i < bc && std::min<int64_t>(int64_t(bo[i]) + kB, g.kend) <= pos) ++i;
          while (j < cc && ci[j] < pos) ++j;
          if (i < bc && bo[i] <= pos)
            pos = std::min<int64_t>(int64_t(bo[i]) + kB, g.kend);
          else if (j < cc && ci[j] == pos)
            pos = pos + 1;
          else
            return pos;
        }
        return -1;
      };
      const int64_t se = std::min(std::max<int64_t>(sink, 0), g.kend);
      if (const int64_t gap = first_gap(0, se); gap >= 0)
        return bad(where(h, qb) + "sink: key " + std::to_string(gap) + " of [0, " +
                   std::to_string(se) + ") is in neither block_offset nor column_index");
      if (const int64_t gap = first_gap(std::min(g.base, g.kend), g.kend); gap >= 0)
        return bad(where(h, qb) + "local: diagonal key " + std::to_string(gap) + " of [" +
                   std::to_string(std::min(g.base, g.kend)) + ", " + std::to_string(g.kend) +
                   ") is in neither block_offset nor column_index");
    }
  }
  return Status::ok();
}

}  // namespace sf::kernels
