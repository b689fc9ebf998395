// The bf16 sparse attention kernel on Hopper's warpgroup MMA (wgmma, sm_90a), and the launcher
// that picks between it and the mma.sync kernel of attention_sparse_bf16.cuh. Same contract and
// the same index walk (TileList), online softmax (softmax_tile) and epilogue (store_rows) as that
// kernel; only the tile products differ.
//
// Work split. A CTA is one warpgroup (4 warps, 128 threads) and owns one (head, 64-query block)
// slot, as before. Q stays in registers as wgmma's A operand (the mma.sync A-fragment layout).
// Each 64-key tile of K and V lives in shared memory in the layout wgmma reads: rows of 128
// bytes (64 bf16), D/64 column blocks of 64 rows, each 16-byte chunk c of row r stored at chunk
// c ^ (r & 7) (the 128-byte swizzle, 1024-byte aligned atoms). Per tile:
//   S  = Q K^T: D/16 wgmma m64n64k16, Q from registers, K from shared memory K-major (as stored);
//   softmax on the accumulator registers (warp w holds rows 16w..16w+15 in the m16n8 layout);
//   O += P V: 4 wgmma m64nDk16, P from registers (the accumulator repacked to bf16, no shuffle),
//   V from shared memory MN-major (as stored, transposed by the instruction).
// Tile t's softmax overlaps P(t-1) V(t-1) on the tensor cores (see the schedule below). K/V
// tiles are copied by all 128 threads with cp.async, three stages deep, two tiles ahead; the 2
// CTAs that fit per SM (97 KB each at D = 128) overlap one's softmax with the other's MMAs.
// Tiles whose keys every row sees (all at or below the slot's first row, none empty) skip the
// mask.
// Not yet: TMA, a producer warp, ping-pong between warpgroups (FlashAttention-3).
#pragma once
#include <atomic>

#include "kernels/cuda/attention_sparse_bf16.cuh"
#include "kernels/cuda/cuda_ops.h"  // SparseBf16Mainloop
#include "kernels/cuda/smem_opt_in.h"

namespace sf::kernels::cuda {

namespace attention_sparse_bf16_sm90_detail {
using namespace attention_sparse_bf16_detail;

// One 64-row operand tile in the 128-byte-swizzled layout: [column block][row][64 elements].
template <int D>
struct SwTile {
  __nv_bfloat16 e[D / 64][kTile][64];
};
constexpr int kStages = 3;  // K and V each: copies run two tiles ahead of the products
template <int D>
struct Smem90 {
  SwTile<D> k[kStages], v[kStages];
  int32_t pos[kStages][kTile];  // per K stage: key position of tile row j, -1 when empty
  int32_t masked[kStages];      // per K stage: 1 when some key of the tile is hidden from some row
};
constexpr uint32_t kSwAlign = 1024;  // a swizzle atom (8 rows x 128 bytes)

// Element offset of 16-byte chunk c (8 elements, c < D/8) of row r.
__device__ __forceinline__ int sw_offset(int r, int c) {
  return (c >> 3) * (kTile * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (all >> 4), layout type 1 in bits 62-63. Atoms are 1024-aligned: base offset 0.
__device__ __forceinline__ uint64_t sw128_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes (cp.async) made visible to the async proxy (wgmma's operand reads).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins accumulator registers at this point: the compiler may not move their reads or writes
// across an in-flight wgmma (which it cannot see) to this side of the fence.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// d += A B on the warpgroup. _ss: A and B from shared-memory descriptors, both K-major;
// _rs: A from registers (this thread's m16n8k16 A fragment of its warp's 16 rows), B K-major
// (TransB 0) or MN-major (TransB 1). scale-d is 1: d accumulates.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t desc_a,
                                                   uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "n"(1));
}

template <int TransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4],
                                                   uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1), "n"(TransB));
}

template <int TransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4],
                                                    uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]),
        "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]),
        "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1), "n"(TransB));
}

