// The bf16 sparse attention kernel on wgmma with warp specialization (FlashAttention-3's split):
// a producer warpgroup copies, two consumer warpgroups compute. Same contract, tile walk
// (TileList), products (issue_s, issue_pv), softmax and epilogue as the wgmma kernel of
// attention_sparse_bf16_sm90.cuh; what differs is who issues the copies and how stages are
// handed over.
//
// Why. The single-warpgroup kernel is issue- and latency-bound (Nsight on H200: no hotspot, IPC
// about 1.5 of 4 at 8 warps an SM), and a gathered-column tile costs each of its threads 16
// cp.async, their addresses and 8 index loads per tile, between the products and the softmax.
// Here those instructions run on other warps, and a stage is handed over by mbarriers instead
// of a CTA-wide barrier per tile.
//
// Work split. A CTA of 384 threads owns two neighbouring (head, 64-query block) slots. Warpgroup
// 0 produces: threads 0-63 for slot 0, 64-127 for slot 1, each half walking its slot's tiles in
// order. Block tiles arrive by TMA (one thread), gathered columns by cp.async from the half's 64
// threads, which then arrive on the stage's "full" mbarrier with cp.async.mbarrier.arrive.noinc
// (the arrival lands when the thread's copies have). Warpgroups 1 and 2 consume slot 0 and 1
// with the wgmma kernel's schedule (S(t + 1) and P(t - 1) V(t - 1) on the tensor cores during
// tile t's softmax); each consumer thread releases a stage on its "empty" mbarrier once the
// product that read it has landed. Registers move to the consumers with setmaxnreg (producer 56,
// consumers 224: 128 * 56 + 256 * 224 = 64,512, the CTA's allocation at launch), one CTA an SM.
// At D = 128 neither role spills (ptxas). The launcher builds it for D = 128 only (D = 64 keeps
// the wgmma kernel's three CTAs an SM); the code is written for both.
//
// Measured on H200 (bench/NOTES.md, thirteenth session), against the wgmma kernel in one run
// with their repeats interleaved: 128K +16% vertical-slash, +10% block-sparse, +9%
// adaptive-block, +12% on a full index, adaptive-vs within the run's noise; 1M +17%, +6%, +24%
// (adaptive-vs), +9%. The default mainloop. Also measured and dropped: one slot a CTA at two
// CTAs an SM (its 64 producer threads on 40 registers lost the column gains), and this kernel
// made persistent with a static round-robin over slots (10-35% slower everywhere). Paired
// (fourteenth session, run 8, against this unpaired kernel in one run): block-sparse +6% at
// 128K, a full index +13%; at 1M block-sparse even (run 9). An adaptive-block index paired
// lost 6-17% at 128K, so the launcher pairs only where SparseIndexDevice::pair_heads holds.
// Also dropped (H100, bench/NOTES.md twenty-first session): launching the query heads of a KV
// head side by side at each query block (24% slower for vertical-slash at 1M), and a CTA's two
// query blocks on one pipe, copying a tile both read once (1.16-1.94x slower in every mode).
//
// Paired (GQA). A CTA may instead own two query heads of one KV head at the same query block,
// on one pipe: the producer walks the union of their sorted block lists and copies a block both
// hold once, then their column tiles in turn. Each tile carries flags: which consumer masks it by
// positions, which does not hold it (it computes it with every score masked: branching around
// the S product makes ptxas serialize the loop's wgmma, and per-step branches around softmax
// and P V cost 15% on a full index), and whether it is the last. Why: at 1M block-sparse was
// L2-bound (Nsight: L2 78%, DRAM 44%, tensor pipe 53%), every query head loading its KV head's
// tiles itself; the query heads of a KV head mostly pick the same blocks.
//
// Stages: unpaired, K and V three each per slot, as the wgmma kernel; paired, six each on the
// one pipe (the same shared memory, as many copies in flight). Positions and flags sit in a ring
// of twice the stages, written with K(t): softmax(t) reads slot t % 2S while K(t + S) may already
// be in flight into tile t's stage.
#pragma once
#include "kernels/cuda/attention_sparse_bf16_sm90.cuh"

