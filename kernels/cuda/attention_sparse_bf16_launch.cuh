// The bf16 sparse attention launcher: runs the mainloop named (kernels/cuda/cuda_ops.h) among
// the mma.sync kernel (attention_sparse_bf16.cuh), the wgmma kernel
// (attention_sparse_bf16_sm90.cuh) and the warp-specialized wgmma kernel
// (attention_sparse_bf16_ws.cuh), and fills the TMA maps.
#pragma once
#include "kernels/cuda/attention_sparse_bf16_ws.cuh"

namespace sf::kernels::cuda {

// Opts Kernel into `smem` bytes of dynamic shared memory (once a device) and launches it.
template <auto Kernel>
cudaError_t attention_sparse_bf16_launch_opted(dim3 grid, unsigned threads, size_t smem,
                                               cudaStream_t stream,
                                               const AttentionSparseBf16Params& p) {
  static SmemOptIn opted;
  if (const cudaError_t err = opt_in_smem(Kernel, smem, opted); err != cudaSuccess) return err;
  Kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t attention_sparse_bf16_launch(const AttentionSparseBf16Params& p,
                                         SparseBf16Mainloop mainloop, cudaStream_t stream) {
  using namespace attention_sparse_bf16_sm90_detail;
  if (p.n_q == 0 || p.n_qblocks == 0) return cudaSuccess;
  if (p.n_qblocks > 0x7fffffff || p.n_heads > 65535) return cudaErrorInvalidConfiguration;
  cudaError_t err = cudaSuccess;
  if (mainloop == SparseBf16Mainloop::kMmaSync)
    return attention_sparse_bf16_launch_opted<attention_sparse_bf16_kernel<D>>(
        dim3(unsigned(p.n_qblocks), unsigned(p.n_heads)), kThreads, sizeof(Smem<D>), stream, p);
  // Both wgmma mainloops load block tiles by TMA. No keys: no slot has a block tile, and the
  // encoder rejects an empty dimension.
  AttentionSparseBf16Params pm = p;
  if (p.n_k > 0 && ((err = encode_kv_map(&pm.tm_k, p.k, p.n_k, p.n_kv_heads, D)) != cudaSuccess ||
                    (err = encode_kv_map(&pm.tm_v, p.v, p.n_k, p.n_kv_heads, D)) != cudaSuccess))
    return err;
  // head_dim 64: the wgmma kernel's three CTAs an SM (0.74-0.81x of SDPA at 128K, eighth
  // session) hold more slots than the warp-specialized kernel's two, which is not measured
  // there: wgmma-ws (and -pair) is built for head_dim 128 only, and 64 runs the wgmma kernel.
  if constexpr (D == 128) {
    namespace ws = attention_sparse_bf16_ws_detail;
    constexpr size_t kSmem = sizeof(ws::SmemWs<D>) + kSwAlign;  // + slack to align the base
    // Paired: a CTA takes two query heads of one KV head at one query block on one pipe
    // (attention_sparse_bf16_ws.cuh). It needs an even number of query heads per KV head.
    // wgmma-ws pairs them where the index says paired heads hold equally many blocks and no
    // columns (pair_heads, known at plan time, so no host sync): a tile one head lacks is
    // computed masked by it, and an adaptive index, whose heads keep different counts, lost
    // 6-17% at 128K paired (bench/NOTES.md).
    const bool pairable = (p.n_heads / p.n_kv_heads) % ws::kSlots == 0;
    if (pairable && (mainloop == SparseBf16Mainloop::kWgmmaWsPair ||
                     (mainloop == SparseBf16Mainloop::kWgmmaWs && p.pair_heads)))
      return attention_sparse_bf16_launch_opted<attention_sparse_bf16_ws_kernel<D, true>>(
          dim3(unsigned(p.n_qblocks), unsigned(p.n_heads / ws::kSlots)), ws::kWsThreads, kSmem,
          stream, pm);
    if (mainloop == SparseBf16Mainloop::kWgmmaWs || mainloop == SparseBf16Mainloop::kWgmmaWsPair ||
        mainloop == SparseBf16Mainloop::kWgmmaWsSingle)
      return attention_sparse_bf16_launch_opted<attention_sparse_bf16_ws_kernel<D, false>>(
          dim3(unsigned((p.n_qblocks + ws::kSlots - 1) / ws::kSlots), unsigned(p.n_heads)),
          ws::kWsThreads, kSmem, stream, pm);
  }
  return attention_sparse_bf16_launch_opted<attention_sparse_bf16_sm90_kernel<D>>(
      dim3(unsigned(p.n_qblocks), unsigned(p.n_heads)), kThreads, sizeof(Smem90<D>) + kSwAlign,
      stream, pm);
}

extern template cudaError_t attention_sparse_bf16_launch<64>(const AttentionSparseBf16Params&,
                                                             SparseBf16Mainloop, cudaStream_t);
extern template cudaError_t attention_sparse_bf16_launch<128>(const AttentionSparseBf16Params&,
                                                              SparseBf16Mainloop, cudaStream_t);

}  // namespace sf::kernels::cuda