template <int D>
__device__ __forceinline__ void wgmma_pv(float (&o)[D / 8][4], const uint32_t (&a)[4],
                                         uint64_t desc_v) {
  if constexpr (D == 128)
    wgmma_m64n128k16_rs<1>(o, a, desc_v);
  else
    wgmma_m64n64k16_rs<1>(o, a, desc_v);
}

// Whether some row of the slot must not see some position of tile t: an empty position, or a
// key past the slot's first row (base).
__device__ __forceinline__ int tile_needs_mask(const TileList& tl, int t, int64_t base) {
  if (t < tl.n_block_tiles) {
    const int64_t k0 = tl.bo[t];
    return k0 + kTile > tl.cta_end || k0 + kTile - 1 > base;
  }
  const int last = (t - tl.n_block_tiles) * kTile + kTile - 1;
  return last >= tl.n_cols || int64_t(tl.ci[last]) > base;
}

// What one thread of NT copies, fixed for the CTA: 16-byte chunk c of rows j0 + i * kRowsPer,
// i < kIter, of every K and V tile. Since kRowsPer is a multiple of 8, j & 7 == j0 & 7: the
// chunk's swizzled place moves by a constant kRowsPer rows per i.
template <int D, int NT = kThreads>
struct CopyPlan {
  static constexpr int kVec = D / 8, kRowsPer = NT / kVec, kIter = kTile / kRowsPer;
  static_assert(kRowsPer % 8 == 0, "rows per pass must keep j & 7 fixed");
  int j0;
  uint32_t k_sa, v_sa;                 // shared address of (row j0, chunk c) in stage 0
  const __nv_bfloat16 *k_src, *v_src;  // chunk c of kv_head's row 0
  int64_t row_stride;                  // elements between key rows

  // k0, v0: stage 0 of the K and V tile arrays.
  __device__ __forceinline__ CopyPlan(const AttentionSparseBf16Params& p, const SwTile<D>& k0,
                                      const SwTile<D>& v0, int kv_head) {
    const int c = threadIdx.x % kVec;
    j0 = threadIdx.x / kVec;
    const int so = sw_offset(j0, c) * int(sizeof(__nv_bfloat16));
    k_sa = static_cast<uint32_t>(__cvta_generic_to_shared(&k0)) + so;
    v_sa = static_cast<uint32_t>(__cvta_generic_to_shared(&v0)) + so;
    k_src = p.k + int64_t(kv_head) * D + c * 8;
    v_src = p.v + int64_t(kv_head) * D + c * 8;
    row_stride = int64_t(p.n_kv_heads) * D;
  }
};

// One commit group: the V rows of tile tv (when 0 <= tv < n_tiles) into V stage vb, and the K
// rows of tile tk (when tk < n_tiles) into K stage kb with their positions (written by the
// chunk-0 threads, for the softmax mask) and mask flag. A thread copies the same rows of every
// tile, so the positions of V(tv) are the ones it looked up for K(tv) in its previous call: they
// stay in pend, which then takes K(tk)'s. Empty rows are zero-filled, so masked keys multiply
// zeros.
// The thread's rows of a K or V tile (positions pos, -1 empty) into stage b of the array at sa0.
template <int D, int NT>
__device__ __forceinline__ void copy_rows(const CopyPlan<D, NT>& cp, uint32_t sa0,
                                          const __nv_bfloat16* src, int b,
                                          const int32_t (&pos)[CopyPlan<D, NT>::kIter]) {
  constexpr uint32_t kStepBytes = CopyPlan<D, NT>::kRowsPer * 64 * sizeof(__nv_bfloat16);
  constexpr uint32_t kStageBytes = sizeof(SwTile<D>);  // stage b at + b * kStageBytes
#pragma unroll
  for (int i = 0; i < CopyPlan<D, NT>::kIter; ++i)
    cp_async_16(sa0 + b * kStageBytes + i * kStepBytes,
                src + int64_t(max(pos[i], 0)) * cp.row_stride, pos[i] >= 0);
}