namespace sf::kernels::cuda {

namespace attention_sparse_bf16_ws_detail {
using namespace attention_sparse_bf16_sm90_detail;

constexpr int kSlots = 2;                         // consumer warpgroups (slots) per CTA
constexpr int kWsThreads = (kSlots + 1) * kThreads;  // 384
constexpr int kProd = kThreads / kSlots;          // producer threads per slot
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
// setmaxnreg moves registers within the CTA's launch allocation: 384 threads get 168 each
// (65,536 / 384 rounded down to a multiple of 8).
static_assert(kThreads * kProducerRegs + kSlots * kThreads * kConsumerRegs <= 168 * kWsThreads,
              "register split over the CTA's allocation");

// One slot's pipeline. full_k counts 2 arrivals a producer thread (its copies' arrival, or
// TMA's expect_tx / a plain arrival, then a plain arrival that publishes the positions), full_v
// one, empty_* one a consumer thread. S stages of K and V each; positions and flags in 2 S slots.
template <int D, int S>
struct alignas(kSwAlign) WsPipe {
  static constexpr int kS = S;
  SwTile<D> k[S], v[S];
  uint64_t full_k[S], full_v[S], empty_k[S], empty_v[S];
  int32_t pos[2 * S][kTile];
  int32_t masked[2 * S];
};
// Unpaired: a pipe of kStages a slot. Paired: one pipe of twice the stages in the same space,
// so the CTA keeps as many copies in flight for its two consumers as unpaired.
constexpr int kDeepStages = kSlots * kStages;
template <int D>
struct SmemWs {
  union {
    WsPipe<D, kStages> pipe[kSlots];
    WsPipe<D, kDeepStages> deep;
  };
  int32_t none[kTile];  // all -1: the mask of a tile the consumer's slot does not hold (paired)
};
// empty_*: kEmpty arrivals a consumer warpgroup, one a thread: each thread's reads of a stage and
// of its positions come before the producer's rewrite by its own arrival. (One arrival a warp
// after __syncwarp is as correct, but racecheck does not follow that chain and reported every
// reuse of the position ring; as fast at 128K: bench/NOTES.md, sixty-first session.) Paired,
// both consumers release each stage.
constexpr uint32_t kFullK = 2 * kProd, kFullV = kProd, kEmpty = kThreads;

// A tile's flags (WsPipe::masked), written with its K: bit c, consumer c masks by the positions;
// bit 2 + c, consumer c's slot does not hold the tile (every score masked); kLast, no tile
// follows.
constexpr int kSkipShift = 2, kLast = 16;

// Arrives on bar when every cp.async this thread issued before has landed.
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar))
               : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Tile j sits in stage j % S with mbarrier parity (j / S) & 1, positions in slot j % 2S: stepped
// per tile (no divisions).
template <int S>
struct Ring {
  int s3 = 0, s6 = 0, ph = 0;  // stage, position slot, parity
  __device__ __forceinline__ void next() {
    ph ^= s3 == S - 1;
    s3 = s3 == S - 1 ? 0 : s3 + 1;
    s6 = s6 == 2 * S - 1 ? 0 : s6 + 1;
  }
};

// What one producer thread (pt < 64) copies of a gathered-column tile: rows j0 + 8 i (i < 8),
// 16-byte chunk c of each 64-dim column block. Rows 8 apart keep j & 7 == j0: a chunk's swizzled
// place moves by 8 rows (1024 bytes) per i.
template <int D>
struct WsCopy {
  static constexpr int kBlocks = D / 64, kIter = kTile / 8;
  int j0;
  uint32_t k_sa, v_sa;        // shared address of (row j0, chunk c, column block 0) in stage 0
  const char *k_src, *v_src;  // chunk c of kv_head's row 0
  uint32_t row_bytes;

