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
// Tile t's softmax runs while S(t+1) and P(t-1) V(t-1) are on the tensor cores (see the schedule
// below). K/V tiles sit in three stages; the 2 CTAs that fit per SM (99 KB each at D = 128, 254
// registers) overlap one's softmax with the other's MMAs. Block tiles (64 consecutive keys)
// arrive by TMA, one thread issuing D/64 box loads per tile on a stage's mbarrier; gathered-column
// tiles by cp.async from all 128 threads. Tiles whose keys every row sees (all at or below the
// slot's first row, none empty) skip the mask. The kernel is issue-bound (Nsight on H200: about
// 525 instructions per warp per tile before TMA, half of them copy address math), so the copies'
// instruction count is what the TMA path and the 32-bit copy addresses cut.
// Not yet: a producer warp, ping-pong between warpgroups (FlashAttention-3).
#pragma once
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <atomic>

#include "kernels/cuda/attention_sparse_bf16.cuh"
#include "kernels/cuda/cuda_ops.h"  // SparseBf16Mainloop
#include "kernels/cuda/mbarrier.cuh"  // the TMA loads' mbarriers
#include "kernels/cuda/smem_opt_in.h"

namespace sf::kernels::cuda {

namespace attention_sparse_bf16_sm90_detail {
using namespace attention_sparse_bf16_detail;

// One 64-row operand tile in the 128-byte-swizzled layout: [column block][row][64 elements].
template <int D>
struct SwTile {
  __nv_bfloat16 e[D / 64][kTile][64];
};
constexpr int kStages = 3;  // K and V each (about 99 KB at D = 128: two CTAs per SM)
// Tile t's mask data sits in slot t % kPosSlots: softmax(t) reads it in the iteration whose
// copies already fill K stage t % kStages with tile t + kStages.
constexpr int kPosSlots = 2 * kStages;
template <int D>
struct Smem90 {
  SwTile<D> k[kStages], v[kStages];
  uint64_t bar_k[kStages], bar_v[kStages];  // mbarriers of the stages' TMA loads
  int32_t pos[kPosSlots][kTile];            // key position of tile row j, -1 when empty
  int32_t masked[kPosSlots];                // 1 when some key of the tile is hidden from some row
};
constexpr uint32_t kSwAlign = 1024;  // a swizzle atom (8 rows x 128 bytes)

// Element offset of 16-byte chunk c (8 elements, c < D/8) of row r.
__device__ __forceinline__ int sw_offset(int r, int c) {
  return (c >> 3) * (kTile * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (all >> 4), layout type 1 in bits 62-63. Atoms are 1024-aligned: base offset 0.
__device__ __forceinline__ uint64_t sw128_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = smem_u32(smem);
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
// One 64-row tile of a [n_k, n_kv_heads, D] tensor by TMA: D / 64 boxes of 64 dims x 64 rows
// into the tile's column blocks (the box layout is the tile's 128-byte swizzle), completing on
// bar, which expects the tile's bytes. Rows past n_k arrive as zeros.
template <int D>
__device__ __forceinline__ void tma_tile(const CUtensorMap* map, uint64_t* bar, SwTile<D>& dst,
                                         int kv_head, int32_t row0) {
  mbar::arrive_expect_tx(bar, sizeof(SwTile<D>));
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem_u32(&dst.e[cb][0][0])),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(cb * 64), "r"(kv_head), "r"(row0),
        "r"(smem_u32(bar))
        : "memory");
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
// key past the slot's first row (base). Block tile at k0; column tile ct.
__device__ __forceinline__ int block_tile_needs_mask(int64_t k0, int64_t cta_end, int64_t base) {
  return k0 + kTile > cta_end || k0 + kTile - 1 > base;
}
__device__ __forceinline__ int column_tile_needs_mask(const TileList& tl, int ct, int64_t base) {
  const int last = ct * kTile + kTile - 1;
  return last >= tl.n_cols || int64_t(tl.ci[last]) > base;
}
__device__ __forceinline__ int tile_needs_mask(const TileList& tl, int t, int64_t base) {
  if (t < tl.n_block_tiles) return block_tile_needs_mask(tl.bo[t], tl.cta_end, base);
  return column_tile_needs_mask(tl, t - tl.n_block_tiles, base);
}

// What one thread copies of a gathered-column tile, fixed for the CTA: 16-byte chunk c of rows
// j0 + i * kRowsPer, i < kIter. Since kRowsPer is a multiple of 8, j & 7 == j0 & 7: the chunk's
// swizzled place moves by a constant kRowsPer rows per i.
template <int D>
struct CopyPlan {
  static constexpr int kVec = D / 8, kRowsPer = kThreads / kVec, kIter = kTile / kRowsPer;
  static_assert(kRowsPer % 8 == 0, "rows per pass must keep j & 7 fixed");
  int j0;
  uint32_t k_sa, v_sa;        // shared address of (row j0, chunk c) in stage 0
  const char *k_src, *v_src;  // chunk c of kv_head's row 0
  uint32_t row_bytes;         // between key rows (n_kv_heads * D * 2 < 2^32; rows < 2^31)

  // k0, v0: stage 0 of the K and V tile arrays.
  __device__ __forceinline__ CopyPlan(const AttentionSparseBf16Params& p, const SwTile<D>& k0,
                                      const SwTile<D>& v0, int kv_head) {
    const int c = threadIdx.x % kVec;
    j0 = threadIdx.x / kVec;
    const int so = sw_offset(j0, c) * int(sizeof(__nv_bfloat16));
    k_sa = smem_u32(&k0) + so;
    v_sa = smem_u32(&v0) + so;
    k_src = reinterpret_cast<const char*>(p.k + int64_t(kv_head) * D + c * 8);
    v_src = reinterpret_cast<const char*>(p.v + int64_t(kv_head) * D + c * 8);
    row_bytes = uint32_t(p.n_kv_heads) * D * uint32_t(sizeof(__nv_bfloat16));
  }
};

// The thread's rows of a gathered K or V tile (positions pos, -1 empty) into the stage at byte
// offset stage_off of the array at sa0. The mainloop is issue-bound, so a row's address is one
// 32 x 32 + 64-bit multiply-add (positions and row bytes are 32-bit).
template <int D>
__device__ __forceinline__ void copy_rows(const CopyPlan<D>& cp, uint32_t sa0, const char* src,
                                          uint32_t stage_off,
                                          const int32_t (&pos)[CopyPlan<D>::kIter]) {
  constexpr uint32_t kStepBytes = CopyPlan<D>::kRowsPer * 64 * sizeof(__nv_bfloat16);
#pragma unroll
  for (int i = 0; i < CopyPlan<D>::kIter; ++i)
    cp_async_16(sa0 + stage_off + i * kStepBytes,
                src + uint64_t(uint32_t(max(pos[i], 0))) * cp.row_bytes, pos[i] >= 0);
}

// One commit group: the V rows of tile tv (when 0 <= tv < n_tiles) into V stage vb, and the K
// rows of tile tk (when tk < n_tiles) into K stage kb, with their positions (for the softmax
// mask) and mask flag into slot ps. Block tiles go by TMA (thread 0), their positions written by
// threads 0..63; such a tile's rows past the causal limit arrive as the real keys there (zeros
// past n_k), which the mask hides: their probabilities are exactly 0, so K/V rows below n_k must
// be finite (they are computed keys in every caller). Gathered columns go by cp.async from every
// thread; a thread copies the same rows of every tile, so the positions of V(tv) are the ones it
// looked up when it copied K(tv): the caller keeps them (vpos; pend takes K(tk)'s, and is left
// unset for block tiles, whose V goes by TMA). Their empty rows are zero-filled.
template <int D>
__device__ __forceinline__ void issue_kv(const AttentionSparseBf16Params& p, const TileList& tl,
                                         const CopyPlan<D>& cp, int n_tiles, int kv_head, int tk,
                                         int kb, int ps, int tv, int vb, int64_t base,
                                         Smem90<D>& sm, const int32_t (&vpos)[CopyPlan<D>::kIter],
                                         int32_t (&pend)[CopyPlan<D>::kIter]) {
  using Plan = CopyPlan<D>;
  constexpr uint32_t kStageBytes = sizeof(SwTile<D>);
  if (tv >= 0 && tv < n_tiles) {
    if (tv < tl.n_block_tiles) {
      if (threadIdx.x == 0) tma_tile<D>(&p.tm_v, &sm.bar_v[vb], sm.v[vb], kv_head, tl.bo[tv]);
    } else {
      copy_rows(cp, cp.v_sa, cp.v_src, vb * kStageBytes, vpos);
    }
  }
  if (tk < n_tiles) {
    if (tk < tl.n_block_tiles) {  // a key block: consecutive positions, clipped causally
      // Rows past the causal limit arrive (real keys, or zeros past n_k) but are masked by
      // position. 32-bit: positions are below n_k <= INT32_MAX.
      const int32_t k0 = tl.bo[tk];
      if (threadIdx.x < kTile) {
        const int32_t j = int32_t(threadIdx.x);
        sm.pos[ps][j] = j < int32_t(tl.cta_end - k0) ? k0 + j : -1;
      }
      if (threadIdx.x == 0) {
        sm.masked[ps] = tile_needs_mask(tl, tk, base);
        tma_tile<D>(&p.tm_k, &sm.bar_k[kb], sm.k[kb], kv_head, k0);
      }
    } else {  // gathered columns
      const int c0 = (tk - tl.n_block_tiles) * kTile + cp.j0;
#pragma unroll
      for (int i = 0; i < Plan::kIter; ++i) {
        const int ci = c0 + i * Plan::kRowsPer;
        pend[i] = ci < tl.n_cols ? tl.ci[ci] : -1;
      }
      if (threadIdx.x % Plan::kVec == 0) {
#pragma unroll
        for (int i = 0; i < Plan::kIter; ++i) sm.pos[ps][cp.j0 + i * Plan::kRowsPer] = pend[i];
      }
      if (threadIdx.x == 0) sm.masked[ps] = tile_needs_mask(tl, tk, base);
      copy_rows(cp, cp.k_sa, cp.k_src, kb * kStageBytes, pend);
    }
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

// Schedule. The tensor cores get two products per softmax: iteration t issues S(t + 1) =
// Q K(t + 1)^T and O += P(t - 1) V(t - 1) back to back, then the copies, then runs tile t's
// softmax (its S landed in iteration t - 1) while both products run; O is rescaled by tile t's
// factor once they land (P(t - 1) is relative to the old max, so that is exact). Scores
// alternate between two register sets (S(t + 1) is written while tile t's are read). Tile j's K
// and V sit in stage j % kStages; iteration t's copy group holds K(t + kStages) (into the stage
// S(t) read, landed in iteration t - 1) and V(t + kStages - 2) (into the stage P(t - 2) V(t - 2)
// read, likewise). Iteration t waits for the group of iteration t + 1 - kStages, which holds
// both K(t + 1) and V(t - 1).

template <int D>
struct Sm90Loop {
  using Plan = CopyPlan<D>;
  const AttentionSparseBf16Params& p;
  const TileList& tl;
  const Plan& cp;
  Smem90<D>& sm;
  int n_tiles;
  int64_t base;
  float scale_log2;
  int tq, kv_head;
  int32_t pk1[Plan::kIter], pk2[Plan::kIter];  // K positions copied one and two groups ago
  // t % kStages, t % kPosSlots and (t / kStages) & 1 of the current iteration t, stepped (no
  // divisions per tile). Block tiles come first in the list, so the j-th use of a stage's
  // mbarrier is always tile j * 3 + stage: a tile's TMA phase is (t / 3) & 1.
  int r3, r6, ph;
  static_assert(kStages == 3 && kPosSlots == 6, "the stage arithmetic below assumes 3 stages");

  __device__ __forceinline__ int stage_next() const { return r3 == 2 ? 0 : r3 + 1; }
  __device__ __forceinline__ int stage_prev() const { return r3 == 0 ? 2 : r3 - 1; }
  __device__ __forceinline__ void advance() {
    ph ^= r3 == 2;
    r3 = stage_next();
    r6 = r6 == 5 ? 0 : r6 + 1;
  }
  // Waits for the TMA loads of K(t + 1) and V(t - 1) where they are block tiles.
  __device__ __forceinline__ void wait_tma(int t, bool next, bool prev) {
    if (next && t + 1 < tl.n_block_tiles) mbar::wait(&sm.bar_k[stage_next()], ph ^ (r3 == 2));
    if (prev && t - 1 < tl.n_block_tiles) mbar::wait(&sm.bar_v[stage_prev()], ph ^ (r3 == 0));
  }

  // The copy group of iteration i (i >= -kStages): K(i + kStages) into stage i % 3 (pos slot
  // (i + 3) % 6), V(i + kStages - 2) into stage (i + 1) % 3; i is the current iteration (r3,
  // r6) or, in the prologue, the stages are passed directly.
  __device__ __forceinline__ void copies(int i) {
    copies_at(i, r3, r6 >= 3 ? r6 - 3 : r6 + 3, stage_next());
  }
  __device__ __forceinline__ void copies_at(int i, int kb, int ps, int vb) {
    int32_t pk[Plan::kIter];
    issue_kv<D>(p, tl, cp, n_tiles, kv_head, i + kStages, kb, ps, i + kStages - 2, vb, base, sm,
                pk2, pk);
#pragma unroll
    for (int j = 0; j < Plan::kIter; ++j) {
      pk2[j] = pk1[j];
      pk1[j] = pk[j];
    }
  }

  // Iteration t: kNext when tile t + 1 exists, kPrev when tile t - 1 does. Every product issued
  // here lands here: one in flight where paths join makes the compiler serialize all of them
  // (ptxas C7518).
  template <bool kNext, bool kPrev>
  __device__ __forceinline__ void step(int t, const uint32_t (&qa)[D / 16][4],
                                       float (&s_cur)[kTile / 8][4], float (&s_next)[kTile / 8][4],
                                       uint32_t (&pa)[kTile / 16][4], RowState<D>& st) {
    cp_async_wait<kStages - 2>();
    wait_tma(t, kNext, kPrev);
    fence_proxy_async();
    __syncthreads();  // K(t + 1), V(t - 1) landed for every thread; S(t) and P V(t - 2) done
    if constexpr (kNext) issue_s<D>(s_next, qa, sm.k[stage_next()]);
    if constexpr (kPrev) issue_pv<D>(st, pa, sm.v[stage_prev()]);
    copies(t);
    float alpha[2];
    const int ps = r6;
    softmax_tile<D>(s_cur, sm.masked[ps] ? sm.pos[ps] : nullptr, scale_log2, tq, st, alpha);
    if constexpr (kNext || kPrev) wgmma_wait<0>();
    if constexpr (kNext) fence_regs(s_next);
    if constexpr (kPrev) fence_regs(st.o);
    rescale_o<D>(alpha, st);
    // pa is an operand of the product that just landed: rewritten only now.
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) p_fragment(s_cur, kk, pa[kk]);
    advance();
  }
};

template <int D>
__device__ __forceinline__ void attention_sparse_bf16_sm90_block(
    const AttentionSparseBf16Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D == 64 || D == 128, "wgmma mainloop: head_dim 64 or 128");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sa = smem_u32(smem_raw);
  Smem90<D>& sm = *reinterpret_cast<Smem90<D>*>(
      smem_raw + ((kSwAlign - (sa & (kSwAlign - 1))) & (kSwAlign - 1)));
  const int h = blockIdx.y;
  const int kv_head = h / (p.n_heads / p.n_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const SlotGeom sg = slot_geom(p);
  RowState<D> st;
  row_state_init<D>(p, warp, g, sg.rows, sg.base, st);
  const TileList tl = slot_tiles(p, h, sg);
  const int n = tl.count();
  if (n > 0) {
    const CopyPlan<D> cp(p, sm.k[0], sm.v[0], kv_head);
    if (threadIdx.x == 0) {
      for (int b = 0; b < kStages; ++b) {
        mbar::init(&sm.bar_k[b], 1);
        mbar::init(&sm.bar_v[b], 1);
      }
      mbar::init_fence();
    }
    __syncthreads();
    Sm90Loop<D> lp{p, tl, cp, sm, n, sg.base, p.scale * kLog2e, tq, kv_head, {}, {}, 0, 0, 0};
    lp.copies_at(-3, 0, 0, 1);  // K(0)
    // Q stays in registers (wgmma's A operand) for the whole slot; rows past the slot's end are
    // zero (their results are never stored).
    uint32_t qa[D / 16][4];
    load_q_fragments<D>(p, h, sg, warp, g, tq, qa);
    lp.copies_at(-2, 1, 1, 2);  // K(1)
    lp.copies_at(-1, 2, 2, 0);  // K(2), V(0)
    float s0[kTile / 8][4], s1[kTile / 8][4];
    uint32_t pa[kTile / 16][4];
    cp_async_wait<kStages - 1>();  // K(0)
    if (tl.n_block_tiles > 0) mbar::wait(&sm.bar_k[0], 0);
    fence_proxy_async();
    __syncthreads();
    issue_s<D>(s0, qa, sm.k[0]);
    wgmma_wait<0>();
    fence_regs(s0);
    // Tile t's scores are in s0 for even t, s1 for odd t.
    if (n == 1) {
      lp.template step<false, false>(0, qa, s0, s1, pa, st);
    } else {
      lp.template step<true, false>(0, qa, s0, s1, pa, st);
      int t = 1;
      for (; t + 2 < n; t += 2) {
        lp.template step<true, true>(t, qa, s1, s0, pa, st);
        lp.template step<true, true>(t + 1, qa, s0, s1, pa, st);
      }
      if (t + 1 < n) {  // t = n - 2
        lp.template step<true, true>(t, qa, s1, s0, pa, st);
        lp.template step<false, true>(t + 1, qa, s0, s1, pa, st);
      } else {  // t = n - 1
        lp.template step<false, true>(t, qa, s1, s0, pa, st);
      }
    }
    // The last tile's P V: V(n - 1) is in the group of iteration n + 1 - kStages (r3, ph now
    // describe iteration n).
    cp_async_wait<0>();
    lp.wait_tma(n, false, true);
    fence_proxy_async();
    __syncthreads();
    issue_pv<D>(st, pa, sm.v[lp.stage_prev()]);  // the loop left r3 at n % 3
    wgmma_wait<0>();
    fence_regs(st.o);
  }
  store_rows<D>(p, h, sg.r0, sg.rows, warp, g, tq, st);
#else
  __trap();  // built without sm_90a: the launcher never selects this kernel there
#endif
}

}  // namespace attention_sparse_bf16_sm90_detail

template <int D>
// head_dim 64: three CTAs an SM (168 registers, no spills; about 51 KB of shared memory each)
// instead of the two its unbounded 222 registers allowed. Four would spill.
__global__ void __launch_bounds__(attention_sparse_bf16_detail::kThreads, D == 64 ? 3 : 1)
    attention_sparse_bf16_sm90_kernel(const __grid_constant__ AttentionSparseBf16Params p) {
  attention_sparse_bf16_sm90_detail::attention_sparse_bf16_sm90_block<D>(p);
}

// The TMA map of a [n_k, n_kv_heads, d] bf16 tensor as the wgmma mainloop reads it (dims
// innermost first; 64-dim x 1-head x 64-row boxes, 128-byte swizzle, zeros past n_k). The driver's
// encoder is looked up once through the runtime (no libcuda link). Host-only, no device work:
// safe while a stream is being captured.
inline cudaError_t encode_kv_map(CUtensorMap* map, const void* base, int64_t n_k, int n_kv_heads,
                                 int d) {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> encode{nullptr};
  PFN_cuTensorMapEncodeTiled_v12000 fn = encode.load(std::memory_order_acquire);
  if (fn == nullptr) {
    void* sym = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &sym, 12000,
                                                           cudaEnableDefault, &q);
    if (e != cudaSuccess) return e;
    if (q != cudaDriverEntryPointSuccess || sym == nullptr) return cudaErrorNotSupported;
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(sym);
    encode.store(fn, std::memory_order_release);
  }
  const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(n_kv_heads), cuuint64_t(n_k)};
  const cuuint64_t strides[2] = {cuuint64_t(d) * 2, cuuint64_t(n_kv_heads) * cuuint64_t(d) * 2};
  const cuuint32_t box[3] = {64, 1, 64}, elem_strides[3] = {1, 1, 1};
  const CUresult r =
      fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box,
         elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace sf::kernels::cuda