template <int D>
__device__ __forceinline__ void issue_kv(const TileList& tl, const CopyPlan<D>& cp, int n_tiles,
                                         int tk, int kb, int tv, int vb, int64_t base,
                                         Smem90<D>& sm, int32_t (&pend)[CopyPlan<D>::kIter]) {
  using Plan = CopyPlan<D>;
  if (tv >= 0 && tv < n_tiles) copy_rows(cp, cp.v_sa, cp.v_src, vb, pend);
  if (tk < n_tiles) {
    if (tk < tl.n_block_tiles) {  // a key block: consecutive positions, clipped causally
      const int64_t k0 = tl.bo[tk];
      const int64_t k1 = k0 + kTile < tl.cta_end ? k0 + kTile : tl.cta_end;
#pragma unroll
      for (int i = 0; i < Plan::kIter; ++i) {
        const int64_t kp = k0 + cp.j0 + i * Plan::kRowsPer;
        pend[i] = kp < k1 ? int32_t(kp) : -1;
      }
    } else {  // gathered columns
      const int c0 = (tk - tl.n_block_tiles) * kTile + cp.j0;
#pragma unroll
      for (int i = 0; i < Plan::kIter; ++i) {
        const int ci = c0 + i * Plan::kRowsPer;
        pend[i] = ci < tl.n_cols ? tl.ci[ci] : -1;
      }
    }
    if (threadIdx.x % Plan::kVec == 0) {
#pragma unroll
      for (int i = 0; i < Plan::kIter; ++i) sm.pos[kb][cp.j0 + i * Plan::kRowsPer] = pend[i];
    }
    if (threadIdx.x == 0) sm.masked[kb] = tile_needs_mask(tl, tk, base);
    copy_rows(cp, cp.k_sa, cp.k_src, kb, pend);
  }
  cp_async_commit();
}

// S = Q K^T of K tile kt, issued (not waited for). Q from registers (qa: the A
// fragments of the thread's warp rows, one per 16-wide k-step); K K-major: 8-row groups 1024
// bytes apart (SBO), the leading offset unused with swizzling (16); a k-step of 16 moves 32 bytes
// within a 128-byte row, 4 steps per column block, column blocks kTile * 128 bytes apart.
template <int D>
__device__ __forceinline__ void issue_s(float (&s)[kTile / 8][4], const uint32_t (&qa)[D / 16][4],
                                        const SwTile<D>& kt) {
  const uint64_t desc_k = sw128_desc(&kt, 16, 1024);
#pragma unroll
  for (int nt = 0; nt < kTile / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  fence_regs(s);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint64_t step = uint64_t(((ks >> 2) * (kTile * 128) + (ks & 3) * 32) >> 4);
    wgmma_m64n64k16_rs<0>(s, qa[ks], desc_k + step);
  }
  wgmma_commit();
  fence_regs(s);
}

// O += P V with V tile vt, issued (not waited for). V MN-major: 64-dim column blocks
// kTile * 128 bytes apart (LBO), 8-key groups 1024 bytes apart (SBO); a k-step of 16 keys moves
// 2048 bytes.
template <int D>
__device__ __forceinline__ void issue_pv(RowState<D>& st, const uint32_t (&pa)[kTile / 16][4],
                                         const SwTile<D>& vt) {
  const uint64_t desc_v = sw128_desc(&vt, kTile * 128, 1024);
  fence_regs(st.o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk)
    wgmma_pv<D>(st.o, pa[kk], desc_v + uint64_t((kk * 16 * 128) >> 4));
  wgmma_commit();
  fence_regs(st.o);
}