  template <int S>
  __device__ __forceinline__ WsCopy(const AttentionSparseBf16Params& p, const WsPipe<D, S>& pp,
                                    int kv_head, int pt) {
    const int c = pt % 8;
    j0 = pt / 8;
    const int so = sw_offset(j0, c) * int(sizeof(__nv_bfloat16));
    k_sa = smem_u32(&pp.k[0]) + so;
    v_sa = smem_u32(&pp.v[0]) + so;
    k_src = reinterpret_cast<const char*>(p.k + int64_t(kv_head) * D + c * 8);
    v_src = reinterpret_cast<const char*>(p.v + int64_t(kv_head) * D + c * 8);
    row_bytes = uint32_t(p.n_kv_heads) * D * uint32_t(sizeof(__nv_bfloat16));
  }
  // The thread's rows of column tile `ct` (positions, -1 past the slot's columns).
  __device__ __forceinline__ void ids(const TileList& tl, int ct, int32_t (&pos)[kIter]) const {
    const int c0 = ct * kTile + j0;
#pragma unroll
    for (int i = 0; i < kIter; ++i) {
      const int ci = c0 + 8 * i;
      pos[i] = ci < tl.n_cols ? tl.ci[ci] : -1;
    }
  }
  // Copies those rows into the stage at byte offset stage_off of the array at sa0; empty rows
  // are zero-filled (0-probability columns multiply zeros).
  __device__ __forceinline__ void rows(uint32_t sa0, const char* src, uint32_t stage_off,
                                       const int32_t (&pos)[kIter]) const {
#pragma unroll
    for (int i = 0; i < kIter; ++i) {
      const char* s = src + uint64_t(uint32_t(max(pos[i], 0))) * row_bytes;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
        cp_async_16(sa0 + stage_off + i * 8 * 128 + b * kTile * 128, s + b * 128, pos[i] >= 0);
    }
  }
};

// The order in which a pipe's tiles are copied. Unpaired (one slot a pipe): the slot's TileList
// order. Paired (two query heads of one KV head at the same query block share one pipe): the
// union of the two sorted block lists, a block both hold copied once, then the two slots' column
// tiles in turn. own: bit c set when slot c holds the tile.
struct TileSeq {
  struct Tile {
    int32_t k0;  // block tile: its first key
    int list;    // column tile: the slot whose columns, -1 for a block tile
    int ct;      // column tile: its index in that slot's columns
    int own;
  };
  const int32_t *bo0, *bo1;  // the slots' block starts
  int nb0, nb1, nc0, nc1;    // their block tiles and column tiles
  int ia = 0, ib = 0, ca = 0, cb = 0;

  __device__ __forceinline__ TileSeq(const TileList& a, const TileList& b)
      : bo0(a.bo),
        bo1(b.bo),
        nb0(a.n_block_tiles),
        nb1(b.n_block_tiles),
        nc0((a.n_cols + kTile - 1) / kTile),
        nc1((b.n_cols + kTile - 1) / kTile) {}
  __device__ __forceinline__ bool more() const {
    return ia < nb0 || ib < nb1 || ca < nc0 || cb < nc1;
  }
  __device__ __forceinline__ Tile next() {
    Tile t{0, -1, 0, 0};
    if (ia < nb0 || ib < nb1) {
      const int32_t x = ia < nb0 ? bo0[ia] : INT32_MAX;
      const int32_t y = ib < nb1 ? bo1[ib] : INT32_MAX;
      t.k0 = x < y ? x : y;
      t.own = int(x == t.k0) | int(y == t.k0) << 1;
      ia += x == t.k0;
      ib += y == t.k0;
    } else if (ca < nc0 && (ca <= cb || cb >= nc1)) {  // the slots' column tiles alternate
      t.list = 0;
      t.ct = ca++;
      t.own = 1;
    } else {
      t.list = 1;
      t.ct = cb++;
      t.own = 2;
    }
    return t;
  }
};

// a or b, field by field: selecting whole structs puts both in local memory.
__device__ __forceinline__ TileList pick_list(const TileList& a, const TileList& b, bool second) {
  return {second ? b.bo : a.bo, second ? b.ci : a.ci, second ? b.n_block_tiles : a.n_block_tiles,
          second ? b.n_cols : a.n_cols, second ? b.cta_end : a.cta_end};
}

