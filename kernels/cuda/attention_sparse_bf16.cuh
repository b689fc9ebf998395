// Sparse causal attention over the unified index, bf16 inputs and output, fp32 accumulation and
// softmax, on tensor cores (mma.sync m16n8k16, FlashAttention-2's register layout). Same contract
// as attention_sparse.cuh (the fp32 kernel, which stays the reference): GQA-native, one online
// softmax across block entries and gathered columns, per-row causal mask as the CPU kernel, LSE
// in fp32 (natural log).
//
// Work split. A CTA owns one (head, 64-query block) slot; 4 warps, warp w owns rows 16w..16w+15
// and keeps their Q fragments in registers (loaded once from global). The key list is walked in
// tiles of 64 positions (a block entry clipped to the CTA's causal limit, or 64 gathered
// columns); K/V rows of the tile are staged in shared memory by position with cp.async, two
// stages deep (rows padded by 16 bytes so ldmatrix phases are conflict-free), so both kinds of
// tile share one mainloop:
// S = Q K^T (8 key n-tiles x D/16 k-steps), mask, online softmax in registers (scores in log2
// units, ex2.approx), P (re-packed to bf16 A fragments) x V via ldmatrix.trans.
// This is the second mainloop now: attention_sparse_bf16_sm90.cuh (wgmma) is the default and
// shares this file's tile walk, softmax_tile, rescale_o, p_fragment and store_rows.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sf::kernels::cuda {

struct AttentionSparseBf16Params {
  const __nv_bfloat16* q;  // [n_q, n_heads, D]
  const __nv_bfloat16* k;  // [n_k, n_kv_heads, D]
  const __nv_bfloat16* v;  // [n_k, n_kv_heads, D]
  __nv_bfloat16* out;      // [n_q, n_heads, D]
  float* lse;              // [n_heads, n_q], natural log, -inf for rows that see no selected key
  int64_t n_q, n_k;
  int n_heads, n_kv_heads;
  float scale;
  int64_t q_offset;
  const int32_t* block_count;
  const int32_t* block_offset;
  const int32_t* column_count;
  const int32_t* column_index;
  int64_t n_qblocks;
  int max_blocks, max_cols;
  int pair_heads;  // SparseIndexDevice::pair_heads
  // K and V as TMA tensor maps (dims D, n_kv_heads, n_k; 64 x 1 x 64 boxes, 128-byte swizzle),
  // filled by the launcher for the wgmma mainloop, which loads block tiles through them.
  CUtensorMap tm_k, tm_v;
};