// Schedule (FlashAttention-3's intra-warpgroup overlap): iteration t issues S(t) = Q K(t)^T and
// O += P(t-1) V(t-1) back to back, then the copies of K(t+2) and V(t+1), then runs tile t's
// softmax while P(t-1) V(t-1) is still on the tensor cores; O is rescaled once that product
// lands. V(j) is copied together with K(j+1), so the group iteration t waits for (K(t), V(t-1))
// was issued two iterations earlier, with one more in flight behind it. Three stages of K and of
// V (96 KB at D = 128): the stage a copy overwrites was last read an iteration before.
template <int D>
__device__ __forceinline__ void attention_sparse_bf16_sm90_block(
    const AttentionSparseBf16Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D == 64 || D == 128, "wgmma mainloop: head_dim 64 or 128");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  Smem90<D>& sm = *reinterpret_cast<Smem90<D>*>(
      smem_raw + ((kSwAlign - (sa & (kSwAlign - 1))) & (kSwAlign - 1)));
  const int h = blockIdx.y;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const SlotGeom sg = slot_geom(p);
  RowState<D> st;
  row_state_init<D>(p, warp, g, sg.rows, sg.base, st);
  const float scale_log2 = p.scale * kLog2e;
  const TileList tl = slot_tiles(p, h, sg);
  const int n_tiles = tl.count();
  if (n_tiles > 0) {
    const CopyPlan<D> cp(p, sm.k[0], sm.v[0], kv_head);
    int32_t pend[CopyPlan<D>::kIter];
    issue_kv<D>(tl, cp, n_tiles, 0, 0, -1, 0, sg.base, sm, pend);  // K(0)
    // Q stays in registers (wgmma's A operand) for the whole slot; rows past the slot's end are
    // zero (their results are never stored).
    uint32_t qa[D / 16][4];
    load_q_fragments<D>(p, h, sg, warp, g, tq, qa);
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // K(0) and its positions, for every thread
    issue_kv<D>(tl, cp, n_tiles, 1, 1, 0, 0, sg.base, sm, pend);  // V(0), K(1)

    float s[kTile / 8][4];
    uint32_t pa[kTile / 16][4];
    float alpha[2];
    issue_s<D>(s, qa, sm.k[0]);
    issue_kv<D>(tl, cp, n_tiles, 2, 2, 1, 1, sg.base, sm, pend);  // V(1), K(2)
    wgmma_wait<0>();
    fence_regs(s);
    softmax_tile<D>(s, sm.masked[0] ? sm.pos[0] : nullptr, scale_log2, tq, st, alpha);
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) p_fragment(s, kk, pa[kk]);

    // Stages of K(t) (= V(t)'s), of K(t+2) / V(t-1), and of V(t+1), rotated each iteration.
    int b0 = 1, b2 = 0, b1 = 2;
    for (int t = 1; t < n_tiles; ++t) {
      // K(t) and V(t-1) landed, for every thread; every warp is past iteration t - 1, whose
      // products (reading K stage b2 and V stage b2's predecessor) completed there.
      cp_async_wait<1>();
      fence_proxy_async();
      __syncthreads();
      issue_s<D>(s, qa, sm.k[b0]);
      issue_pv<D>(st, pa, sm.v[b2]);
      // V(t+1) into the stage V(t-2) used, K(t+2) into the one K(t-1) used.
      issue_kv<D>(tl, cp, n_tiles, t + 2, b2, t + 1, b1, sg.base, sm, pend);
      wgmma_wait<1>();  // S(t) done; P(t-1) V(t-1) may still run
      fence_regs(s);
      softmax_tile<D>(s, sm.masked[b0] ? sm.pos[b0] : nullptr, scale_log2, tq, st, alpha);
      wgmma_wait<0>();
      fence_regs(st.o);
      rescale_o<D>(alpha, st);
      // pa is an operand of the product that just landed: rewritten only now.
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) p_fragment(s, kk, pa[kk]);
      const int nb = b2;  // (b0, b1, b2) <- (b1, b2, b0): t+1's K stage is b1
      b2 = b0;
      b0 = b1;
      b1 = nb;
    }
    // The last tile's P V (stage b2 now holds V(n_tiles - 1)).
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    issue_pv<D>(st, pa, sm.v[b2]);
    wgmma_wait<0>();
    fence_regs(st.o);
  }
  store_rows<D>(p, h, sg.r0, sg.rows, warp, g, tq, st);