// The producer half of one pipe: K(0), then K(t + 1) and V(t) for every t, each into its stage
// once the consumer has released it (parity ph ^ 1: a fresh barrier's previous phase counts as
// complete, so the first pass over the stages does not wait). A column tile's ids are loaded
// again for its V (L1 hits) rather than kept in the producer's few registers. Unpaired, the
// tiles are tl0's in its order and counted (tl1 unused): the TileSeq walk and per-tile last
// flags there cost the unpaired kernel 5-18% (bench/NOTES.md, fourteenth session, run 7).
template <int D, int S, bool kPair>
__device__ __forceinline__ void produce(const AttentionSparseBf16Params& p, const TileList& tl0,
                                        const TileList& tl1, int64_t base, int kv_head, int pt,
                                        WsPipe<D, S>& pp) {
  using Copy = WsCopy<D>;
  static_assert(kProd == kTile, "a block tile's positions: one producer thread a row");
  constexpr uint32_t kStageBytes = sizeof(SwTile<D>);
  const Copy cp(p, pp, kv_head, pt);
  Ring<S> rk, rv;
  // After the wait for the stage: flags (thread 0), positions, the copies, the arrivals. A
  // tile's ids (or block start) are loaded before that wait: their latency (an L2 or HBM round
  // trip) then overlaps the consumer's use of the stage.
  auto fill_k = [&](bool block, int32_t k0, const int32_t(&pk)[Copy::kIter], int flags) {
    const int s = rk.s3, slot = rk.s6;
    mbar::wait(&pp.empty_k[s], rk.ph ^ 1);
    if (pt == 0) pp.masked[slot] = flags;
    if (block) {
      pp.pos[slot][pt] = pt < int32_t(tl0.cta_end - k0) ? k0 + pt : -1;
      if (pt == 0)
        tma_tile<D>(&p.tm_k, &pp.full_k[s], pp.k[s], kv_head, k0);
      else
        mbar::arrive(&pp.full_k[s]);
    } else {
      if (pt % 8 == 0) {
#pragma unroll
        for (int i = 0; i < Copy::kIter; ++i) pp.pos[slot][cp.j0 + 8 * i] = pk[i];
      }
      cp.rows(cp.k_sa, cp.k_src, s * kStageBytes, pk);
      mbar_arrive_cp_async(&pp.full_k[s]);
    }
    mbar::arrive(&pp.full_k[s]);  // publishes the positions and the flags
    rk.next();
  };
  auto fill_v = [&](bool block, int32_t k0, const int32_t(&pv)[Copy::kIter]) {
    const int s = rv.s3;
    mbar::wait(&pp.empty_v[s], rv.ph ^ 1);
    if (block) {
      if (pt == 0)
        tma_tile<D>(&p.tm_v, &pp.full_v[s], pp.v[s], kv_head, k0);
      else
        mbar::arrive(&pp.full_v[s]);
    } else {
      cp.rows(cp.v_sa, cp.v_src, s * kStageBytes, pv);
      mbar_arrive_cp_async(&pp.full_v[s]);
    }
    rv.next();
  };
  if constexpr (!kPair) {
    const TileList& tl = tl0;
    const int n = tl.count();
    // Tile t's source: a block tile's first key, or a column tile's gathered key ids.
    auto source = [&](int t, int32_t& k0, int32_t(&ids)[Copy::kIter]) {
      const bool block = t < tl.n_block_tiles;
      k0 = 0;
      if (block)
        k0 = tl.bo[t];
      else
        cp.ids(tl, t - tl.n_block_tiles, ids);
      return block;
    };
    auto put_k = [&](int t) {
      int32_t pk[Copy::kIter], k0;
      const bool block = source(t, k0, pk);
      fill_k(block, k0, pk, pt == 0 ? tile_needs_mask(tl, t, base) : 0);
    };
    auto put_v = [&](int t) {
      int32_t pv[Copy::kIter], k0;
      const bool block = source(t, k0, pv);
      fill_v(block, k0, pv);
    };
    if (n > 0) put_k(0);
    for (int t = 0; t < n; ++t) {
      if (t + 1 < n) put_k(t + 1);
      put_v(t);
    }
  } else {
    TileSeq sk(tl0, tl1), sv(tl0, tl1);
    auto put_k = [&]() {
      const TileSeq::Tile t = sk.next();
      const bool block = t.list < 0;
      const TileList tl = pick_list(tl0, tl1, t.list == 1);
      int32_t pk[Copy::kIter];
      if (!block) cp.ids(tl, t.ct, pk);
      int f = 0;
      if (pt == 0) {
        const int m = block ? block_tile_needs_mask(t.k0, tl0.cta_end, base)
                            : column_tile_needs_mask(tl, t.ct, base);
        f = sk.more() ? 0 : kLast;
#pragma unroll
        for (int c = 0; c < kSlots; ++c) f |= (t.own >> c & 1) ? m << c : 1 << (kSkipShift + c);
      }
      fill_k(block, t.k0, pk, f);
    };
    auto put_v = [&]() {
      const TileSeq::Tile t = sv.next();
      const bool block = t.list < 0;
      int32_t pv[Copy::kIter];
      if (!block) cp.ids(pick_list(tl0, tl1, t.list == 1), t.ct, pv);
      fill_v(block, t.k0, pv);
    };
    if (sk.more()) put_k();
    while (sv.more()) {
      if (sk.more()) put_k();
      put_v();
    }
  }
  cp_async_wait<0>();  // the thread's last copies land before it exits
}