namespace attention_sparse_bf16_detail {

constexpr int kQBlock = 64;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 64;  // keys per tile
constexpr int kPad = 8;    // bf16 elements of row padding (16 bytes)
constexpr float kLog2e = 1.4426950408889634f;

// Two stages: tile t + 1 is copied (cp.async) while tile t is computed. D=128: 69 KB, dynamic
// shared memory (opt-in above 48 KB); 190 registers per thread allow 2 CTAs per SM anyway.
template <int D>
struct Stage {
  __nv_bfloat16 k[kTile][D + kPad];
  __nv_bfloat16 v[kTile][D + kPad];
  int32_t pos[kTile];  // key position of tile row j, -1 when empty (the index is int32)
};
template <int D>
struct Smem {
  Stage<D> stage[2];
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&p);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A generic pointer to shared memory as a shared-space address (PTX operands).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = smem_u32(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = smem_u32(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// To a shared-space address (cvta'd once by the caller).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int n = valid ? 16 : 0;  // src-size 0: the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(n));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(smem_u32(smem), gmem, valid);
}
// 2^x on the SFU, flushing denormals (what exp2f compiles to under --use_fast_math): the
// probabilities it makes are rounded to bf16 next, and exp2(-inf) is still 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The slot's key list as a sequence of 64-position tiles: first one tile per block entry that
// starts below the CTA's causal limit (clipped to it), then the gathered columns below the limit
// in chunks of 64. Both lists are sorted ascending, so the limits are binary searches.
struct TileList {
  const int32_t* bo;
  const int32_t* ci;
  int n_block_tiles, n_cols;
  int64_t cta_end;

  __device__ __forceinline__ int count() const {
    return n_block_tiles + (n_cols + kTile - 1) / kTile;
  }
  __device__ __forceinline__ int64_t pos(int t, int j) const {
    if (t < n_block_tiles) {
      const int64_t k0 = bo[t];
      const int64_t k1 = k0 + kTile < cta_end ? k0 + kTile : cta_end;
      return k0 + j < k1 ? k0 + j : -1;
    }
    const int c = (t - n_block_tiles) * kTile + j;
    return c < n_cols ? int64_t(ci[c]) : -1;
  }
};

__device__ __forceinline__ int lower_bound_i32(const int32_t* a, int n, int64_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (int64_t(a[mid]) < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Issues the copies of tile t into `st` (one commit group). Empty rows are zero-filled so that
// 0-probability columns multiply zeros, never garbage (0 * NaN).
template <int D>
__device__ __forceinline__ void issue_tile(const AttentionSparseBf16Params& p, const TileList& tl,
                                           int t, Stage<D>& st, int kv_head) {
  if (threadIdx.x < kTile) st.pos[threadIdx.x] = int32_t(tl.pos(t, int(threadIdx.x)));
  constexpr int kVec = D / 8;  // 16-byte chunks per row
  for (int e = threadIdx.x; e < kTile * kVec; e += kThreads) {
    const int j = e / kVec, c = e % kVec;
    const int64_t pos = tl.pos(t, j);
    const int64_t off = pos >= 0 ? (pos * p.n_kv_heads + kv_head) * D + c * 8 : 0;
    cp_async_16(&st.k[j][c * 8], p.k + off, pos >= 0);
    cp_async_16(&st.v[j][c * 8], p.v + off, pos >= 0);
  }
  cp_async_commit();
}

// Per-thread softmax and output state of the two rows a lane owns (g and g + 8 of its warp's 16),
// in the m16n8 accumulator layout. Shared by both mainloops: wgmma's m64nN accumulator gives
// warp w of the warpgroup rows 16w..16w+15 in the same per-warp layout.
template <int D>
struct RowState {
  float o[D / 8][4];  // O accumulator per 8-dim n-tile
  float m[2], l[2];   // rows g and g + 8: running max (log2 units), lane-partial sum
  int64_t lim[2];     // keys < lim visible to the row (0: no row)
};

template <int D>
__device__ __forceinline__ void row_state_init(const AttentionSparseBf16Params& p, int warp, int g,
                                               int64_t rows, int64_t base, RowState<D>& st) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = warp * 16 + g + 8 * r;  // row within the slot
    const int64_t lim = base + i + 1 < p.n_k ? base + i + 1 : p.n_k;
    st.lim[r] = i < rows ? lim : 0;
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
  }
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) st.o[dt][0] = st.o[dt][1] = st.o[dt][2] = st.o[dt][3] = 0.f;
}

// One online-softmax step over a 64-key tile of raw scores s (m16n8 accumulator layout: lane holds
// rows g (e = 0, 1) and g + 8 (e = 2, 3), keys nt*8 + 2*tq + (e & 1)). pos (the tile's key
// positions, -1 empty) masks per row; nullptr means every key of the tile is visible to every
// row. Leaves unnormalised probabilities in s, updates m and l, and returns in alpha the factor
// the O accumulator must be scaled by (rescale_o) before this tile's P V is added. O is not
// touched here, so a P V of the previous tile may still be in flight.
template <int D>
__device__ __forceinline__ void softmax_tile(float (&s)[kTile / 8][4], const int32_t* pos,
                                             float scale_log2, int tq, RowState<D>& st,
                                             float (&alpha)[2]) {
  if (pos) {
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t kp = pos[nt * 8 + 2 * tq + (e & 1)];
        if (!(kp >= 0 && kp < st.lim[e >> 1])) s[nt][e] = -INFINITY;
      }
  }
  // Max of the raw scores (scale > 0 commutes with max), then p = 2^(s * scale - m) in one FFMA.
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(st.m[r], mx[r] * scale_log2);
    // A row with nothing visible yet keeps m = -inf: alpha 1, probabilities 0.
    alpha[r] = m_new == -INFINITY ? 1.f : fast_exp2(st.m[r] - m_new);
    st.m[r] = m_new;
  }
  // exp2(-inf - m) is 0 for finite m; a row still at m = -inf subtracts 0 instead.
  const float msub[2] = {st.m[0] == -INFINITY ? 0.f : st.m[0],
                         st.m[1] == -INFINITY ? 0.f : st.m[1]};
  float rs[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pr = fast_exp2(fmaf(s[nt][e], scale_log2, -msub[e >> 1]));
      s[nt][e] = pr;
      rs[e >> 1] += pr;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = st.l[r] * alpha[r] + rs[r];
}