#else
  __trap();  // built without sm_90a: the launcher never selects this kernel there
#endif
}


// ---- Query-block pairs: one K/V tile read for 128 rows --------------------------------------------
// The single-slot kernel reads every tile from L2 for 64 rows: at 128K block-sparse that is about
// 32 KB per 2.1 MFLOP, which is what bounds it (FlashAttention-3 reads a tile once for 128 rows).
// Here a CTA is two warpgroups and owns two neighbouring query blocks of one head (warpgroup w:
// query block 2j + w). Their block lists overlap heavily: slash diagonals of block 2j + 1 are
// those of block 2j moved by 64 keys, and block-sparse picks and sinks repeat. The CTA walks the
// merge of the two sorted block lists, loading an offset both lists hold once, then each slot's
// own column tiles. A tile carries an owner mask; a warpgroup computes only the tiles it owns,
// so no product is spent on keys a slot did not select. The warpgroups run in lockstep (one
// barrier per tile); a warpgroup that skips a tile still lands its previous P V.
constexpr int kPairThreads = 2 * kThreads;
constexpr int kPairStages = 4;  // copies run three tiles ahead (one CTA per SM at D = 128)
template <int D>
struct SmemPair {
  SwTile<D> k[kPairStages], v[kPairStages];
  int32_t pos[kPairStages][kTile];  // per K stage: key position of tile row j, -1 when empty
  int32_t own[kPairStages];         // per K stage: bit w set when slot w computes the tile
  int32_t masked[kPairStages][2];   // per K stage and slot: some key hidden from some row
};

// The pair's tile sequence: the union of both slots' block entries in ascending offset, then
// slot 0's column tiles, then slot 1's.
struct PairTiles {
  TileList tl[2];
  int64_t base[2];
  int64_t end;  // the later slot's causal limit: block tiles are clipped to it
  int n_union, n_ct0;
  __device__ __forceinline__ int count() const {
    return n_union + n_ct0 + (tl[1].n_cols + kTile - 1) / kTile;
  }
};

// Walks the merge of the two block lists; every thread runs its own copy in the same order.
// The next offset of each list is held in a register (INT64_MAX past the end).
struct PairCursor {
  int i[2];
  int64_t o[2];
  __device__ __forceinline__ explicit PairCursor(const PairTiles& pt) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      i[w] = 0;
      o[w] = pt.tl[w].n_block_tiles > 0 ? int64_t(pt.tl[w].bo[0]) : INT64_MAX;
    }
  }
  // The next union offset and its owner mask.
  __device__ __forceinline__ int64_t next(const PairTiles& pt, int& own) {
    const int64_t k0 = o[0] < o[1] ? o[0] : o[1];
    own = 0;
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      if (o[w] != k0) continue;
      own |= 1 << w;
      ++i[w];
      o[w] = i[w] < pt.tl[w].n_block_tiles ? int64_t(pt.tl[w].bo[i[w]]) : INT64_MAX;
    }
    return k0;
  }
};

// Offsets both lists hold, counted by all threads of the CTA (a binary search per entry of
// slot 0's list); the result is the same in every thread.
__device__ __forceinline__ int pair_common_blocks(const PairTiles& pt) {
  const int n0 = pt.tl[0].n_block_tiles, n1 = pt.tl[1].n_block_tiles;
  int common = 0;
  for (int i0 = 0; i0 < n0; i0 += kPairThreads) {
    const int i = i0 + int(threadIdx.x);
    bool hit = false;
    if (i < n0 && n1 > 0) {
      const int32_t x = pt.tl[0].bo[i];
      const int j = lower_bound_i32(pt.tl[1].bo, n1, x);
      hit = j < n1 && pt.tl[1].bo[j] == x;
    }
    common += __syncthreads_count(hit);
  }
  return common;
}