// Waits for a full stage and makes its generic-proxy (cp.async) writes visible to wgmma.
__device__ __forceinline__ void wait_full(uint64_t* bar, int parity) {
  mbar::wait(bar, uint32_t(parity));
  fence_proxy_async();
}

// The consumer warpgroup of one slot: the wgmma kernel's schedule over the producer's stages.
// Iteration t (tile t's scores in s_cur): waits K(t + 1) and V(t - 1), issues S(t + 1) and
// P(t - 1) V(t - 1), runs softmax(t), waits for both products, then releases their stages.
template <int D, int S, bool kPair>
struct WsConsumer {
  WsPipe<D, S>& pp;
  const int32_t* none;  // all -1
  float scale_log2;
  int tq, c;   // c: the consumer's bit in the flags (0 unpaired)
  Ring<S> r;  // tile t (the current iteration)

  __device__ __forceinline__ bool last() const { return pp.masked[r.s6] & kLast; }

  __device__ __forceinline__ int stage_next() const { return r.s3 == S - 1 ? 0 : r.s3 + 1; }
  __device__ __forceinline__ int stage_prev() const { return r.s3 == 0 ? S - 1 : r.s3 - 1; }

  template <bool kNext, bool kPrev>
  __device__ __forceinline__ void step(const uint32_t (&qa)[D / 16][4],
                                       float (&s_cur)[kTile / 8][4], float (&s_next)[kTile / 8][4],
                                       uint32_t (&pa)[kTile / 16][4], RowState<D>& st) {
    const int sn = stage_next(), sp = stage_prev();
    if constexpr (kNext) {
      wait_full(&pp.full_k[sn], r.ph ^ (r.s3 == S - 1));
      issue_s<D>(s_next, qa, pp.k[sn]);
    }
    if constexpr (kPrev) {
      wait_full(&pp.full_v[sp], r.ph ^ (r.s3 == 0));
      issue_pv<D>(st, pa, pp.v[sp]);
    }
    float alpha[2];
    const int ps = r.s6, f = pp.masked[ps];
    const int32_t* mask;
    if constexpr (kPair)
      mask = f >> (kSkipShift + c) & 1 ? none : (f >> c & 1 ? pp.pos[ps] : nullptr);
    else
      mask = f ? pp.pos[ps] : nullptr;
    softmax_tile<D>(s_cur, mask, scale_log2, tq, st, alpha);
    if constexpr (kNext || kPrev) wgmma_wait<0>();
    if constexpr (kNext) {
      fence_regs(s_next);
      mbar::arrive(&pp.empty_k[sn]);
    }
    if constexpr (kPrev) {
      fence_regs(st.o);
      mbar::arrive(&pp.empty_v[sp]);
    }
    rescale_o<D>(alpha, st);
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) p_fragment(s_cur, kk, pa[kk]);
    r.next();
  }
};