// Skipped when no row of the warp changed its max (alpha 1 throughout): the usual case once a
// row has seen its largest scores.
template <int D>
__device__ __forceinline__ void rescale_o(const float (&alpha)[2], RowState<D>& st) {
  if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    st.o[dt][0] *= alpha[0];
    st.o[dt][1] *= alpha[0];
    st.o[dt][2] *= alpha[1];
    st.o[dt][3] *= alpha[1];
  }
}

// P's C fragments of n-tiles 2kk, 2kk + 1 as the bf16 A fragment of key k-step kk (the same
// register layout for mma.sync m16n8k16 and for wgmma's register-A operand).
__device__ __forceinline__ void p_fragment(const float (&s)[kTile / 8][4], int kk,
                                           uint32_t (&a)[4]) {
  a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Normalises and writes the lane's two rows of out (bf16) and their LSE.
template <int D>
__device__ __forceinline__ void store_rows(const AttentionSparseBf16Params& p, int h, int64_t r0,
                                           int64_t rows, int warp, int g, int tq,
                                           const RowState<D>& st) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int i = warp * 16 + g + 8 * r;
    if (i >= rows) continue;
    const int64_t t = r0 + i;
    const bool any = l > 0.f;
    const float inv = any ? 1.f / l : 0.f;
    __nv_bfloat16* o = p.out + (t * p.n_heads + h) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(o + dt * 8 + 2 * tq) =
          pack_bf16(st.o[dt][2 * r] * inv, st.o[dt][2 * r + 1] * inv);
    if (tq == 0) p.lse[int64_t(h) * p.n_q + t] = any ? (st.m[r] + log2f(l)) / kLog2e : -INFINITY;
  }
}

template <int D>
__device__ __forceinline__ void mainloop_tile(float scale_log2, const Stage<D>& sm, int lane,
                                              const uint32_t (&qa)[D / 16][4], RowState<D>& st) {
  const int tq = lane % 4;
  // S = Q K^T: 8 n-tiles of 8 keys. ldmatrix x4 (non-trans) over K rows gives the B fragments of
  // two consecutive k-steps: matrices (key rows nt*8.., dims ks*16 + 0/8, (ks+1)*16 + 0/8).
  float s[kTile / 8][4];
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks += 2) {
      uint32_t b[4];
      const int mi = lane / 8;
      ldmatrix_x4(b, &sm.k[nt * 8 + lane % 8][ks * 16 + mi * 8]);
      mma_bf16(s[nt], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b[0], b[1]);
      mma_bf16(s[nt], qa[ks + 1][0], qa[ks + 1][1], qa[ks + 1][2], qa[ks + 1][3], b[2], b[3]);
    }
  }
  float alpha[2];
  softmax_tile<D>(s, sm.pos, scale_log2, tq, st, alpha);
  rescale_o<D>(alpha, st);
  // O += P V. ldmatrix x4 trans over V rows gives B fragments of two consecutive 8-dim n-tiles:
  // matrices (key rows kk*16 + 0/8, dims dt*8), (.., (dt+1)*8).
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    uint32_t a[4];
    p_fragment(s, kk, a);
#pragma unroll
    for (int dt = 0; dt < D / 8; dt += 2) {
      uint32_t b[4];
      const int mi = lane / 8;
      ldmatrix_x4_trans(b, &sm.v[kk * 16 + (mi & 1) * 8 + lane % 8][(dt + (mi >> 1)) * 8]);
      mma_bf16(st.o[dt], a[0], a[1], a[2], a[3], b[0], b[1]);
      mma_bf16(st.o[dt + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
    }
  }
}