// issue_kv for the pair's sequence: K(tk) with its positions, owner mask and per-slot mask
// flags into stage kb, V(tv) into stage vb (positions from the previous call, as there).
template <int D>
__device__ __forceinline__ void issue_kv_pair(const PairTiles& pt, PairCursor& cur,
                                              const CopyPlan<D, kPairThreads>& cp, int n_tiles,
                                              int tk, int kb, int tv, int vb, SmemPair<D>& sm,
                                              int32_t (&pend)[CopyPlan<D, kPairThreads>::kIter]) {
  using Plan = CopyPlan<D, kPairThreads>;
  if (tv >= 0 && tv < n_tiles) copy_rows(cp, cp.v_sa, cp.v_src, vb, pend);
  if (tk < n_tiles) {
    int own, mk0, mk1;
    if (tk < pt.n_union) {
      const int64_t k0 = cur.next(pt, own);
      const int64_t k1 = k0 + kTile < pt.end ? k0 + kTile : pt.end;
#pragma unroll
      for (int i = 0; i < Plan::kIter; ++i) {
        const int64_t kp = k0 + cp.j0 + i * Plan::kRowsPer;
        pend[i] = kp < k1 ? int32_t(kp) : -1;
      }
      mk0 = k0 + kTile > pt.tl[0].cta_end || k0 + kTile - 1 > pt.base[0];
      mk1 = k0 + kTile > pt.tl[1].cta_end || k0 + kTile - 1 > pt.base[1];
    } else {  // a column tile of one slot (selects, not an indexed pick: no local memory)
      const bool w1 = tk - pt.n_union >= pt.n_ct0;
      const int32_t* col = w1 ? pt.tl[1].ci : pt.tl[0].ci;
      const int n_cols = w1 ? pt.tl[1].n_cols : pt.tl[0].n_cols;
      const int c0 = (tk - pt.n_union - (w1 ? pt.n_ct0 : 0)) * kTile;
#pragma unroll
      for (int i = 0; i < Plan::kIter; ++i) {
        const int ci = c0 + cp.j0 + i * Plan::kRowsPer;
        pend[i] = ci < n_cols ? col[ci] : -1;
      }
      own = w1 ? 2 : 1;
      const int last = c0 + kTile - 1;
      const int m = last >= n_cols || int64_t(col[last]) > (w1 ? pt.base[1] : pt.base[0]);
      mk0 = w1 ? 0 : m;
      mk1 = w1 ? m : 0;
    }
    if (threadIdx.x % Plan::kVec == 0) {
#pragma unroll
      for (int i = 0; i < Plan::kIter; ++i) sm.pos[kb][cp.j0 + i * Plan::kRowsPer] = pend[i];
    }
    if (threadIdx.x == 0) {
      sm.own[kb] = own;
      sm.masked[kb][0] = mk0;
      sm.masked[kb][1] = mk1;
    }
    copy_rows(cp, cp.k_sa, cp.k_src, kb, pend);
  }
  cp_async_commit();
}