// Consumer c of a pipe (c = 0 unpaired) for slot (h, sg). Unpaired, n is the slot's tile
// count; paired, n > 0 when the pipe has a tile, and the count is not needed up front: each
// tile's flags say whether it is the last, and tile t's are published with K(t), which step
// t - 1 waited for.
template <int D, int S, bool kPair>
__device__ __forceinline__ void consume(const AttentionSparseBf16Params& p, int n,
                                        const SlotGeom& sg, int h, int ctid, int c,
                                        WsPipe<D, S>& pp, const int32_t* none) {
  const int warp = ctid / 32, lane = ctid % 32;
  const int g = lane / 4, tq = lane % 4;
  RowState<D> st;
  row_state_init<D>(p, warp, g, sg.rows, sg.base, st);
  if (n > 0) {
    uint32_t qa[D / 16][4];
    load_q_fragments<D>(p, h, sg, warp, g, tq, qa);
    WsConsumer<D, S, kPair> cs{pp, none, p.scale * kLog2e, tq, c, {}};
    float s0[kTile / 8][4], s1[kTile / 8][4];
    uint32_t pa[kTile / 16][4];
    wait_full(&pp.full_k[0], 0);
    issue_s<D>(s0, qa, pp.k[0]);
    wgmma_wait<0>();
    fence_regs(s0);
    mbar::arrive(&pp.empty_k[0]);
    // Tile t's scores are in s0 for even t, s1 for odd t.
    if constexpr (!kPair) {
      if (n == 1) {
        cs.template step<false, false>(qa, s0, s1, pa, st);
      } else {
        cs.template step<true, false>(qa, s0, s1, pa, st);
        int t = 1;
        for (; t + 2 < n; t += 2) {
          cs.template step<true, true>(qa, s1, s0, pa, st);
          cs.template step<true, true>(qa, s0, s1, pa, st);
        }
        if (t + 1 < n) {
          cs.template step<true, true>(qa, s1, s0, pa, st);
          cs.template step<false, true>(qa, s0, s1, pa, st);
        } else {
          cs.template step<false, true>(qa, s1, s0, pa, st);
        }
      }
    } else if (cs.last()) {
      cs.template step<false, false>(qa, s0, s1, pa, st);
    } else {
      cs.template step<true, false>(qa, s0, s1, pa, st);
      for (;;) {
        if (cs.last()) {
          cs.template step<false, true>(qa, s1, s0, pa, st);
          break;
        }
        cs.template step<true, true>(qa, s1, s0, pa, st);
        if (cs.last()) {
          cs.template step<false, true>(qa, s0, s1, pa, st);
          break;
        }
        cs.template step<true, true>(qa, s0, s1, pa, st);
      }
    }
    // The last tile's P V (the ring now describes the tile past the last).
    const int sp = cs.stage_prev();
    wait_full(&pp.full_v[sp], cs.r.ph ^ (cs.r.s3 == 0));
    issue_pv<D>(st, pa, pp.v[sp]);
    wgmma_wait<0>();
    fence_regs(st.o);
  }
  store_rows<D>(p, h, sg.r0, sg.rows, warp, g, tq, st);
}

// Slot x of the launch (x = kSlots * blockIdx.x + consumer): later query blocks first, as the
// single-slot kernels.
__device__ __forceinline__ SlotGeom slot_geom_at(const AttentionSparseBf16Params& p, int64_t x) {
  SlotGeom sg;
  sg.qb = p.n_qblocks - 1 - x;
  sg.r0 = sg.qb * kQBlock;
  sg.rows = p.n_q - sg.r0 < kQBlock ? p.n_q - sg.r0 : kQBlock;
  sg.base = p.q_offset + sg.r0;
  sg.cta_end = sg.base + sg.rows < p.n_k ? sg.base + sg.rows : p.n_k;
  return sg;
}