// The CTA's slot geometry and its key list.
struct SlotGeom {
  int64_t qb, r0, rows, base, cta_end;
};
__device__ __forceinline__ SlotGeom slot_geom(const AttentionSparseBf16Params& p) {
  SlotGeom sg;
  sg.qb = p.n_qblocks - 1 - int64_t(blockIdx.x);  // later query blocks first
  sg.r0 = sg.qb * kQBlock;
  sg.rows = p.n_q - sg.r0 < kQBlock ? p.n_q - sg.r0 : kQBlock;
  sg.base = p.q_offset + sg.r0;
  sg.cta_end = sg.base + sg.rows < p.n_k ? sg.base + sg.rows : p.n_k;
  return sg;
}
__device__ __forceinline__ TileList slot_tiles(const AttentionSparseBf16Params& p, int h,
                                               const SlotGeom& sg) {
  const int64_t slot = int64_t(h) * p.n_qblocks + sg.qb;
  TileList tl;
  tl.bo = p.block_offset + slot * p.max_blocks;
  tl.ci = p.column_index + slot * p.max_cols;
  tl.cta_end = sg.cta_end;
  tl.n_block_tiles = lower_bound_i32(tl.bo, p.block_count[slot], sg.cta_end);
  tl.n_cols = lower_bound_i32(tl.ci, p.column_count[slot], sg.cta_end);
  return tl;
}

// Q A-fragments straight from global, for the lane's rows of its warp: registers a0..a3 =
// (row g, k 2tq), (row g+8, k 2tq), (row g, k 2tq+8), (row g+8, k 2tq+8) of each 16-wide k-step
// (mma.sync m16n8k16 and wgmma's register-A layout alike). Rows past the slot's end are zero.
template <int D>
__device__ __forceinline__ void load_q_fragments(const AttentionSparseBf16Params& p, int h,
                                                 const SlotGeom& sg, int warp, int g, int tq,
                                                 uint32_t (&qa)[D / 16][4]) {
  const int i0 = warp * 16 + g, i1 = i0 + 8;
  const uint32_t* q0 =
      i0 < sg.rows ? reinterpret_cast<const uint32_t*>(p.q + ((sg.r0 + i0) * p.n_heads + h) * D)
                   : nullptr;
  const uint32_t* q1 =
      i1 < sg.rows ? reinterpret_cast<const uint32_t*>(p.q + ((sg.r0 + i1) * p.n_heads + h) * D)
                   : nullptr;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int w0 = (ks * 16 + 2 * tq) / 2, w1 = w0 + 4;  // 32-bit word index (2 bf16)
    qa[ks][0] = q0 ? q0[w0] : 0u;
    qa[ks][1] = q1 ? q1[w0] : 0u;
    qa[ks][2] = q0 ? q0[w1] : 0u;
    qa[ks][3] = q1 ? q1[w1] : 0u;
  }
}

template <int D>
__device__ __forceinline__ void attention_sparse_bf16_block(const AttentionSparseBf16Params& p) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem<D>& sm = *reinterpret_cast<Smem<D>*>(smem_raw);
  const int h = blockIdx.y;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const SlotGeom sg = slot_geom(p);

  RowState<D> st;
  row_state_init<D>(p, warp, g, sg.rows, sg.base, st);
  uint32_t qa[D / 16][4];
  load_q_fragments<D>(p, h, sg, warp, g, tq, qa);
  const float scale_log2 = p.scale * kLog2e;
  const TileList tl = slot_tiles(p, h, sg);
  const int n_tiles = tl.count();
  if (n_tiles > 0) issue_tile(p, tl, 0, sm.stage[0], kv_head);
  for (int t = 0; t < n_tiles; ++t) {
    // Stage (t + 1) & 1 was last read by tile t - 1, which every warp finished (barrier below).
    if (t + 1 < n_tiles) {
      issue_tile(p, tl, t + 1, sm.stage[(t + 1) & 1], kv_head);
      cp_async_wait<1>();  // tile t landed; t + 1 may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies (and pos stores) of tile t are visible
    mainloop_tile<D>(scale_log2, sm.stage[t & 1], lane, qa, st);
    __syncthreads();  // stage t & 1 consumed before tile t + 2 overwrites it
  }
  store_rows<D>(p, h, sg.r0, sg.rows, warp, g, tq, st);
}

}  // namespace attention_sparse_bf16_detail

template <int D>
__global__ void __launch_bounds__(attention_sparse_bf16_detail::kThreads)
    attention_sparse_bf16_kernel(const AttentionSparseBf16Params p) {
  attention_sparse_bf16_detail::attention_sparse_bf16_block<D>(p);
}

}  // namespace sf::kernels::cuda