// The pair mainloop. Tile t sits in stage t % S (K and V alike). Iteration t waits for the copy
// group holding K(t) and V(t - 1), issues S(t) (when the warpgroup owns t) and P V of its
// previous tile (when it owned t - 1) back to back, then the copies of K(t + S - 1) and
// V(t + S - 2) into the stages S(t - 1) and P(t - 2) V(t - 2) read (both landed in iteration
// t - 1, before this iteration's barrier), then runs tile t's softmax while that P V is on the
// tensor cores.
template <int D>
__device__ __forceinline__ void attention_sparse_bf16_pair_block(
    const AttentionSparseBf16Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D == 64 || D == 128, "wgmma mainloop: head_dim 64 or 128");
  constexpr int S = kPairStages;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  SmemPair<D>& sm = *reinterpret_cast<SmemPair<D>*>(
      smem_raw + ((kSwAlign - (sa & (kSwAlign - 1))) & (kSwAlign - 1)));
  const int h = blockIdx.y;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  const int wg = threadIdx.x / kThreads;  // the warpgroup's slot in the pair
  const int warp = (threadIdx.x / 32) % kWarps, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  // Later pairs first; slot 1 is the later block, slot 0 (missing for an odd count) the earlier.
  const int64_t qb1 = p.n_qblocks - 1 - 2 * int64_t(blockIdx.x);
  const SlotGeom sg[2] = {slot_geom_at(p, qb1 - 1), slot_geom_at(p, qb1)};
  PairTiles pt;
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    pt.tl[w] = slot_tiles(p, h, sg[w]);
    pt.base[w] = sg[w].base;
  }
  pt.end = sg[0].cta_end > sg[1].cta_end ? sg[0].cta_end : sg[1].cta_end;
  pt.n_union = pt.tl[0].n_block_tiles + pt.tl[1].n_block_tiles - pair_common_blocks(pt);
  pt.n_ct0 = (pt.tl[0].n_cols + kTile - 1) / kTile;
  const SlotGeom mine = wg ? sg[1] : sg[0];
  RowState<D> st;
  row_state_init<D>(p, warp, g, mine.rows, mine.base, st);
  const float scale_log2 = p.scale * kLog2e;
  const int n_tiles = pt.count();
  if (n_tiles > 0) {
    const CopyPlan<D, kPairThreads> cp(p, sm.k[0], sm.v[0], kv_head);
    PairCursor cur(pt);
    int32_t pend[CopyPlan<D, kPairThreads>::kIter];
    issue_kv_pair<D>(pt, cur, cp, n_tiles, 0, 0, -1, 0, sm, pend);  // K(0)
    uint32_t qa[D / 16][4];
    load_q_fragments<D>(p, h, mine, warp, g, tq, qa);
#pragma unroll
    for (int i = 1; i <= S - 2; ++i)  // V(i - 1), K(i)
      issue_kv_pair<D>(pt, cur, cp, n_tiles, i, i, i - 1, i - 1, sm, pend);

    float s[kTile / 8][4];
    uint32_t pa[kTile / 16][4];
    float alpha[2];
    bool pv_pending = false;  // P V of this warpgroup's last tile (t - 1) not yet issued
    for (int t = 0; t < n_tiles; ++t) {
      const int b = t % S, bv = (t + S - 1) % S;  // stages of K(t) and V(t - 1)
      cp_async_wait<S - 2>();
      fence_proxy_async();
      __syncthreads();
      // Warp-uniform by construction; through a shuffle the compiler knows it too, so the
      // wgmma issues under it are not serialized as a divergent path's would be.
      const bool own = __shfl_sync(0xffffffffu, (sm.own[b] >> wg) & 1, 0);
      const auto copies = [&] {
        issue_kv_pair<D>(pt, cur, cp, n_tiles, t + S - 1, (t + S - 1) % S, t + S - 2,
                         (t + S - 2) % S, sm, pend);
      };
      // Four straight paths, each landing every product it issues: a product in flight where
      // paths join makes the compiler serialize all of them (ptxas C7518).
      if (own && pv_pending) {
        issue_s<D>(s, qa, sm.k[b]);
        issue_pv<D>(st, pa, sm.v[bv]);
        copies();
        wgmma_wait<1>();  // S(t) done; the P V may still run
        fence_regs(s);
        softmax_tile<D>(s, sm.masked[b][wg] ? sm.pos[b] : nullptr, scale_log2, tq, st, alpha);
        wgmma_wait<0>();
        fence_regs(st.o);
      } else if (own) {
        issue_s<D>(s, qa, sm.k[b]);
        copies();
        wgmma_wait<0>();
        fence_regs(s);
        softmax_tile<D>(s, sm.masked[b][wg] ? sm.pos[b] : nullptr, scale_log2, tq, st, alpha);
      } else if (pv_pending) {
        issue_pv<D>(st, pa, sm.v[bv]);
        copies();
        wgmma_wait<0>();
        fence_regs(st.o);
      } else {
        copies();
      }
      if (own) {
        rescale_o<D>(alpha, st);
        // pa is an operand of the product that just landed: rewritten only now.
#pragma unroll
        for (int kk = 0; kk < kTile / 16; ++kk) p_fragment(s, kk, pa[kk]);
      }
      pv_pending = own;
    }
    cp_async_wait<0>();  // V(n_tiles - 1)
    fence_proxy_async();
    __syncthreads();
    if (pv_pending) {
      issue_pv<D>(st, pa, sm.v[(n_tiles - 1) % S]);
      wgmma_wait<0>();
      fence_regs(st.o);
    }
  }
  store_rows<D>(p, h, mine.r0, mine.rows, warp, g, tq, st);