// kPair = false: slots (h = blockIdx.y, query blocks 2 blockIdx.x and 2 blockIdx.x + 1 from the
// end), one pipe each. kPair = true (the query heads of a KV head come in pairs): slots (heads
// 2 blockIdx.y and 2 blockIdx.y + 1, the same query block) on one deep pipe, so a block tile
// both heads hold is copied once for them; both consumers walk every stage.
template <int D, bool kPair>
__device__ __forceinline__ void attention_sparse_bf16_ws_block(const AttentionSparseBf16Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D == 64 || D == 128, "wgmma mainloop: head_dim 64 or 128");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t sa = smem_u32(smem_raw);
  SmemWs<D>& sm = *reinterpret_cast<SmemWs<D>*>(
      smem_raw + ((kSwAlign - (sa & (kSwAlign - 1))) & (kSwAlign - 1)));
  const int wg = threadIdx.x / kThreads;
  // Slot c's head and launch index (x: query block n_qblocks - 1 - x).
  auto head_of = [&](int c) { return kPair ? kSlots * int(blockIdx.y) + c : int(blockIdx.y); };
  auto x_of = [&](int c) { return kPair ? int64_t(blockIdx.x) : kSlots * int64_t(blockIdx.x) + c; };
  const int kv_head = head_of(0) / (p.n_heads / p.n_kv_heads);
  auto init = [](auto& pp, uint32_t empty_count) {
    for (int b = 0; b < pp.kS; ++b) {
      mbar::init(&pp.full_k[b], kFullK);
      mbar::init(&pp.full_v[b], kFullV);
      mbar::init(&pp.empty_k[b], empty_count);
      mbar::init(&pp.empty_v[b], empty_count);
    }
  };
  if (threadIdx.x == 0) {
    if constexpr (kPair) {
      init(sm.deep, kSlots * kEmpty);
    } else {
      for (int c = 0; c < kSlots; ++c) init(sm.pipe[c], kEmpty);
    }
    mbar::init_fence();
  }
  if (kPair && threadIdx.x < kTile) sm.none[threadIdx.x] = -1;
  __syncthreads();  // the last CTA-wide barrier: the roles never meet again
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    const int c = int(threadIdx.x) / kProd;
    const int64_t x = x_of(c);
    if (x >= p.n_qblocks) return;
    const SlotGeom sg = slot_geom_at(p, x);
    if constexpr (kPair) {
      if (c == 0)  // one producer half for the shared pipe
        produce<D, kDeepStages, true>(p, slot_tiles(p, head_of(0), sg),
                                      slot_tiles(p, head_of(1), sg), sg.base, kv_head,
                                      int(threadIdx.x), sm.deep);
    } else {
      const TileList tl = slot_tiles(p, head_of(c), sg);
      produce<D, kStages, false>(p, tl, tl, sg.base, kv_head, int(threadIdx.x) % kProd, sm.pipe[c]);
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const int c = wg - 1;
    const int64_t x = x_of(c);
    if (x >= p.n_qblocks) return;
    const SlotGeom sg = slot_geom_at(p, x);
    const int ctid = int(threadIdx.x) - wg * kThreads;
    if constexpr (kPair) {
      const int any =
          slot_tiles(p, head_of(c), sg).count() + slot_tiles(p, head_of(1 - c), sg).count();
      consume<D, kDeepStages, true>(p, any, sg, head_of(c), ctid, c, sm.deep, sm.none);
    } else {
      consume<D, kStages, false>(p, slot_tiles(p, head_of(c), sg).count(), sg, head_of(c), ctid, 0,
                                 sm.pipe[c], sm.none);
    }
  }
#else
  __trap();  // built without sm_90a: the launcher never selects this kernel there
#endif
}

}  // namespace attention_sparse_bf16_ws_detail

template <int D, bool kPair>
__global__ void __launch_bounds__(attention_sparse_bf16_ws_detail::kWsThreads, 1)
    attention_sparse_bf16_ws_kernel(const __grid_constant__ AttentionSparseBf16Params p) {
  attention_sparse_bf16_ws_detail::attention_sparse_bf16_ws_block<D, kPair>(p);
}

}  // namespace sf::kernels::cuda