#else
  __trap();  // built without sm_90a: the launcher never selects this kernel there
#endif
}

}  // namespace attention_sparse_bf16_sm90_detail

template <int D>
__global__ void __launch_bounds__(attention_sparse_bf16_detail::kThreads)
    attention_sparse_bf16_sm90_kernel(const AttentionSparseBf16Params p) {
  attention_sparse_bf16_sm90_detail::attention_sparse_bf16_sm90_block<D>(p);
}

template <int D>
__global__ void __launch_bounds__(attention_sparse_bf16_sm90_detail::kPairThreads, 1)
    attention_sparse_bf16_pair_kernel(const AttentionSparseBf16Params p) {
  attention_sparse_bf16_sm90_detail::attention_sparse_bf16_pair_block<D>(p);
}

template <int D>
cudaError_t attention_sparse_bf16_launch(const AttentionSparseBf16Params& p,
                                         SparseBf16Mainloop mainloop, cudaStream_t stream) {
  using namespace attention_sparse_bf16_sm90_detail;
  if (p.n_q == 0 || p.n_qblocks == 0) return cudaSuccess;
  if (p.n_qblocks > 0x7fffffff || p.n_heads > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(unsigned(p.n_qblocks), unsigned(p.n_heads));
  cudaError_t err = cudaSuccess;
  if (mainloop == SparseBf16Mainloop::kWgmmaPair) {
    constexpr size_t kSmem = sizeof(SmemPair<D>) + kSwAlign;
    static std::atomic<uint64_t> opted{0};
    if ((err = opt_in_smem(attention_sparse_bf16_pair_kernel<D>, kSmem, opted)) != cudaSuccess)
      return err;
    const dim3 pairs(unsigned((p.n_qblocks + 1) / 2), unsigned(p.n_heads));
    attention_sparse_bf16_pair_kernel<D><<<pairs, kPairThreads, kSmem, stream>>>(p);
  } else if (mainloop == SparseBf16Mainloop::kWgmma) {
    constexpr size_t kSmem = sizeof(Smem90<D>) + kSwAlign;  // + slack to align the base
    static std::atomic<uint64_t> opted{0};
    if ((err = opt_in_smem(attention_sparse_bf16_sm90_kernel<D>, kSmem, opted)) != cudaSuccess)
      return err;
    attention_sparse_bf16_sm90_kernel<D><<<grid, kThreads, kSmem, stream>>>(p);
  } else {
    constexpr size_t kSmem = sizeof(Smem<D>);
    static std::atomic<uint64_t> opted{0};
    if ((err = opt_in_smem(attention_sparse_bf16_kernel<D>, kSmem, opted)) != cudaSuccess)
      return err;
    attention_sparse_bf16_kernel<D><<<grid, kThreads, kSmem, stream>>>(p);
  }
  return cudaGetLastError();
}

extern template cudaError_t attention_sparse_bf16_launch<64>(const AttentionSparseBf16Params&,
                                                             SparseBf16Mainloop, cudaStream_t);
extern template cudaError_t attention_sparse_bf16_launch<128>(const AttentionSparseBf16Params&,
                                                              SparseBf16Mainloop, cudaStream_t);

}  // namespace sf::kernels::cuda
